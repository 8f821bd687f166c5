// jitmarlin — small kernels of the MoE path (on by default; JITMARLIN_MOE_KERNELS=0 uses torch ops).
//
// jm_moe_align: the token-slot -> expert-block table of moe_align_block_size in one kernel (one
// CTA) instead of ~20 small torch kernels: count the slots of each expert, pad every count to the
// block size, prefix-sum the padded counts, tag each block with its expert, and place each slot
// at its expert's next position. Placement runs in slot order (a match-any vote per 32 slots, the
// lowest lane advancing the expert's cursor), each of 32 warps over its own contiguous chunk of
// slots when the per-warp counts fit the launch's shared memory (one warp over all slots
// otherwise), so the table is identical to the torch reference's stable sort. A programmatic
// dependent of the kernel before it (the router's): it waits for it before reading the ids.
// jm_moe_route: the router's logits [T, E] (the model dtype) -> softmax over all E in fp32, the top
// k, optionally renormalized to sum 1 (Mixtral): weights fp32 [T, k] and int32 ids [T, k], which
// the alignment and the one-token path read directly. One warp per token instead of four torch
// kernels (softmax, top-k, sum, divide) and a cast.
// jm_silu_mul: y[r, j] = silu(x[r, j]) * x[r, I + j] for the gate/up halves of the first expert
// GEMM's output, 8 values per thread.
// jm_topk_sum: y[t, j] = sum over k of x[t * top_k + k, j] (the second expert GEMM's output, the
// routing weights already applied), summed in fp32 in slot order, rounded once, 8 values per thread;
// jm_topk_sum_f32: the same over fp32 x [splits, T * top_k, H] (that GEMM split along K), split by split.
// jm_moe_gather (act-order experts): y[r, j] = x[slot / top_k, perm[expert, j]] for each position r
// of the expert-sorted slot list (slot = sorted_ids[r], expert = expert_ids[r / block]; perm null:
// y[r, j] = x[slot / top_k, j], the rows in slot-list order for the wgmma producer form); padding
// positions get zeros, positions at or past *num_padded are not written (no GEMM reads them). One
// kernel instead of the torch gather through an [L, K] int64 index tensor; 8 values per thread.
// jm_silu_gather: jm_moe_gather of SiLU(gate) * up straight from the first expert GEMM's output (the
// down projection's input by position for the producer form and act-order experts), no [slots, I]
// intermediate and one kernel boundary less.
// Programmatic dependent launch (sm_90): jm_silu_gather lets the kernel after it launch at once, so
// that the expert GEMM's CTAs are resident and set up when it finishes (the GEMM reads nothing of
// ours before its own griddep_wait); jm_moe_gather once each thread has waited for the kernel
// before it (the alignment), so that the GEMM after it may read the routing tables, and stream
// its first weights, at once; silu_mul, launched as a dependent of the first GEMM, waits for it
// before reading its output.
#pragma once

#include "jm_common.cuh"
#include "jm_ptx.cuh"

struct JmMoeParams {
  const void* ids;      // align: [numel] expert of each (token, k) slot, int32 or int64
  int* sorted_ids;      // align: [max_len] out
  int* expert_ids;      // align: [blocks] out
  int* num_padded;      // align: [1] out
  const void* x;        // silu_mul: [rows, 2 * inter]
  void* y;              // silu_mul: [rows, inter]
  int32_t numel;
  int32_t num_experts;
  int32_t block;
  int32_t max_len;
  int32_t blocks;
  int32_t ids_64;       // 1: ids are int64
  int32_t rows;
  int32_t inter;
  int32_t top_k;        // topk_sum: slots per token; moe_gather: slots per row of x
  const int* perm;      // moe_gather: [num_experts, inter] column order of each expert's input
  int* route_ids;       // moe_route: [rows, top_k] int32 out (weights: y, fp32 [rows, top_k]; logits: x)
  int32_t renorm;       // moe_route: 1 = the k weights renormalized to sum 1
  int32_t splits;       // topk_sum with fp32 input: x is [splits, rows * top_k, inter] (K-split partials)
};

namespace jm {

JM_DEVICE int load_id(const JmMoeParams& p, int i) {
  if (p.ids_64) return static_cast<int>(static_cast<const int64_t*>(p.ids)[i]);
  return static_cast<const int32_t*>(p.ids)[i];
}

// Words of dynamic shared memory the per-warp placement needs (host: moe._align_smem_bytes).
constexpr int kAlignWarps = 32;  // the kernel runs 1024 threads
JM_DEVICE int align_parallel_words(int experts) { return (2 + kAlignWarps) * experts; }

JM_DEVICE void moe_align_body(const JmMoeParams p) {
  extern __shared__ int sm[];
  const int E = p.num_experts;
  int* count = sm;         // [E] slots per expert (then, serial placement: the cursor)
  int* start = sm + E;     // [E] first padded position of each expert
  int* wcur = sm + 2 * E;  // parallel placement: [32 warps][E] slots of warp w's chunk per expert,
                           // then the exclusive prefix over warps, then warp w's cursor
  __shared__ int s_total;
  const int tid = threadIdx.x, nthreads = blockDim.x, lane = tid & 31, warp = tid >> 5;
  // Parallel placement when the launch gave the per-warp table room (E up to a few hundred): warp w
  // places the slots of its own contiguous chunk; a serial warp-0 loop otherwise. Both are stable.
  const bool par = nthreads == 32 * kAlignWarps &&
                   dynamic_smem_bytes() >= 4u * static_cast<uint32_t>(align_parallel_words(E));
  const int chunk = (p.numel + kAlignWarps - 1) / kAlignWarps;
  const int c0 = warp * chunk, c1 = min(p.numel, c0 + chunk);
  griddep_launch_dependents();
  griddep_wait();  // the routing ids come from the kernel before (programmatic dependent launch)
  for (int e = tid; e < E; e += nthreads) count[e] = 0;
  if (par)
    for (int i = tid; i < kAlignWarps * E; i += nthreads) wcur[i] = 0;
  __syncthreads();
  if (par) {
    for (int i = c0 + lane; i < c1; i += 32) {
      const int e = load_id(p, i);
      if (e >= 0 && e < E) atomicAdd(&wcur[warp * E + e], 1);
    }
    __syncthreads();
    for (int e = tid; e < E; e += nthreads) {  // totals, and each warp's offset within its expert
      int run = 0;
      for (int w = 0; w < kAlignWarps; w++) {
        const int c = wcur[w * E + e];
        wcur[w * E + e] = run;
        run += c;
      }
      count[e] = run;
    }
  } else {
    for (int i = tid; i < p.numel; i += nthreads) {
      const int e = load_id(p, i);
      if (e >= 0 && e < E) atomicAdd(&count[e], 1);
    }
  }
  __syncthreads();
  if (tid < 32) {  // exclusive scan of the padded counts, 32 experts per step
    int carry = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      const int padded = e < E ? (count[e] + p.block - 1) / p.block * p.block : 0;
      int incl = padded;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
        if (lane >= d) incl += v;
      }
      if (e < E) start[e] = carry + incl - padded;
      carry += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (lane == 0) s_total = carry;
  }
  __syncthreads();
  const int total = s_total;
  if (tid == 0) *p.num_padded = total;
  for (int j = tid; j < p.max_len; j += nthreads) p.sorted_ids[j] = p.numel;  // padding sentinel
  for (int b = tid; b < p.blocks; b += nthreads) {
    const int pos = b * p.block;
    int e = E - 1;  // blocks past the padded total are never read
    if (pos < total) {  // the last expert whose run starts at or before pos
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= pos) lo = mid;
        else hi = mid - 1;
      }
      e = lo;
    }
    p.expert_ids[b] = e;
  }
  if (par) {
    for (int i = tid; i < kAlignWarps * E; i += nthreads) wcur[i] += start[i % E];  // cursors
  } else {
    for (int e = tid; e < E; e += nthreads) count[e] = start[e];
  }
  __syncthreads();  // (the sentinels are written before any slot lands)
  // Stable placement, slots in order: a match-any vote per 32 slots, the lowest lane of each
  // expert's group advancing that expert's cursor (parallel: each warp over its chunk with its own
  // cursors, which start after the earlier chunks' slots of the expert).
  if (par || tid < 32) {
    int* cur = par ? wcur + warp * E : count;
    const int i_begin = par ? c0 : 0, i_end = par ? c1 : p.numel;
    for (int i0 = i_begin; i0 < i_end; i0 += 32) {
      const int i = i0 + lane;
      const int e = i < i_end ? load_id(p, i) : -1;
      const bool valid = e >= 0 && e < E;
      const unsigned peers = __match_any_sync(0xFFFFFFFFu, valid ? e : -1);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      int base = 0;
      if (valid && rank == 0) base = cur[e];
      base = __shfl_sync(0xFFFFFFFFu, base, __ffs(peers) - 1);
      if (valid) p.sorted_ids[base + rank] = i;
      __syncwarp();
      if (valid && rank == 0) cur[e] = base + __popc(peers);
      __syncwarp();
    }
  }
}

// The elementwise MoE kernels: one thread per 8-value chunk (row r, columns j..j+7) of a
// rows x p.inter output. Lets the next kernel launch at once (kTriggerFirst; else once this thread
// has waited, so that the kernel after it starts only when every kernel before this one is
// complete); false past the end, else waits for the kernel before (its output is our input).
template <bool kTriggerFirst = true>
JM_DEVICE bool chunk_of_thread(const JmMoeParams& p, int& r, int& j) {
  if constexpr (kTriggerFirst) griddep_launch_dependents();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int chunks = p.inter / 8;
  if (idx >= static_cast<int64_t>(p.rows) * chunks) return false;
  griddep_wait();
  if constexpr (!kTriggerFirst) griddep_launch_dependents();
  r = static_cast<int>(idx / chunks);
  j = static_cast<int>(idx % chunks) * 8;
  return true;
}

template <typename T>
JM_DEVICE void silu_mul_body(const JmMoeParams p) {
  int r, j;
  if (!chunk_of_thread(p, r, j)) return;
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(r) * 2 * p.inter;
  const uint4 gv = *reinterpret_cast<const uint4*>(x + j);
  const uint4 uv = *reinterpret_cast<const uint4*>(x + p.inter + j);
  const T* g = reinterpret_cast<const T*>(&gv);
  const T* u = reinterpret_cast<const T*>(&uv);
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = silu_times<T>(g[i], u[i]);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + static_cast<int64_t>(r) * p.inter + j) = out;
}

// X = T: x [rows * top_k, inter]; X = float: x [p.splits, rows * top_k, inter], the fp32 partial
// sums of an expert GEMM split along K, summed split by split, each in slot order
template <typename T, typename X>
JM_DEVICE void topk_sum_body(const JmMoeParams p) {
  int r, j;
  if (!chunk_of_thread(p, r, j)) return;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; i++) acc[i] = 0.f;
  const int splits = sizeof(X) == 4 ? p.splits : 1;
  const int64_t slice = static_cast<int64_t>(p.rows) * p.top_k * p.inter;
  for (int sp = 0; sp < splits; sp++) {
    const X* x = static_cast<const X*>(p.x) + sp * slice + static_cast<int64_t>(r) * p.top_k * p.inter + j;
    for (int s = 0; s < p.top_k; s++) {
      if constexpr (sizeof(X) == 4) {
        const float4 v0 = *reinterpret_cast<const float4*>(x + static_cast<int64_t>(s) * p.inter);
        const float4 v1 = *reinterpret_cast<const float4*>(x + static_cast<int64_t>(s) * p.inter + 4);
        acc[0] += v0.x, acc[1] += v0.y, acc[2] += v0.z, acc[3] += v0.w;
        acc[4] += v1.x, acc[5] += v1.y, acc[6] += v1.z, acc[7] += v1.w;
      } else {
        const uint4 v = *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(s) * p.inter);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] += static_cast<float>(e[i]);
      }
    }
  }
  uint4 out;
  T* o = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = static_cast<T>(acc[i]);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + static_cast<int64_t>(r) * p.inter + j) = out;
}

// Act-order MoE: position r of the expert-sorted list gathers the columns of its expert's order
// from its slot's row of x (rows x p.inter output; p.numel slots, p.block positions per expert
// block). The sorted list and the expert of each block come from the align kernel, x from the
// kernel just before (the hidden states' producer, or SiLU-mul): all read after griddep_wait.
// SILU (jm_silu_gather): x is the first expert GEMM's [slots, 2 * p.inter] output (p.top_k = 1) and
// each gathered value is silu_times(gate, up) of its column: SiLU-mul and the down projection's gather
// in one pass, the same values as the two kernels.
template <typename T, bool SILU>
JM_DEVICE void moe_gather_body(const JmMoeParams p) {
  static_assert(sizeof(T) == 2, "2-byte activations");
  int r, j;
  // the plain gather (the first expert GEMM's input) lets that GEMM launch only once the routing tables
  // (the alignment, the kernel before this one) are complete: it reads them, and streams its first weight
  // stages, before its own wait (moe.fused_marlin_moe's ready tables); jm_silu_gather triggers at once
  // -DJM_MOE_GATHER_TRIGGER_FIRST (A/B switch, with moe.MOE_W13_READY_TABLES = False): at once as before
#if defined(JM_MOE_GATHER_TRIGGER_FIRST)
  constexpr bool kTriggerFirst = true;
#else
  constexpr bool kTriggerFirst = SILU;
#endif
  if (!chunk_of_thread<kTriggerFirst>(p, r, j) || r >= *p.num_padded) return;
  const int slot = p.sorted_ids[r];
  const int64_t ld = SILU ? 2 * static_cast<int64_t>(p.inter) : p.inter;  // x's row length
  uint32_t packed[4] = {0u, 0u, 0u, 0u};
  if (slot < p.numel && p.perm == nullptr) {  // no column order: the slot's row as it is (the MoE
    // producer-form route, moe.fused_marlin_moe: a block's rows contiguous for one TMA box)
    const T* src = static_cast<const T*>(p.x) + static_cast<int64_t>(slot / p.top_k) * ld + j;
    uint4 v = *reinterpret_cast<const uint4*>(src);
    if constexpr (SILU) {
      const uint4 uv = *reinterpret_cast<const uint4*>(src + p.inter);
      T* g = reinterpret_cast<T*>(&v);
      const T* u = reinterpret_cast<const T*>(&uv);
#pragma unroll
      for (int i = 0; i < 8; i++) g[i] = silu_times<T>(g[i], u[i]);
    }
    packed[0] = v.x;
    packed[1] = v.y;
    packed[2] = v.z;
    packed[3] = v.w;
  } else if (slot < p.numel) {
    const int* perm = p.perm + static_cast<int64_t>(p.expert_ids[r / p.block]) * p.inter + j;
    const int4 c0 = *reinterpret_cast<const int4*>(perm);
    const int4 c1 = *reinterpret_cast<const int4*>(perm + 4);
    const int cols[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
    const T* src = static_cast<const T*>(p.x) + static_cast<int64_t>(slot / p.top_k) * ld;
    T o[8];
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = SILU ? silu_times<T>(src[cols[i]], src[p.inter + cols[i]]) : src[cols[i]];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      packed[i] = static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&o[2 * i])) |
                  (static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&o[2 * i + 1])) << 16);
    }
  }
  *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + static_cast<int64_t>(r) * p.inter + j) =
      make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// Router: one warp per token (row r of the [rows, num_experts] logits). Lane l holds logits
// l, l + 32, ... (up to kRouteMaxPerLane each: E <= 32 * kRouteMaxPerLane); softmax as torch computes
// it (max, exp(x - max), sum, divide, fp32); then k rounds of a warp arg-max (the larger probability,
// the lower id on ties), each winner removed; weights renormalized by their fp32 sum when asked.
constexpr int kRouteMaxPerLane = 16;

template <typename T>
JM_DEVICE void moe_route_body(const JmMoeParams p) {
  griddep_launch_dependents();
  const int r = static_cast<int>((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= p.rows) return;
  griddep_wait();  // the logits come from the kernel before
  const int E = p.num_experts;
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(r) * E;
  float v[kRouteMaxPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRouteMaxPerLane; j++) {
    const int e = lane + 32 * j;
    v[j] = e < E ? static_cast<float>(x[e]) : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, d));
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kRouteMaxPerLane; j++) {
    v[j] = lane + 32 * j < E ? expf(v[j] - mx) : -1.f;  // probabilities are >= 0: -1 marks no expert
    sum += v[j] > 0.f ? v[j] : 0.f;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
#pragma unroll
  for (int j = 0; j < kRouteMaxPerLane; j++)
    if (v[j] >= 0.f) v[j] = v[j] / sum;
  float picked = 0.f, wsum = 0.f;
  int picked_id = 0;
  for (int q = 0; q < p.top_k; q++) {
    float best = -2.f;
    int best_e = 0x7FFFFFFF;
#pragma unroll
    for (int j = 0; j < kRouteMaxPerLane; j++) {
      const int e = lane + 32 * j;
      if (v[j] > best) {  // ascending e within a lane: a tie keeps the lower id
        best = v[j];
        best_e = e;
      }
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, d);
      const int oe = __shfl_xor_sync(0xFFFFFFFFu, best_e, d);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    wsum += best;
    if (lane == q) {
      picked = best;
      picked_id = best_e;
    }
#pragma unroll
    for (int j = 0; j < kRouteMaxPerLane; j++)
      if (lane + 32 * j == best_e) v[j] = -1.f;  // taken
  }
  if (lane < p.top_k) {
    static_cast<float*>(p.y)[static_cast<int64_t>(r) * p.top_k + lane] = p.renorm ? picked / wsum : picked;
    p.route_ids[static_cast<int64_t>(r) * p.top_k + lane] = picked_id;
  }
}

}  // namespace jm

#define JM_MOE_ROUTE_KERNEL(NAME, T) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmMoeParams p) { jm::moe_route_body<T>(p); }
#define JM_MOE_ALIGN_KERNEL(NAME) \
  extern "C" __global__ void __launch_bounds__(1024) NAME(const JmMoeParams p) { jm::moe_align_body(p); }
#define JM_SILU_MUL_KERNEL(NAME, T) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmMoeParams p) { jm::silu_mul_body<T>(p); }
#define JM_TOPK_SUM_KERNEL(NAME, T) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmMoeParams p) { jm::topk_sum_body<T, T>(p); }
#define JM_TOPK_SUM_F32_KERNEL(NAME, T) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmMoeParams p) { jm::topk_sum_body<T, float>(p); }
#define JM_MOE_GATHER_KERNEL(NAME, T) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmMoeParams p) { jm::moe_gather_body<T, false>(p); }
#define JM_SILU_GATHER_KERNEL(NAME, T) \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmMoeParams p) { jm::moe_gather_body<T, true>(p); }
