"""The strip kernel (cuda_src/jm_strip.cuh) run on the CPU by the SIMT emulator (tests/simt): the real kernel text,
the real launch parameters (gemm.strip_params, strip_grid, K.strip_smem_bytes) and the real packer, against the
plain-PyTorch reference on the dequantized weight, with a poisoned output. Every built config and every weight
format; odd K (warps without rows, runs that cut groups); clusters exchanging sums through distributed shared
memory; scheduling orders that a missing barrier would make matter.

This does not replace the GPU tests (tests/gpu/test_strip_gpu.py: the hardware's instructions, timing, the
driver's launch); it runs the kernel's logic where no GPU is lent. The mutation tests at the end show that the
emulator does catch the bug classes it is meant for: session 49's weight addressing (its first GPU run), a
missing barrier, a cp.async read before its copy landed, a cluster barrier left unarrived, activations read before
the programmatic-dependent-launch wait.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.quant import dequantize, pack_weights, pack_zeros, permute_scales

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
FORMATS = [K.Family(d, b, z, g) for d, b, g, z in itertools.product(("f16", "bf16"), (4, 8), (-1, 32, 64, 128),
                                                                    (False, True))]
FORMAT_CONFIGS = ((16, 4, 1, 0), (4, 1, 2, 0), (16, 2, 2, 1), (8, 1, 1, 1), (8, 1, 4, 1))
BASE = K.Family("f16", 4, False, 128)
PER_CHANNEL = K.Family("f16", 4, False, -1)


def fam_id(fam: K.Family) -> str:
    return f"{fam.dtype}-u{fam.bits}-{'gc' if fam.group_size == -1 else f'g{fam.group_size}'}" + \
        ("-zp" if fam.zero_points else "")


def sources(pairs):
    """(family, config[, act-order form]) -> the kernels' (name, source)."""
    return [(K.strip_kernel_name(f, *c, perm=bool(x)), K.strip_kernel_source(f, *c, perm=bool(x)))
            for f, c, *x in pairs]


PERM_FORMATS = (BASE, K.Family("bf16", 8, True, 32), K.Family("f16", 4, True, -1))
ALL_PAIRS = ([(BASE, c) for c in K.STRIP_CONFIGS] + [(PER_CHANNEL, c) for c in K.STRIP_CONFIGS]
             + [(f, c) for f in FORMATS for c in FORMAT_CONFIGS if f not in (BASE, PER_CHANNEL)]
             + [(BASE, c, True) for c in K.STRIP_CONFIGS] + [(f, c, True) for f in PERM_FORMATS[1:] for c in FORMAT_CONFIGS])


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    library = emu.build(sources(dict.fromkeys(ALL_PAIRS)), tmp_path_factory.mktemp("simt"))
    yield library
    library.free_all()


def weights(k: int, n: int, fam: K.Family, seed: int):
    """Random integer weights, scales, zero points: (packed b, permuted scales, packed zeros, W [K, N] fp32)."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if fam.group_size == -1 else k // fam.group_size
    q = torch.randint(0, 1 << fam.bits, (k, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005) / (16 if fam.bits == 8 else 1)
    s = s.to(DTYPES[fam.dtype])
    z = torch.randint(0, 1 << fam.bits, (groups, n), generator=gen, dtype=torch.int32) if fam.zero_points else None
    w = dequantize(q, s, z, fam.bits, fam.group_size)
    return (pack_weights(q, fam.bits), permute_scales(s), pack_zeros(z, fam.bits) if z is not None else None,
            w.float())


def run_strip(lib, fam, cfg, a, b, s, z, bias, seed=0, perm=None):
    """The kernel's output for a (M, K) through the emulator, launched as gemm.launch_strip launches it (perm: the
    act-order form, a[:, perm] @ W); checks that the rows past M stay poisoned."""
    warps, cluster, toks, smem = cfg
    m, k = a.shape
    n = s.shape[1]
    G.check_strip(m, n, k, fam, warps, cluster, toks, smem, emu.EmuKernel(lib, "", (9, 0)), perm is not None)  # H200
    bufs = [lib.guarded(t) for t in (a, b, s) + tuple(x for x in (z, bias, perm) if x is not None)]
    ga, gb, gs = bufs[:3]
    rest = bufs[3:]
    gz = rest.pop(0) if z is not None else None
    gbias = rest.pop(0) if bias is not None else None
    gperm = rest.pop(0) if perm is not None else None
    full = lib.guarded(torch.full((m + 1, n), float("nan"), dtype=a.dtype))
    out = full[:m]
    p = G.strip_params(m, n, k, warps, cluster, ga, gb, gs, gz, gbias, out, gperm)
    lib.launch(K.strip_kernel_name(fam, *cfg, perm=perm is not None), p.grid, 32 * warps, cluster,
               K.strip_smem_bytes(fam, warps, smem, perm is not None, k, cluster, toks), p, bufs, seed=seed,
               dependent=emu.dependent_buffers(lib, p))  # (launch_strip's programmatic dependent launch)
    assert torch.isnan(full[m].float()).all(), "the kernel wrote past row M"
    return out.clone()


def check_close(out, ref, tol, what):
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < tol:  # where: rows, columns mod 64 (a layout slip shows a pattern)
        bad = ((out.float() - ref).abs() > 0.05 * ref.abs().mean()) | ~torch.isfinite(out.float())
        raise AssertionError(f"{what}: rel err {err:.3e} >= {tol}; bad rows {bad.any(1).nonzero().flatten()[:16].tolist()}"
                             f", bad cols mod 64 {sorted(set((bad.any(0).nonzero().flatten() % 64).tolist()))[:64]}")


def tokens(toks: int) -> tuple[int, ...]:
    """M values for a config of `toks` token blocks: inside the first block, across blocks, the last row."""
    return {1: (1, 3, 8), 2: (2, 9, 13, 16), 3: (5, 17, 22, 24), 4: (19, 25, 30, 32)}[toks]


@pytest.mark.parametrize("cfg", K.STRIP_CONFIGS, ids=lambda c: "w{}-c{}-t{}{}".format(*c[:3], "-s" if c[3] else ""))
def test_strip_every_config(lib, cfg):
    """Every config of STRIP_CONFIGS on fp16 W4: group 128 with K = 1152 (72 k16 rows over up to 64 warps: runs of
    one and two rows, groups cut between warps), K = 2048 over three strips, per channel with K = 272 (17 rows:
    warps with no row); with and without bias."""
    for fam, k, n in ((BASE, 1152, 128), (BASE, 2048, 192), (PER_CHANNEL, 272, 64)):
        b, s, z, w = weights(k, n, fam, seed=k + n)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).half()
        for m in tokens(cfg[2]):
            a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
            out = run_strip(lib, fam, cfg, a, b, s, z, None)
            check_close(out, a.float() @ w, 1e-3, f"{cfg} K={k} N={n} {fam_id(fam)} M={m}")
            if m == tokens(cfg[2])[1]:
                out = run_strip(lib, fam, cfg, a, b, s, z, bias)
                check_close(out, a.float() @ w + bias.float(), 1e-3, f"bias {cfg} K={k} N={n} M={m}")


@pytest.mark.parametrize("fam", FORMATS, ids=fam_id)
def test_strip_every_format(lib, fam):
    """fp16 / bf16 x 4 / 8 bits x per channel / group 32 / 64 / 128 x symmetric / zero points, on four configs
    (clusters of 4, two token blocks, the shared-memory ring with and without a cluster); K = 640 (40 k16 rows:
    20 groups of 32 over 64 warps)."""
    k, n = 640, 128
    b, s, z, w = weights(k, n, fam, seed=7)
    tol = 1e-3 if fam.dtype == "f16" else 1e-2
    for cfg in FORMAT_CONFIGS:
        for m in tokens(cfg[2])[::2]:
            a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DTYPES[fam.dtype])
            out = run_strip(lib, fam, cfg, a, b, s, z, None)
            assert out.dtype == a.dtype
            check_close(out, a.float() @ w, tol, f"{fam_id(fam)} {cfg} M={m}")


@pytest.mark.parametrize("cfg", K.STRIP_CONFIGS, ids=lambda c: "w{}-c{}-t{}{}".format(*c[:3], "-s" if c[3] else ""))
def test_strip_act_order_every_config(lib, cfg):
    """The act-order form of every config (the activation columns gathered through a random permutation by the
    kernel, perm indices PD rows ahead of the activations): a[:, perm] @ W, K = 1152 and 2048 (long runs: the index
    ring wraps), with a bias."""
    for k, n in ((1152, 128), (2048, 64)):
        b, s, z, w = weights(k, n, BASE, seed=k)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)).to(torch.int32)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).half()
        for m in tokens(cfg[2]):
            a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
            out = run_strip(lib, BASE, cfg, a, b, s, z, bias if m == 1 else None, perm=perm)
            ref = a[:, perm.long()].float() @ w + (bias.float() if m == 1 else 0)
            check_close(out, ref, 1e-3, f"act-order {cfg} K={k} M={m}")
            unpermuted = a.float() @ w + (bias.float() if m == 1 else 0)
            assert ((out.float() - unpermuted).norm() / unpermuted.norm()).item() > 0.5  # (the columns were gathered)


@pytest.mark.parametrize("fam", PERM_FORMATS[1:], ids=fam_id)
def test_strip_act_order_formats(lib, fam):
    """The act-order form with bf16 8-bit zero points in groups of 32 and fp16 4-bit per-channel zero points."""
    k, n = 640, 128
    b, s, z, w = weights(k, n, fam, seed=9)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    tol = 1e-3 if fam.dtype == "f16" else 1e-2
    for cfg in FORMAT_CONFIGS:
        for m in tokens(cfg[2])[::2]:
            a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DTYPES[fam.dtype])
            check_close(run_strip(lib, fam, cfg, a, b, s, z, None, perm=perm), a[:, perm.long()].float() @ w, tol,
                        f"act-order {fam_id(fam)} {cfg} M={m}")


def test_strip_larger_k(lib):
    """K = 4096 over two strips: long runs through the register ring (8 rows ahead) and the shared-memory ring
    (24 rows, wrapping several times), one and two token blocks."""
    k, n = 4096, 128
    b, s, z, w = weights(k, n, BASE, seed=3)
    for cfg, m in (((16, 1, 1, 0), 5), ((4, 1, 1, 1), 8), ((4, 1, 2, 0), 16), ((16, 2, 2, 1), 12)):
        a = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
        check_close(run_strip(lib, BASE, cfg, a, b, s, z, None), a.float() @ w, 1e-3, f"{cfg} M={m}")


def test_strip_order_independent(lib):
    """The same bits whatever order the emulator runs the threads in (the sums meet in a fixed order: warps, then
    cluster ranks), so the GPU's schedule cannot change the result either."""
    k, n = 1152, 128
    b, s, z, w = weights(k, n, BASE, seed=5)
    a = torch.randn(4, k, generator=torch.Generator().manual_seed(1)).half()
    for cfg in ((16, 4, 1, 0), (16, 2, 2, 1), (8, 1, 1, 1)):
        first = run_strip(lib, BASE, cfg, a, b, s, z, None, seed=0)
        for seed in (1, 2, 3):
            assert torch.equal(first, run_strip(lib, BASE, cfg, a, b, s, z, None, seed=seed)), (cfg, seed)


def test_emulator_checks_loads(lib):
    """A load from memory that is not one of the launch's buffers stops the launch with an error naming it."""
    k, n = 256, 64
    b, s, z, w = weights(k, n, BASE, seed=1)
    a = torch.randn(1, k).half()
    cfg = (4, 1, 1, 0)
    ga, gs = lib.guarded(a), lib.guarded(s)
    out = lib.guarded(torch.empty(1, n, dtype=torch.float16))
    p = G.strip_params(1, n, k, 4, 1, ga, b, gs, None, None, out)  # b: not registered below
    with pytest.raises(emu.SimtError, match="outside every buffer"):
        lib.launch(K.strip_kernel_name(BASE, *cfg), p.grid, 128, 1, 0, p, [ga, gs, out])


# ---- mutations: the emulator must catch them ----

def mutated(tmp_path, cfg, old: str, new: str, count: int = 1):
    text = (emu.CUDA_SRC / "jm_strip.cuh").read_text()
    assert text.count(old) >= count, old
    lib = emu.build(sources([(BASE, cfg)]), tmp_path, headers={"jm_strip.cuh": text.replace(old, new, count)})
    return lib


def fails(lib, cfg, seeds=(0, 1, 2, 3), k=1152, n=128, m=8):
    """Whether the (mutated) kernel gives a wrong result or an emulator error for some scheduling seed."""
    b, s, z, w = weights(k, n, BASE, seed=11)
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).half()
    ref = a.float() @ w
    try:
        for seed in seeds:
            out = run_strip(lib, BASE, cfg, a, b, s, z, None, seed=seed)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-3:
                return True
    except (emu.SimtError, AssertionError):
        return True
    finally:
        lib.free_all()
    return False


def test_emulator_catches_session49_addressing(tmp_path):
    """The weights read in k-major order across strips (Marlin's), as the kernel's first GPU run did."""
    cfg = (16, 1, 1, 0)
    old_base = "reinterpret_cast<const uint4*>(p.b) + static_cast<int64_t>(strip) * k16 * kRowVecs + lane;"
    text = (emu.CUDA_SRC / "jm_strip.cuh").read_text()
    assert old_base in text and "wbase + kt * kRowVecs" in text
    text = text.replace(old_base, "reinterpret_cast<const uint4*>(p.b) + static_cast<int64_t>(strip) * kRowVecs + lane;")
    text = text.replace("wbase + kt * kRowVecs", "wbase + kt * kRowVecs * (n / 64)")
    lib = emu.build(sources([(BASE, cfg)]), tmp_path, headers={"jm_strip.cuh": text})
    assert fails(lib, cfg)
    assert not fails(emu.build(sources([(BASE, cfg)]), tmp_path / "orig"), cfg)  # the shipped text passes


def test_emulator_catches_missing_barrier(tmp_path):
    """The barrier between the warps' writes of their sums and their reads dropped: some order reads NaN."""
    cfg = (16, 1, 1, 0)
    assert fails(mutated(tmp_path, cfg, "    __syncthreads();\n    for (int i = threadIdx.x;", "    for (int i = threadIdx.x;"),
                 cfg)


def test_emulator_catches_early_ring_read(tmp_path):
    """The shared-memory ring read one cp.async group too early (the row has not landed)."""
    cfg = (8, 1, 1, 1)
    assert fails(mutated(tmp_path, cfg, "cp_async_wait_fenced<SRING - 1>()", "cp_async_wait_fenced<SRING>()"), cfg,
                 k=4096)


def test_emulator_catches_activations_read_before_the_wait(tmp_path):
    """The dense form's griddepcontrol.wait removed (the kernel before may still be writing the activations or
    reading the output): the emulator stops the launch (tests/test_simt_pdl.py has the rules)."""
    cfg = (16, 1, 1, 0)
    lib = mutated(tmp_path, cfg, "  griddep_launch_dependents();\n  griddep_wait();\n", "  griddep_launch_dependents();\n")
    b, s, z, w = weights(1152, 128, BASE, seed=1)
    with pytest.raises(emu.SimtError, match="griddepcontrol.wait"):
        run_strip(lib, BASE, cfg, torch.randn(2, 1152).half(), b, s, z, None)
    lib.free_all()


@pytest.mark.parametrize("cfg,old,new,error", [
    # rank 0 waits on a cluster barrier phase it never arrived at
    ((16, 2, 1, 0), "    cluster_arrive_release();\n", "    if (rank != 0) cluster_arrive_release();\n",
     "cluster.wait without a matching arrive"),
    # a lane leaves before the warp's first collective (since session 54 the __syncwarp after the group scales' first
    # copy, then mma.sync; the other 31 would wait forever on the GPU)
    ((4, 1, 1, 0), "  float acc[TOKS][4][4]", "  if (lane == 5) return;\n  float acc[TOKS][4][4]",
     "deadlock.*(__syncwarp|mma)"),
], ids=["unarrived-cluster-barrier", "lane-missing-from-mma"])
def test_emulator_reports_hangs(tmp_path, cfg, old, new, error):
    """What would hang a GPU is an error naming it here, not a hang."""
    lib = mutated(tmp_path, cfg, old, new)
    b, s, z, w = weights(1152, 128, BASE, seed=1)
    with pytest.raises(emu.SimtError, match=error):
        run_strip(lib, BASE, cfg, torch.randn(2, 1152).half(), b, s, z, None)
    lib.free_all()


def test_emulator_rounds_like_torch(lib):
    """The emulator's fp16 / bf16 conversions (every kernel value passes through them) give PyTorch's bits: round to
    nearest even, subnormals, overflow to infinity, NaN; and convert back exactly."""
    import ctypes

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=gen) * 10 ** torch.randint(-9, 6, (20000,), generator=gen).float(),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.9, 65520.0, -70000.0, 6.0e-8, 2.9e-8, 3.0e-8, 1e-40,
                                 float("inf"), float("-inf"), 3.4e38, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11])])
    x = x.float().contiguous()
    for dtype, flag in ((torch.float16, 0), (torch.bfloat16, 1)):
        out = torch.empty(x.numel(), dtype=torch.int16)
        back = torch.empty(x.numel())
        lib.lib.simt_round(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_void_p(back.data_ptr()), x.numel(), flag)
        want = x.to(dtype)
        assert torch.equal(out, want.view(torch.int16)), (dtype, x[out != want.view(torch.int16)][:8])
        assert torch.equal(back, want.float())
    nan = torch.tensor([float("nan")])
    out = torch.empty(1, dtype=torch.int16)
    back = torch.empty(1)
    for flag in (0, 1):
        lib.lib.simt_round(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_void_p(back.data_ptr()), 1, flag)
        assert torch.isnan(back).all()
