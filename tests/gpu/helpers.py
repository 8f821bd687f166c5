"""Shared helpers for the GPU tests: random quantized weights, references, error reports."""

from __future__ import annotations

import functools

import torch

from jitmarlin.quant import dequantize, pack_weights, pack_zeros, permute_scales
from jitmarlin.quant.packed import Packed


@functools.lru_cache(maxsize=16)
def random_weights(k: int, n: int, bits: int = 4, group: int = 128, zp: bool = False,
                   dtype: torch.dtype = torch.float16, seed: int = 0) -> tuple[Packed, torch.Tensor]:
    """Random integer weights, scales (and zero points) on the GPU, packed, plus the fp32
    reference matrix W [K, N] they represent."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    groups = 1 if group == -1 else k // group
    q = torch.randint(0, 1 << bits, (k, n), device="cuda", generator=gen, dtype=torch.int32)
    s = (torch.rand(groups, n, device="cuda", generator=gen) * 0.02 + 0.005).to(dtype)
    if bits == 8:
        s = s / 16
    z = torch.randint(0, 1 << bits, (groups, n), device="cuda", generator=gen, dtype=torch.int32) if zp else None
    w = dequantize(q, s, z, bits, group)
    packed = Packed(b=pack_weights(q, bits), scales=permute_scales(s),
                    zeros=pack_zeros(z, bits) if zp else None, bits=bits, group_size=group)
    return packed, w


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> float:
    """Assert out ~ ref; on failure describe where the error sits (rows, columns mod 64), which
    usually tells a layout bug from a numerics one."""
    out2 = out.float().reshape(-1, ref.shape[-1])
    ref2 = ref.reshape(-1, ref.shape[-1])
    bad_nan = (~torch.isfinite(out2)).sum().item()
    err = rel_err(out2, ref2) if bad_nan == 0 else float("inf")
    if bad_nan or not err < tol:
        diff = (out2 - ref2).abs()
        scale = ref2.abs().mean().clamp_min(1e-30)
        badm = (diff > 0.05 * scale) | ~torch.isfinite(out2)
        rows = badm.any(1).nonzero().flatten()[:16].tolist()
        cols = badm.any(0).nonzero().flatten()
        col_mod = sorted(set((cols % 64).tolist()))[:64]
        raise AssertionError(
            f"{what}: rel err {err:.3e} >= {tol} ({bad_nan} non-finite of {out2.numel()}); "
            f"bad fraction {badm.float().mean().item():.3f}; first bad rows {rows}; "
            f"bad cols {cols.numel()} of {ref2.shape[1]}, first {cols[:16].tolist()}, mod 64: {col_mod}")
    return err


FLAGS_CHANGED: list = []  # set by late_arrival_build; conftest's fixture restores the usual kernels


def late_arrival_build(monkeypatch, fam) -> None:
    """Kernels of this process from a -DJM_TEST_LATE_ARRIVAL build from here on (the usual ones again
    after the test, tests/gpu/conftest.py): the kernel handles and build specs are cached per
    process with the flags of their first use, so without clearing them the flag would not reach
    the kernels (it did not before session 23)."""
    from jitmarlin.ops import _kernels as K

    monkeypatch.setenv("JITMARLIN_NVCC_FLAGS", "-DJM_TEST_LATE_ARRIVAL")
    K.clear_kernel_caches()
    FLAGS_CHANGED.append(True)
    assert "-DJM_TEST_LATE_ARRIVAL" in K.build_spec(fam, torch.cuda.get_device_capability(0)).flags
