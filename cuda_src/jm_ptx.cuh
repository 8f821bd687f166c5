// jitmarlin — thin PTX wrappers. Each says why it exists.
#pragma once

#include "jm_common.cuh"

namespace jm {

JM_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that does not occupy registers and bypasses L1 (.cg): the weight
// stream is read exactly once. With valid == false nothing is read and the 16 bytes are zeroed
// (src-size 0), so rows past M enter the MMA as exact zeros.
JM_DEVICE void cp_async16(void* smem, const void* gmem, bool valid = true) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(n));
}

// 4- or 8-byte global->shared copy through L1 (.ca: the only form below 16 bytes) for small per-lane data that must
// reach shared memory without passing through a register: a register written by a global load is tracked by a
// scoreboard counter shared with the warp's other global loads, so its first read waits for all of them; a cp.async
// is waited for with its own group count (the strip kernel's group scales, session 54).
// With valid == false nothing is read and the bytes are zeroed (src-size 0).
template <int BYTES>
JM_DEVICE void cp_async_small(void* smem, const void* gmem, bool valid = true) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(smem)), "l"(gmem), "n"(BYTES),
               "r"(valid ? BYTES : 0));
}

// A compiler-only fence: shared-memory reads above it are not moved below a later cp.async into the same bytes
// (the asm statements of the copies carry no memory clobber).
JM_DEVICE void compiler_fence() { asm volatile("" ::: "memory"); }

// Arrive on an mbarrier once every cp.async this thread has issued so far has landed (.noinc:
// the barrier's expected count already includes this arrival). Lets 16-byte cp.async copies
// complete a producer/consumer ring slot together with bulk copies (PTX ISA,
// "cp.async.mbarrier.arrive").
JM_DEVICE void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Wait for every cp.async of this thread, committed or not.
JM_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// 16-byte load of data read once (the weight stream of the direct-load tiles): the read-only
// path, no L1 allocation.
JM_DEVICE uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A hint, not a copy: ask for `bytes` contiguous bytes from `src` to be brought into L2 (sm_90's bulk prefetch, PTX
// ISA 8.0 "cp.async.bulk.prefetch"; src 16-byte aligned, bytes a multiple of 16). Nothing lands in a register or in
// shared memory and nothing waits for it (the wgmma producer form's A/B switch JM_WG_L2_AHEAD; the floor probe's
// variants). No-op below sm_90.
JM_DEVICE void prefetch_l2_bulk(const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes));
#endif
}

// One group per pipeline stage, committed even when empty so group counting stays uniform.
JM_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
JM_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The same wait with a memory clobber, for a thread that reads back its own copies with plain shared-memory loads
// and no barrier after the wait (the strip kernel's lane-private ring): the compiler must not move those loads
// above it.
template <int N>
JM_DEVICE void cp_async_wait_fenced() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix x4: the four 8x8 matrices of a 16x16 activation block land exactly in the A fragment
// registers of mma.m16n8k16 (PTX ISA, "ldmatrix" and "Matrix Fragments for mma.m16n8k16").
JM_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// ldmatrix x2: an 8-token x 16-k activation block as the B operand of the transposed MMA.
JM_DEVICE void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem)));
}

// D = A * B + D, m16n8k16, fp32 accumulate.
template <typename T>
JM_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (DType<T>::kBF16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// (a & b) | c in one instruction; the compiler does not always fuse the and/or pair.
// LUT: with a=0xF0, b=0xCC, c=0xAA, (a & b) | c = 0xEA.
JM_DEVICE uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Byte permute: picks 4 bytes out of {b, a} by the selector nibbles (PTX prmt).
JM_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Packed 16-bit arithmetic on raw registers. fp16 uses sub/fma/mul.f16x2; bf16 uses
// fma.rn.bf16x2 only, because add/sub/mul.bf16x2 need sm_90 while fma.bf16x2 exists on sm_80.
template <typename T>
JM_DEVICE uint32_t sub2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (DType<T>::kBF16) {
    // a * 1.0 + (-b); negating a bf16x2 is flipping both sign bits.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(0x3f803f80u), "r"(b ^ 0x80008000u));
  } else {
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

template <typename T>
JM_DEVICE uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if constexpr (DType<T>::kBF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}

template <typename T>
JM_DEVICE uint32_t mul2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (DType<T>::kBF16) {
    // a * b + (-0.0): exact product, keeps the sign of zero.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("mul.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}

// ---- Hopper (sm_90) only: bulk copies, mbarriers, programmatic dependent launch ----
// Used by the producer-warp pipeline of jm_gemm.cuh (BULK tiles). PTX ISA: "cp.async.bulk",
// "mbarrier", "griddepcontrol". The Python side compiles BULK tiles only for sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JM_HAS_BULK 1
#else
#define JM_HAS_BULK 0
#endif

// One mbarrier: `count` arrivals complete a phase (plus the transaction bytes announced with
// arrive_expect_tx, which bulk copies count down as they land).
JM_DEVICE void mbar_init(uint64_t* bar, uint32_t count) {
#if JM_HAS_BULK
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}

// Make the initialised barriers visible to the async proxy (the bulk copy engine).
JM_DEVICE void mbar_fence_init() {
#if JM_HAS_BULK
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Order this thread's earlier generic-proxy shared-memory writes before later async-proxy
// (bulk copy) accesses of the same memory.
JM_DEVICE void fence_proxy_async_smem() {
#if JM_HAS_BULK
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

JM_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if JM_HAS_BULK
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}

JM_DEVICE void mbar_arrive(uint64_t* bar) {
#if JM_HAS_BULK
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Spin until the phase of parity `parity` of the barrier has completed. try_wait may suspend the thread
// until the phase completes or a time limit passes (PTX ISA, mbarrier.try_wait); probe builds with
// -DJM_MBAR_SUSPEND_NS=N give that limit as the suspendTimeHint operand (nanoseconds) instead of the
// system's default, so that waiting warps re-issue the test less often.
JM_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
#if JM_HAS_BULK
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  while (!done) {
#ifdef JM_MBAR_SUSPEND_NS
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity), "n"(JM_MBAR_SUSPEND_NS)
        : "memory");
#else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
#endif
  }
#endif
}

// Warpgroup register reallocation (sm_90a; PTX ISA "setmaxnreg"): every warp of a warpgroup
// executes the same one; .dec returns registers to the CTA's pool, .inc waits until the pool has
// them. Used by the producer form: the copy-issuing warpgroup keeps few, the compute ones take them.
template <int N>
JM_DEVICE void setmaxnreg_dec() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
JM_DEVICE void setmaxnreg_inc() {
  static_assert(N % 8 == 0 && N >= 24 && N <= 256, "setmaxnreg: a multiple of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Global -> shared copy of `bytes` (multiple of 16, both addresses 16-byte aligned) by the bulk
// copy engine; completion is counted on `bar` in bytes. One thread issues it, no registers hold
// the data, and the issuing warp does not wait.
JM_DEVICE void bulk_copy_g2s(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
#if JM_HAS_BULK
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Programmatic dependent launch: wait until the previous kernel in the stream has completed and
// its memory is visible (a no-op when the launch did not allow overlap), and let the next kernel
// start launching early (it still waits in its own griddep_wait before touching our outputs).
JM_DEVICE void griddep_wait() {
#if JM_HAS_BULK
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
JM_DEVICE void griddep_launch_dependents() {
#if JM_HAS_BULK
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Dynamic shared memory of this launch (PTX special register %dynamic_smem_size).
JM_DEVICE uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// Load with acquire semantics at GPU scope (PTX memory model): memory reads after it see what the
// writer released before the value was stored.
JM_DEVICE int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// ---- thread-block clusters (sm_90; PTX ISA: "barrier.cluster", "mapa", distributed shared memory) ----
// NAME(): the special register REG (a cluster-ctarank kind of register), DEFAULT before sm_90
#define JM_CLUSTER_SREG(NAME, REG, DEFAULT)                     \
  JM_DEVICE uint32_t NAME() {                                   \
    uint32_t r = DEFAULT;                                       \
    JM_CLUSTER_SREG_READ(REG)                                   \
    return r;                                                   \
  }
#if JM_HAS_BULK
#define JM_CLUSTER_SREG_READ(REG) asm volatile("mov.u32 %0, %%" REG ";\n" : "=r"(r));
#else
#define JM_CLUSTER_SREG_READ(REG)
#endif
JM_CLUSTER_SREG(cluster_ctarank, "cluster_ctarank", 0)    // this CTA's rank in its cluster
JM_CLUSTER_SREG(cluster_nctarank, "cluster_nctarank", 1)  // CTAs in its cluster (1 without a cluster launch)
#undef JM_CLUSTER_SREG_READ
#undef JM_CLUSTER_SREG

// Arrive on the cluster barrier without ordering memory (every non-exited thread of the cluster
// arrives once per phase; a thread may exit after arriving).
JM_DEVICE void cluster_arrive_relaxed() {
#if JM_HAS_BULK
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#endif
}
// Arrive, releasing this thread's earlier writes (shared::cluster included) to the waiters.
JM_DEVICE void cluster_arrive_release() {
#if JM_HAS_BULK
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}
// Wait for the current phase to complete, acquiring what the arriving threads released.
JM_DEVICE void cluster_wait() {
#if JM_HAS_BULK
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// This CTA's shared address `addr` as seen in cluster CTA `rank` (its shared memory), for st.shared::cluster
JM_DEVICE uint32_t cluster_map(uint32_t addr, uint32_t rank) {
  uint32_t remote = addr;
#if JM_HAS_BULK
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
#endif
  return remote;
}
// Store v at this CTA's shared address `addr` as seen in cluster CTA `rank`.
JM_DEVICE void st_cluster_f32(uint32_t addr, uint32_t rank, float v) {
#if JM_HAS_BULK
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(cluster_map(addr, rank)), "f"(v) : "memory");
#endif
}
// Store 16 bytes at this CTA's shared address `addr` as seen in cluster CTA `rank`.
JM_DEVICE void st_cluster_v4(uint32_t addr, uint32_t rank, float x, float y, float z, float w) {
#if JM_HAS_BULK
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(cluster_map(addr, rank)), "f"(x), "f"(y),
               "f"(z), "f"(w)
               : "memory");
#endif
}

// The strip kernel's next group's scales (or zero points) on their way through shared memory (jm_strip.cuh):
// `st.shared [slot], pend` then, in place, `@more ld.global.nc pend, [src]`, one asm statement, so the load lands in
// the register the store read and nothing reads it before the next group ends. Written in C++ as `cur = next;
// next = load(..)`, the compiler issued the load into a spare register ahead of the copy and copied it into `next`
// at once, which stalled the warp for a memory round trip at every group end (sm_90a SASS, session 53). `slot`: a
// shared-state-space address (smem_addr) that only this thread reads.
JM_DEVICE void pass_on16(uint32_t slot, uint4& pend, bool more, const void* src) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
      " st.shared.v4.u32 [%4], {%0, %1, %2, %3};\n"
      " @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%6];\n}\n"
      : "+r"(pend.x), "+r"(pend.y), "+r"(pend.z), "+r"(pend.w)
      : "r"(slot), "r"(static_cast<int>(more)), "l"(src)
      : "memory");
}
JM_DEVICE void pass_on4(uint32_t slot, uint32_t& pend, bool more, const void* src) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n"
      " st.shared.u32 [%1], %0;\n"
      " @q ld.global.nc.u32 %0, [%3];\n}\n"
      : "+r"(pend)
      : "r"(slot), "r"(static_cast<int>(more)), "l"(src)
      : "memory");
}

// Diagnostics (-DJM_TIMELINE, benchmarks/probe_timeline.py): the GPU-wide nanosecond timer and
// the SM a CTA runs on.
JM_DEVICE uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
JM_DEVICE uint32_t smid() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(r));
  return r;
}

// Barrier over the first `threads` threads of the CTA (named barrier 1; 0 is __syncthreads).
JM_DEVICE void named_sync(int threads) { asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory"); }

}  // namespace jm
