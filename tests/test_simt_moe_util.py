"""The MoE helper kernels (cuda_src/jm_moe_util.cuh: alignment, router, SiLU-mul, top-k sum in fp16 / bf16 and from
fp32 K-split partials, the gather by position with and without act-order column orders, SiLU-mul fused into that
gather) and the dense act-order column gather (jm_gemm.cuh: scattered and shared-memory forms), run on the CPU by
the SIMT emulator (tests/simt) through the launch functions of jitmarlin.ops (grid, shared memory and parameter
struct as on the GPU), against the torch references the GPU tests use (tests/gpu/test_moe_util_gpu.py,
test_gemm_gpu.py): the same assertions, smaller shapes. Each launch is a programmatic dependent launch on an
emulated sm_90, so every buffer of the kernel before is checked to be touched only after griddepcontrol.wait
(tests/test_simt_pdl.py), and outputs are poisoned (the launch path's allocations are NaN-filled guarded memory).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.ops import moe as M

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

DENSE = (K.Family("f16", 4, False, 128), K.Family("bf16", 4, False, 128))
LAUNCHED: list[str] = []


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    srcs = list(K.moe_util_build_spec((9, 0)).sources)
    for fam in DENSE:
        srcs += emu.gather_sources(fam)
    library = emu.build(srcs, tmp_path_factory.mktemp("simtutil"))
    yield library
    library.free_all()


class NaNTorch(emu.GuardedTorch):
    """The launch path's torch.empty as guarded memory filled with NaN (integers: -1), so that what a kernel does
    not write shows."""

    def empty(self, *size, **kw):
        t = super().empty(*size, **kw)
        return t.fill_(float("nan") if t.dtype.is_floating_point else -1) if t.numel() else t


@pytest.fixture
def dev(monkeypatch, lib):
    emu.emulated_device(monkeypatch, lib, (9, 0), log=LAUNCHED)
    for mod in (G, M):
        monkeypatch.setattr(mod, "torch", NaNTorch(lib))
    LAUNCHED.clear()
    yield lib
    emu.clear_launch_caches()


def ids_of(t, k, e, seed, skew=False, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most slots on expert 0, many experts empty
        ids = torch.zeros(t, k, dtype=torch.int64)
        if k > 1:
            ids[:, 1:] = torch.randint(0, max(1, e // 4), (t, k - 1), generator=g)
    else:
        ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
    return ids.to(dtype)


@pytest.mark.parametrize("t,k,e,block,skew,dtype", [
    (1, 2, 8, 8, False, torch.int64), (3, 2, 8, 8, True, torch.int32), (16, 2, 8, 16, False, torch.int32),
    (64, 6, 64, 16, True, torch.int64), (129, 2, 8, 64, False, torch.int32), (300, 6, 64, 16, False, torch.int32),
    (7, 1, 1, 8, False, torch.int64)])
def test_align_kernel_equals_reference(dev, t, k, e, block, skew, dtype):
    """The alignment kernel's tables equal the torch reference's (stable placement); from 256 slots its warps place
    their own chunks (the per-warp table)."""
    ids = dev.guarded(ids_of(t, k, e, seed=t * 7 + k, skew=skew, dtype=dtype))
    want = M._align_torch(ids, block, e)
    got = M._align_cuda(ids, block, e)
    assert LAUNCHED == ["jm_moe_align"]
    for g_, w_, name in zip(got, want, ("sorted_ids", "expert_ids", "num_padded")):
        assert g_.dtype == torch.int32 and g_.shape == w_.shape, name
        assert torch.equal(g_, w_), (name, g_[:64].tolist(), w_[:64].tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 200)])
def test_silu_mul_kernel(dev, dtype, rows, inter):
    c1 = dev.guarded(torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)).to(dtype) * 3)
    got = M._launch_chunked("silu_mul", c1, rows, inter)
    want = F.silu(c1[:, :inter].float()) * c1[:, inter:].float()
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert ((got.float() - want).abs() <= tol * want.abs() + 1e-3).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,h", [(1, 2, 64), (7, 6, 48), (3, 8, 1032)])
def test_topk_sum_kernel(dev, dtype, tokens, top_k, h):
    """Equal to torch's fp32 sum to the bit for two slots, within one rounding otherwise; and the fp32 K-split form
    summed over its splits too."""
    gen = torch.Generator().manual_seed(tokens * top_k)
    c3 = dev.guarded(torch.randn(tokens * top_k, h, generator=gen).to(dtype))
    got = M._launch_chunked("topk_sum", c3, tokens, h, top_k)
    want = c3.view(tokens, top_k, h).float().sum(1).to(dtype)
    eps = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    if top_k == 2:
        assert torch.equal(got, want)
    else:
        assert ((got.float() - want.float()).abs() <= eps * want.float().abs() + 1e-6).all()
    parts = dev.guarded(torch.randn(3, tokens * top_k, h, generator=gen))
    got = M._launch_chunked("topk_sum_f32", parts, tokens, h, top_k, dtype=dtype, splits=3)
    want = parts.view(3, tokens, top_k, h).sum((0, 2)).to(dtype)
    assert ((got.float() - want.float()).abs() <= eps * want.float().abs() + 1e-5).all()


def aligned_with_orders(dev, t, k, e, block, cols):
    ids = ids_of(t, k, e, seed=t + cols)
    sorted_ids, expert_ids, num_padded = (dev.guarded(x) for x in M._align_torch(ids, block, e))
    g = torch.Generator().manual_seed(cols)
    perm = dev.guarded(torch.stack([torch.randperm(cols, generator=g) for _ in range(e)]).to(torch.int32))
    n = int(num_padded)
    return sorted_ids, expert_ids, num_padded, perm, n, sorted_ids[:n] < t * k, g


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,block,cols", [(1, 2, 8, 8, 64), (5, 2, 8, 16, 136), (3, 1, 4, 8, 64)])
def test_moe_gather_kernel(dev, dtype, t, k, e, block, cols):
    """By position with the experts' column orders (act-order) and without (the producer form's rows): equal to the
    torch reference at real slots, zeros at padding positions, positions past num_padded not written."""
    sorted_ids, expert_ids, num_padded, perm, n, real, g = aligned_with_orders(dev, t, k, e, block, cols)
    for rows, top, order in ((t, k, perm), (t * k, 1, perm), (t, k, None)):
        x = dev.guarded(torch.randn(rows, cols, generator=g).to(dtype))
        got = M._launch_gather("moe_gather", x, cols, top, sorted_ids, expert_ids, num_padded, order, block)
        want = M._gather_by_position_torch(x, sorted_ids, expert_ids, order, top, block)
        assert got.shape == want.shape == (sorted_ids.numel(), cols) and got.dtype == dtype
        assert torch.equal(got[:n][real], want[:n][real])
        assert not got[:n][~real].any()
        assert got[n:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k,e,block,inter", [(1, 2, 8, 8, 64), (6, 2, 8, 24, 72)])
def test_silu_gather_kernel(dev, dtype, t, k, e, block, inter):
    """SiLU-mul fused into the gather: the bits of the two kernels it replaces at real slots, near the torch
    reference, zeros at padding, nothing written past num_padded."""
    sorted_ids, expert_ids, num_padded, perm, n, real, g = aligned_with_orders(dev, t, k, e, block, inter)
    c1 = dev.guarded(torch.randn(t * k, 2 * inter, generator=g).to(dtype) * 4)
    for order in (None, perm):
        got = M._launch_gather("silu_gather", c1, inter, 1, sorted_ids, expert_ids, num_padded, order, block)
        two = M._launch_gather("moe_gather", M._launch_chunked("silu_mul", c1, t * k, inter), inter, 1, sorted_ids,
                               expert_ids, num_padded, order, block)
        ref = M._gather_by_position_torch(F.silu(c1[:, :inter].float()) * c1[:, inter:].float(), sorted_ids,
                                          expert_ids, order, 1, block)
        assert torch.equal(got[:n][real], two[:n][real])
        tol = 2e-3 if dtype == torch.float16 else 1.6e-2
        assert ((got[:n][real].float() - ref[:n][real]).abs() <= tol * ref[:n][real].abs() + 1e-3).all()
        assert not got[:n][~real].any()
        assert got[n:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 60, 4), (3, 128, 8), (2, 512, 32), (9, 1, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_route_kernel(dev, dtype, t, e, k, renorm):
    """The router: torch's softmax + top-k ids (distinct logits: no ties), int32, weights within fp32 rounding."""
    g = torch.Generator().manual_seed(t * 1000 + e)
    grid = torch.randperm(e, generator=g).float() * (8.0 / e) - 4.0
    logits = dev.guarded(torch.stack([grid[torch.randperm(e, generator=g)] for _ in range(t)]).to(dtype))
    w, ids = M._route_cuda(logits, k, renorm)
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_ids = torch.topk(probs, k, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fam", DENSE, ids=lambda f: f.dtype)
@pytest.mark.parametrize("form,smem_min_m,ctas", [("scattered", 10**9, 64), ("smem", 1, 64), ("smem-parts", 1, 512)])
def test_dense_gather_kernels(dev, monkeypatch, fam, form, smem_min_m, ctas):
    """The act-order column gather, both forms, into a NaN-poisoned output: A[:, perm] exactly, at M across part
    boundaries and a K whose chunks do not fill the last CTA (or need two parts per row: 4160 / 8 = 520 > 512)."""
    monkeypatch.setattr(G, "GATHER_SMEM_MIN_M", smem_min_m)
    monkeypatch.setattr(G, "GATHER_SMEM_CTAS", ctas)
    dt = torch.float16 if fam.dtype == "f16" else torch.bfloat16
    for k in (1376, 4160):
        perm = dev.guarded(torch.randperm(k, generator=torch.Generator().manual_seed(k)).to(torch.int32))
        for m in (1, 3, 9):
            a = dev.guarded(torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt))
            out = dev.guarded(torch.full((m, k), float("nan"), dtype=dt))
            LAUNCHED.clear()
            G.gather_columns(a, perm, m, k, fam, out=out)
            assert LAUNCHED == [K.gather_kernel_name(fam) + ("" if form == "scattered" else "_smem")], LAUNCHED
            assert torch.equal(out, a[:, perm.long()]), f"K={k} M={m}"
