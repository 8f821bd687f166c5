// jitmarlin — Hopper (sm_90a) GEMM for large M: warpgroup MMA with the weights in registers.
//
// EXPERIMENTAL: compiled and checked with ptxas, not yet run on a GPU (off by default).
//
// Transposed product, as the small-M kernel's SWAP mode: D^T[features, tokens] = W^T A^T. The
// wgmma A operand (64 rows x 16 k, in registers) is the dequantized weights: each warp of a
// warpgroup holds 16 output features, and a lane's packed word j of our layout (n8-blocks 2j and
// 2j+1 of its 64-column strip) dequantizes straight into the m16k16 register fragment of warp j
// (PTX ISA, "Register Fragments" of wgmma .m64nNk16, which matches the mma.m16n8k16 A fragment).
// The B operand (tokens x 16 k, K-major) is the activation tile in shared memory in the
// no-swizzle canonical layout: 8 tokens x 8 k "core matrices" of 128 contiguous bytes, core
// matrices along k 128 B apart (LBO), along tokens 1024 B apart (SBO, one 64-k stage row block).
// So weights never pass through shared memory and are never expanded to fp16 in memory, unlike
// a dequantize-then-cuBLAS path.
//
// CTA: two warpgroups = two 64-column strips (128 features) x NT tokens, all of K, no split.
// MOE: an m tile is one expert's block of NT = block-size rows of the sorted slot list (as the
// mma.sync MoE kernel: A rows gathered through the slot ids, output row = slot, routing weight).
// Activations: a STAGES-deep cp.async ring of 64-k stages. Weights and scales: plain loads into
// registers one stage ahead. Per stage each warpgroup dequantizes its 4 k16 fragments, then
// issues 4 wgmma and waits for them before the ring slot is reused; with OVERLAP it dequantizes
// the next stage's fragments while they run.
#pragma once

#include "jm_gemm.cuh"

namespace jm {

// wgmma shared-memory matrix descriptor, no swizzle (PTX ISA "Matrix Descriptor Format"):
// start address, leading- and stride-dimension byte offsets, each encoded as (x & 0x3FFFF) >> 4.
JM_DEVICE uint64_t wgmma_desc(uint32_t smem_byte_addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32);
}

JM_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
JM_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
JM_DEVICE void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keep a register live (and unmoved) across the asynchronous MMA: the compiler must not reuse it
// or read it early while a wgmma still reads or writes it.
JM_DEVICE void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
JM_DEVICE void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (shared memory, descriptor); fp32 accumulate.
template <int N>
struct WgmmaRS;

// TY: "f16" or "bf16" (a string literal, pasted into the instruction)
#define JM_WGMMA_RS_N64(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))

// TY: "f16" or "bf16" (a string literal, pasted into the instruction)
#define JM_WGMMA_RS_N128(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                                   \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))

template <>
struct WgmmaRS<64> {
  template <typename T>
  static JM_DEVICE void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
    if constexpr (DType<T>::kBF16) JM_WGMMA_RS_N64("bf16");
    else JM_WGMMA_RS_N64("f16");
  }
};

template <>
struct WgmmaRS<128> {
  template <typename T>
  static JM_DEVICE void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
    if constexpr (DType<T>::kBF16) JM_WGMMA_RS_N128("bf16");
    else JM_WGMMA_RS_N128("f16");
  }
};

template <typename T, int BITS, bool HAS_ZP, int GROUP_BLOCKS, int NT, int STAGES, bool OVERLAP, bool MOE>
JM_DEVICE void wgmma_body(const JmGemmParams p) {
  static_assert(NT == 64 || NT == 128, "token tile");
  static_assert(STAGES >= 2, "at least two stages");
  constexpr int kKT = 64;                           // k per stage: 4 x k16
  constexpr int kStageBytes = NT * kKT * 2;         // activation bytes per stage
  constexpr int kWordsPerK16 = 32 * BITS;           // packed words of one strip per 16 k
  constexpr bool kGrouped = GROUP_BLOCKS > 0;
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
  const int g = lane >> 2, t = lane & 3;
  // p.grid: the m tiles the launch covers (MoE: an upper bound; the padded row count decides)
  const int f_tiles = p.n / 128, m_tiles = p.grid;
  // feature-tile-major order: CTAs running together share weights (L2) and read all token tiles
  const int f_tile = blockIdx.x / m_tiles, m_tile = blockIdx.x - f_tile * m_tiles;
  if (f_tile >= f_tiles) return;
  const int strip = 2 * f_tile + wg;
  const int tok0 = m_tile * NT;
  const int k_tiles = p.k / kKT;
  const int e0 = 2 * warp;  // this warp's n8-blocks of the strip: e0, e0 + 1 (features 16 warp .. +15)

  griddep_wait();  // MoE: the routing tables come from the previous kernels
  griddep_launch_dependents();
  int expert = 0;  // MoE: an m tile of NT rows (= the block size) belongs to one expert
  if constexpr (MOE) {
    if (tok0 >= *p.num_padded) return;
    expert = __ldg(p.expert_ids + m_tile);
  }

  // ---- activations: 16-byte chunks (token r, 8 k j) at (r/8)*1024 + j*128 + (r%8)*16 ----
  auto fetch = [&](int kt, int slot) {
    uint8_t* st = smem + slot * kStageBytes;
    constexpr int kChunks = NT * (kKT / 8);
#pragma unroll
    for (int c = tid; c < kChunks; c += 256) {
      const int r = c >> 3, j = c & 7;
      int row = tok0 + r;
      bool valid;
      if constexpr (MOE) {  // A row of a (token, k) slot: its token, or its position when pre-gathered
        const int slot_id = __ldg(p.sorted_ids + row);
        valid = slot_id < p.m;
        row = p.a_by_position ? row : slot_id / p.top_k;
      } else {
        valid = row < p.m;
      }
      const T* src = static_cast<const T*>(p.a) + static_cast<int64_t>(valid ? row : 0) * p.lda + kt * kKT + j * 8;
      cp_async16(st + (r >> 3) * 1024 + j * 128 + (r & 7) * 16, src, valid);
    }
  };

  // ---- weights of one stage (4 k16) for this warp: BITS/2 words per k16 per lane ----
  const uint32_t* bstrip = static_cast<const uint32_t*>(p.b) + expert * p.b_expert_stride +
                           static_cast<int64_t>(strip) * (p.k / 16) * kWordsPerK16;
  auto load_w = [&](int kt, uint32_t (&w)[4][BITS / 2]) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
      const uint32_t* base = bstrip + static_cast<int64_t>(kt * 4 + s) * kWordsPerK16;
      if constexpr (BITS == 4) {
        w[s][0] = __ldg(base + lane * 4 + warp);  // word j = warp: n8-blocks 2 warp, 2 warp + 1
      } else {
        // 8-bit: words e0, e0 + 1 of a lane's 8 (the first 4 at lane*4, the last 4 at 128 + lane*4)
        const uint32_t* q = base + (e0 < 4 ? lane * 4 + e0 : 128 + lane * 4 + e0 - 4);
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(q));
        w[s][0] = v.x;
        w[s][1] = v.y;
      }
    }
  };

  // scales / zero points of k16 block kb (global index) for this lane's two features
  const T* sbase = static_cast<const T*>(p.s) + expert * p.s_expert_stride;
  auto scales_of = [&](int kb) -> uint32_t {
    if constexpr (kGrouped) {
      const int grp = kb / GROUP_BLOCKS;  // permuted: lane g's 8 scales of a strip are contiguous
      return __ldg(reinterpret_cast<const uint32_t*>(sbase + static_cast<int64_t>(grp) * p.n + strip * 64 + 8 * g + e0));
    } else {
      const T lo = sbase[strip * 64 + 8 * e0 + g], hi = sbase[strip * 64 + 8 * (e0 + 1) + g];
      T pair[2] = {lo, hi};
      return *reinterpret_cast<uint32_t*>(pair);
    }
  };
  auto zeros_of = [&](int kb, uint32_t& z0, uint32_t& z1) {
    if constexpr (HAS_ZP) {
      const int grp = kGrouped ? kb / GROUP_BLOCKS : 0;
      const uint32_t* zb = static_cast<const uint32_t*>(p.z) + expert * p.z_expert_stride +
                           static_cast<int64_t>(grp) * (p.n * BITS / 32);
      if constexpr (BITS == 4) {
        const uint32_t w = __ldg(zb + strip * 8 + g);
        z0 = (w >> (4 * e0)) & 0xFu;
        z1 = (w >> (4 * (e0 + 1))) & 0xFu;
      } else {
        const uint32_t w = __ldg(zb + strip * 16 + 2 * g + (e0 >> 2));
        z0 = (w >> (8 * (e0 & 3))) & 0xFFu;
        z1 = (w >> (8 * ((e0 + 1) & 3))) & 0xFFu;
      }
    } else {
      z0 = z1 = BITS == 4 ? 8u : 128u;
    }
  };

  float d[NT / 2];
#pragma unroll
  for (int i = 0; i < NT / 2; i++) d[i] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < k_tiles) fetch(s, s);
    cp_async_commit();
  }
  // dequantize the 4 k16 fragments of stage kt from its packed words
  auto dequant_stage = [&](int kt, const uint32_t (&w)[4][BITS / 2], uint32_t (&a)[4][4]) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
      const int kb = kt * 4 + s;
      uint32_t z0, z1;
      zeros_of(kb, z0, z1);
      const ZeroConst zc0 = make_zero_const<T, BITS>(z0), zc1 = make_zero_const<T, BITS>(z1);
      Frag f0, f1;
      if constexpr (BITS == 4) {
        dequant4<T>(w[s][0], zc0, zc1, f0, f1);
      } else {
        f0 = dequant8<T>(w[s][0], zc0);
        f1 = dequant8<T>(w[s][1], zc1);
      }
      const uint32_t sc = scales_of(kb);
      const uint32_t s0 = bcast_half(sc, 0), s1 = bcast_half(sc, 1);
      a[s][0] = mul2<T>(f0.b0, s0);  // rows g (feature 16 warp + g), k 2t, 2t+1
      a[s][1] = mul2<T>(f1.b0, s1);  // rows g + 8
      a[s][2] = mul2<T>(f0.b1, s0);  // rows g, k 2t + 8, 2t + 9
      a[s][3] = mul2<T>(f1.b1, s1);  // rows g + 8, k 2t + 8, 2t + 9
    }
  };

  // OVERLAP: the next stage's fragments are dequantized while this stage's wgmma run (weights
  // loaded two stages ahead); else dequantize, multiply, wait, in turn.
  uint32_t wnext[4][BITS / 2], wlater[4][BITS / 2];
  uint32_t acur[4][4], anext[4][4];
  if constexpr (OVERLAP) {
    uint32_t w0[4][BITS / 2];
    load_w(0, w0);
    if (k_tiles > 1) load_w(1, wnext);
    dequant_stage(0, w0, acur);
  } else {
    load_w(0, wnext);
  }

  const uint32_t smem_base = smem_addr(smem);
  int slot = 0;
  for (int kt = 0; kt < k_tiles; kt++) {
    cp_async_wait<STAGES - 2>();
    fence_proxy_async_smem();  // the cp.async bytes are read by wgmma (async proxy)
    __syncthreads();           // stage kt is in for every thread; every warpgroup is done with kt - 1
    {
      const int nk = kt + STAGES - 1;
      if (nk < k_tiles) fetch(nk, (slot + STAGES - 1) % STAGES);
      cp_async_commit();
    }
    if constexpr (OVERLAP) {
      if (kt + 2 < k_tiles) load_w(kt + 2, wlater);
    } else {
      dequant_stage(kt, wnext, acur);
      if (kt + 1 < k_tiles) load_w(kt + 1, wnext);
    }

    wgmma_fence();
    const uint32_t st = smem_base + slot * kStageBytes;
#pragma unroll
    for (int s = 0; s < 4; s++) {
      // k16 step s: core matrices 2s, 2s + 1 of each 8-token row block
      WgmmaRS<NT>::template run<T>(d, acur[s], wgmma_desc(st + s * 256, 128, 1024), 1);
    }
    wgmma_commit();
    if constexpr (OVERLAP) {
      if (kt + 1 < k_tiles) dequant_stage(kt + 1, wnext, anext);  // other registers than acur
    }
    wgmma_wait0();
    // acur stays allocated (nothing else may live in its registers) until the wgmma reading it
    // have completed; the accumulators are not read before either
#pragma unroll
    for (int s = 0; s < 4; s++) {
#pragma unroll
      for (int i = 0; i < 4; i++) reg_fence(acur[s][i]);
    }
#pragma unroll
    for (int i = 0; i < NT / 2; i++) reg_fence(d[i]);
    if constexpr (OVERLAP) {
#pragma unroll
      for (int s = 0; s < 4; s++) {
#pragma unroll
        for (int i = 0; i < 4; i++) acur[s][i] = anext[s][i];
#pragma unroll
        for (int i = 0; i < BITS / 2; i++) wnext[s][i] = wlater[s][i];
      }
    }
    slot = slot + 1 == STAGES ? 0 : slot + 1;
  }
  cp_async_wait<0>();

  // ---- epilogue: d[4i + c] = (feature 16 warp + g + 8 (c >> 1), token 8i + 2t + (c & 1)) ----
  T* cbase = static_cast<T*>(p.c);
  const T* bias = static_cast<const T*>(p.bias);
  const int f_lo = strip * 64 + 16 * warp + g, f_hi = f_lo + 8;
  const float b_lo = bias != nullptr ? to_float<T>(bias[f_lo]) : 0.f;
  const float b_hi = bias != nullptr ? to_float<T>(bias[f_hi]) : 0.f;
#pragma unroll
  for (int i = 0; i < NT / 8; i++) {
#pragma unroll
    for (int c = 0; c < 2; c++) {
      int tok = tok0 + 8 * i + 2 * t + c;
      float w = 1.f;
      if constexpr (MOE) {  // output row = the slot; times its routing weight when given
        tok = __ldg(p.sorted_ids + tok);
        if (tok < p.m && p.topk_weights != nullptr) w = __ldg(p.topk_weights + tok);
      }
      if (tok >= p.m) continue;
      T* row = cbase + static_cast<int64_t>(tok) * p.ldc;
      row[f_lo] = from_float<T>((d[4 * i + c] + b_lo) * w);
      row[f_hi] = from_float<T>((d[4 * i + 2 + c] + b_hi) * w);
    }
  }
}

}  // namespace jm

#define JM_WGMMA_KERNEL(NAME, T, BITS, HAS_ZP, GROUP_BLOCKS, NT, STAGES, OVERLAP, MOE) \
  extern "C" __global__ void __launch_bounds__(256, 1) NAME(const JmGemmParams p) {       \
    jm::wgmma_body<T, BITS, HAS_ZP, GROUP_BLOCKS, NT, STAGES, OVERLAP, MOE>(p);           \
  }
