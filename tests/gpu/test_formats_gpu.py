"""Every weight format the kernel family takes: fp16/bf16 x 4/8-bit x group -1/32/64/128 x
symmetric/zero points, on odd M and on K that is not a power of two."""

from __future__ import annotations

import itertools

import pytest
import torch

from .helpers import check_close, random_weights
from .test_gemm_gpu import assert_workspace_clean, run_poisoned

FORMATS = [pytest.param(d, b, g, z, id=f"{'bf16' if d == torch.bfloat16 else 'f16'}-u{b}-g{g}-{'zp' if z else 'sym'}")
           for d, b, g, z in itertools.product((torch.float16, torch.bfloat16), (4, 8), (-1, 32, 64, 128), (False, True))]
SHAPES = [(5120, 768), (11008, 512), (14336, 256)]
M_LIST = [1, 5, 16, 33, 100]


@pytest.mark.parametrize("dtype,bits,group,zp", FORMATS)
def test_format(dtype, bits, group, zp):
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for k, n in SHAPES:
        packed, w = random_weights(k, n, bits, group, zp, dtype)
        for m in M_LIST:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            out = run_poisoned(a, packed)
            assert out.dtype == dtype
            check_close(out, a.float() @ w, tol, f"M={m} K={k} N={n}")
        a = torch.randn(40, k, device="cuda", dtype=dtype)  # the large-M path: dequantize + cuBLAS
        check_close(run_poisoned(a, packed, override="dequant"), a.float() @ w, tol, f"dequant K={k} N={n}")
    assert_workspace_clean()
