"""MarlinMoE / fused_marlin_moe against a plain-PyTorch MoE on the dequantized experts."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from jitmarlin.nn.moe import MarlinMoE
from jitmarlin.ops import _kernels as K
from jitmarlin.ops.moe import fused_marlin_moe
from jitmarlin.quant import pack_weights, permute_scales
from jitmarlin.quant.packed import Packed

from .helpers import check_close

MIXTRAL = (8, 4096, 14336, 2)
QWEN = (64, 2048, 1408, 6)


def _expert(k, n, bits, group, dtype, gen, device):
    q = torch.randint(0, 1 << bits, (k, n), device=device, dtype=torch.int32, generator=gen)
    groups = 1 if group == -1 else k // group
    s = (torch.rand(groups, n, device=device, generator=gen) * 0.02 + 0.005).to(dtype) / (1 if bits == 4 else 16)
    return Packed(pack_weights(q, bits), permute_scales(s), None, bits, group)


@functools.lru_cache(maxsize=4)
def make_moe(e, h, i, top_k, dtype=torch.float16, act_order=False, bits=4, group=128, device="cuda:0", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = [_expert(h, 2 * i, bits, group, dtype, gen, device) for _ in range(e)]
    w2 = [_expert(i, h, bits, group, dtype, gen, device) for _ in range(e)]
    router = torch.randn(e, h, device=device, generator=gen) * 0.05
    p13 = p2 = None
    if act_order:
        p13 = torch.stack([torch.randperm(h, device=device, generator=gen) for _ in range(e)])
        p2 = torch.stack([torch.randperm(i, device=device, generator=gen) for _ in range(e)])
    moe = MarlinMoE(w13, w2, router, top_k, renormalize=True, w13_perm=p13, w2_perm=p2)
    w13f, w2f = moe.dequantize()
    return moe, w13f.float(), w2f.float()


def reference(x, w13, w2, weights, ids, dtype):
    """Per-expert loop in fp32, rounding to the activation dtype where an fp16/bf16 model would."""
    t, h = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(t, h, device=x.device, dtype=torch.float32)
    xf = x.float()
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h1 = (xf[tok] @ w13[e].t()).to(dtype).float()
        h2 = (F.silu(h1[:, :inter]) * h1[:, inter:]).to(dtype).float()
        h3 = ((h2 @ w2[e].t()) * weights[tok, slot].float()[:, None]).to(dtype).float()
        out.index_add_(0, tok, h3)
    return out


def run_fused(moe, x, weights, ids):
    return fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, weights, ids,
                            w13_zeros=moe.w13_qzeros, w2_zeros=moe.w2_qzeros, w13_perm=moe.w13_perm,
                            w2_perm=moe.w2_perm)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [MIXTRAL, QWEN], ids=["mixtral", "e64"])
def test_moe_module(shape, dtype, act_order):
    e, h, i, top_k = shape
    moe, w13, w2 = make_moe(e, h, i, top_k, dtype, act_order)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    # (e64 at 80 / 160 / 288 tokens: 7.5 / 15 / 27 rows per expert, small experts' blocks of 8 (mma.sync kernel) /
    # the producer form's 24 / 32 since session 33, at 27 rows many experts in two blocks)
    for t in (1, 3, 16, 64, 80, 160, 257, 288, 1024):
        x = torch.randn(t, h, device="cuda", dtype=dtype)
        out = moe(x)
        assert out.shape == (t, h) and out.dtype == dtype
        weights, ids = moe.route(x)
        check_close(out, reference(x, w13, w2, weights, ids, dtype), tol, f"T={t}")
    ws = K.default_workspace(torch.device("cuda"))
    torch.cuda.synchronize()
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("routing", ["one_expert", "empty_experts"])
def test_moe_skewed_routing(routing):
    e, h, i, top_k = QWEN
    moe, w13, w2 = make_moe(e, h, i, top_k)
    t = 300
    x = torch.randn(t, h, device="cuda", dtype=torch.float16)
    if routing == "one_expert":  # slot 0 of every token on expert 5, the rest on 6 others
        ids = torch.stack([torch.tensor([5, 1, 2, 3, 4, 6])] * t).cuda()
    else:  # only experts 0..7 receive tokens
        ids = torch.stack([torch.randperm(8)[:top_k] for _ in range(t)]).cuda()
    weights = torch.softmax(torch.randn(t, top_k, device="cuda"), -1)
    out = run_fused(moe, x, weights, ids)
    check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, routing)


def check_graph_replays(moe, w13, w2, x, replays=3, tol=1e-3, what="graph"):
    """Capture moe(x) (after an eager call) and replay it on new inputs: each replay routes its own
    tokens; outputs against the reference (in x's dtype, relative error < tol)."""
    moe(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = moe(x)
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        weights, ids = moe.route(x)
        check_close(y, reference(x, w13, w2, weights, ids, x.dtype), tol, what)


def test_moe_cuda_graph():
    e, h, i, top_k = QWEN
    moe, w13, w2 = make_moe(e, h, i, top_k)
    check_graph_replays(moe, w13, w2, torch.randn(16, h, device="cuda", dtype=torch.float16))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on the nvidia-h200-x2 machine)")
def test_moe_on_second_device():
    e, h, i, top_k = QWEN
    moe, w13, w2 = make_moe(e, h, i, top_k, device="cuda:1")
    with torch.cuda.device(0):
        for t in (1, 64):
            x = torch.randn(t, h, device="cuda:1", dtype=torch.float16)
            out = moe(x)
            torch.cuda.synchronize(1)
            weights, ids = moe.route(x)
            check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, f"cuda:1 T={t}")


def test_moe_bad_act_order_is_refused():
    e, h, i, top_k = QWEN
    moe, _, _ = make_moe(e, h, i, top_k, act_order=True)
    x = torch.randn(5, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x)
    bad = moe.w2_perm.clone()
    bad[3, 7] = bad[3, 8]  # a repeat in expert 3's order
    with pytest.raises(ValueError, match="every row of perm"):
        fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, weights, ids,
                         w13_perm=moe.w13_perm, w2_perm=bad)
    with pytest.raises(ValueError, match="w13_perm must be an integer tensor"):
        fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, weights, ids,
                         w13_perm=moe.w13_perm[:, :-1], w2_perm=moe.w2_perm)
    torch.cuda.synchronize()


LARGE = (2, 8192, 4096, 2)  # w13 of one expert: K*N = 8192 * 8192 = 64M, the large-problem routes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_large_experts(dtype):
    """Experts with K*N >= 64M: on sm_90 the w13 GEMM of the MoE kernel runs blocks of 8 on the
    direct-load tile with three CTAs per SM (two experts of 64M), blocks of 16 on the three-slot
    16-row ring with three CTAs per SM, blocks of 32 on the 32-row bulk-copy ring."""
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops.moe import choose_block_size

    e, h, i, top_k = LARGE
    moe, w13, w2 = make_moe(e, h, i, top_k, dtype)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    fam = K.Family("bf16" if dtype == torch.bfloat16 else "f16", 4, False, 128, True)
    info = G.device_info(0)
    for t, rows in ((4, 8), (12, 16), (24, 32)):
        assert choose_block_size(t, top_k, e) == rows
        if info.cc >= (9, 0):  # the test reaches the tiles it is meant for
            tile = G.select_plan(rows, 2 * i, h, fam, info.smem_per_block, info.cc, experts=min(e, t * top_k)).tile
            assert tile.tag() == {8: "w8_k128_s6_bk_dr1_o3", 16: "w16_k128_s3_bk_o3", 32: "m2_k128_s4_bk"}[rows], tile
        x = torch.randn(t, h, device="cuda", dtype=dtype)
        weights, ids = moe.route(x)
        check_close(moe(x), reference(x, w13, w2, weights, ids, dtype), tol, f"T={t}")
    ws = K.default_workspace(torch.device("cuda"))
    torch.cuda.synchronize()
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("late", [False, True], ids=["usual", "late_arrival"])
def test_moe_early_publish(monkeypatch, late):
    """MoE blocks of 8 on the three-CTA direct-load tile publish the partials of a split unit that
    ends mid-run without waiting, the producer warp arriving for them later (kEarlyPublish; MoE too
    since session 23); with -DJM_TEST_LATE_ARRIVAL that arrival comes after the unit's first CTA's,
    so the mid-run CTA sums the unit at the end of its run. Both expert GEMMs on that tile, CTAs that
    end a unit mid-run present; reference, determinism, counters back to zero."""
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops.moe import choose_block_size

    from .helpers import late_arrival_build

    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("bulk-copy tiles are built for sm_90 and newer only")
    # both GEMMs above K*N = 64M with two experts active, K / 128 not a multiple of a CTA's run
    e, h, i, top_k = 4, 4096, 11008, 2
    fam = K.Family("f16", 4, False, 128, True)
    if late:
        late_arrival_build(monkeypatch, fam)
    moe, w13, w2 = make_moe(e, h, i, top_k)
    for t in (1, 3):
        x = torch.randn(t, h, device="cuda", dtype=torch.float16)
        weights, ids = moe.route(x)
        assert choose_block_size(t, top_k, e) == 8
        blocks = int(torch.unique(ids).numel())  # one block of 8 per active expert at these token counts
        rows = t * top_k + e * 7
        mids = 0
        for n, k in ((2 * i, h), (h, i)):
            launch = G.prepare_launch(8, rows, n, k, fam, 0, tuned=False, experts=min(e, t * top_k))
            assert launch.plan.tile.tag() == "w8_k128_s6_bk_dr1_o3", (n, k, launch.plan)
            k_tiles = k // 128
            total = (n // (64 * launch.plan.nwarps)) * blocks * k_tiles
            iters = -(-total // launch.grid)
            mid = [c for c in range(launch.grid) if c * iters % k_tiles
                   and (c * iters // k_tiles + 1) * k_tiles < min(total, (c + 1) * iters)]
            mids += len(mid)
        assert mids, f"T={t}: no CTA of either GEMM ends a split unit mid-run"
        out = moe(x)
        check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, f"T={t} late={late}")
        assert torch.equal(moe(x), out), f"T={t}: not deterministic"
    ws = K.default_workspace(torch.device("cuda"))
    torch.cuda.synchronize()
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("shape", [MIXTRAL, QWEN], ids=["mixtral", "e64"])
def test_moe_one_token_without_alignment(monkeypatch, shape):
    """One token (blocks of 8): no alignment kernel, the expert GEMMs read the router's ids as their
    expert table (moe.one_token_tables; int64 ids through their low words). Against the reference and
    the alignment path (JITMARLIN_MOE_ONE_TOKEN=0), int32 ids equal to int64 ids, CUDA graph replays
    with new tokens and new routing, and out-of-range ids clamped (finite output, no fault)."""
    from jitmarlin.ops import moe as M

    e, h, i, top_k = shape
    moe, w13, w2 = make_moe(e, h, i, top_k)
    x = torch.randn(1, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x)
    assert ids.dtype == torch.int32 and M.one_token_tables(ids) is not None  # the router kernel's ids
    out = run_fused(moe, x, weights, ids)
    check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, "one token")
    assert M.one_token_tables(ids.to(torch.int64))[3] == 1  # torch.topk's ids: read through their low words
    assert torch.equal(run_fused(moe, x, weights, ids.to(torch.int64)), out)
    monkeypatch.setenv("JITMARLIN_MOE_ONE_TOKEN", "0")
    K.env_flag.cache_clear()
    assert M.one_token_tables(ids) is None
    check_close(run_fused(moe, x, weights, ids), out.float(), 1e-3, "alignment path")
    monkeypatch.delenv("JITMARLIN_MOE_ONE_TOKEN")
    K.env_flag.cache_clear()
    check_graph_replays(moe, w13, w2, x)  # each replay routes its own token
    weights, ids = moe.route(x)
    bad = ids.clone()
    bad[0, 0] = e + 5
    bad[0, -1] = -1
    assert torch.isfinite(run_fused(moe, x, weights, bad)).all()
    torch.cuda.synchronize()


@pytest.fixture
def strip_moe_launches(monkeypatch):
    """The strip route on (sm_90+); the configs of the strip kernel's MoE launches are recorded in the list."""
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops import moe as M

    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("the strip kernels are built for sm_90 and newer")
    monkeypatch.setattr(G, "STRIP_ROUTE", True)
    launches = []
    real = M._launch_strip_moe
    monkeypatch.setattr(M, "_launch_strip_moe", lambda *args: launches.append(args[-1]) or real(*args))
    return launches


@pytest.mark.parametrize("shape", [MIXTRAL, QWEN], ids=["mixtral", "e64"])
def test_moe_one_token_on_the_strip_kernel(strip_moe_launches, shape):
    """With the strip route on (gemm.STRIP_ROUTE), both one-token expert GEMMs run the strip kernel's MoE form (a CTA per
    slot and 64-column strip): against the reference, int64 ids equal to int32, CUDA graph replays, out-of-range ids
    clamped."""
    e, h, i, top_k = shape
    moe, w13, w2 = make_moe(e, h, i, top_k)
    x = torch.randn(1, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x)
    out = run_fused(moe, x, weights, ids)
    assert len(strip_moe_launches) == 2, strip_moe_launches  # gate/up and down
    check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, "one token, strip")
    assert torch.equal(run_fused(moe, x, weights, ids.to(torch.int64)), out)
    check_graph_replays(moe, w13, w2, x)
    bad = ids.clone()
    bad[0, 0] = e + 5
    bad[0, -1] = -1
    assert torch.isfinite(run_fused(moe, x, weights, bad)).all()
    torch.cuda.synchronize()


@pytest.mark.parametrize("tokens", [3, 16, 64])
def test_moe_small_experts_on_the_strip_kernel(strip_moe_launches, tokens):
    """With the strip route on, the E=64 top-6 layer's expert GEMMs in blocks of 8 (1-6 rows per expert) run the strip
    kernel's MoE form on the alignment's tables: against the reference; the layer's two GEMMs took it at 3 tokens."""
    e, h, i, top_k = QWEN
    moe, w13, w2 = make_moe(e, h, i, top_k)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x)
    out = run_fused(moe, x, weights, ids)
    check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, f"{tokens} tokens, strip")
    if tokens == 3:
        assert len(strip_moe_launches) == 2, strip_moe_launches


@pytest.mark.parametrize("shape,tokens,strip", [(MIXTRAL, 1, True), (MIXTRAL, 16, True), (QWEN, 1, True),
                                                 (QWEN, 16, False)], ids=["mixtral-1", "mixtral-16", "e64-1", "e64-16"])
def test_moe_default_route_takes_the_strip_form_on_few_blocks(monkeypatch, shape, tokens, strip):
    """By default (strip route not forced) the strip kernel's MoE form runs where the tables hold at most
    moe.STRIP_MOE_MAX_BLOCKS blocks of 8 (session 55: one token, a block per slot; Mixtral's 16-token tables, 11
    blocks), not on E=64's 16-token tables (68 blocks); against the reference either way."""
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops import moe as M

    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("the strip kernels are built for sm_90 and newer")
    monkeypatch.setattr(G, "STRIP_ROUTE", False)
    monkeypatch.delenv("JITMARLIN_STRIP", raising=False)
    K.env_flag.cache_clear()
    launches = []
    real = M._launch_strip_moe
    monkeypatch.setattr(M, "_launch_strip_moe", lambda *args: launches.append(args[-1]) or real(*args))
    e, h, i, top_k = shape
    moe, w13, w2 = make_moe(e, h, i, top_k)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x)
    out = run_fused(moe, x, weights, ids)
    assert len(launches) == (2 if strip else 0), launches
    check_close(out, reference(x, w13, w2, weights, ids, torch.float16), 1e-3, f"{tokens} tokens, default route")


@pytest.mark.parametrize("tokens", [1, 5])
def test_moe_under_torch_compile(tokens):
    """MarlinMoE through torch.compile (the decode step users compile; at one token the one-token
    tables are built eagerly: one_token_tables is excluded from tracing): equal to eager, and to the
    reference for a new token batch."""
    e, h, i, top_k = QWEN
    moe, w13, w2 = make_moe(e, h, i, top_k)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.float16)
    want = moe(x)
    cmoe = torch.compile(moe)
    for _ in range(2):
        got = cmoe(x)
        check_close(got, want.float(), 1e-3, f"torch.compile, {tokens} tokens")
    x2 = torch.randn(tokens, h, device="cuda", dtype=torch.float16)
    weights, ids = moe.route(x2)
    check_close(cmoe(x2), reference(x2, w13, w2, weights, ids, torch.float16), 1e-3, "torch.compile, new token")
