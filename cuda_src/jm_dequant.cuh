// jitmarlin — integer weights to fp16/bf16 MMA fragments, by bit tricks.
//
// The trick (Kim et al., "Who says elephants can't run", and the Marlin paper, Frantar et al.):
// OR a small unsigned integer q into the low mantissa bits of a float whose exponent makes one
// mantissa step worth exactly 1. The result is exactly (base + q); one packed fma then removes the
// base and the zero point, leaving (q - z) exactly, two values per 32-bit register.
//
//   fp16 0x6400 = 1024 (10 mantissa bits, step 1)   -> 4-bit and 8-bit
//   bf16 0x4300 = 128  (7 mantissa bits, step 1)    -> 4-bit only (8 bits do not fit)
//   fp32 0x4B000000 = 2^23 (step 1)                 -> 8-bit for bf16, then truncated to bf16
//
// Weight word layouts (see jitmarlin/quant/layout.py, which packs them):
//   4-bit word j of lane (g, t), eight nibbles p:
//     p = h + 2*(kl >> 3) + 4*(kl & 1), k = 2t + (kl&1) + 8*(kl>>3), column = 16j + 8h + g
//     so nibbles (0,4) are the b0 pair of n8-block 2j, (2,6) its b1 pair, (1,5) and (3,7) the
//     b0/b1 pairs of n8-block 2j+1: the low nibble of each byte always feeds block 2j, the high
//     nibble block 2j+1 (which lets dequant4_raw leave the 1/16 of the high nibble to the
//     epilogue, per column).
//   8-bit word e of lane (g, t): bytes (k 2t, k 2t+8, k 2t+1, k 2t+9) of column 8e + g.
//
// A "frag" below is the two registers {b0, b1} of one n8-block's B operand (PTX mma.m16n8k16):
// b0 = (k 2t, k 2t+1), b1 = (k 2t+8, k 2t+9), both at column g of the block.
#pragma once

#include "jm_ptx.cuh"

namespace jm {

struct Frag {
  uint32_t b0, b1;
};

// Per n8-block constants that remove the magic base and the zero point: neg_lo is added to
// values built as (base + q); neg_hi serves the fp16 4-bit path whose high nibble is built as
// (1024 + 16 q) and scaled by 1/16 in the same fma.
struct ZeroConst {
  uint32_t neg_lo, neg_hi;
};

template <typename T, int BITS>
JM_DEVICE ZeroConst make_zero_const(uint32_t z) {
  ZeroConst c;
  if constexpr (BITS == 4) {
    if constexpr (DType<T>::kBF16) {
      c.neg_lo = (0xC300u | z) * 0x10001u;  // bf16 -(128 + z)
      c.neg_hi = c.neg_lo;
    } else {
      c.neg_lo = (0xE400u | z) * 0x10001u;         // fp16 -(1024 + z)
      c.neg_hi = (0xD400u | (z << 4)) * 0x10001u;  // fp16 -(64 + z): step at 64 is 1/16
    }
  } else {
    if constexpr (DType<T>::kBF16) {
      c.neg_lo = 0xCB000000u | z;  // fp32 -(2^23 + z)
      c.neg_hi = c.neg_lo;
    } else {
      c.neg_lo = (0xE400u | z) * 0x10001u;  // fp16 -(1024 + z), z < 256 fits the mantissa
      c.neg_hi = c.neg_lo;
    }
  }
  return c;
}

// 4-bit: one word -> the frags of n8-blocks 2j (f0) and 2j+1 (f1).
template <typename T>
JM_DEVICE void dequant4(uint32_t w, const ZeroConst& z0, const ZeroConst& z1, Frag& f0, Frag& f1) {
  constexpr uint32_t kOne = DType<T>::kBF16 ? 0x3F803F80u : 0x3C003C00u;
  if constexpr (DType<T>::kBF16) {
    // The high-nibble trick does not fit bf16 (bit 7 is an exponent bit), so shift instead.
    constexpr uint32_t kMask = 0x000F000Fu, kBase = 0x43004300u;
    f0.b0 = fma2<T>(and_or(w, kMask, kBase), kOne, z0.neg_lo);
    f1.b0 = fma2<T>(and_or(w >> 4, kMask, kBase), kOne, z1.neg_lo);
    f0.b1 = fma2<T>(and_or(w >> 8, kMask, kBase), kOne, z0.neg_lo);
    f1.b1 = fma2<T>(and_or(w >> 12, kMask, kBase), kOne, z1.neg_lo);
  } else {
    constexpr uint32_t kLo = 0x000F000Fu, kHi = 0x00F000F0u, kBase = 0x64006400u;
    constexpr uint32_t kSixteenth = 0x2C002C00u;  // fp16 1/16
    const uint32_t w8 = w >> 8;
    f0.b0 = fma2<T>(and_or(w, kLo, kBase), kOne, z0.neg_lo);
    f1.b0 = fma2<T>(and_or(w, kHi, kBase), kSixteenth, z1.neg_hi);
    f0.b1 = fma2<T>(and_or(w8, kLo, kBase), kOne, z0.neg_lo);
    f1.b1 = fma2<T>(and_or(w8, kHi, kBase), kSixteenth, z1.neg_hi);
  }
}

// "raw": fp16 frags hold (1024 + q) for block 2j and (1024 + 16 q) for block 2j+1,
// exactly; no subtraction, no scaling. The MMA then sums a * (1024 + q) in fp32, and the
// epilogue of the tile recovers sum a * (q - z) per column as acc - (1024 + z) * sum(a), or
// acc / 16 - (64 + z) * sum(a) for block 2j+1, with sum(a) from one extra MMA per 16 k.
// 5 instructions per 8 weights instead of 9.
// bf16: every nibble is shifted into the low mantissa bits and held as (128 + q), exactly (the
// fp16 high-nibble trick would set bf16's lowest exponent bit): 7 instructions instead of 11.
template <typename T>
JM_DEVICE void dequant4_raw(uint32_t w, Frag& f0, Frag& f1) {
  if constexpr (DType<T>::kBF16) {
    constexpr uint32_t kMask = 0x000F000Fu, kBase = 0x43004300u;
    f0.b0 = and_or(w, kMask, kBase);
    f1.b0 = and_or(w >> 4, kMask, kBase);
    f0.b1 = and_or(w >> 8, kMask, kBase);
    f1.b1 = and_or(w >> 12, kMask, kBase);
  } else {
    constexpr uint32_t kLo = 0x000F000Fu, kHi = 0x00F000F0u, kBase = 0x64006400u;
    const uint32_t w8 = w >> 8;
    f0.b0 = and_or(w, kLo, kBase);
    f1.b0 = and_or(w, kHi, kBase);
    f0.b1 = and_or(w8, kLo, kBase);
    f1.b1 = and_or(w8, kHi, kBase);
  }
}

// fp16 only, "raw" 8-bit: (1024 + q) per byte, exactly.
JM_DEVICE Frag dequant8_raw(uint32_t w) {
  constexpr uint32_t kBase = 0x64646464u;
  return Frag{prmt(w, kBase, 0x5250), prmt(w, kBase, 0x5351)};
}

// 8-bit: one word -> the frag of one n8-block.
template <typename T>
JM_DEVICE Frag dequant8(uint32_t w, const ZeroConst& z) {
  Frag f;
  if constexpr (DType<T>::kBF16) {
    // Bytes into fp32 (2^23 + q), subtract (2^23 + z) exactly, keep the upper 16 bits: exact,
    // because |q - z| <= 255 needs at most 8 significant bits.
    const float neg = __uint_as_float(z.neg_lo);
    const float k0 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7650)) + neg;  // k 2t
    const float k8 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7651)) + neg;  // k 2t+8
    const float k1 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7652)) + neg;  // k 2t+1
    const float k9 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7653)) + neg;  // k 2t+9
    f.b0 = __byte_perm(__float_as_uint(k0), __float_as_uint(k1), 0x7632);
    f.b1 = __byte_perm(__float_as_uint(k8), __float_as_uint(k9), 0x7632);
  } else {
    constexpr uint32_t kOne = 0x3C003C00u, kBase = 0x64646464u;
    f.b0 = fma2<T>(prmt(w, kBase, 0x5250), kOne, z.neg_lo);  // bytes 0, 2: k 2t, 2t+1
    f.b1 = fma2<T>(prmt(w, kBase, 0x5351), kOne, z.neg_lo);  // bytes 1, 3: k 2t+8, 2t+9
  }
  return f;
}

}  // namespace jm
