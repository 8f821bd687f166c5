// Weight-stream probe: how fast can a kernel shaped like our small-M GEMM read a large weight
// matrix from HBM, by three mechanisms, at the occupancies the GEMM actually runs with?
//
//   ldg   math-style warps load their own 16-byte words (ld.global.nc, no L1 allocation) with a
//         rolling register prefetch of DEPTH words per lane; no shared memory at all
//   bulk  one producer warp fills a ring of STAGES slots with bulk copies (COPIES per stage, each
//         from its own strip, as the GEMM's weight layout does, or one contiguous copy), the
//         consumer warps wait on the slot, read it once from shared memory and free it
//   cpa   every warp streams its own strip with 16-byte cp.async into a private ring (the
//         sm_80-style pipeline), waiting with cp.async.wait_group
//
// No torch: build and run with
//   nvcc -std=c++17 -O3 -arch=sm_90a -I cuda_src benchmarks/stream_probe.cu -o /tmp/stream_probe
//   /tmp/stream_probe            # prints one line per configuration: µs per pass and TB/s
// A pass reads BYTES (default 117 MB, the W4 weights of an 8192 x 28672 layer) from one of four
// buffers in turn (464 MB together, far past the 60 MB L2), so every pass comes from HBM.
// benchmarks/NOTES.md (session 6) says what the numbers are for.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "jm_ptx.cuh"

#include "probe_check.cuh"

namespace {

using jm::ldg_stream;  // the direct-load tiles' weight load

// ---- ldg: each warp owns `per_warp` contiguous bytes; lane L reads word 32 j + L ----
template <int DEPTH>
__global__ void ldg_kernel(const uint4* __restrict__ buf, size_t words_per_warp, uint32_t* out) {
  const int lane = threadIdx.x & 31;
  const size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const uint4* p = buf + warp * words_per_warp + lane;
  const size_t steps = words_per_warp / 32;
  uint4 ring[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; d++) ring[d] = d < steps ? ldg_stream(p + 32 * d) : make_uint4(0, 0, 0, 0);
  uint32_t acc = 0;
  size_t s = 0;
  for (; s + DEPTH < steps; s += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {  // consume the oldest word, refill its slot DEPTH steps ahead
      acc ^= ring[d].x ^ ring[d].y ^ ring[d].z ^ ring[d].w;
      ring[d] = ldg_stream(p + 32 * (s + DEPTH + d));
    }
  }
#pragma unroll
  for (int d = 0; d < DEPTH; d++)
    if (s + d < steps) acc ^= ring[d].x ^ ring[d].y ^ ring[d].z ^ ring[d].w;
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads alive
}

// ---- bulk: producer warp + consumer warps, ring of STAGES slots of `stage_bytes` ----
// CTA c streams tiles c, c + grid, ...; a tile is `copies` pieces of stage_bytes / copies, piece w
// of tile t at strip w (strided: strips of `strip_bytes` apart, the GEMM's layout) or adjacent.
__global__ void bulk_kernel(const uint8_t* __restrict__ buf, int tiles, int stage_bytes, int copies, int stages,
                            size_t strip_bytes, int strided, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t full_bar[16];
  __shared__ __align__(8) uint64_t empty_bar[16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int consumers = blockDim.x / 32 - 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; s++) {
      jm::mbar_init(&full_bar[s], 1);
      jm::mbar_init(&empty_bar[s], consumers);
    }
    jm::mbar_fence_init();
  }
  __syncthreads();
  const int piece = stage_bytes / copies;
  const int my_tiles = tiles > static_cast<int>(blockIdx.x) ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  if (warp == consumers) {  // the producer
    int slot = 0;
    uint32_t phase = 0;
    for (int i = 0; i < my_tiles; i++) {
      const size_t t = blockIdx.x + static_cast<size_t>(i) * gridDim.x;
      if (i >= stages) jm::mbar_wait(&empty_bar[slot], (phase & 1) ^ 1);
      if (lane == 0) jm::mbar_arrive_expect_tx(&full_bar[slot], stage_bytes);
      __syncwarp();
      for (int w = lane; w < copies; w += 32) {
        const size_t src = strided ? w * strip_bytes + t * piece : t * stage_bytes + w * piece;
        jm::bulk_copy_g2s(smem + slot * stage_bytes + w * piece, buf + src, piece, &full_bar[slot]);
      }
      if (++slot == stages) {
        slot = 0;
        ++phase;
      }
    }
    return;
  }
  uint32_t acc = 0;
  int slot = 0;
  uint32_t phase = 0;
  for (int i = 0; i < my_tiles; i++) {
    jm::mbar_wait(&full_bar[slot], phase & 1);
    // each consumer reads its share of the slot once (16 bytes per lane per 512 bytes)
    const uint4* s4 = reinterpret_cast<const uint4*>(smem + slot * stage_bytes);
    for (int j = warp * 32 + lane; j < stage_bytes / 16; j += consumers * 32) {
      const uint4 v = s4[j];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (lane == 0) jm::mbar_arrive(&empty_bar[slot]);
    if (++slot == stages) {
      slot = 0;
      ++phase;
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

// ---- cpa: each warp streams its own contiguous region through a private cp.async ring ----
template <int STAGES>
__global__ void cpa_kernel(const uint4* __restrict__ buf, size_t words_per_warp, int words_per_stage, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t gwarp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  uint4* ring = reinterpret_cast<uint4*>(smem) + static_cast<size_t>(warp) * STAGES * words_per_stage;
  const uint4* p = buf + gwarp * words_per_warp;
  const int n_stages = static_cast<int>(words_per_warp / words_per_stage);
  auto fetch = [&](int s, int slot) {
    for (int j = lane; j < words_per_stage; j += 32)
      jm::cp_async16(ring + slot * words_per_stage + j, p + static_cast<size_t>(s) * words_per_stage + j, true);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < n_stages) fetch(s, s);
    jm::cp_async_commit();
  }
  uint32_t acc = 0;
  for (int s = 0; s < n_stages; s++) {
    jm::cp_async_wait<STAGES - 2>();
    __syncwarp();
    const int slot = s % STAGES;
    for (int j = lane; j < words_per_stage; j += 32) {
      const uint4 v = ring[slot * words_per_stage + j];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if (s + STAGES - 1 < n_stages) fetch(s + STAGES - 1, (s + STAGES - 1) % STAGES);
    jm::cp_async_commit();
  }
  if (acc == 0x12345678u) out[0] = acc;
}

template <typename Launch>
float time_passes(Launch launch, int passes) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 4; i++) launch(i);  // warm-up
  CK(cudaEventRecord(a));
  for (int i = 0; i < passes; i++) launch(i);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  return 1000.f * ms / passes;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8192ull * 28672 / 2;
  const int passes = 50;
  int sms = 0, dev = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::vector<uint8_t*> bufs(4);
  for (auto& p : bufs) {
    CK(cudaMalloc(&p, bytes + (1 << 20)));
    CK(cudaMemset(p, 1, bytes + (1 << 20)));
  }
  uint32_t* out;
  CK(cudaMalloc(&out, 4));
  auto report = [&](const char* what, float us, size_t moved) {
    std::printf("%-58s %8.2f us  %5.2f TB/s\n", what, us, moved / (us * 1e-6) / 1e12);
  };
  char name[128];

  // ldg: warps per SM x prefetch depth
  for (int wps : {8, 16, 32}) {
    for (int depth : {2, 4, 8}) {
      const int threads = 256, ctas = sms * wps / 8;
      const size_t warps = static_cast<size_t>(ctas) * threads / 32;
      const size_t wpw = (bytes / 16 / warps) / 32 * 32;
      auto go = [&](int i) {
        const uint4* b = reinterpret_cast<const uint4*>(bufs[i & 3]);
        if (depth == 2) ldg_kernel<2><<<ctas, threads>>>(b, wpw, out);
        else if (depth == 4) ldg_kernel<4><<<ctas, threads>>>(b, wpw, out);
        else ldg_kernel<8><<<ctas, threads>>>(b, wpw, out);
      };
      std::snprintf(name, sizeof name, "ldg   %2d warps/SM, %d x 16 B in flight per lane", wps, depth);
      report(name, time_passes(go, passes), wpw * 16 * warps);
    }
  }

  // bulk: the GEMM's M=1 shape (4 strips of 4 KB per stage, 6 stages, 2 CTAs/SM of 4 consumers),
  // then variants: one contiguous copy, bigger stages, more CTAs
  struct B {
    int stage_bytes, copies, stages, ctas_per_sm, consumers, strided;
  };
  const B cfgs[] = {{16384, 4, 6, 2, 4, 1}, {16384, 1, 6, 2, 4, 0}, {16384, 4, 6, 2, 4, 0}, {32768, 8, 3, 2, 4, 1},
                    {32768, 1, 3, 2, 4, 0}, {8192, 2, 12, 2, 4, 1}, {16384, 4, 4, 3, 4, 1}, {16384, 4, 6, 2, 8, 1},
                    {65536, 1, 3, 1, 8, 0}};
  for (const B& c : cfgs) {
    const int tiles = static_cast<int>(bytes / c.stage_bytes);
    const size_t strip_bytes = bytes / c.copies;  // piece w of tile t sits in strip w
    const int ctas = sms * c.ctas_per_sm, smem = c.stage_bytes * c.stages;
    CK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto go = [&](int i) {
      bulk_kernel<<<ctas, 32 * (c.consumers + 1), smem>>>(bufs[i & 3], tiles, c.stage_bytes, c.copies, c.stages,
                                                          strip_bytes, c.strided, out);
    };
    std::snprintf(name, sizeof name, "bulk  %2d KB x %d stages, %d %s copies, %d CTAs/SM x %d warps",
                  c.stage_bytes / 1024, c.stages, c.copies, c.strided ? "strided" : "adjacent", c.ctas_per_sm,
                  c.consumers);
    report(name, time_passes(go, passes), static_cast<size_t>(tiles) * c.stage_bytes);
  }

  // cpa: per-warp rings of 4 stages x 2 KB (the sm_80-style pipeline)
  for (int wps : {8, 16}) {
    const int threads = 128, ctas = sms * wps / 4, wpst = 128;
    const size_t warps = static_cast<size_t>(ctas) * threads / 32;
    const size_t wpw = (bytes / 16 / warps) / wpst * wpst;
    const int smem = 4 * wpst * 16 * (threads / 32);
    CK(cudaFuncSetAttribute(cpa_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto go = [&](int i) {
      cpa_kernel<4><<<ctas, threads, smem>>>(reinterpret_cast<const uint4*>(bufs[i & 3]), wpw, wpst, out);
    };
    std::snprintf(name, sizeof name, "cpa   %2d warps/SM, 4 stages x 2 KB per warp", wps);
    report(name, time_passes(go, passes), wpw * 16 * warps);
  }
  return 0;
}
