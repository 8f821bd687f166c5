// jitmarlin — the strip kernel: M <= 32 tokens with no partial sums in global memory.
//
// Why a second small-M kernel: at M <= 16 the striped GEMM (jm_gemm.cuh) streams its weights at the
// copy rate, but a call on a mid-size layer ends with several microseconds of fix-up (the K splits of
// an output unit summed through the workspace: store, fence, counter, the last CTA's loads) and
// straggling CTAs (H200 timelines, benchmarks/NOTES.md sessions 11 and 49: 8192^2 M = 1 busy 7.9 us of
// a 14.3 us call, exit 4.2). A kernel that only streams the same bytes, timed the same way, runs at
// 92-105% of the copy floor on those layers (benchmarks/floor_probe.cu). This kernel is shaped like that
// stream: every CTA owns one 64-column strip of the output (or 1/CLUSTER of its K, the CTAs of a
// thread-block cluster summing through distributed shared memory), every warp streams a contiguous
// run of k16 rows of that strip (all runs within one row of each other) with its own 16-byte loads,
// DEPTH k16 rows ahead in registers or SRING rows in a lane-private shared-memory ring (no producer, no
// barrier in the main loop), and the warps meet once, in shared memory, at the end. All CTAs carry the
// same bytes, so they end together.
//
// MMA form ("swap", as the 8-row tiles of jm_gemm.cuh): the weights are the A operand of
// mma.m16n8k16 (16 output features x 16 k) and the tokens its 8 columns. In the packed layout
// (jitmarlin/quant/layout.py; the word and nibble map also in jm_dequant.cuh) lane (g, t)'s word j
// of a k16 row holds features 16j + g (n8-block 2j) and 16j + 8 + g (block 2j + 1) at k 2t, 2t+1,
// 2t+8, 2t+9: dequantized, that is exactly the A fragment {f0.b0, f1.b0, f0.b1, f1.b1} of the 16
// features 16j..16j+15. The B fragment is lane (g, t)'s token g at the same k: two 32-bit loads.
// Group scales multiply the fp32 sums of each group's rows in the warp's run (one block of 8 tokens) or the
// weights (two to four blocks); per-channel scales and the bias are applied to the final sums.
//
// Act-order (PERM): the activations of k are A[:, perm[k]] (the weights' rows sorted by group at load time), gathered
// here instead of by a kernel before this one (whose launch boundary cost 1.2-3.4 us on GEMMs of 7-26 us, H200
// session 38). Lane (g, t) needs columns perm[16 kt + {2t, 2t+1, 2t+8, 2t+9}] of k16 row kt. Register rings: each
// warp copies its run of the layer-constant perm to shared memory at the start (cp.async), reads a row's indices
// there and gathers the row's activation halves a batch (DEPTH rows) ahead, like its weights (session 54).
// Shared-memory rings: two 8-byte loads of perm per row, PD rows before the row's gathers (a ring of indices in
// registers), the gathered halves PA = DEPTH / 2 rows ahead. Either way the halves stay unpacked until their row is
// computed: pairing them as they were loaded waited for the loads at every row (sm_90a SASS, session 53).
//
// MoE (MOE; expert blocks of 8 rows, moe._moe_gemm_cuda): the grid holds N / 64 * CLUSTER CTAs per block of the
// expert-sorted slot list (moe_align_block_size's, or one_token_tables': block j = slot j), block after block
// (blockIdx.x / (N / 64 * CLUSTER)), blocks past the padded list's end leaving at once. A block's CTAs stream the
// weights of its expert (p.expert_ids[block << ids_shift], clamped to num_experts - 1 where that is set); lane g's
// token is slot sorted_ids[8 block + g] (padding: >= p.m), activation row slot / top_k (p.a_by_position: the position
// 8 block + g), written to output row `slot`, times the slot's routing weight where p.topk_weights is given. The ids are
// read after griddepcontrol.wait unless p.tables_ready (then the weights stream before it, as in the dense form).
//
// Launch (gemm.launch_strip): grid = N / 64 * CLUSTER CTAs of 32 * WARPS threads, clusters of CLUSTER
// along x when CLUSTER > 1; p.m <= 8 * TOKS; N a multiple of 64; K a multiple of 16 and of the group size; dynamic
// shared memory: WARPS x SRING x (BITS / 4 x 512 + TOKS x 256, not act-order) bytes, or for an act-order form with
// register rings 64 bytes per k16 row of the CTA's share of K (K.strip_smem_bytes).
#pragma once

// (for benchmarks/strip_probe.cu, which builds against this header and an older one: since session 54 the rows of a
// shared-memory ring hold the activations too, and the ring forms take fewer rows, K.strip_ring_rows)
#define JM_STRIP_RING_ACTS 1

#include "jm_dequant.cuh"
#include "jm_gemm_params.h"

namespace jm {

// Diagnostics (-DJM_STRIP_TRACE, benchmarks/strip_probe.cu only; p.timeline then holds 64 values per CTA): lane 0 of
// warp 0 of each CTA writes the global timer at its entry (slot 0), past griddepcontrol.wait (1), after its first row
// (2), at the end of each group of its run (8 + i, i < 48), past its main loop (3) and before the output (4). Without
// the macro nothing is recorded.
#ifdef JM_STRIP_TRACE
#define JM_STRIP_MARK(slot)                                                                               \
  do {                                                                                                   \
    if (threadIdx.x == 0 && p.timeline != nullptr) p.timeline[blockIdx.x * 64 + (slot)] = globaltimer(); \
  } while (0)
// the end of a group of the run (uses the kernel's trace_groups counter)
#define JM_STRIP_GROUP_MARK()                                 \
  do {                                                        \
    if (trace_groups < 48) JM_STRIP_MARK(8 + trace_groups);   \
    trace_groups++;                                           \
  } while (0)
#else
#define JM_STRIP_MARK(slot) \
  do {                      \
  } while (0)
#define JM_STRIP_GROUP_MARK() \
  do {                        \
  } while (0)
#endif

// TOKS: token blocks of 8 (1: M <= 8, 2: M <= 16, 3 / 4: M <= 24 / 32). With one block the group scales multiply each
// group's fp32 sums; with more the registers for a second set of sums are not there, so they multiply the dequantized
// weights (fp16 / bf16, as the other kernels do). Every weight fragment feeds TOKS MMAs.
//
// SRING: 0 = the weights' ring is DEPTH rows of registers per lane; > 0 = SRING rows per lane in shared memory, filled
// by each lane's own 16-byte cp.async (no registers held while in flight, so 2x the bytes in flight of the register
// ring at 16 warps per SM), and since session 54 the activations with them (each lane's 8 bytes per token block and
// row, 4-byte copies), one commit group per row: no global load into a register in the main loop, so no wait for
// one (act-order: the activations in a register ring of DEPTH rows, gathered). Each lane reads back only what it
// copied itself, so no barrier is needed, only cp.async.wait_group.
template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS, int WARPS, int DEPTH, int CLUSTER, int TOKS, int SRING,
          bool PERM, bool MOE>
JM_DEVICE void strip_body(const JmGemmParams& p) {
  static_assert(!MOE || (TOKS == 1 && !PERM), "the MoE form: blocks of 8 rows, no act-order");
  static_assert(BITS == 4 || BITS == 8, "4- or 8-bit weights");
  static_assert(CLUSTER == 1 || CLUSTER == 2 || CLUSTER == 4, "clusters of 1, 2 or 4 CTAs");
  static_assert(WARPS >= 1 && WARPS <= 16 && DEPTH >= 1, "warps and depth");
  static_assert(TOKS >= 1 && TOKS <= 4, "one to four blocks of 8 tokens");
  static_assert(TOKS <= 2 || WARPS <= 8, "three or four token blocks: at most 8 warps per CTA (8 per SM)");
  static_assert(SRING == 0 || (SRING % DEPTH == 0 && SRING * (BITS / 4) >= 4),
                "a shared-memory ring: a multiple of the activation ring, and room for a warp's 2 KB of sums");
  constexpr bool kGrouped = GROUP_BLOCKS > 0;
  constexpr bool kFold = kGrouped && TOKS == 1;  // group scales on the fp32 sums (else on the weights)
  constexpr int kVec = BITS / 4;                     // 16-byte words per lane per k16 row
  constexpr int kRowWords = 32 * BITS;               // int32 words of one 16 x 64 tile

  constexpr bool kSmemRing = SRING > 0;
  constexpr bool kActCopy = kSmemRing && !PERM;  // the activations through the ring too
  constexpr int kActRowBytes = kActCopy ? TOKS * 256 : 0;  // a ring row's activations: 32 lanes x TOKS x 8 bytes
  constexpr int kWarpRingBytes = (kSmemRing ? SRING : 1) * (kVec * 512 + kActRowBytes);  // a warp's ring (dynamic)
  extern __shared__ __align__(16) uint8_t strip_dyn[];
  __shared__ float red_regs[kSmemRing ? 1 : WARPS][8][64];  // each warp's sums of one token block: [token][feature]
  // (with a shared-memory ring, warp w's sums go to the start of its own ring, free after its main loop)
  auto red = [&](int w, int tok, int f) -> float& {
    if constexpr (kSmemRing) return reinterpret_cast<float*>(strip_dyn + w * kWarpRingBytes)[tok * 64 + f];
    else return red_regs[w][tok][f];
  };
  __shared__ float sums[8 * TOKS][64];                // this CTA's sums over its warps
  __shared__ float recv[CLUSTER > 1 ? CLUSTER - 1 : 1][8 * TOKS][64];  // rank 0: the other CTAs' sums

  JM_STRIP_MARK(0);
#ifdef JM_STRIP_TRACE
  int trace_groups = 0;
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = CLUSTER > 1 ? static_cast<int>(cluster_ctarank()) : 0;
  int strip = static_cast<int>(blockIdx.x) / CLUSTER;
  // MoE: this CTA's block, its expert (offsets of its weights, scales, zero points), lane g's slot and activation row
  int block = 0;
  bool my_row = false;  // (MoE: lane g's row holds a slot)
  int64_t w_off = 0, s_off = 0, z_off = 0, a_row = 0;
  if constexpr (MOE) {
    // the tables may be the previous kernel's output: wait for it, unless they were complete before it started
    // (p.tables_ready), before they address the weights
    if (!p.tables_ready) griddep_wait();
    const int block_ctas = p.n / 64 * CLUSTER;  // the CTAs of one block
    strip = static_cast<int>(blockIdx.x) % block_ctas / CLUSTER;
    block = static_cast<int>(blockIdx.x) / block_ctas;
    if (8 * block >= *p.num_padded) return;  // past the padded list (the whole CTA: no barrier reached yet)
    int expert = p.expert_ids[block << p.ids_shift];
    if (p.num_experts > 0) {
      expert = static_cast<int>(min(static_cast<unsigned>(expert), static_cast<unsigned>(p.num_experts - 1)));
    }
    w_off = expert * p.b_expert_stride;
    s_off = expert * p.s_expert_stride;
    z_off = expert * p.z_expert_stride;
    const int my_slot = p.sorted_ids[8 * block + g];
    my_row = my_slot < p.m;
    a_row = p.a_by_position ? 8 * block + g : my_slot / p.top_k;
  }
  auto row_ok = [&](int b) -> bool {  // lane g's token in token block b has a row
    if constexpr (MOE) return my_row;
    else return g + 8 * b < p.m;
  };
  const int n = p.n, k16 = p.k / 16;

  // this warp's run of k16 rows, as even as they split over the CLUSTER * WARPS workers (within one row: a run
  // may start or end inside a scale group, whose partial sums are scaled like whole ones)
  const int workers = CLUSTER * WARPS, worker = rank * WARPS + warp;
  const int kt0 = static_cast<int>(static_cast<int64_t>(k16) * worker / workers);
  const int kt1 = static_cast<int>(static_cast<int64_t>(k16) * (worker + 1) / workers);
  const int rows = kt1 - kt0;
  const int cta_kt0 = static_cast<int>(static_cast<int64_t>(k16) * (rank * WARPS) / workers);  // this CTA's first row

  // the packed weights are [N/64 strips][K/16][32 * BITS words] (jitmarlin/quant/layout.py): a strip is
  // contiguous along K, and lane l's words of a k16 row are the 16-byte vectors l (and 32 + l for 8-bit)
  constexpr int kRowVecs = kRowWords / 4;  // 16-byte vectors of one k16 row of a strip
  const uint4* wbase = reinterpret_cast<const uint4*>(p.b) + static_cast<int64_t>(strip) * k16 * kRowVecs + lane;
  const T* arow = static_cast<const T*>(p.a) + static_cast<int64_t>(g) * p.lda + 2 * t;  // token g (+ 8)
  if constexpr (MOE) {  // the slot's expert (its word offset is a whole number of 16-byte vectors) and row
    wbase += w_off / 4;
    arow = static_cast<const T*>(p.a) + a_row * p.lda + 2 * t;
  }
  const int64_t a_next = static_cast<int64_t>(8) * p.lda;

  uint4 wr[kSmemRing ? 1 : DEPTH][kVec];
  uint32_t ar[PERM ? 1 : DEPTH][2 * TOKS];  // the activations of rows i .. i + DEPTH - 1 (act-order: araw below)
  auto load_w = [&](uint4 (&dst)[kVec], int kt) {
#pragma unroll
    for (int v = 0; v < kVec; v++) dst[v] = ldg_stream(wbase + kt * kRowVecs + 32 * v);
  };
  uint8_t* const my_ring = strip_dyn + warp * kWarpRingBytes + lane * 16;  // this lane's 16 bytes of each slot
  auto issue_w = [&](int slot, int kt) {
#pragma unroll
    for (int v = 0; v < kVec; v++) cp_async16(my_ring + (slot * kVec + v) * 512, wbase + kt * kRowVecs + 32 * v);
  };
  // this lane's activations of each ring row (kActCopy): after the weights, 8 bytes per token block
  uint8_t* const my_act = strip_dyn + warp * kWarpRingBytes + SRING * kVec * 512 + lane * 8 * TOKS;
  auto load_a = [&](uint32_t (&dst)[2 * TOKS], int kt) {
#pragma unroll
    for (int b = 0; b < TOKS; b++) {
      if (row_ok(b)) {
        const T* src = arow + b * a_next + kt * 16;
        dst[2 * b] = *reinterpret_cast<const uint32_t*>(src);
        dst[2 * b + 1] = *reinterpret_cast<const uint32_t*>(src + 8);
      } else {
        dst[2 * b] = 0u;
        dst[2 * b + 1] = 0u;
      }
    }
  };
  auto issue_a = [&](int slot, int kt) {  // kActCopy: row kt's activations into ring row `slot` (0 past M)
#pragma unroll
    for (int b = 0; b < TOKS; b++) {
      const bool ok = row_ok(b);
      const T* src = ok ? arow + b * a_next + kt * 16 : static_cast<const T*>(p.a);
      uint8_t* dst = my_act + slot * kActRowBytes + 8 * b;
      cp_async_small<4>(dst, src, ok);
      cp_async_small<4>(dst + 4, ok ? src + 8 : src, ok);
    }
  };
  // act-order: the columns of lane (g, t) in k16 row kt, {perm[2t], perm[2t+1]} and {perm[2t+8], perm[2t+9]}.
  // Register rings (kPermSmem): the warp's whole run of the permutation is copied to shared memory (dynamic, after
  // the CTA's other uses: K.strip_smem_bytes) by cp.async at the start, so a gather's indices are shared-memory
  // loads, and the gathered halves are a whole batch (DEPTH rows) ahead. Shared-memory rings: an index ring of PD
  // rows in registers, PA rows of gathered halves.
  constexpr bool kPermSmem = PERM && !kSmemRing;
  constexpr int PA = PERM && !kPermSmem ? (DEPTH >= 2 ? DEPTH / 2 : 1) : DEPTH;  // rows of gathered halves ahead
  constexpr int PD = PERM && !kPermSmem ? PA : 1;                                 // index ring rows (ahead of them)
  static_assert(DEPTH % PA == 0 && DEPTH % PD == 0, "the act-order rings divide the weights' ring");
  const int* const perm_t = static_cast<const int*>(p.perm) + 2 * t;
  auto load_perm = [&](int2 (&dst)[2], int kt) {
    if constexpr (PERM) {
      dst[0] = __ldg(reinterpret_cast<const int2*>(perm_t + kt * 16));
      dst[1] = __ldg(reinterpret_cast<const int2*>(perm_t + kt * 16 + 8));
    }
  };
  const T* const arow0 = static_cast<const T*>(p.a) + static_cast<int64_t>(g) * p.lda;  // token g, column 0
  // the four gathered halves of each token block, one per register (paired by pack_a when their row is computed)
  auto load_a_perm = [&](uint32_t (&dst)[4 * TOKS], const int2 (&c)[2]) {
#pragma unroll
    for (int b = 0; b < TOKS; b++) {
      if (row_ok(b)) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(arow0 + b * a_next);
        dst[4 * b] = src[c[0].x];
        dst[4 * b + 1] = src[c[0].y];
        dst[4 * b + 2] = src[c[1].x];
        dst[4 * b + 3] = src[c[1].y];
      } else {
#pragma unroll
        for (int q = 0; q < 4; q++) dst[4 * b + q] = 0u;
      }
    }
  };
  auto pack_a = [&](const uint32_t (&h)[4 * TOKS], uint32_t (&dst)[2 * TOKS]) {
#pragma unroll
    for (int b = 0; b < TOKS; b++) {
      dst[2 * b] = h[4 * b] | (h[4 * b + 1] << 16);
      dst[2 * b + 1] = h[4 * b + 2] | (h[4 * b + 3] << 16);
    }
  };

  // scales (and zero points) of a group: lane g's 8 halves are the scales of columns g + 8e (the
  // 64-column permutation of jitmarlin.quant.permute_scales), e = the n8-block
  const T* sbase = static_cast<const T*>(p.s) + strip * 64 + 8 * g;
  const uint32_t* zbase = static_cast<const uint32_t*>(p.z) + strip * (BITS * 2) + (BITS == 4 ? g : 2 * g);
  if constexpr (MOE) {  // the slot's expert
    sbase += s_off;
    zbase += z_off;
  }
  const int zrow = n * BITS / 32;
  auto load_s = [&](int grp) -> uint4 {
    if constexpr (kGrouped) return __ldg(reinterpret_cast<const uint4*>(sbase + static_cast<int64_t>(grp) * n));
    else return make_uint4(0, 0, 0, 0);
  };
  auto load_z = [&](int grp) -> uint2 {
    uint2 z = make_uint2(0u, 0u);
    if constexpr (HAS_ZP) {
      const uint32_t* src = zbase + static_cast<int64_t>(grp) * zrow;
      z.x = __ldg(src);
      if constexpr (BITS == 8) z.y = __ldg(src + 1);
    }
    return z;
  };

  // The weights, scales and zero points never depend on the previous kernel: out before the wait.
  const int grp0 = kGrouped ? kt0 / GROUP_BLOCKS : 0;
  const int grp_last = kGrouped && rows > 0 ? (kt1 - 1) / GROUP_BLOCKS : 0;  // the run's last group
  if constexpr (kSmemRing) {
#pragma unroll
    for (int d = 0; d < SRING; d++) {
      if (d < rows) issue_w(d, kt0 + d);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int d = 0; d < DEPTH; d++)
      if (d < rows) load_w(wr[d], kt0 + d);
  }
  // Register rings: the group scales (zero points) reach shared memory by cp.async, group q of the run into slot
  // q % 2 of the warp's ring, one group ahead (fetched where group q - 2 ends, after its slot was read), each group's
  // copies one commit group, waited for by count. A register loaded from global memory would be waited for with every
  // weight load in flight (see the main loop below). The four lanes of a row g use the same scales: lane (g, 0)
  // copies them, and the lanes meet (__syncwarp) after its wait and before it overwrites a slot.
  constexpr bool kCopyScales = kGrouped && !kSmemRing;
  __shared__ uint4 s_ring[kCopyScales ? WARPS : 1][2][8];
  __shared__ uint2 z_ring[kCopyScales && HAS_ZP ? WARPS : 1][2][8];
  auto fetch_group = [&](int q) {
    if constexpr (kCopyScales) {
      const int grp = grp0 + q;
      if (t == 0 && rows > 0 && grp <= grp_last) {
        cp_async16(&s_ring[warp][q % 2][g], sbase + static_cast<int64_t>(grp) * n);
        if constexpr (HAS_ZP) {
          cp_async_small<BITS == 4 ? 4 : 8>(&z_ring[warp][q % 2][g], zbase + static_cast<int64_t>(grp) * zrow);
        }
      }
      cp_async_commit();  // (empty past the run's last group: the count stays one group per fetch)
    }
  };
  // act-order, register rings: the warp's run of the permutation (rows x 16 indices) into shared memory, one commit
  // group (before the scales' groups: see fetch_group), each lane 16-byte chunks c = lane + 32 j
  const int* const perm_run = reinterpret_cast<const int*>(strip_dyn) + 16 * (kt0 - cta_kt0);
  if constexpr (kPermSmem) {
    const int* src = static_cast<const int*>(p.perm) + 16 * kt0;
    for (int c = lane; c < 4 * rows; c += 32) cp_async16(const_cast<int*>(perm_run) + 4 * c, src + 4 * c);
    cp_async_commit();
  }
  uint4 s_cur = make_uint4(0, 0, 0, 0), s_next = s_cur;
  uint2 z_cur = make_uint2(0u, 0u), z_next = z_cur;
  if constexpr (kCopyScales) {
    fetch_group(0);
    fetch_group(1);
  } else if (rows > 0) {  // (shared-memory rings: the next group's one group ahead in s_next, see pass_on16)
    s_cur = load_s(grp0);
    z_cur = load_z(grp0);
    s_next = load_s(min(grp0 + 1, grp_last));
    z_next = load_z(min(grp0 + 1, grp_last));
  }
  auto perm_cols = [&](int2 (&dst)[2], int i) {  // row i of the run (kPermSmem): this lane's four columns
    dst[0] = *reinterpret_cast<const int2*>(perm_run + 16 * i + 2 * t);
    dst[1] = *reinterpret_cast<const int2*>(perm_run + 16 * i + 2 * t + 8);
  };
  // act-order, shared-memory rings: the first PA rows' columns (for the gathers after the wait) and the index ring's
  // PD rows after them
  int2 pfirst[PERM && !kPermSmem ? PA : 1][2], pr[PD][2];
  if constexpr (PERM && !kPermSmem) {
#pragma unroll
    for (int d = 0; d < PA; d++)
      if (d < rows) load_perm(pfirst[d], kt0 + d);
#pragma unroll
    for (int d = 0; d < PD; d++)
      if (PA + d < rows) load_perm(pr[d], kt0 + PA + d);
  }
  if constexpr (CLUSTER > 1) cluster_arrive_relaxed();  // phase 0: this CTA runs (its shared memory exists)
  griddep_launch_dependents();
  griddep_wait();
  JM_STRIP_MARK(1);
  uint32_t araw[PERM ? PA : 1][4 * TOKS];  // act-order: the gathered halves of rows i .. i + PA - 1
  if constexpr (kPermSmem) {
    cp_async_wait_fenced<kCopyScales ? 2 : 0>();  // the permutation's group (the scales' two may be in flight)
    __syncwarp();
  }
  if constexpr (kActCopy) {
    // the first SRING rows' activations, a commit group per row after the weights' SRING groups: row i < SRING then
    // waits with SRING - 1 groups after its activations' (SRING - 1 - i of these, i of the loop's), as every later
    // row does after its one group (weights and activations)
#pragma unroll
    for (int d = 0; d < SRING; d++) {
      if (d < rows) issue_a(d, kt0 + d);
      cp_async_commit();
    }
  }
#pragma unroll
  for (int d = 0; d < (kActCopy ? 0 : PERM ? PA : DEPTH); d++) {
    if (d < rows) {
      if constexpr (kPermSmem) {
        int2 c[2];
        perm_cols(c, d);
        load_a_perm(araw[d], c);
      } else if constexpr (PERM) {
        load_a_perm(araw[d], pfirst[d]);
      } else {
        load_a(ar[d], kt0 + d);
      }
    }
  }
  // row i's activations (slot d = i % DEPTH of the unrolled loop), then the loads of a later row into the freed slot:
  // row i + DEPTH's, or with PERM row i + PA's gathers from the index ring, which then takes row i + PA + PD
  // (slot (i + PA) % PA = (i + PA + PD) % PD = d % PA)
  auto take_a = [&](uint32_t (&dst)[2 * TOKS], int d) {
    if constexpr (PERM) pack_a(araw[d % PA], dst);
    else {
#pragma unroll
      for (int q = 0; q < 2 * TOKS; q++) dst[q] = ar[d % DEPTH][q];
    }
  };
  auto next_a = [&](int d, int i) {
    if constexpr (kPermSmem) {
      if (i + DEPTH < rows) {
        int2 c[2];
        perm_cols(c, i + DEPTH);
        load_a_perm(araw[d], c);
      }
    } else if constexpr (PERM) {
      if (i + PA < rows) {
        load_a_perm(araw[d % PA], pr[d % PD]);
        if (i + PA + PD < rows) load_perm(pr[d % PD], kt0 + i + PA + PD);
      }
    } else {
      if (i + DEPTH < rows) load_a(ar[d % DEPTH], kt0 + i + DEPTH);
    }
  };

  float acc[TOKS][4][4], part[kFold ? 4 : 1][4];
#pragma unroll
  for (int j = 0; j < 4; j++)
#pragma unroll
    for (int q = 0; q < 4; q++) {
#pragma unroll
      for (int b = 0; b < TOKS; b++) acc[b][j][q] = 0.f;
      part[kFold ? j : 0][q] = 0.f;
    }

  ZeroConst zc[8];
  auto set_zeros = [&](uint2 z) {
#pragma unroll
    for (int e = 0; e < 8; e++) {
      uint32_t zv = BITS == 4 ? 8u : 128u;
      if constexpr (HAS_ZP) {
        if constexpr (BITS == 4) zv = (z.x >> (4 * e)) & 0xFu;
        else zv = ((e < 4 ? z.x : z.y) >> (8 * (e & 3))) & 0xFFu;
      }
      zc[e] = make_zero_const<T, BITS>(zv);
    }
  };
  if constexpr (kCopyScales) {
    cp_async_wait_fenced<1>();  // the run's first group (the second may still be in flight)
    __syncwarp();
    s_cur = s_ring[warp][0][g];
    if constexpr (HAS_ZP) z_cur = z_ring[warp][0][g];
  }
  set_zeros(z_cur);
  // shared-memory rings: this lane's slot for the next group's scales / zero points (pass_on16: a lane reads only
  // what it wrote)
  constexpr bool kPassOn = kGrouped && kSmemRing;
  __shared__ uint4 s_slots[kPassOn ? WARPS : 1][32];
  __shared__ uint2 z_slots[kPassOn && HAS_ZP ? WARPS : 1][32];
  const uint4* const s_slot_ptr = &s_slots[kPassOn ? warp : 0][lane];
  const uint2* const z_slot_ptr = &z_slots[kPassOn && HAS_ZP ? warp : 0][lane];
  const uint32_t s_slot = smem_addr(s_slot_ptr), z_slot = smem_addr(z_slot_ptr);
  // folding (one token block), the current group's scales are read from the slot where the group ends, not held in
  // registers (the act-order forms are at the register limit)
  if constexpr (kFold && kPassOn) *const_cast<uint4*>(s_slot_ptr) = s_cur;

  auto compute = [&](const uint4 (&w)[kVec], const uint32_t (&a)[2 * TOKS]) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(w);
    const uint16_t* sh = reinterpret_cast<const uint16_t*>(&s_cur);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      Frag f0, f1;
      if constexpr (BITS == 4) {
        dequant4<T>(words[j], zc[2 * j], zc[2 * j + 1], f0, f1);
      } else {
        f0 = dequant8<T>(words[2 * j], zc[2 * j]);
        f1 = dequant8<T>(words[2 * j + 1], zc[2 * j + 1]);
      }
      if constexpr (kGrouped && !kFold) {  // the group's scales on the weights: halves 2j / 2j+1, doubled
        const uint32_t s0 = sh[2 * j] * 0x10001u, s1 = sh[2 * j + 1] * 0x10001u;
        f0.b0 = mul2<T>(f0.b0, s0);
        f0.b1 = mul2<T>(f0.b1, s0);
        f1.b0 = mul2<T>(f1.b0, s1);
        f1.b1 = mul2<T>(f1.b1, s1);
      }
      const uint32_t af[4] = {f0.b0, f1.b0, f0.b1, f1.b1};
      if constexpr (kFold) {
        mma_16816<T>(part[j], af, a[0], a[1]);
      } else {
#pragma unroll
        for (int b = 0; b < TOKS; b++) mma_16816<T>(acc[b][j], af, a[2 * b], a[2 * b + 1]);
      }
    }
  };
  // fold the finished group's sums into acc with its scales (halves 2j / 2j+1: features 16j+g / 16j+8+g)
  auto fold = [&](const uint4 sg) {
    if constexpr (kFold) {
      const T* sh = reinterpret_cast<const T*>(&sg);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float lo = static_cast<float>(sh[2 * j]), hi = static_cast<float>(sh[2 * j + 1]);
        acc[0][j][0] = fmaf(part[j][0], lo, acc[0][j][0]);
        acc[0][j][1] = fmaf(part[j][1], lo, acc[0][j][1]);
        acc[0][j][2] = fmaf(part[j][2], hi, acc[0][j][2]);
        acc[0][j][3] = fmaf(part[j][3], hi, acc[0][j][3]);
#pragma unroll
        for (int q = 0; q < 4; q++) part[j][q] = 0.f;
      }
    }
  };

  // after row i of the run: a group (or the run) ends -> fold its sums, the next group's scales and zeros
  auto after_row = [&](int i) {
    if constexpr (kGrouped) {
      if ((kt0 + i + 1) % GROUP_BLOCKS == 0 || i + 1 == rows) {  // row i ends a group or the run
        if constexpr (kCopyScales) {
          const int q = (kt0 + i) / GROUP_BLOCKS - grp0;  // the group ending, its scales in slot q % 2 (landed)
          fold(s_ring[warp][q % 2][g]);
          JM_STRIP_GROUP_MARK();
          __syncwarp();  // every lane has read slot (q + 2) % 2 = q % 2 (just above)
          fetch_group(q + 2);
          cp_async_wait_fenced<1>();  // group q + 1's (fetched a group ago) have landed
          __syncwarp();
          if constexpr (!kFold) s_cur = s_ring[warp][(q + 1) % 2][g];
          if constexpr (HAS_ZP) set_zeros(z_ring[warp][(q + 1) % 2][g]);
          return;
        }
        fold(*s_slot_ptr);
        JM_STRIP_GROUP_MARK();
        // the next group's scales (landed: loaded a group ago) into this lane's slot, where fold reads them (and
        // s_cur, where they go on the weights), and the group after it into s_next in place (pass_on16)
        const int nxt = (kt0 + i + 1) / GROUP_BLOCKS + 1;  // the group after the next one
        const bool more = nxt <= grp_last;
        pass_on16(s_slot, s_next, more, sbase + static_cast<int64_t>(more ? nxt : 0) * n);
        if constexpr (!kFold) s_cur = *s_slot_ptr;
        if constexpr (HAS_ZP) {
          const uint32_t* zsrc = zbase + static_cast<int64_t>(more ? nxt : 0) * zrow;
          pass_on4(z_slot, z_next.x, more, zsrc);
          if constexpr (BITS == 8) pass_on4(z_slot + 4, z_next.y, more, zsrc + 1);
          set_zeros(*z_slot_ptr);
        }
      }
    }
  };

  if constexpr (kSmemRing) {
    for (int base = 0; base < rows; base += SRING) {
#pragma unroll
      for (int d = 0; d < SRING; d++) {
        const int i = base + d;
        if (i < rows) {
          cp_async_wait_fenced<SRING - 1>();  // row i's group (each row one group, committed in order) has landed
          uint4 w[kVec];
#pragma unroll
          for (int v = 0; v < kVec; v++) w[v] = *reinterpret_cast<const uint4*>(my_ring + (d * kVec + v) * 512);
          uint32_t a_now[2 * TOKS];
          if constexpr (kActCopy) {
#pragma unroll
            for (int q = 0; q < 2 * TOKS; q++)
              a_now[q] = reinterpret_cast<const uint32_t*>(my_act + d * kActRowBytes)[q];
          } else {
            take_a(a_now, d);
          }
          compiler_fence();  // (the slot's reads above the copies that refill it)
          if (i + SRING < rows) {
            issue_w(d, kt0 + i + SRING);
            if constexpr (kActCopy) issue_a(d, kt0 + i + SRING);
          }
          cp_async_commit();
          compute(w, a_now);
          if (i == 0) JM_STRIP_MARK(2);
          if constexpr (!kActCopy) next_a(d, i);
          after_row(i);
        }
      }
    }
    cp_async_wait_fenced<0>();  // (nothing left in flight; the ring's start takes the warp's sums next)
  } else {
    // Whole batches of DEPTH rows, every row present, then the last rows. ptxas tracks a load's result with a
    // scoreboard counter shared by all of the warp's global loads and waits for the counter to drain; with a guard
    // around each row (`if (i < rows)`) a path skipped the previous rows' first read (where the batch's wait is),
    // so every row waited for the loads the row before it had just issued: one memory round trip per k16 row
    // (sm_90a SASS, benchmarks/sass_waits.py, session 54). Unguarded, the first row's read waits once per batch
    // for the DEPTH rows in flight and the other rows read registers that are complete.
    auto row_step = [&](int d, int i) {
      uint32_t a_now[2 * TOKS];
      take_a(a_now, d);
      compute(wr[d], a_now);
      if (i == 0) JM_STRIP_MARK(2);
      if (i + DEPTH < rows) load_w(wr[d], kt0 + i + DEPTH);
      next_a(d, i);
      after_row(i);
    };
    // (The act-order forms: their indices come from shared memory and their gathered halves are loaded a batch
    // ahead, like the weights; with indices in registers the unguarded batches spilled, ptxas sm_90.)
    int base = 0;
    for (; base + DEPTH <= rows; base += DEPTH) {
#pragma unroll
      for (int d = 0; d < DEPTH; d++) row_step(d, base + d);
    }
#pragma unroll
    for (int d = 0; d < DEPTH - 1; d++)
      if (base + d < rows) row_step(d, base + d);
  }

  JM_STRIP_MARK(3);
  // the warps' sums meet in shared memory, one token block at a time: red[warp][token][feature] -> sums
  constexpr int kThreads = 32 * WARPS;
  const int m = MOE ? 8 : p.m;  // (MoE: the block's rows, padding skipped at the write)
#pragma unroll
  for (int b = 0; b < TOKS; b++) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      red(warp, 2 * t, 16 * j + g) = acc[b][j][0];
      red(warp, 2 * t + 1, 16 * j + g) = acc[b][j][1];
      red(warp, 2 * t, 16 * j + 8 + g) = acc[b][j][2];
      red(warp, 2 * t + 1, 16 * j + 8 + g) = acc[b][j][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 8 * 64; i += kThreads) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; w++) v += red(w, i >> 6, i & 63);
      sums[8 * b + (i >> 6)][i & 63] = v;
    }
    __syncthreads();
  }
  if constexpr (CLUSTER > 1) {
    cluster_wait();  // phase 0 complete: every CTA of the cluster has started
    if (rank != 0) {
      for (int i = threadIdx.x; i < m * 64; i += kThreads)
        st_cluster_f32(smem_addr(&recv[rank - 1][i >> 6][i & 63]), 0, sums[i >> 6][i & 63]);
    }
    cluster_arrive_release();
    cluster_wait();  // phase 1: rank 0 holds every share
    if (rank != 0) return;
  }
  JM_STRIP_MARK(4);
  T* out = static_cast<T*>(p.c);
  const T* bias = static_cast<const T*>(p.bias);
  for (int i = threadIdx.x; i < m * 64; i += kThreads) {
    const int tok = i >> 6, f = i & 63;
    float v = sums[tok][f];
    if constexpr (CLUSTER > 1) {
#pragma unroll
      for (int r = 0; r < CLUSTER - 1; r++) v += recv[r][tok][f];
    }
    const int col = strip * 64 + f;
    if constexpr (!kGrouped) v *= static_cast<float>(static_cast<const T*>(p.s)[s_off + col]);  // per channel
    if (bias != nullptr) v += static_cast<float>(bias[col]);
    if constexpr (MOE) {
      const int slot = p.sorted_ids[8 * block + tok];
      if (slot >= p.m) continue;  // padding
      if (p.topk_weights != nullptr) v *= p.topk_weights[slot];
      out[static_cast<int64_t>(slot) * p.ldc + col] = static_cast<T>(v);
    } else {
      out[static_cast<int64_t>(tok) * p.ldc + col] = static_cast<T>(v);
    }
  }
}

}  // namespace jm

// Launch bounds: 16 warps per SM (1 / 2 / 4 CTAs of 16 / 8 / 4 warps, <= 128 registers per thread), or 8 with three or
// four token blocks (their sums take ~150 registers); gemm.strip_choice plans its one-wave grids with the occupancy.
#define JM_STRIP_KERNEL(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, WARPS, DEPTH, CLUSTER, TOKS, SRING, PERM, MOE)   \
  extern "C" __global__ void __launch_bounds__(32 * (WARPS), ((TOKS) > 2 ? 8 : 16) / (WARPS))                    \
      NAME(const JmGemmParams p) {                                                                               \
    jm::strip_body<T, BITS, HAS_ZP, GROUP_BLOCKS, WARPS, DEPTH, CLUSTER, TOKS, SRING, PERM, MOE>(p);               \
  }
