"""The sm_90a warpgroup-MMA kernel (cuda_src/jm_wgmma.cuh) on the CPU emulator (tests/simt): its plain form with
16- to 128-token tiles (64 and 128 read their activations by TMA), the wide four-warpgroup form, the producer form
and the two-compute-warpgroup producer form, K splits through the workspace and stream-K, through the real launch
path (gemm.launch_gemm's wgmma override: the grid, workspace, cluster and parameter struct of the GPU launch) with
the driver replaced by the emulator and the TMA descriptor by the emulator's.

The kernel passes its GPU tests on the H200 (tests/gpu/test_wgmma_gpu.py); here it checks the emulator's wgmma,
TMA and mbarrier model against that kernel, and lets a change to the kernel's logic be tested where no GPU is lent.
"""

from __future__ import annotations

import pytest
import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.quant import dequantize, pack_weights, pack_zeros, permute_scales

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

F16 = K.Family("f16", 4, False, 128)
BF16_U8 = K.Family("bf16", 8, True, 64)
# (family, NT, FW, STAGES, wide, prod): each kernel form once for fp16 4-bit, a few for bf16 8-bit zero points
FORMS = [(F16, 16, 1, 8, False, 0), (F16, 32, 1, 8, False, 0), (F16, 32, 2, 8, False, 0), (F16, 64, 1, 6, False, 0),
         (F16, 128, 1, 4, False, 0), (F16, 128, 2, 4, True, 0), (F16, 64, 1, 6, False, 1), (F16, 16, 1, 7, False, 1),
         (F16, 128, 2, 4, False, 2), (F16, 144, 1, 6, False, 2),
         (BF16_U8, 64, 1, 6, False, 0), (BF16_U8, 32, 1, 6, False, 1), (BF16_U8, 128, 2, 4, False, 2)]


def form_id(f):
    fam, nt, fw, st, wide, prod = f
    return f"{fam.dtype}-u{fam.bits}-n{nt}-f{fw}-s{st}" + ("-wide" if wide else "") + ("-prod2" if prod == 2 else
                                                                                      "-prod" if prod else "")


def source(fam, nt, fw, st, wide, prod):
    name = K.wgmma_kernel_name(fam, nt, fw, st, wide, prod)
    return name, dict(K.wgmma_build_spec(fam, (9, 0)).sources)[name]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    library = emu.build([source(*f) for f in FORMS], tmp_path_factory.mktemp("simtwg"))
    yield library
    library.free_all()


@pytest.fixture
def sm90(monkeypatch, lib):
    ws, state = emu.emulated_device(monkeypatch, lib, (9, 0))
    yield lib, ws, state
    emu.clear_launch_caches()


def weights(lib, k, n, fam, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if fam.group_size == -1 else k // fam.group_size
    q = torch.randint(0, 1 << fam.bits, (k, n), generator=gen, dtype=torch.int32)
    dt = torch.bfloat16 if fam.dtype == "bf16" else torch.float16
    s = ((torch.rand(groups, n, generator=gen) * 0.02 + 0.005) / (16 if fam.bits == 8 else 1)).to(dt)
    z = torch.randint(0, 1 << fam.bits, (groups, n), generator=gen, dtype=torch.int32) if fam.zero_points else None
    w = dequantize(q, s, z, fam.bits, fam.group_size).float()
    return (lib.guarded(pack_weights(q, fam.bits)), lib.guarded(permute_scales(s)),
            lib.guarded(pack_zeros(z, fam.bits)) if z is not None else None, w, dt)


@pytest.mark.parametrize("form", FORMS, ids=form_id)
def test_wgmma_forms_emulated(sm90, form):
    """Each form at M inside one token tile, past it (a partial last tile: rows past M as zeros) and on 4 SMs with
    K split two ways (or stream-K where the form takes it); output rows past M untouched, counters back at zero."""
    lib, ws, state = sm90
    fam, nt, fw, st, wide, prod = form
    k, n = 512, 128 * fw * 2
    b, s, z, w, dt = weights(lib, k, n, fam, seed=nt)
    tol = 1e-3 if dt == torch.float16 else 1e-2
    splits_list = (1, 2, -1) if (nt <= 64 or prod == 2) else (1, 2)
    for m in sorted({max(1, nt // 2 + 3), nt + 5}):
        for splits in splits_list:
            emu.clear_launch_caches()
            a = lib.guarded(torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt))
            full = lib.guarded(torch.full((m + 1, n), float("nan"), dtype=dt))
            out = full[:m]
            G.launch_gemm(a, b, s, z, None, out, m, n, k, fam,
                          plan_override=("wgmma", nt, fw, st, splits, wide, prod))
            ref = a.float() @ w
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < tol, f"{form_id(form)} M={m} splits={splits}: rel err {err:.3e}"
            assert torch.isnan(full[m].float()).all(), "the kernel wrote past row M"
            assert int(ws.counters.abs().sum()) == 0, "arrival counters not reset"


MUTATION_FORMS = [(F16, 64, 1, 6, False, 0), (F16, 32, 1, 8, False, 0)]  # a TMA-fed and a cp.async-fed tile


def mutated_launches(tmp_path, monkeypatch, old: str, new: str):
    """The two MUTATION_FORMS built with jm_wgmma.cuh's `old` replaced by `new`: yields (nt, launch), launch() running
    that form at M = nt - 5 through the launch path and returning (output, reference)."""
    text = (emu.CUDA_SRC / "jm_wgmma.cuh").read_text()
    assert text.count(old) == 1
    bad = emu.build([source(*f) for f in MUTATION_FORMS], tmp_path, headers={"jm_wgmma.cuh": text.replace(old, new)})
    emu.emulated_device(monkeypatch, bad, (9, 0))
    k, n = 512, 256
    b, s, z, w, dt = weights(bad, k, n, F16, seed=1)
    try:
        for _, nt, fw, st, wide, prod in MUTATION_FORMS:
            def launch(nt=nt, fw=fw, st=st, wide=wide, prod=prod):
                m = nt - 5
                emu.clear_launch_caches()
                a = bad.guarded(torch.randn(m, k).half())
                out = bad.guarded(torch.full((m, n), float("nan"), dtype=torch.float16))
                G.launch_gemm(a, b, s, z, None, out, m, n, k, F16, plan_override=("wgmma", nt, fw, st, 1, wide, prod))
                return out, a.float() @ w
            yield nt, launch
    finally:
        bad.free_all()


def test_emulator_catches_a_wrong_descriptor(tmp_path, monkeypatch):
    """The kernel's wgmma descriptor with the 8-row stride halved (512 bytes for 1024): the emulator reads the wrong
    activations and the result is wrong, on a TMA-fed and a cp.async-fed tile."""
    for nt, launch in mutated_launches(tmp_path, monkeypatch, "(1024 >> 4) << 32", "(512 >> 4) << 32"):
        out, ref = launch()
        assert not ((out.float() - ref).norm() / ref.norm()).item() < 1e-3, nt


def test_emulator_catches_activations_fetched_before_the_wait(tmp_path, monkeypatch):
    """The plain form's griddepcontrol.wait (after its early weight copies) removed: the activation copies (TMA
    boxes, or cp.async) read a buffer the kernel before may still be writing, and the emulator stops the launch
    (tests/test_simt_pdl.py has the rules)."""
    old = ("    griddep_wait();\n    if (tid == 0) JM_TL(1, globaltimer());\n    griddep_launch_dependents();\n"
           "#pragma unroll\n    for (int s = 0; s < STAGES - 1; s++) {\n      if (s < k_tiles) fetch_acts(s, s);")
    for nt, launch in mutated_launches(tmp_path, monkeypatch, old, old.replace("    griddep_wait();\n", "", 1)):
        with pytest.raises(emu.SimtError, match="griddepcontrol.wait"):
            launch()


def test_producer_l2_lead_in_range_and_harmless(tmp_path, monkeypatch):
    """The producer form's optional L2 lead (-DJM_WG_L2_AHEAD, session 56's A/B switch; off by default): built with a
    lead of 3 stages the producer forms give the plain build's bits at whole K and split in two, and every bulk
    prefetch lies inside the weights (the emulator checks range, alignment and size); without the clip to the piece's
    stages the last strip's prefetch runs past the buffer and the emulator says so."""
    text = (emu.CUDA_SRC / "jm_wgmma.cuh").read_text()
    off, on, clip = "#define JM_WG_L2_AHEAD 0", "#define JM_WG_L2_AHEAD 3", "          i1 = i1 < k_tiles ? i1 : k_tiles;\n"
    assert text.count(off) == 1 and text.count(clip) == 1
    forms = [(F16, 64, 1, 6, False, 1), (F16, 16, 1, 7, False, 1), (BF16_U8, 32, 1, 6, False, 1)]

    def run(lib, form, m, splits):
        fam, nt, fw, st, wide, prod = form
        k, n = 1024, 256
        b, s, z, w, dt = weights(lib, k, n, fam, seed=nt)
        emu.clear_launch_caches()
        a = lib.guarded(torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt))
        out = lib.guarded(torch.full((m, n), float("nan"), dtype=dt))
        G.launch_gemm(a, b, s, z, None, out, m, n, k, fam, plan_override=("wgmma", nt, fw, st, splits, wide, prod))
        return out.clone(), a.float() @ w

    lead = emu.build([source(*f) for f in forms], tmp_path / "lead", headers={"jm_wgmma.cuh": text.replace(off, on)})
    plain = emu.build([source(*f) for f in forms], tmp_path / "plain")
    try:
        for form in forms:
            for splits in (1, 2):
                m = form[1] - 3
                emu.emulated_device(monkeypatch, lead, (9, 0))
                got, ref = run(lead, form, m, splits)
                tol = 1e-3 if form[0] is F16 else 1e-2
                assert ((got.float() - ref).norm() / ref.norm()).item() < tol, (form_id(form), splits)
                emu.emulated_device(monkeypatch, plain, (9, 0))
                assert torch.equal(got, run(plain, form, m, splits)[0]), (form_id(form), splits)
    finally:
        lead.free_all()
        plain.free_all()
        emu.clear_launch_caches()
    unclipped = emu.build([source(*forms[0])], tmp_path / "unclipped",
                          headers={"jm_wgmma.cuh": text.replace(off, on).replace(clip, "")})
    emu.emulated_device(monkeypatch, unclipped, (9, 0))
    try:
        with pytest.raises(emu.SimtError, match="bulk.prefetch"):
            run(unclipped, forms[0], 61, 1)
    finally:
        unclipped.free_all()
        emu.clear_launch_caches()
