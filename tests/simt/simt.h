// jitmarlin tests — a small SIMT emulator that runs our CUDA kernel sources on the CPU.
//
// Why: the GPU is lent by the session and sometimes not at all; a kernel's index arithmetic, fragment
// layouts, barriers, copy ordering and cluster exchanges can be checked here first, on the real .cuh text. The
// kernel source is compiled by the host C++ compiler with this header in front (CUDA's built-in names defined
// here) and with tests/simt/jm_ptx.cuh and jm_wgmma_ptx.cuh in place of cuda_src's (the PTX wrappers,
// emulated). tests/simt/emu.py copies the sources next to these files, rewrites the shared-memory declarations,
// builds a shared library and launches kernels through simt_run() (runner.h); the tests/test_simt_*.py files use it.
//
// Model:
// - every CUDA thread is a fiber (ucontext) of one OS thread; a fiber runs until it reaches a warp or warpgroup
//   collective (mma.sync, ldmatrix, shuffles, ballot, __syncwarp, wgmma), a CTA or named barrier, a cluster wait
//   or an mbarrier wait; then another runnable fiber of the same CTA is picked at random (seeded), so an order
//   that a missing barrier makes matter shows up in some seed;
// - collectives fire when all threads of the warp (warpgroup) have reached the same one; anything that can never
//   complete (a lane exited, lanes at different collectives, a phase nobody arrives at) is reported as a deadlock;
// - a static __shared__ variable becomes a C++ static that registers itself where it is declared
//   (JM_SIMT_SHARED); the registered variables hold the values of the CTA whose fiber runs, and are swapped
//   when another CTA's fiber is picked, so each CTA has its own copy; dynamic shared memory is one buffer per
//   CTA, 1024-byte aligned, ending at (at most 1023 bytes before) a PROT_NONE page; shared memory starts as 0xFF
//   bytes (NaN as floats), as a GPU gives no initial contents;
// - cp.async copies land only when a cp.async.wait_group asks for their group (a read before that sees the old
//   bytes); bulk copies, TMA boxes and cp.async arrivals on an mbarrier land when a thread waits on that barrier
//   or when nothing else can run; mbarriers count pending arrivals and transaction bytes;
// - global loads through the wrappers are checked against the launch's registered buffers; distributed shared
//   memory stores reach the other CTA's copy; a cluster's CTAs run together, clusters and cluster-less CTAs one
//   after another; a thread that exits counts as arrived at every later cluster-barrier phase;
// - fp16 / bf16 arithmetic rounds to nearest even from an exact (or double) result; mma.sync and wgmma multiply
//   exactly and sum in double, then round to fp32 (hardware sums in another order: compare with a tolerance, as
//   on the GPU); wgmma runs when issued, so its fences and waits order nothing here;
// - programmatic dependent launch (a launch that lets the kernel overlap the one before it): the buffers the
//   kernel before may still read or write (the launch's "dependent" regions: activations, outputs, workspace,
//   routing tables) may be touched only after griddepcontrol.wait. A thread has waited if it executed the wait
//   or synchronized with one that had (a warp collective, a CTA, named, cluster or mbarrier phase that such a
//   thread arrived at); an access through the checked wrappers by a thread that has not stops the launch, and
//   plain loads and stores are caught by keeping those buffers' pages PROT_NONE while such a thread runs.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

// ---- CUDA's qualifiers and built-in types, as the host compiler needs them ----
#define __device__
#define __host__
#define __global__
#define __grid_constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define JM_SIMT_SHARED(var) ::jm_simt::shared_var(&(var), sizeof(var))

struct uint4 {
  uint32_t x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
struct int4 {
  int x, y, z, w;
};
struct int2 {
  int x, y;
};
struct float4 {
  float x, y, z, w;
};
struct float2 {
  float x, y;
};
struct uint3 {
  unsigned x, y, z;
};
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }

namespace jm_simt {

inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// Round to nearest even into IEEE half (from fp32; the callers' values are exact in fp32 or nearly so).
inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) return static_cast<uint16_t>(sign | (ax > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: infinity
  if (ax < 0x38800000u) {                                                 // below 2^-14: subnormal steps of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(bits_f32(ax) * 16777216.0f)));
  }
  uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7FFFFFu) >> 13));
  const uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return static_cast<uint16_t>(sign | h);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(m), -24);
  if (e == 31) return bits_f32(sign | 0x7F800000u | (m << 13));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

}  // namespace jm_simt

struct __half {
  uint16_t bits;
  __half() = default;
  __half(float f) : bits(jm_simt::f32_to_f16(f)) {}
  operator float() const { return jm_simt::f16_to_f32(bits); }
};
typedef __half half;
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(jm_simt::f32_to_bf16(f)) {}
  operator float() const { return jm_simt::bf16_to_f32(bits); }
};

// CUDA's global min / max (integer and float overloads): here one template, in the operands' common type
template <typename A, typename B>
inline typename std::common_type<A, B>::type min(A a, B b) {
  typedef typename std::common_type<A, B>::type C;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <typename A, typename B>
inline typename std::common_type<A, B>::type max(A a, B b) {
  typedef typename std::common_type<A, B>::type C;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// fast-math intrinsics: their exact forms here (the GPU's are within a few ulp)
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float x, float y) { return x / y; }

inline float __half2float(__half h) { return static_cast<float>(h); }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.bits = u;
  return h;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float expf(float x) { return std::exp(x); }
inline float __uint_as_float(uint32_t u) { return jm_simt::bits_f32(u); }
inline uint32_t __float_as_uint(float f) { return jm_simt::f32_bits(f); }
// PTX prmt (default mode): selector nibble i picks byte (sel_i & 7) of {b, a} for result byte i; bit 3 of the
// nibble replicates that byte's sign bit instead.
inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t src = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; i++) {
    const uint32_t s = (sel >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(src >> (8 * (s & 7u))) & 0xFFu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * i);
  }
  return r;
}

namespace jm_simt {

enum class St { Ready, Coll, Bar, ClusterWait, MbarWait, NamedBar, Done };

struct Copy {
  void* dst;
  const void* src;
  bool valid;
  int bytes = 16;  // 4, 8 or 16 (cp.async's copy sizes)
};

struct Thread;
typedef void (*CollFn)(Thread* const* lanes);  // a warp collective, run once with the 32 lanes' state

struct Thread {
  ucontext_t ctx;
  char* stack = nullptr;
  int cta = 0;  // index in the running cluster
  uint3 tid{0, 0, 0};
  St st = St::Ready;
  CollFn coll = nullptr;
  const char* coll_name = "";
  int coll_width = 32;  // threads of the collective: a warp, or a warpgroup (wgmma)
  // a collective's operands, by pointer into the lane's own frame (valid while it waits)
  const void* in[4] = {nullptr, nullptr, nullptr, nullptr};
  void* out = nullptr;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;                 // issued, not yet committed
  int arrivals = 0, waits = 0;            // cluster barrier phases this thread arrived at / waited for
  int wait_phase = -1;
  const void* wait_bar = nullptr;  // the mbarrier this thread waits on (St::MbarWait)
  bool waited = false;             // past griddepcontrol.wait, itself or through a synchronization (see the top)
};

// An mbarrier (PTX ISA, "mbarrier"): a phase completes when its pending arrivals reach zero and its transaction
// count is zero; then the phase bit flips and the arrivals are expected again.
struct Mbar {
  int count = 0, pending = 0, phase = 0;
  long long tx = 0;
  bool hb_open = false, hb_done = false;  // an arrival of the open / last completed phase had waited
};

// An asynchronous operation that lands later (when a thread waits on its barrier, or when no thread can run):
// a bulk copy counting its bytes down on an mbarrier, or a thread's cp.async copies followed by its arrival.
struct AsyncOp {
  int cta;
  const void* bar;
  uint32_t dst;  // bulk copy: encoded shared address
  const void* src;
  uint32_t bytes;
  std::vector<std::pair<uint32_t, Copy>> copies;  // cp.async arrival: (encoded destination, copy)
  bool arrive;
  bool waited = false;  // the issuing thread had waited (programmatic dependent launch)
  bool tma = false;  // a TMA tile load: the descriptor's words (simt format), the box origin
  unsigned long long tmap[8] = {};
  int k0 = 0, row0 = 0;
};

// The emulator's TMA descriptor (what the tests' driver.tensor_map_2d returns in the 128 bytes of a CUtensorMap):
// a 2-D row-major matrix of 2-byte elements, copied in boxes of box_outer rows x box_inner elements into the
// 128-byte swizzle layout, rows or columns outside the matrix as zeros.
enum TensorMapWord { kTmMagic, kTmAddr, kTmInner, kTmOuter, kTmRowBytes, kTmBoxInner, kTmBoxOuter };
constexpr unsigned long long kTensorMapMagic = 0x53494D54544D4150ull;  // "SIMTTMAP"

struct Cta {
  uint3 block{0, 0, 0};
  std::vector<std::vector<uint8_t>> saved;  // its static shared variables while another CTA's are live
  uint8_t* dyn = nullptr;      // its dynamic shared memory (ends at a PROT_NONE page)
  void* map = nullptr;
  size_t map_bytes = 0, dyn_bytes = 0;
  int bar_waiting = 0, done = 0, named_waiting = 0;
  std::vector<int> ready;  // runnable threads (indices into Launch::threads)
  // programmatic dependent launch: a thread executed griddepcontrol.wait; the CTA's first trigger (an explicit
  // launch_dependents, or its exit) came before it had waited
  bool waited_any = false, triggered = false, trigger_early = false;
};

struct Region {
  uintptr_t lo, hi;
};

struct Launch {
  void (*kernel)(const void*, const void*) = nullptr;
  const void* params = nullptr;
  const void* extra = nullptr;  // the kernel's second parameter (the wgmma kernels' TMA descriptor), or null
  int threads_per_cta = 0, cluster = 1;
  uint3 grid{1, 1, 1}, block{1, 1, 1};
  std::vector<Cta> ctas;
  std::vector<Thread> threads;
  std::vector<Region> regions;
  std::vector<std::pair<uint8_t*, size_t>> vars;  // the static shared variables declared so far
  std::vector<int> cluster_arrived;  // per cluster-barrier phase
  std::vector<char> cluster_hb;      // per phase: a thread that had waited arrived at it
  bool phase_done = false;           // an arrival completed a phase: wake its waiters
  std::vector<int> exited_arrivals;  // per exited thread: the cluster phases it had arrived at
  std::vector<char> exited_waited;   // per exited thread: whether it had waited
  std::vector<Region> dependent;     // the previous kernel's buffers (programmatic dependent launch)
  int landing_waited = -1;           // landing an async copy: its issuer's `waited` (else -1: the thread's)
  bool all_early = true;             // every CTA triggered its dependents before waiting (see Cta)
  bool any_wait = false;             // some thread executed griddepcontrol.wait
  std::vector<std::pair<std::pair<int, const void*>, Mbar>> mbars;  // (CTA, address) -> state
  std::vector<AsyncOp> async_ops;
  int loaded = -1;                   // the CTA whose static shared variables are live
  std::string error;
  std::mt19937 rng;
};

inline Launch*& launch() {
  static Launch* l = nullptr;
  return l;
}
inline Thread*& cur() {
  static Thread* t = nullptr;
  return t;
}
inline ucontext_t& sched_ctx() {
  static ucontext_t c;
  return c;
}

// Stop the launch with an error: the calling fiber never resumes.
[[noreturn]] inline void fail(const std::string& msg) {
  Launch* l = launch();
  Thread* t = cur();
  if (l->error.empty()) {
    char where[96];
    snprintf(where, sizeof where, " (block %u,%u thread %u)", l->ctas[t->cta].block.x, l->ctas[t->cta].block.y,
             t->tid.x);
    l->error = msg + where;
  }
  t->st = St::Done;
  swapcontext(&t->ctx, &sched_ctx());
  abort();  // not reached: the scheduler stops at the first error
}

inline void yield_to_scheduler() {
  Thread* t = cur();
  swapcontext(&t->ctx, &sched_ctx());
}

inline bool in_regions(const void* p, size_t bytes) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  for (const Region& r : launch()->regions)
    if (lo >= r.lo && lo + bytes <= r.hi) return true;
  return false;
}

template <typename P>
inline const P* check_global(const P* p, size_t bytes, const char* what) {
  if (!in_regions(p, bytes)) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s: %zu bytes at %p are outside every buffer of the launch", what, bytes,
             static_cast<const void*>(p));
    fail(msg);
  }
  if (reinterpret_cast<uintptr_t>(p) % (bytes > 16 ? 16 : bytes)) fail(std::string(what) + ": misaligned address");
  Launch* l = launch();
  const bool waited = l->landing_waited >= 0 ? l->landing_waited != 0 : cur()->waited;
  if (!waited) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
    for (const Region& r : l->dependent)
      if (lo < r.hi && lo + bytes > r.lo) {
        char msg[200];
        snprintf(msg, sizeof msg, "%s at %p: a buffer of the kernel before (programmatic dependent launch) read "
                 "before griddepcontrol.wait", what, static_cast<const void*>(p));
        fail(msg);
      }
  }
  return p;
}

// ---- programmatic dependent launch: the dependent regions' pages are PROT_NONE while a thread that has not
// waited runs; a fault there is recorded (and the pages opened, so the access completes) and reported when the
// thread stops ----
struct PageSpan {
  uintptr_t lo, hi;  // page-aligned
};
inline std::vector<PageSpan>& dep_pages() {
  static std::vector<PageSpan> v;
  return v;
}
inline volatile bool& dep_guarded() {
  static volatile bool g = false;
  return g;
}
inline volatile uintptr_t& dep_fault() {  // the address of the first recorded access, or 0
  static volatile uintptr_t a = 0;
  return a;
}
inline void dep_guard(bool on) {
  if (dep_guarded() == on) return;
  for (const PageSpan& s : dep_pages())
    mprotect(reinterpret_cast<void*>(s.lo), s.hi - s.lo, on ? PROT_NONE : PROT_READ | PROT_WRITE);
  dep_guarded() = on;
}
inline struct sigaction& dep_old_action() {
  static struct sigaction a;
  return a;
}
inline void dep_on_fault(int sig, siginfo_t* info, void* uctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  if (dep_guarded())
    for (const PageSpan& s : dep_pages())
      if (a >= s.lo && a < s.hi) {
        if (dep_fault() == 0) dep_fault() = a;
        dep_guard(false);  // (mprotect is async-signal-safe) the access runs again and completes
        return;
      }
  sigaction(SIGSEGV, &dep_old_action(), nullptr);  // not ours: the fault repeats under the previous handler
  (void)sig;
  (void)uctx;
}
// Async copies land in a thread's or the scheduler's context: their sources were checked with their issuer's
// state, so the pages open while they copy.
struct DepOpen {
  bool was = dep_guarded();
  DepOpen() { dep_guard(false); }
  ~DepOpen() { dep_guard(was); }
};

inline void griddep_wait() {
  cur()->waited = true;
  launch()->ctas[cur()->cta].waited_any = true;
  launch()->any_wait = true;
  dep_guard(false);
}
// griddepcontrol.launch_dependents: the CTA's first one decides when the dependent may start (conservatively: a
// CTA counts as triggered at the first thread's instruction)
inline void griddep_trigger() {
  Cta& c = launch()->ctas[cur()->cta];
  if (c.triggered) return;
  c.triggered = true;
  c.trigger_early = !cur()->waited;
}

// A static shared variable, registered by every thread that reaches its declaration (the first one fills it
// with 0xFF bytes: it is live for that thread's CTA, the loaded one).
inline void shared_var(void* p, size_t bytes) {
  Launch* l = launch();
  for (const auto& v : l->vars)
    if (v.first == p) return;
  l->vars.emplace_back(static_cast<uint8_t*>(p), bytes);
  memset(p, 0xFF, bytes);
}

// CTA c's copy of static shared variable i while it is not loaded (0xFF bytes until first written).
inline uint8_t* saved_var(Launch* l, int c, size_t i) {
  std::vector<std::vector<uint8_t>>& sv = l->ctas[c].saved;
  if (sv.size() <= i) sv.resize(i + 1);
  if (sv[i].size() != l->vars[i].second) sv[i].assign(l->vars[i].second, 0xFF);
  return sv[i].data();
}

// Shared-memory addresses as 32-bit values (what cvta.to.shared gives a kernel): bits 31-30 the kind (1 static,
// 2 dynamic), bits 29-27 the cluster rank, the rest the offset (static: bits 26-19 the variable, 18-0 the offset).
constexpr uint32_t kStatic = 1u << 30, kDynamic = 2u << 30, kRankShift = 27, kOffMask = (1u << 27) - 1;
constexpr uint32_t kVarShift = 19, kVarOffMask = (1u << 19) - 1;

inline uint32_t encode_smem(const void* p) {
  Launch* l = launch();
  Thread* t = cur();
  const uint8_t* b = static_cast<const uint8_t*>(p);
  const uint32_t rank = static_cast<uint32_t>(t->cta) << kRankShift;
  for (size_t i = 0; i < l->vars.size() && i < 256; i++)
    if (b >= l->vars[i].first && b < l->vars[i].first + l->vars[i].second)
      return kStatic | rank | (static_cast<uint32_t>(i) << kVarShift) | static_cast<uint32_t>(b - l->vars[i].first);
  const Cta& c = l->ctas[t->cta];
  if (b >= c.dyn && b <= c.dyn + c.dyn_bytes) return kDynamic | rank | static_cast<uint32_t>(b - c.dyn);
  fail("a shared-memory address that is not in this CTA's shared memory");
}

// The bytes behind an encoded address, in the CTA it names (live if that CTA is loaded, else its saved copy).
inline uint8_t* decode_smem(uint32_t addr, size_t bytes) {
  Launch* l = launch();
  const int rank = static_cast<int>((addr >> kRankShift) & 7u);
  const uint32_t off = addr & kOffMask;
  if (rank >= static_cast<int>(l->ctas.size())) fail("distributed shared memory: a rank past the cluster");
  Cta& c = l->ctas[rank];
  if (c.done == l->threads_per_cta) fail("distributed shared memory: the target CTA has exited");
  if ((addr & (3u << 30)) == kStatic) {
    const size_t var = off >> kVarShift, voff = off & kVarOffMask;
    if (var >= l->vars.size() || voff + bytes > l->vars[var].second) fail("shared-memory address past its variable");
    return (rank == l->loaded ? l->vars[var].first : saved_var(l, rank, var)) + voff;
  }
  if ((addr & (3u << 30)) == kDynamic) {
    if (off + bytes > c.dyn_bytes) fail("shared-memory address past the dynamic shared memory");
    return c.dyn + off;
  }
  fail("not a shared-memory address");
}

inline uint8_t* dyn_smem() { return launch()->ctas[cur()->cta].dyn; }

// A warp collective: record the operands, wait until the 32 lanes are there; the last one in runs fn for all.
inline void warp_collective(CollFn fn, const char* name, const void* in0, const void* in1, const void* in2,
                            const void* in3, void* out, int width = 32) {
  Thread* t = cur();
  t->coll_width = width;
  t->coll = fn;
  t->coll_name = name;
  t->in[0] = in0, t->in[1] = in1, t->in[2] = in2, t->in[3] = in3;
  t->out = out;
  t->st = St::Coll;
  yield_to_scheduler();
}

inline void syncthreads() {
  Thread* t = cur();
  t->st = St::Bar;
  yield_to_scheduler();
}

// A cluster barrier phase is complete when every thread of the cluster arrived at it or exited before (an exited
// thread counts as arrived at every later phase: the producer warps of jm_gemm.cuh leave after phase 0).
inline bool cluster_phase_complete(Launch* l, int phase) {
  int n = phase < static_cast<int>(l->cluster_arrived.size()) ? l->cluster_arrived[phase] : 0;
  for (int a : l->exited_arrivals) n += a <= phase;
  return n == l->threads_per_cta * static_cast<int>(l->ctas.size());
}
// Whether a thread that had waited (programmatic dependent launch) arrived at the phase, or exited after its
// arrivals (exited threads count as arrived at every later phase).
inline bool cluster_phase_hb(Launch* l, int phase) {
  if (phase < static_cast<int>(l->cluster_hb.size()) && l->cluster_hb[phase]) return true;
  for (size_t i = 0; i < l->exited_arrivals.size(); i++)
    if (l->exited_arrivals[i] <= phase && l->exited_waited[i]) return true;
  return false;
}
inline void cluster_arrive() {
  Launch* l = launch();
  Thread* t = cur();
  const int phase = t->arrivals++;
  if (static_cast<int>(l->cluster_arrived.size()) <= phase) {
    l->cluster_arrived.resize(phase + 1, 0);
    l->cluster_hb.resize(phase + 1, 0);
  }
  l->cluster_arrived[phase]++;
  if (t->waited) l->cluster_hb[phase] = 1;
  if (cluster_phase_complete(l, phase)) l->phase_done = true;
}
inline void cluster_wait() {
  Thread* t = cur();
  const int phase = t->waits++;
  if (phase >= t->arrivals) fail("barrier.cluster.wait without a matching arrive");
  t->wait_phase = phase;
  t->st = St::ClusterWait;
  yield_to_scheduler();
}

inline void cp_async(void* dst, const void* src, bool valid, int bytes = 16) {
  if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async copies 4, 8 or 16 bytes");
  if (reinterpret_cast<uintptr_t>(src) % bytes || reinterpret_cast<uintptr_t>(dst) % bytes)
    fail("cp.async with an address not aligned to its size");
  if (valid) check_global(static_cast<const uint8_t*>(src), bytes, "cp.async source");
  decode_smem(encode_smem(dst), bytes);  // a shared address of this CTA
  cur()->open.push_back(Copy{dst, src, valid, bytes});
}
inline void cp_async_commit() {
  Thread* t = cur();
  t->groups.push_back(t->open);
  t->open.clear();
}
// Complete every committed group but the newest `keep`.
inline void cp_async_wait(int keep) {
  Thread* t = cur();
  DepOpen open;
  while (static_cast<int>(t->groups.size()) > keep) {
    for (const Copy& c : t->groups.front()) {
      if (c.valid) memcpy(c.dst, c.src, c.bytes);
      else memset(c.dst, 0, c.bytes);
    }
    t->groups.erase(t->groups.begin());
  }
}


// ---- mbarriers, bulk copies, named barriers ----
inline Mbar* find_mbar(int cta, const void* bar) {
  for (auto& m : launch()->mbars)
    if (m.first.first == cta && m.first.second == bar) return &m.second;
  return nullptr;
}
inline Mbar& mbar_of(int cta, const void* bar) {
  Mbar* m = find_mbar(cta, bar);
  if (m == nullptr) fail("an mbarrier used before mbarrier.init");
  return *m;
}
inline void mbar_init(const void* bar, int count) {
  if (count < 1) fail("mbarrier.init with a count below 1");
  Launch* l = launch();
  const int cta = cur()->cta;
  Mbar* m = find_mbar(cta, bar);
  if (m == nullptr) {
    l->mbars.emplace_back(std::make_pair(cta, bar), Mbar());
    m = &l->mbars.back().second;
  }
  *m = Mbar();
  m->count = m->pending = count;
}
// A phase completes: flip it, expect the arrivals again, wake the threads that wait on it.
inline void mbar_settle(int cta, const void* bar, Mbar& m) {
  if (m.pending != 0 || m.tx != 0) return;
  m.phase ^= 1;
  m.pending = m.count;
  m.hb_done = m.hb_open;
  m.hb_open = false;
  Launch* l = launch();
  for (size_t j = 0; j < l->threads.size(); j++) {
    Thread& u = l->threads[j];
    if (u.st == St::MbarWait && u.cta == cta && u.wait_bar == bar) {
      u.waited = u.waited || m.hb_done;
      u.st = St::Ready;
      l->ctas[cta].ready.push_back(static_cast<int>(j));
    }
  }
}
inline void mbar_arrive_on(int cta, const void* bar, long long tx, bool waited) {
  Mbar& m = mbar_of(cta, bar);
  m.hb_open = m.hb_open || waited;
  m.tx += tx;
  if (--m.pending < 0) fail("an mbarrier phase got more arrivals than its count");
  mbar_settle(cta, bar, m);
}
// 128-byte swizzle (PTX ISA, "Tensor-map" swizzle modes / wgmma "Matrix Descriptor"): within each 1024-byte
// block, the 16-byte chunk j of 128-byte row r sits at chunk j ^ (r & 7).
inline uint32_t swizzle128(uint32_t off) { return off ^ (((off >> 7) & 7u) << 4); }

inline void land(const AsyncOp& op) {
  DepOpen open;
  Launch* l = launch();
  l->landing_waited = op.waited ? 1 : 0;
  struct Reset {
    Launch* l;
    ~Reset() { l->landing_waited = -1; }
  } reset{l};
  if (op.tma) {
    const unsigned long long* m = op.tmap;
    const int inner = static_cast<int>(m[kTmInner]), outer = static_cast<int>(m[kTmOuter]);
    const int bi = static_cast<int>(m[kTmBoxInner]), bo = static_cast<int>(m[kTmBoxOuter]);
    const uint8_t* g = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(m[kTmAddr]));
    const uint32_t bytes = static_cast<uint32_t>(bi * bo * 2);
    uint8_t* dst = decode_smem(op.dst, bytes);
    for (int r = 0; r < bo; r++)
      for (int c = 0; c < bi; c++) {
        const int row = op.row0 + r, col = op.k0 + c;
        uint16_t v = 0;
        if (row >= 0 && row < outer && col >= 0 && col < inner)
          memcpy(&v, check_global(g + static_cast<size_t>(row) * m[kTmRowBytes] + 2 * static_cast<size_t>(col), 2,
                                  "TMA source"), 2);
        memcpy(dst + swizzle128(static_cast<uint32_t>(r * bi * 2 + c * 2)), &v, 2);
      }
    Mbar& mb = mbar_of(op.cta, op.bar);
    mb.tx -= bytes;
    mbar_settle(op.cta, op.bar, mb);
  } else if (op.arrive) {
    for (const auto& c : op.copies) {
      uint8_t* dst = decode_smem(c.first, c.second.bytes);
      if (c.second.valid) memcpy(dst, c.second.src, c.second.bytes);
      else memset(dst, 0, c.second.bytes);
    }
    mbar_arrive_on(op.cta, op.bar, 0, op.waited);
  } else {
    memcpy(decode_smem(op.dst, op.bytes), op.src, op.bytes);
    Mbar& m = mbar_of(op.cta, op.bar);
    m.tx -= op.bytes;
    mbar_settle(op.cta, op.bar, m);
  }
}
// Land the pending operations of one barrier (bar null: all of them).
inline void land_ops(int cta, const void* bar) {
  Launch* l = launch();
  for (size_t i = 0; i < l->async_ops.size();) {
    if (bar == nullptr || (l->async_ops[i].cta == cta && l->async_ops[i].bar == bar)) {
      const AsyncOp op = l->async_ops[i];
      l->async_ops.erase(l->async_ops.begin() + static_cast<long>(i));
      land(op);
    } else {
      i++;
    }
  }
}
inline void bulk_copy(void* smem, const void* gmem, uint32_t bytes, const void* bar) {
  if (bytes % 16 || reinterpret_cast<uintptr_t>(smem) % 16) fail("cp.async.bulk: size or address not a multiple of 16");
  check_global(static_cast<const uint8_t*>(gmem), bytes, "cp.async.bulk source");
  const uint32_t dst = encode_smem(smem);
  decode_smem(dst, bytes);
  mbar_of(cur()->cta, bar);
  launch()->async_ops.push_back(AsyncOp{cur()->cta, bar, dst, gmem, bytes, {}, false, cur()->waited});
}
// cp.async.bulk.tensor.2d ... tile.mbarrier::complete_tx::bytes: one box of the descriptor at (k0, row0).
inline void tma_2d(void* smem, const unsigned long long* map, int k0, int row0, const void* bar) {
  if (map[kTmMagic] != kTensorMapMagic) fail("a TMA descriptor the emulator did not make (tests: driver.tensor_map_2d)");
  if (map[kTmBoxInner] * 2 != 128) fail("TMA: the emulator knows the 128-byte swizzle boxes only");
  const uint32_t dst = encode_smem(smem);
  if ((dst & kOffMask) % 1024) fail("TMA with the 128-byte swizzle: destination not 1024-byte aligned");
  mbar_of(cur()->cta, bar);
  AsyncOp op{cur()->cta, bar, dst, nullptr, 0, {}, false, cur()->waited};
  op.tma = true;
  memcpy(op.tmap, map, sizeof op.tmap);
  op.k0 = k0;
  op.row0 = row0;
  launch()->async_ops.push_back(op);
}

// cp.async.mbarrier.arrive.noinc: the arrival happens once all of this thread's cp.async copies have landed.
inline void cp_async_arrive(const void* bar) {
  Thread* t = cur();
  mbar_of(t->cta, bar);
  AsyncOp op{t->cta, bar, 0, nullptr, 0, {}, true, t->waited};
  for (auto& g : t->groups)
    for (const Copy& c : g) op.copies.emplace_back(encode_smem(c.dst), c);
  for (const Copy& c : t->open) op.copies.emplace_back(encode_smem(c.dst), c);
  t->groups.clear();
  t->open.clear();
  launch()->async_ops.push_back(op);
}
// mbarrier.try_wait.parity in a loop: returns once the phase of that parity has completed.
inline void mbar_wait(const void* bar, int parity) {
  Thread* t = cur();
  land_ops(t->cta, bar);
  const Mbar& m = mbar_of(t->cta, bar);
  if (m.phase != (parity & 1)) {  // (the phase completed before: its arrivals' state)
    if (m.hb_done) {
      t->waited = true;
      dep_guard(false);
    }
    return;
  }
  t->wait_bar = bar;
  t->st = St::MbarWait;
  yield_to_scheduler();
}
inline void named_sync(int threads) {
  Thread* t = cur();
  if (threads % 32 || threads > launch()->threads_per_cta) fail("bar.sync 1: a thread count that is not whole warps");
  t->wait_phase = threads;
  t->st = St::NamedBar;
  yield_to_scheduler();
}

}  // namespace jm_simt

#define threadIdx (::jm_simt::cur()->tid)
#define blockIdx (::jm_simt::launch()->ctas[::jm_simt::cur()->cta].block)
#define blockDim (::jm_simt::launch()->block)
#define gridDim (::jm_simt::launch()->grid)

inline void __syncthreads() { jm_simt::syncthreads(); }

namespace jm_simt {
inline void no_op_collective(Thread* const*) {}
// __shfl_sync: lane l's result = the value of lane (src of lane l) mod 32
template <typename V>
inline void shfl_collective(Thread* const* lanes) {
  V vals[32];
  for (int l = 0; l < 32; l++) vals[l] = *static_cast<const V*>(lanes[l]->in[0]);
  for (int l = 0; l < 32; l++) *static_cast<V*>(lanes[l]->out) = vals[*static_cast<const int*>(lanes[l]->in[1]) & 31];
}
// __shfl_up_sync: lane l gets lane l - d's value (its own where l < d); __shfl_xor_sync: lane l ^ d's
template <typename V, bool kXor>
inline void shfl_delta_collective(Thread* const* lanes) {
  V vals[32];
  for (int l = 0; l < 32; l++) vals[l] = *static_cast<const V*>(lanes[l]->in[0]);
  for (int l = 0; l < 32; l++) {
    const int d = *static_cast<const int*>(lanes[l]->in[1]);
    const int src = kXor ? (l ^ d) & 31 : (l >= d ? l - d : l);
    *static_cast<V*>(lanes[l]->out) = vals[src];
  }
}
// __match_any_sync: the lanes holding the same value as lane l, as a bit mask
inline void match_any_collective(Thread* const* lanes) {
  int vals[32];
  for (int l = 0; l < 32; l++) vals[l] = *static_cast<const int*>(lanes[l]->in[0]);
  for (int l = 0; l < 32; l++) {
    unsigned m = 0;
    for (int q = 0; q < 32; q++) m |= (vals[q] == vals[l] ? 1u : 0u) << q;
    *static_cast<unsigned*>(lanes[l]->out) = m;
  }
}
}  // namespace jm_simt

namespace jm_simt {
inline void ballot_collective(Thread* const* lanes) {
  unsigned bits = 0;
  for (int l = 0; l < 32; l++) bits |= (*static_cast<const int*>(lanes[l]->in[0]) ? 1u : 0u) << l;
  for (int l = 0; l < 32; l++) *static_cast<unsigned*>(lanes[l]->out) = bits;
}
}  // namespace jm_simt
inline unsigned __ballot_sync(unsigned mask, int pred) {
  if (mask != 0xFFFFFFFFu) jm_simt::fail("__ballot_sync with a partial mask is not emulated");
  unsigned r;
  jm_simt::warp_collective(&jm_simt::ballot_collective, "__ballot_sync", &pred, nullptr, nullptr, nullptr, &r);
  return r;
}

// __syncwarp: the lanes of the warp meet (a collective, so that the writes of lanes before it reach reads after it).
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  if (mask != 0xFFFFFFFFu) jm_simt::fail("__syncwarp with a partial mask is not emulated");
  jm_simt::warp_collective(&jm_simt::no_op_collective, "__syncwarp", nullptr, nullptr, nullptr, nullptr, nullptr);
}
template <typename V>
inline V __shfl_sync(unsigned mask, V v, int src, int width = 32) {
  static_assert(sizeof(V) == 4, "32-bit shuffles");
  if (mask != 0xFFFFFFFFu || width != 32) jm_simt::fail("__shfl_sync with a partial mask or width is not emulated");
  V r;
  jm_simt::warp_collective(&jm_simt::shfl_collective<V>, "__shfl_sync", &v, &src, nullptr, nullptr, &r);
  return r;
}
namespace jm_simt {
template <typename V, bool kXor>
inline V shfl_delta(unsigned mask, V v, int d, const char* name) {
  static_assert(sizeof(V) == 4, "32-bit shuffles");
  if (mask != 0xFFFFFFFFu) fail(std::string(name) + " with a partial mask is not emulated");
  V r;
  warp_collective(&shfl_delta_collective<V, kXor>, name, &v, &d, nullptr, nullptr, &r);
  return r;
}
}  // namespace jm_simt
template <typename V>
inline V __shfl_up_sync(unsigned mask, V v, int delta) {
  return jm_simt::shfl_delta<V, false>(mask, v, delta, "__shfl_up_sync");
}
template <typename V>
inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
  return jm_simt::shfl_delta<V, true>(mask, v, lane_mask, "__shfl_xor_sync");
}
inline unsigned __match_any_sync(unsigned mask, int v) {
  if (mask != 0xFFFFFFFFu) jm_simt::fail("__match_any_sync with a partial mask is not emulated");
  unsigned r;
  jm_simt::warp_collective(&jm_simt::match_any_collective, "__match_any_sync", &v, nullptr, nullptr, nullptr, &r);
  return r;
}
// Atomics and fences: one fiber runs at a time, so a read-modify-write is atomic and every write is visible at
// once; the address must be one of the launch's buffers or this CTA's shared memory.
inline int atomicAdd(int* p, int v) {
  jm_simt::Launch* l = jm_simt::launch();
  const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
  const jm_simt::Cta& c = l->ctas[jm_simt::cur()->cta];
  bool shared = b >= c.dyn && b + 4 <= c.dyn + c.dyn_bytes;
  for (const auto& var : l->vars) shared = shared || (b >= var.first && b + 4 <= var.first + var.second);
  if (!shared) jm_simt::check_global(p, 4, "atomicAdd");
  const int old = *p;
  *p = old + v;
  return old;
}
inline void __threadfence() {}

template <typename P>
inline P __ldg(const P* p) {
  return *jm_simt::check_global(p, sizeof(P), "__ldg");
}
// L2-only load / store (the split sums in the workspace): plain accesses, checked against the launch's buffers.
template <typename P>
inline P __ldcg(const P* p) {
  return *jm_simt::check_global(p, sizeof(P), "__ldcg");
}
template <typename P>
inline void __stcg(P* p, P v) {
  *const_cast<P*>(jm_simt::check_global(p, sizeof(P), "__stcg")) = v;
}

namespace jm_simt {

inline void fiber_main() {
  Launch* l = launch();
  l->kernel(l->params, l->extra);
  Thread* t = cur();
  t->st = St::Done;
  swapcontext(&t->ctx, &sched_ctx());
}

inline void load_cta(Launch* l, int c) {
  if (l->loaded == c) return;
  for (size_t i = 0; i < l->vars.size(); i++) {
    if (l->loaded >= 0) memcpy(saved_var(l, l->loaded, i), l->vars[i].first, l->vars[i].second);
    memcpy(l->vars[i].first, saved_var(l, c, i), l->vars[i].second);
  }
  l->loaded = c;
}

// After thread i stopped: fire what its stop completes.
inline void settle(Launch* l, int i) {
  Thread& t = l->threads[i];
  Cta& c = l->ctas[t.cta];
  const int base = t.cta * l->threads_per_cta;
  if (t.st == St::Done) {
    c.done++;
    if (l->cluster > 1) {
      l->exited_arrivals.push_back(t.arrivals);
      l->exited_waited.push_back(t.waited ? 1 : 0);
      l->phase_done = true;  // its later phases may be complete now
    }
  } else if (t.st == St::Coll) {
    const int width = t.coll_width;
    const int w0 = base + static_cast<int>(t.tid.x & ~static_cast<unsigned>(width - 1));
    const int lanes = l->threads_per_cta - (w0 - base) < width ? l->threads_per_cta - (w0 - base) : width;
    Thread* ls[128];
    for (int j = 0; j < lanes; j++) {
      ls[j] = &l->threads[w0 + j];
      if (ls[j]->st != St::Coll) return;  // not all there yet (or never: the deadlock check reports it)
    }
    if (lanes != width) {
      l->error = "a warp or warpgroup collective in a partial warp or warpgroup";
      return;
    }
    for (int j = 0; j < width; j++)
      if (ls[j]->coll != t.coll || ls[j]->coll_width != width) {
        l->error = std::string("warp lanes at different collectives: ") + ls[0]->coll_name + " / " + ls[j]->coll_name;
        return;
      }
    Thread* const* cl = ls;
    Thread* saved = cur();
    t.coll(cl);
    cur() = saved;
    bool hb = false;
    for (int j = 0; j < width; j++) hb = hb || ls[j]->waited;
    for (int j = 0; j < width; j++) {
      ls[j]->waited = hb;
      ls[j]->st = St::Ready;
      c.ready.push_back(w0 + j);
    }
  } else if (t.st == St::NamedBar) {
    if (++c.named_waiting == t.wait_phase) {
      c.named_waiting = 0;
      bool hb = false;
      for (int j = 0; j < l->threads_per_cta; j++)
        if (l->threads[base + j].st == St::NamedBar) hb = hb || l->threads[base + j].waited;
      for (int j = 0; j < l->threads_per_cta; j++)
        if (l->threads[base + j].st == St::NamedBar) {
          l->threads[base + j].waited = hb;
          l->threads[base + j].st = St::Ready;
          c.ready.push_back(base + j);
        }
    }
  } else if (t.st == St::Bar) {
    if (++c.bar_waiting == l->threads_per_cta) {
      c.bar_waiting = 0;
      bool hb = false;
      for (int j = 0; j < l->threads_per_cta; j++) hb = hb || l->threads[base + j].waited;
      for (int j = 0; j < l->threads_per_cta; j++) {
        l->threads[base + j].waited = hb;
        l->threads[base + j].st = St::Ready;
        c.ready.push_back(base + j);
      }
    }
  }
  // cluster barrier: a waiter whose phase is complete goes on; a completed phase wakes its waiters
  if (t.st == St::ClusterWait && cluster_phase_complete(l, t.wait_phase)) {
    t.waited = t.waited || cluster_phase_hb(l, t.wait_phase);
    t.st = St::Ready;
    c.ready.push_back(i);
  }
  if (l->phase_done) {
    l->phase_done = false;
    for (size_t j = 0; j < l->threads.size(); j++) {
      Thread& u = l->threads[j];
      if (u.st == St::ClusterWait && cluster_phase_complete(l, u.wait_phase)) {
        u.waited = u.waited || cluster_phase_hb(l, u.wait_phase);
        u.st = St::Ready;
        l->ctas[u.cta].ready.push_back(static_cast<int>(j));
      }
    }
  }
}

// Run the CTAs of one cluster (or one CTA) to completion.
inline void run_group(Launch* l) {
  for (;;) {
    if (!l->error.empty()) return;
    int pick_cta = -1;
    if (l->loaded >= 0 && l->loaded < static_cast<int>(l->ctas.size()) && !l->ctas[l->loaded].ready.empty())
      pick_cta = l->loaded;
    for (size_t c = 0; pick_cta < 0 && c < l->ctas.size(); c++)
      if (!l->ctas[c].ready.empty()) pick_cta = static_cast<int>(c);
    if (pick_cta < 0 && !l->async_ops.empty()) {  // only copies in flight: the copy engine goes on
      cur() = &l->threads[0];
      land_ops(-1, nullptr);
      continue;
    }
    if (pick_cta < 0) {
      int done = 0;
      for (const Cta& c : l->ctas) done += c.done;
      if (done == static_cast<int>(l->threads.size())) return;
      std::string states;
      for (size_t j = 0; j < l->threads.size() && states.size() < 400; j++) {
        const Thread& u = l->threads[j];
        if (u.st == St::Done) continue;
        char b[96];
        snprintf(b, sizeof b, " [cta %d thread %u: %s]", u.cta, u.tid.x,
                 u.st == St::Coll ? u.coll_name : u.st == St::Bar ? "__syncthreads" : u.st == St::MbarWait ?
                 "mbarrier wait" : u.st == St::NamedBar ? "named barrier" : "cluster wait");
        states += b;
      }
      l->error = "deadlock: threads wait for ones that exited or wait elsewhere:" + states;
      return;
    }
    load_cta(l, pick_cta);
    std::vector<int>& rd = l->ctas[pick_cta].ready;
    const size_t k = l->rng() % rd.size();
    const int i = rd[k];
    rd[k] = rd.back();
    rd.pop_back();
    Thread& t = l->threads[i];
    cur() = &t;
    if (!t.waited) dep_guard(true);
    swapcontext(&sched_ctx(), &t.ctx);
    dep_guard(false);
    if (dep_fault() != 0 && l->error.empty()) {
      char msg[240];
      snprintf(msg, sizeof msg, "an access at %p to a buffer of the kernel before (programmatic dependent launch) "
               "before griddepcontrol.wait (block %u thread %u)", reinterpret_cast<void*>(dep_fault()),
               l->ctas[t.cta].block.x, t.tid.x);
      l->error = msg;
    }
    if (!l->error.empty()) return;
    settle(l, i);
  }
}

constexpr size_t kStack = 256 * 1024;

inline std::string run(void (*kernel)(const void*, const void*), const void* params, const void* extra, uint3 grid,
                       uint3 block, int cluster, size_t dyn_bytes, const Region* regions, int nregions,
                       unsigned seed, const Region* dependent = nullptr, int ndependent = 0,
                       int* pdl_flags = nullptr) {
  Launch l;
  launch() = &l;
  l.kernel = kernel;
  l.params = params;
  l.extra = extra;
  l.grid = grid;
  l.block = block;
  l.cluster = cluster;
  l.threads_per_cta = static_cast<int>(block.x * block.y * block.z);
  l.regions.assign(regions, regions + nregions);
  l.dependent.assign(dependent, dependent + ndependent);
  l.rng.seed(seed);
  if (block.y != 1 || block.z != 1 || l.threads_per_cta > 1024) return "blocks must be 1-D with at most 1024 threads";
  if (cluster < 1 || cluster > 8 || grid.x % cluster) return "the grid must be a multiple of the cluster size (1-8)";
  const long page = sysconf(_SC_PAGESIZE);
  // the dependent regions' pages (the caller makes sure no other data shares them: tests/simt/runner.h)
  dep_pages().clear();
  for (const Region& r : l.dependent)
    dep_pages().push_back(PageSpan{r.lo / page * page, (r.hi + page - 1) / page * page});
  dep_fault() = 0;
  struct sigaction act;
  memset(&act, 0, sizeof act);
  act.sa_sigaction = dep_on_fault;
  act.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&act.sa_mask);
  if (!dep_pages().empty()) sigaction(SIGSEGV, &act, &dep_old_action());
  std::vector<char*> stacks;
  std::string err;
  const size_t total_ctas = static_cast<size_t>(grid.x) * grid.y * grid.z;
  for (size_t g0 = 0; g0 < total_ctas && err.empty(); g0 += cluster) {
    l.ctas.assign(cluster, Cta());
    l.threads.assign(static_cast<size_t>(cluster) * l.threads_per_cta, Thread());
    l.cluster_arrived.clear();
    l.cluster_hb.clear();
    l.exited_arrivals.clear();
    l.exited_waited.clear();
    l.mbars.clear();
    l.async_ops.clear();
    l.loaded = -1;
    for (int c = 0; c < cluster; c++) {
      Cta& cta = l.ctas[c];
      const size_t flat = g0 + c;
      cta.block = uint3{static_cast<unsigned>(flat % grid.x), static_cast<unsigned>(flat / grid.x % grid.y),
                        static_cast<unsigned>(flat / grid.x / grid.y)};
      // 1024-byte aligned (as the GPU's shared window: the swizzled layouts' XOR reads the address bits), ending
      // at most 1023 bytes before a PROT_NONE page
      const size_t body = (dyn_bytes + page - 1) / page * page + page;
      cta.map_bytes = body + page;
      cta.map = mmap(nullptr, cta.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (cta.map == MAP_FAILED) return "mmap failed";
      mprotect(static_cast<char*>(cta.map) + body, page, PROT_NONE);
      cta.dyn = static_cast<uint8_t*>(cta.map) + body - (dyn_bytes + 1023) / 1024 * 1024;
      cta.dyn_bytes = dyn_bytes;
      memset(cta.dyn, 0xFF, dyn_bytes);
      for (int j = 0; j < l.threads_per_cta; j++) {
        const size_t idx = static_cast<size_t>(c) * l.threads_per_cta + j;
        Thread& t = l.threads[idx];
        t.cta = c;
        t.tid = uint3{static_cast<unsigned>(j), 0, 0};
        if (stacks.size() <= idx) stacks.push_back(static_cast<char*>(malloc(kStack)));
        t.stack = stacks[idx];
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = t.stack;
        t.ctx.uc_stack.ss_size = kStack;
        t.ctx.uc_link = &sched_ctx();
        makecontext(&t.ctx, fiber_main, 0);
        cta.ready.push_back(static_cast<int>(idx));
      }
    }
    run_group(&l);
    err = l.error;
    for (Cta& cta : l.ctas)  // a CTA that never triggered does so at its exit
      l.all_early = l.all_early && (cta.triggered ? cta.trigger_early : !cta.waited_any);
    for (Cta& cta : l.ctas) munmap(cta.map, cta.map_bytes);
  }
  for (char* s : stacks) free(s);
  dep_guard(false);
  if (!dep_pages().empty()) sigaction(SIGSEGV, &dep_old_action(), nullptr);
  dep_pages().clear();
  if (pdl_flags != nullptr) {  // [0]: the dependent may start before this kernel waited; [1]: no thread waited
    pdl_flags[0] = l.all_early ? 1 : 0;
    pdl_flags[1] = l.any_wait ? 0 : 1;
  }
  launch() = nullptr;
  return err;
}

}  // namespace jm_simt
