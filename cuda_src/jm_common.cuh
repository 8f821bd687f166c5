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

}  // namespace jm
