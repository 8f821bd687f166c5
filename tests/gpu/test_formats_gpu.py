"""Every weight format the kernel family takes: fp16/bf16 x 4/8-bit x group -1/32/64/128 x
symmetric/zero points, on odd M and on K that is not a power of two."""

from __future__ import annotations

import itertools

import pytest
import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G

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


SM90_ROUTED = [pytest.param(tag, id=tag)
               for tag in ("w8_k128_s6_bk_dr2", "w8_k128_s6_bk_dr1", "w16_k128_s5_bk", "w16_k128_s6_bk_dr1",
                           "w16_k128_s6_bk", "m2_k128_s4_bk")]


@pytest.mark.parametrize("tag", SM90_ROUTED)
@pytest.mark.parametrize("dtype,bits,group,zp", FORMATS)
def test_format_sm90_small_m_tiles(dtype, bits, group, zp, tag):
    """The tiles the sm_90 heuristic routes M <= 32 to on large problems (the direct-load tiles of
    4-bit and 8-bit weights, the five-slot and the six-slot (8-bit) 16-row rings, the 16-row
    direct-load tile of mid-size 4-bit problems, the 32-row ring), in every format they take, on a
    shape the heuristic would not give them."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("bulk-copy tiles are built for sm_90 and newer only")
    tile, nw = K.Tile.from_tag(tag), 4
    fam = K.Family("bf16" if dtype == torch.bfloat16 else "f16", bits, zp, group)
    if not K.tile_fits(fam, tile):
        pytest.skip(f"{tag} is not built for {fam} (tile_fits)")
    if K.smem_bytes(fam, tile, nw) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin - G.SMEM_RESERVE:
        pytest.skip("does not fit shared memory")
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    k, n = 5120, 768
    packed, w = random_weights(k, n, bits, group, zp, dtype)
    for m in (1, 5, 8, 9, 16, 17, 31, 33):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        check_close(run_poisoned(a, packed, override=(tile, nw)), a.float() @ w, tol, f"{tag} M={m}")
    assert_workspace_clean()
