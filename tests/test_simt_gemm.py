"""The mma.sync GEMM kernel (cuda_src/jm_gemm.cuh) on the CPU emulator (tests/simt), built as for sm_80: every tile
of K.TILES (what an sm_8x GPU runs) through the real launch path — gemm.launch_gemm with a tile override, the
plan, grid, workspace and parameter struct of the GPU launch — with the driver replaced by the emulator.

Two purposes. This kernel passes its GPU tests on the H200 (the same tiles, built for sm_90), so its passing here
checks the emulator's model of mma.sync, ldmatrix, shuffles, cp.async and barriers against hardware-proven code
(the strip kernel's emulated results rest on that model). And the sm_80 build of the tiles runs here at all: no
sm_8x GPU is lent to this project, so until now only its compilation was tested on the CPU. A small SM count makes
the striped partitioning split output units along K across CTAs, so the global fix-up (partial sums in the
workspace, arrival counters, the last CTA's sum) runs too, and must leave the counters at zero.
"""

from __future__ import annotations

import pytest
import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.quant import dequantize, pack_weights, pack_zeros, permute_scales

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
FAMILIES = (K.Family("f16", 4, False, 128), K.Family("bf16", 4, True, 64), K.Family("f16", 8, False, -1),
            K.Family("bf16", 8, True, 32))
PAIRS = [(f, t) for f in FAMILIES for t in K.TILES if K.tile_fits(f, t)]
BULK_PAIRS = [(f, t) for f in FAMILIES for t in K.BULK_TILES if K.tile_fits(f, t)]
SMEM = emu.SMEM_OPTIN
CASES = [((8, 0), f, t) for f, t in PAIRS] + [((9, 0), f, t) for f, t in BULK_PAIRS]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """The emulator library of an architecture's tiles, built on first use."""
    built = {}

    def get(cc):
        if cc not in built:
            pairs = PAIRS if cc == (8, 0) else BULK_PAIRS
            built[cc] = emu.build([(K.kernel_name(f, t), K.kernel_source(f, t)) for f, t in pairs],
                                  tmp_path_factory.mktemp(f"simt{cc[0]}0"), sm=cc[0] * 10)
        return built[cc]

    yield get
    for lib in built.values():
        lib.free_all()


def weights(lib, k, n, fam, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if fam.group_size == -1 else k // fam.group_size
    q = torch.randint(0, 1 << fam.bits, (k, n), generator=gen, dtype=torch.int32)
    s = ((torch.rand(groups, n, generator=gen) * 0.02 + 0.005) / (16 if fam.bits == 8 else 1)).to(DTYPES[fam.dtype])
    z = torch.randint(0, 1 << fam.bits, (groups, n), generator=gen, dtype=torch.int32) if fam.zero_points else None
    w = dequantize(q, s, z, fam.bits, fam.group_size).float()
    return (lib.guarded(pack_weights(q, fam.bits)), lib.guarded(permute_scales(s)),
            lib.guarded(pack_zeros(z, fam.bits)) if z is not None else None, w)


def run(lib, a, b, s, z, fam, override, bias=None):
    m, k = a.shape
    n = s.shape[1]
    full = lib.guarded(torch.full((m + 1, n), float("nan"), dtype=a.dtype))
    out = full[:m]
    G.launch_gemm(lib.guarded(a), b, s, z, bias, out, m, n, k, fam, plan_override=override)
    assert torch.isnan(full[m].float()).all(), "the kernel wrote past row M"
    return out.clone()


def check_close(out, ref, tol, what):
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < tol, f"{what}: rel err {err:.3e} >= {tol}"


def fam_tile_id(x):
    if isinstance(x, K.Tile):
        return x.tag()
    return f"{x.dtype}-u{x.bits}-g{x.group_size}{'-zp' if x.zero_points else ''}"


def check_tile(device, fam, tile, cc):
    """The tile with 2 and 4 warps on 4 and 3 SMs (K split across CTAs: the workspace fix-up runs), M at the
    tile's edges, with a bias; the counters back at zero after every launch."""
    lib, ws, state = device
    k, n = 1024, 256
    b, s, z, w = weights(lib, k, n, fam, seed=k)
    bias = lib.guarded(torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DTYPES[fam.dtype]))
    tol = 1e-3 if fam.dtype == "f16" else 1e-2
    ran = 0
    for sms, nw in ((4, 2), (3, 4)):
        state["sms"] = sms
        emu.clear_launch_caches()
        if K.smem_bytes(fam, tile, nw) > SMEM[cc] - G.SMEM_RESERVE:
            continue
        for m in sorted({1, tile.rows - 3, tile.rows} - {0} if tile.rows > 3 else {1, tile.rows}):
            a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DTYPES[fam.dtype])
            out = run(lib, a, b, s, z, fam, (tile, nw), bias=bias if m == 1 else None)
            ref = a.float() @ w + (bias.float() if m == 1 else 0)
            check_close(out, ref, tol, f"{tile.tag()} nw={nw} sms={sms} M={m}")
            assert int(ws.counters.abs().sum()) == 0, "split-unit arrival counters not reset"
            ran += 1
    assert ran, "no launch fits"


@pytest.mark.parametrize("cc,fam,tile", CASES, ids=lambda x: fam_tile_id(x) if not isinstance(x, tuple) else
                         f"sm{x[0]}{x[1]}")
def test_gemm_tiles_emulated(monkeypatch, libs, cc, fam, tile):
    """Every tile an sm_8x GPU runs (K.TILES built for sm_80: no bulk copies, no PDL), and the sm_90 tiles
    (K.BULK_TILES: a producer warp's bulk copies and cp.async counted on mbarriers, named barriers among the math
    warps, direct weight loads, the k-split ring, clusters) — what the H200 runs at M <= 16."""
    lib = libs(cc)
    ws, state = emu.emulated_device(monkeypatch, lib, cc)
    try:
        check_tile((lib, ws, state), fam, tile, cc)
    finally:
        emu.clear_launch_caches()
