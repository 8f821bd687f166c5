// jitmarlin — common definitions shared by every kernel source.
// Kernel sources include only CUDA headers (never torch), so each instantiation compiles in seconds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define JM_DEVICE __device__ __forceinline__
#define JM_HD __host__ __device__ __forceinline__

namespace jm {

// 16-bit element type of activations, scales and outputs.
template <typename T> struct DType;
template <> struct DType<half> {
  static constexpr bool kBF16 = false;
};
template <> struct DType<__nv_bfloat16> {
  static constexpr bool kBF16 = true;
};

JM_HD constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// SiLU(g) * u rounded to the activation dtype between the two, as F.silu(gate) * up does (the MoE
// SiLU-mul kernels of jm_moe_util.cuh and the gate/up GEMM's SiLU epilogue of jm_wgmma.cuh: one
// formula, so the two routes give the same bits). The quotient by the approximate reciprocal
// (__fdividef: MUFU.RCP and one multiply, within 2 ulp of fp32, far below the 16-bit rounding after it;
// 0 for a denominator past 2^126, i.e. SiLU(g < -87) = -0, whose true value rounds to -0 anyway): the
// IEEE quotient's range check branches to a slow path, and in the GEMM epilogue each value's branch
// region kept ptxas from overlapping the values' dependent chains (SASS: FCHK, BSSY / BSYNC per value).
// H200 session 31, gate/up GEMM alone, Mixtral 256 tokens: 336-356 us without the SiLU epilogue, 357-372
// with it (IEEE quotient), 335 with the epilogue's SiLU arithmetic left out (benchmarks/NOTES.md).
template <typename T>
JM_DEVICE T silu_times(const T g, const T u) {
  const float gf = static_cast<float>(g);
  const T s = static_cast<T>(__fdividef(gf, 1.f + __expf(-gf)));
  return static_cast<T>(static_cast<float>(s) * static_cast<float>(u));
}

}  // namespace jm
