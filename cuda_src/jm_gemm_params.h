// jitmarlin — the single by-value parameter of every GEMM kernel.
// Mirrored field by field by jitmarlin/ops/gemm.py (ctypes); a CPU test compiles this header
// and compares offsets and size with the ctypes structure.
#pragma once

#include <stdint.h>

struct JmGemmParams {
  const void* a;             // activations [rows, lda], fp16 or bf16
  const void* b;             // packed weights (jitmarlin layout), int32 words
  const void* s;             // scales: [K/G, N] permuted per 64 columns, or [1, N] per channel
  const void* z;             // packed zero points [K/G, N*bits/32] int32, or null
  const void* bias;          // [N] in the activation dtype, or null
  void* c;                   // output [rows, ldc]
  float* ws;                 // fp32 partial sums of split units: 2 regions per CTA
  int* counters;             // one arrival counter per CTA, all zero between launches
  const int* sorted_ids;     // MoE: (token, k) slot of each row of the padded, expert-sorted list
  const int* expert_ids;     // MoE: expert of each m tile
  const int* num_padded;     // MoE: number of rows of the padded list (device scalar)
  const float* topk_weights; // MoE: routing weight of each (token, k) slot, or null
  const int* perm;           // column gather kernel (act-order): output column j = input column perm[j]
  int64_t b_expert_stride;   // MoE: int32 words between two experts' packed weights
  int64_t s_expert_stride;   // MoE: elements between two experts' scales
  int64_t z_expert_stride;   // MoE: int32 words between two experts' zero points
  int32_t m;                 // dense: rows of A and C; MoE: number of (token, k) slots
  int32_t n;
  int32_t k;
  int32_t lda;               // row stride of A, elements
  int32_t ldc;               // row stride of C, elements
  int32_t nwarps;            // warps per CTA; a CTA covers 64 * nwarps output columns
  int32_t grid;              // CTAs launched
  int32_t top_k;             // MoE: A row of a slot = slot / top_k (1 for the down projection)
  int32_t a_by_position;     // MoE: 1 = A row r of the padded list is A[r] (pre-gathered A)
  int32_t k_splits;          // wgmma kernel: CTAs sharing one output tile along K (0 or 1: none; MoE:
                             // fp32 partial sums, one [m, ldc] slice of c per split)
  int32_t tables_ready;      // MoE, sm_90 bulk tiles and the wgmma producer form: 1 = the routing
                             // tables were complete before the previous kernel started (both expert
                             // GEMMs of moe.fused_marlin_moe where a gather runs between the alignment
                             // and the first): read them, and stream the first weight tiles, before
                             // waiting for it
  int32_t ids_shift;         // MoE, mma.sync kernel: expert of m tile i = expert_ids[i << ids_shift] (1: the
                             // low words of int64 router ids read as the table, one block per slot)
  int32_t num_experts;       // MoE, mma.sync kernel: expert ids are clamped to num_experts - 1 (0: not)
  int32_t silu_out;          // MoE, sm_90a producer form without zero points: 1 = the gate/up GEMM writes
                             // SiLU(gate) * up by position into c [rows of the padded list, n / 2]
                             // (jm_wgmma.cuh, "SiLU epilogue"); 0 = the GEMM's output. (Fills the
                             // padding before `timeline`: the struct's size and offsets are unchanged.)
  unsigned long long* timeline;  // diagnostics, kernels built with -DJM_TIMELINE: 8 values per CTA
                                 // (jm_gemm.cuh, "timeline"), or null
};
