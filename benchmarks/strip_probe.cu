// Strip kernel probe (session 53): where a strip kernel's time goes at M = 1 (and M = 16, two token blocks), timed as
// bench_gemm times the GEMM (a CUDA graph of back-to-back calls, each on its own copy of the weights, programmatic
// dependent launch), with the kernel's trace (-DJM_STRIP_TRACE, cuda_src/jm_strip.cuh): per CTA (lane 0 of warp 0)
// the global timer at entry, past griddepcontrol.wait, after the first row, at each group end, past the main loop and
// before the output. Session 52 measured the strip kernel at 0.5 us per k16 row per warp whatever the warps per CTA
// (8192^2 M = 1: 16 / 8 / 4 warps 19.1 / 35.2 / 67.2 us), far from the floor probe's stream at the same occupancy;
// this says which part of a row's or group's time that is.
//
// Plain CUDA, no torch (the weights are random words: the timing does not depend on their values):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DJM_STRIP_TRACE -I cuda_src \
//        benchmarks/strip_probe.cu -o /tmp/strip_probe && /tmp/strip_probe
// (Put a directory with another jm_strip.cuh before cuda_src on the include path to probe that version.)
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "jm_strip.cuh"
#include "probe_check.cuh"

#ifndef JM_STRIP_TRACE
#error "build with -DJM_STRIP_TRACE"
#endif

// ring rows of the shared-memory-ring forms (one / two token blocks): K.strip_ring_rows of the header built against
#ifdef JM_STRIP_RING_ACTS
#define SP_RING1 16
#define SP_RING2 12
#define SP_ACT_ROW 256  // a ring row's activations per token block and warp
#else
#define SP_RING1 24
#define SP_RING2 24
#define SP_ACT_ROW 0
#endif
// (warps, depth, cluster 1, one token block, ring rows) as the route's configs (jitmarlin/ops/_kernels.py)
JM_STRIP_KERNEL(sp_g_w16, half, 4, false, 8, 16, 8, 1, 1, 0, false, false)
JM_STRIP_KERNEL(sp_g_w8, half, 4, false, 8, 8, 8, 1, 1, 0, false, false)
JM_STRIP_KERNEL(sp_g_w4, half, 4, false, 8, 4, 8, 1, 1, 0, false, false)
JM_STRIP_KERNEL(sp_g_w16s, half, 4, false, 8, 16, 4, 1, 1, SP_RING1, false, false)
JM_STRIP_KERNEL(sp_g_w8s, half, 4, false, 8, 8, 4, 1, 1, SP_RING1, false, false)
JM_STRIP_KERNEL(sp_c_w16, half, 4, false, -1, 16, 8, 1, 1, 0, false, false)
JM_STRIP_KERNEL(sp_c_w8, half, 4, false, -1, 8, 8, 1, 1, 0, false, false)
JM_STRIP_KERNEL(sp_c_w4, half, 4, false, -1, 4, 8, 1, 1, 0, false, false)
JM_STRIP_KERNEL(sp_c_w16s, half, 4, false, -1, 16, 4, 1, 1, SP_RING1, false, false)
JM_STRIP_KERNEL(sp_p_w16, half, 4, false, 8, 16, 8, 1, 1, 0, true, false)  // act-order: in-kernel gather
JM_STRIP_KERNEL(sp_p_w8, half, 4, false, 8, 8, 8, 1, 1, 0, true, false)
// two token blocks (M = 9-16: the group scales on the weights), register and shared-memory rings
JM_STRIP_KERNEL(sp_t2_w16, half, 4, false, 8, 16, 6, 1, 2, 0, false, false)
JM_STRIP_KERNEL(sp_t2_w16s, half, 4, false, 8, 16, 4, 1, 2, SP_RING2, false, false)
JM_STRIP_KERNEL(sp_t2_w4s, half, 4, false, 8, 4, 4, 1, 2, SP_RING2, false, false)
// the route's tall-layer picks since session 55 (gemm.strip_tall): clusters of two CTAs splitting K
JM_STRIP_KERNEL(sp_g_w16_c2, half, 4, false, 8, 16, 8, 2, 1, 0, false, false)
JM_STRIP_KERNEL(sp_g_w8_c2, half, 4, false, 8, 8, 8, 2, 1, 0, false, false)
JM_STRIP_KERNEL(sp_t2_w16_c2, half, 4, false, 8, 16, 6, 2, 2, 0, false, false)
// session 56: the 8-warp ring form in clusters of 2 (two CTAs per SM: a call's CTAs resident beside the previous call's)
JM_STRIP_KERNEL(sp_g_w8_c2s, half, 4, false, 8, 8, 4, 2, 1, SP_RING1, false, false)

namespace {

struct Kern {
  const char* name;
  void (*fn)(const JmGemmParams);
  int warps, sring;         // (the group size is in the name: g128 / chan = per channel)
  bool perm;                // act-order: the activations gathered through a permutation of K
  int m;                    // tokens
  int cluster = 1;          // CTAs per strip (a thread-block cluster splitting K)
};

const Kern kKerns[] = {
    {"g128 w16", sp_g_w16, 16, 0, false, 1},       {"g128 w8", sp_g_w8, 8, 0, false, 1},
    {"g128 w4", sp_g_w4, 4, 0, false, 1},          {"g128 w16-s", sp_g_w16s, 16, SP_RING1, false, 1},
    {"g128 w8-s", sp_g_w8s, 8, SP_RING1, false, 1},      {"chan w16", sp_c_w16, 16, 0, false, 1},
    {"chan w8", sp_c_w8, 8, 0, false, 1},           {"chan w4", sp_c_w4, 4, 0, false, 1},
    {"chan w16-s", sp_c_w16s, 16, SP_RING1, false, 1},    {"perm w16", sp_p_w16, 16, 0, true, 1},
    {"perm w8", sp_p_w8, 8, 0, true, 1},           {"g128 w16-t2", sp_t2_w16, 16, 0, false, 16},
    {"g128 w16-t2-s", sp_t2_w16s, 16, SP_RING2, false, 16}, {"g128 w4-t2-s", sp_t2_w4s, 4, SP_RING2, false, 16},
    {"g128 w16-c2", sp_g_w16_c2, 16, 0, false, 1, 2}, {"g128 w8-c2", sp_g_w8_c2, 8, 0, false, 1, 2},
    {"g128 w16-c2-t2", sp_t2_w16_c2, 16, 0, false, 16, 2}, {"g128 w8-c2-s", sp_g_w8_c2s, 8, SP_RING1, false, 1, 2},
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (const Kern& kn : kKerns) {
    // (at most what the device allows per CTA beside the kernel's static shared memory)
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, kn.fn));
    int optin = 0;
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    const int dyn = std::min(200 * 1024, optin - static_cast<int>(fa.sharedSizeBytes));
    CK(cudaFuncSetAttribute(kn.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn));
  }

  const int calls = 20, reps = 20, slots = 64, max_m = 16;
  struct Layer {
    int k, n;
  };
  const Layer layers[] = {{8192, 8192}, {4096, 4096}, {4096, 28672}, {11008, 4096}, {14336, 4096}, {28672, 8192}};
  for (const Layer& L : layers) {
    const size_t wbytes = static_cast<size_t>(L.k) * L.n / 2;
    const size_t sbytes = static_cast<size_t>(L.k / 128) * L.n * 2;
    std::vector<void*> ws(calls), ss(calls);
    for (int i = 0; i < calls; i++) {
      CK(cudaMalloc(&ws[i], wbytes));
      CK(cudaMemset(ws[i], 0x5a + i, wbytes));
      CK(cudaMalloc(&ss[i], sbytes));
      CK(cudaMemset(ss[i], 0x20, sbytes));  // fp16 0x2020: a small positive scale
    }
    half *a, *c;
    CK(cudaMalloc(&a, static_cast<size_t>(max_m) * L.k * 2));
    CK(cudaMemset(a, 0x30, static_cast<size_t>(max_m) * L.k * 2));
    CK(cudaMalloc(&c, static_cast<size_t>(max_m) * L.n * 2));
    const int max_grid = L.n / 64 * 2;  // (clusters of two: two CTAs per strip)
    int* perm;  // a fixed pseudo-random permutation of K (the timing does not depend on which)
    {
      std::vector<int> h(L.k);
      for (int i = 0; i < L.k; i++) h[i] = i;
      uint32_t x = 12345u;
      for (int i = L.k - 1; i > 0; i--) {
        x = x * 1664525u + 1013904223u;
        std::swap(h[i], h[x % static_cast<uint32_t>(i + 1)]);
      }
      CK(cudaMalloc(&perm, static_cast<size_t>(L.k) * 4));
      CK(cudaMemcpy(perm, h.data(), static_cast<size_t>(L.k) * 4, cudaMemcpyHostToDevice));
    }
    unsigned long long* trace;
    const size_t trace_vals = static_cast<size_t>(calls) * max_grid * slots;
    CK(cudaMalloc(&trace, trace_vals * 8));
    const double floor_bytes = static_cast<double>(wbytes) + static_cast<double>(sbytes);
    for (const Kern& kn : kKerns) {
      const int grid = L.n / 64 * kn.cluster;
      // every replay writes the same slots; the ones a CTA never writes (groups past its run) stay 0
      CK(cudaMemset(trace, 0, trace_vals * 8));
      // dynamic shared memory: the warps' rings, or an act-order register form's permutation store since session 54
      // (64 bytes per k16 row of K, one CTA per strip here; K.strip_smem_bytes). The old header ignores it.
      const size_t act_row = static_cast<size_t>(SP_ACT_ROW) * (kn.m > 8 ? 2 : 1);
      const size_t smem = kn.perm && kn.sring == 0 ? static_cast<size_t>(L.k / 16) * 64
                                                   : static_cast<size_t>(kn.warps) * kn.sring * (512 + act_row);
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < calls; i++) {
        JmGemmParams p = {};
        p.a = a;
        p.b = ws[i];
        p.s = ss[i];
        p.c = c;
        p.m = kn.m;
        p.n = L.n;
        p.k = L.k;
        p.lda = L.k;
        p.ldc = L.n;
        p.perm = kn.perm ? perm : nullptr;
        p.timeline = trace + static_cast<size_t>(i) * grid * slots;
        cudaLaunchConfig_t lc = {};
        lc.gridDim = dim3(grid);
        lc.blockDim = dim3(32 * kn.warps);
        lc.dynamicSmemBytes = smem;
        lc.stream = st;
        cudaLaunchAttribute attr[2];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        attr[1].id = cudaLaunchAttributeClusterDimension;
        attr[1].val.clusterDim.x = kn.cluster;
        attr[1].val.clusterDim.y = 1;
        attr[1].val.clusterDim.z = 1;
        lc.attrs = attr;
        lc.numAttrs = kn.cluster > 1 ? 2 : 1;
        CK(cudaLaunchKernelEx(&lc, kn.fn, p));
      }
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      const double us = 1000.0 * graph_median_ms(ge, st, reps) / calls;
      // the last replay's trace, calls 9 and 10
      std::vector<unsigned long long> h(trace_vals);
      CK(cudaMemcpy(h.data(), trace, trace_vals * 8, cudaMemcpyDeviceToHost));
      auto at = [&](int call, int cta, int slot) -> double {
        return static_cast<double>(h[(static_cast<size_t>(call) * grid + cta) * slots + slot]);
      };
      double prev_end = 0, end = 0;
      for (int x = 0; x < grid; x++) {
        prev_end = std::max(prev_end, at(9, x, 4));
        end = std::max(end, at(10, x, 4));
      }
      std::vector<double> enter, wait, first, grp, grp0, loop, red, loop_end;
      for (int x = 0; x < grid; x++) {
        enter.push_back(at(10, x, 0) - prev_end);
        wait.push_back(at(10, x, 1) - at(10, x, 0));
        first.push_back(at(10, x, 2) - at(10, x, 1));
        loop.push_back(at(10, x, 3) - at(10, x, 1));
        if (at(10, x, 4) > 0) red.push_back(at(10, x, 4) - at(10, x, 3));  // (a cluster's rank 0 only)
        loop_end.push_back(at(10, x, 3));
        if (at(10, x, 8) > 0) grp0.push_back(at(10, x, 8) - at(10, x, 2));  // (per channel: no group marks)
        for (int q = 1; q < 48; q++) {
          const double a0 = at(10, x, 8 + q - 1), a1 = at(10, x, 8 + q);
          if (a1 > a0 && a1 < at(10, x, 3) + 1) grp.push_back(a1 - a0);
        }
      }
      const double le_med = median(loop_end);
      double le_max = 0;
      for (double v : loop_end) le_max = std::max(le_max, v);
      std::printf(
          "%5dx%-5d M=%-2d %-13s %7.2f us/call (%5.1f%% of 4.2 TB/s) | step %6.2f enter %6.2f wait %6.2f first %6.2f "
          "grp0 %6.2f grp %6.2f (n %zu) loop %6.2f spread %6.2f red %5.2f (us, medians over CTAs)\n",
          L.k, L.n, kn.m, kn.name, us, 100.0 * floor_bytes / 4.2e12 * 1e6 / us, (end - prev_end) / 1e3, median(enter) / 1e3,
          median(wait) / 1e3, median(first) / 1e3, median(grp0) / 1e3, median(grp) / 1e3, grp.size(),
          median(loop) / 1e3, (le_max - le_med) / 1e3, median(red) / 1e3);
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
    for (int i = 0; i < calls; i++) {
      CK(cudaFree(ws[i]));
      CK(cudaFree(ss[i]));
    }
    CK(cudaFree(a));
    CK(cudaFree(c));
    CK(cudaFree(trace));
    CK(cudaFree(perm));
  }
  CK(cudaGetLastError());
  return 0;
}
