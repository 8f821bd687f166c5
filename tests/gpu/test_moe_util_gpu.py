"""The MoE helper kernels (on by default since their first H200 run, 2026-11-30): the align kernel
must give exactly the torch reference's table (it places slots in order), the SiLU-mul kernel
F.silu(gate) * up, the act-order gather the torch gather's rows, and the fused MoE layer the same
result with the kernels as with torch ops (JITMARLIN_MOE_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import moe as M


@pytest.fixture(autouse=True)
def _fresh_env_flags():
    """The switches are read once per process (K.env_flag); these tests flip them."""
    K.env_flag.cache_clear()
    yield
    K.env_flag.cache_clear()


def _ids(t, k, e, seed, skew=False, dtype=torch.int64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if skew:  # most slots on expert 0, many experts empty
        ids = torch.zeros(t, k, dtype=torch.int64, device="cuda")
        if k > 1:
            ids[:, 1:] = torch.randint(0, max(1, e // 4), (t, k - 1), device="cuda", generator=g)
    else:
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :k]
    return ids.to(dtype)


@pytest.mark.parametrize("t,k,e,block", [(1, 2, 8, 8), (3, 2, 8, 8), (16, 2, 8, 16), (64, 6, 64, 16),
                                         (257, 2, 8, 64), (1024, 6, 64, 64), (4096, 8, 256, 32), (7, 1, 1, 8),
                                         (1024, 2, 8, 128)])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_align_kernel_equals_reference(t, k, e, block, skew, dtype):
    ids = _ids(t, k, e, seed=t * 7 + k, skew=skew, dtype=dtype)
    want = M._align_torch(ids, block, e)
    for _ in range(2):  # the output buffers are fresh each call; run twice to catch stale state
        got = M._align_cuda(ids, block, e)
        torch.cuda.synchronize()
        for g_, w_, name in zip(got, want, ("sorted_ids", "expert_ids", "num_padded")):
            assert g_.dtype == torch.int32 and g_.shape == w_.shape, name
            assert torch.equal(g_, w_), (name, g_[:64].tolist(), w_[:64].tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 64), (16, 14336), (257, 1408)])
def test_silu_mul_kernel(monkeypatch, dtype, rows, inter):
    monkeypatch.delenv("JITMARLIN_MOE_KERNELS", raising=False)
    c1 = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype) * 3
    got = M.silu_mul(c1, inter)
    want = F.silu(c1[:, :inter]) * c1[:, inter:]
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + 1e-3).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,h", [(1, 2, 4096), (7, 6, 2048), (64, 8, 1032), (300, 2, 64)])
def test_topk_sum_kernel(monkeypatch, dtype, tokens, top_k, h):
    """Our sum over each token's slots against torch's, output poisoned first: equal to the bit
    for two slots (one exact fp32 addition, one rounding), within one rounding otherwise."""
    monkeypatch.delenv("JITMARLIN_MOE_KERNELS", raising=False)
    c3 = torch.randn(tokens * top_k, h, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    got = M.topk_sum(c3, tokens, top_k)
    want = c3.view(tokens, top_k, h).float().sum(1).to(dtype)
    assert got.shape == (tokens, h) and got.dtype == dtype
    if top_k == 2:
        assert torch.equal(got, want)
    else:
        eps = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
        assert ((got.float() - want.float()).abs() <= eps * want.float().abs() + 1e-6).all()


def _aligned_with_orders(t, k, e, block, cols):
    """Random routing of t tokens (top-k of e experts) aligned to blocks of `block`, and a random order
    of `cols` columns per expert (int32): the tables, the order, the padded length n, which of the first
    n positions hold real slots, and the generator (for more data from the same seed)."""
    ids = _ids(t, k, e, seed=t + cols)
    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, block, e)
    g = torch.Generator(device="cuda").manual_seed(cols)
    perm = torch.stack([torch.randperm(cols, device="cuda", generator=g) for _ in range(e)]).to(torch.int32)
    n = int(num_padded)
    return sorted_ids, expert_ids, num_padded, perm, n, sorted_ids[:n] < t * k, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,block,cols", [(1, 2, 8, 8, 4096), (5, 2, 8, 16, 1408), (64, 2, 8, 64, 14336),
                                              (300, 6, 64, 16, 2048), (3, 1, 4, 8, 64)])
def test_moe_gather_kernel(monkeypatch, dtype, t, k, e, block, cols):
    """Act-order experts: our gather against the torch reference on every position the expert GEMM
    reads (before num_padded), for the first GEMM's input (token rows, top_k slots each) and the
    second's (one row per slot, the order given as int64): equal to the bit at real slots, zeros
    at padding positions."""
    monkeypatch.delenv("JITMARLIN_MOE_KERNELS", raising=False)
    sorted_ids, expert_ids, num_padded, perm, n, real, _ = _aligned_with_orders(t, k, e, block, cols)
    for rows, top, order in ((t, k, perm), (t * k, 1, perm.to(torch.int64))):
        x = torch.randn(rows, cols, device="cuda", dtype=dtype)
        got = M.gather_by_position(x, sorted_ids, expert_ids, num_padded, order, top, block)
        want = M._gather_by_position_torch(x, sorted_ids, expert_ids, order, top, block)
        assert got.shape == want.shape == (sorted_ids.numel(), cols) and got.dtype == dtype
        assert torch.equal(got[:n][real], want[:n][real])
        assert not got[:n][~real].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,block,inter", [(1, 2, 8, 8, 4096), (37, 2, 8, 24, 1408), (64, 2, 8, 48, 14336),
                                               (300, 6, 64, 80, 512), (3, 1, 4, 96, 64)])
def test_silu_gather_kernel(monkeypatch, dtype, t, k, e, block, inter):
    """SiLU-mul and the down projection's gather by position in one kernel (jm_silu_gather) against the
    two kernels it replaces (jm_silu_mul, then jm_moe_gather): equal to the bit at real slots, with and
    without a column order (and near the torch reference); zeros at padding positions; positions at or
    past num_padded not written (NaN kept)."""
    monkeypatch.delenv("JITMARLIN_MOE_KERNELS", raising=False)
    sorted_ids, expert_ids, num_padded, perm, n, real, g = _aligned_with_orders(t, k, e, block, inter)
    c1 = torch.randn(t * k, 2 * inter, device="cuda", dtype=dtype, generator=g) * 4
    empty = torch.empty
    for order in (None, perm, perm.to(torch.int64)):
        monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
        got = M.silu_gather_by_position(c1, inter, sorted_ids, expert_ids, num_padded, order, block)
        monkeypatch.setattr(torch, "empty", empty)
        two = M.gather_by_position(M.silu_mul(c1, inter), sorted_ids, expert_ids, num_padded, order, 1, block)
        ref = M._gather_by_position_torch(F.silu(c1[:, :inter]) * c1[:, inter:], sorted_ids, expert_ids, order, 1,
                                          block)
        assert got.shape == (sorted_ids.numel(), inter) and got.dtype == dtype
        assert torch.equal(got[:n][real], two[:n][real])
        tol = 2e-3 if dtype == torch.float16 else 1.6e-2  # (test_silu_mul_kernel's: __expf vs torch's SiLU)
        assert ((got[:n][real].float() - ref[:n][real].float()).abs() <= tol * ref[:n][real].float().abs() + 1e-3).all()
        assert not got[:n][~real].any()
        assert got[n:].isnan().all()


@pytest.mark.parametrize("act_order", [False, True])
def test_fused_moe_same_with_and_without_the_kernels(monkeypatch, act_order):
    from .test_moe_gpu import make_moe

    moe, _, _ = make_moe(8, 1024, 512, 2, act_order=act_order)
    x = torch.randn(37, 1024, device="cuda", dtype=torch.float16)
    monkeypatch.setenv("JITMARLIN_MOE_KERNELS", "0")
    K.env_flag.cache_clear()
    assert not M.use_moe_kernels()
    want = moe(x)
    monkeypatch.delenv("JITMARLIN_MOE_KERNELS")
    K.env_flag.cache_clear()
    assert M.use_moe_kernels()
    got = moe(x)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 8, 2), (300, 64, 6), (33, 60, 4), (5, 128, 8), (64, 256, 8),
                                   (3, 512, 32), (9, 1, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_route_kernel(monkeypatch, dtype, t, e, k, renorm):
    """jm_moe_route (moe.route_topk on CUDA): the ids of torch's softmax + top-k (distinct logits, so
    no ties), int32, and its weights within fp32 rounding (renormalized or not); the layer routes with
    it and its ids feed the alignment and the one-token path."""
    monkeypatch.delenv("JITMARLIN_MOE_KERNELS", raising=False)
    g = torch.Generator(device="cuda").manual_seed(t * 1000 + e)
    # distinct logits: a random permutation of an evenly spaced grid, in the model dtype
    logits = (torch.randperm(e, device="cuda", generator=g).float() * (8.0 / e) - 4.0)
    logits = torch.stack([logits[torch.randperm(e, device="cuda", generator=g)] for _ in range(t)]).to(dtype)
    w, ids = M.route_topk(logits, k, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_ids = torch.topk(probs, k, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(ids.long(), want_ids)
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-7)  # sums of up to 512 terms in another order
    monkeypatch.setenv("JITMARLIN_MOE_KERNELS", "0")
    K.env_flag.cache_clear()
    w0, ids0 = M.route_topk(logits, k, renorm)
    assert ids0.dtype == torch.int64 and torch.equal(ids0, want_ids)
