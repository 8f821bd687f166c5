"""The SIMT emulator's model of programmatic dependent launch (tests/simt/simt.h): in a launch that may overlap the
kernel before it, the buffers that kernel may still use (activations, outputs, workspace, routing tables unless
complete before it started: tests/simt/emu.py, dependent_buffers) may be touched only after griddepcontrol.wait,
by a thread that executed it or synchronized with one that had.

A GPU test rarely sees such a bug (the kernel before a test's GEMM is usually a torch kernel that does not trigger
its dependents early, so the wait returns at once); in a model's chain of our kernels (the MoE chain, the act-order
gather) it is a silent, timing-dependent wrong result. First a small kernel of ours shows each rule (reads through
the checked loads and plain pointers, plain stores, cp.async issued early, happens-before through a CTA barrier, a
warp collective and an mbarrier phase, the layer constants and ready tables allowed before the wait); then
mutations of the shipped kernels (their wait removed) show the check catching them in the real code.
"""

from __future__ import annotations

import pytest
import torch

from jitmarlin.ops import _kernels as K

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

# p.m selects what the kernel does (each thread of a 64-thread CTA; two CTAs, so the second starts unwaited again)
PROBE = r"""
#include "jm_ptx.cuh"
#include "jm_gemm_params.h"

extern "C" __global__ void pdl_probe(const __grid_constant__ JmGemmParams p) {
  __shared__ __align__(8) uint64_t bar;
  const int tid = threadIdx.x, mode = p.m;
  const half* a = static_cast<const half*>(p.a);
  half* c = static_cast<half*>(p.c);
  float acc = 0.f;
  if (mode == 0) {         // wait, then touch everything: allowed
    jm::griddep_wait();
    acc = __half2float(__ldg(a + tid)) + static_cast<float>(*p.num_padded);
  } else if (mode == 1) {  // a plain read of a routing table before the wait
    acc = static_cast<float>(*p.num_padded);
    jm::griddep_wait();
  } else if (mode == 2) {  // a plain store to the output before the wait
    c[tid] = __float2half_rn(1.f);
    jm::griddep_wait();
  } else if (mode == 3) {  // a checked load of the activations before the wait
    acc = __half2float(__ldg(a + tid));
    jm::griddep_wait();
  } else if (mode == 4) {  // the layer's constants (weights, scales) before the wait: allowed
    acc = static_cast<float>(__ldg(static_cast<const int*>(p.b) + tid)) +
          __half2float(__ldg(static_cast<const half*>(p.s) + tid));
    jm::griddep_wait();
    acc += __half2float(__ldg(a + tid));
  } else if (mode == 5 || mode == 6) {  // thread 0 waits; the others read after a CTA barrier (5) or without (6)
    if (tid == 0) jm::griddep_wait();
    if (mode == 5) __syncthreads();
    acc = __half2float(__ldg(a + tid));
  } else if (mode == 7) {  // lane 0 waits; its warp reads after a shuffle (a warp collective): allowed
    if (tid < 32) {
      if (tid == 0) jm::griddep_wait();
      acc = static_cast<float>(__shfl_sync(0xFFFFFFFFu, tid, 0));
      acc += __half2float(__ldg(a + tid));
    } else {
      jm::griddep_wait();
    }
  } else if (mode == 8) {  // a cp.async of the activations issued before the wait
    extern __shared__ __align__(16) uint8_t smem[];
    jm::cp_async16(smem + 16 * tid, a + 8 * (tid % 4));
    jm::griddep_wait();
    jm::cp_async_wait_all();
  } else if (mode == 9) {  // the workspace's arrival counters read before the wait
    acc = static_cast<float>(jm::ld_acquire_gpu(p.counters));
    jm::griddep_wait();
  } else if (mode == 10 || mode == 11) {  // thread 0 arrives on an mbarrier after (10) or before (11) its wait;
    if (tid == 0) jm::mbar_init(&bar, 1);    // thread 32 waits on the phase, then reads
    __syncthreads();
    if (tid == 0) {
      if (mode == 10) jm::griddep_wait();
      jm::mbar_arrive(&bar);
      jm::griddep_wait();
    } else if (tid == 32) {
      jm::mbar_wait(&bar, 0);
      acc = __half2float(__ldg(a + tid));
      jm::griddep_wait();
    } else {
      jm::griddep_wait();
    }
  }
  if (mode != 2) c[blockIdx.x * 64 + tid] = __float2half_rn(acc);
}
"""

MODES_ALLOWED = {0: "wait first", 4: "constants before the wait", 5: "a CTA barrier after thread 0's wait",
                 7: "a warp shuffle after lane 0's wait", 10: "an mbarrier phase arrived after the wait"}
MODES_CAUGHT = {1: ("plain read of a table", "num_padded"), 2: ("plain store to the output", "c"),
                3: ("checked load of the activations", "a"), 6: ("no barrier after thread 0's wait", "a"),
                8: ("cp.async issued before the wait", "a"), 9: ("workspace counter read", "counters"),
                11: ("an mbarrier phase arrived before the wait", "a")}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    library = emu.build([("pdl_probe", emu.rewrite(PROBE))], tmp_path_factory.mktemp("simtpdl"))
    yield library
    library.free_all()


def probe(lib, mode: int, tables_ready: int = 0, seed: int = 0) -> None:
    g = lib.guarded
    a = g(torch.randn(64).half())
    c = g(torch.zeros(128).half())
    b, s = g(torch.arange(64, dtype=torch.int32)), g(torch.rand(64).half())
    num_padded, counters = g(torch.tensor([8], dtype=torch.int32)), g(torch.zeros(4, dtype=torch.int32))
    p = K.GemmParams()
    for field, t in (("a", a), ("c", c), ("b", b), ("s", s), ("num_padded", num_padded), ("counters", counters)):
        setattr(p, field, t.data_ptr())
    p.m, p.tables_ready = mode, tables_ready
    try:
        lib.launch("pdl_probe", 2, 64, 1, 1024, p, seed=seed, dependent=emu.dependent_buffers(lib, p))
    except emu.SimtError as e:
        raise emu.SimtError(emu.name_dependent(lib, p, str(e))) from None


@pytest.mark.parametrize("mode", sorted(MODES_ALLOWED), ids=lambda m: MODES_ALLOWED[m])
def test_allowed_accesses(lib, mode):
    for seed in range(3):
        probe(lib, mode, seed=seed)


@pytest.mark.parametrize("mode", sorted(MODES_CAUGHT), ids=lambda m: MODES_CAUGHT[m][0])
def test_early_accesses_caught(lib, mode):
    """Each is an error naming the rule and the parameter whose buffer was touched."""
    with pytest.raises(emu.SimtError, match=f"griddepcontrol.wait.*the launch's `{MODES_CAUGHT[mode][1]}`"):
        probe(lib, mode)


def test_ready_tables_and_plain_launches(lib):
    """Tables complete before the kernel before started (tables_ready) may be read before the wait; a launch
    without programmatic dependent launch has no dependent buffers at all."""
    probe(lib, 1, tables_ready=1)
    with pytest.raises(emu.SimtError, match="griddepcontrol.wait"):
        probe(lib, 2, tables_ready=1)  # (the output stays dependent)
    p = K.GemmParams()
    p.m = 2
    c = lib.guarded(torch.zeros(128).half())
    p.c = c.data_ptr()
    lib.launch("pdl_probe", 2, 64, 1, 1024, p)


def test_dependent_buffers_must_be_guarded(lib):
    p = K.GemmParams()
    plain = torch.zeros(16, dtype=torch.int32)
    p.c = plain.data_ptr()
    with pytest.raises(AssertionError, match="`c`"):
        emu.dependent_buffers(lib, p)

