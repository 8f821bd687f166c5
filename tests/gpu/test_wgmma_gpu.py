"""The sm_90a warpgroup-MMA GEMM (by default: MoE blocks of 32, 64 and 128 rows, dense M in [9, 1024]):
outputs vs x @ dequant(W) on every format the dense op takes and every compiled config, output
buffers poisoned with NaN first; the routes through marlin_gemm (JITMARLIN_WGMMA=1 / 0 / unset) and
the MoE layer (against the mma.sync MoE kernel). Runs only on compute capability 9.0."""

from __future__ import annotations

import functools

import os

import pytest
import torch

import jitmarlin
from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G

from .helpers import check_close, random_weights

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the wgmma kernel is built for sm_90a (H100/H200) only"),
]

@pytest.fixture(autouse=True)
def _fresh_env_flags():
    """The switches are read once per process (K.env_flag); these tests flip them."""
    K.env_flag.cache_clear()
    yield
    K.env_flag.cache_clear()


FORMATS = [  # (dtype, bits, group, zero points)
    (torch.float16, 4, 128, False), (torch.bfloat16, 4, 128, False), (torch.float16, 4, 64, True),
    (torch.float16, 8, -1, False), (torch.bfloat16, 8, 32, True), (torch.float16, 4, -1, True),
]


def run(a, packed, m, n, k, dtype, cfg=None, bias=None):
    # the op's rule: one group of scales over all of K is per channel (permute_scales leaves it as is)
    group = -1 if packed.scales.shape[0] == 1 else packed.group_size
    fam = K.Family(K.DTYPES[dtype], packed.bits, packed.zeros is not None, group)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    G.launch_gemm(a, packed.b, packed.scales, packed.zeros, bias, out, m, n, k, fam,
                  plan_override=("wgmma",) + (cfg or (None, None, None)))
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_formats(fmt):
    dtype, bits, group, zp = fmt
    k, n = 1024, 768
    packed, w = random_weights(k, n, bits, group, zp, dtype)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for m in (1, 9, 17, 32, 64, 100, 128, 257):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        for cfg in K.WGMMA_CONFIGS:
            if n % (128 * cfg[1]):
                continue
            check_close(run(a, packed, m, n, k, dtype, cfg), a.float() @ w, tol, f"M={m} config={cfg}")
    n = 1024  # two strips per warpgroup need N % 256
    packed, w = random_weights(k, n, bits, group, zp, dtype, seed=1)
    a = torch.randn(200, k, device="cuda", dtype=dtype)
    for cfg in K.WGMMA_CONFIGS:
        check_close(run(a, packed, 200, n, k, dtype, cfg), a.float() @ w, tol, f"N={n} config={cfg}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_k_splits(fmt):
    """Split-K: each output tile is the sum of `splits` CTAs' partials over runs of K (uneven runs:
    80 stages in 3 or 7), the bias added once; a second run is bit-identical (fixed summation
    order whichever CTA arrives last) and the arrival counters are all zero afterwards."""
    dtype, bits, group, zp = fmt
    k, n = 5120, 512
    packed, w = random_weights(k, n, bits, group, zp, dtype, seed=2)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (1, 64, 100, 257):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = a.float() @ w + bias.float()
        for cfg in K.WGMMA_CONFIGS:
            if n % (128 * cfg[1]):
                continue
            for splits in (2, 3, 7):
                out = run(a, packed, m, n, k, dtype, cfg + (splits,), bias=bias)
                check_close(out, ref, tol, f"M={m} config={cfg} splits={splits}")
                again = run(a, packed, m, n, k, dtype, cfg + (splits,), bias=bias)
                assert torch.equal(out, again), (m, cfg, splits)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="K splits"):
        run(a, packed, 1, n, k, dtype, K.WGMMA_CONFIGS[0] + (k // 64 + 1,))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_stream_k(fmt):
    """Stream-K (splits=-1): the tiles' stages cut evenly over the resident CTA slots. Shapes where
    a tile is cut over many CTAs (K=4096, N=2560: ~5 stages per CTA), where CTAs cross tile
    boundaries (K=1024, N=28672) and where CTAs also hold whole tiles in the middle of their run
    (M=200: 448 tiles); the bias is added once; a second run is bit-identical and the counters are
    all zero afterwards."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for k, n, ms in ((4096, 2560, (17, 64)), (1024, 28672, (33, 200))):
        packed, w = random_weights(k, n, bits, group, zp, dtype, seed=4)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = a.float() @ w + bias.float()
            for cfg in K.WGMMA_CONFIGS:
                if cfg[0] > 64 or n % (128 * cfg[1]) or cfg[0] < m // 4:
                    continue
                out = run(a, packed, m, n, k, dtype, cfg + (-1,), bias=bias)
                check_close(out, ref, tol, f"K={k} N={n} M={m} config={cfg} stream-K")
                again = run(a, packed, m, n, k, dtype, cfg + (-1,), bias=bias)
                assert torch.equal(out, again), (k, n, m, cfg)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="stream-K"):
        run(a, packed, m, n, k, dtype, (128, 1, 4, -1))


def test_stream_k_route_in_a_cuda_graph():
    """The heuristic takes stream-K where whole tiles fill the SMs badly (8192x28672 at M=64 on 132
    SMs: 112 tiles); captured and replayed equals eager, and new inputs give the right result."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, n, m = 8192, 28672, 64
    fam = K.Family(K.DTYPES[torch.float16], 4, False, 128)
    nt, fw, _ = G.wgmma_config(m, n, sms, k)
    tiles = -(-m // nt) * (n // (128 * fw))
    if not G.wgmma_stream_grid(tiles, k, nt, fw, sms):
        pytest.skip(f"{sms} SMs: {tiles} tiles fill them without stream-K")
    assert G.wgmma_launch(m, n, k, fam, 0).splits == -1
    _graph_equals_eager(m, n, k, fam)


def _graph_equals_eager(m, n, k, fam):
    """The automatic wgmma launch of (M, N, K), fp16 4-bit g128: eager matches the reference (and
    sizes the workspace); captured and replayed equals eager; new inputs copied into the captured
    buffer give the right result."""
    packed, w = random_weights(k, n, 4, 128)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    G.launch_wgmma(a, packed.b, packed.scales, None, None, out, m, n, k, fam, 0)
    eager = out.clone()
    check_close(eager, a.float() @ w, 1e-3, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.launch_wgmma(a, packed.b, packed.scales, None, None, out, m, n, k, fam, 0)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, eager)
    a.copy_(torch.randn(m, k, device="cuda", dtype=torch.float16))
    graph.replay()
    check_close(out, a.float() @ w, 1e-3, "replay with new inputs")


def test_k_splits_in_a_cuda_graph():
    """The automatic split count on a narrow shape (few output tiles): captured and replayed equals
    eager, on fresh inputs copied into the captured buffer."""
    k, n, m = 8192, 1024, 64
    fam = K.Family(K.DTYPES[torch.float16], 4, False, 128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nt, fw, _ = G.wgmma_config(m, n, sms)
    assert G.wgmma_splits(-(-m // nt) * (n // (128 * fw)), k, nt, fw, sms) > 1  # the case under test
    _graph_equals_eager(m, n, k, fam)


def test_capture_of_a_new_split_shape_needs_no_growth():
    """After any eager split launch the workspace holds wgmma_split_bound floats, so a CUDA graph of
    another split shape captures without growing it (growth during capture is refused)."""
    fam = K.Family(K.DTYPES[torch.float16], 4, False, 128)
    packed, _ = random_weights(2048, 1024, 4, 128)
    a = torch.randn(64, 2048, device="cuda", dtype=torch.float16)
    out = torch.empty(64, 1024, device="cuda", dtype=torch.float16)
    G.launch_wgmma(a, packed.b, packed.scales, None, None, out, 64, 1024, 2048, fam, 0)
    ws = K.default_workspace(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert ws.ws.numel() >= G.wgmma_split_bound(sms)
    k, n, m = 11008, 4096, 300  # a larger split launch, first seen inside the capture (on 132 SMs since session
    packed2, w2 = random_weights(k, n, 4, 128, seed=3)  # 39 the 128-token stream-K of two-warpgroup CTAs, whose
    a2 = torch.randn(m, k, device="cuda", dtype=torch.float16)  # two regions per CTA are the bound)
    out2 = torch.empty(m, n, device="cuda", dtype=torch.float16)
    assert G.wgmma_launch(m, n, k, fam, 0).splits not in (0, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.launch_wgmma(a2, packed2.b, packed2.scales, None, None, out2, m, n, k, fam, 0)
    graph.replay()
    check_close(out2, a2.float() @ w2, 1e-3, "captured first")


@pytest.fixture
def wide_configs(monkeypatch):
    """Build the wide (four-warpgroup) form of the two-strip 64/128-token configs for this test, and
    their two-warpgroup form (128-token tiles: not in the built set since session 16)."""
    monkeypatch.setattr(K, "WGMMA_WIDE_CONFIGS", ((64, 2, 4), (128, 2, 4)))
    monkeypatch.setattr(K, "WGMMA_CONFIGS", tuple(dict.fromkeys(K.WGMMA_CONFIGS + K.WGMMA_WIDE_CONFIGS)))
    yield from _rebuilt(K.WGMMA_WIDE_CONFIGS)


def _rebuilt(configs):
    """Fixture body: the build specs and launches recomputed for the patched config lists, and again
    after the test (monkeypatch restores the lists)."""
    K.wgmma_build_spec.cache_clear()
    G.wgmma_launch.cache_clear()
    yield configs
    K.wgmma_build_spec.cache_clear()
    G.wgmma_launch.cache_clear()


def _form_cases(fmt, shapes, seed):
    """The cases of the form tests: for each (K, N, Ms) random weights of format fmt and a bias, then per
    M random activations and the reference (fp32, with bias): yields (k, n, m, a, packed, bias, ref)."""
    dtype, bits, group, zp = fmt
    for k, n, ms in shapes:
        packed, w = random_weights(k, n, bits, group, zp, dtype, seed=seed)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            yield k, n, m, a, packed, bias, a.float() @ w + bias.float()


def _check_form(a, packed, m, n, k, dtype, cfg, bias, ref, tol, label):
    """Config `cfg` in its other form (the flag appended to cfg: wide or producer) matches the
    reference and equals the plain form bit for bit."""
    other = run(a, packed, m, n, k, dtype, cfg + (True,), bias=bias)
    check_close(other, ref, tol, f"K={k} N={n} M={m} config={cfg} {label}")
    assert torch.equal(other, run(a, packed, m, n, k, dtype, cfg, bias=bias)), (k, n, m, cfg)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_wide_form(fmt, wide_configs):
    """The wide form (512 threads, four warpgroups of one strip) of a two-strip config: whole tiles,
    uneven K splits and stream-K, M with partial token tiles, bias; bit-identical to the two-warpgroup
    kernel of the same config (the same arithmetic per strip), NaN-poisoned outputs, counters back
    to zero; asking for a wide kernel that is not built is a clear error."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = ((5120, 512, (17, 64, 100, 257)), (1024, 2048, (33, 128, 300)))
    for k, n, m, a, packed, bias, ref in _form_cases(fmt, shapes, seed=7):
        for nt, fw, st in wide_configs:
            # stream-K only with at least one stage per CTA (wgmma_launch refuses fewer)
            stream = -(-m // nt) * (n // (128 * fw)) * (k // 64) >= sms
            for splits in ((None, 3, -1) if nt == 64 and stream else (None, 3)):
                _check_form(a, packed, m, n, k, dtype, (nt, fw, st, splits), bias, ref, tol, "wide")
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    with pytest.raises(ValueError, match="no wide"):
        G.wgmma_launch(64, 1024, 1024, fam, 0, 64, 1, 6, None, True)


# NT-FW-STAGES[-CTAS]: CTAs per SM 2 unless given (3: K.WGMMA_PROD_CTAS)
PROD_TEST_CONFIGS = tuple(tuple(int(v) for v in c.split("-")) for c in os.environ.get(
    "JM_PROD_TEST_CONFIGS", "16-1-8,32-1-8,64-1-6,16-2-8,32-2-6,32-1-6-3,16-1-7-3").split(","))


@pytest.fixture
def prod_configs(monkeypatch):
    """Build the producer form (a producer warpgroup issues every copy, the activations by TMA at
    every token tile, one compute warpgroup of two or four strips; K.WGMMA_PROD_CONFIGS) of 16- to
    64-token configs for this test, and their plain form for the comparison."""
    configs = tuple(c[:3] for c in PROD_TEST_CONFIGS)
    monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS", configs)
    monkeypatch.setattr(K, "WGMMA_PROD_CTAS", {c[:3]: c[3] for c in PROD_TEST_CONFIGS if len(c) > 3})
    monkeypatch.setattr(K, "WGMMA_CONFIGS", tuple(dict.fromkeys(K.WGMMA_CONFIGS + configs)))
    yield from _rebuilt(K.WGMMA_PROD_CONFIGS)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_producer_form(fmt, prod_configs):
    """The producer form matches the reference: whole tiles, uneven K splits, stream-K with pieces
    crossing tiles (where every CTA gets a stage), M with partial token tiles (TMA fills rows past M
    with zeros), bias; NaN-poisoned outputs; counters back to zero; 256 threads per CTA; an unbuilt
    producer config is a clear error. Two strips (fw = 1) at two CTAs per SM: bit-identical to the
    plain kernel of the same config (the same arithmetic per strip, the same split-K order). Four
    strips (fw = 2) or three CTAs per SM: one accumulator set where the plain 32-token kernel keeps
    two (NACC), so the fp32 sums round differently; so do kernels of which only one applies group
    scales to the sums (K.wgmma_scales_on_sums: e.g. the 64-token producer form of g64 / g128);
    there each result must repeat bit for bit instead."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = ((5120, 512, (9, 64, 100, 257)), (1024, 28672, (33, 200)))
    for k, n, m, a, packed, bias, ref in _form_cases(fmt, shapes, seed=9):
        for nt, fw, st in prod_configs:
            if nt < m // 4 or (k == 1024 and nt == 128 and m < 100):
                continue
            assert G.wgmma_launch(m, n, k, fam, 0, nt, fw, st, None, False, True).threads == 256
            stages = -(-m // nt) * (n // (128 * fw)) * (k // 64)
            ctas = K.prod_ctas((nt, fw, st))
            for splits in (None, 3) + ((-1,) if stages >= ctas * sms else ()):
                cfg = (nt, fw, st, splits, False)
                same_scaling = (K.wgmma_scales_on_sums(bits, group, nt, ctas, prod=True, fw=fw, zp=zp, dtype=fam.dtype)
                                == K.wgmma_scales_on_sums(bits, group, nt, fw=fw, zp=zp, dtype=fam.dtype))
                if fw == 1 and ctas == 2 and same_scaling:
                    _check_form(a, packed, m, n, k, dtype, cfg, bias, ref, tol, "producer form")
                else:  # four strips, three CTAs per SM, or group scales on the sums in one form only
                    got = run(a, packed, m, n, k, dtype, cfg + (True,), bias=bias)
                    check_close(got, ref, tol, f"K={k} N={n} M={m} config={cfg} ctas={ctas} producer form")
                    assert torch.equal(got, run(a, packed, m, n, k, dtype, cfg + (True,), bias=bias)), (k, n, m, cfg)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="no producer-form"):
        G.wgmma_launch(64, 1024, 1024, fam, 0, 64, 2, 4, None, False, True)
    assert G.wgmma_launch(32, 28672, 8192, fam, 0, 32, 2, 6, None, False, True).grid == 2 * 112  # 2 CTAs per SM


def test_producer_form_route():
    """The automatic config takes the producer form of (64, 1, 6) at M = 33-64, of (32, 1, 6) at
    three CTAs per SM at M = 17-32 (4-bit) and of (16, 1, 8) at M = 9-16 (fp16 8-bit) on large problems
    only (4-bit: on the shapes of G.WGMMA_PROD_N16_U4, some with (16, 1, 7) at three CTAs per SM), and that
    launch is what the public op runs there
    (checked against the reference)."""
    fam = K.Family("f16", 4, False, 128)
    for m, n, k, want in ((64, 28672, 8192, 64), (33, 8192, 28672, 64), (64, 8192, 8192, 0), (64, 4096, 4096, 0),
                          (32, 28672, 8192, 32), (17, 8192, 8192, 32), (17, 4096, 4096, 0), (16, 28672, 8192, 0),
                          (128, 28672, 8192, 0)):  # (M = 129-1024: the tall tiles' two-compute-warpgroup form)
        wl = G.wgmma_launch(m, n, k, fam, 0)
        assert wl.prod == (1 if want else 0), (m, n, k)
        assert not want or (wl.nt, wl.fw, wl.stages, wl.threads) == (want, 1, 6, 256), (m, n, k)
    assert not G.wgmma_launch(32, 28672, 8192, K.Family("f16", 8, False, 128), 0).prod
    k, n = 8192, 8320  # K*N above 2^26, N not a multiple of 256
    packed, w = random_weights(k, n, 4, 128, False, torch.float16, seed=3)
    for m in (17, 32, 33, 64):
        assert G.wgmma_launch(m, n, k, fam, 0).prod and G.use_wgmma_path(m, n, k, fam, 0)
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"M={m} routed producer")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wl = G.wgmma_launch(32, 28672, 8192, fam, 0)  # 224 tiles on 3 x 132 CTA slots: stream-K over all
    assert (wl.splits, wl.grid) == (-1, 3 * sms) and K.prod_ctas((32, 1, 6)) == 3
    # the routed three-CTA kernel through the public op, stream-K pieces across tiles
    _routed_op_matches(4096, 28672, 4, (17, 24, 32), 4, "routed three-CTA producer")
    # fp16 8-bit weights at M = 9-16 from K*N = 2^26 with N >= 8192: the 16-token producer form (session 21)
    f8 = K.Family("f16", 8, False, 128)
    for m, n, k, want in ((9, 28672, 4096, True), (16, 8192, 8192, True), (16, 4096, 14336, False),
                          (16, 28672, 4096, True)):
        assert G.use_wgmma_path(m, n, k, f8, 0) is want, (m, n, k)
        if want:
            wl = G.wgmma_launch(m, n, k, f8, 0)
            assert wl.prod and (wl.nt, wl.fw, wl.stages, wl.threads) == (16, 1, 8, 256), (m, n, k)
    assert not G.use_wgmma_path(16, 28672, 4096, K.Family("bf16", 8, False, 128), 0)
    _routed_op_matches(4096, 28672, 8, (9, 13, 16), 6, "routed 8-bit 16-token producer")
    # 4-bit weights at M = 9-16 on the shapes listed in G.WGMMA_PROD_N16_U4 (sessions 37 / 38): fp16 and bf16;
    # stages 7: the three-CTA build (16, 1, 7), 96 tiles x as many K splits as 3 CTAs per SM hold (4 on 132 SMs)
    sp = min(4, 3 * sms // 96)
    for dtype, k, n, stages in (("f16", 8192, 8192, 8), ("f16", 4096, 11008, 8), ("f16", 11008, 4096, 8),
                                ("f16", 4096, 12288, 7), ("f16", 4096, 28672, 0), ("bf16", 4096, 11008, 8),
                                ("bf16", 4096, 12288, 7), ("bf16", 8192, 8192, 0)):
        f4 = K.Family(dtype, 4, False, 128)
        for m in (9, 16):
            assert G.use_wgmma_path(m, n, k, f4, 0) is bool(stages), (dtype, m, n, k)
            if stages:
                wl = G.wgmma_launch(m, n, k, f4, 0)
                assert wl.prod and (wl.nt, wl.fw, wl.stages, wl.threads) == (16, 1, stages, 256), (dtype, m, n, k)
                assert stages == 8 or (wl.splits, wl.grid) == (sp, 96 * sp), (dtype, m, n, k, wl.splits, wl.grid)
    _routed_op_matches(11008, 4096, 4, (9, 12, 16), 7, "routed 4-bit 16-token producer")
    _routed_op_matches(4096, 11008, 4, (9, 16), 8, "routed 4-bit 16-token producer")
    _routed_op_matches(4096, 12288, 4, (9, 13, 16), 10, "routed 4-bit 16-token producer, three CTAs per SM")
    ta = torch.bfloat16
    for k, n in ((4096, 11008), (4096, 12288)):
        packed, w = random_weights(k, n, 4, 128, False, ta, seed=9)
        for m in (9, 16):
            a = torch.randn(m, k, device="cuda", dtype=ta)
            out = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
            check_close(out, a.float() @ w, 1e-2, f"M={m} {k}x{n} bf16 routed 4-bit 16-token producer")
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0


def _routed_op_matches(k, n, bits, ms, seed, label):
    """marlin_gemm on fp16 weights of `bits` (g128) at each M of ms: matches the reference (fp32), and a
    second call is bit-identical."""
    packed, w = random_weights(k, n, bits, 128, False, torch.float16, seed=seed)
    for m in ms:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        out = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
        check_close(out, a.float() @ w, 1e-3, f"M={m} {label}")
        assert torch.equal(out, jitmarlin.marlin_gemm(a, packed.b, packed.scales)), m


@pytest.mark.parametrize("k,n", [(1408, 512), (1536, 512), (1152, 768), (1920, 256)])
def test_few_stages_per_cta(k, n):
    """Small K and N at M = 17-64 (a few tiles of under 32 stages each): the route never runs
    stream-K with CTAs that hold no stage (session 19: K=1408 N=512 M=24 left such CTAs inside a
    tile's span, so the tile was never summed: NaN outputs, counters left set, later launches'
    sums corrupted). Outputs match the reference (NaN-poisoned before each launch), repeated calls
    and the public op are bit-identical, counters end at zero; a forced stream-K launch with fewer
    stages than CTAs is a clear error."""
    fam = K.Family("f16", 4, False, 128)
    packed, w = random_weights(k, n, 4, 128, False, torch.float16, seed=5)
    for m in (17, 24, 32, 33, 64):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        wl = G.wgmma_launch(m, n, k, fam, 0)
        assert wl.splits != -1 or wl.m_tiles * (n // (128 * wl.fw)) * (k // 64) >= wl.grid * G.WGMMA_SPLIT_MIN_STAGES
        out = run(a, packed, m, n, k, torch.float16)
        check_close(out, a.float() @ w, 1e-3, f"K={k} N={n} M={m} route")
        for _ in range(3):
            assert torch.equal(run(a, packed, m, n, k, torch.float16), out), (k, n, m)
        assert torch.equal(jitmarlin.marlin_gemm(a, packed.b, packed.scales), out), (k, n, m)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="at least one 64-k stage per CTA"):
        G.wgmma_launch(24, 512, 1408, fam, 0, 32, 1, 8, -1)


@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 11008), (11008, 4096), (5120, 13824), (128, 128)])
def test_shapes(k, n):
    packed, w = random_weights(k, n, 4, 128 if k % 128 == 0 else -1)
    for m in (64, 65, 512, 1024):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        for cfg in [None] + [c for c in K.WGMMA_CONFIGS if n % (128 * c[1]) == 0]:
            check_close(run(a, packed, m, n, k, torch.float16, cfg, bias=bias),
                        a.float() @ w + bias.float(), 1e-3, f"M={m} config={cfg}")


def test_route_through_the_op(monkeypatch):
    calls = []
    orig = G.launch_wgmma
    monkeypatch.setattr(G, "launch_wgmma", lambda *args, **kw: (calls.append(args[6]), orig(*args, **kw))[1])
    k, n = 2048, 1024
    packed, w = random_weights(k, n, 4, 128)
    for setting, want in (("1", [64, 300, 2048]), ("0", [])):
        monkeypatch.setenv("JITMARLIN_WGMMA", setting)
        K.env_flag.cache_clear()
        calls.clear()
        for m in (64, 300, 2048):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"M={m}")
        assert calls == want, (setting, calls)
    monkeypatch.delenv("JITMARLIN_WGMMA")  # default: M in [33, 1024] here
    K.env_flag.cache_clear()
    calls.clear()
    k, n = 4096, 28672
    packed, w = random_weights(k, n, 4, 128)
    for m in (64, 256, 1024, 1025):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"M={m}")
    assert calls == [64, 256, 1024]  # (session 16: up to 1024; 1025 dequantizes for cuBLAS)
    calls.clear()
    packed, w = random_weights(4096, 4096, 4, 128)  # narrow: the K split fills the GPU
    for m in (8, 9, 16, 17, 32, 63, 128, 511, 512, 1024, 1025):
        a = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"M={m}")
    assert calls == [9, 16, 17, 32, 63, 128, 511, 512, 1024]  # 16-token tiles from M = 9 on this small matrix
    calls.clear()
    packed, w = random_weights(8192, 28672, 8, 128)  # 8-bit: 32-token tiles at M = 17-32, and since
    for m in (8, 16, 17, 32):  # session 21 (fp16, K*N >= 2^26, N >= 8192) the 16-token producer form at M = 9-16
        a = torch.randn(m, 8192, device="cuda", dtype=torch.float16)
        check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"8-bit M={m}")
    assert calls == [16, 17, 32]
    with pytest.raises(ValueError, match="N % 128"):
        packed2, _ = random_weights(256, 192, 4, 128)
        run(torch.randn(64, 256, device="cuda", dtype=torch.float16), packed2, 64, 192, 256, torch.float16)


@pytest.mark.parametrize("fw", [1, 2])
@pytest.mark.parametrize("kw", [dict(), dict(act_order=True), dict(dtype=torch.bfloat16), dict(bits=8, group=64)],
                         ids=["f16", "act-order", "bf16", "u8-g64"])
def test_moe_blocks_of_64(monkeypatch, fw, kw):
    """The MoE variant (blocks of 64 rows: many tokens per expert) against the mma.sync MoE kernel,
    through the whole layer, at token counts that fill the last block of an expert partly; 1024
    tokens (256 rows per expert) take blocks of 128 (one strip per warpgroup)."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    monkeypatch.setattr(M, "_launch_wgmma_moe", functools.partial(M._launch_wgmma_moe, fw=fw))
    # (these small experts at 64 rows would take the producer form's blocks of 80 by moe.small_cover, which has no
    # two-strip-per-warpgroup config: off here, this test is about the plain form's blocks of 64)
    monkeypatch.setattr(M, "WGMMA_COVER_SMALL_MIN_ROWS", float("inf"))
    moe, _, _ = make_moe(8, 1024, 512, 2, **kw)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for t in (257, 1024):
        x = torch.randn(t, 1024, device="cuda", dtype=dtype)
        monkeypatch.setenv("JITMARLIN_WGMMA", "0")
        K.env_flag.cache_clear()
        want = moe(x)
        for setting in ("auto", "1"):  # wgmma blocks of 64, of 128 at 1024 tokens
            if setting == "auto":
                monkeypatch.delenv("JITMARLIN_WGMMA")
            else:
                monkeypatch.setenv("JITMARLIN_WGMMA", setting)
            K.env_flag.cache_clear()
            got = moe(x)
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol, (t, setting)


@pytest.mark.parametrize("kw", [dict(), dict(act_order=True), dict(dtype=torch.bfloat16), dict(bits=8, group=64)],
                         ids=["f16", "act_order", "bf16", "u8g64"])
def test_moe_blocks_of_32(monkeypatch, kw):
    """Blocks of 16 / 24 / 32 rows on the wgmma kernel (small experts: 4-bit 16 at 7.8-13 rows per expert, 24 to 19
    and 32 up to 29.5, 8-bit 32 at 9-25): the layer's output against the mma.sync MoE kernel (JITMARLIN_WGMMA=0), and the
    route taken."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    blocks = []
    orig = M._launch_wgmma_moe
    monkeypatch.setattr(M, "_launch_wgmma_moe", lambda *a, **k: (blocks.append(a[14]), orig(*a, **k))[1])
    moe, _, _ = make_moe(8, 1024, 512, 2, **kw)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for t in (40, 56, 64, 95):  # 10, 14, 16, 23.75 rows per expert
        x = torch.randn(t, 1024, device="cuda", dtype=dtype)
        monkeypatch.setenv("JITMARLIN_WGMMA", "0")
        K.env_flag.cache_clear()
        want = moe(x)
        monkeypatch.delenv("JITMARLIN_WGMMA")
        K.env_flag.cache_clear()
        blocks.clear()
        got = moe(x)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol, t
        # (4-bit at 10 rows: blocks of 16 on the producer form since session 37, WGMMA_16_ROWS_SMALL_U4)
        b = 32 if kw.get("bits", 4) == 8 or t == 95 else 16 if t == 40 else 24
        assert blocks == [b, b], (t, blocks)


def test_act_order_gemm_on_the_wgmma_route_pdl_rule(monkeypatch):
    """After the act-order gather the wgmma kernel launches without PDL on K*N <= 2^24 and as a
    programmatic dependent above (benchmarks/NOTES.md, session 15), plain calls keep PDL; results
    are A[:, perm] @ W and A @ W."""
    seen = []
    orig = G.launch_wgmma
    monkeypatch.setattr(G, "launch_wgmma", lambda *a, **kw: (seen.append(kw.get("pdl", True)), orig(*a, **kw))[1])
    monkeypatch.delenv("JITMARLIN_WGMMA", raising=False)
    K.env_flag.cache_clear()
    for k, n, ms, after_gather in ((4096, 4096, (16, 32, 64), False), (8192, 4096, (32, 64), True)):
        seen.clear()
        packed, w = random_weights(k, n, 4, 128, seed=5)
        perm = torch.randperm(k, device="cuda").to(torch.int32)
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales, perm=perm), a[:, perm.long()].float() @ w,
                        1e-3, f"act-order M={m}")
            check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"M={m}")
        assert seen == [after_gather, True] * len(ms), (k, n, seen)


@pytest.fixture(params=[1, 2], ids=["fw1", "fw2"])
def moe_prod_fw(request, monkeypatch):
    """Strips per warpgroup pair of the MoE producer form: 1 (the built (32, 1, 6)), or 2 (four strips,
    (32, 2, 6) built for this test: moe.MOE_WGMMA_PROD_FW)."""
    from jitmarlin.ops import moe as M

    if request.param == 2:
        monkeypatch.setattr(K, "WGMMA_MOE_PROD_CONFIGS", ((32, 2, 6),) + K.WGMMA_MOE_PROD_CONFIGS)
        monkeypatch.setattr(M, "MOE_WGMMA_PROD_FW", 2)
    yield from _rebuilt(request.param)


def _routed_case(moe, w13, w2, t, skew, dtype):
    """Random tokens for the layer, routed by its router (skew: every token to experts 3 and 5, so that
    they hold several blocks each and six experts none), and the reference output: (x, weights, ids, want)."""
    from .test_moe_gpu import reference

    x = torch.randn(t, 1024, device="cuda", dtype=dtype)
    weights, ids = moe.route(x)
    if skew:
        ids = torch.tensor([[3, 5]] * t, device="cuda", dtype=ids.dtype)
    return x, weights, ids, reference(x, w13, w2, weights, ids, dtype)


def _poisoned_moe_layer(moe, dtype, block_size=None):
    """fused_marlin_moe on the layer's experts (block_size None: its own rule), with 32 MB of NaN
    allocated and freed first: the caching allocator hands that memory out next, so an output row
    left unwritten shows."""
    from jitmarlin.ops import moe as M

    def layer(x, weights, ids):
        torch.full((1 << 24,), float("nan"), device="cuda", dtype=dtype)
        return M.fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, weights, ids,
                                  w13_zeros=moe.w13_qzeros, w2_zeros=moe.w2_qzeros, w13_perm=moe.w13_perm,
                                  w2_perm=moe.w2_perm, block_size=block_size)
    return layer


@pytest.mark.parametrize("kw", [dict(), dict(act_order=True), dict(dtype=torch.bfloat16), dict(bits=8, group=64),
                                dict(group=-1)], ids=["f16", "act_order", "bf16", "u8g64", "gc"])
def test_moe_producer_form(monkeypatch, kw, moe_prod_fw):
    """The MoE kernel's producer form (session 25; blocks of 32 rows, both GEMMs' inputs gathered in
    slot-list order so that a block's rows are one TMA box; two or four strips on its compute
    warpgroup) against the plain-PyTorch reference and the plain wgmma MoE kernel, with random and
    skewed routing (two experts take every token: several blocks each, six experts empty) and
    act-order experts; the output memory poisoned with NaN first."""
    from .test_moe_gpu import check_graph_replays, make_moe

    from jitmarlin.ops import moe as M

    launched = []
    get = K.get_wgmma_kernel

    def spy(fam, nt, fw, stages, index, wide=False, prod=False):
        launched.append((nt, prod) if not prod else (nt, prod, fw))
        return get(fam, nt, fw, stages, index, wide, prod)

    monkeypatch.setattr(K, "get_wgmma_kernel", spy)
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)  # (these experts are small: the route's size rule off)
    moe, w13, w2 = make_moe(8, 1024, 512, 2, **kw)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2

    layer = _poisoned_moe_layer(moe, dtype)

    # 10 / 16 / 23.75 rows per expert (since session 33 4-bit experts this small take blocks of 8 below 9.5 rows,
    # and the rule's 16 (4-bit at 10 rows, session 37) / 24 fall back to 32 here, where MOE_WGMMA_PROD_BLOCKS
    # leaves them out)
    for t, skew in ((40, False), (64, False), (95, False), (64, True)):
        x, weights, ids, want = _routed_case(moe, w13, w2, t, skew, dtype)
        monkeypatch.setattr(M, "MOE_WGMMA_PROD_BLOCKS", ())
        launched.clear()
        plain = layer(x, weights, ids)
        assert launched == [(32, False), (32, False)], (t, launched)
        monkeypatch.setattr(M, "MOE_WGMMA_PROD_BLOCKS", (32,))
        launched.clear()
        got = layer(x, weights, ids)
        torch.cuda.synchronize()
        assert launched == [(32, True, moe_prod_fw), (32, True, moe_prod_fw)], (t, launched)
        check_close(got, want, tol, f"producer form, T={t}, skewed={skew}")
        check_close(got, plain, tol, f"producer form vs plain kernel, T={t}")
    graph_x = torch.randn(64, 1024, device="cuda", dtype=dtype)  # CUDA graph: capture, replay on new tokens
    check_graph_replays(moe, w13, w2, graph_x, 2, tol, "producer form in a CUDA graph")
    if not kw:  # torch.compile of the layer on the producer-form route: as eager
        cmoe = torch.compile(moe)
        for _ in range(2):
            check_close(cmoe(graph_x), moe(graph_x).float(), tol, "producer form under torch.compile")


@pytest.mark.parametrize("kw", [dict(), dict(act_order=True), dict(dtype=torch.bfloat16), dict(bits=8, group=64),
                                dict(group=-1)], ids=["f16", "act_order", "bf16", "u8g64", "gc"])
@pytest.mark.parametrize("form", ["plain32", "prod32", "plain64"])
def test_moe_down_splits(monkeypatch, kw, form):
    """The down projection split along K (moe.MOE_DOWN_SPLITS: fp32 partial sums per split, added by the
    top-k sum) on the plain wgmma MoE kernel (blocks of 32 and 64) and its producer form, against the
    reference and the unsplit layer; splits that do not divide K's stages evenly, every stage its own
    split; random and skewed routing; output memory poisoned with NaN first; CUDA-graph replays."""
    from .test_moe_gpu import check_graph_replays, make_moe

    from jitmarlin.ops import moe as M

    launched = []
    orig = M._launch_wgmma_moe

    def spy(*a, **kw2):
        launched.append(kw2.get("k_splits", 1))
        return orig(*a, **kw2)

    monkeypatch.setattr(M, "_launch_wgmma_moe", spy)
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_BLOCKS", (32,) if form == "prod32" else ())
    bs = 64 if form == "plain64" else 32
    moe, w13, w2 = make_moe(8, 1024, 512, 2, **kw)  # the down projection: K = 512, 8 stages
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2

    layer = _poisoned_moe_layer(moe, dtype, bs)

    for t, skew in ((37, False), (64, False), (64, True)):
        x, weights, ids, want = _routed_case(moe, w13, w2, t, skew, dtype)
        monkeypatch.setattr(M, "MOE_DOWN_SPLITS", 1)
        whole = layer(x, weights, ids)
        for splits in (2, 3, 8):
            monkeypatch.setattr(M, "MOE_DOWN_SPLITS", splits)
            launched.clear()
            got = layer(x, weights, ids)
            torch.cuda.synchronize()
            assert launched == [1, splits], (t, splits, launched)
            assert got.dtype == dtype and got.shape == x.shape
            check_close(got, want, tol, f"{form} down projection in {splits} K splits, T={t}, skewed={skew}")
            check_close(got, whole, tol, f"{form} {splits} K splits vs unsplit, T={t}")
    monkeypatch.setattr(M, "MOE_DOWN_SPLITS", 3)
    if bs == 32:  # (the module routes its own block size: 4-bit blocks of 24 at 16 rows per expert since session 33)
        check_graph_replays(moe, w13, w2, torch.randn(64, 1024, device="cuda", dtype=dtype), 2, tol,
                            f"{form} K splits in a CUDA graph")


def test_moe_gemm_k_splits_op():
    """moe_gemm_ready_tables with k_splits: [splits, T*k, N] fp32 partial sums whose sum is the unsplit
    output; the rule's bounds and the blocks it takes as clear errors."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    moe, _, _ = make_moe(8, 1024, 512, 2)
    t, top_k = 64, 2
    x = torch.randn(t * top_k, 512, device="cuda", dtype=torch.float16)
    ids = torch.randint(0, 8, (t, top_k), device="cuda", dtype=torch.int32)
    tw = torch.rand(t * top_k, device="cuda")
    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, 32, 8)
    args = (x, moe.w2_qweight, moe.w2_scales, None, sorted_ids, expert_ids, num_padded, tw, t * top_k, 1, 32)
    op = torch.ops.jitmarlin.moe_gemm_ready_tables
    whole = op(*args)
    for splits in (2, 5, 8):
        part = op(*args, False, 0, 0, splits)
        assert part.dtype == torch.float32 and part.shape == (splits, t * top_k, 1024)
        check_close(part.sum(0), whole.float(), 1e-3, f"{splits} K splits summed")
        summed = M.topk_sum(part, t, top_k, torch.float16)
        check_close(summed, whole.view(t, top_k, -1).float().sum(1), 1e-3, f"topk_sum of {splits} splits")
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"k_splits={bad} must be in"):
            op(*args, False, 0, 0, bad)
    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, 128, 8)
    with pytest.raises(ValueError, match="blocks of 32 or 64 rows"):
        op(x, moe.w2_qweight, moe.w2_scales, None, sorted_ids, expert_ids, num_padded, tw, t * top_k, 1, 128,
           False, 0, 0, 2)


@pytest.mark.parametrize("kw", [dict(), dict(act_order=True), dict(dtype=torch.bfloat16), dict(bits=8, group=64),
                                dict(group=-1)], ids=["f16", "act_order", "bf16", "u8g64", "gc"])
def test_moe_stream_k(monkeypatch, kw):
    """The MoE producer form's stream-K launch (moe.MOE_STREAM_K: every resident CTA an even run of all
    tiles' stages over the blocks that hold rows, tiles cut between CTAs summed through the workspace)
    against the reference and the whole-tile launch: random and skewed routing, fewer stages than CTAs
    (the CTAs past them take none), output memory poisoned with NaN first, repeat calls identical
    (fixed summation order), the arrival counters all zero after each launch, CUDA-graph replays."""
    from .test_moe_gpu import check_graph_replays, make_moe

    from jitmarlin.ops import moe as M

    grids = []
    _spy_wgmma_launches(monkeypatch, lambda grid, p: grids.append((grid, p.k_splits)))
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for e, top_k, cases in ((8, 2, ((37, False), (64, False), (64, True))), (2, 1, ((20, False),))):
        moe, w13, w2 = make_moe(e, 1024, 512, top_k, **kw)

        layer = _poisoned_moe_layer(moe, dtype, 32)

        for t, skew in cases:  # E=2, 20 tokens: 2 blocks x 8 feature tiles x 8 stages < the CTAs
            x, weights, ids, want = _routed_case(moe, w13, w2, t, skew, dtype)
            monkeypatch.setattr(M, "MOE_STREAM_K", False)
            grids.clear()
            whole = layer(x, weights, ids)
            assert len(grids) == 2 and all(s == 1 for _, s in grids), grids  # whole tiles
            monkeypatch.setattr(M, "MOE_STREAM_K", True)
            grids.clear()
            got = layer(x, weights, ids)
            again = layer(x, weights, ids)
            torch.cuda.synchronize()
            # both GEMMs, twice, on every resident CTA slot (4-bit: K.prod_ctas, four per SM since session 32;
            # 8-bit: two, its stages do not fit three)
            per_sm = 2 if kw.get("bits") == 8 else K.prod_ctas((32, 1, 6), 4, moe=True)
            assert grids == [(per_sm * sms, -1)] * 4, (t, grids)
            check_close(got, want, tol, f"stream-K, E={e}, T={t}, skewed={skew}")
            check_close(got, whole, tol, f"stream-K vs whole tiles, E={e}, T={t}")
            assert torch.equal(got, again), "stream-K sums in a fixed order: repeat calls are identical"
            assert not K.default_workspace(x.device).counters.any(), "arrival counters left non-zero"
    graph_x = torch.randn(64, 1024, device="cuda", dtype=dtype)
    moe, w13, w2 = make_moe(8, 1024, 512, 2, **kw)
    check_graph_replays(moe, w13, w2, graph_x, 2, tol, "stream-K in a CUDA graph")


def _spy_wgmma_launches(monkeypatch, record):
    """K.get_wgmma_kernel wrapped so that every launch of its kernels first calls record(grid, params)."""
    orig = K.get_wgmma_kernel

    def spy(fam, nt, fw, stages, index, wide=False, prod=False):
        fn = orig(fam, nt, fw, stages, index, wide, prod)

        class Spy:
            def __getattr__(self, name):
                return getattr(fn, name)

            def launch(self, grid, *a, **kw2):
                record(grid, a[3])
                return fn.launch(grid, *a, **kw2)
        return Spy()

    monkeypatch.setattr(K, "get_wgmma_kernel", spy)


def _layer_graph_replays(layer, moe, w13, w2, dtype, tol, what):
    """The layer (x, weights, ids) -> out captured in a CUDA graph on 48 tokens, replayed twice on new tokens
    and routing, each replay against the reference; returns the last (x, weights, ids)."""
    from .test_moe_gpu import reference

    x = torch.randn(48, 1024, device="cuda", dtype=dtype)
    weights, ids = moe.route(x)
    layer(x, weights, ids)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x, weights, ids)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        w_new, ids_new = moe.route(x)
        weights.copy_(w_new)
        ids.copy_(ids_new)
        g.replay()
        torch.cuda.synchronize()
        check_close(y, reference(x, w13, w2, weights, ids, dtype), tol, what)
    return x, weights, ids


@pytest.mark.parametrize("kw", [dict(), dict(act_order=True), dict(dtype=torch.bfloat16), dict(bits=8, group=64),
                                dict(group=-1)], ids=["f16", "act_order", "bf16", "u8g64", "gc"])
@pytest.mark.parametrize("nt", [16, 24, 48, 80, 96])
def test_moe_producer_blocks(monkeypatch, kw, nt):
    """Expert blocks of 16 / 24 / 48 / 80 / 96 rows (m64nNTk16 on the producer form; 16 for 4-bit weights only,
    8-bit blocks of 16 take the mma.sync kernel) against the reference and blocks of 32: random and skewed
    routing (several blocks per expert), stream-K on and off, output memory poisoned with NaN first, a CUDA
    graph replayed on new tokens and routing; blocks of 24 / 80 / 96 where the producer form cannot take them
    are a clear error, blocks of 16 / 48 there take the mma.sync kernel."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    launched = []
    get = K.get_wgmma_kernel

    def spy(fam, nt, fw, stages, index, wide=False, prod=False):
        launched.append((nt, prod))
        return get(fam, nt, fw, stages, index, wide, prod)

    monkeypatch.setattr(K, "get_wgmma_kernel", spy)
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)  # (small experts: both GEMMs' inputs gathered anyway)
    bits = kw.get("bits", 4)
    prod = M.wgmma_prod_moe_config(nt, 1, bits) is not None
    assert nt in M.MOE_WGMMA_PROD_BLOCKS and prod == (nt != 16 or bits == 4)
    moe, w13, w2 = make_moe(8, 1024, 512, 2, **kw)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    layer_nt, layer32 = _poisoned_moe_layer(moe, dtype, nt), _poisoned_moe_layer(moe, dtype, 32)
    for t, skew in ((37, False), (64, False), (64, True), (200, False), (200, True)):
        x, weights, ids, want = _routed_case(moe, w13, w2, t, skew, dtype)
        b32 = layer32(x, weights, ids)
        for stream in (True, False):
            monkeypatch.setattr(M, "MOE_STREAM_K", stream)
            launched.clear()
            got = layer_nt(x, weights, ids)
            torch.cuda.synchronize()
            assert launched == ([(nt, True), (nt, True)] if prod else []), (t, launched)
            check_close(got, want, tol, f"blocks of {nt}, T={t}, skewed={skew}, stream-K {stream}")
            check_close(got, b32, tol, f"blocks of {nt} vs 32, T={t}")
    # a CUDA graph of the layer on these blocks, replayed on new tokens and routing
    x, weights, ids = _layer_graph_replays(layer_nt, moe, w13, w2, dtype, tol, f"blocks of {nt} in a CUDA graph")
    # these blocks with A not gathered by position: a clear error, not a launch (48: the mma.sync kernel)
    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, nt, 8)
    args = (x, moe.w13_qweight, moe.w13_scales, moe.w13_qzeros, sorted_ids, expert_ids, num_padded, None, 48 * 2, 2, nt)
    if nt in M.PROD_ONLY_BLOCKS:
        with pytest.raises(ValueError, match=f"block_size={nt} needs the sm_90a wgmma MoE kernel's producer form"):
            M.moe_gemm(*args)
    else:
        launched.clear()
        got = M.moe_gemm(*args)
        assert launched == [], launched
        if moe.w13_perm is None:  # (act-order experts read their input in each expert's column order)
            slot_w = w13[ids.reshape(-1).long()]  # [T*k, 2I, H]: each slot's expert
            want = torch.einsum("sh,sih->si", x.float().repeat_interleave(2, 0), slot_w)
            check_close(got, want, tol, f"blocks of {nt} (mma.sync) without gathered rows")


@pytest.mark.parametrize("bits", [4, 8])
def test_moe_blocks_of_16_route(monkeypatch, bits):
    """Large experts (K*N above MOE_WGMMA_PROD_MIN_KN) at 7.2-12 rows per expert: the rule's blocks of 16 run
    both GEMMs on the producer form (inputs gathered, the gate/up GEMM with the SiLU epilogue) for 4-bit
    weights and on the mma.sync kernel for 8-bit; output against the reference, NaN-poisoned memory first."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wgmma kernels run on sm_90 only")
    launched = []
    _spy_wgmma_launches(monkeypatch, lambda grid, p: launched.append((p.grid, p.silu_out)))
    e, h, inter, top_k = 4, 4096, 2304, 2  # the gate/up experts: 4608 x 4096 = 18.9M weights > 2^24
    assert 2 * inter * h > M.MOE_WGMMA_PROD_MIN_KN
    moe, w13, w2 = make_moe(e, h, inter, top_k, bits=bits, group=128)
    layer = _poisoned_moe_layer(moe, torch.float16)
    for t in (16, 20):  # 8 / 10 rows per expert
        assert M.choose_block_size(t, top_k, e) == 16
        assert M.choose_block_size(t, top_k, e, True, 2 * inter * h, bits=bits) == 16
        _blocks_of_16_case(moe, w13, w2, layer, launched, t, bits == 4, f"blocks of 16, {bits}-bit, T={t}")


def _blocks_of_16_case(moe, w13, w2, layer, launched, t, prod, label):
    """One routed call of `layer` on t random tokens (w13: the fp32 experts [E, 2I, H]): both GEMMs launched as
    blocks of 16 on the producer form (the gate/up GEMM with the SiLU epilogue) when `prod` is True, no wgmma
    launch when False, either when None; output against the reference."""
    from .test_moe_gpu import reference

    e, h = w13.shape[0], w13.shape[2]
    x = torch.randn(t, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x)
    launched.clear()
    got = layer(x, weights, ids)
    torch.cuda.synchronize()
    m_tiles = -(-(t * ids.shape[1] + e * 15) // 16)  # the launch's bound of blocks of 16
    if prod is not None:
        assert launched == ([(m_tiles, 1), (m_tiles, 0)] if prod else []), (t, launched)
    check_close(got, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, label)


@pytest.mark.parametrize("bits", [4, 8])
def test_moe_small_blocks_of_16_route(monkeypatch, bits):
    """Small experts (K*N <= 2^24) with moe.WGMMA_16_ROWS_SMALL_U4's range (the default since session 37): at 8-12 rows per
    expert the rule's blocks of 16 run both GEMMs on the producer form (inputs gathered, the gate/up GEMM with
    the SiLU epilogue) for 4-bit weights; 8-bit weights keep their rule (no blocks of 16 on the wgmma kernel);
    output against the reference, NaN-poisoned memory first."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wgmma kernels run on sm_90 only")
    monkeypatch.setattr(M, "WGMMA_16_ROWS_SMALL_U4", (7.8, 13.0))
    launched = []
    _spy_wgmma_launches(monkeypatch, lambda grid, p: launched.append((p.grid, p.silu_out)))
    e, h, inter, top_k = 8, 1024, 512, 2  # gate/up experts of 1024 x 1024 weights: small
    moe, w13, w2 = make_moe(e, h, inter, top_k, bits=bits, group=128)
    layer = _poisoned_moe_layer(moe, torch.float16)
    for t in (32, 40, 48):  # 8 / 10 / 12 rows per expert
        assert M.small_block16(t * top_k / e, 2 * inter * h, bits) == (bits == 4)
        if bits == 4:
            assert M.choose_block_size(t, top_k, e, True, 2 * inter * h, bits=bits) == 16
        _blocks_of_16_case(moe, w13, w2, layer, launched, t, True if bits == 4 else None,
                           f"small blocks of 16, {bits}-bit, T={t}")


@pytest.mark.parametrize("kw", [dict(), dict(dtype=torch.bfloat16), dict(act_order=True), dict(bits=8, group=64)],
                         ids=["f16", "bf16", "act_order", "u8g64"])
def test_moe_ready_tables_early_weights(monkeypatch, kw):
    """Both expert GEMMs on the producer form launch with p.tables_ready = 1 (the gate/up GEMM after
    jm_moe_gather, which lets it launch only after its own wait for the alignment; the down projection by
    moe_gemm_ready_tables) and stream their first weight stages before waiting for the kernel before them
    (moe.MOE_PROD_EARLY_WEIGHTS, MOE_W13_READY_TABLES). The layer's output is bit-identical with the switch
    off and matches the reference, eagerly and replayed in a CUDA graph (where the launches overlap), for
    blocks of 16 (4-bit) / 24 / 32 / 48 and stream-K on and off."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the wgmma kernels run on sm_90 only")
    seen = []
    _spy_wgmma_launches(monkeypatch, lambda grid, p: seen.append((p.silu_out, p.tables_ready)))
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)  # (small experts: both GEMMs' inputs gathered anyway)
    moe, w13, w2 = make_moe(8, 1024, 512, 2, **kw)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for nt in ((16,) if kw.get("bits", 4) == 4 else ()) + (24, 32, 48):
        layer = _poisoned_moe_layer(moe, dtype, nt)
        for t, skew in ((37, False), (64, True), (200, False)):
            x, weights, ids, want = _routed_case(moe, w13, w2, t, skew, dtype)
            for stream in (True, False):
                monkeypatch.setattr(M, "MOE_STREAM_K", stream)
                outs = {}
                for early in (False, True):
                    monkeypatch.setattr(M, "MOE_PROD_EARLY_WEIGHTS", early)
                    seen.clear()
                    outs[early] = layer(x, weights, ids)
                    torch.cuda.synchronize()
                    assert [r for _, r in seen] == [int(early)] * 2, (nt, t, seen)  # gate/up, down
                check_close(outs[True], want, tol, f"early weights, blocks of {nt}, T={t}, stream-K {stream}")
                assert torch.equal(outs[True], outs[False]), f"blocks of {nt}, T={t}: early vs waiting first"
            monkeypatch.setattr(M, "MOE_W13_READY_TABLES", False)  # the gate/up GEMM waits first
            seen.clear()
            assert torch.equal(layer(x, weights, ids), outs[True])
            torch.cuda.synchronize()
            assert [r for _, r in seen] == [0, 1], (nt, t, seen)
            monkeypatch.setattr(M, "MOE_W13_READY_TABLES", True)
        _layer_graph_replays(layer, moe, w13, w2, dtype, tol, f"early weights, blocks of {nt}, in a CUDA graph")


@pytest.mark.parametrize("kw", [dict(), dict(dtype=torch.bfloat16), dict(bits=8, group=64), dict(group=-1)],
                         ids=["f16", "bf16", "u8g64", "gc"])
def test_moe_silu_epilogue(monkeypatch, kw):
    """SiLU-mul in the gate/up GEMM's epilogue (moe_gemm_silu, the producer form writing SiLU(gate) * up by
    position) against the two-kernel path it replaces (the GEMM's [slots, 2I] output, then jm_silu_gather) on
    every position below num_padded: bit for bit with whole tiles, within rounding with stream-K (its cuts
    fall elsewhere in the remapped strips); blocks of (4-bit: 16 /) 24 / 32 / 48 rows, random and skewed routing (experts
    with several blocks, empty experts), the output poisoned with NaN first; the layer with it
    (fused_marlin_moe, moe.MOE_SILU_EPILOGUE) against the layer without (equal with whole tiles) and the
    plain-PyTorch reference, also replayed in a CUDA graph; launched with silu_out = 1; blocks
    the producer form does not take are a clear error."""
    from .test_moe_gpu import make_moe

    from jitmarlin.ops import moe as M

    silu_flags = []
    _spy_wgmma_launches(monkeypatch, lambda grid, p: silu_flags.append(p.silu_out))
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)  # (small experts: the producer route's size rule off)
    e, h, inter, top_k = 8, 1024, 512, 2
    moe, w13, w2 = make_moe(e, h, inter, top_k, **kw)
    dtype = kw.get("dtype", torch.float16)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    wq, ws = moe.w13_qweight, moe.w13_scales
    for nt in ((16,) if kw.get("bits", 4) == 4 else ()) + (24, 32, 48):  # (16: 4-bit producer form only)
        layer = _poisoned_moe_layer(moe, dtype, nt)
        for t, skew in ((37, False), (64, False), (64, True), (200, True)):
            x, weights, ids, want = _routed_case(moe, w13, w2, t, skew, dtype)
            sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, nt, e)
            a1 = M.gather_by_position(x, sorted_ids, expert_ids, num_padded, None, top_k, nt)
            assert M.silu_epilogue_ok(a1, wq, ws, None, t * top_k, nt)
            npad = int(num_padded.item())
            for stream in (True, False):
                monkeypatch.setattr(M, "MOE_STREAM_K", stream)
                c1 = M.moe_gemm(a1, wq, ws, None, sorted_ids, expert_ids, num_padded, None, t * top_k, top_k, nt,
                                True)
                two = M.silu_gather_by_position(c1, inter, sorted_ids, expert_ids, num_padded, None, nt)
                torch.full((1 << 24,), float("nan"), device="cuda", dtype=dtype)  # poison the next allocation
                silu_flags.clear()
                one = torch.ops.jitmarlin.moe_gemm_silu(a1, wq, ws, sorted_ids, expert_ids, num_padded, t * top_k,
                                                        top_k, nt)
                torch.cuda.synchronize()
                assert silu_flags == [1], silu_flags
                assert one.shape == (sorted_ids.numel(), inter) and one.dtype == dtype
                assert not one[:npad].isnan().any(), f"blocks of {nt}, T={t}: positions left unwritten"
                if stream:  # stream-K cuts a CTA's tile where it cuts the plain GEMM's tile of other strips: the
                    # fp32 sums are added in another order, so equal up to rounding
                    check_close(one[:npad], two[:npad].float(), tol, f"SiLU epilogue vs two kernels, blocks of "
                                f"{nt}, T={t}, stream-K")
                else:  # whole tiles: the same sums, rounded alike, through the same formula
                    assert torch.equal(one[:npad], two[:npad]), \
                        (nt, t, skew, (one[:npad].float() - two[:npad].float()).abs().max().item())
                monkeypatch.setattr(M, "MOE_SILU_EPILOGUE", False)
                silu_flags.clear()
                off = layer(x, weights, ids)
                assert silu_flags == [0, 0], silu_flags
                monkeypatch.setattr(M, "MOE_SILU_EPILOGUE", True)
                silu_flags.clear()
                on = layer(x, weights, ids)
                torch.cuda.synchronize()
                assert silu_flags == [1, 0], silu_flags  # the gate/up GEMM with the epilogue, then the down GEMM
                if stream:
                    check_close(on, off.float(), tol, f"layer with / without the epilogue, blocks of {nt}, T={t}")
                else:
                    assert torch.equal(on, off), (nt, t, skew)
                check_close(on, want, tol, f"SiLU epilogue, blocks of {nt}, T={t}, skewed={skew}, stream-K {stream}")
    # the layer in a CUDA graph, replayed on new tokens and routing
    x, weights, ids = _layer_graph_replays(_poisoned_moe_layer(moe, dtype, 32), moe, w13, w2, dtype, tol,
                                           "SiLU epilogue in a CUDA graph")
    # blocks of 64 (the plain wgmma form): a clear error, not a launch
    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, 64, e)
    a1 = M.gather_by_position(x, sorted_ids, expert_ids, num_padded, None, top_k, 64)
    silu_flags.clear()
    with pytest.raises(ValueError, match="moe_gemm_silu needs the sm_90a wgmma MoE kernel's producer form"):
        torch.ops.jitmarlin.moe_gemm_silu(a1, wq, ws, sorted_ids, expert_ids, num_padded, 48 * top_k, top_k, 64)
    assert silu_flags == []


@pytest.fixture
def prod2_configs(monkeypatch):
    """Build the producer form with two compute warpgroups (K.WGMMA_PROD2_CONFIGS: one CTA per SM, 384 threads)
    of a 128- (the routed one since session 39) and a 64-token config for this test."""
    monkeypatch.setattr(K, "WGMMA_PROD2_CONFIGS", ((128, 2, 4), (64, 2, 6)))
    yield from _rebuilt(K.WGMMA_PROD2_CONFIGS)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_producer_form_two_warpgroups(fmt, prod2_configs):
    """The producer form with two compute warpgroups of two strips (256 features per CTA, 384 threads, one
    CTA per SM; prepared in session 38 for stream-K at 128 tokens, which the other 128-token kernels cannot
    run without spilling their accumulators): whole tiles, uneven K splits, stream-K with pieces crossing
    tiles (where every CTA gets a stage), M with partial token tiles (TMA zero rows), bias; NaN-poisoned
    outputs match the reference and repeat bit for bit; counters back to zero; an unbuilt config is a clear
    error."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = ((5120, 512, (33, 64, 100, 257)), (1024, 28672, (65, 200, 256)))
    for k, n, m, a, packed, bias, ref in _form_cases(fmt, shapes, seed=11):
        for nt, fw, st in prod2_configs:
            if nt < m // 4:
                continue
            wl = G.wgmma_launch(m, n, k, fam, 0, nt, fw, st, None, False, 2)
            assert wl.threads == 384 and wl.prod == 2, (nt, wl)
            stages = -(-m // nt) * (n // (128 * fw)) * (k // 64)
            for splits in (1, 3) + ((-1,) if stages >= sms else ()):
                cfg = (nt, fw, st, splits, False, 2)
                got = run(a, packed, m, n, k, dtype, cfg, bias=bias)
                check_close(got, ref, tol, f"K={k} N={n} M={m} config={cfg} two-warpgroup producer form")
                assert torch.equal(got, run(a, packed, m, n, k, dtype, cfg, bias=bias)), (k, n, m, cfg)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="no two-compute-warpgroup producer-form"):
        G.wgmma_launch(128, 1024, 1024, fam, 0, 128, 2, 6, None, False, 2)
    # stream-K at 128 tokens: one region pair per CTA of 256 x 64 floats (grid = the SMs)
    wl = G.wgmma_launch(256, 28672, 8192, fam, 0, 128, 2, 4, -1, False, 2)
    assert (wl.grid, wl.splits) == (sms, -1) and wl.ws[0] >= 2 * sms * 256 * 2 * 64


def _built_dense_forms(bits):
    """Every dense wgmma kernel a family builds by default, as the `cfg` tails run() takes: (nt, fw, stages, form
    flags...) for the plain configs, the wide ones, the producer form and its two-compute-warpgroup form."""
    forms = [c + (None,) for c in K.WGMMA_CONFIGS]
    forms += [c + (None, True) for c in K.WGMMA_WIDE_CONFIGS]
    forms += [c + (None, False, True) for c in K.dense_prod_configs(bits)]
    forms += [c + (None, False, 2) for c in K.WGMMA_PROD2_CONFIGS]
    return forms


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[4]], ids=("float16-u4-g128", "bfloat16-u8-g32-zp"))
def test_partial_last_tile_box(fmt):
    """Session 40: the plain form's partial last token tile with under NT / 2 rows of its own reads the NT / 2 rows
    before M as well and writes only its own rows (TMA boxes mostly past M ran up to 1.6x slower on the H200);
    the other forms keep their box at the tile's first row. Every dense kernel built by
    default, M on both sides of each tile boundary (one row into a tile, a quarter, half a tile, one row short of whole
    tiles, a single partial tile, whole tiles), one K split, three and stream-K where the form runs it with a stage
    per CTA:
    NaN-poisoned outputs match the reference with bias and repeat bit for bit; an activation row changed after
    the call changes only its own output row on the next call (no row of the previous tile is written from the
    shifted one with other data)."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, n = 2048, 1024
    packed, w = random_weights(k, n, bits, group, zp, dtype, seed=17)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    checked = 0
    for nt, fw, st, _, *form in _built_dense_forms(bits):
        for m in sorted({nt - 1, nt + 1, nt + nt // 4, nt + nt // 2, 2 * nt + 1, 3 * nt - 1, 2 * nt}):
            if m < 9 or m > 4 * 128:
                continue
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = a.float() @ w + bias.float()
            stages = -(-m // nt) * (n // (128 * fw)) * (k // 64)
            # CTAs per SM: the producer form's own count, one for the wide and two-compute-warpgroup forms
            ctas = K.prod_ctas((nt, fw, st), bits) if form == [False, True] else 1 if form or fw == 2 else 2
            stream = (nt <= 64 or form == [False, 2]) and stages >= ctas * sms  # (plain 128-token tiles: never)
            for splits in (1, 3) + ((-1,) if stream else ()):
                cfg = (nt, fw, st, splits, *form)
                got = run(a, packed, m, n, k, dtype, cfg, bias=bias)
                check_close(got, ref, tol, f"M={m} config={cfg}")
                assert torch.equal(got, run(a, packed, m, n, k, dtype, cfg, bias=bias)), (m, cfg)
                checked += 1
            if m > nt and m % nt:  # where the plain form's box moves back, its first rows belong to the tile before
                row = (m // nt) * nt - 1
                a2 = a.clone()
                a2[row] = torch.randn(k, device="cuda", dtype=dtype)
                cfg = (nt, fw, st, 1, *form)
                before, after = run(a, packed, m, n, k, dtype, cfg, bias=bias), run(a2, packed, m, n, k, dtype, cfg, bias=bias)
                changed = (before != after).any(dim=1).nonzero().flatten().tolist()
                assert changed == [row], (m, cfg, changed)
    assert checked >= 60, checked
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0


# (M, N, K): where the route's whole 128-token tiles fill the 132 SMs of an H100 / H200 poorly (session 39:
# ctas / (sms * rounds) under G.WGMMA_STREAM2_MAX_FILL) and where they do not
STREAM2_ROUTED = ((384, 12288, 4096), (100, 22016, 8192), (300, 4096, 11008), (256, 22016, 4096), (384, 8192, 28672))
STREAM2_NOT = ((512, 12288, 4096), (1024, 8192, 8192), (256, 28672, 8192), (128, 4096, 14336), (384, 4096, 4096),
               (256, 12288, 4096))  # (the last: 47 stages per stream-K CTA, under G.WGMMA_STREAM2_MIN_STAGES)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_two_warpgroup_stream_k_route(fmt):
    """Session 39: where whole 128-token tiles fill the SMs poorly (G.wgmma_route_stream2) the automatic launch
    is the two-compute-warpgroup producer form (128, 2, 4) running stream-K over one CTA per SM. Through the
    public op (general path and a layer's cache of launches: MarlinLinear's gemm_fast) NaN-poisoned outputs
    match the reference with bias, at M with a partial token tile too, repeat bit for bit, and the counters
    end at zero; elsewhere the route is unchanged."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k in STREAM2_ROUTED + STREAM2_NOT:
        want = G.wgmma_route_stream2(m, n, k, G.wgmma_route_config(m, n, k, sms), fam, sms)
        assert want is ((m, n, k) in STREAM2_ROUTED) or sms != 132, (m, n, k, want)
        wl = G.wgmma_launch(m, n, k, fam, 0)
        tall = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), fam, sms)
        if tall is not None:  # the tall-tile rule (sessions 41-42) goes first
            assert (wl.prod, wl.nt, wl.fw) == (2,) + tall[0][:2], (m, n, k, wl)
            continue
        assert (wl.prod == 2) is want, (m, n, k, wl)
        if want:
            assert (wl.nt, wl.fw, wl.stages, wl.splits, wl.threads, wl.grid) == (128, 2, 4, -1, 384, sms), wl
            assert wl.ws[0] == G.wgmma_split_bound(sms)  # two regions of 256 x 128 floats per CTA: the bound
    shapes = ((4096, 12288, (340, 384)), (11008, 4096, (257,)))
    for k, n, m, a, packed, bias, ref in _form_cases(fmt, shapes, seed=13):
        assert G.wgmma_launch(m, n, k, fam, 0).prod == 2 or sms != 132, (k, n, m)
        assert G.use_wgmma_path(m, n, k, fam, 0), (k, n, m)
        got = run(a, packed, m, n, k, dtype, bias=bias)  # the automatic launch, output poisoned with NaN
        check_close(got, ref, tol, f"K={k} N={n} M={m} routed 128-token stream-K")
        assert torch.equal(got, run(a, packed, m, n, k, dtype, bias=bias)), (k, n, m)
        op = jitmarlin.marlin_gemm(a, packed.b, packed.scales, packed.zeros, bias)
        assert torch.equal(op, got), (k, n, m)
        fast = G.FastGemm()
        for _ in range(2):  # the entry built, then reused
            out = G.gemm_fast(fast, a, packed.b, packed.scales, packed.zeros, bias)
            assert out is not None and torch.equal(out, got), (k, n, m)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0


# (K, N): {M: (NT, FW)} of the tall-tile route: every tile of the table (G.WGMMA_TALL_ROUTE, M <= 256) and the cost
# model (above)
TALL_CASES = {
    (8192, 16384): {129: (144, 2), 150: (160, 2), 160: (160, 2)},  # K*N = 2^27: the two-strip tiles
    (4096, 28672): {129: (144, 2), 160: (160, 2)},  # K*N > 2^26 and N >= 24576: the two-strip tiles (session 44)
    (4096, 12288): {129: (144, 1), 144: (144, 1), 176: (192, 1), 192: (192, 1), 200: (208, 1), 224: (224, 1),
                    240: (240, 1), 256: (256, 1), 288: (160, 2), 512: (256, 1), 780: (208, 1), 850: (224, 1)},
    (4096, 4096): {300: (176, 1), 600: (176, 1), 700: (176, 1), 800: (208, 1)},  # (from 257: the cost model)
    (8192, 2048): {160: (144, 1), 257: (144, 1), 300: (176, 1), 384: (192, 1)},  # two 192-token tiles from K = 8192
    (2048, 2048): {192: (144, 1)},  # two 144-token tiles at M = 145-192 where N <= 2560 (session 47)
    (2048, 1024): {400: (144, 1), 700: (144, 1), 1000: (144, 1)},  # three to seven 144-token tiles
}  # (session 47's refit of the cost model prices the 144-token tile: 8192x2048 M = 257 and 2048x1024 take it;
#     session 48 built the 176- / 208- / 224- / 240-token tiles: rows of 208-240 at M = 193-256, the model above)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_tall_token_tile_route(fmt):
    """Sessions 41-44: where the route would run 128-token tiles (M = 129-1024) it runs the two-compute-warpgroup
    producer form with tiles of 144-256 tokens (G.wgmma_route_tall: the table's rows to M = 256, the
    cost model above), stream-K or whole tiles / K splits. The launch it picks in cells of every tile, and none where
    neither picks one; through the public op and a layer's cache of launches NaN-poisoned outputs match the reference with
    bias, repeat bit for bit, and the counters end at zero."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = tuple((k, n, tuple(ms)) for (k, n), ms in TALL_CASES.items())
    seen = set()
    for k, n, m, a, packed, bias, ref in _form_cases(fmt, shapes, seed=23):
        nt, fw = TALL_CASES[(k, n)][m]
        tall = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), fam, sms)
        assert tall is not None and tall[0][:2] == (nt, fw), (k, n, m, tall)
        splits = tall[1]
        wl = G.wgmma_launch(m, n, k, fam, 0)
        assert (wl.prod, wl.nt, wl.fw, wl.stages, wl.m_tiles, wl.threads, wl.splits) == (
            2, nt, fw, tall[0][2], -(-m // nt), 384, splits), (k, n, m, wl)
        seen.add((nt, fw, splits == -1, wl.m_tiles > 1))
        got = run(a, packed, m, n, k, dtype, bias=bias)  # the automatic launch, output poisoned with NaN
        check_close(got, ref, tol, f"K={k} N={n} M={m} tall tile {nt} x {fw}")
        assert torch.equal(got, run(a, packed, m, n, k, dtype, bias=bias)), (k, n, m)
        if not G.use_wgmma_path(m, n, k, fam, 0):  # (bf16 8-bit above WGMMA_BF16_U8_MAX_M: the op runs mma.sync)
            assert dtype == torch.bfloat16 and bits == 8 and m > G.WGMMA_BF16_U8_MAX_M, (k, n, m)
            continue
        op = jitmarlin.marlin_gemm(a, packed.b, packed.scales, packed.zeros, bias)
        assert torch.equal(op, got), (k, n, m)
        fast = G.FastGemm()
        for _ in range(2):
            out = G.gemm_fast(fast, a, packed.b, packed.scales, packed.zeros, bias)
            assert out is not None and torch.equal(out, got), (k, n, m)
    # every built tall tile ran: the table's, and the cost model's 176-token one (no row of its own, session 48)
    built = {(nt, fw) for nt, fw, _ in K.WGMMA_PROD2_CONFIGS if nt > 128}
    assert {c.tile[:2] for c in G.WGMMA_TALL_ROUTE} <= built == {(nt, fw) for nt, fw, _, _ in seen}, seen
    assert {multi for *_, multi in seen} == {True, False}, seen
    if sms == 132:  # H200: 4096x12288 M = 512 runs stream-K, the others whole tiles or K splits
        assert {sk for *_, sk, _ in seen} == {True, False}, seen
    for m, n, k in ((128, 12288, 4096), (100, 12288, 4096), (200, 4096, 4096), (300, 11008, 4096),
                    (600, 12288, 4096), (896, 4608, 3584)):  # 128-token tiles, no row of the table, the model's none
        assert G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), fam, sms) is None, (m, n, k)
        assert G.wgmma_launch(m, n, k, fam, 0).nt <= 128, (m, n, k)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0


def test_tall_token_tile_route_in_a_cuda_graph():
    """The routed tall token tile (session 41) captured in a CUDA graph equals eager and gives the right result
    on new inputs."""
    m, n, k = 160, 12288, 4096
    fam = K.Family("f16", 4, False, 128)
    wl = G.wgmma_launch(m, n, k, fam, 0)
    assert (wl.prod, wl.nt) == (2, 192), wl
    _graph_equals_eager(m, n, k, fam)


def test_two_warpgroup_stream_k_route_in_a_cuda_graph():
    """The routed 128-token stream-K launch (session 39) captured in a CUDA graph equals eager and gives the
    right result on new inputs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k = 384, 12288, 4096
    fam = K.Family("f16", 4, False, 128)
    if G.wgmma_launch(m, n, k, fam, 0).prod != 2:
        pytest.skip(f"{sms} SMs: whole tiles fill them at M={m} N={n} K={k}")
    _graph_equals_eager(m, n, k, fam)


@pytest.fixture
def no_cluster_sum(monkeypatch):
    """A callable that runs its argument with the K splits summed through the workspace (gemm.WGMMA_CLUSTER_SUM
    off), launches recomputed before and after."""
    def workspace_run(fn):
        monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", False)
        G.wgmma_launch.cache_clear()
        try:
            return fn()
        finally:
            monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", True)
            G.wgmma_launch.cache_clear()
    G.wgmma_launch.cache_clear()
    yield workspace_run
    G.wgmma_launch.cache_clear()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{str(f[0])[6:]}-u{f[1]}-g{f[2]}{'-zp' if f[3] else ''}")
def test_cluster_sum(fmt, no_cluster_sum, monkeypatch):
    """K splits launched in clusters of the splits and summed through distributed shared memory (session 45):
    every dense form the family builds, clusters of 2, 3 and 4 (the route takes 2 only: gemm.WGMMA_CLUSTER_MAX is
    raised here to run the kernel's other sizes; uneven runs of K: 80 stages in 3), partial token tiles, bias:
    the NaN-poisoned output matches the reference and equals the workspace fixup's bit for bit (the same order of
    additions); a launch takes its cluster exactly where the shares divide evenly and fit the ring (these grids
    run in one round); counters stay zero. Then the default rule: a two-way K split of the route is clustered,
    a four-way one is not, and the plain 128-token tile's four splits of 4096^2 M = 256 become two clustered ones
    (gemm.wgmma_halve_splits, session 46), as do 3072x4096 M = 160 and 8192x4096 M = 256 instead of the tall tiles
    (session 47); the op's results on those routes and on the 64-token tile's halved one (4096x8192 M = 64)."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    monkeypatch.setattr(G, "WGMMA_CLUSTER_MAX", 4)
    clustered = set()
    for k, n, m, a, packed, bias, ref in _form_cases(fmt, ((5120, 1024, (16, 100, 257)),), seed=12):
        for form in _built_dense_forms(bits):
            nt, fw, st = form[:3]
            if nt < m // 4 or (nt > 64 and m < 64):
                continue
            for splits in (2, 3, 4):
                cfg = (nt, fw, st, splits) + form[4:]
                wide, prod = (form[4] if len(form) > 4 else False), (form[5] if len(form) > 5 else 0)
                G.wgmma_launch.cache_clear()
                wl = G.wgmma_launch(m, n, k, fam, 0, nt, fw, st, splits, wide, int(prod))
                per_thread = nt * 128 * fw // (4 * (wl.threads - 128 if wl.prod else wl.threads))
                fits = (splits - 1) * nt * 128 * fw * 4 // splits <= wl.smem - 1024
                assert wl.cluster == (splits if per_thread % splits == 0 and fits else 0), (form, splits, wl)
                got = run(a, packed, m, n, k, dtype, cfg, bias=bias)
                label = f"K={k} N={n} M={m} config={cfg} cluster={wl.cluster}"
                check_close(got, ref, tol, label)
                if wl.cluster:
                    clustered.add((nt, fw, splits))
                    ws = no_cluster_sum(lambda: run(a, packed, m, n, k, dtype, cfg, bias=bias))
                    assert torch.equal(got, ws), label
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    assert {2, 3, 4} <= {s for _, _, s in clustered}, clustered
    monkeypatch.setattr(G, "WGMMA_CLUSTER_MAX", 2)
    G.wgmma_launch.cache_clear()
    # the route: 8192^2 at M = 256 splits K in two (one 256-token tile x 64 strips x 2); 4096^2 (the plain 128-token
    # tile, 2 x 32 tiles) in two clusters of 2 by the halving rule (session 46), four through the workspace without it
    wl = G.wgmma_launch(256, 8192, 8192, fam, 0)
    assert wl.splits == 2 and wl.cluster == 2, wl
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wl = G.wgmma_launch(256, 4096, 4096, fam, 0)
    halved = G.wgmma_halve_splits(64, 4, 128, 1, 0, False, sms, 4096) and G.wgmma_cluster_sum(
        wl.fn, fam, 128, 1, 2, wl.threads, wl.smem, 0, 128, 2 * sms) == 2  # (the device runs 64 clusters of 2 at once)
    assert (wl.nt, wl.prod, wl.splits, wl.cluster) == ((128, 0, 2, 2) if halved else (128, 0, 4, 0)), (sms, wl)
    monkeypatch.setattr(G, "WGMMA_CLUSTER_HALVE", False)
    G.wgmma_launch.cache_clear()
    wl = G.wgmma_launch(256, 4096, 4096, fam, 0)
    assert wl.splits == 4 and wl.cluster == 0, wl
    monkeypatch.setattr(G, "WGMMA_CLUSTER_HALVE", True)
    G.wgmma_launch.cache_clear()
    # the halving rule in place of the table's tall tiles (session 47): M = 145-192 at K <= 4096, M = 193-256 at K <= 8192
    for m, k in ((160, 3072), (256, 8192)):
        wl = G.wgmma_launch(m, 4096, k, fam, 0)
        assert (wl.nt, wl.prod, wl.splits, wl.cluster) == ((128, 0, 2, 2) if halved else (wl.nt, 2, wl.splits, 0)), wl
    for m, k, n in ((256, 8192, 8192), (256, 4096, 4096), (100, 8192, 8192), (64, 4096, 8192), (160, 3072, 4096),
                    (256, 8192, 4096)):
        packed, w = random_weights(k, n, bits, group, zp, dtype, seed=13)
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        wl = G.wgmma_launch(m, n, k, fam, 0)
        got = jitmarlin.marlin_gemm(a, packed.b, packed.scales, packed.zeros)
        check_close(got, a.float() @ w, tol, f"{k}x{n} M={m} through the op ({wl.splits} splits, cluster {wl.cluster})")


# Token tiles of 176-240 rows (session 47: instantiable in jm_wgmma.cuh; session 48: built and routed)
EXTRA_TALL = ((176, 1, 6), (208, 1, 6), (224, 1, 5), (240, 1, 5))


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[1]], ids=("float16-u4-g128", "bfloat16-u4-g128"))
def test_extra_tall_token_tiles(fmt, monkeypatch):
    """The two-compute-warpgroup producer form with 176- / 208- / 224- / 240-token tiles (built by default since
    session 48): NaN-poisoned outputs match the reference with bias for whole tiles, two clustered K splits, three
    through the workspace and stream-K, at M with a partial last token tile (a few rows past one tile) and with exactly
    three tiles; the clustered split equals the workspace one bit for bit and the counters end at zero."""
    dtype, bits, group, zp = fmt
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family(K.DTYPES[dtype], bits, zp, group)
    assert set(EXTRA_TALL) <= set(K.WGMMA_PROD2_CONFIGS)
    try:
        k, n = 2048, 1024
        packed, w = random_weights(k, n, bits, group, zp, dtype, seed=47)
        bias = torch.randn(n, device="cuda", dtype=dtype)
        for nt, fw, st in EXTRA_TALL:
            assert K.wgmma_smem_bytes(fam, nt, fw, st) <= 227 * 1024, (nt, st)
            for m in (nt + 5, 3 * nt):
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                ref = a.float() @ w + bias.float()
                outs = {}
                for splits in (1, 2, 3, -1):
                    cfg = (nt, fw, st, splits, False, 2)
                    wl = G.wgmma_launch(m, n, k, fam, 0, nt, fw, st, splits, False, 2)
                    assert (wl.nt, wl.prod, wl.splits, wl.m_tiles) == (nt, 2, splits, -(-m // nt)), wl
                    got = run(a, packed, m, n, k, dtype, cfg, bias=bias)
                    check_close(got, ref, tol, f"K={k} N={n} M={m} tile {nt} splits {splits} cluster {wl.cluster}")
                    outs[splits] = got
                    if splits == 2:
                        assert wl.cluster == 2, wl
                        monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", False)
                        G.wgmma_launch.cache_clear()
                        try:
                            assert torch.equal(run(a, packed, m, n, k, dtype, cfg, bias=bias), got), (nt, m)
                        finally:
                            monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", True)
                            G.wgmma_launch.cache_clear()
                assert torch.equal(outs[1], run(a, packed, m, n, k, dtype, (nt, fw, st, 1, False, 2), bias=bias))
        assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
    finally:
        monkeypatch.undo()
        K.clear_kernel_caches()
