// Harness floor probe: how close to the HBM bandwidth floor can ANY kernel come that reads a layer's
// W4 weights once, timed the way bench_gemm times the GEMM (a CUDA graph of back-to-back calls, each
// on its own copy of the weights so that every call reads HBM, programmatic dependent launch on)?
//
// The kernel does nothing but stream: every warp reads one contiguous share of the bytes with
// ld.global.nc.L1::no_allocate (jm::ldg_stream, the direct-load tiles' weight load), DEPTH 16-byte
// words per lane in flight, folds them into one word and writes it at the end. Its first DEPTH loads go
// out before griddepcontrol.wait, as the GEMM's direct-load tiles do with their weights; it calls
// griddepcontrol.launch_dependents at its start, as the GEMM does after its setup. So its time per call
// is what a GEMM with free math, free fixups and a perfect split would take: the harness floor.
//
// Build and run (plain CUDA, no torch; sm_90a for griddepcontrol):
//   nvcc -std=c++17 -O3 -arch=sm_90a -I cuda_src benchmarks/floor_probe.cu -o /tmp/floor_probe
//   /tmp/floor_probe            # one line per (layer, configuration): us per call, % of the floor
// The floor counts the 4-bit weights and g128 fp16 scales of a K x N layer at M = 1 (activations and
// output are < 0.2% of it) against the device-to-device copy bandwidth measured in the same run
// (bytes read + bytes written, as benchmarks/common.py copy_bandwidth).
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "jm_ptx.cuh"

#include "probe_check.cuh"

namespace {

// PF > 0: lane 0 also asks for the rows PF batches past the ones its loads are about to fetch to be prefetched into L2
// (jm::prefetch_l2_bulk), so HBM keeps streaming while the warp waits for a batch (session 56)
template <int DEPTH, int PF>
__global__ void stream_kernel(const uint4* __restrict__ buf, size_t words, uint32_t* out, int pdl) {
  const int lane = threadIdx.x & 31;
  const size_t warps = static_cast<size_t>(gridDim.x) * (blockDim.x >> 5);
  const size_t warp = static_cast<size_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  // warp w reads words [lo, hi): the shares differ by at most one 32-word step
  const size_t steps = words / 32, lo = steps * warp / warps * 32, hi = steps * (warp + 1) / warps * 32;
  const uint4* p = buf + lo + lane;
  const int n = static_cast<int>((hi - lo) / 32);
  uint4 ring[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; d++) ring[d] = d < n ? jm::ldg_stream(p + 32 * d) : make_uint4(0, 0, 0, 0);
  // rows [i0, i1) of this warp's share (clipped) into L2
  auto prefetch = [&](int i0, int i1) {
    i1 = i1 < n ? i1 : n;
    if (PF > 0 && lane == 0 && i0 < i1) jm::prefetch_l2_bulk(p - lane + 32 * i0, static_cast<uint32_t>(i1 - i0) * 512u);
  };
  prefetch(DEPTH, DEPTH + PF * DEPTH);
  if (pdl) {
    jm::griddep_launch_dependents();
    jm::griddep_wait();
  }
  uint32_t acc = 0;
  int s = 0;
  for (; s + DEPTH < n; s += DEPTH) {
    prefetch(s + DEPTH + PF * DEPTH, s + 2 * DEPTH + PF * DEPTH);
#pragma unroll
    for (int d = 0; d < DEPTH; d++) {
      acc ^= ring[d].x ^ ring[d].y ^ ring[d].z ^ ring[d].w;
      ring[d] = s + DEPTH + d < n ? jm::ldg_stream(p + 32 * (s + DEPTH + d)) : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int d = 0; d < DEPTH; d++) acc ^= ring[d].x ^ ring[d].y ^ ring[d].z ^ ring[d].w;
  for (int o = 16; o; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0 && acc == 0x9e3779b9u) out[0] = acc;  // never true for the fill below; keeps the loads
}

struct Cfg {
  int per_sm, threads, depth, pf;
};

template <int DEPTH, int PF>
void launch_one(cudaStream_t st, const Cfg& c, int sms, const uint4* buf, size_t words, uint32_t* out, bool pdl) {
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(sms * c.per_sm);
  lc.blockDim = dim3(c.threads);
  lc.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&lc, stream_kernel<DEPTH, PF>, buf, words, out, pdl ? 1 : 0));
}

void launch(cudaStream_t st, const Cfg& c, int sms, const uint4* buf, size_t words, uint32_t* out, bool pdl) {
  if (c.pf == 1) {
    if (c.depth == 4) launch_one<4, 1>(st, c, sms, buf, words, out, pdl);
    else launch_one<8, 1>(st, c, sms, buf, words, out, pdl);
  } else if (c.pf == 2) {
    launch_one<8, 2>(st, c, sms, buf, words, out, pdl);
  } else if (c.depth == 4) {
    launch_one<4, 0>(st, c, sms, buf, words, out, pdl);
  } else if (c.depth == 8) {
    launch_one<8, 0>(st, c, sms, buf, words, out, pdl);
  } else {
    launch_one<16, 0>(st, c, sms, buf, words, out, pdl);
  }
}

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  // copy bandwidth, 1 GiB each way, median of 5
  double copy_bw = 0;
  {
    const size_t cb = 1ull << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, cb));
    CK(cudaMalloc(&dst, cb));
    CK(cudaMemset(src, 1, cb));
    std::vector<float> t;
    for (int i = 0; i < 7; i++) {
      CK(cudaEventRecord(e0, st));
      CK(cudaMemcpyAsync(dst, src, cb, cudaMemcpyDeviceToDevice, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    copy_bw = 2.0 * cb / (t[t.size() / 2] * 1e-3);
    CK(cudaFree(src));
    CK(cudaFree(dst));
  }
  std::printf("copy bandwidth %.2f TB/s (read + written, 1 GiB, median of 5)\n", copy_bw / 1e12);

  const int calls = 20, reps = 30;
  uint32_t* out;
  CK(cudaMalloc(&out, 4));
  struct Layer {
    long k, n;
  };
  const Layer layers[] = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {4096, 12288}, {14336, 4096},
                          {8192, 8192}, {4096, 28672}, {8192, 28672}};
  // (per SM, threads, depth, L2 prefetch batches ahead): the strip kernel runs 16 warps per SM, depth 8
  const Cfg cfgs[] = {{2, 256, 8, 0}, {3, 256, 8, 0}, {4, 256, 4, 0}, {4, 256, 8, 0}, {2, 512, 8, 0}, {1, 1024, 4, 0},
                      {8, 128, 8, 0}, {2, 256, 8, 1}, {2, 256, 8, 2}, {1, 512, 8, 1}, {1, 512, 8, 2}, {4, 256, 4, 1}};
  for (const Layer& L : layers) {
    const size_t bytes = static_cast<size_t>(L.k * L.n / 2 + L.k / 128 * L.n * 2);
    const size_t words = bytes / 16;
    std::vector<uint4*> bufs(calls);
    for (auto& b : bufs) {
      CK(cudaMalloc(&b, bytes + 4096));
      CK(cudaMemset(b, 0x5a, bytes + 4096));
    }
    const double floor_us = bytes / copy_bw * 1e6;
    for (const Cfg& c : cfgs) {
      for (int pdl = 0; pdl < 2; pdl++) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < calls; i++) launch(st, c, sms, bufs[i], words, out, pdl);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        const double us = 1000.0 * graph_median_ms(ge, st, reps) / calls;
        std::printf("%5ldx%-5ld %6.2f MB  %d CTA/SM x %4d thr, depth %2d, pdl %d: %7.2f us per call, floor %6.2f us, "
                    "%5.1f%% of floor%s\n",
                    L.k, L.n, bytes / 1e6, c.per_sm, c.threads, c.depth, pdl, us, floor_us, 100.0 * floor_us / us,
                    c.pf == 1 ? ", L2 prefetch 1 batch ahead" : c.pf == 2 ? ", L2 prefetch 2 batches ahead" : "");
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
      }
    }
    for (auto& b : bufs) CK(cudaFree(b));
  }
  CK(cudaGetLastError());
  return 0;
}
