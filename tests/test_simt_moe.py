"""The MoE expert GEMM on the CPU emulator (tests/simt): the mma.sync kernel's MoE tiles built for sm_80 and for
sm_90 (bulk-copy tiles), and the sm_90a wgmma kernel's MoE form, launched by the real grouped-GEMM entry
(moe._moe_gemm_cuda: route, tile, grid and parameter struct of the GPU launch) with the driver replaced by the
emulator, on alignment tables from the PyTorch reference (moe._align_torch): every slot's row against
A[slot // top_k] @ dequant(W[expert of slot]) (times its routing weight), for each expert-block size.
"""

from __future__ import annotations

import pytest
import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import moe as M
from jitmarlin.quant import dequantize, pack_weights, pack_zeros, permute_scales

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

FAMILIES = (K.Family("f16", 4, False, 128, moe=True), K.Family("bf16", 8, True, 64, moe=True))


def sources(cc):
    out = []
    for fam in FAMILIES:
        out += [(K.kernel_name(fam, t), K.kernel_source(fam, t)) for t in K.tiles_for(cc) if K.tile_fits(fam, t)]
        if cc == (9, 0):
            out += [(K.strip_kernel_name(fam, *c), K.strip_kernel_source(fam, *c)) for c in K.STRIP_MOE_CONFIGS]
            spec = dict(K.wgmma_build_spec(fam, cc).sources)
            out += [(n, spec[n]) for n in (K.wgmma_kernel_name(fam, nt, fw, st) for nt, fw, st in K.WGMMA_MOE_CONFIGS
                                           if nt == 64)]
    return out


@pytest.fixture(scope="module", params=[(8, 0), (9, 0)], ids=["sm80", "sm90"])
def device(request, tmp_path_factory):
    cc = request.param
    lib = emu.build(sources(cc), tmp_path_factory.mktemp(f"simtmoe{cc[0]}"), sm=cc[0] * 10)
    yield lib, cc
    lib.free_all()


LAUNCHED: list[str] = []


@pytest.fixture
def emulated(monkeypatch, device):
    lib, cc = device
    emu.emulated_device(monkeypatch, lib, cc, sms=6, log=LAUNCHED)
    yield lib, cc
    emu.clear_launch_caches()


def experts(lib, e, k, n, fam, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if fam.dtype == "bf16" else torch.float16
    groups = 1 if fam.group_size == -1 else k // fam.group_size
    bs, ss, zs, ws = [], [], [], []
    for _ in range(e):
        q = torch.randint(0, 1 << fam.bits, (k, n), generator=gen, dtype=torch.int32)
        s = ((torch.rand(groups, n, generator=gen) * 0.02 + 0.005) / (16 if fam.bits == 8 else 1)).to(dt)
        z = torch.randint(0, 1 << fam.bits, (groups, n), generator=gen, dtype=torch.int32) if fam.zero_points else None
        ws.append(dequantize(q, s, z, fam.bits, fam.group_size).float())
        bs.append(pack_weights(q, fam.bits))
        ss.append(permute_scales(s))
        zs.append(pack_zeros(z, fam.bits) if z is not None else None)
    b = lib.guarded(torch.stack(bs))
    s = lib.guarded(torch.stack(ss))
    z = lib.guarded(torch.stack(zs)) if fam.zero_points else None
    return b, s, z, torch.stack(ws), dt


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f"{f.dtype}-u{f.bits}")
def test_moe_gemm_emulated(emulated, monkeypatch, fam):
    """Blocks of 8 / 16 / 32 / 48 rows (the mma.sync MoE tiles) and 64 (sm_90: the wgmma MoE kernel), 4 experts,
    top-2, 7 tokens (blocks with padding), with and without routing weights; on sm_90 the default route's strip
    kernel MoE form for those tables of blocks of 8 too (moe.STRIP_MOE_MAX_BLOCKS, session 55)."""
    lib, cc = emulated
    monkeypatch.setattr(M, "STRIP_MOE_MAX_BLOCKS", 0)  # the mma.sync tile at blocks of 8 (larger tables take it)
    e, k, n, tokens, top_k = 4, 256, 256, 7, 2
    b, s, z, w, dt = experts(lib, e, k, n, fam, seed=cc[0])
    gen = torch.Generator().manual_seed(5)
    a = lib.guarded(torch.randn(tokens, k, generator=gen).to(dt))
    topk_ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    topk_w = lib.guarded(torch.rand(tokens, top_k, generator=gen))
    slots = tokens * top_k
    ref = torch.stack([a[t // top_k].float() @ w[int(topk_ids.view(-1)[t])] for t in range(slots)])
    tol = 1e-3 if dt == torch.float16 else 1e-2
    for block in (8, 16, 32, 48, 64):
        sorted_ids, expert_ids, num_padded = (lib.guarded(t) for t in M._align_torch(topk_ids, block, e))
        for weighted in (False, True):
            emu.clear_launch_caches()
            LAUNCHED.clear()
            out = M._moe_gemm_cuda(a, b, s, z, sorted_ids, expert_ids, num_padded, topk_w if weighted else None,
                                   slots, top_k, block)
            want = ref * topk_w.reshape(-1, 1) if weighted else ref
            err = ((out.float() - want).norm() / want.norm()).item()
            assert err < tol, f"{fam.dtype}-u{fam.bits} sm_{cc[0]}{cc[1]} block {block} weighted={weighted}: {err:.3e}"
            wgmma = cc == (9, 0) and block == 64
            assert len(LAUNCHED) == 1 and LAUNCHED[0].startswith("jm_wgmma_" if wgmma else "jm_gemm_"), LAUNCHED
            assert "_moe_" in LAUNCHED[0]
    if cc == (9, 0):  # 7 tokens, top-2, 4 experts: 6 blocks of 8, within STRIP_MOE_MAX_BLOCKS
        monkeypatch.setattr(M, "STRIP_MOE_MAX_BLOCKS", 12)
        sorted_ids, expert_ids, num_padded = (lib.guarded(t) for t in M._align_torch(topk_ids, 8, e))
        emu.clear_launch_caches()
        LAUNCHED.clear()
        out = M._moe_gemm_cuda(a, b, s, z, sorted_ids, expert_ids, num_padded, topk_w, slots, top_k, 8)
        want = ref * topk_w.reshape(-1, 1)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < tol, f"{fam.dtype}-u{fam.bits} strip form by default: {err:.3e}"
        assert len(LAUNCHED) == 1 and LAUNCHED[0].startswith("jm_strip_") and "_moe_" in LAUNCHED[0], LAUNCHED


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f"{f.dtype}-u{f.bits}")
def test_blocks_of_8_on_the_strip_kernel(emulated, monkeypatch, fam):
    """With the strip route on, expert GEMMs in blocks of 8 run the strip kernel's MoE form (a CTA per block and
    64-column strip): one-token tables (one_token_tables' layout: int32 and int64 router ids, an id past the experts
    clamped), the alignment's tables for 7 tokens (padding rows, blocks past the padded list), activations gathered by
    position; gate/up shape (A row = slot // top_k) and down shape (A row = slot, routing weights); every config."""
    lib, cc = emulated
    if cc != (9, 0):
        pytest.skip("the strip kernels are built for sm_90 and newer")
    from jitmarlin.ops import gemm as G

    monkeypatch.setattr(G, "STRIP_ROUTE", True)
    e, k, n, top_k = 4, 512, 192, 2
    b, s, z, w, dt = experts(lib, e, k, n, fam, seed=3)
    gen = torch.Generator().manual_seed(2)
    tol = 1e-3 if dt == torch.float16 else 1e-2

    def check(a, ids, sorted_ids, expert_ids, num_padded, weights, kk, ids_shift, clamp, rows, by_position=False):
        slots = len(rows)
        LAUNCHED.clear()
        out = M._moe_gemm_cuda(a, b, s, z, sorted_ids, expert_ids, num_padded, weights, slots, kk, 8, by_position,
                               ids_shift, clamp, weights is not None)
        ref = torch.stack([a[rows[j]].float() @ w[min(int(ids[j]), e - 1)] for j in range(slots)])
        if weights is not None:
            ref = ref * weights.reshape(-1, 1)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < tol, f"{order} {what}: {err:.3e}"
        assert LAUNCHED == [K.strip_kernel_name(fam, *order[0])], LAUNCHED

    for order in ([c] for c in K.STRIP_MOE_CONFIGS):
        monkeypatch.setattr(M, "STRIP_MOE_ORDER", tuple(order))
        # one token: block j holds slot j (one_token_tables), the router's ids as the expert table
        sorted_ids = lib.guarded(torch.tensor([[j] + [top_k] * 7 for j in range(top_k)], dtype=torch.int32).reshape(-1))
        num_padded = lib.guarded(torch.tensor([8 * top_k], dtype=torch.int32))
        tw = lib.guarded(torch.rand(top_k, generator=gen))
        for ids64, chosen in ((False, [3, 1]), (True, [0, 7])):  # (7: past the experts, clamped to 3)
            what = f"one token ids64={ids64}"
            ids = torch.tensor([chosen], dtype=torch.int64 if ids64 else torch.int32)
            table = lib.guarded(ids.view(torch.int32).reshape(-1) if ids64 else ids.reshape(-1))
            one = lib.guarded(torch.randn(1, k, generator=gen).to(dt))
            per_slot = lib.guarded(torch.randn(top_k, k, generator=gen).to(dt))
            check(one, chosen, sorted_ids, table, num_padded, None, top_k, int(ids64), e, [0, 0])
            check(per_slot, chosen, sorted_ids, table, num_padded, tw, 1, int(ids64), e, [0, 1])
        # 7 tokens through the alignment's tables (experts with 2-5 rows: padding, blocks past the padded list)
        tokens = 7
        topk_ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
        sorted_ids, expert_ids, num_padded = (lib.guarded(t) for t in M._align_torch(topk_ids, 8, e))
        flat = topk_ids.reshape(-1).tolist()
        x = lib.guarded(torch.randn(tokens, k, generator=gen).to(dt))
        weights = lib.guarded(torch.rand(tokens * top_k, generator=gen))
        what = "aligned"
        check(x, flat, sorted_ids, expert_ids, num_padded, None, top_k, 0, 0, [j // top_k for j in range(len(flat))])
        # activations gathered by position (row 8 block + g of the padded list): A[pos] = x[slot // top_k]
        what = "by position"
        pos_of = {int(sl): p_ for p_, sl in enumerate(sorted_ids.tolist()) if sl < len(flat)}
        gathered = torch.randn(sorted_ids.numel(), k, generator=gen).to(dt)
        for sl, p_ in pos_of.items():
            gathered[p_] = x[sl // top_k]
        gathered = lib.guarded(gathered)
        check(gathered, flat, sorted_ids, expert_ids, num_padded, weights, top_k, 0, 0,
              [pos_of[j] for j in range(len(flat))], by_position=True)


@pytest.mark.parametrize("header,old,block", [
    ("jm_gemm.cuh", "    if (!BULK || !p.tables_ready) griddep_wait();\n", 16),
    ("jm_strip.cuh", "    if (!p.tables_ready) griddep_wait();\n", 8),
], ids=["mma-sync-moe", "strip-moe"])
def test_emulator_catches_tables_read_before_the_wait(tmp_path, monkeypatch, header, old, block):
    """The MoE kernels' wait for the routing tables removed (the kernel before, the alignment, may still be writing
    them): the emulator stops the launch at the first early access (tests/test_simt_pdl.py has the rules); the
    shipped text passes the same call."""
    from jitmarlin.ops import gemm as G

    fam = FAMILIES[0]
    monkeypatch.setattr(G, "STRIP_ROUTE", block == 8)
    if block == 8:
        monkeypatch.setattr(M, "STRIP_MOE_ORDER", (K.STRIP_MOE_CONFIGS[0],))
        srcs = [(K.strip_kernel_name(fam, *K.STRIP_MOE_CONFIGS[0]), K.strip_kernel_source(fam, *K.STRIP_MOE_CONFIGS[0]))]
    else:
        srcs = [(K.kernel_name(fam, t), K.kernel_source(fam, t)) for t in K.tiles_for((9, 0)) if K.tile_fits(fam, t)]
    text = (emu.CUDA_SRC / header).read_text()
    assert text.count(old) == 1
    e, k, n, tokens, top_k = 4, 256, 128, 5, 2
    gen = torch.Generator().manual_seed(1)
    topk_ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    for mutate in (False, True):
        lib = emu.build(srcs, tmp_path / str(mutate), headers={header: text.replace(old, "")} if mutate else None)
        emu.emulated_device(monkeypatch, lib, (9, 0), sms=6, log=LAUNCHED)
        b, s, z, w, dt = experts(lib, e, k, n, fam, seed=2)
        a = lib.guarded(torch.randn(tokens, k, generator=gen).to(dt))
        tables = [lib.guarded(t) for t in M._align_torch(topk_ids, block, e)]
        LAUNCHED.clear()
        try:
            if mutate:
                with pytest.raises(emu.SimtError, match="griddepcontrol.wait"):
                    M._moe_gemm_cuda(a, b, s, z, *tables, None, tokens * top_k, top_k, block)
            else:
                out = M._moe_gemm_cuda(a, b, s, z, *tables, None, tokens * top_k, top_k, block)
                ref = torch.stack([a[t // top_k].float() @ w[int(topk_ids.view(-1)[t])] for t in range(tokens * top_k)])
                assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-3
            assert ("jm_strip_" if block == 8 else "jm_gemm_") in LAUNCHED[0], LAUNCHED
        finally:
            emu.clear_launch_caches()
            lib.free_all()
