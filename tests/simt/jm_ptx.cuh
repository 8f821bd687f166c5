// jitmarlin tests — cuda_src/jm_ptx.cuh's wrappers, emulated on the CPU (tests/simt/simt.h).
// Same names and signatures as the real header; each follows the PTX ISA's definition of the instruction the
// real wrapper issues. Wrappers a kernel under emulation does not need stop the launch with a clear error.
#pragma once

#include "jm_common.cuh"

#ifndef JM_SIMT_SM
#define JM_SIMT_SM 90  // the emulated architecture (emu.build's sm)
#endif
#define JM_HAS_BULK (JM_SIMT_SM >= 90)

namespace jm {

namespace simt_detail {

inline uint16_t lo16(uint32_t v) { return static_cast<uint16_t>(v & 0xFFFFu); }
inline uint16_t hi16(uint32_t v) { return static_cast<uint16_t>(v >> 16); }

template <typename T>
inline double to_f64(uint16_t h) {
  return DType<T>::kBF16 ? jm_simt::bf16_to_f32(h) : jm_simt::f16_to_f32(h);
}

// Round a double to the nearest-even 16-bit value (fp16: 11 significant bits, steps of 2^-24 at the bottom;
// bf16: 8 bits, steps of 2^-133), through fp32 only once the value is exact in it.
template <typename T>
inline uint16_t from_f64(double r) {
  constexpr bool kBF = DType<T>::kBF16;
  if (std::isfinite(r) && r != 0.0) {
    int e;
    std::frexp(r, &e);
    const int q = kBF ? (e - 8 > -133 ? e - 8 : -133) : (e - 11 > -24 ? e - 11 : -24);
    r = std::ldexp(std::nearbyint(std::ldexp(r, -q)), q);
  }
  const float f = static_cast<float>(r);
  return kBF ? jm_simt::f32_to_bf16(f) : jm_simt::f32_to_f16(f);
}

// Packed two-lane op: out.lo = op(a.lo, b.lo, c.lo), out.hi likewise, each rounded once.
template <typename T, typename Op>
inline uint32_t packed(uint32_t a, uint32_t b, uint32_t c, Op op) {
  const uint16_t lo = from_f64<T>(op(to_f64<T>(lo16(a)), to_f64<T>(lo16(b)), to_f64<T>(lo16(c))));
  const uint16_t hi = from_f64<T>(op(to_f64<T>(hi16(a)), to_f64<T>(hi16(b)), to_f64<T>(hi16(c))));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// mma.sync.aligned.m16n8k16.row.col.f32 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type"; lane l, g = l >> 2, t = l & 3): A a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
// a3 = A[g+8][2t+8, 2t+9]; B b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; C / D c0, c1 = C[g][2t, 2t+1],
// c2, c3 = C[g+8][2t, 2t+1]; the lower-indexed element in the low half of a register.
template <typename T>
inline void mma_collective(jm_simt::Thread* const* lanes) {
  double A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; l++) {
    const int g = l >> 2, t = l & 3;
    const uint32_t* a = static_cast<const uint32_t*>(lanes[l]->in[0]);
    const uint32_t b0 = *static_cast<const uint32_t*>(lanes[l]->in[1]);
    const uint32_t b1 = *static_cast<const uint32_t*>(lanes[l]->in[2]);
    const float* d = static_cast<const float*>(lanes[l]->out);
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; r++) {
      A[rows[r]][cols[r]] = to_f64<T>(lo16(a[r]));
      A[rows[r]][cols[r] + 1] = to_f64<T>(hi16(a[r]));
    }
    B[2 * t][g] = to_f64<T>(lo16(b0));
    B[2 * t + 1][g] = to_f64<T>(hi16(b0));
    B[2 * t + 8][g] = to_f64<T>(lo16(b1));
    B[2 * t + 9][g] = to_f64<T>(hi16(b1));
    C[g][2 * t] = d[0], C[g][2 * t + 1] = d[1], C[g + 8][2 * t] = d[2], C[g + 8][2 * t + 1] = d[3];
  }
  for (int l = 0; l < 32; l++) {
    const int g = l >> 2, t = l & 3;
    float* d = static_cast<float*>(lanes[l]->out);
    const int rr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int q = 0; q < 4; q++) {
      double s = 0.0;
      for (int k = 0; k < 16; k++) s += A[rr[q]][k] * B[k][cc[q]];
      d[q] = static_cast<float>(C[rr[q]][cc[q]] + s);
    }
  }
}

[[noreturn]] inline void unsupported(const char* what) {
  jm_simt::fail(std::string("not emulated (tests/simt/jm_ptx.cuh): ") + what);
}

}  // namespace simt_detail

JM_DEVICE uint32_t smem_addr(const void* p) { return jm_simt::encode_smem(p); }

JM_DEVICE void cp_async16(void* smem, const void* gmem, bool valid = true) { jm_simt::cp_async(smem, gmem, valid); }
template <int BYTES>
JM_DEVICE void cp_async_small(void* smem, const void* gmem, bool valid = true) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  jm_simt::cp_async(smem, gmem, valid, BYTES);
}
JM_DEVICE void compiler_fence() {}
JM_DEVICE void cp_async_commit() { jm_simt::cp_async_commit(); }
template <int N>
JM_DEVICE void cp_async_wait() {
  jm_simt::cp_async_wait(N);
}
template <int N>
JM_DEVICE void cp_async_wait_fenced() {
  jm_simt::cp_async_wait(N);
}
JM_DEVICE void cp_async_wait_all() {
  jm_simt::cp_async_commit();
  jm_simt::cp_async_wait(0);
}
JM_DEVICE void cp_async_mbar_arrive(uint64_t* bar) { jm_simt::cp_async_arrive(bar); }

// st.shared of the pending value to the slot, then (where `more`) ld.global.nc of the next one into it
JM_DEVICE void pass_on16(uint32_t slot, uint4& pend, bool more, const void* src) {
  std::memcpy(jm_simt::decode_smem(slot, 16), &pend, 16);
  if (more) pend = *jm_simt::check_global(static_cast<const uint4*>(src), 16, "ld.global.nc (pass_on16)");
}
JM_DEVICE void pass_on4(uint32_t slot, uint32_t& pend, bool more, const void* src) {
  std::memcpy(jm_simt::decode_smem(slot, 4), &pend, 4);
  if (more) pend = *jm_simt::check_global(static_cast<const uint32_t*>(src), 4, "ld.global.nc (pass_on4)");
}
JM_DEVICE uint4 ldg_stream(const uint4* p) { return *jm_simt::check_global(p, 16, "ld.global.nc (ldg_stream)"); }
// cp.async.bulk.prefetch.L2 (a hint: nothing lands anywhere); the emulator checks that the range lies in a buffer the
// test allocated, 16-byte aligned, a multiple of 16 bytes (the PTX rules), so a lead past the run shows up
JM_DEVICE void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || bytes % 16 != 0 || bytes == 0)
    jm_simt::fail("cp.async.bulk.prefetch.L2: the source 16-byte aligned and the size a nonzero multiple of 16");
  jm_simt::check_global(static_cast<const uint8_t*>(src), bytes, "cp.async.bulk.prefetch.L2");
}

// ldmatrix.sync.aligned.m8n8.xN.shared.b16 (PTX ISA, "ldmatrix"): lanes 8i..8i+7 give the 16-byte row addresses
// of 8x8 matrix i; register i of lane l receives the 32-bit word (l & 3) of row (l >> 2) of matrix i.
namespace simt_detail {
template <int N>
inline void ldmatrix_collective(jm_simt::Thread* const* lanes) {
  uint32_t got[32][N];
  for (int l = 0; l < 32; l++)
    for (int i = 0; i < N; i++) {
      const uint8_t* row = static_cast<const uint8_t*>(lanes[8 * i + (l >> 2)]->in[0]);
      memcpy(&got[l][i], row + 4 * (l & 3), 4);
    }
  for (int l = 0; l < 32; l++) memcpy(lanes[l]->out, got[l], sizeof got[l]);
}
template <int N>
inline void ldmatrix(uint32_t* r, const void* smem) {
  if (reinterpret_cast<uintptr_t>(smem) % 16) unsupported("ldmatrix row address not 16-byte aligned");
  jm_simt::decode_smem(jm_simt::encode_smem(smem), 16);  // a row of this CTA's shared memory
  jm_simt::warp_collective(&ldmatrix_collective<N>, N == 4 ? "ldmatrix.x4" : "ldmatrix.x2", smem, nullptr, nullptr,
                           nullptr, r);
}
}  // namespace simt_detail
JM_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* smem) { simt_detail::ldmatrix<4>(r, smem); }
JM_DEVICE void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  // (lanes 16-31 give no address for .x2; the emulator checks every lane's, which the kernels' all point in range)
  simt_detail::ldmatrix<2>(r, smem);
}

template <typename T>
JM_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  jm_simt::warp_collective(&simt_detail::mma_collective<T>, "mma.m16n8k16", a, &b0, &b1, nullptr, d);
}

// lop3.b32 with LUT 0xEA: (a & b) | c
JM_DEVICE uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
JM_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) { return __byte_perm(a, b, sel); }

template <typename T>
JM_DEVICE uint32_t sub2(uint32_t a, uint32_t b) {
  return simt_detail::packed<T>(a, b, 0u, [](double x, double y, double) { return x - y; });
}
template <typename T>
JM_DEVICE uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  return simt_detail::packed<T>(a, b, c, [](double x, double y, double z) { return x * y + z; });
}
template <typename T>
JM_DEVICE uint32_t mul2(uint32_t a, uint32_t b) {
  return simt_detail::packed<T>(a, b, 0u, [](double x, double y, double) { return x * y; });
}

JM_DEVICE void mbar_init(uint64_t* bar, uint32_t count) { jm_simt::mbar_init(bar, static_cast<int>(count)); }
JM_DEVICE void mbar_fence_init() {}  // (one fiber at a time: the initialised state is seen by everyone)
JM_DEVICE void fence_proxy_async_smem() {}
JM_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  jm_simt::mbar_arrive_on(jm_simt::cur()->cta, bar, bytes, jm_simt::cur()->waited);
}
JM_DEVICE void mbar_arrive(uint64_t* bar) {
  jm_simt::mbar_arrive_on(jm_simt::cur()->cta, bar, 0, jm_simt::cur()->waited);
}
JM_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) { jm_simt::mbar_wait(bar, static_cast<int>(parity)); }
template <int N>
JM_DEVICE void setmaxnreg_dec() {}
template <int N>
JM_DEVICE void setmaxnreg_inc() {}
JM_DEVICE void bulk_copy_g2s(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  jm_simt::bulk_copy(smem, gmem, bytes, bar);
}

// Programmatic dependent launch: the kernel before has finished long ago here; the wait marks the thread as
// allowed to touch that kernel's buffers (tests/simt/simt.h, the launch's dependent regions).
JM_DEVICE void griddep_wait() { jm_simt::griddep_wait(); }
JM_DEVICE void griddep_launch_dependents() { jm_simt::griddep_trigger(); }
JM_DEVICE uint32_t dynamic_smem_bytes() {
  return static_cast<uint32_t>(jm_simt::launch()->ctas[jm_simt::cur()->cta].dyn_bytes);
}

JM_DEVICE int ld_acquire_gpu(const int* ptr) { return *jm_simt::check_global(ptr, 4, "ld.acquire"); }

JM_DEVICE uint32_t cluster_ctarank() { return static_cast<uint32_t>(jm_simt::cur()->cta); }
JM_DEVICE uint32_t cluster_nctarank() { return static_cast<uint32_t>(jm_simt::launch()->cluster); }
JM_DEVICE void cluster_arrive_relaxed() { jm_simt::cluster_arrive(); }
JM_DEVICE void cluster_arrive_release() { jm_simt::cluster_arrive(); }
JM_DEVICE void cluster_wait() { jm_simt::cluster_wait(); }
JM_DEVICE uint32_t cluster_map(uint32_t addr, uint32_t rank) {
  if (rank >= static_cast<uint32_t>(jm_simt::launch()->cluster)) simt_detail::unsupported("mapa to a rank past the cluster");
  return (addr & ~(7u << jm_simt::kRankShift)) | (rank << jm_simt::kRankShift);
}
JM_DEVICE void st_cluster_f32(uint32_t addr, uint32_t rank, float v) {
  memcpy(jm_simt::decode_smem(cluster_map(addr, rank), 4), &v, 4);
}
JM_DEVICE void st_cluster_v4(uint32_t addr, uint32_t rank, float x, float y, float z, float w) {
  const float v[4] = {x, y, z, w};
  if (addr % 16) simt_detail::unsupported("st.shared::cluster.v4 at an address not 16-byte aligned");
  memcpy(jm_simt::decode_smem(cluster_map(addr, rank), 16), v, 16);
}

JM_DEVICE uint64_t globaltimer() { return 0; }
JM_DEVICE uint32_t smid() { return 0; }
JM_DEVICE void named_sync(int threads) { jm_simt::named_sync(threads); }

}  // namespace jm
