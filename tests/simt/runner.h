// jitmarlin tests — the C entry points of a SIMT-emulator library (included last by the generated source, after
// its table `kSimtKernels` of {name, trampoline}).
#pragma once

#include <map>

static std::map<void*, std::pair<void*, size_t>>& simt_maps();

extern "C" {

// Launch kernel `name` on the emulator: a 1-D grid of `grid` CTAs of `threads` threads, clusters of `cluster`
// CTAs along x, `dyn` bytes of dynamic shared memory; params / extra: its parameters (extra: the second one, or
// null). regions: (address, bytes) pairs of the global buffers the
// kernel may read through the checked wrappers; dependent: (address, bytes) pairs of the buffers the kernel before
// it may still use (a launch with programmatic dependent launch: touched only after griddepcontrol.wait), each in
// memory from simt_alloc (whose pages hold nothing else); pdl_flags (2 ints, or null): whether the kernel after
// this one could start before this one waited, whether no thread waited at all. Returns 0, or 1 with the error in
// err.
int simt_run(const char* name, unsigned grid, unsigned threads, int cluster, unsigned long long dyn,
             const void* params, const void* extra, const unsigned long long* regions, int nregions,
             const unsigned long long* dependent, int ndependent, unsigned seed, char* err, int errlen,
             int* pdl_flags) {
  auto spans = [](const unsigned long long* v, int n) {
    std::vector<jm_simt::Region> rs;
    for (int i = 0; i < n; i++)
      rs.push_back(jm_simt::Region{static_cast<uintptr_t>(v[2 * i]), static_cast<uintptr_t>(v[2 * i] + v[2 * i + 1])});
    return rs;
  };
  const std::vector<jm_simt::Region> deps = spans(dependent, ndependent);
  for (const jm_simt::Region& d : deps) {  // whole pages of one simt_alloc buffer, never its guard page
    bool ok = false;
    for (const auto& m : simt_maps()) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(m.second.first);
      ok = ok || (d.lo >= base && d.hi <= base + m.second.second - static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)));
    }
    if (!ok) {
      snprintf(err, errlen, "a dependent buffer at %p is not memory from simt_alloc", reinterpret_cast<void*>(d.lo));
      return 1;
    }
  }
  for (const SimtKernel& k : kSimtKernels) {
    if (strcmp(k.name, name) != 0) continue;
    const std::vector<jm_simt::Region> rs = spans(regions, nregions);
    const std::string e = jm_simt::run(k.fn, params, extra, uint3{grid, 1, 1}, uint3{threads, 1, 1}, cluster,
                                       static_cast<size_t>(dyn), rs.data(), nregions, seed, deps.data(), ndependent,
                                       pdl_flags);
    snprintf(err, errlen, "%s", e.c_str());
    return e.empty() ? 0 : 1;
  }
  snprintf(err, errlen, "no kernel named %s in this library", name);
  return 1;
}

// The emulator's float -> fp16 / bf16 rounding (and back), for the test that compares it with PyTorch's.
void simt_round(const float* x, uint16_t* out, float* back, int n, int bf16) {
  for (int i = 0; i < n; i++) {
    out[i] = bf16 ? jm_simt::f32_to_bf16(x[i]) : jm_simt::f32_to_f16(x[i]);
    back[i] = bf16 ? jm_simt::bf16_to_f32(out[i]) : jm_simt::f16_to_f32(out[i]);
  }
}

}  // extern "C"

// `bytes` of memory, 16-byte aligned, followed by a PROT_NONE page after at most 15 bytes of padding: a kernel
// reading or writing past the end of a buffer copied there stops with SIGSEGV instead of reading a neighbour.
static std::map<void*, std::pair<void*, size_t>>& simt_maps() {
  static std::map<void*, std::pair<void*, size_t>> m;
  return m;
}

extern "C" {
void* simt_alloc(unsigned long long bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t body = (bytes + page - 1) / page * page, total = body + page;
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  mprotect(static_cast<char*>(base) + body, page, PROT_NONE);
  void* p = static_cast<char*>(base) + body - (bytes + 15) / 16 * 16;
  simt_maps()[p] = {base, total};
  return p;
}
void simt_free(void* p) {
  auto it = simt_maps().find(p);
  if (it == simt_maps().end()) return;
  munmap(it->second.first, it->second.second);
  simt_maps().erase(it);
}
}
