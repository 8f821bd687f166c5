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

import functools

import pytest
import torch

from jitmarlin.jit import driver
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
SMEM = {(8, 0): 166912, (9, 0): 232448}  # bytes of shared memory a CTA may opt into: A100, H100 / H200


@pytest.fixture(scope="module")
def lib80(tmp_path_factory):
    library = emu.build([(K.kernel_name(f, t), K.kernel_source(f, t)) for f, t in PAIRS],
                        tmp_path_factory.mktemp("simt80"), sm=80)
    yield library
    library.free_all()


@pytest.fixture(scope="module")
def lib90(tmp_path_factory):
    library = emu.build([(K.kernel_name(f, t), K.kernel_source(f, t)) for f, t in BULK_PAIRS],
                        tmp_path_factory.mktemp("simt90"), sm=90)
    yield library
    library.free_all()


class _EmuKernel:
    """What the launch path reads of a driver kernel handle; launch() runs the emulator."""

    num_regs = 128

    def __init__(self, lib, name, cc):
        self.lib, self.name, self.cc = lib, name, cc

    def occupancy(self, threads, smem):
        return max(0, min(2, SMEM[self.cc] // max(smem, 1)))

    def max_active_clusters(self, threads, smem, cluster):  # (an H200 fits 16 clusters of 8 of these tiles)
        return 16

    def launch(self, grid, threads, smem, stream, params, pdl=False, cluster=0, extra=None):
        assert not (pdl and self.cc < (9, 0)), "sm_80 launches have no programmatic dependent launch"
        self.lib.launch(self.name, grid, threads, max(cluster, 1), smem, params)


class _Workspace:
    def __init__(self, lib):
        self.ws = lib.guarded(torch.full((1 << 18,), float("nan")))
        self.counters = lib.guarded(torch.zeros(1024, dtype=torch.int32))

    def ensure(self, floats, slots):
        assert floats <= self.ws.numel() and slots <= self.counters.numel(), (floats, slots)


def emulated_device(monkeypatch, lib, cc):
    """A device of compute capability cc and `state["sms"]` SMs (set by the test) whose kernels run on the
    emulator."""
    ws = _Workspace(lib)
    state = {"sms": 4}
    dev = type("Dev", (), {"smem_per_block_optin": SMEM[cc]})
    monkeypatch.setattr(G, "_cc", functools.lru_cache(None)(lambda index: cc))
    monkeypatch.setattr(driver, "device", lambda index: type("D", (dev,), {"sm_count": state["sms"]})())
    monkeypatch.setattr(K, "get_kernel", lambda fam, tile, index, c: _EmuKernel(lib, K.kernel_name(fam, tile), cc))
    monkeypatch.setattr(K, "default_workspace", lambda d: ws)
    monkeypatch.setattr(K, "current_stream_handle", lambda d: 0)
    monkeypatch.setattr(K, "cuda_index", lambda d: 0)
    G.prepare_launch.cache_clear()
    return lib, ws, state


@pytest.fixture
def sm80(monkeypatch, lib80):
    yield emulated_device(monkeypatch, lib80, (8, 0))
    G.prepare_launch.cache_clear()


@pytest.fixture
def sm90(monkeypatch, lib90):
    yield emulated_device(monkeypatch, lib90, (9, 0))
    G.prepare_launch.cache_clear()


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
        G.prepare_launch.cache_clear()
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


@pytest.mark.parametrize("fam,tile", PAIRS, ids=fam_tile_id)
def test_gemm_sm80_tiles_emulated(sm80, fam, tile):
    """Every tile an sm_8x GPU runs (K.TILES, built for sm_80: no bulk copies, no PDL)."""
    check_tile(sm80, fam, tile, (8, 0))


@pytest.mark.parametrize("fam,tile", BULK_PAIRS, ids=fam_tile_id)
def test_gemm_sm90_bulk_tiles_emulated(sm90, fam, tile):
    """The sm_90 tiles (K.BULK_TILES: a producer warp's bulk copies and cp.async counted on mbarriers, named
    barriers among the math warps, direct weight loads, the k-split ring, clusters) — what the H200 runs at M <= 16."""
    check_tile(sm90, fam, tile, (9, 0))
