"""The whole MoE expert chain of jitmarlin.ops.moe (router kernel, alignment or the one-token tables, gate/up GEMM,
SiLU-mul, down GEMM with the routing weights, top-k sum; act-order experts through the gathers by position) run on
the CPU by the SIMT emulator, as fused_marlin_moe launches it, against a plain-PyTorch reference on the dequantized
experts; and the chain rule of programmatic dependent launch checked on the kernels actually launched
(tests/simt/emu.py, Stream): a GEMM that reads its routing tables before its wait (tables_ready) must not run
beside the kernel that wrote them. A mutation (the gate/up GEMM letting the next kernel start before its own wait)
shows the rule catching the race that would follow.

The tensors are CPU tensors in guarded memory; `Tensor.is_cuda` reads True during the call so the chain takes its
CUDA branches, whose kernels the emulated device runs (jitmarlin's custom ops call their CUDA implementations).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.ops import moe as M
from jitmarlin.quant import dequantize, pack_weights, permute_scales

from .simt import emu

pytestmark = pytest.mark.skipif(not emu.has_compiler(), reason="needs a host C++ compiler (g++) for the emulator")

FAM = K.Family("f16", 4, False, 128, moe=True)
E, H, INTER, TOP_K = 4, 256, 256, 2
LAUNCHED: list[str] = []


def sources():
    srcs = list(K.moe_util_build_spec((9, 0)).sources)
    srcs += [(K.kernel_name(FAM, t), K.kernel_source(FAM, t)) for t in K.tiles_for((9, 0)) if K.tile_fits(FAM, t)]
    srcs += [(K.strip_kernel_name(FAM, *c), K.strip_kernel_source(FAM, *c)) for c in K.STRIP_MOE_CONFIGS]
    return srcs


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    library = emu.build(sources(), tmp_path_factory.mktemp("simtchain"))
    yield library
    library.free_all()


def experts(k, n, seed, act_order):
    """Packed experts [E, n/64, k/16, 128], their scales, the dequantized [k, n] weights, and (act-order) each
    expert's column order of its input (the packed rows are in that order)."""
    gen = torch.Generator().manual_seed(seed)
    bs, ss, ws, perms = [], [], [], []
    for _ in range(E):
        q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        s = (torch.rand(k // 128, n, generator=gen) * 0.02 + 0.005).half()
        bs.append(pack_weights(q, 4))
        ss.append(permute_scales(s))
        ws.append(dequantize(q, s, None, 4, 128).float())
        perms.append(torch.randperm(k, generator=gen).to(torch.int32))
    return torch.stack(bs), torch.stack(ss), ws, (torch.stack(perms) if act_order else None)


def reference(x, weights, ids, w13, w2, p13, p2):
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xin = x[t].float() if p13 is None else x[t].float()[p13[e].long()]
            c1 = xin @ w13[e]
            a = F.silu(c1[:INTER]) * c1[INTER:]
            out[t] += weights[t, j] * ((a if p2 is None else a[p2[e].long()]) @ w2[e])
    return out


def run_chain(monkeypatch, lib, tokens, act_order, strip=False, seed=0):
    """Router kernel on random logits, then fused_marlin_moe, on the emulated device; (output, reference). strip:
    the strip kernel's MoE form forced on (gemm.STRIP_ROUTE), else off (moe.STRIP_MOE_MAX_BLOCKS 0: the mma.sync
    tiles, which the default rule would replace on these small tables since session 55)."""
    b13, s13, w13, p13 = experts(H, 2 * INTER, 1, act_order)
    b2, s2, w2, p2 = experts(INTER, H, 2, act_order)
    gen = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, H, generator=gen).half()
    logits = (torch.randn(tokens, E, generator=gen) * 2).half()
    ws, state = emu.emulated_device(monkeypatch, lib, (9, 0), sms=6, log=LAUNCHED)
    monkeypatch.setattr(G, "STRIP_ROUTE", strip)
    monkeypatch.setattr(M, "STRIP_MOE_MAX_BLOCKS", M.STRIP_MOE_MAX_BLOCKS if strip else 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    g = lib.guarded
    LAUNCHED.clear()
    try:
        weights, ids = M.route_topk(g(logits), TOP_K, True)
        out = M.fused_marlin_moe(g(x), g(b13), g(s13), g(b2), g(s2), weights, ids,
                                 w13_perm=None if p13 is None else g(p13), w2_perm=None if p2 is None else g(p2))
    finally:
        monkeypatch.undo()
    assert int(ws.counters.abs().sum()) == 0, "arrival counters not reset"
    return out, reference(x, weights, ids, w13, w2, p13, p2)


@pytest.mark.parametrize("tokens,act_order,strip", [(1, False, False), (1, False, True), (7, False, False),
                                                     (7, False, True), (7, True, False)],
                         ids=["1tok", "1tok-strip", "7tok", "7tok-strip", "7tok-act-order"])
def test_moe_chain_emulated(monkeypatch, lib, tokens, act_order, strip):
    out, ref = run_chain(monkeypatch, lib, tokens, act_order, strip)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-3, f"rel err {err:.3e}; launched {LAUNCHED}"
    assert LAUNCHED[0].startswith("jm_moe_route") and LAUNCHED[-1].startswith("jm_topk_sum"), LAUNCHED
    assert ("jm_moe_align" in LAUNCHED) == (tokens > 1 or act_order), LAUNCHED
    if act_order:
        assert any(n.startswith("jm_moe_gather") for n in LAUNCHED), LAUNCHED
    assert sum(n.startswith("jm_strip_") for n in LAUNCHED) == (2 if strip else 0), LAUNCHED


@pytest.mark.parametrize("header,old,strip", [
    ("jm_gemm.cuh", "    if (!BULK || !p.tables_ready) griddep_wait();\n", False),
    ("jm_strip.cuh", "    if (!p.tables_ready) griddep_wait();\n", True),
], ids=["mma-sync", "strip"])
def test_chain_rule_catches_an_early_trigger(monkeypatch, tmp_path, header, old, strip):
    """The gate/up GEMM (mma.sync MoE tiles, or the strip kernel's MoE form) lets the next kernel launch before its own
    wait: SiLU-mul, then the down projection (tables_ready) may start while the alignment (or, at one token, the
    router) still writes the tables the down projection reads before its wait — the emulator stops the launch naming
    the writer."""
    text = (emu.CUDA_SRC / header).read_text()
    assert text.count(old) == 1
    bad = emu.build(sources(), tmp_path, headers={header: text.replace(old, "    griddep_launch_dependents();\n" + old)})
    try:
        for tokens, writer in ((7, "jm_moe_align"), (1, "jm_moe_route")):
            with pytest.raises(emu.SimtError, match=f"griddepcontrol.wait.*written by {writer}"):
                run_chain(monkeypatch, bad, tokens, False, strip)
    finally:
        bad.free_all()
