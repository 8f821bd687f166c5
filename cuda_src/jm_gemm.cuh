// jitmarlin — the mixed-precision GEMM kernel template (dense and MoE share it).
//
//   C[m, n] = sum_k A[m, k] * s[grp(k), n] * (q[k, n] - z[grp(k), n])
//
// Design (after the Marlin paper, Frantar et al. 2024; our code):
// - A CTA covers nwarps 64-column strips (runtime); warp w owns strip w of the output and all
//   R rows of the m tile, and runs over K in tiles of TILE_K. With KSPLIT > 1 (bulk tiles)
//   KSPLIT warps share a strip, each taking a part of every k tile, and meet in shared memory
//   when a unit ends.
// - Weights are pre-shuffled (jitmarlin/quant/layout.py) so that one 16-byte shared-memory load
//   per lane per 16 k yields all B fragments of the warp's 64 columns, and a strip's weights
//   are contiguous along K: a tile of one strip is one contiguous block of memory.
// - A multi-stage ring (STAGES) streams the weights, activation tile and group scales/zero
//   points into shared memory: cp.async by all threads with one barrier per tile, or on sm_90
//   (BULK) bulk copies by a producer warp with full/empty mbarriers per slot (see below).
// - Activations use an XOR swizzle of 16-byte chunks (chunk ^ (row & 7)) so that both the
//   cp.async writes and the ldmatrix reads are free of bank conflicts (BULK: rows padded by 16
//   bytes instead, since a bulk copy lands a whole row).
// - Small batch (SWAP, M <= 16): the MMA is issued transposed, weights in the 16-row A slot and
//   8 tokens in the 8-column B slot (M_BLOCKS groups of 8 tokens), so no half of the m16 tile is
//   wasted at M <= 8 and the group scales stay per lane (no shuffles) at M <= 16.
// - Work is striped over CTAs (jm_schedule.cuh); split units meet in an fp32 fixup slot.
#pragma once

#include "jm_dequant.cuh"
#include "jm_gemm_params.h"
#include "jm_schedule.cuh"

namespace jm {

template <int BITS, bool HAS_ZP, int GROUP_BLOCKS, int M_BLOCKS, bool SWAP, int K_BLOCKS, bool BULK = false,
          bool DIRECT = false>
struct GemmShape {
  static constexpr int kRows = SWAP ? 8 * M_BLOCKS : 16 * M_BLOCKS;  // rows of an m tile
  static constexpr int kTileK = 16 * K_BLOCKS;
  static constexpr bool kGrouped = GROUP_BLOCKS > 0;       // else one scale per column (epilogue)
  // scale / zero-point rows one stage needs (several when a group is shorter than the tile)
  static constexpr int kGroupRows = (kGrouped && GROUP_BLOCKS < K_BLOCKS) ? K_BLOCKS / GROUP_BLOCKS : 1;
  static constexpr int kAChunksPerRow = kTileK / 8;        // 16-byte chunks of one A row
  // A row pitch in shared memory: the cp.async ring swizzles 16-byte chunks within a row; the
  // bulk-copy ring lands whole rows, so it pads each row by 16 bytes instead (8 rows read by one
  // ldmatrix phase then start in 8 different bank groups).
  static constexpr int kAPitch = BULK ? kTileK * 2 + 16 : kTileK * 2;
  static constexpr int kAStageBytes = kRows * kAPitch;
  // one strip, one tile (DIRECT: the weights go to registers, not through shared memory)
  static constexpr int kBWarpBytes = DIRECT ? 0 : K_BLOCKS * 16 * 64 * BITS / 8;
  static constexpr int kSWarpBytes = kGrouped ? kGroupRows * 64 * 2 : 0;
  static constexpr int kZWarpBytes = HAS_ZP ? kGroupRows * 64 * BITS / 8 : 0;
  static constexpr int kWordsPerK16 = 16 * 64 * BITS / 32;  // int32 words of one strip per 16 k
  static constexpr int kAcc = SWAP ? 16 * M_BLOCKS : 32 * M_BLOCKS;  // fp32 accumulators per thread
  // Small m tiles with one scale row per tile: multiply the tile's fp32 partial sums by the
  // scales once (kAcc FFMA per tile) instead of every dequantized weight pair (16 HMUL2 per 16 k
  // per warp). Only pays when kAcc is small and a tile does not span several groups.
#ifdef JM_NO_SCALE_ACC  // tuning switch (JITMARLIN_NVCC_FLAGS=-DJM_NO_SCALE_ACC): always scale weights
  static constexpr bool kScaleAcc = false;
#else
  static constexpr bool kScaleAcc = kGrouped && GROUP_BLOCKS >= K_BLOCKS && (SWAP || M_BLOCKS == 1);
#endif

  static_assert(K_BLOCKS == 4 || K_BLOCKS == 8, "TILE_K must be 64 or 128 (A swizzle needs >= 8 chunks)");
  static_assert(BITS == 4 || BITS == 8, "4- or 8-bit weights");
  static_assert(M_BLOCKS >= 1 && M_BLOCKS <= 4 && (!SWAP || M_BLOCKS <= 2), "m tile of 8, 16, 32, 48, 64 rows");
  static_assert(!kGrouped || K_BLOCKS % GROUP_BLOCKS == 0 || GROUP_BLOCKS % K_BLOCKS == 0,
                "group size and TILE_K must divide one another");

  JM_HD static int stage_bytes(int nwarps) {
    return kAStageBytes + nwarps * (kBWarpBytes + kSWarpBytes + kZWarpBytes);
  }
  // fp32 exchange space after the ring when KSPLIT warps share a strip (in-CTA k reduction)
  JM_HD static int reduce_bytes(int nwarps, int ksplit) { return (ksplit - 1) * nwarps * 32 * kAcc * 4; }
};

// Row (within the m tile) and column (within the warp's 64-column strip) of accumulator i.
//   normal: i = (mb * 8 + e) * 4 + c  ->  row mb*16 + g + 8*(c>>1), column 8e + 2t + (c&1)
//   SWAP:   i = (tg * 4 + j) * 4 + c  ->  row 8tg + 2t + (c&1),      column 16j + g + 8*(c>>1)
template <bool SWAP>
JM_DEVICE int acc_row(int i, int g, int t) {
  const int c = i & 3;
  if constexpr (SWAP) return 8 * (i >> 4) + 2 * t + (c & 1);
  else return (i >> 5) * 16 + g + 8 * (c >> 1);
}
template <bool SWAP>
JM_DEVICE int acc_col(int i, int g, int t) {
  const int c = i & 3;
  if constexpr (SWAP) return 16 * ((i >> 2) & 3) + g + 8 * (c >> 1);
  else return 8 * ((i >> 2) & 7) + 2 * t + (c & 1);
}

template <typename T>
JM_DEVICE float to_float(T v) {
  if constexpr (DType<T>::kBF16) return __bfloat162float(v);
  else return __half2float(v);
}
template <typename T>
JM_DEVICE T from_float(float v) {
  if constexpr (DType<T>::kBF16) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

// Broadcast 16-bit half `e & 1` of register r to both halves.
JM_DEVICE uint32_t bcast_half(uint32_t r, int hi) { return __byte_perm(r, r, hi ? 0x3232 : 0x1010); }

// Half `hi` of register r (fp16 or bf16 bits) as fp32.
template <typename T>
JM_DEVICE float half_to_float(uint32_t r, int hi) {
  const uint32_t bits = hi ? r >> 16 : r & 0xFFFFu;
  if constexpr (DType<T>::kBF16) return __uint_as_float(bits << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS, int M_BLOCKS, bool SWAP, int K_BLOCKS,
          int STAGES, bool MOE, bool BULK, int KSPLIT, int DIRECT = 0, int CLUSTER = 0>
JM_DEVICE void gemm_body(const JmGemmParams p) {
  // CLUSTER > 1 (dense bulk tiles, sm_90): launched in clusters of CLUSTER CTAs, each output unit
  // split evenly along K across one cluster's CTAs and summed through distributed shared memory.
  constexpr bool kCluster = CLUSTER > 1;
  // Split units ending mid-run publish their partials without waiting and the producer warp
  // arrives for them later; the unit's first CTA sums without storing its own partial when it
  // finds the others arrived (finish_unit, kPublish / kDeferred). H200 session 11, same-run A/B
  // against the plain protocol (-DJM_FIXUP_V0): the 8-row one-tile-ahead direct tile gains
  // (8192x28672 / 28672x8192 M=1 35.2 -> 34.4, 36.6 -> 35.4 us), every other route measured
  // 0.5-1.5 us slower with it compiled in (8192^2 M=16 19.0 -> 20.1), so only that tile has it.
#if defined(JM_FIXUP_V0) || defined(JM_NO_FIXUP)
  constexpr bool kEarlyPublish = false;
#else
  constexpr bool kEarlyPublish = BULK && !kCluster && DIRECT == 1 && SWAP && M_BLOCKS == 1;
#endif
  static_assert(!kCluster || (BULK && !MOE && (CLUSTER == 2 || CLUSTER == 4 || CLUSTER == 8)),
                "cluster tiles: dense bulk tiles, clusters of 2, 4 or 8");
  // DIRECT > 0 (experiment, session 6): the math warps load their own weight words straight from
  // global memory into registers, DIRECT tiles ahead (Marlin's layout gives each lane its
  // fragments in one 16-byte word per 16 k), and the producer warp brings only A and the scales.
  static_assert(DIRECT == 0 || (BULK && KSPLIT == 1), "direct weight loads: bulk tiles, no k split");
  using S = GemmShape<BITS, HAS_ZP, GROUP_BLOCKS, M_BLOCKS, SWAP, K_BLOCKS, BULK, (DIRECT > 0)>;
  // KSPLIT warps share each 64-column strip, each taking K_BLOCKS / KSPLIT of every k tile, and
  // meet in shared memory when a unit ends: more warps per SM without a deeper ring.
  static_assert(KSPLIT == 1 || (BULK && K_BLOCKS % KSPLIT == 0), "k-split warps: bulk tiles, KSPLIT | K_BLOCKS");
  constexpr int KPW = K_BLOCKS / KSPLIT;  // 16-k blocks per warp per tile
#if defined(__CUDA_ARCH__) && !JM_HAS_BULK
  static_assert(!BULK, "BULK tiles (bulk copies, mbarriers) need sm_90");
#endif
  static_assert(STAGES >= 2, "at least two stages");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;
  // bulk tiles: the split unit a CTA ends mid-run (kPublish below): its partials are stored
  // (pub_bar, every math lane), the producer's arrival on the counter is done (done_bar), and
  // whether that arrival was the unit's last (s_defer)
  __shared__ __align__(8) uint64_t pub_bar;
  __shared__ __align__(8) uint64_t done_bar;
  __shared__ int s_defer;

  const int tid = threadIdx.x, lane = tid & 31, warp_id = tid >> 5;
#ifdef JM_TIMELINE
  // Diagnostics (benchmarks/probe_timeline.py; bulk tiles): globaltimer ns per CTA at
  // p.timeline[8 * blockIdx.x + i]: 0 entry, 1 the producer past griddep_wait, 2 math warp 0's
  // first tile landed, 3 its last tile computed, 4 its end (after the last unit's fixup and
  // output); 5 the SM, 6 the CTA's tiles, 7 ns math warp 0 spent in unit fixups and outputs.
#define JM_TL(i, v)                                                          \
  do {                                                                       \
    if (p.timeline != nullptr) p.timeline[8 * blockIdx.x + (i)] = (v);      \
  } while (0)
  if (tid == 0) {
    JM_TL(0, globaltimer());
    JM_TL(5, smid());
  }
#else
#define JM_TL(i, v) \
  do {              \
  } while (0)
#endif
  const int g = lane >> 2, t = lane & 3;
  const int nwarps = p.nwarps;  // strips (of 64 columns) per CTA
  const int nmath = nwarps * KSPLIT;  // warps that compute
  const int warp = KSPLIT > 1 ? warp_id % nwarps : warp_id;  // this warp's strip
  const int kpart = KSPLIT > 1 ? warp_id / nwarps : 0;       // and its part of each k tile
  const int n_tiles = p.n / (64 * nwarps);
  const int k_tiles = p.k / S::kTileK;
  // MoE: the expert of m tile i. The table is the alignment's, or (p.ids_shift = 1, one token) the
  // router's int64 ids themselves, one block per slot; p.num_experts > 0 clamps the ids so that a
  // bad one reads some expert's weights, never memory past them (unsigned: -1 clamps too).
  auto expert_of = [&](int m_tile) {
    const unsigned e = static_cast<unsigned>(__ldg(p.expert_ids + (m_tile << p.ids_shift)));
    return static_cast<int>(min(e, static_cast<unsigned>(p.num_experts - 1)));
  };
  int m_tiles;
  // MoE: the routing tables come from the previous kernel (programmatic dependent launch), unless
  // the launch says they were complete before it started (bulk tiles only: the cp.async ring
  // waits here either way, its first copies need the activations too).
  if constexpr (MOE) {
    if (!BULK || !p.tables_ready) griddep_wait();
  }
  if constexpr (MOE) m_tiles = *p.num_padded / S::kRows;
  else m_tiles = ceil_div(p.m, S::kRows);
  const Schedule sch = make_schedule(n_tiles, m_tiles, k_tiles, p.grid);
  const int begin = blockIdx.x * sch.iters;
  const int end = min(sch.total, begin + sch.iters);
  if (begin >= end) return;
  const int n_it = end - begin;
  if (tid == 0) JM_TL(6, n_it);

  const int stage_bytes = S::stage_bytes(nwarps);
  const int b_off = S::kAStageBytes + warp * S::kBWarpBytes;
  const int s_off = S::kAStageBytes + nwarps * S::kBWarpBytes + warp * S::kSWarpBytes;
  const int z_off = S::kAStageBytes + nwarps * (S::kBWarpBytes + S::kSWarpBytes) + warp * S::kZWarpBytes;
  const int64_t strip_words = static_cast<int64_t>(p.k / 16) * S::kWordsPerK16;
  const int group_k = 16 * GROUP_BLOCKS;
  // Byte offset of 16-byte chunk `ch` of A row `row` within a stage.
  auto a_offset = [](int row, int ch) {
    if constexpr (BULK) return row * S::kAPitch + ch * 16;
    else return row * S::kAPitch + ((ch ^ (row & 7)) * 16);
  };
  // Barrier over the threads that compute (the producer warp of BULK tiles stays out of it).
  auto math_sync = [&]() {
    if constexpr (BULK) named_sync(32 * nmath);
    else __syncthreads();
  };

  // Position of a tile in the schedule; stepped forward without divisions.
  struct Cursor {
    int kt, m_tile, n_tile;
  };
  auto cursor_at = [&](int it) {
    const int u = it / k_tiles;
    const int n_tile = u / m_tiles;
    return Cursor{it - u * k_tiles, u - n_tile * m_tiles, n_tile};
  };
  auto advance = [&](Cursor& c) {
    if (++c.kt == k_tiles) {
      c.kt = 0;
      if (++c.m_tile == m_tiles) {
        c.m_tile = 0;
        ++c.n_tile;
      }
    }
  };

  // ---- fetch one tile (unit, k tile) of weights, scales, zero points and activations ----
  auto fetch_tile = [&](const Cursor& cur, int slot) {
    const int kt = cur.kt, m_tile = cur.m_tile, n_tile = cur.n_tile;
    const int strip = n_tile * nwarps + warp;
    int expert = 0;
    if constexpr (MOE) expert = expert_of(m_tile);
    uint8_t* st = smem + slot * stage_bytes;

    const int4* bsrc = reinterpret_cast<const int4*>(static_cast<const uint32_t*>(p.b) + expert * p.b_expert_stride +
                                                     strip * strip_words +
                                                     static_cast<int64_t>(kt) * K_BLOCKS * S::kWordsPerK16);
    int4* bdst = reinterpret_cast<int4*>(st + b_off);
#pragma unroll
    for (int i = 0; i < S::kBWarpBytes / (16 * 32); i++) cp_async16(bdst + lane + 32 * i, bsrc + lane + 32 * i);

    int grow0 = 0;  // first scale / zero-point row of this tile
    if constexpr (S::kGrouped) grow0 = (kt * S::kTileK) / group_k;
    if constexpr (S::kGrouped) {
      if (lane < 8 * S::kGroupRows) {  // 64 scales = 8 chunks per row
        const int r = lane >> 3, ch = lane & 7;
        const T* src = static_cast<const T*>(p.s) + expert * p.s_expert_stride +
                       static_cast<int64_t>(grow0 + r) * p.n + strip * 64 + ch * 8;
        cp_async16(st + s_off + r * 128 + ch * 16, src);
      }
    }
    if constexpr (HAS_ZP) {
      constexpr int kChunks = BITS / 2;  // 64 zero points: 32 B (4-bit) or 64 B (8-bit)
      if (lane < kChunks * S::kGroupRows) {
        const int r = lane / kChunks, ch = lane % kChunks;
        const uint32_t* src = static_cast<const uint32_t*>(p.z) + expert * p.z_expert_stride +
                              static_cast<int64_t>(grow0 + r) * (p.n * BITS / 32) + strip * 2 * BITS + ch * 4;
        cp_async16(st + z_off + r * (8 * BITS) + ch * 16, src);
      }
    }

    constexpr int kAChunks = S::kRows * S::kAChunksPerRow;
    for (int c = tid; c < kAChunks; c += blockDim.x) {
      const int row = c / S::kAChunksPerRow, ch = c % S::kAChunksPerRow;
      int src_row;
      bool valid;
      if constexpr (MOE) {
        const int pos = m_tile * S::kRows + row;
        const int slot_id = __ldg(p.sorted_ids + pos);
        valid = slot_id < p.m;
        src_row = !valid ? 0 : (p.a_by_position ? pos : slot_id / p.top_k);
      } else {
        src_row = m_tile * S::kRows + row;
        valid = src_row < p.m;
        if (!valid) src_row = 0;
      }
      const T* src = static_cast<const T*>(p.a) + static_cast<int64_t>(src_row) * p.lda + kt * S::kTileK + ch * 8;
      cp_async16(st + a_offset(row, ch), src, valid);
    }
  };

  float acc[S::kAcc];
#pragma unroll
  for (int i = 0; i < S::kAcc; i++) acc[i] = 0.f;
  float accg[S::kScaleAcc ? S::kAcc : 1];  // this tile's unscaled partial sums (kScaleAcc)
  // Raw fp16 weights (transposed MMA, one group per tile): the MMA multiplies the exact values
  // (1024 + q) / (1024 + 16 q) (dequant4_raw; bf16 4-bit: 128 + q), and the end of the tile removes base and zero
  // point per column with sum(a) over the tile, which one more MMA per 16 k (weights = 1)
  // provides. Saves 4 of 9 ALU instructions per 8 weights. Cancellation costs at most
  // log2(1024 / 4.6) ~ 8 of fp32's 24 mantissa bits, far below the fp16 output's rounding.
#ifdef JM_NO_RAW  // tuning switch (JITMARLIN_NVCC_FLAGS=-DJM_NO_RAW): subtract per weight pair
  constexpr bool kRaw = false;
#else
  // bf16: 4-bit only (128 + q); 128 + q of 8-bit weights needs 9 significant bits
  constexpr bool kRaw = (!DType<T>::kBF16 || BITS == 4) && S::kScaleAcc && SWAP;
#endif

  // MMA into accumulator block i (4 floats): the running sums, or with kScaleAcc the tile's
  // partial sums, started from zero at the tile's first 16 k.
  auto mma_at = [&](int i, const uint32_t(&a)[4], uint32_t b0, uint32_t b1, bool first) {
    if constexpr (S::kScaleAcc) {
      float(&d)[4] = *reinterpret_cast<float(*)[4]>(&accg[i]);
      if (first) {
        d[0] = d[1] = d[2] = d[3] = 0.f;
      }
      mma_16816<T>(d, a, b0, b1);
    } else {
      float(&d)[4] = *reinterpret_cast<float(*)[4]>(&acc[i]);
      mma_16816<T>(d, a, b0, b1);
    }
  };

  // ---- dequantize + MMA over one tile in shared memory ----
  // wreg: DIRECT only, this tile's weight words of this lane (uint4 per 16 k; two for 8-bit)
  auto compute_tile = [&](int slot, const uint4* wreg) {
    const uint8_t* st = smem + slot * stage_bytes;
    uint32_t sr[4];     // raw group scales of lane g: half e = column 8e + g
    uint32_t sc[8];     // group scale of n8-block e, broadcast to both halves
    ZeroConst zc[8];    // zero point of n8-block e, as dequant constants
    float cz[8];        // kRaw: base + zero point of n8-block e as the raw sums carry it
    float sa[kRaw ? M_BLOCKS : 1][4];  // kRaw: sum of a over the tile, per token (columns 2t, 2t+1)
    // raw fp16 4-bit: block 2j holds 1024 + q, block 2j+1 holds (1024 + 16 q) / 16 = 64 + q after
    // the epilogue's 1/16; raw fp16 8-bit: 1024 + q; raw bf16 4-bit: 128 + q in every block
    constexpr bool kHiSixteenth = BITS == 4 && !DType<T>::kBF16;  // block 2j+1 carries 16 q
    auto raw_base = [](int e, uint32_t z) {
      return static_cast<float>((DType<T>::kBF16 ? 128u : (kHiSixteenth && (e & 1) ? 64u : 1024u)) + z);
    };
    if constexpr (!HAS_ZP) {
#pragma unroll
      for (int e = 0; e < 8; e++) {
        zc[e] = make_zero_const<T, BITS>(BITS == 4 ? 8u : 128u);
        cz[e] = raw_base(e, BITS == 4 ? 8u : 128u);
      }
    }
#pragma unroll
    for (int kk = 0; kk < KPW; kk++) {
      const int kb = kpart * KPW + kk;
      const int gr = S::kGroupRows > 1 ? kb / GROUP_BLOCKS : 0;
      const bool new_group = kk == 0 || (S::kGroupRows > 1 && kb % GROUP_BLOCKS == 0);
      if (new_group) {
        if constexpr (S::kGrouped) {
          const uint4 v = *reinterpret_cast<const uint4*>(st + s_off + gr * 128 + g * 16);
          sr[0] = v.x; sr[1] = v.y; sr[2] = v.z; sr[3] = v.w;
          if constexpr (!S::kScaleAcc) {
#pragma unroll
            for (int e = 0; e < 8; e++) sc[e] = bcast_half(sr[e >> 1], e & 1);
          }
        }
        if constexpr (HAS_ZP) {
          if constexpr (BITS == 4) {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(st + z_off + gr * 32 + g * 4);
#pragma unroll
            for (int e = 0; e < 8; e++) {
              zc[e] = make_zero_const<T, 4>((w >> (4 * e)) & 0xFu);
              cz[e] = raw_base(e, (w >> (4 * e)) & 0xFu);
            }
          } else {
            const uint2 w = *reinterpret_cast<const uint2*>(st + z_off + gr * 64 + g * 8);
#pragma unroll
            for (int e = 0; e < 8; e++) {
              zc[e] = make_zero_const<T, 8>(((e < 4 ? w.x : w.y) >> (8 * (e & 3))) & 0xFFu);
              cz[e] = raw_base(e, ((e < 4 ? w.x : w.y) >> (8 * (e & 3))) & 0xFFu);
            }
          }
        }
      }

      uint32_t qw[BITS == 4 ? 4 : 8];
      if constexpr (DIRECT > 0) {
        const uint4 v = wreg[BITS == 4 ? kb : 2 * kb];
        qw[0] = v.x; qw[1] = v.y; qw[2] = v.z; qw[3] = v.w;
        if constexpr (BITS == 8) {
          const uint4 v1 = wreg[2 * kb + 1];
          qw[4] = v1.x; qw[5] = v1.y; qw[6] = v1.z; qw[7] = v1.w;
        }
      } else if constexpr (BITS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(st + b_off + kb * 512 + lane * 16);
        qw[0] = v.x; qw[1] = v.y; qw[2] = v.z; qw[3] = v.w;
      } else {
        const uint4 v0 = *reinterpret_cast<const uint4*>(st + b_off + kb * 1024 + lane * 16);
        const uint4 v1 = *reinterpret_cast<const uint4*>(st + b_off + kb * 1024 + 512 + lane * 16);
        qw[0] = v0.x; qw[1] = v0.y; qw[2] = v0.z; qw[3] = v0.w;
        qw[4] = v1.x; qw[5] = v1.y; qw[6] = v1.z; qw[7] = v1.w;
      }

      uint32_t af[M_BLOCKS][4];
      uint32_t bt[M_BLOCKS][2];
      if constexpr (SWAP) {
#pragma unroll
        for (int tg = 0; tg < M_BLOCKS; tg++) {
          const int row = 8 * tg + (lane & 7), ch = 2 * kb + ((lane >> 3) & 1);
          ldmatrix_x2(bt[tg], st + a_offset(row, ch));
          if constexpr (kRaw) {
            constexpr uint32_t kOne = DType<T>::kBF16 ? 0x3F803F80u : 0x3C003C00u;
            constexpr uint32_t kOnes[4] = {kOne, kOne, kOne, kOne};
            if (kk == 0) sa[tg][0] = sa[tg][1] = sa[tg][2] = sa[tg][3] = 0.f;
            mma_16816<T>(sa[tg], kOnes, bt[tg][0], bt[tg][1]);
          }
        }
      } else {
#pragma unroll
        for (int mb = 0; mb < M_BLOCKS; mb++) {
          const int row = mb * 16 + (lane & 15), ch = 2 * kb + (lane >> 4);
          ldmatrix_x4(af[mb], st + a_offset(row, ch));
        }
      }

#pragma unroll
      for (int j = 0; j < 4; j++) {
        Frag f0, f1;  // n8-blocks 2j and 2j+1
        if constexpr (kRaw) {
          if constexpr (BITS == 4) {
            dequant4_raw<T>(qw[j], f0, f1);
          } else {
            f0 = dequant8_raw(qw[2 * j]);
            f1 = dequant8_raw(qw[2 * j + 1]);
          }
        } else if constexpr (BITS == 4) {
          dequant4<T>(qw[j], zc[2 * j], zc[2 * j + 1], f0, f1);
        } else {
          f0 = dequant8<T>(qw[2 * j], zc[2 * j]);
          f1 = dequant8<T>(qw[2 * j + 1], zc[2 * j + 1]);
        }
        if constexpr (S::kGrouped && !S::kScaleAcc) {
          f0.b0 = mul2<T>(f0.b0, sc[2 * j]);
          f0.b1 = mul2<T>(f0.b1, sc[2 * j]);
          f1.b0 = mul2<T>(f1.b0, sc[2 * j + 1]);
          f1.b1 = mul2<T>(f1.b1, sc[2 * j + 1]);
        }
        if constexpr (SWAP) {
          const uint32_t wa[4] = {f0.b0, f1.b0, f0.b1, f1.b1};
#pragma unroll
          for (int tg = 0; tg < M_BLOCKS; tg++) mma_at(16 * tg + 4 * j, wa, bt[tg][0], bt[tg][1], kk == 0);
        } else {
#pragma unroll
          for (int mb = 0; mb < M_BLOCKS; mb++) {
            mma_at((mb * 8 + 2 * j) * 4, af[mb], f0.b0, f0.b1, kk == 0);
            mma_at((mb * 8 + 2 * j + 1) * 4, af[mb], f1.b0, f1.b1, kk == 0);
          }
        }
      }
    }
    if constexpr (S::kScaleAcc) {
      if constexpr (SWAP) {
        // accumulator 16tg + 4j + c is column 16j + 8(c>>1) + g: lane g's own scale, n8-block 2j + (c>>1),
        // token 8tg + 2t + (c&1)
#pragma unroll
        for (int i = 0; i < S::kAcc; i++) {
          const int e = 2 * ((i >> 2) & 3) + ((i & 3) >> 1);
          float v = accg[i];
          if constexpr (kRaw) {
            const float mul = (kHiSixteenth && (e & 1)) ? 0.0625f : 1.f;
            v = fmaf(v, mul, -cz[e] * sa[i >> 4][i & 1]);
          }
          acc[i] = fmaf(half_to_float<T>(sr[e >> 1], e & 1), v, acc[i]);
        }
      } else {
        // accumulator 4e + c is column 8e + 2t + (c&1): the scale that lane g' = 2t + (c&1) holds
        uint32_t s_even[4], s_odd[4];
#pragma unroll
        for (int r = 0; r < 4; r++) {
          s_even[r] = __shfl_sync(0xFFFFFFFFu, sr[r], 8 * t);
          s_odd[r] = __shfl_sync(0xFFFFFFFFu, sr[r], 8 * t + 4);
        }
#pragma unroll
        for (int i = 0; i < S::kAcc; i++) {
          const int e = (i >> 2) & 7;
          const uint32_t* src = (i & 1) ? s_odd : s_even;
          acc[i] = fmaf(half_to_float<T>(src[e >> 1], e & 1), accg[i], acc[i]);
        }
      }
    }
  };

  // ---- a unit is complete in this CTA: fixup if split, then write C ----
  // Modes: kFinish, the usual case; kPublish (bulk tiles only), a split unit that ends mid-run in
  // a CTA that does not hold the unit's first tile: store the partial sums and go straight on, the
  // producer warp arrives on the unit's counter for the CTA once its own work is issued (the math
  // warps never wait for that round trip mid-run); kDeferred, at the end of the run when that
  // arrival turned out to be the unit's last: sum the unit from the workspace and write it.
  constexpr int kFinish = 0, kPublish = 1, kDeferred = 2;
  auto finish_unit = [&](const Cursor& cur, const int mode) {
    if (mode != kDeferred) {
      if constexpr (KSPLIT > 1) {
        // the k parts of each strip meet in shared memory, in a fixed order
        float* red = reinterpret_cast<float*>(smem + STAGES * stage_bytes);
        if (kpart > 0) {
          float* dst = red + ((kpart - 1) * nwarps + warp) * (S::kAcc * 32) + lane;
#pragma unroll
          for (int i = 0; i < S::kAcc; i++) dst[i * 32] = acc[i];
        }
        math_sync();
        if (kpart == 0) {
#pragma unroll
          for (int kp = 1; kp < KSPLIT; kp++) {
            const float* src = red + ((kp - 1) * nwarps + warp) * (S::kAcc * 32) + lane;
#pragma unroll
            for (int i = 0; i < S::kAcc; i++) acc[i] += src[i * 32];
          }
        }
        math_sync();  // the exchange space is free again
      }
    }
    const bool owner = kpart == 0;  // the warp that writes its strip's results
    int cslice = -1, clg = 0;       // cluster launch: this CTA writes accumulators i with i >> clg == cslice
    const int n_tile = cur.n_tile, m_tile = cur.m_tile;
    const int u = n_tile * m_tiles + m_tile;
    const int n0 = (n_tile * nwarps + warp) * 64;
    int expert = 0;
    if constexpr (MOE) expert = expert_of(m_tile);

    if constexpr (!S::kGrouped) {  // per-channel scale, on fp32 before any sum across CTAs
      if (mode != kDeferred) {
        const T* sp = static_cast<const T*>(p.s) + expert * p.s_expert_stride + n0;
#pragma unroll
        for (int i = 0; i < S::kAcc; i++) acc[i] *= to_float<T>(sp[acc_col<SWAP>(i, g, t)]);
      }
    }

#ifdef JM_NO_FIXUP  // timing bound only (wrong results): split units skip the fixup protocol
    const int ctas = 1;
#else
    const int ctas = unit_ctas(sch, u);
#endif
    if (ctas > 1) {
      // Split unit: every CTA's partial sums go to a workspace region of its own and are added
      // up in CTA order (bit-identical results run to run) by the CTA that arrives last on the
      // unit's counter, or (fast path) by the CTA holding the unit's first tile when it finds
      // every other one already arrived: its own partial is the first summand, kept in
      // registers, and it neither stores it nor arrives.
      const int first = unit_slot(sch, u);
      const int64_t region_floats = static_cast<int64_t>(nwarps) * 32 * S::kAcc;
      // a CTA has at most two split units, its first (region 0) and its last (region 1)
      auto region = [&](int cta) {
        const int r = u == (cta * sch.iters) / k_tiles ? 0 : 1;
        return p.ws + (2 * static_cast<int64_t>(cta) + r) * region_floats + warp * (32 * S::kAcc) + lane * 4;
      };
      // Partials of rows past M are never read back: float4 q of a thread holds rows
      // (SWAP) 8(q/4) + 2t + {0, 1}, (normal) 16(q/8) + g + {0, 8} of the m tile. Skipping them
      // cuts the split traffic by up to 4x at M=1 (dense; MoE rows are not contiguous).
      auto live = [&](int q) {
        if constexpr (MOE) return true;
        const int r = SWAP ? 8 * (q >> 2) + 2 * t : (q >> 3) * 16 + g;
        return m_tile * S::kRows + r < p.m;
      };
      auto publish = [&]() {
        if (owner) {
          float* mine = region(blockIdx.x);
#pragma unroll
          for (int q = 0; q < S::kAcc / 4; q++)
            if (live(q))
              __stcg(reinterpret_cast<float4*>(mine + q * 128),
                     make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]));
        }
      };
      // acc += the partials of CTAs [from, first + ctas), in order; chunks of up to 32
      // accumulators keep all loads of one CTA's chunk in flight together
      auto add_regions = [&](int from) {
        constexpr int kChunk = S::kAcc < 32 ? S::kAcc : 32;
#pragma unroll
        for (int c0 = 0; c0 < S::kAcc; c0 += kChunk) {
          for (int cta = from; cta < first + ctas; cta++) {
            const float* src = region(cta);
            float4 v[kChunk / 4];
#pragma unroll
            for (int q = 0; q < kChunk / 4; q++)
              v[q] = live(c0 / 4 + q) ? __ldcg(reinterpret_cast<const float4*>(src + (c0 / 4 + q) * 128))
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int q = 0; q < kChunk / 4; q++) {
              acc[c0 + 4 * q] += v[q].x;
              acc[c0 + 4 * q + 1] += v[q].y;
              acc[c0 + 4 * q + 2] += v[q].z;
              acc[c0 + 4 * q + 3] += v[q].w;
            }
          }
        }
      };
      auto zero_acc = [&]() {
#pragma unroll
        for (int i = 0; i < S::kAcc; i++) acc[i] = 0.f;
      };

      if constexpr (kCluster) {
        // Cluster launch (bulk tiles, dense): the unit's CTAs are the cluster's, one k range each.
        // Reduce-scatter through distributed shared memory: CTA j of the cluster owns accumulators
        // [j * slice, (j + 1) * slice) of every thread, receives them from the others into its
        // receive space, adds all in rank order (deterministic) and writes those outputs. Two
        // cluster barrier phases instead of global-memory round trips.
        const int rank = static_cast<int>(cluster_ctarank());
        constexpr int slice = S::kAcc / CLUSTER;
        constexpr int lg = slice == 2 ? 1 : slice == 4 ? 2 : slice == 8 ? 3 : slice == 16 ? 4 : slice == 32 ? 5 : 6;
        static_assert(slice >= 2 && (1 << lg) == slice, "accumulator slices of a power of two");
        float* cbuf = reinterpret_cast<float*>(smem + STAGES * stage_bytes + S::reduce_bytes(nwarps, KSPLIT));
        // element i of a thread's slice, sent by CTA src to its owner (src != owner)
        auto cidx = [&](int src, int owner_rank, int i) {
          const int pos = src < owner_rank ? src : src - 1;
          return ((pos * nwarps + warp) * slice + (i & (slice - 1))) * 32 + lane;
        };
        auto row_live = [&](int i) { return m_tile * S::kRows + acc_row<SWAP>(i, g, t) < p.m; };
        cluster_wait();  // phase 0 (arrived at entry): every CTA of the cluster runs
        if (owner) {
#pragma unroll
          for (int i = 0; i < S::kAcc; i++) {
            const int j = i >> lg;
            if (j != rank && row_live(i)) st_cluster_f32(smem_addr(cbuf + cidx(rank, j, i)), j, acc[i]);
          }
        }
        cluster_arrive_release();
        cluster_wait();  // phase 1: every slice has landed at its owner
        if (owner) {
#pragma unroll
          for (int i = 0; i < S::kAcc; i++) {
            if ((i >> lg) == rank && row_live(i)) {
              float sum = 0.f;
#pragma unroll
              for (int r = 0; r < CLUSTER; r++) sum += r == rank ? acc[i] : cbuf[cidx(r, rank, i)];
              acc[i] = sum;
            }
          }
        }
        cslice = rank;
        clg = lg;
      } else {
        if (mode == kPublish) {
          publish();
          // every math lane arrives after its own stores: the producer's wait then orders all of
          // them before its release of the counter (mbarrier arrive/wait: release/acquire, CTA)
          if constexpr (BULK) mbar_arrive(&pub_bar);
          zero_acc();
          return;
        }
        if (mode == kDeferred) {
          __threadfence();  // the producer's arrival saw every other CTA's release
          zero_acc();
          add_regions(first);
        } else {
          bool fast = false;
          // worth a look only when the unit's one other CTA ends it mid-run (its arrival then comes
          // long before this CTA's end); CTAs that all end their runs in the unit arrive together
          const bool fast_possible =
              kEarlyPublish && ctas == 2 && (u + 1) * k_tiles < min(sch.total, (first + 2) * sch.iters);
          if (fast_possible && static_cast<int>(blockIdx.x) == first) {
            if (tid == 0) s_last = ld_acquire_gpu(p.counters + first) == ctas - 1;
            math_sync();
            fast = s_last;
          }
          if (fast) {
            if (tid == 0) p.counters[first] = 0;  // every other CTA of this unit has arrived
            add_regions(first + 1);
          } else {
            publish();
            __threadfence();
            math_sync();
            if (tid == 0) s_last = atomicAdd(p.counters + first, 1) == ctas - 1;
            math_sync();
            if (!s_last || !owner) {
              zero_acc();
              return;
            }
            __threadfence();
            if (tid == 0) p.counters[first] = 0;  // every other CTA of this unit has arrived
            zero_acc();
            add_regions(first);
          }
        }
      }  // not a cluster launch
    }

    if (!owner) {
#pragma unroll
      for (int i = 0; i < S::kAcc; i++) acc[i] = 0.f;
      return;
    }

    T* cbase = static_cast<T*>(p.c);
    const T* bias = static_cast<const T*>(p.bias);
    // The bias of this thread's columns and (MoE) the slots and routing weights of its rows, loaded together ahead
    // of the stores: loaded inside the per-output branches below, each was waited for on its own, a round trip per
    // output (sm_90a SASS, benchmarks/sass_waits.py, session 54). A thread's outputs span few distinct columns (SWAP
    // 8, else 16) and rows (SWAP 2 per 8-row block, else 2 per 16-row block): col_ix / row_ix number them. Tiles
    // of more than 64 accumulators (three and four 16-row blocks) keep the loads at the stores: there ptxas
    // interleaved the hoisted loads with their uses anyway (register pressure), and the MoE forms waited more.
    constexpr bool kHoist = S::kAcc <= 64;
    constexpr bool kHoistBias = kHoist && !MOE;  // (the MoE GEMMs take no bias: moe.py never sets one)
    constexpr int kCols = SWAP ? 8 : 16, kRowsPer = SWAP ? S::kAcc / 8 : S::kAcc / 16;
    auto col_ix = [](int i) { return SWAP ? ((i >> 2) & 3) * 2 + ((i & 3) >> 1) : ((i >> 2) & 7) * 2 + (i & 1); };
    auto row_ix = [](int i) { return SWAP ? (i >> 4) * 2 + (i & 1) : (i >> 5) * 2 + ((i & 3) >> 1); };
    float bcol[kHoistBias ? kCols : 1];
#pragma unroll
    for (int c = 0; c < (kHoistBias ? kCols : 1); c++) bcol[c] = 0.f;
    if (kHoistBias && bias != nullptr) {
#pragma unroll
      for (int i = 0; i < S::kAcc; i++) {  // (each column once: the first i of its col_ix)
        bool first = true;
#pragma unroll
        for (int j = 0; j < i; j++) first = first && col_ix(j) != col_ix(i);
        if (first) bcol[col_ix(i)] = to_float<T>(__ldg(bias + n0 + acc_col<SWAP>(i, g, t)));
      }
    }
    int slot_of[MOE && kHoist ? kRowsPer : 1];
    float w_of[MOE && kHoist ? kRowsPer : 1];
    if constexpr (MOE && kHoist) {
#pragma unroll
      for (int i = 0; i < S::kAcc; i++) {
        bool first = true;
#pragma unroll
        for (int j = 0; j < i; j++) first = first && row_ix(j) != row_ix(i);
        if (first) slot_of[row_ix(i)] = __ldg(p.sorted_ids + m_tile * S::kRows + acc_row<SWAP>(i, g, t));
      }
#pragma unroll
      for (int q = 0; q < kRowsPer; q++) {
        w_of[q] = 1.f;
        if (slot_of[q] < p.m && p.topk_weights != nullptr) w_of[q] = __ldg(p.topk_weights + slot_of[q]);
      }
    }
    // one output row per accumulator pair (normal) or element (SWAP)
    constexpr int kStep = SWAP ? 1 : 2;
#pragma unroll
    for (int i = 0; i < S::kAcc; i += kStep) {
      if (cslice >= 0 && (i >> clg) != cslice) continue;
      const int r = acc_row<SWAP>(i, g, t);
      const int col = n0 + acc_col<SWAP>(i, g, t);
      int out_row;
      bool valid;
      float w = 1.f;
      if constexpr (MOE && kHoist) {
        const int slot_id = slot_of[row_ix(i)];
        valid = slot_id < p.m;
        out_row = slot_id;
        w = w_of[row_ix(i)];
      } else if constexpr (MOE) {
        const int slot_id = __ldg(p.sorted_ids + m_tile * S::kRows + r);
        valid = slot_id < p.m;
        out_row = slot_id;
        if (valid && p.topk_weights != nullptr) w = __ldg(p.topk_weights + slot_id);
      } else {
        out_row = m_tile * S::kRows + r;
        valid = out_row < p.m;
      }
      if (!valid) continue;
      T* dst = cbase + static_cast<int64_t>(out_row) * p.ldc + col;
      auto bias_at = [&](int ii, int c) {
        return kHoistBias ? bcol[kHoistBias ? col_ix(ii) : 0] : to_float<T>(bias[c]);
      };
      if constexpr (SWAP) {
        float v = acc[i];
        if (bias != nullptr) v += bias_at(i, col);
        *dst = from_float<T>(v * w);
      } else {
        float v0 = acc[i], v1 = acc[i + 1];
        if (bias != nullptr) {
          v0 += bias_at(i, col);
          v1 += bias_at(i + 1, col + 1);
        }
        T pair[2] = {from_float<T>(v0 * w), from_float<T>(v1 * w)};
        *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<uint32_t*>(pair);
      }
    }
#pragma unroll
    for (int i = 0; i < S::kAcc; i++) acc[i] = 0.f;
  };

  if constexpr (BULK) {
    // ---- producer warp + bulk copies (sm_90) ----
    // Warp `nwarps` streams every tile of the CTA's run into a ring of STAGES slots with bulk
    // copies (one per weight strip, scale row and activation row, spread over its lanes); the
    // math warps wait on a slot's "full" barrier (its bytes have landed) and arrive on its
    // "empty" barrier when done, so no CTA-wide barrier sits in the main loop and the weight
    // stream runs ahead of the math by up to STAGES tiles. (Producer/consumer rings with
    // mbarriers and the bulk copy engine: the Hopper tuning guide and PTX ISA; our code.)
    __shared__ __align__(8) uint64_t full_bar[STAGES];
    __shared__ __align__(8) uint64_t empty_bar[STAGES];
    // Activations of 16-row m tiles: 16-byte cp.async copies by the producer's 32 lanes (each
    // lane then arrives on the slot's full barrier when its copies have landed: 1 + 32 arrivals
    // per fill), instead of one bulk copy per 256-byte row: 16 bulk copies per stage against 4
    // for the weights (NOTES.md, session 6). 8-row tiles keep the row copies (the cp.async loop
    // pushes the f16 4-bit w8 tiles past their 96-register cap). -DJM_A_BULK_ROWS: row copies
    // everywhere, for A/B runs.
#ifdef JM_A_BULK_ROWS
    constexpr bool kACp = false;
#else
    constexpr bool kACp = S::kRows >= 16;
#endif
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; s++) {
        mbar_init(&full_bar[s], kACp ? 33 : 1);
        mbar_init(&empty_bar[s], nmath);
      }
      mbar_init(&pub_bar, 32 * nmath);
      mbar_init(&done_bar, 1);
      mbar_fence_init();
    }
    // Activation rows a bulk copy never fills (rows past M) enter the MMA as zeros (the cp.async
    // path zero-fills them itself).
    if constexpr (!kACp) {
      for (int i = tid; i < STAGES * (S::kAStageBytes / 16); i += blockDim.x) {
        const int slot = i / (S::kAStageBytes / 16), off = i - slot * (S::kAStageBytes / 16);
        *reinterpret_cast<int4*>(smem + slot * stage_bytes + off * 16) = make_int4(0, 0, 0, 0);
      }
    }
    fence_proxy_async_smem();
    __syncthreads();
    griddep_launch_dependents();
    if constexpr (kCluster) cluster_arrive_relaxed();  // phase 0 of the cluster reduction: this CTA runs
    // The CTA's first unit, when it is split, ends before the run does and does not start in this
    // run: its partials are published mid-run (kPublish) and the producer arrives for them.
    const int u_first = begin / k_tiles;
    const bool mid_split = kEarlyPublish && (u_first + 1) * k_tiles < end && unit_ctas(sch, u_first) > 1 &&
                           unit_slot(sch, u_first) != static_cast<int>(blockIdx.x);
    const int mid_end = mid_split ? (u_first + 1) * k_tiles - 1 - begin : -1;  // its last tile in the run

    if (warp_id == nmath) {  // the producer
      constexpr uint32_t kRowBytes = S::kTileK * 2;
      const uint32_t weight_bytes = nwarps * (S::kBWarpBytes + S::kSWarpBytes + S::kZWarpBytes);
      // A row r of the m tile at cursor c: (valid, source row)
      auto a_row = [&](const Cursor& c, int r, int& src_row) {
        if constexpr (MOE) {
          const int pos = c.m_tile * S::kRows + r;
          const int slot_id = __ldg(p.sorted_ids + pos);
          src_row = p.a_by_position ? pos : slot_id / p.top_k;
          return slot_id < p.m;
        } else {
          src_row = c.m_tile * S::kRows + r;
          return src_row < p.m;
        }
      };
      auto valid_rows = [&](const Cursor& c) {
        int count = 0;
        for (int r0 = 0; r0 < S::kRows; r0 += 32) {
          int src;
          const bool v = r0 + lane < S::kRows && a_row(c, r0 + lane, src);
          count += __popc(__ballot_sync(0xFFFFFFFFu, v));
        }
        return count;
      };
      auto issue_weights = [&](const Cursor& c, int slot) {
        uint8_t* st = smem + slot * stage_bytes;
        int expert = 0;
        if constexpr (MOE) expert = expert_of(c.m_tile);
        const uint32_t* b = static_cast<const uint32_t*>(p.b) + expert * p.b_expert_stride +
                            static_cast<int64_t>(c.kt) * K_BLOCKS * S::kWordsPerK16;
        if constexpr (DIRECT == 0) {
          for (int w = lane; w < nwarps; w += 32) {
            const int strip = c.n_tile * nwarps + w;
            bulk_copy_g2s(st + S::kAStageBytes + w * S::kBWarpBytes, b + strip * strip_words, S::kBWarpBytes,
                          &full_bar[slot]);
          }
        }
        int grow0 = 0;
        if constexpr (S::kGrouped) grow0 = (c.kt * S::kTileK) / group_k;
        // Scales and zero points of the CTA's strips are adjacent in global memory: one copy per
        // group row for all strips (bulk copies have a fixed cost each; NOTES.md).
        if constexpr (S::kGrouped) {
          static_assert(S::kGroupRows == 1 || S::kSWarpBytes == S::kGroupRows * 128, "scale rows");
          const T* sb = static_cast<const T*>(p.s) + expert * p.s_expert_stride;
          if (S::kGroupRows == 1) {
            if (lane == 0)
              bulk_copy_g2s(st + S::kAStageBytes + nwarps * S::kBWarpBytes,
                            sb + static_cast<int64_t>(grow0) * p.n + c.n_tile * nwarps * 64, nwarps * 128,
                            &full_bar[slot]);
          } else {  // several group rows per tile: one copy per (strip, row), rows of a strip together
            for (int j = lane; j < nwarps * S::kGroupRows; j += 32) {
              const int w = j / S::kGroupRows, r = j - w * S::kGroupRows;
              const int strip = c.n_tile * nwarps + w;
              bulk_copy_g2s(st + S::kAStageBytes + nwarps * S::kBWarpBytes + w * S::kSWarpBytes + r * 128,
                            sb + static_cast<int64_t>(grow0 + r) * p.n + strip * 64, 128, &full_bar[slot]);
            }
          }
        }
        if constexpr (HAS_ZP) {
          const uint32_t* zb = static_cast<const uint32_t*>(p.z) + expert * p.z_expert_stride;
          if (S::kGroupRows == 1) {
            if (lane == 0)
              bulk_copy_g2s(st + S::kAStageBytes + nwarps * (S::kBWarpBytes + S::kSWarpBytes),
                            zb + static_cast<int64_t>(grow0) * (p.n * BITS / 32) + c.n_tile * nwarps * 2 * BITS,
                            nwarps * 8 * BITS, &full_bar[slot]);
          } else {
            for (int j = lane; j < nwarps * S::kGroupRows; j += 32) {
              const int w = j / S::kGroupRows, r = j - w * S::kGroupRows;
              const int strip = c.n_tile * nwarps + w;
              bulk_copy_g2s(st + S::kAStageBytes + nwarps * (S::kBWarpBytes + S::kSWarpBytes) + w * S::kZWarpBytes +
                                r * (8 * BITS),
                            zb + static_cast<int64_t>(grow0 + r) * (p.n * BITS / 32) + strip * 2 * BITS, 8 * BITS,
                            &full_bar[slot]);
            }
          }
        }
      };
      auto issue_acts = [&](const Cursor& c, int slot) {
        uint8_t* st = smem + slot * stage_bytes;
        if constexpr (kACp) {  // rows past M (or padded MoE slots) are zero-filled
          for (int ci = lane; ci < S::kRows * S::kAChunksPerRow; ci += 32) {
            const int r = ci / S::kAChunksPerRow, ch = ci % S::kAChunksPerRow;
            int src_row;
            const bool valid = a_row(c, r, src_row);
            cp_async16(st + r * S::kAPitch + ch * 16,
                       static_cast<const T*>(p.a) + static_cast<int64_t>(valid ? src_row : 0) * p.lda +
                           c.kt * S::kTileK + ch * 8,
                       valid);
          }
          cp_async_mbar_arrive(&full_bar[slot]);
          return;
        }
        for (int r = lane; r < S::kRows; r += 32) {
          int src_row;
          if (a_row(c, r, src_row))
            bulk_copy_g2s(st + r * S::kAPitch,
                          static_cast<const T*>(p.a) + static_cast<int64_t>(src_row) * p.lda + c.kt * S::kTileK,
                          kRowBytes, &full_bar[slot]);
        }
      };

      Cursor c = cursor_at(begin);
      // Dense: the weights of the first fills go out before waiting for the previous kernel
      // (they never depend on it); the activations follow once it has finished.
      const int pre = (MOE && !p.tables_ready) ? 0 : min(STAGES, n_it);
      for (int i = 0; i < pre; i++) {
        const int rows = kACp ? 0 : valid_rows(c);  // activation bytes the bulk copies bring
        if (lane == 0) mbar_arrive_expect_tx(&full_bar[i], weight_bytes + rows * kRowBytes);
        __syncwarp();
        issue_weights(c, i);
        advance(c);
      }
      griddep_wait();
      if (lane == 0) JM_TL(1, globaltimer());
      c = cursor_at(begin);
      for (int i = 0; i < pre; i++) {
        issue_acts(c, i);
        advance(c);
      }
      int slot = pre % STAGES;
      uint32_t phase = pre / STAGES;  // fills of this slot so far, mod 2
      for (int i = pre; i < n_it; i++) {
        if (i >= STAGES) mbar_wait(&empty_bar[slot], (phase & 1) ^ 1);
        const int rows = kACp ? 0 : valid_rows(c);
        if (lane == 0) mbar_arrive_expect_tx(&full_bar[slot], weight_bytes + rows * kRowBytes);
        __syncwarp();
        issue_weights(c, slot);
        issue_acts(c, slot);
        advance(c);
        if (++slot == STAGES) {
          slot = 0;
          ++phase;
        }
      }
      if constexpr (kACp) cp_async_wait_all();  // leave no cp.async of this thread in flight at exit
      if (kEarlyPublish && mid_split) {  // arrive for the mid-run unit once the math warps have stored its partials
        mbar_wait(&pub_bar, 0);
        if (lane == 0) {
          const int slot_cta = unit_slot(sch, u_first);
#ifdef JM_TEST_LATE_ARRIVAL  // tests: arrive 30 us late, so that the unit's first CTA has arrived
          for (const uint64_t t0 = globaltimer(); globaltimer() - t0 < 30000;) {  // and this one finishes it
          }
#endif
          __threadfence();  // the partials (acquired through pub_bar) before the arrival
          const bool last = atomicAdd(p.counters + slot_cta, 1) == unit_ctas(sch, u_first) - 1;
          if (last) p.counters[slot_cta] = 0;  // every other CTA of the unit has arrived
          s_defer = last;
          mbar_arrive(&done_bar);
        }
      }
      return;
    }

    // the math warps
    constexpr int kWords = K_BLOCKS * (BITS == 4 ? 1 : 2);  // DIRECT: 16-byte weight words per lane per tile
    uint4 wbuf[DIRECT > 0 ? DIRECT : 1][kWords];             // DIRECT: the tiles in flight
    Cursor lcur = cursor_at(begin);                           // DIRECT: the next tile whose weights to load
    auto load_w = [&](uint4 (&dst)[kWords], const Cursor& c) {
      const int strip = c.n_tile * nwarps + warp;
      int expert = 0;  // MoE: the routing tables are complete here (waited for at the start, or ready)
      if constexpr (MOE) expert = expert_of(c.m_tile);
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(p.b) + expert * p.b_expert_stride +
                                                        strip * strip_words +
                                                        static_cast<int64_t>(c.kt) * K_BLOCKS * S::kWordsPerK16) +
                         lane;
#pragma unroll
      for (int j = 0; j < kWords; j++) dst[j] = ldg_stream(src + 32 * j);
    };
    if constexpr (DIRECT > 0) {  // the weights never depend on the previous kernel: out before the wait
                                 // (MoE: their experts do; the tables were waited for at the start
                                 // unless the launch said they were ready)
#pragma unroll
      for (int d = 0; d < DIRECT; d++)
        if (d < n_it) {
          load_w(wbuf[d], lcur);
          advance(lcur);
        }
    }
    griddep_wait();
    Cursor ccur = cursor_at(begin);
    int slot = 0;
    uint32_t phase = 0;
    // tile i of the run: wait for its slot, compute, free the slot, `after_release`, then the
    // unit's fixup and output when the unit ends here
#ifdef JM_TIMELINE
    uint64_t tl_fix = 0;
#endif
    auto step = [&](int i, const uint4* wreg, auto&& after_release) {
      mbar_wait(&full_bar[slot], phase);
      if (tid == 0 && i == 0) JM_TL(2, globaltimer());
#ifndef JM_STREAM_ONLY  // diagnostic switch: stream the weights, compute nothing (wrong results)
      compute_tile(slot, wreg);
#else
      if constexpr (DIRECT > 0) {  // keep the direct loads alive
        uint32_t x = 0;
#pragma unroll
        for (int j = 0; j < kWords; j++) x ^= wreg[j].x ^ wreg[j].w;
        acc[0] += static_cast<float>(x & 1u);
      }
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty_bar[slot]);
      after_release();
#ifdef JM_TIMELINE
      const uint64_t tl0 = globaltimer();
      if (tid == 0 && i == n_it - 1) JM_TL(3, tl0);
#endif
      if (ccur.kt == k_tiles - 1 || i == n_it - 1) finish_unit(ccur, kEarlyPublish && i == mid_end ? kPublish : kFinish);
#ifdef JM_TIMELINE
      tl_fix += globaltimer() - tl0;
#endif
      advance(ccur);
      if (++slot == STAGES) {
        slot = 0;
        phase ^= 1;
      }
    };
    if constexpr (DIRECT > 0) {
      for (int i0 = 0; i0 < n_it; i0 += DIRECT) {
#pragma unroll
        for (int d = 0; d < DIRECT; d++) {
          const int i = i0 + d;
          if (i < n_it)
            step(i, wbuf[d], [&] {
              if (i + DIRECT < n_it) {  // refill this buffer DIRECT tiles ahead
                load_w(wbuf[d], lcur);
                advance(lcur);
              }
            });
        }
      }
    } else {
      for (int i = 0; i < n_it; i++) step(i, nullptr, [] {});
    }
    if (kEarlyPublish && mid_split) {  // the producer's arrival for the mid-run unit was its last: finish it here
      mbar_wait(&done_bar, 0);
      if (s_defer) finish_unit(cursor_at(begin), kDeferred);
    }
#ifdef JM_TIMELINE
    if (tid == 0) {
      JM_TL(4, globaltimer());
      JM_TL(7, tl_fix);
    }
#endif
    return;
  } else {
#if JM_HAS_BULK
    // Programmatic dependent launch on sm_90: nothing of the previous kernel is read before it
    // has finished.
    griddep_wait();
    griddep_launch_dependents();
#endif
    // ---- the pipeline: STAGES-1 tiles in flight while one is computed ----
    Cursor fcur = cursor_at(begin);  // next tile to fetch
    Cursor ccur = fcur;               // next tile to compute
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
      if (s < n_it) {
        fetch_tile(fcur, s);
        advance(fcur);
      }
      cp_async_commit();
    }
    int fslot = STAGES - 1, cslot = 0;
    for (int i = 0; i < n_it; i++) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile i has landed for every thread; every warp is done with tile i-1
      if (i + STAGES - 1 < n_it) {  // refill the slot of tile i-1
        fetch_tile(fcur, fslot);
        advance(fcur);
      }
      cp_async_commit();
      fslot = fslot == STAGES - 1 ? 0 : fslot + 1;
      compute_tile(cslot, nullptr);
      cslot = cslot == STAGES - 1 ? 0 : cslot + 1;
      if (ccur.kt == k_tiles - 1 || i == n_it - 1) finish_unit(ccur, kFinish);
      advance(ccur);
    }
  }
}

}  // namespace jm

// One extern "C" kernel per template instantiation, so the launcher finds it by a plain name.
#define JM_GEMM_KERNEL(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, M_BLOCKS, SWAP, K_BLOCKS, STAGES, MOE, BULK,      \
                       KSPLIT, MAX_THREADS, MIN_BLOCKS, DIRECT, CLUSTER)                                         \
  extern "C" __global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS) NAME(const JmGemmParams p) {             \
    jm::gemm_body<T, BITS, HAS_ZP, GROUP_BLOCKS, M_BLOCKS, SWAP, K_BLOCKS, STAGES, MOE, BULK, KSPLIT, DIRECT,    \
                  CLUSTER>(p);                                                                                   \
  }

namespace jm {

// Dequantize packed weights into W^T [N, K] (row n = output feature, contiguous along K), the
// operand of a cuBLAS GEMM for large M, where a tensor-core library beats an mma.sync kernel
// that re-dequantizes the weights for every 64 rows. One thread per (strip, 16 k, lane), i.e.
// per 16-byte vector of the packed layout; p.c receives W^T, p.a and the MoE fields are unused.
template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS>
JM_DEVICE void dequant_body(const JmGemmParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = static_cast<int>(idx & 31);
  const int64_t chunk = idx >> 5;  // strip * (K/16) + kt
  const int k16 = p.k / 16;
  if (chunk >= static_cast<int64_t>(p.n / 64) * k16) return;
  const int strip = static_cast<int>(chunk / k16), kt = static_cast<int>(chunk % k16);
  const int g = lane >> 2, t = lane & 3;
  constexpr bool kGrouped = GROUP_BLOCKS > 0;
  const int grp = kGrouped ? kt / GROUP_BLOCKS : 0;

  uint32_t qw[BITS == 4 ? 4 : 8];
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(p.b) + chunk * (32 * BITS));
  {
    const uint4 v = __ldg(src + lane);
    qw[0] = v.x; qw[1] = v.y; qw[2] = v.z; qw[3] = v.w;
    if constexpr (BITS == 8) {
      const uint4 w = __ldg(src + 32 + lane);
      qw[4] = w.x; qw[5] = w.y; qw[6] = w.z; qw[7] = w.w;
    }
  }
  ZeroConst zc[8];
#pragma unroll
  for (int e = 0; e < 8; e++) {
    uint32_t z = BITS == 4 ? 8u : 128u;
    if constexpr (HAS_ZP) {
      const uint32_t* zp = static_cast<const uint32_t*>(p.z) + static_cast<int64_t>(grp) * (p.n * BITS / 32);
      if constexpr (BITS == 4) z = (__ldg(zp + strip * 8 + g) >> (4 * e)) & 0xFu;
      else z = (__ldg(zp + strip * 16 + 2 * g + (e >> 2)) >> (8 * (e & 3))) & 0xFFu;
    }
    zc[e] = make_zero_const<T, BITS>(z);
  }
  T* out = static_cast<T*>(p.c);
  const T* sp = static_cast<const T*>(p.s);
#pragma unroll
  for (int j = 0; j < 4; j++) {
    Frag f[2];
    if constexpr (BITS == 4) {
      dequant4<T>(qw[j], zc[2 * j], zc[2 * j + 1], f[0], f[1]);
    } else {
      f[0] = dequant8<T>(qw[2 * j], zc[2 * j]);
      f[1] = dequant8<T>(qw[2 * j + 1], zc[2 * j + 1]);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int e = 2 * j + h;
      const int n = strip * 64 + 8 * e + g;
      // grouped scales are permuted inside each 64 columns (lane g's 8 scales are contiguous)
      const T s = kGrouped ? sp[static_cast<int64_t>(grp) * p.n + strip * 64 + 8 * g + e] : sp[n];
      uint32_t s2;
      {
        T pair[2] = {s, s};
        s2 = *reinterpret_cast<uint32_t*>(pair);
      }
      T* row = out + static_cast<int64_t>(n) * p.k + kt * 16 + 2 * t;
      *reinterpret_cast<uint32_t*>(row) = mul2<T>(f[h].b0, s2);
      *reinterpret_cast<uint32_t*>(row + 8) = mul2<T>(f[h].b1, s2);
    }
  }
}

}  // namespace jm

#define JM_DEQUANT_KERNEL(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS)                       \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmGemmParams p) {    \
    jm::dequant_body<T, BITS, HAS_ZP, GROUP_BLOCKS>(p);                             \
  }

namespace jm {

// Act-order: C[r, j] = A[r, perm[j]] for r < p.m, j < p.k (row strides p.lda, p.ldc), the
// activation columns in the order of the sorted weight rows. One thread per 8 output columns of
// one row (one 16-byte store; M >= gemm.GATHER_SMEM_MIN_M takes gather_smem_body below). Under
// programmatic dependent launch (sm_90) it lets the GEMM after it launch at once, so that the
// GEMM's first weight copies overlap this kernel, reads perm while the kernel before it still
// runs, and waits for that kernel before reading A.
// (Triggering after the wait instead, as jm_moe_gather does, measured slower: H200 session 41, act-order
// layer 4096^2 M = 1 7.9 -> 10.0 us, 14336x4096 M = 1 16.2 -> 19.1; benchmarks/NOTES.md.)

template <typename T>
JM_DEVICE void gather_body(const JmGemmParams p) {
  griddep_launch_dependents();
  const int chunks = p.k / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.m) * chunks) return;
  const int row = static_cast<int>(idx / chunks), j0 = static_cast<int>(idx % chunks) * 8;
  // perm is a layer constant (no kernel writes it): read it while the previous kernel finishes
  const int4 c0 = __ldg(reinterpret_cast<const int4*>(p.perm + j0));
  const int4 c1 = __ldg(reinterpret_cast<const int4*>(p.perm + j0 + 4));
  griddep_wait();
  const unsigned short* src = static_cast<const unsigned short*>(p.a) + static_cast<int64_t>(row) * p.lda;
  const int cols[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; i++)
    packed[i] = static_cast<uint32_t>(__ldg(src + cols[2 * i])) | (static_cast<uint32_t>(__ldg(src + cols[2 * i + 1])) << 16);
  *reinterpret_cast<uint4*>(static_cast<unsigned short*>(p.c) + static_cast<int64_t>(row) * p.ldc + j0) =
      make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// The same gather staged through shared memory (M >= gemm.GATHER_SMEM_MIN_M): CTA b copies row
// b / p.n of A whole into shared memory with coalesced 16-byte loads, then writes part b % p.n of
// that row's output chunks, each thread at most kGatherSmemChunks of them, reading the permuted
// columns from shared memory. The scattered 2-byte loads of gather_body cost one L1 transaction
// each and bound it at M = 8-16 (H200: 2.5-4.8 us at K = 14336-28672, M = 16); here each CTA reads
// its row at full width instead (1.8-3.2 us, NOTES.md session 15). Needs 2 K bytes of dynamic
// shared memory; blockDim.x = kGatherSmemThreads.
constexpr int kGatherSmemThreads = 512;
constexpr int kGatherSmemChunks = 4;

template <typename T>
JM_DEVICE void gather_smem_body(const JmGemmParams p) {
  griddep_launch_dependents();
  extern __shared__ __align__(16) uint8_t smem[];
  const int parts = p.n, chunks = p.k / 8;
  const int row = static_cast<int>(blockIdx.x) / parts, part = static_cast<int>(blockIdx.x) - row * parts;
  const int per = ceil_div(chunks, parts);
  const int c0 = part * per, c1 = min(chunks, c0 + per);
  // perm of this thread's output chunks (a layer constant): read while the kernel before still runs
  int4 pa[kGatherSmemChunks], pb[kGatherSmemChunks];
#pragma unroll
  for (int i = 0; i < kGatherSmemChunks; i++) {
    const int ch = c0 + static_cast<int>(threadIdx.x) + i * kGatherSmemThreads;
    if (ch < c1) {
      pa[i] = __ldg(reinterpret_cast<const int4*>(p.perm) + 2 * ch);
      pb[i] = __ldg(reinterpret_cast<const int4*>(p.perm) + 2 * ch + 1);
    }
  }
  griddep_wait();
  const int4* src = reinterpret_cast<const int4*>(static_cast<const T*>(p.a) + static_cast<int64_t>(row) * p.lda);
  int4* srow = reinterpret_cast<int4*>(smem);
#pragma unroll 4
  for (int i = threadIdx.x; i < chunks; i += kGatherSmemThreads) srow[i] = __ldg(src + i);
  __syncthreads();
  const unsigned short* sh = reinterpret_cast<const unsigned short*>(smem);
  unsigned short* dst = static_cast<unsigned short*>(p.c) + static_cast<int64_t>(row) * p.ldc;
#pragma unroll
  for (int i = 0; i < kGatherSmemChunks; i++) {
    const int ch = c0 + static_cast<int>(threadIdx.x) + i * kGatherSmemThreads;
    if (ch < c1) {
      const int cols[8] = {pa[i].x, pa[i].y, pa[i].z, pa[i].w, pb[i].x, pb[i].y, pb[i].z, pb[i].w};
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; j++)
        w[j] = static_cast<uint32_t>(sh[cols[2 * j]]) | (static_cast<uint32_t>(sh[cols[2 * j + 1]]) << 16);
      *reinterpret_cast<uint4*>(dst + 8 * ch) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

}  // namespace jm

#define JM_GATHER_KERNEL(NAME, T)                                                 \
  extern "C" __global__ void __launch_bounds__(256) NAME(const JmGemmParams p) { \
    jm::gather_body<T>(p);                                                        \
  }                                                                               \
  extern "C" __global__ void __launch_bounds__(jm::kGatherSmemThreads)            \
      NAME##_smem(const JmGemmParams p) {                                         \
    jm::gather_smem_body<T>(p);                                                   \
  }
