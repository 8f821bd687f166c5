// jitmarlin — Hopper (sm_90a) GEMM for large M: warpgroup MMA with the weights in registers.
//
// Used for MoE blocks of 32, 64 and 128 rows and for dense M in [9, 1024] (jitmarlin/ops/gemm.py,
// use_wgmma_path; JITMARLIN_WGMMA=0 / 1 to never / always use it).
//
// Transposed product, as the small-M kernel's SWAP mode: D^T[features, tokens] = W^T A^T. The
// wgmma A operand (64 rows x 16 k, in registers) is the dequantized weights: each warp of a
// warpgroup holds 16 output features, and a lane's packed word j of our layout (n8-blocks 2j and
// 2j+1 of its 64-column strip) dequantizes straight into the m16k16 register fragment of warp j
// (PTX ISA, "Register Fragments" of wgmma .m64nNk16, which matches the mma.m16n8k16 A fragment).
// The B operand (tokens x 16 k, K-major) is the activation tile in shared memory, one 128-byte
// row of 64 k per token in the 128-byte swizzle layout (see wgmma_desc_sw128; the no-swizzle
// layout of the first version ran 3-7x slower).
// Weights never exist as fp16 in memory (unlike a dequantize-then-cuBLAS path).
//
// CTA: two warpgroups; each owns FW 64-feature strips (one wgmma per strip and k16, sharing the
// activation descriptor) x NT tokens, all of K, or (dense, p.k_splits > 1) one of k_splits
// contiguous runs of K, reduced through the workspace in a fixed order (as the mma.sync kernel's
// split units), or (dense, p.k_splits == -1, stream-K) its even share of all tiles' stages (see
// wgmma_body). MOE: an m tile is one expert's block of
// NT = block-size rows of the sorted slot list (as the mma.sync MoE kernel: A rows gathered
// through the slot ids, output row = slot, routing weight).
// Pipeline: a STAGES-deep ring of 64-k stages holding activations, packed weights, and the
// stage's group scales / zero points, filled by cp.async (dense tiles of 64 and 128 tokens: the
// activations by TMA, one mbarrier per slot); one __syncthreads per stage. A warpgroup dequantizes
// k16 step s+1 into another fragment buffer while the wgmma of the earlier steps run (NB buffers,
// wgmma.wait_group NB - 1 before one is rewritten): the overlap the study of the fastest peer
// (../shared/PERF_NOTES.md section 3) names as the lever it leaves.
#pragma once

#include <type_traits>

#include "jm_gemm.cuh"
#include "jm_wgmma_ptx.cuh"

namespace jm {

// wgmma shared-memory matrix descriptor for a K-major tile in the 128-byte swizzle layout (PTX
// ISA "Matrix Descriptor Format"): start address, leading- and stride-dimension byte offsets, each
// encoded as (x & 0x3FFFF) >> 4, and the swizzle mode in bits 62-63 (1 = 128 B). Rows of 64 k
// (128 B) lie 128 B apart, the 16-byte chunk j of row r at chunk position j ^ (r & 7), 8-row groups
// SBO = 1024 B apart; the leading offset is unused when the MMA's 16 k lie inside one row, and
// k16 step s starts 32 s bytes into the row (the hardware applies the XOR to the address, so the
// tile must start 1024-byte aligned).
JM_DEVICE uint64_t wgmma_desc_sw128(uint32_t smem_byte_addr) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Dense activations by TMA (wg_tma; -DJM_WG_NO_TMA: by cp.async, as before session 15): the box of NT
// tokens x 64 k at (k0, row0) lands in shared memory in the 128-byte swizzle layout the wgmma
// descriptors read (rows past M as zeros), counted on `bar` in bytes. Written and read by the
// async proxy only, so the per-stage proxy fence of the cp.async path goes (0-14%, NOTES.md
// session 14).
// Only for tiles of 64 and 128 tokens: H200 session 15 (probe_configs, route, cp.async -> TMA, us):
// M=64 8192x28672 85.2 -> 80.6, 28672x8192 89.3 -> 76.9, 8192^2 30.2 -> 27.4, 14336x4096 29.0 ->
// 26.7; M=256 257 -> 234, 240 -> 208, 67.2 -> 59.4, 62.2 -> 55.6; but the 32-token tiles lost 4-8%
// (4096x28672 M=32 40.1 -> 42.8, 8192^2 25.1 -> 26.5, 4096^2 10.1 -> 10.5). MoE gathers its rows.
#if defined(JM_WG_NO_TMA)
constexpr bool kWgTma = false;
#else
constexpr bool kWgTma = true;
#endif
constexpr bool wg_tma(int nt, bool moe) { return kWgTma && !moe && nt >= 64; }
// -DJM_WG_WAIT_FIRST (A/B switch): every form waits for the previous kernel before any copy
#if defined(JM_WG_WAIT_FIRST)
constexpr bool kWaitFirst = true;
#else
constexpr bool kWaitFirst = false;
#endif
// -DJM_WG_L2_AHEAD=A (A/B switch, session 56; default 0: off): the producer form's producer also asks for the weights
// of the stage A stages past the one whose copies it issues to be brought into L2 (jm::prefetch_l2_bulk), so HBM would
// keep streaming while the ring is full and the copies that refill it would be L2 hits. Not measured yet (stage s56b);
// the same lead in front of the strip kernel's register loads made it 4-15% slower on an H100 (benchmarks/NOTES.md).
#ifndef JM_WG_L2_AHEAD
#define JM_WG_L2_AHEAD 0
#endif
constexpr int kWgL2Ahead = JM_WG_L2_AHEAD;

// The ring's barriers and phases, kept across a CTA's pieces (stream-K runs several tiles through
// one ring). act: per slot, the TMA activation box landed (the plain form, one arrival + bytes).
// The producer form (PROD; session 17 a producer warp, session 18 a producer warpgroup with
// setmaxnreg, since a 288-thread CTA lost an SM's second CTA to the register file): one thread of
// the producer warpgroup issues every copy of a stage — the activation box by TMA, one bulk copy per strip of
// packed weights and per group row of scales / zero points — on the slot's `full` barrier (one
// expect_tx arrival per stage, counted down in bytes), and waits on the slot's `empty` barrier (one
// arrival per compute warp once its wgmma on the slot are complete) before refilling it. The compute
// warps never copy and never meet at a CTA-wide barrier inside the main loop.
struct WgRing {
  uint64_t* act;
  uint64_t* full;
  uint64_t* empty;
  uint32_t act_phase, full_phase, empty_phase, filled;  // bit s: parity to wait for next / slot filled once
};
// float4 loads in flight per partial-sum region in the stream-K fixup: the largest divisor of the
// n8 blocks q8 = NT / 8 that is at most 8 (NT = 80: 5, 96: 6; else min(q8, 8))
constexpr int wg_sum_chunk_below(int q8, int c) { return q8 % c == 0 ? c : wg_sum_chunk_below(q8, c - 1); }
constexpr int wg_sum_chunk(int q8) { return q8 <= 8 ? q8 : (q8 % 8 == 0 ? 8 : wg_sum_chunk_below(q8, 7)); }

constexpr int wgmma_group_rows(int group_blocks) {  // group rows per 64-k stage (0: per channel)
  return group_blocks <= 0 ? 0 : (group_blocks >= 4 ? 1 : 4 / group_blocks);
}

// Bytes of one ring stage; jitmarlin/ops/_kernels.py (wgmma_smem_bytes) mirrors this, plus 1 KB
// for aligning the ring to 1024 bytes.
template <int BITS, bool HAS_ZP, int GROUP_BLOCKS, int NT, int FW>
struct WgmmaStage {
  static constexpr int kStrips = 2 * FW;                      // 64-feature strips per CTA
  static constexpr int kAct = NT * 64 * 2;                    // activations [NT x 64 k]
  static constexpr int kStripBytes = 4 * 32 * BITS * 4;       // one strip, 4 k16 of packed words
  static constexpr int kW = kStrips * kStripBytes;
  static constexpr int kRows = wgmma_group_rows(GROUP_BLOCKS);
  static constexpr int kS = kRows * kStrips * 64 * 2;         // group scales
  static constexpr int kZ = HAS_ZP ? kRows * kStrips * 64 * BITS / 8 : 0;  // packed zero points
  static constexpr int kBytes = (kAct + kW + kS + kZ + 1023) / 1024 * 1024;  // swizzled tiles: 1 KB aligned
};

// How a CTA's piece of an output tile ends (MoE: whole tiles but for the producer form's stream-K):
// `arrivals` == 1: the piece is the whole tile, written out directly. Else the piece stores its
// partial sums in region `region` of the workspace and arrives on the tile's counter; the last of
// the tile's `arrivals` pieces to arrive adds the regions first + i * stride (+ first_extra for
// i = 0), i = 0 .. arrivals - 1, in that order (bit-identical results whoever arrives last).
struct WgPiece {
  int arrivals, region, first, stride, first_extra;
};

// piece_of(): the piece's WgPiece, asked for only after the main loop (a split launch's is
// recomputed from blockIdx there rather than held in registers through it)
template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS, int NT, int FW, int STAGES, bool MOE, int WGS,
          bool PROD, int ROLE, int MINB, typename PieceOf>
JM_DEVICE void wgmma_tile(const JmGemmParams p, const int f_tile, const int m_tile, const int kt0,
                          const int k_tiles, const PieceOf& piece_of, const JmTensorMap* amap, WgRing& ring) {
  static_assert(NT == 16 || NT == 32 || NT == 64 || NT == 128 ||
                    ((NT == 24 || NT == 48 || NT == 80 || NT == 96) && MOE && PROD) ||
                    ((NT == 144 || NT == 160 || NT == 176 || NT == 192 || NT == 208 || NT == 224 || NT == 240 ||
                      NT == 256) && !MOE && PROD && WGS == 2),
                "token tile (24, 48, 80, 96: MoE expert blocks on the producer form only; 144-256 in steps of 16: "
                "dense, the two-compute-warpgroup producer form only)");
  static_assert(FW == 1 || FW == 2 || (FW == 4 && WGS == 1 && PROD), "strips per warpgroup");
  static_assert(STAGES >= 3, "the stage boundary waits for all but STAGES - 3 copy groups");
  // WGS warpgroups per CTA (2; 4 in the "wide" form: 512 threads, one strip each, sharing the
  // activation tile of a two-strip CTA), FW strips each: the CTA's ring is that of WGS * FW / 2
  // strips per "warpgroup pair", so the host's shared-memory and workspace formulas see FW * WGS / 2
  static_assert(WGS == 2 || (WGS == 4 && FW == 1 && !MOE) || (WGS == 1 && (FW == 2 || FW == 4) && PROD),
                "warpgroups per CTA");
  constexpr int kThreads = 128 * WGS;  // the compute threads (the producer warpgroup comes after them)
  using S = WgmmaStage<BITS, HAS_ZP, GROUP_BLOCKS, NT, FW * WGS / 2>;
  constexpr int kWordsPerK16 = 32 * BITS;  // packed words of one strip per 16 k
  constexpr bool kGrouped = GROUP_BLOCKS > 0;
  // Group scales on the fp32 sums (kGacc): groups of 64 or 128 k (whole stages) feed the exact (q - z)
  // to the wgmma, accumulate each group into a temporary set and add scale x set to the sums once the
  // group's wgmma are done (see the main loop), instead of one multiply per weight (measured at 10-15% of
  // the 24-64-token kernels with -DJM_WG_NOSCALE, session 28). Where the registers allow it without
  // spills (ptxas -v, nvcc 13.0): 4-bit weights, tiles of up to 32 tokens, the 64-token producer form and
  // the producer-form MoE blocks of up to 64 rows, at up to three CTAs per SM, and the MoE blocks of 24 at
  // four with two fragment buffers (with four they spill 440 bytes; the dense plain 64-token tile 40
  // bytes, the 128-token tiles 400-560, the producer form's four strips (probes only) 48: not taken).
  // The plain MoE form's blocks of 32 rows (fp16 4-bit) fold each group late (kLateFold, below): with the
  // fold right after the group's last step they lost 10% (H200 session 29, E=64 top-6 256 tokens 170.9 ->
  // 187.8 us, separate processes); with the late fold they gained 2% (session 30, interleaved, two rounds:
  // 96 / 256 tokens 160.1, 160.0 / 173.3, 172.2 -> 157.3, 156.9 / 169.5, 169.2 us). Dense 8192 x 28672
  // M = 17 / 48 / 64 55.3 / 71.1 / 78.7 -> 54.2 / 69.6 / 71.2 us (benchmarks/NOTES.md, session 29). Not the
  // 32-token tiles with zero points: their g128 forms spilled 4 (plain) and 20 bytes (three CTAs per SM). Not
  // tiles past 32 tokens at three CTAs per SM (the MoE blocks of 48 there, probes only: 1224 bytes of spills
  // with the form, 616 with two fragment buffers, none without it; session 31).
  // 8-bit weights (session 30): at up to two CTAs per SM, and with zero points only on 16-token tiles
  // (three CTAs per SM spilled 20-250 bytes, zero points at 32 / 64 tokens 4-16); fp16 u8b128 route, two
  // rounds, NO_GACC -> this: 4096 x 28672 M=32 43.2, 43.2 -> 41.1, 41.4 us, 28672 x 8192 M=64 82.4, 81.3 ->
  // 79.0, 77.9, 8192^2 M=32 27.5, 27.4 -> 26.5, 26.5.
  // bf16 only on the dense plain 4-bit tiles: bf16 lost with it in the producer form (8192 x 28672 M = 32 /
  // 64 57.7, 57.9 / 75.1, 75.3 -> 59.9, 59.7 / 77.1, 76.7 us; 28672 x 8192 M=32 57.4 -> 60.0) and with 8-bit
  // weights (bf16 u8 8192 x 28672 M=32 82.1 -> 88.1, 4096^2 M=32 10.9 -> 11.5), while the 4096^2 plain
  // tiles gained (M = 16 / 32 9.5 / 10.5 -> 9.3 / 10.3), session 30.
  // Python mirror (tests choose bit-identity checks by it): _kernels.wgmma_scales_on_sums.
  // -DJM_WG_NO_GACC: the per-weight multiply everywhere (A/B probes). -DJM_WG_GACC_BF16 (probes): bf16 by the
  // fp16 rule.
#if defined(JM_WG_GACC_BF16)
  constexpr bool kBf16Rule = false;
#else
  constexpr bool kBf16Rule = DType<T>::kBF16;  // bf16's narrower rule applies
#endif
#if defined(JM_WG_NO_GACC)
  constexpr bool kGacc = false;
#else
  constexpr bool kGacc = kGrouped && GROUP_BLOCKS >= 4 && FW <= 2 &&
                         (BITS == 4 ? (MINB <= 2 || (MINB == 3 && NT <= 32) || NT <= 24) && !(HAS_ZP && NT == 32)
                                    : (MINB <= 2 && (!HAS_ZP || NT <= 16))) &&
                         (NT <= 32 || (NT <= 64 && PROD)) && (PROD || !MOE || BITS == 4) &&
                         (!kBf16Rule || (BITS == 4 && !PROD && !MOE));
#endif
  // where a group's scaled sums are folded: right after its last step (the wait drains the warpgroup's
  // wgmma, then the next stage's first dequant follows), or (the plain MoE form) only after the next stage's
  // slot wait, preload and first dequant, which then overlap the group's last wgmma. The late fold measured
  // level to 1-3% slower on the dense and producer forms (session 30: Mixtral 80 tokens 332.6 / 335.9 /
  // 336.3 vs 328.6 / 326.3 / 332.9 us, 28672 x 8192 M=48 71.3 vs 69.9), 2% faster on the plain MoE form.
  constexpr bool kLateFold = MOE && !PROD;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // the swizzle pattern follows address bits 7-9: the ring must start 1024-byte aligned
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
  const int g = lane >> 2;
  // p.grid: the m tiles the launch covers (MoE: an upper bound; the padded row count decides)
  const int f_tiles = p.n / (64 * S::kStrips), m_tiles = p.grid;
  if (f_tile >= f_tiles) return;
  // Diagnostics (-DJM_TIMELINE, benchmarks/probe_timeline.py; the slots of the mma.sync kernel's
  // timeline): 0 entry, 1 past griddep_wait, 2 the first stage landed, 3 the last stage computed,
  // 4 the end, 5 the SM, 6 the stages, 7 ns from 3 to 4 (split-K sum and output). Thread 0.
#ifdef JM_TIMELINE
  uint64_t tl_last = 0;
  auto tl_end = [&]() {
    if (tid == 0) {
      const uint64_t now = globaltimer();
      JM_TL(4, now);
      JM_TL(7, now - tl_last);
    }
  };
#else
  auto tl_end = [&]() {};
#endif
  // SiLU epilogue (the MoE gate/up GEMM on the producer form without zero points, p.silu_out = 1): the
  // CTA's strip 0 is gate strip f_tile and its strip 1 the up strip of the same features, f_tiles strips
  // later (the gate columns come first in w13), so that one thread ends with both sums of a feature and
  // writes SiLU(gate) * up (the formula of jm_silu_gather, silu_times) by position into c [rows, n / 2]:
  // the down projection's input, with no SiLU / gather kernel and no [slots, n] round trip between.
  // Local strip j of the CTA is global strip strip0 + j * sstep.
  constexpr bool kSilu = MOE && PROD && !HAS_ZP && S::kStrips == 2 && WGS == 1;
  const bool silu = kSilu && p.silu_out != 0;
  // (diagnostics, wrong results: -DJM_SILU_NO_REMAP the epilogue on strips 2 f_tile, 2 f_tile + 1;
  // -DJM_SILU_PLAIN_EPI the remapped strips, the epilogue writing gate + up without the SiLU arithmetic)
#if defined(JM_SILU_NO_REMAP)
  const int sstep = 1;
  const int strip0 = f_tile * S::kStrips;
#else
  const int sstep = silu ? f_tiles : 1;
  const int strip0 = silu ? f_tile : f_tile * S::kStrips;  // the CTA's first strip
#endif
  const int tok0 = m_tile * NT;  // this piece's stages: [kt0, kt0 + k_tiles)
  // The plain dense form's partial last token tile keeps at most NT / 2 of its activation box's rows past M:
  // with fewer than NT / 2 rows of its own (M - tok0) it reads the NT / 2 rows before M as well, [M - NT / 2,
  // M + NT / 2), and writes only its own rows [tok0, M). H200 session 40 (route, f16 4-bit, the 128-token
  // plain form, us; benchmarks/NOTES.md): TMA boxes mostly past M made the launch up to 1.6x slower than one
  // more tile's worth of rows (s40a: 8192^2 M = 129 / 144 / 160 / 176 / 192 89.8 / 82.4 / 76.3 / 63.6 / 59.0),
  // and without TMA (-DJM_WG_NO_TMA) M = 129 cost what 192 did. With this rule (s40c, against -DJM_WG_NO_SHIFT):
  // 8192^2 M = 129 / 144 / 160 / 176 57.9 / 58.2 / 58.9 / 59.3 vs 89.5 / 81.0 / 76.2 / 67.1, 4096x11008 M = 257
  // 52.8 vs 65.9, the rest level. A box moved all the way to end at M cost 3-7% where it held 64 real rows
  // (14336x4096 M = 192 56.8 vs 52.9: rows read from L2 cost more than a modest zero fill), and 2-14% in the
  // wide and producer forms, which never paid for the zero fill (8192x28672 M = 257 wide 335.6 vs 300.5): they
  // keep the box at tok0, as MoE does. -DJM_WG_NO_SHIFT: the box at tok0 in every form (A/B).
#if defined(JM_WG_NO_SHIFT)
  constexpr bool kShiftBox = false;
#else
  constexpr bool kShiftBox = !MOE && !PROD && WGS == 2 && wg_tma(NT, MOE);
#endif
  const int atok0 = kShiftBox && p.m - tok0 < NT / 2 && tok0 > 0 ? p.m - NT / 2 : tok0;  // the box's first row
  const int e0 = 2 * warp;  // this warp's n8-blocks of a strip: e0, e0 + 1 (features 16 warp .. +15)
  if (tid == 0) {
    JM_TL(0, globaltimer());
    JM_TL(5, smid());
    JM_TL(6, k_tiles);
  }

  // Dense: the weight copies of the first stages go out before waiting for the previous kernel
  // (they never depend on it; the act-order gather before this GEMM, any kernel of a model); the
  // activations follow once it has finished (below). MoE: the routing tables come from the
  // previous kernels, so it waits here — but for the producer form launched with p.tables_ready
  // (the tables were complete before the previous kernel started: moe_gemm_ready_tables), whose
  // producer then issues its first fills' weights before its own wait and whose compute warps
  // wait before the main loop (the activations, workspace and outputs); they read only the tables
  // before it. -DJM_WG_WAIT_FIRST: wait here in every form (A/B switch).
  constexpr bool kEarlyWeights = !MOE && !kWaitFirst;
  if (!kEarlyWeights && !(MOE && PROD && p.tables_ready && !kWaitFirst)) {
    griddep_wait();
    if (tid == 0) JM_TL(1, globaltimer());
    griddep_launch_dependents();
  }
  int expert = 0;  // MoE: an m tile of NT rows (= the block size) belongs to one expert
  if constexpr (MOE) {
    if (tok0 >= *p.num_padded) return;
    expert = __ldg(p.expert_ids + m_tile);
  }

  // ---- activation rows this thread copies: chunk c = (token r, 8 k j), r = 8 (c >> 6) + (c & 7),
  // j = (c >> 3) & 7, so a warp reads 64 contiguous bytes of 8 rows and writes 4 full 128-byte lines
  // (NT = 16: 128 chunks, copied by the first warpgroup)
  constexpr int kActChunks = NT * 8, kActPerThread = (kActChunks + kThreads - 1) / kThreads;
  const bool act_copier = kActChunks >= kThreads || tid < kActChunks;
  const T* arow[kActPerThread];
  bool avalid[kActPerThread];
#pragma unroll
  for (int i = 0; i < kActPerThread; i++) {
    const int c = (tid + kThreads * i) % kActChunks, r = 8 * (c >> 6) + (c & 7), j = (c >> 3) & 7;
    int row = atok0 + r;  // (atok0 = tok0 but in the plain TMA form; MoE: a slot index)
    bool valid;
    if constexpr (MOE) {  // A row of a (token, k) slot: its token, or its position when pre-gathered
      const int slot_id = __ldg(p.sorted_ids + row);
      valid = slot_id < p.m;
      row = p.a_by_position ? row : slot_id / p.top_k;
    } else {
      valid = row < p.m;
    }
    arow[i] = static_cast<const T*>(p.a) + static_cast<int64_t>(valid ? row : 0) * p.lda + j * 8;
    avalid[i] = valid;
  }
  const uint32_t* bbase = static_cast<const uint32_t*>(p.b) + expert * p.b_expert_stride +
                          static_cast<int64_t>(strip0) * (p.k / 16) * kWordsPerK16;
  const T* sbase = static_cast<const T*>(p.s) + expert * p.s_expert_stride;
  const uint32_t* zbase = HAS_ZP ? static_cast<const uint32_t*>(p.z) + expert * p.z_expert_stride : nullptr;

  if constexpr (PROD && ROLE == 1) {  // the producer warpgroup: one thread issues every copy of the piece's stages
#if defined(JM_WG_COMPUTE_ONLY)  // diagnostic (wrong results): no copies, the compute warps never wait for data
    if (tid == kThreads) {
      griddep_wait();
      griddep_launch_dependents();
    }
    return;
#endif
    if (tid == kThreads) {
#if defined(JM_WG_NO_ACT)  // diagnostic (wrong results): no activation copies, the weight stream alone
      constexpr uint32_t kStageTx = S::kW + S::kS + S::kZ;
#else
      constexpr uint32_t kStageTx = S::kAct + S::kW + S::kS + S::kZ;  // bytes a stage's copies bring
#endif
      auto issue_weights = [&](int i, int slot) {
        if ((ring.filled >> slot) & 1u) {  // every compute warp is done with the slot's last stage
          mbar_wait(&ring.empty[slot], (ring.empty_phase >> slot) & 1u);
          ring.empty_phase ^= 1u << slot;
        }
        ring.filled |= 1u << slot;
        uint8_t* st = smem + slot * S::kBytes;
        const int kt = kt0 + i;
        mbar_arrive_expect_tx(&ring.full[slot], kStageTx);
#pragma unroll
        for (int j = 0; j < S::kStrips; j++)  // a strip's 4 k16 of the stage are contiguous
          bulk_copy_g2s(st + S::kAct + j * S::kStripBytes,
                        bbase + static_cast<int64_t>(j * sstep) * (p.k / 16) * kWordsPerK16 + kt * 4 * kWordsPerK16,
                        S::kStripBytes, &ring.full[slot]);
        if constexpr (kGrouped) {
          const int grp0 = kt * 4 / GROUP_BLOCKS;
#pragma unroll
          for (int r = 0; r < S::kRows; r++) {
            if (silu) {  // the two strips' scales are not adjacent: one copy each
#pragma unroll
              for (int j = 0; j < S::kStrips; j++)
                bulk_copy_g2s(st + S::kAct + S::kW + r * (S::kStrips * 64 * 2) + j * 128,
                              sbase + static_cast<int64_t>(grp0 + r) * p.n + (strip0 + j * sstep) * 64, 128,
                              &ring.full[slot]);
            } else {
              bulk_copy_g2s(st + S::kAct + S::kW + r * (S::kStrips * 64 * 2),
                            sbase + static_cast<int64_t>(grp0 + r) * p.n + strip0 * 64, S::kStrips * 64 * 2,
                            &ring.full[slot]);
            }
            if constexpr (HAS_ZP)
              bulk_copy_g2s(st + S::kAct + S::kW + S::kS + r * (S::kStrips * 64 * BITS / 8),
                            zbase + static_cast<int64_t>(grp0 + r) * (p.n * BITS / 32) + strip0 * (2 * BITS),
                            S::kStrips * 64 * BITS / 8, &ring.full[slot]);
          }
        }
      };
      auto issue_acts = [&](int i, int slot) {
#if !defined(JM_WG_NO_ACT)
        tma_load_2d(smem + slot * S::kBytes, amap, (kt0 + i) * 64, atok0, &ring.full[slot]);
#endif
      };
      // L2 lead (kWgL2Ahead stages; 0: off): one bulk prefetch per strip of the stages [i0, i1) of the piece (each
      // strip's run of them is contiguous)
      constexpr int kL2Ahead = kWgL2Ahead;
      auto prefetch_stages = [&](int i0, int i1) {
        if constexpr (kL2Ahead > 0) {
          i1 = i1 < k_tiles ? i1 : k_tiles;
          if (i0 < i1) {
#pragma unroll
            for (int j = 0; j < S::kStrips; j++)
              prefetch_l2_bulk(bbase + static_cast<int64_t>(j * sstep) * (p.k / 16) * kWordsPerK16 +
                                   (kt0 + i0) * 4 * kWordsPerK16,
                               static_cast<uint32_t>(i1 - i0) * S::kStripBytes);
          }
        }
      };
      // the weights of the first fills before waiting for the previous kernel (they never depend
      // on it), the activations after
      const int pre = k_tiles < STAGES ? k_tiles : STAGES;
      for (int i = 0; i < pre; i++) issue_weights(i, i);
      prefetch_stages(pre, pre + kL2Ahead);
      griddep_wait();
      griddep_launch_dependents();
      for (int i = 0; i < pre; i++) issue_acts(i, i);
      int slot = pre % STAGES;
      for (int i = pre; i < k_tiles; i++) {
        prefetch_stages(i + kL2Ahead, i + kL2Ahead + 1);
        issue_weights(i, slot);
        issue_acts(i, slot);
        slot = slot + 1 == STAGES ? 0 : slot + 1;
      }
    }
    return;  // (the TMA and bulk copies complete on the barriers whether or not the warpgroup lives)
  }

  // Per-thread copy offsets are computed once here; a stage adds only its k offset (a generic
  // strided copy loop compiled to ~150 instructions per stage, most of the kernel's issue slots).
  constexpr int kWChunks = S::kW / 16, kStripChunks = S::kStripBytes / 16;
  static_assert(kWChunks % kThreads == 0 && kThreads % kStripChunks == 0 || kStripChunks % kThreads == 0,
                "weight chunks per thread");
  constexpr int kWPerThread = kWChunks / kThreads;
  uint32_t woff[kWPerThread];  // words from bbase, at k = 0
#pragma unroll
  for (int i = 0; i < kWPerThread; i++) {
    const int c = tid + kThreads * i, strip = c / kStripChunks, off = c - strip * kStripChunks;
    woff[i] = static_cast<uint32_t>(strip * (p.k / 16) * kWordsPerK16 + off * 4);
  }
  const uint32_t asoff = static_cast<uint32_t>((8 * (tid >> 6) + (tid & 7)) * 128 + ((((tid >> 3) & 7) ^ (tid & 7)) << 4));
  constexpr int kRowChunks = S::kStrips * 64 * 2 / 16, kZRowChunks = S::kStrips * 64 * BITS / 8 / 16;
  const bool s_copier = kGrouped && tid < S::kRows * kRowChunks;
  const bool z_copier = kGrouped && HAS_ZP && tid < S::kRows * kZRowChunks;
  const int soff = (tid / kRowChunks) * p.n + strip0 * 64 + (tid % kRowChunks) * 8;
  const int zoff = (tid / kZRowChunks) * (p.n * BITS / 32) + strip0 * (2 * BITS) + (tid % kZRowChunks) * 4;

  constexpr bool kTma = wg_tma(NT, MOE);
  auto fetch_acts = [&](int kt_local, int slot) {
#if defined(JM_WG_COMPUTE_ONLY)
    return;
#endif
    const int kt = kt0 + kt_local;
    uint8_t* st = smem + slot * S::kBytes;
    if constexpr (kTma) {
      if (tid == 0) {
#if defined(JM_WG_NO_ACT)  // (diagnostic, see the producer's copies)
        mbar_arrive(&ring.act[slot]);
#else
        mbar_arrive_expect_tx(&ring.act[slot], S::kAct);
        tma_load_2d(st, amap, kt * 64, atok0, &ring.act[slot]);
#endif
      }
      return;
    }
#if defined(JM_WG_NO_ACT)
    return;
#endif
    // activations: chunk c = tid + kThreads i lands kThreads / 8 rows (16 kThreads bytes) after chunk tid
#pragma unroll
    for (int i = 0; i < kActPerThread; i++)
      if (act_copier) cp_async16(st + asoff + 16 * kThreads * i, arow[i] + kt * 64, avalid[i]);
  };
  auto fetch_weights = [&](int kt_local, int slot) {
#if defined(JM_WG_COMPUTE_ONLY)
    return;
#endif
    const int kt = kt0 + kt_local;
    uint8_t* st = smem + slot * S::kBytes;
    // weights: per strip, the 4 k16 of this stage are contiguous (S::kStripBytes)
    const uint32_t* wk = bbase + kt * 4 * kWordsPerK16;
#pragma unroll
    for (int i = 0; i < kWPerThread; i++) cp_async16(st + S::kAct + (tid + kThreads * i) * 16, wk + woff[i]);
    if constexpr (kGrouped) {
      const int grp0 = kt * 4 / GROUP_BLOCKS;
      if (s_copier) cp_async16(st + S::kAct + S::kW + tid * 16, sbase + static_cast<int64_t>(grp0) * p.n + soff);
      if constexpr (HAS_ZP) {
        if (z_copier)
          cp_async16(st + S::kAct + S::kW + S::kS + tid * 16,
                     zbase + static_cast<int64_t>(grp0) * (p.n * BITS / 32) + zoff);
      }
    }
  };
  auto fetch = [&](int kt_local, int slot) {
    fetch_acts(kt_local, slot);
    fetch_weights(kt_local, slot);
  };

  // per channel: this lane's scales (and zero points) for its FW strips, once
  uint32_t sc_chan[FW];
  uint32_t zc_chan[FW][2];
  if constexpr (!kGrouped) {
#pragma unroll
    for (int j = 0; j < FW; j++) {
      const int strip = strip0 + (wg * FW + j) * sstep;
      const T lo = sbase[strip * 64 + 8 * e0 + g], hi = sbase[strip * 64 + 8 * (e0 + 1) + g];
      T pair[2] = {lo, hi};
      sc_chan[j] = *reinterpret_cast<uint32_t*>(pair);
      if constexpr (HAS_ZP) {
        if constexpr (BITS == 4) {
          const uint32_t w = __ldg(zbase + strip * 8 + g);
          zc_chan[j][0] = (w >> (4 * e0)) & 0xFu;
          zc_chan[j][1] = (w >> (4 * (e0 + 1))) & 0xFu;
        } else {
          const uint32_t w = __ldg(zbase + strip * 16 + 2 * g + (e0 >> 2));
          zc_chan[j][0] = (w >> (8 * (e0 & 3))) & 0xFFu;
          zc_chan[j][1] = (w >> (8 * ((e0 + 1) & 3))) & 0xFFu;
        }
      }
    }
  }

  // the stage's group scales (and packed zero-point words) of this lane, per strip and group row:
  // read from shared memory once per stage, not once per k16 step
  constexpr int R = S::kRows > 0 ? S::kRows : 1;
  uint32_t gsc[FW][R], gzw[FW][R];
  auto load_groups = [&](const uint8_t* st) {
#pragma unroll
    for (int j = 0; j < FW; j++) {
      const int ls = wg * FW + j;
#pragma unroll
      for (int r = 0; r < R; r++) {
        if constexpr (kGrouped) {  // permuted scales: lane g's 8 scales of a strip are contiguous
          gsc[j][r] = *reinterpret_cast<const uint32_t*>(st + S::kAct + S::kW + r * (S::kStrips * 64 * 2) +
                                                         (ls * 64 + 8 * g + e0) * 2);
          if constexpr (HAS_ZP) {
            const uint8_t* zst = st + S::kAct + S::kW + S::kS + r * (S::kStrips * 64 * BITS / 8);
            gzw[j][r] = *reinterpret_cast<const uint32_t*>(
                zst + (BITS == 4 ? ls * 8 + g : ls * 16 + 2 * g + (e0 >> 2)) * 4);
          }
        } else {
          gsc[j][r] = sc_chan[j];
        }
      }
    }
  };

  // dequantize k16 step s of the stage in `st` into the A fragments of this warp, one per strip
  // The stage's packed weight words of this lane, read from shared memory together when the stage
  // becomes current: the wgmma asm statements are memory barriers to the compiler, so a read
  // inside dequant would wait behind the previous step's wgmma issue and put its latency on every
  // step. -DJM_WG_NO_PRELOAD: read per step (A/B switch, session 13 prep).
#if defined(JM_WG_NO_PRELOAD) || defined(JM_WG_NOLDS)
  constexpr bool kPreload = false;
#else
  constexpr bool kPreload = true;
#endif
  constexpr int kWW = BITS == 4 ? 1 : 2;  // 32-bit words per lane, strip and k16 step
  uint32_t wpre[kPreload ? 4 : 1][FW][kWW];
  auto lane_words = [&](const uint8_t* st, int s, int j, uint32_t (&w)[kWW]) {
    const uint8_t* wst = st + S::kAct + (wg * FW + j) * S::kStripBytes + s * kWordsPerK16 * 4;
    if constexpr (BITS == 4) {
      w[0] = *reinterpret_cast<const uint32_t*>(wst + (lane * 4 + warp) * 4);
    } else {  // words e0, e0 + 1 of a lane's 8 (the first 4 at lane*4, the last 4 at 128 + lane*4)
      const uint2 v = *reinterpret_cast<const uint2*>(wst + (e0 < 4 ? lane * 4 + e0 : 128 + lane * 4 + e0 - 4) * 4);
      w[0] = v.x;
      w[kWW - 1] = v.y;
    }
  };
  auto preload = [&](const uint8_t* st) {
    if constexpr (kPreload) {
#pragma unroll
      for (int s = 0; s < 4; s++) {
#pragma unroll
        for (int j = 0; j < FW; j++) lane_words(st, s, j, wpre[s][j]);
      }
    }
  };

  auto dequant = [&](const uint8_t* st, int s, uint32_t (&a)[FW][4]) {
    const int row = S::kRows > 1 ? s / GROUP_BLOCKS : 0;
#pragma unroll
    for (int j = 0; j < FW; j++) {
      uint32_t z0, z1;
      if constexpr (!HAS_ZP) {
        z0 = z1 = BITS == 4 ? 8u : 128u;
      } else if constexpr (!kGrouped) {
        z0 = zc_chan[j][0];
        z1 = zc_chan[j][1];
      } else if constexpr (BITS == 4) {
        z0 = (gzw[j][row] >> (4 * e0)) & 0xFu;
        z1 = (gzw[j][row] >> (4 * (e0 + 1))) & 0xFu;
      } else {
        z0 = (gzw[j][row] >> (8 * (e0 & 3))) & 0xFFu;
        z1 = (gzw[j][row] >> (8 * ((e0 + 1) & 3))) & 0xFFu;
      }
      const ZeroConst zc0 = make_zero_const<T, BITS>(z0), zc1 = make_zero_const<T, BITS>(z1);
      Frag f0, f1;
      uint32_t w[kWW];
      if constexpr (kPreload) {
#pragma unroll
        for (int i = 0; i < kWW; i++) w[i] = wpre[s][j][i];
      } else {
        lane_words(st, s, j, w);
      }
#if defined(JM_WG_NOLDS)  // diagnostic (wrong results): no weight reads from shared memory
      const uint32_t wword =
          static_cast<uint32_t>(reinterpret_cast<uintptr_t>(st + S::kAct + (wg * FW + j) * S::kStripBytes + s * 64)) *
          0x9E3779B9u;
#else
      const uint32_t wword = w[0];
#endif
#if defined(JM_WG_NODEQ)  // diagnostic (wrong results): the fragments are the packed words, no dequant ALU
      if constexpr (true) {
        a[j][0] = a[j][1] = a[j][2] = a[j][3] = wword ^ gsc[j][row];
        continue;
      }
#endif
      if constexpr (BITS == 4) {
        dequant4<T>(wword, zc0, zc1, f0, f1);
      } else {
        f0 = dequant8<T>(wword, zc0);
        f1 = dequant8<T>(w[kWW - 1], zc1);
      }
      // per channel: the integer weights (q - z) go into the wgmma exactly and the channel scale
      // multiplies the fp32 sums once, after the main loop (H200 session 28: the per-weight HMUL2 and
      // its PRMT are 10-15% of the 32 / 64-token kernels' time, measured with -DJM_WG_NOSCALE)
#if defined(JM_WG_NOSCALE)  // diagnostic (wrong results): no group-scale multiply (its HMUL2 / PRMT)
      if constexpr (true) {
#else
      if constexpr (!kGrouped || kGacc) {
#endif
        a[j][0] = f0.b0;
        a[j][1] = f1.b0;
        a[j][2] = f0.b1;
        a[j][3] = f1.b1;
        continue;
      }
      const uint32_t sc = gsc[j][row];
      const uint32_t s0 = bcast_half(sc, 0), s1 = bcast_half(sc, 1);
      a[j][0] = mul2<T>(f0.b0, s0);  // rows g (feature 16 warp + g), k 2t, 2t+1
      a[j][1] = mul2<T>(f1.b0, s1);  // rows g + 8
      a[j][2] = mul2<T>(f0.b1, s0);  // rows g, k 2t + 8, 2t + 9
      a[j][3] = mul2<T>(f1.b1, s1);  // rows g + 8, k 2t + 8, 2t + 9
    }
  };

  // NACC accumulator sets: k16 step s of a stage accumulates into set s % NACC, so consecutive
  // wgmma of a warpgroup do not wait on each other's accumulators (summed before the epilogue).
  // H200 session 13 (NOTES.md), two sets vs one: 32-token tiles 1-6% faster (8192x28672 M=32
  // n32-f1 77.8 -> 73.1 us, n32-f2 70.1 -> 68.5), 64-token tiles within +-4%, four sets no better;
  // with 64 and 128 tokens the registers are needed elsewhere. Tuning switch -DJM_WG_NACC=1/2/4.
#ifdef JM_WG_NACC
  constexpr int NACC = JM_WG_NACC;
#else
  // (four strips, or three CTAs per SM: one set; with two, ptxas serialized the wgmma of the 32-token
  // tile, C7512)
  constexpr int NACC = NT <= 32 && FW <= 2 && MINB <= 2 && !kGacc ? 2 : 1;
#endif
  static_assert(NACC == 1 || NACC == 2 || NACC == 4, "accumulator sets divide the 4 k16 steps of a stage");
  float dacc[NACC][FW][NT / 2];
#pragma unroll
  for (int q = 0; q < NACC; q++) {
#pragma unroll
    for (int j = 0; j < FW; j++) {
#pragma unroll
      for (int i = 0; i < NT / 2; i++) dacc[q][j][i] = 0.f;
    }
  }
  float (&d)[FW][NT / 2] = dacc[0];
  // The B descriptor of k16 step s of the stage at st_addr: step s starts 32 s bytes into each row,
  // i.e. 2 s in the descriptor's 16-byte address field, which holds shared addresses (< 256 KB) without
  // carrying out of it; so one descriptor per stage, plus 2 s per step (the per-step encode cost ~7
  // uniform-datapath instructions per step: SASS of session 16). -DJM_WG_DESC_PER_STEP: encode per step.
  // step s's wgmma into acc (the running sums' set s % NACC, or kGacc's group set tacc with scale_d 0 at a
  // group's first step)
  auto issue = [&](const uint32_t (&a)[FW][4], uint64_t desc_st, uint32_t st_addr, int s, float (&acc)[FW][NT / 2],
                   int scale_d) {
    wgmma_fence();
#if defined(JM_WG_DESC_PER_STEP)
    const uint64_t desc = wgmma_desc_sw128(st_addr + s * 32);
#else
    const uint64_t desc = desc_st + static_cast<uint64_t>(2 * s);
#endif
#pragma unroll
    for (int j = 0; j < FW; j++) {
#if defined(JM_WG_NOMMA)  // diagnostic (wrong results): no tensor work; keep the fragments alive
      d[j][0] += __uint_as_float(a[j][0] ^ a[j][1] ^ a[j][2] ^ a[j][3] ^ static_cast<uint32_t>(desc));
#else
      WgmmaRS<NT>::template run<T>(acc[j], a[j], desc, scale_d);
#endif
    }
    wgmma_commit();
  };

  if constexpr (PROD) {
    griddep_wait();  // (before the outputs and the workspace are written)
    griddep_launch_dependents();
  } else if constexpr (kEarlyWeights) {
    // one copy group per stage as below; the first also holds every early weight copy, and it
    // completes before any later group is waited for
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
      if (s < k_tiles) fetch_weights(s, s);
    griddep_wait();
    if (tid == 0) JM_TL(1, globaltimer());
    griddep_launch_dependents();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
      if (s < k_tiles) fetch_acts(s, s);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
      if (s < k_tiles) fetch(s, s);
      cp_async_commit();
    }
  }
  // the activations of the stage in `slot` have landed (TMA; the cp.async path waits for its
  // copy groups, then fences them for the async proxy that wgmma reads with)
  auto wait_acts = [&](int slot) {
#if defined(JM_WG_COMPUTE_ONLY)  // (diagnostic: dequantize and multiply whatever the ring holds)
    return;
#endif
    if constexpr (PROD) {  // every copy of the stage (one barrier)
      mbar_wait(&ring.full[slot], (ring.full_phase >> slot) & 1u);
      ring.full_phase ^= 1u << slot;
    } else if constexpr (kTma) {
      mbar_wait(&ring.act[slot], (ring.act_phase >> slot) & 1u);
      ring.act_phase ^= 1u << slot;
    } else {
#ifndef JM_WG_NO_PROXY_FENCE  // diagnostic only (formally racy): what the proxy fence costs
      fence_proxy_async_smem();  // the cp.async bytes are read by wgmma (async proxy)
#endif
    }
  };
  // this warp's wgmma on `slot` are complete: the producer may refill it
  auto release = [&](int slot) {
#if defined(JM_WG_COMPUTE_ONLY)
    return;
#endif
    if constexpr (PROD) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&ring.empty[slot]);
    }
  };
  if constexpr (PROD) {
    wait_acts(0);
  } else {
    cp_async_wait<STAGES - 2>();
    wait_acts(0);
    __syncthreads();
  }
  if (tid == 0) JM_TL(2, globaltimer());

  const uint32_t smem_base = smem_addr(smem);  // 1024-byte aligned
  const uint64_t desc_base = wgmma_desc_sw128(smem_base);  // slot 0, step 0 (the others: + offsets)
  // NB fragment buffers: step s dequantizes into buffer s % NB while up to NB - 1 earlier steps'
  // wgmma still run (wait_group NB - 1 before a buffer is rewritten). Four when the registers allow
  // (a whole stage in flight), else two. -DJM_WG_NB=2 / 4: that many everywhere (probes).
#if defined(JM_WG_NB)
  constexpr int NB = JM_WG_NB;
#else
  constexpr int NB = ((FW == 2 && NT >= 128) || (NT > 128) || (MINB >= 4 && (NT > 24 || kGacc))) ? 2 : 4;
#endif
  uint32_t abuf[NB][FW][4];
  preload(smem);
  load_groups(smem);
  dequant(smem, 0, abuf[0]);
  int slot = 0;
  // kGacc: each group of the piece accumulates into tacc (its first wgmma with scale-d 0); after the
  // group's last stage (kLateFold: and the next stage's first dequant) the
  // warpgroup waits for all its wgmma and adds scale x tacc to the sums (ptxas
  // serializes every wgmma, C7513, if accumulator registers are read while any wgmma is in flight: a
  // second set folded one group later, with no wait, compiled that way). A stage is 4 k16 steps, a group
  // 4 or 8 (GROUP_BLOCKS), so groups start at stages: kt0 + kt a multiple of GROUP_BLOCKS / 4 (or the
  // piece's first stage, which may start inside a group).
  float tacc[FW][NT / 2];  // (unused, and eliminated, without kGacc)
  uint32_t gsf[FW];
  if constexpr (kGacc) {
#pragma unroll
    for (int j = 0; j < FW; j++) {
      gsf[j] = 0u;
#pragma unroll
      for (int i = 0; i < NT / 2; i++) tacc[j][i] = 0.f;
    }
  }
  // adds scale x tacc to the sums once the warpgroup's wgmma are all done
  auto fold_group = [&]() {
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < FW; j++) {
      const T* pair = reinterpret_cast<const T*>(&gsf[j]);
      const float s_lo = to_float<T>(pair[0]), s_hi = to_float<T>(pair[1]);
#pragma unroll
      for (int i = 0; i < NT / 2; i++) d[j][i] = fmaf((i & 2) ? s_hi : s_lo, tacc[j][i], d[j][i]);
    }
  };
  auto group_start = [&](int kt) { return kt == 0 || (kt0 + kt) % (GROUP_BLOCKS / 4 > 0 ? GROUP_BLOCKS / 4 : 1) == 0; };
  // one stage of the piece: stage kt in ring slot `slot` (kt % STAGES: each piece starts at slot 0)
  auto stage = [&](const int kt, const int slot) {
    const uint8_t* st = smem + slot * S::kBytes;
    const uint32_t st_addr = smem_base + slot * S::kBytes;
    const uint64_t desc_st = desc_base + static_cast<uint64_t>(slot * (S::kBytes >> 4));
    bool gstart = false;
    if constexpr (kGacc) {
      gstart = group_start(kt);
      if (gstart) {
#pragma unroll
        for (int j = 0; j < FW; j++) gsf[j] = gsc[j][0];
      }
    }
#pragma unroll
    for (int s = 0; s < 4; s++) {
      if constexpr (kGacc)
        issue(abuf[s % NB], desc_st, st_addr, s, tacc, (s == 0 && gstart) ? 0 : 1);
      else
        issue(abuf[s % NB], desc_st, st_addr, s, dacc[s % NACC], 1);
      wgmma_wait<NB - 1>();  // step s - NB + 1 is done: its buffer may be rewritten
      if (s < 3) dequant(st, s + 1, abuf[(s + 1) % NB]);
    }
    if constexpr (kGacc && !kLateFold) {
      if (kt + 1 == k_tiles || group_start(kt + 1)) fold_group();
    }
    // here every step of stage kt - 1 is done (this thread's warpgroup): the producer form frees
    // its slot (outside the step loop: an mbarrier arrival between wgmma issue and wait made
    // ptxas serialize the wgmma, C7513)
    if (kt > 0) release(slot == 0 ? STAGES - 1 : slot - 1);
    const int nslot = slot + 1 == STAGES ? 0 : slot + 1;  // the next stage's
    if (kt + 1 < k_tiles) {
      if constexpr (PROD) {
        wait_acts(nslot);  // stage kt + 1 is in (the producer refills the slots itself)
      } else {
        cp_async_wait<STAGES - 3>();  // stage kt + 1 is in (this thread's copies)
        wait_acts(nslot);
        __syncthreads();  // ... every thread's; and no warpgroup still reads stage kt - 1's slot
        const int nk = kt + STAGES - 1;
        if (nk < k_tiles) fetch(nk, (nslot + STAGES - 2) % STAGES);  // stage kt - 1's slot: (kt + STAGES - 1) % STAGES
        cp_async_commit();
      }
      preload(smem + nslot * S::kBytes);
      load_groups(smem + nslot * S::kBytes);
      dequant(smem + nslot * S::kBytes, 0, abuf[0]);  // its last reader, step 4 - NB of stage kt, is done
    }
    if constexpr (kGacc && kLateFold) {  // the group's last stage: its sums, scaled, after the above
      if (kt + 1 == k_tiles || group_start(kt + 1)) fold_group();
    }
  };
#if !defined(JM_WG_ROLLED_RING)
  // The stage loop unrolled over the ring: each copy's slot, its shared addresses, descriptor and barrier phase
  // bit are compile-time constants (session 35: ~60 of the 16-row form's 174 instructions per stage and warp were
  // that bookkeeping, rematerialized every stage under the register cap). H200 session 37, interleaved A/B
  // against the rolled loop (probe flag -DJM_WG_ROLLED_RING): dense M = 17-64 on 8192x28672 -4 to -5%, MoE
  // Mixtral 32-64 tokens -2 to -4%, E=64 128-256 tokens -2 to -4%.
  for (int kb = 0; kb < k_tiles; kb += STAGES) {
#pragma unroll
    for (int sl = 0; sl < STAGES; sl++)
      if (kb + sl < k_tiles) stage(kb + sl, sl);
  }
  slot = k_tiles % STAGES;
#else
  for (int kt = 0; kt < k_tiles; kt++) {
    stage(kt, slot);
    slot = slot + 1 == STAGES ? 0 : slot + 1;
  }
#endif
  wgmma_wait<0>();
  cp_async_wait<0>();
  release(slot == 0 ? STAGES - 1 : slot - 1);  // the piece's last stage
#ifdef JM_TIMELINE
  tl_last = globaltimer();
  if (tid == 0) JM_TL(3, tl_last);
#endif

#pragma unroll
  for (int q = 1; q < NACC; q++) {
#pragma unroll
    for (int j = 0; j < FW; j++) {
#pragma unroll
      for (int i = 0; i < NT / 2; i++) d[j][i] += dacc[q][j][i];
    }
  }
  if constexpr (!kGrouped) {  // the channel scales (rows g and g + 8 of the warp's 16 features per strip)
#pragma unroll
    for (int j = 0; j < FW; j++) {
      const T* pair = reinterpret_cast<const T*>(&sc_chan[j]);
      const float s_lo = to_float<T>(pair[0]), s_hi = to_float<T>(pair[1]);
#pragma unroll
      for (int i = 0; i < NT / 2; i++) d[j][i] *= (i & 2) ? s_hi : s_lo;
    }
  }
  const WgPiece piece = piece_of();
  // A dense K-split tile launched in clusters of its splits (gemm.wgmma_launch's `cluster`: one piece per
  // CTA, CTA rank = split): reduce-scatter through distributed shared memory instead of the workspace. Each
  // CTA owns 1/S of every thread's float4s of sums (u = j NT/8 + i: the cl_per consecutive u of owner
  // u / cl_per); once every CTA of the cluster is past its main loop (phase A: the rings are free) each
  // pushes the float4s it does not own into the owner's ring (thread-major: sender slot pos, u, thread),
  // then (phase B) each owner adds all S partial sums in rank order, the workspace path's order of
  // additions (the same bits), and writes its outputs. No partial sum goes through L2 (H200 session 45:
  // the workspace fixup took 2-12 us of the K-split launches at M = 16-300, -DJM_WG_NO_FIXUP).
  int cl_size = 1, cl_rank = 0, cl_per = FW * (NT / 8);
  if constexpr (!MOE) cl_size = static_cast<int>(cluster_nctarank());
  if (cl_size > 1) {
    cl_rank = static_cast<int>(cluster_ctarank());
    cl_per = FW * (NT / 8) / cl_size;
    // the cluster's size as a constant, so that every index of d[] and of the receive space is one too. The
    // host launches only sizes summed here (2, 3 or 4, dividing FW NT / 8: gemm.wgmma_cluster_sum, CPU-tested);
    // a device-side check of it cost the 256-token tile 56 bytes of spills (ptxas, nvcc 13.0)
    auto cluster_sum = [&](auto size_const) {
      constexpr int CS = decltype(size_const)::value, kPer = FW * (NT / 8) / CS;
      float4* recv = reinterpret_cast<float4*>(smem);  // [CS - 1 senders][kPer][kThreads]
      cluster_arrive_release();
      cluster_wait();  // phase A: no CTA of the cluster still reads its ring
#pragma unroll
      for (int j = 0; j < FW; j++) {
#pragma unroll
        for (int q = 0; q < NT / 8; q++) {
          const int u = j * (NT / 8) + q, owner = u / kPer;
          if (owner == cl_rank) continue;
          const int pos = cl_rank < owner ? cl_rank : cl_rank - 1;
          st_cluster_v4(smem_addr(recv + (pos * kPer + u - owner * kPer) * kThreads + tid), owner, d[j][4 * q],
                        d[j][4 * q + 1], d[j][4 * q + 2], d[j][4 * q + 3]);
        }
      }
      cluster_arrive_release();
      cluster_wait();  // phase B: every share is in its owner's ring
#pragma unroll
      for (int own = 0; own < CS; own++) {
        if (own != cl_rank) continue;
#pragma unroll
        for (int uu = 0; uu < kPer; uu++) {
          const int u = own * kPer + uu, j = u / (NT / 8), q = u - j * (NT / 8);
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int r = 0; r < CS; r++) {
            const float4 v = r == own ? make_float4(d[j][4 * q], d[j][4 * q + 1], d[j][4 * q + 2], d[j][4 * q + 3])
                                      : recv[((r < own ? r : r - 1) * kPer + uu) * kThreads + tid];
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
          }
          d[j][4 * q] = acc.x;
          d[j][4 * q + 1] = acc.y;
          d[j][4 * q + 2] = acc.z;
          d[j][4 * q + 3] = acc.w;
        }
      }
    };
    if constexpr ((FW * (NT / 8)) % 4 == 0) {
      if (cl_size == 4) cluster_sum(std::integral_constant<int, 4>{});
    }
    if constexpr ((FW * (NT / 8)) % 3 == 0) {
      if (cl_size == 3) cluster_sum(std::integral_constant<int, 3>{});
    }
    if constexpr ((FW * (NT / 8)) % 2 == 0) {
      if (cl_size == 2) cluster_sum(std::integral_constant<int, 2>{});
    }
  } else
#if defined(JM_WG_NO_FIXUP)  // diagnostic (wrong results): every piece writes its partial sums out, no fixup
  if (false) {
#else
  if (piece.arrivals > 1) {
#endif
    // Every piece stores its partial sums in a region of its own (thread-major float4s, so each
    // warp writes and reads 512 contiguous bytes); the last of the tile's pieces to arrive adds all
    // regions up in a fixed order: bit-identical results run to run, whoever arrives last.
    constexpr int kRegion = kThreads * FW * (NT / 2);  // floats per piece
    __shared__ int s_last;
    float* mine = p.ws + static_cast<int64_t>(piece.region) * kRegion + tid * 4;
#pragma unroll
    for (int j = 0; j < FW; j++) {
#pragma unroll
      for (int q = 0; q < NT / 8; q++)
        __stcg(reinterpret_cast<float4*>(mine + (j * (NT / 8) + q) * 4 * kThreads),
               make_float4(d[j][4 * q], d[j][4 * q + 1], d[j][4 * q + 2], d[j][4 * q + 3]));
    }
    __threadfence();
    if constexpr (PROD) compute_sync<kThreads>(); else __syncthreads();
    const int unit = f_tile * m_tiles + m_tile;
    if (tid == 0) s_last = atomicAdd(p.counters + unit, 1) == piece.arrivals - 1;
    if constexpr (PROD) compute_sync<kThreads>(); else __syncthreads();
    if (!s_last) {
      tl_end();
      return;
    }
    __threadfence();
    if (tid == 0) p.counters[unit] = 0;  // all the tile's pieces have arrived: zero for the next launch
#if defined(JM_WG_FIXUP_NOSUM)  // diagnostic (wrong results): the stores and the arrival, not the last piece's sum
    constexpr bool kSum = false;
#else
    constexpr bool kSum = true;
#endif
    // 16-token tiles (two CTAs per SM): the regions' loads in batches of four, issued together, then added in
    // region order (the same additions in the same order as one region at a time: the same bits). Such a tile
    // holds two float4s of sums per thread and strip, so each region was one short round trip after another.
    // H200 session 45 (s45h, route, two rounds, us, one region -> batches): 4096x11008 M = 9 / 16 13.8 / 13.9 ->
    // 12.9 / 13.0, 11008x4096 M = 16 17.2 -> 17.4, 8192^2 / 4096^2 / 4096x12288 level; batches of two for the
    // 32-token tiles lost (4096^2 M = 24 / 32 9.5 / 9.6 -> 10.0 / 10.1), and three CTAs per SM spill with them.
    constexpr int kChunk = wg_sum_chunk(NT / 8);  // float4 loads in flight per region
    constexpr int kBatch = NT == 16 && MINB < 3 ? 8 / kChunk : 1;  // regions per round trip
    if constexpr (!kSum) {
    } else if constexpr (kBatch > 1) {
#pragma unroll
      for (int j = 0; j < FW; j++) {
#pragma unroll
        for (int q0 = 0; q0 < NT / 8; q0 += kChunk) {
#pragma unroll
          for (int q = q0; q < q0 + kChunk; q++) d[j][4 * q] = d[j][4 * q + 1] = d[j][4 * q + 2] = d[j][4 * q + 3] = 0.f;
          for (int sp0 = 0; sp0 < piece.arrivals; sp0 += kBatch) {
            float4 v[kBatch][kChunk];
#pragma unroll
            for (int b = 0; b < kBatch; b++) {
              const int sp = sp0 + b;
              if (sp < piece.arrivals) {
                const int region = piece.first + sp * piece.stride + (sp == 0 ? piece.first_extra : 0);
                const float* src =
                    p.ws + static_cast<int64_t>(region) * kRegion + tid * 4 + (j * (NT / 8) + q0) * 4 * kThreads;
#pragma unroll
                for (int q = 0; q < kChunk; q++) v[b][q] = __ldcg(reinterpret_cast<const float4*>(src + q * 4 * kThreads));
              }
            }
#pragma unroll
            for (int b = 0; b < kBatch; b++) {
              if (sp0 + b < piece.arrivals) {
#pragma unroll
                for (int q = 0; q < kChunk; q++) {
                  d[j][4 * (q0 + q)] += v[b][q].x;
                  d[j][4 * (q0 + q) + 1] += v[b][q].y;
                  d[j][4 * (q0 + q) + 2] += v[b][q].z;
                  d[j][4 * (q0 + q) + 3] += v[b][q].w;
                }
              }
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < FW; j++) {
#pragma unroll
        for (int q0 = 0; q0 < NT / 8; q0 += kChunk) {
#pragma unroll
          for (int q = q0; q < q0 + kChunk; q++) d[j][4 * q] = d[j][4 * q + 1] = d[j][4 * q + 2] = d[j][4 * q + 3] = 0.f;
          for (int sp = 0; sp < piece.arrivals; sp++) {
            const int region = piece.first + sp * piece.stride + (sp == 0 ? piece.first_extra : 0);
            const float* src =
                p.ws + static_cast<int64_t>(region) * kRegion + tid * 4 + (j * (NT / 8) + q0) * 4 * kThreads;
            float4 v[kChunk];
#pragma unroll
            for (int q = 0; q < kChunk; q++) v[q] = __ldcg(reinterpret_cast<const float4*>(src + q * 4 * kThreads));
#pragma unroll
            for (int q = 0; q < kChunk; q++) {
              d[j][4 * (q0 + q)] += v[q].x;
              d[j][4 * (q0 + q) + 1] += v[q].y;
              d[j][4 * (q0 + q) + 2] += v[q].z;
              d[j][4 * (q0 + q) + 3] += v[q].w;
            }
          }
        }
      }
    }
  }

  // ---- epilogue: d[j][4i + c] = (feature 16 warp + g + 8 (c >> 1) of strip j, token 8i + 2t + (c & 1)) ----
  T* cbase = static_cast<T*>(p.c);
  const T* bias = static_cast<const T*>(p.bias);
  const int t4 = lane & 3;
  if constexpr (kSilu) {
    if (silu) {  // d[0]: gate, d[1]: up, features 64 f_tile + 16 warp + g (+ 8); rows = positions (padding
      // positions too: their gathered input rows are zeros, so they get SiLU(0) * 0 = 0 as the gather's)
      const int f_lo = f_tile * 64 + 16 * warp + g, f_hi = f_lo + 8;
#pragma unroll
      for (int i = 0; i < NT / 8; i++) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
          T* row = cbase + static_cast<int64_t>(tok0 + 8 * i + 2 * t4 + c) * p.ldc;
#if defined(JM_SILU_PLAIN_EPI)
          row[f_lo] = from_float<T>(d[0][4 * i + c] + d[1][4 * i + c]);
          row[f_hi] = from_float<T>(d[0][4 * i + 2 + c] + d[1][4 * i + 2 + c]);
#else
          row[f_lo] = silu_times<T>(from_float<T>(d[0][4 * i + c]), from_float<T>(d[1][4 * i + c]));
          row[f_hi] = silu_times<T>(from_float<T>(d[0][4 * i + 2 + c]), from_float<T>(d[1][4 * i + 2 + c]));
#endif
        }
      }
      tl_end();
      return;
    }
  }
  // MoE with K splits: fp32 partial sums, split s into slice s of [k_splits, m, ldc] (summed by the
  // top-k sum kernel); the split is recomputed from the CTA index (wgmma_body's mapping)
  // (not with 128-token blocks: the branch costs the 8-bit bf16 form registers it does not have)
  constexpr bool kSplitOut = MOE && NT <= 64;
  float* c32 = nullptr;
  if constexpr (kSplitOut) {
    if (p.k_splits > 1)
      c32 = static_cast<float*>(p.c) + static_cast<int64_t>((static_cast<int>(blockIdx.x) / m_tiles) % p.k_splits) *
                                           p.m * p.ldc;
  }
#pragma unroll
  for (int j = 0; j < FW; j++) {
    const int f_lo = (strip0 + wg * FW + j) * 64 + 16 * warp + g, f_hi = f_lo + 8;
    const float b_lo = bias != nullptr ? to_float<T>(bias[f_lo]) : 0.f;
    const float b_hi = bias != nullptr ? to_float<T>(bias[f_hi]) : 0.f;
#pragma unroll
    for (int i = 0; i < NT / 8; i++) {
      if (cl_size > 1 && (j * (NT / 8) + i) / cl_per != cl_rank) continue;  // another CTA's of the cluster
#pragma unroll
      for (int c = 0; c < 2; c++) {
        int tok = atok0 + 8 * i + 2 * t4 + c;
        if (kShiftBox && tok < tok0) continue;  // a row of the previous tile (a shifted box)
        float w = 1.f;
        if constexpr (MOE) {  // output row = the slot; times its routing weight when given
          tok = __ldg(p.sorted_ids + tok);
          if (tok < p.m && p.topk_weights != nullptr) w = __ldg(p.topk_weights + tok);
        }
        if (tok >= p.m) continue;
        if constexpr (kSplitOut) {
          if (c32 != nullptr) {
            float* row32 = c32 + static_cast<int64_t>(tok) * p.ldc;
            row32[f_lo] = (d[j][4 * i + c] + b_lo) * w;
            row32[f_hi] = (d[j][4 * i + 2 + c] + b_hi) * w;
            continue;
          }
        }
        T* row = cbase + static_cast<int64_t>(tok) * p.ldc;
        row[f_lo] = from_float<T>((d[j][4 * i + c] + b_lo) * w);
        row[f_hi] = from_float<T>((d[j][4 * i + 2 + c] + b_hi) * w);
      }
    }
  }
  tl_end();
}

// One launch: a CTA's pieces of output tiles.
// * MoE: CTA = ((feature tile, split), m tile), all of K or (p.k_splits > 1) one contiguous run of its
//   stages, the split's fp32 partial sums in its own output slice (no workspace, no arrivals).
// * Dense, p.k_splits >= 1: CTA = (feature tile, split, m tile), feature-tile-major (CTAs running
//   together share weights in L2); `splits` CTAs share a tile, each over a contiguous run of its
//   64-k stages.
// * Dense, p.k_splits == -1 (stream-K, as the mma.sync kernel's striping): the tiles' stages in
//   one sequence (tile t = f_tile * m_tiles + m_tile, then its stages), CTA c takes the run
//   [c W / G, (c + 1) W / G) of the W = tiles * K/64 stages, G = gridDim.x, so that every SM gets
//   the same work when the tiles do not divide the resident CTAs (4096x28672, 8192x28672: 112
//   tiles of two strips on 132 SMs). A tile cut between CTAs is summed by the last piece to
//   arrive; region of CTA c's piece: 2c for its first tile, 2c + 1 for its last.
//   The two-compute-warpgroup producer form (dense) runs the first D = floor(tiles / G) rounds as whole
//   tiles (round r: tile r G + c, so the CTAs running together share weight strips in L2 as in the
//   tile-per-CTA launch) and stream-K over the tiles left, as the "data-parallel + stream-K" hybrid of
//   Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on
//   the GPU" (2023); one round fewer where the tiles left would give a CTA under kWgSkMinStages stages.
//   Stream-K over all tiles re-read each weight strip from HBM per token tile (a CTA's run walks the tiles
//   of one strip one after another), e.g. (160, 2, 4) 8192x28672 M = 640 stream-K 552 us vs whole tiles
//   523 (4 rounds, the last 39% full). -DJM_WG_NO_HYBRID: stream-K over all tiles (measurements).
// The piece loop (see wgmma_body); ROLE: 0 every thread (plain form), 1 the producer
// warpgroup, 2 the compute warpgroups of the producer form. MOE (the producer form, stream-K only):
// the tiles are (feature tile, expert block) over the blocks that hold rows (the alignment's padded
// count, read after griddep_wait), so W is known on the device only; with fewer stages than CTAs
// the CTAs past W take none and leave at once (G = min(gridDim.x, W) in the formulas).
#ifdef JM_WG_NO_HYBRID
constexpr bool kWgHybrid = false;
#else
constexpr bool kWgHybrid = true;
#endif
constexpr int kWgSkMinStages = 16;  // the hybrid's stream-K stages per CTA at least (gemm.WGMMA_SPLIT_MIN_STAGES)
template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS, int NT, int FW, int STAGES, int WGS, bool PROD,
          int ROLE, int MINB, bool MOE = false>
JM_DEVICE void wgmma_pieces(const JmGemmParams p, const JmTensorMap* amap, WgRing& ring) {
  static_assert(!MOE || PROD, "the MoE piece loop is the producer form's");
  constexpr int kStrips = WGS * FW;
  const int f_tiles = p.n / (64 * kStrips);
  const int ks = p.k / 64, c = static_cast<int>(blockIdx.x);
  int m_tiles = p.grid;
  if constexpr (MOE) {
    // the routing tables are the previous kernels' output (read at once when p.tables_ready: wgmma_tile)
    if (!p.tables_ready || kWaitFirst) griddep_wait();
    m_tiles = *p.num_padded / NT;
  }
  // stream-K for tiles of up to 64 tokens (at 128 the plain and wide kernels' registers spill with it), and
  // in the producer form with two compute warpgroups (232 registers each; K.WGMMA_PROD2_CONFIGS, routed where
  // 128-token tiles fill the SMs poorly: gemm.wgmma_route_stream2)
  const bool stream = MOE || ((NT <= 64 || (PROD && WGS == 2)) && p.k_splits < 0);
  const int splits = MOE || p.k_splits < 1 ? 1 : p.k_splits;
  // the CTAs that share the W stages (MoE: none past W)
  auto stream_ctas = [](int64_t w) -> int64_t {
    if constexpr (MOE) return w < static_cast<int64_t>(gridDim.x) ? w : static_cast<int64_t>(gridDim.x);
    return gridDim.x;
  };
  // stream-K: this CTA's run [u0, u1) of the W stages of the tiles after the first `dp` rounds of whole
  // tiles (W < 2^31: gemm.wgmma_stream_grid); split: one piece, and the loop below runs once
  int u0 = 0, u1 = 1, dp = 0, t_sk = 0;
  if (stream) {
    const int64_t G = stream_ctas(static_cast<int64_t>(f_tiles) * m_tiles * ks);
    if (MOE && c >= G) return;
    if constexpr (kWgHybrid && !MOE && PROD && WGS == 2) {
      const int tiles = f_tiles * m_tiles;
      dp = tiles / static_cast<int>(G);
      const int left = tiles - dp * static_cast<int>(G);
      if (dp > 0 && left > 0 && static_cast<int64_t>(left) * ks < G * kWgSkMinStages) --dp;
      t_sk = dp * static_cast<int>(G);
    }
    const int64_t W = static_cast<int64_t>(f_tiles) * m_tiles * ks - static_cast<int64_t>(t_sk) * ks;
    u0 = static_cast<int>(c * W / G);
    u1 = static_cast<int>((c + 1) * W / G);
  }
#pragma unroll 1
  for (int r = 0, u = u0; r < dp || u < u1;) {  // one call site: the tile's code is inlined once
    int f_tile, m_tile, kt0, k_tiles;
    WgPiece piece{1, 0, 0, 0, 0};
    if (r < dp) {  // a whole tile of the hybrid's first rounds
      const int t = r++ * static_cast<int>(gridDim.x) + c;
      f_tile = t / m_tiles;
      m_tile = t - f_tile * m_tiles;
      kt0 = 0;
      k_tiles = ks;
    } else if (stream) {  // stages [x, x_end) of the stream-K sequence are tile t_sk + u / ks
      const int t = u / ks, x = t * ks, x_end = x + ks, e = u1 < x_end ? u1 : x_end;
      f_tile = (t_sk + t) / m_tiles;
      m_tile = (t_sk + t) - f_tile * m_tiles;
      kt0 = u - x;
      k_tiles = e - u;
      if (k_tiles < ks) {  // cut between CTAs: CTAs c_first .. c_last hold its pieces
        const int64_t W_all = static_cast<int64_t>(f_tiles) * m_tiles * ks, G = stream_ctas(W_all),
                      W = W_all - static_cast<int64_t>(t_sk) * ks;
        const int c_first = static_cast<int>(((x + 1) * G + W - 1) / W) - 1;
        const int c_last = static_cast<int>((static_cast<int64_t>(x_end) * G + W - 1) / W) - 1;
        piece = WgPiece{c_last - c_first + 1, 2 * c + (u0 >= x ? 0 : 1), 2 * c_first, 2,
                        c_first * W / G >= x ? 0 : 1};
      }
      if (!PROD && u != u0) __syncthreads();  // every warp is past the previous piece's last stage
      // (the producer form: the producer waits for each slot's `empty` barrier instead)
      u = e;
    } else {
      const int per_f = m_tiles * splits;
      f_tile = c / per_f;
      const int rem = c - f_tile * per_f;
      // in clusters of the splits (wgmma_tile's cluster sum): split = the CTA's rank, the fastest index
      const bool clustered = splits > 1 && cluster_nctarank() > 1;
      const int split = clustered ? rem % splits : rem / m_tiles;
      m_tile = clustered ? rem / splits : rem - split * m_tiles;
      kt0 = split * ks / splits;
      k_tiles = (split + 1) * ks / splits - kt0;
      u = u1;
    }
    wgmma_tile<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, MOE, WGS, PROD, ROLE, MINB>(
        p, f_tile, m_tile, kt0, k_tiles, [&]() -> WgPiece {
          if (stream || splits == 1) return piece;
          // split pieces: region = the CTA, the tile's splits m_tiles regions apart
          const int cc = static_cast<int>(blockIdx.x), per_f = p.grid * splits, ft = cc / per_f;
          const int mt = (cc - ft * per_f) % p.grid;
          return WgPiece{splits, cc, ft * per_f + mt, p.grid, 0};
        },
        amap, ring);
  }
}
// The producer form's registers: launched with __launch_bounds__(128 (WGS + 1), MINB), so each
// thread starts with 65536 / (128 (WGS + 1) MINB) registers rounded down to 8; the producer
// warpgroup drops to kWgProdRegs and the WGS compute warpgroups share what it frees (the CTA's
// pool, PTX ISA). Per SM sub-partition a CTA has one producer warp per WGS compute warps, so the
// `.inc` is always served there too (40 + 216 = 2 x 128 for WGS = 1, MINB = 2; 40 + 120 = 2 x 80
// for WGS = 1, MINB = 3; 40 + 88 = 2 x 64 for WGS = 1, MINB = 4, the MoE blocks of 24 rows of 4-bit
// families; 40 + 2 x 232 = 3 x 168 for WGS = 2, MINB = 1).
constexpr int kWgProdRegs = 40;
constexpr int kWgMaxRegs = 248;  // per-thread registers, a multiple of 8 below the 255 limit
constexpr int wg_regs_cap(int r) { return r > kWgMaxRegs ? kWgMaxRegs : r; }
constexpr int wg_launch_regs(int wgs, int minb) { return wg_regs_cap(65536 / (128 * (wgs + 1) * minb) / 8 * 8); }
constexpr int wg_consumer_regs(int wgs, int minb) {
  return wg_regs_cap((wg_launch_regs(wgs, minb) + (wg_launch_regs(wgs, minb) - kWgProdRegs) / wgs) / 8 * 8);
}
static_assert(wg_consumer_regs(1, 2) == 216 && wg_consumer_regs(1, 3) == 120 && wg_consumer_regs(1, 4) == 88 &&
                  wg_consumer_regs(2, 1) == 232,
              "producer-form register split");

template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS, int NT, int FW, int STAGES, bool MOE, int WGS,
          bool PROD = false, int MINB = 1>
JM_DEVICE void wgmma_body(const JmGemmParams p, const JmTensorMap* amap) {
  const int m_tiles = p.grid;
  const int ks = p.k / 64, c = static_cast<int>(blockIdx.x);
  // TMA activations: one mbarrier per ring slot, its phase parity per slot in act_phase (bit s),
  // kept across the CTA's pieces (stream-K runs several tiles through the same ring)
  __shared__ __align__(8) uint64_t act_bar[STAGES], full_bar[PROD ? STAGES : 1], empty_bar[PROD ? STAGES : 1];
  WgRing ring{act_bar, full_bar, empty_bar, 0u, 0u, 0u, 0u};
  // MoE: CTA = ((feature tile, split), m tile); split s of p.k_splits > 1 takes the s-th contiguous
  // run of K's stages and writes fp32 partial sums into its own output slice (wgmma_tile's epilogue)
  const int moe_splits = MOE && NT <= 64 && p.k_splits > 1 ? p.k_splits : 1, moe_fs = c / m_tiles;
  const int moe_split = moe_fs % moe_splits, moe_kt0 = moe_split * ks / moe_splits;
  const int moe_f = moe_fs / moe_splits, moe_kts = (moe_split + 1) * ks / moe_splits - moe_kt0;
  if constexpr (MOE && !PROD) {  // CTA = (feature tile, m tile), its run of K, written out directly
    wgmma_tile<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, MOE, WGS, false, 0, MINB>(
        p, moe_f, c % m_tiles, moe_kt0, moe_kts, []() { return WgPiece{1, 0, 0, 0, 0}; }, amap, ring);
    return;
  }
  if constexpr (wg_tma(NT, MOE) || PROD) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; s++) {
        if constexpr (PROD) {
          mbar_init(&full_bar[s], 1);  // the producer's expect_tx arrival (and the bytes)
          mbar_init(&empty_bar[s], 4 * WGS);  // one arrival per compute warp
        } else {
          mbar_init(&act_bar[s], 1);
        }
      }
      mbar_fence_init();
    }
    __syncthreads();
  }
  if constexpr (PROD) {  // the producer warpgroup gives its registers to the compute warpgroups; the
    // two roles never share code after it (ptxas then keeps one register budget per branch)
    constexpr auto whole = []() { return WgPiece{1, 0, 0, 0, 0}; };  // MoE: CTA = ((feature tile, split), m tile)
    // one role's code, written once and expanded in each role's branch: dense, the piece loop; MoE, the
    // CTA's tile over its run of K, or with p.k_splits == -1 stream-K over the blocks that hold rows
#define JM_WG_PROD_ROLE(ROLE)                                                                                \
  if constexpr (MOE) {                                                                                       \
    if (p.k_splits >= 0)                                                                                     \
      wgmma_tile<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, MOE, WGS, true, ROLE, MINB>(                 \
          p, moe_f, c % m_tiles, moe_kt0, moe_kts, whole, amap, ring);                                       \
    else                                                                                                     \
      wgmma_pieces<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, WGS, true, ROLE, MINB, true>(p, amap, ring); \
  } else {                                                                                                   \
    wgmma_pieces<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, WGS, true, ROLE, MINB>(p, amap, ring);       \
  }
    if (threadIdx.x >= 128 * WGS) {
      setmaxnreg_dec<kWgProdRegs>();
      JM_WG_PROD_ROLE(1)
    } else {
      setmaxnreg_inc<wg_consumer_regs(WGS, MINB)>();
      JM_WG_PROD_ROLE(2)
    }
#undef JM_WG_PROD_ROLE
  } else if constexpr (!MOE) {
    wgmma_pieces<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, WGS, false, 0, MINB>(p, amap, ring);
  }
}

}  // namespace jm

// Two CTAs per SM with one strip per warpgroup (<= 128 registers), one with two.
// The second parameter: the dense activations' TMA descriptor (read by the tiles wg_tma selects;
// the host passes one to every wgmma kernel).
#define JM_WGMMA_KERNEL(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, MOE)                        \
  extern "C" __global__ void __launch_bounds__(256, (FW) == 1 ? 2 : 1)                                    \
      NAME(const JmGemmParams p, const __grid_constant__ jm::JmTensorMap amap) {                          \
    jm::wgmma_body<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, MOE, 2>(p, &amap);                      \
  }
// The "wide" form of a two-strip CTA (256 features x NT tokens, the host's FW = 2 shapes: same ring,
// grid and workspace): four warpgroups of one strip each, 512 threads, 16 warps on one SM.
#define JM_WGMMA_KERNEL_WIDE(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, NT, STAGES)                            \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                    \
      NAME(const JmGemmParams p, const __grid_constant__ jm::JmTensorMap amap) {                          \
    jm::wgmma_body<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, 1, STAGES, false, 4>(p, &amap);                     \
  }
// The producer form (dense; its activations by TMA at every token tile, 16 and 32 too): WGS compute
// warpgroups of FW strips and one producer warpgroup, 128 (WGS + 1) threads, MINB CTAs per SM; the
// producer warpgroup drops to kWgProdRegs registers and the compute warpgroups take the rest
// (setmaxnreg, wgmma_body). Built with WGS = 1 (256 threads) and MINB = 2 CTAs per SM: FW = 2 for the
// host's 128-feature configs, FW = 4 for its 256-feature ones (session 20); WGS = 2, MINB = 1, FW = 2: two
// compute warpgroups, 128-token tiles with stream-K (K.WGMMA_PROD2_CONFIGS; session 19 found it slower with
// whole tiles, session 39 routes it where whole tiles fill the SMs poorly, NOTES.md);
// or MINB = 3 with FW = 2 and tiles of up to 32 tokens (K.WGMMA_PROD_CTAS: 12 compute warps per SM,
// 120 registers each, one accumulator set; the route at M = 17-32 on large problems since session 20).
// With four strips a k16 step issues four wgmma and the ring's stage holds 8 KB of 4-bit weights per
// 4 KB of 32-token activations (twice the weight bytes in flight, half the activation re-reads); the
// H200 (session 20, M = 24 / 32) put it 8-11% ahead of two strips at two CTAs per SM on 8192x28672,
// 28672x8192 and 4096x28672 (its compute alone, -DJM_WG_COMPUTE_ONLY, no faster: the gain is the data
// path), but two strips at three CTAs per SM were faster still (NOTES.md): built for probes only.
#define JM_WGMMA_KERNEL_PROD(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, WGS, MINB)              \
  extern "C" __global__ void __launch_bounds__(128 * ((WGS) + 1), MINB)                                  \
      NAME(const JmGemmParams p, const __grid_constant__ jm::JmTensorMap amap) {                          \
    jm::wgmma_body<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, false, WGS, true, MINB>(p, &amap);      \
  }
// The producer form of the MoE kernel (session 25): as above with MOE (expert blocks of NT rows, all
// of K per CTA), for activations pre-gathered in slot-list order only (p.a_by_position: the host's
// moe.gather_by_position), so that a block's rows are one TMA box as in the dense form. (Gathering
// the rows in the kernel, one 1-row TMA box per row issued by the producer warp's lanes, was correct
// but 2-3x slower on the H200: NOTES.md session 25.) MINB: 2, 3, or 4 for 4-bit blocks of 24 rows
// (K.WGMMA_PROD_CTAS_U4; session 28).
#define JM_WGMMA_KERNEL_PROD_MOE(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, WGS, MINB)          \
  extern "C" __global__ void __launch_bounds__(128 * ((WGS) + 1), MINB)                                  \
      NAME(const JmGemmParams p, const __grid_constant__ jm::JmTensorMap amap) {                          \
    jm::wgmma_body<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, FW, STAGES, true, WGS, true, MINB>(p, &amap);       \
  }
