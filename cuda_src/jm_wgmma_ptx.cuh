// jitmarlin — the PTX of the sm_90a wgmma kernel (cuda_src/jm_wgmma.cuh): warpgroup MMA, its fences, the TMA
// tile load and the compute warps' named barrier, as jm_ptx.cuh holds the other kernels' (the kernel text itself
// has no inline asm, so tests/simt can run it with its own version of this file).
#pragma once

#include "jm_ptx.cuh"

namespace jm {

JM_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
JM_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
JM_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// A TMA descriptor (CUtensorMap, built on the host by cuTensorMapEncodeTiled: driver.tensor_map_2d),
// passed as a __grid_constant__ kernel parameter so that its address is valid for the copy engine.
struct alignas(128) JmTensorMap {
  unsigned long long opaque[16];
};

JM_DEVICE void tma_load_2d(void* smem_dst, const JmTensorMap* map, int k0, int row0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k0), "r"(row0), "r"(smem_addr(bar))
      : "memory");
}

// D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (shared memory, descriptor); fp32 accumulate.
template <int N>
struct WgmmaRS;

// The m64nNk16 wgmma with A from registers, one macro per N: TY is "f16" or "bf16" (a string literal pasted
// into the instruction); the operands are the N / 2 fp32 accumulators d[] (JM_WG_D*: four / eight / 32 of them from
// index i), then JM_WG_RS_IN (the four A registers, the B descriptor and the scale-D flag).
#define JM_WG_D4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define JM_WG_D8(i) JM_WG_D4(i), JM_WG_D4((i) + 4)
#define JM_WG_D32(i) JM_WG_D8(i), JM_WG_D8((i) + 8), JM_WG_D8((i) + 16), JM_WG_D8((i) + 24)
#define JM_WG_RS_IN "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d)

#define JM_WGMMA_RS_N16(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "  \
      "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D8(0) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N24(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n24k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "  \
      "{%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D8(0), JM_WG_D4(8) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N48(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n48k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, "  \
      "{%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D8(0), JM_WG_D8(8), JM_WG_D8(16) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N80(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, "  \
      "{%40, %41, %42, %43}, %44, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D32(0), JM_WG_D8(32) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N96(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n96k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "  \
      "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D32(0), JM_WG_D8(32), JM_WG_D8(40) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N32(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "  \
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D8(0), JM_WG_D8(8) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N64(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D32(0) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N128(TY)                                                                  \
  asm volatile(                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                          \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                          \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                                   \
      : JM_WG_D32(0), JM_WG_D32(32) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N144(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %77, 0;\n"                                        \
      "wgmma.mma_async.sync.aligned.m64n144k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, "  \
      "{%72, %73, %74, %75}, %76, p, 1, 1, 0;\n}\n"                                       \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D8(64) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N160(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %85, 0;\n"                                        \
      "wgmma.mma_async.sync.aligned.m64n160k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, "  \
      "{%80, %81, %82, %83}, %84, p, 1, 1, 0;\n}\n"                                       \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D8(64), JM_WG_D8(72) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N176(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %93, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n176k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, "  \
      "{%88, %89, %90, %91}, %92, p, 1, 1, 0;\n}\n"                                  \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D8(64), JM_WG_D8(72), JM_WG_D8(80) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N192(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "  \
      "{%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"                                      \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D32(64) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N256(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
      "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"                                  \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D32(64), JM_WG_D32(96) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N208(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %109, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n208k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103}, "  \
      "{%104, %105, %106, %107}, %108, p, 1, 1, 0;\n}\n"                                  \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D32(64), JM_WG_D8(96) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N224(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %117, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n224k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}, "  \
      "{%112, %113, %114, %115}, %116, p, 1, 1, 0;\n}\n"                                  \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D32(64), JM_WG_D8(96), JM_WG_D8(104) \
      : JM_WG_RS_IN)

#define JM_WGMMA_RS_N240(TY)                                                              \
  asm volatile(                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %125, 0;\n"                                       \
      "wgmma.mma_async.sync.aligned.m64n240k16.f32." TY "." TY " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119}, "  \
      "{%120, %121, %122, %123}, %124, p, 1, 1, 0;\n}\n"                                  \
      : JM_WG_D32(0), JM_WG_D32(32), JM_WG_D32(64), JM_WG_D8(96), JM_WG_D8(104), JM_WG_D8(112) \
      : JM_WG_RS_IN)

// WgmmaRS<N>::run<T>: the m64nNk16 instruction of activation type T. Token tiles: 16 / 32 / 64 / 128 (dense and
// MoE), 24 / 48 / 80 / 96 (MoE expert blocks on the producer form; 24: Humming's Mixtral 64-token gate/up blocks
// are 24 x 512), 144 / 160 / 176 / 192 / 208 / 224 / 240 / 256 (dense, the two-compute-warpgroup producer form only;
// 176-240 since session 47, built only by probes: `--extra-wgmma 176-1-6-p2`, tiles that pad M = 257-1024 less).
#define JM_WGMMA_RS_SPEC(N)                                                                              \
  template <>                                                                                            \
  struct WgmmaRS<N> {                                                                                    \
    template <typename T>                                                                                \
    static JM_DEVICE void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc, int scale_d) {  \
      if constexpr (DType<T>::kBF16) JM_WGMMA_RS_N##N("bf16");                                          \
      else JM_WGMMA_RS_N##N("f16");                                                                      \
    }                                                                                                    \
  };
JM_WGMMA_RS_SPEC(16)
JM_WGMMA_RS_SPEC(24)
JM_WGMMA_RS_SPEC(48)
JM_WGMMA_RS_SPEC(80)
JM_WGMMA_RS_SPEC(96)
JM_WGMMA_RS_SPEC(32)
JM_WGMMA_RS_SPEC(64)
JM_WGMMA_RS_SPEC(128)
JM_WGMMA_RS_SPEC(144)
JM_WGMMA_RS_SPEC(160)
JM_WGMMA_RS_SPEC(176)
JM_WGMMA_RS_SPEC(192)
JM_WGMMA_RS_SPEC(208)
JM_WGMMA_RS_SPEC(224)
JM_WGMMA_RS_SPEC(240)
JM_WGMMA_RS_SPEC(256)

// Named barrier 1 over the compute warps (the producer form's producer warpgroup is not in it;
// the plain form's compute warps are the whole CTA).
template <int kThreads>
JM_DEVICE void compute_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
}

}  // namespace jm
