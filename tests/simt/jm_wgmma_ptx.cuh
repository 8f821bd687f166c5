// jitmarlin tests — cuda_src/jm_wgmma_ptx.cuh emulated on the CPU (tests/simt/simt.h): warpgroup MMA, the TMA tile
// load, the compute warps' named barrier. Same names and signatures as the real header.
#pragma once

#include "jm_ptx.cuh"

namespace jm {

// The wgmma instructions run when issued (the emulator's warpgroup collective), so fences and waits have nothing
// left to order.
JM_DEVICE void wgmma_fence() {}
JM_DEVICE void wgmma_commit() {}
template <int N>
JM_DEVICE void wgmma_wait() {}

struct alignas(128) JmTensorMap {
  unsigned long long opaque[16];
};

JM_DEVICE void tma_load_2d(void* smem_dst, const JmTensorMap* map, int k0, int row0, uint64_t* bar) {
  jm_simt::tma_2d(smem_dst, map->opaque, k0, row0, bar);
}

namespace simt_detail {

// wgmma.mma_async.sync.aligned.m64nNk16.f32 with A from registers and B (K-major) from shared memory (PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): warp w of the warpgroup holds rows 16w..16w+15 of A in
// the mma.m16n8k16 A fragment layout; B[k][n] is at start + (n / 8) * SBO + (n % 8) * 128 + 2k with the 128-byte
// swizzle applied to that address; thread (w, g, t)'s accumulator 4j + q is D[16w + g + 8 (q >> 1)][8j + 2t + (q & 1)].
template <typename T, int N>
inline void wgmma_collective(jm_simt::Thread* const* th) {
  const uint64_t desc = *static_cast<const uint64_t*>(th[0]->in[1]);
  const int scale_d = *static_cast<const int*>(th[0]->in[2]);
  for (int i = 1; i < 128; i++)
    if (*static_cast<const uint64_t*>(th[i]->in[1]) != desc || (*static_cast<const int*>(th[i]->in[2]) != 0) !=
                                                                       (scale_d != 0))
      unsupported("wgmma: the threads of the warpgroup gave different descriptors or scale-d");
  if ((desc >> 62) != 1) unsupported("wgmma: a descriptor without the 128-byte swizzle");
  const uint32_t start = static_cast<uint32_t>(desc & 0x3FFFu) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFFu) << 4;
  jm_simt::Launch* l = jm_simt::launch();
  const jm_simt::Cta& cta = l->ctas[th[0]->cta];
  double A[64][16], B[16][N];
  for (int i = 0; i < 128; i++) {
    const int w = i >> 5, g = (i & 31) >> 2, t = i & 3;
    const uint32_t* a = static_cast<const uint32_t*>(th[i]->in[0]);
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; r++) {
      A[16 * w + rows[r]][cols[r]] = to_f64<T>(lo16(a[r]));
      A[16 * w + rows[r]][cols[r] + 1] = to_f64<T>(hi16(a[r]));
    }
  }
  for (int n = 0; n < N; n++)
    for (int k = 0; k < 16; k++) {
      const uint32_t off = jm_simt::swizzle128(start + (n / 8) * sbo + (n % 8) * 128 + 2 * k);
      if (off + 2 > cta.dyn_bytes) unsupported("wgmma: a B operand past the dynamic shared memory");
      uint16_t v;
      memcpy(&v, cta.dyn + off, 2);
      B[k][n] = to_f64<T>(v);
    }
  for (int i = 0; i < 128; i++) {
    const int w = i >> 5, g = (i & 31) >> 2, t = i & 3;
    float* d = static_cast<float*>(th[i]->out);
    for (int j = 0; j < N / 8; j++)
      for (int q = 0; q < 4; q++) {
        const int row = 16 * w + g + 8 * (q >> 1), col = 8 * j + 2 * t + (q & 1);
        double s = 0.0;
        for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
        d[4 * j + q] = static_cast<float>((scale_d ? static_cast<double>(d[4 * j + q]) : 0.0) + s);
      }
  }
}

}  // namespace simt_detail

// D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (shared memory, descriptor); fp32 accumulate.
template <int N>
struct WgmmaRS {
  template <typename T>
  static JM_DEVICE void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
    jm_simt::warp_collective(&simt_detail::wgmma_collective<T, N>, "wgmma.mma_async", a, &desc, &scale_d, nullptr, d,
                             128);
  }
};

template <int kThreads>
JM_DEVICE void compute_sync() {
  jm_simt::named_sync(kThreads);
}

}  // namespace jm
