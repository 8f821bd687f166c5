"""Model-level API on the CPU: quantize_model, the MoE registry and the Hugging Face adapters,
save_quantized / load_quantized, GPTQ / AWQ checkpoints loaded into whole models, the examples.

Construction, packing and .dequantize() of MarlinLinear / MarlinMoE work on the CPU; only the
kernels need a GPU. The `cpu_kernels` fixture swaps the two kernel entry points the modules
call (marlin_gemm in MarlinLinear.forward, fused_marlin_moe in MarlinMoEBlock.forward) for
plain-PyTorch references on the dequantized weights, so that whole quantized models -- their
wiring, routing, return conventions and generate() -- run here against float models that hold
the same (dequantized) weights. The kernels themselves are checked in tests/gpu/.

Tests that build Hugging Face models skip when transformers is not installed.
"""

from __future__ import annotations

import copy
import json
import py_compile
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jitmarlin
from jitmarlin.model import MarlinMoEBlock, MoESpec, QuantReport, init_empty_weights, load_quantized, \
    quantize_model, register_moe, save_quantized, unregister_moe
from jitmarlin.model import registry
from jitmarlin.model.io import MANIFEST, WEIGHTS
from jitmarlin.nn import MarlinLinear, MarlinMoE
from jitmarlin.quant import packed as packed_module
from jitmarlin.quant.packed import Packed

from .test_formats import write_awq, write_gptq_qweight, write_gptq_qzeros

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


# ================================================================ reference kernels (CPU)


def _deq(b, s, z):
    bits = b.shape[-1] // 32
    k = b.shape[-2] * 16
    groups = s.shape[0]
    return Packed(b, s, z, bits, -1 if groups == 1 else k // groups).dequantize(torch.float32)  # [K, N]


def ref_gemm(a, b, scales, zeros=None, bias=None, workspace=None, perm=None):
    if perm is not None:  # act-order: the packed rows are W[perm]
        a = a.index_select(-1, perm)
    out = a.float() @ _deq(b, scales, zeros)
    if bias is not None:
        out = out + bias.float()
    return out.to(a.dtype)


def ref_fused_moe(hidden, w13, s13, w2, s2, topk_weights, topk_ids, *, w13_zeros=None, w2_zeros=None,
                  w13_perm=None, w2_perm=None, block_size=None):
    """The experts of a MarlinMoE, expert by expert in fp32, rounded where the kernels round."""
    t, h = hidden.shape
    out = torch.zeros(t, h)
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        a = _deq(w13[e], s13[e], None if w13_zeros is None else w13_zeros[e])
        b = _deq(w2[e], s2[e], None if w2_zeros is None else w2_zeros[e])
        if w13_perm is not None:  # the packed rows are W[perm]
            a = torch.empty_like(a).index_copy_(0, w13_perm[e].long(), a)
        if w2_perm is not None:
            b = torch.empty_like(b).index_copy_(0, w2_perm[e].long(), b)
        inter = a.shape[1] // 2
        c1 = (hidden[tok].float() @ a).to(hidden.dtype).float()
        c2 = (F.silu(c1[:, :inter]) * c1[:, inter:]).to(hidden.dtype).float()
        out.index_add_(0, tok, ((c2 @ b) * topk_weights[tok, slot].float()[:, None]).to(hidden.dtype).float())
    return out.to(hidden.dtype)


@pytest.fixture
def cpu_kernels(monkeypatch):
    import jitmarlin.model.blocks as blocks
    import jitmarlin.nn.linear as linear

    calls = {"gemm": 0, "moe": 0}

    def gemm(*a, **k):
        calls["gemm"] += 1
        return ref_gemm(*a, **k)

    def moe(*a, **k):
        calls["moe"] += 1
        return ref_fused_moe(*a, **k)

    monkeypatch.setattr(linear, "marlin_gemm", gemm)
    monkeypatch.setattr(blocks, "fused_marlin_moe", moe)
    return calls


@pytest.fixture
def clean_registry():
    saved = list(registry._user)
    yield
    registry._user[:] = saved


def close(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (the criterion of the GPU tests as well)."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ================================================================ hand-built models


class ToyMLP(nn.Module):
    def __init__(self, h, i, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ToyLayer(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.q_proj = nn.Linear(h, h, bias=True)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp = ToyMLP(h, i)

    def forward(self, x):
        x = x + self.o_proj(torch.tanh(self.q_proj(self.norm(x))))
        return x + self.mlp(self.norm(x))


class ToyModel(nn.Module):
    """Embedding, two layers, a head tied to the embedding; a rotary-like non-persistent buffer and
    an integer buffer."""

    def __init__(self, vocab=128, h=256, i=384, layers=2, tie=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(ToyLayer(h, i) for _ in range(layers))
        self.norm = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("freq", torch.linspace(0.5, 1.5, h), persistent=False)
        self.register_buffer("steps", torch.arange(4), persistent=True)

    def forward(self, ids):
        x = self.embed(ids) * self.freq.to(self.embed.weight.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def toy_model(dtype=torch.float16, seed=0, **kw) -> ToyModel:
    torch.manual_seed(seed)
    m = ToyModel(**kw)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    return m.to(dtype)


class ToyExpert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.wg = nn.Linear(h, i, bias=False)
        self.wu = nn.Linear(h, i, bias=False)
        self.wd = nn.Linear(i, h, bias=False)


class ToyMoE(nn.Module):
    """A user's own MoE block (not a transformers class), computed in float."""

    def __init__(self, h=256, i=192, e=4, k=2):
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(ToyExpert(h, i) for _ in range(e))
        self.k = k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), -1)
        w, ids = torch.topk(probs, self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = ex.wd(F.silu(ex.wg(x[tok])) * ex.wu(x[tok]))
            out.index_add_(0, tok, (y.float() * w[tok, slot, None]).to(x.dtype))
        return out.reshape(shape)


def toy_adapter(block: ToyMoE) -> MoESpec:
    return MoESpec.from_module_list(block.router, block.experts, top_k=block.k, gate="wg", up="wu", down="wd",
                                    checkpoint_experts=("experts.{e}.wg", "experts.{e}.wu", "experts.{e}.wd"),
                                    checkpoint_router="router.weight")


class ToyMoEModel(nn.Module):
    def __init__(self, h=256):
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.moe = ToyMoE(h)
        self.out = nn.Linear(h, 64)

    def forward(self, x):
        return self.out(self.moe(self.proj(x)))


def toy_moe_model(seed=0, dtype=torch.float16) -> ToyMoEModel:
    torch.manual_seed(seed)
    m = ToyMoEModel()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
        m.moe.router.weight.mul_(10)  # decisive routing: no near-ties for rounding to flip
    return m.to(dtype)


# ================================================================ float reference with the dequantized weights


def _set_moe_weights(block: nn.Module, w13: torch.Tensor, w2: torch.Tensor, router: torch.Tensor) -> None:
    """Write float experts into a float MoE block (transformers 4.x / 5.x layouts, or ToyMoE)."""
    inter = w13.shape[1] // 2
    experts = block.experts
    with torch.no_grad():
        if isinstance(experts, nn.ModuleList):
            names = {"MixtralSparseMoeBlock": ("w1", "w3", "w2")}.get(type(block).__name__, None)
            if isinstance(block, ToyMoE):
                names = ("wg", "wu", "wd")
            names = names or ("gate_proj", "up_proj", "down_proj")
            for e, ex in enumerate(experts):
                getattr(ex, names[0]).weight.copy_(w13[e, :inter])
                getattr(ex, names[1]).weight.copy_(w13[e, inter:])
                getattr(ex, names[2]).weight.copy_(w2[e])
        else:
            experts.gate_up_proj.copy_(w13)
            experts.down_proj.copy_(w2)
        (block.router if isinstance(block, ToyMoE) else block.gate).weight.copy_(router)


def dequantized_reference(qmodel: nn.Module, fmodel: nn.Module) -> nn.Module:
    """A copy of the float model fmodel holding the weights qmodel computes with."""
    ref = copy.deepcopy(fmodel)
    with torch.no_grad():
        for name, m in qmodel.named_modules():
            if isinstance(m, MarlinLinear):
                lin = ref.get_submodule(name)
                lin.weight = nn.Parameter(m.dequantize().to(lin.weight.dtype))  # unties a tied head
                if m.bias is not None:
                    lin.bias.copy_(m.bias)
            elif isinstance(m, MarlinMoEBlock):
                w13, w2 = m.moe.dequantize()
                _set_moe_weights(ref.get_submodule(name), w13, w2, m.moe.router.weight)
    return ref


# ================================================================ quantize_model: nn.Linear


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(256, 128, bias=True)
        self.odd_in = nn.Linear(100, 64)
        self.odd_out = nn.Linear(256, 10)
        self.short_k = nn.Linear(192, 64)  # K=192: fine for group 64, not for group 128
        self.custom = _MyLinear(256, 64)
        self.lm_head = nn.Linear(256, 128)


class _MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _shapes_model(dtype=torch.float16):
    torch.manual_seed(1)
    return Shapes().to(dtype)


def test_linear_eligibility_and_reasons():
    m = _shapes_model()
    orig = copy.deepcopy(m)
    rep = quantize_model(m, device="cpu")
    assert isinstance(rep, QuantReport)
    assert isinstance(m.ok, MarlinLinear) and m.ok.bias is not None
    assert [r.name for r in rep.replaced] == ["ok"]
    kept = {k.name: k for k in rep.kept}
    assert set(kept) == {"odd_in", "odd_out", "short_k", "custom", "lm_head"}
    assert "K=100 (in_features) must be a positive multiple of 64" in kept["odd_in"].reason
    assert "N=10 (out_features) must be a positive multiple of 64" in kept["odd_out"].reason
    assert "K=192 must be a multiple of group_size=128" in kept["short_k"].reason
    assert "_MyLinear is a subclass of nn.Linear with its own forward" in kept["custom"].reason
    assert kept["lm_head"].reason == "skipped: matches 'lm_head'"
    for name in kept:
        assert type(getattr(m, name)) is type(getattr(orig, name))
        assert torch.equal(getattr(m, name).weight, getattr(orig, name).weight)
    # the quantized layer is exactly MarlinLinear.from_linear of the original
    direct = MarlinLinear.from_linear(orig.ok, bits=4, group_size=128)
    assert torch.equal(m.ok.qweight, direct.qweight) and torch.equal(m.ok.scales, direct.scales)
    assert torch.equal(m.ok.bias, orig.ok.bias)
    # with group 64 the K=192 layer fits
    m2 = _shapes_model()
    rep2 = quantize_model(m2, device="cpu", group_size=64, skip=())
    assert {r.name for r in rep2.replaced} == {"ok", "short_k", "lm_head"}
    assert isinstance(m2.short_k, MarlinLinear) and m2.short_k.group_size == 64


def test_report_bytes_and_text():
    m = _shapes_model()
    total = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    rep = quantize_model(m, device="cpu")
    assert rep.bytes_before == total
    assert rep.bytes_after == sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    (r,) = rep.replaced
    assert r.bytes_before == (256 * 128 + 128) * 2
    # 4-bit weights (K*N/2 bytes), fp16 scales per group of 128, fp16 bias
    assert r.bytes_after == 256 * 128 // 2 + (256 // 128) * 128 * 2 + 128 * 2
    assert rep.bytes_after == rep.bytes_before - r.bytes_before + r.bytes_after
    assert rep.num_linear == 1 and rep.num_moe == 0
    text = str(rep)
    assert text.splitlines()[0] == rep.summary()
    assert "replaced ok: Linear -> MarlinLinear [256->128, 4-bit, group 128]" in text
    assert "kept     odd_in (Linear): K=100" in text


@pytest.mark.parametrize("bits,group,sym,act_order", [(4, 128, True, False), (8, 64, False, True), (4, -1, True, True)])
def test_formats_follow_options(bits, group, sym, act_order):
    m = _shapes_model(torch.bfloat16)
    w = m.ok.weight.detach().float().clone()
    quantize_model(m, device="cpu", bits=bits, group_size=group, sym=sym, act_order=act_order)
    q = m.ok
    assert (q.bits, q.group_size, q.sym, q.dtype) == (bits, group, sym, torch.bfloat16)
    assert q.act_order == (act_order and group != -1)
    step = (w.abs().max() * 2 / (2 ** bits - 1)).item()
    assert (q.dequantize().float() - w).abs().max().item() <= step  # RTN: within one step everywhere


def test_skip_patterns():
    def names(skip):
        m = toy_model()
        rep = quantize_model(m, device="cpu", skip=skip)
        return {r.name for r in rep.replaced}, {k.name: k.reason for k in rep.kept}

    every = {f"layers.{i}.{n}" for i in range(2) for n in ("q_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                           "mlp.down_proj")}
    rep, kept = names(())
    assert rep == every | {"lm_head"} and not kept
    rep, kept = names("lm_head")  # a single string is one pattern
    assert rep == every and kept == {"lm_head": "skipped: matches 'lm_head'"}
    rep, kept = names(["*.down_proj", "layers.0.q_proj"])
    assert rep == every - {"layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "layers.0.q_proj"} | {"lm_head"}
    assert kept["layers.1.mlp.down_proj"] == "skipped: matches '*.down_proj'"
    rep, kept = names(("layers.1",))  # a whole subtree, by a name suffix
    assert rep == {n for n in every if n.startswith("layers.0.")} | {"lm_head"}
    assert set(kept) == {n for n in every if n.startswith("layers.1.")}
    assert all(r == "skipped: matches 'layers.1'" for r in kept.values())
    rep, kept = names(("ayers.1",))  # suffixes are whole name components
    assert "layers.1.q_proj" in rep
    with pytest.raises(TypeError, match=r"skip must be module-name patterns \(strings\), got int 3"):
        quantize_model(toy_model(), device="cpu", skip=("lm_head", 3))


def test_dtype_device_and_tied_weights():
    m = toy_model(torch.float32)
    assert m.lm_head.weight is m.embed.weight
    rep = quantize_model(m, device="cpu")  # fp32 model -> float16 by default
    assert rep.dtype == torch.float16 and rep.device == torch.device("cpu")
    assert m.embed.weight.dtype == torch.float16 and m.layers[0].norm.weight.dtype == torch.float16
    assert m.lm_head.weight is m.embed.weight  # skipped head still tied
    assert m.freq.dtype == torch.float32  # non-persistent buffers keep their dtype
    assert m.steps.dtype == torch.int64
    assert isinstance(m.layers[0].q_proj, MarlinLinear) and m.layers[0].q_proj.dtype == torch.float16
    m = toy_model(torch.float16)
    quantize_model(m, device="cpu", dtype=torch.bfloat16)
    assert m.embed.weight.dtype == torch.bfloat16 and m.layers[1].mlp.down_proj.dtype == torch.bfloat16


def test_forward_matches_float_model_on_dequantized_weights(cpu_kernels):
    f = toy_model()
    q = copy.deepcopy(f)
    quantize_model(q, device="cpu", act_order=True, skip=())
    ref = dequantized_reference(q, f)
    ids = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        out, want, orig = q(ids), ref(ids), f(ids)
    assert cpu_kernels["gemm"] == 11
    assert close(out, want) < 2e-3
    assert 0 < close(want, orig) < 0.5  # the quantization really changed the weights


def test_errors():
    with pytest.raises(ValueError, match=r"bits=3 is not supported: use 4 or 8"):
        quantize_model(toy_model(), device="cpu", bits=3)
    with pytest.raises(ValueError, match=r"group_size=100 is not supported"):
        quantize_model(toy_model(), device="cpu", group_size=100)
    with pytest.raises(TypeError, match=r"dtype=torch.float32 is not supported"):
        quantize_model(toy_model(), device="cpu", dtype=torch.float32)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got dict"):
        quantize_model({}, device="cpu")
    with pytest.raises(TypeError, match=r"the model itself is a Linear"):
        quantize_model(nn.Linear(64, 64), device="cpu")
    with pytest.raises(ValueError, match=r"device='tpu' is not a torch device"):
        quantize_model(toy_model(), device="tpu")
    with pytest.raises(ValueError, match=r"device='meta' is not supported: use a CUDA device"):
        quantize_model(toy_model(), device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' but torch.cuda.is_available\(\) is False"):
            quantize_model(toy_model())
    with torch.device("meta"):
        meta = ToyModel()
    with pytest.raises(ValueError, match=r"parameter 'embed.weight' is on the meta device"):
        quantize_model(meta, device="cpu", skip=())


def test_already_quantized_modules_are_left_alone():
    m = toy_model()
    quantize_model(m, device="cpu")
    qw = m.layers[0].q_proj.qweight
    rep = quantize_model(m, device="cpu")
    assert rep.replaced == [] and m.layers[0].q_proj.qweight is qw


# ================================================================ registry and custom MoE blocks


def test_register_custom_moe(cpu_kernels, clean_registry):
    f = toy_moe_model()
    q = copy.deepcopy(f)
    rep = quantize_model(q, device="cpu")
    assert not isinstance(q.moe, MarlinMoEBlock)  # unknown block: its linears one by one
    assert isinstance(q.moe.experts[0].wg, MarlinLinear)
    assert any(k.name == "moe.router" and "N=4" in k.reason for k in rep.kept)

    register_moe(ToyMoE, toy_adapter)
    q = copy.deepcopy(f)
    rep = quantize_model(q, device="cpu", group_size=64)
    assert isinstance(q.moe, MarlinMoEBlock) and isinstance(q.moe.moe, MarlinMoE)
    assert q.moe.returns_router_logits is False and q.moe.shared_expert is None
    r = next(r for r in rep.replaced if r.name == "moe")
    assert (r.kind, r.source) == ("MarlinMoE", "ToyMoE")
    assert r.detail == "[4 experts, top-2, H=256, I=192, 4-bit, group 64]"
    assert r.bytes_before == (4 * 3 * 256 * 192 + 4 * 256) * 2
    assert q.moe.moe.top_k == 2 and q.moe.moe.renormalize
    # the extracted experts are the float ones, quantized
    w13, w2 = q.moe.moe.dequantize()
    for e, ex in enumerate(f.moe.experts):
        want13 = torch.cat([ex.wg.weight, ex.wu.weight]).float()
        assert close(w13[e], want13) < 0.1 and close(w2[e], ex.wd.weight) < 0.1
    assert torch.equal(q.moe.moe.router.weight, f.moe.router.weight)
    # ... and the block computes what the float block computes with the dequantized experts
    ref = dequantized_reference(q, f)
    x = torch.randn(3, 4, 256, dtype=torch.float16)
    with torch.no_grad():
        out, want = q(x), ref(x)
    assert cpu_kernels["moe"] == 1 and out.shape == (3, 4, 64)
    assert close(out, want) < 5e-3
    assert unregister_moe(ToyMoE) and not unregister_moe(ToyMoE)


def test_toy_moe_group_and_keep_reasons(clean_registry):
    register_moe(ToyMoE, toy_adapter)
    q = toy_moe_model()
    rep = quantize_model(q, device="cpu")  # I=192 is not a multiple of the group 128
    (k,) = [k for k in rep.kept if k.name == "moe"]
    assert k.kind == "ToyMoE" and "experts with hidden=256, intermediate=192: K=192 must be a multiple of " \
                                  "group_size=128" in k.reason
    assert isinstance(q.moe.experts[0].wg, MarlinLinear)  # 256 -> 192 still fits as a linear
    q = toy_moe_model()
    rep = quantize_model(q, device="cpu", group_size=64, skip=("*.experts.2.wd",))
    (k,) = [k for k in rep.kept if k.name == "moe"]
    assert "skip pattern '*.experts.2.wd' matches its expert module 'moe.experts.2.wd'" in k.reason
    q = toy_moe_model()
    rep = quantize_model(q, device="cpu", group_size=64)
    assert isinstance(q.moe, MarlinMoEBlock) and q.moe.moe.group_size == 64


def test_registry_order_and_errors(clean_registry):
    calls = []

    def a1(block):
        calls.append("a1")
        return toy_adapter(block)

    def a2(block):
        calls.append("a2")
        raise ValueError("refused by a2")

    register_moe(ToyMoE, a1)
    register_moe(lambda m: isinstance(m, ToyMoE), a2)  # the most recent registration is tried first
    q = toy_moe_model()
    rep = quantize_model(q, device="cpu", group_size=64)
    assert calls == ["a2"] and not isinstance(q.moe, MarlinMoEBlock)
    assert [k.reason for k in rep.kept if k.name == "moe"] == ["refused by a2"]
    register_moe(ToyMoE, a1)  # registering the class again moves it to the front
    q = toy_moe_model()
    quantize_model(q, device="cpu", group_size=64)
    assert isinstance(q.moe, MarlinMoEBlock) and calls[-1] == "a1"
    with pytest.raises(TypeError, match=r"register_moe: int is not a torch.nn.Module subclass"):
        register_moe(int, a1)
    with pytest.raises(TypeError, match=r"must be an nn.Module subclass or a function module -> bool, got str"):
        register_moe("ToyMoE", a1)
    with pytest.raises(TypeError, match=r"adapter must be a function module -> MoESpec, got NoneType"):
        register_moe(ToyMoE, None)


def test_moespec_from_module_list_errors():
    b = ToyMoE()
    with pytest.raises(ValueError, match=r"expert 0 has no nn.Linear 'gate_proj' \(found NoneType\)"):
        MoESpec.from_module_list(b.router, b.experts, top_k=2)
    with pytest.raises(ValueError, match=r"experts must be an nn.ModuleList of 4 expert modules .* got 3"):
        MoESpec.from_module_list(b.router, nn.ModuleList(list(b.experts)[:3]), top_k=2, gate="wg", up="wu", down="wd")
    b.experts[1].wu = nn.Linear(256, 192, bias=True)
    with pytest.raises(ValueError, match=r"expert 1.wu has a bias: MarlinMoE experts have none"):
        MoESpec.from_module_list(b.router, b.experts, top_k=2, gate="wg", up="wu", down="wd")


def test_block_input_checks():
    block = toy_moe_model().moe
    spec = toy_adapter(block)
    moe = MarlinMoE.from_float(torch.stack([spec.gate_up(e) for e in range(4)]),
                               torch.stack([spec.down(e) for e in range(4)]), spec.router_weight, 2, group_size=64)
    wrapped = MarlinMoEBlock(moe)
    with pytest.raises(TypeError, match=r"input dtype torch.float32 differs from the quantized MoE block's "
                                        r"torch.float16"):
        wrapped(torch.randn(2, 256))
    with pytest.raises(ValueError, match=r"input has 128 features but the MoE block expects hidden_size=256"):
        wrapped(torch.randn(2, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"shared_expert_gate without a shared_expert"):
        MarlinMoEBlock(moe, shared_expert_gate=nn.Linear(256, 1))
    with pytest.raises(TypeError, match=r"moe must be a jitmarlin MarlinMoE, got Linear"):
        MarlinMoEBlock(nn.Linear(4, 4))


# ================================================================ Hugging Face MoE blocks


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")


def hf_model(kind: str, dtype=torch.float16, seed=0, norm_topk_prob=True, layers=2, top_k=2):
    """A tiny random-weight transformers model built from its config (no download). top_k="all"
    routes every token to every expert: whole-model logits can then be compared strictly, since
    no top-k selection exists that rounding differences upstream could flip (with top-2, a token
    whose 2nd and 3rd router scores tie within the rounding noise picks another expert in the
    float reference now and then; blocks are compared on identical inputs for that case)."""
    tf = _transformers()
    common = dict(vocab_size=128, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if int(tf.__version__.split(".")[0]) >= 5:
        common["experts_implementation"] = "eager"  # the float reference: the plain per-expert loop
    if kind == "llama":
        cfg, cls = tf.LlamaConfig(intermediate_size=512, **common), tf.LlamaForCausalLM
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=384, num_local_experts=4,
                               num_experts_per_tok=4 if top_k == "all" else top_k, **common)
        cls = tf.MixtralForCausalLM
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=512, moe_intermediate_size=128, shared_expert_intermediate_size=384,
                                num_experts=6, num_experts_per_tok=6 if top_k == "all" else top_k,
                                norm_topk_prob=norm_topk_prob, mlp_only_layers=[layers - 1], **common)
        cls = tf.Qwen2MoeForCausalLM
    elif kind == "qwen3_moe":
        if not hasattr(tf, "Qwen3MoeConfig"):
            pytest.skip(f"transformers {tf.__version__} has no Qwen3-MoE")
        cfg = tf.Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=128, num_experts=6,
                                num_experts_per_tok=6 if top_k == "all" else top_k, norm_topk_prob=norm_topk_prob,
                                head_dim=64, **common)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] in (4, 6):
                p.mul_(10)  # peaked routing, as trained routers have (random ones are nearly uniform)
    return model


MOE_KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _moe_blocks(model):
    return [(n, m) for n, m in model.named_modules() if registry._hf_kind(m) is not None]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_hf_adapter_extraction(kind):
    model = hf_model(kind)
    name, block = _moe_blocks(model)[0]
    spec = registry.find_adapter(block)(block)
    assert spec.name == kind and spec.num_experts in (4, 6) and spec.top_k == 2
    assert spec.hidden_size == 256 and spec.intermediate_size == (384 if kind == "mixtral" else 128)
    assert spec.renormalize is True
    assert spec.checkpoint_router == "gate.weight"
    g = "w1" if kind == "mixtral" else "gate_proj"
    assert spec.checkpoint_experts[0] == f"experts.{{e}}.{g}"
    sd = model.state_dict()
    layered = isinstance(block.experts, nn.ModuleList)
    for e in range(spec.num_experts):
        if layered:
            names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            want13 = torch.cat([sd[f"{name}.experts.{e}.{names[0]}.weight"], sd[f"{name}.experts.{e}.{names[1]}.weight"]])
            want2 = sd[f"{name}.experts.{e}.{names[2]}.weight"]
        else:
            want13, want2 = sd[f"{name}.experts.gate_up_proj"][e], sd[f"{name}.experts.down_proj"][e]
        assert torch.equal(spec.gate_up(e), want13) and torch.equal(spec.down(e), want2)
    assert torch.equal(spec.router_weight, sd[f"{name}.gate.weight"])
    assert (spec.shared_expert is not None) == (kind == "qwen2_moe")
    assert spec.returns_router_logits == layered  # transformers 4.x blocks return (hidden, router_logits)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_hf_qwen_renormalize_follows_norm_topk_prob(kind, norm):
    model = hf_model(kind, norm_topk_prob=norm)
    _, block = _moe_blocks(model)[0]
    assert registry.hf_moe_adapter(block).renormalize is norm
    quantize_model(model, device="cpu")
    assert all(b.moe.renormalize is norm for _, b in model.named_modules() if isinstance(b, MarlinMoEBlock))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_hf_block_replacement_mimics_the_block(kind, cpu_kernels):
    """The replacement returns what the transformers block returns (tuple or tensor, shapes,
    dtype) with the values of the float block on the dequantized weights."""
    f = hf_model(kind)
    q = copy.deepcopy(f)
    rep = quantize_model(q, device="cpu")
    ref = dequantized_reference(q, f)
    blocks = [(n, b) for n, b in q.named_modules() if isinstance(b, MarlinMoEBlock)]
    assert len(blocks) == (1 if kind == "qwen2_moe" else 2) == rep.num_moe
    name, block = blocks[0]
    x = torch.randn(2, 5, 256, dtype=torch.float16)
    with torch.no_grad():
        got, want = block(x), ref.get_submodule(name)(x)
    assert type(got) is type(want)
    if isinstance(want, tuple):
        assert len(got) == len(want) == 2
        assert got[1].shape == want[1].shape == (10, block.num_experts) and got[1].dtype == want[1].dtype
        assert close(got[1], want[1]) < 1e-3
        got, want = got[0], want[0]
    assert got.shape == want.shape == (2, 5, 256) and got.dtype == torch.float16
    assert close(got, want) < 5e-3
    if kind == "qwen2_moe":
        assert isinstance(block.shared_expert.gate_proj, MarlinLinear)
        assert type(block.shared_expert_gate) is nn.Linear
        assert any(k.name == f"{name}.shared_expert_gate" and "N=1 " in k.reason for k in rep.kept)
        assert isinstance(q.model.layers[1].mlp.down_proj, MarlinLinear)  # a dense (mlp_only) layer


@pytest.mark.parametrize("kind", ["llama"] + MOE_KINDS)
def test_hf_model_logits_and_generate(kind, cpu_kernels):
    f = hf_model(kind, top_k="all")
    q = copy.deepcopy(f)
    rep = quantize_model(q, device="cpu")
    assert rep.num_linear >= 8 and any(k.name == "lm_head" for k in rep.kept)
    ref = dequantized_reference(q, f)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lq, lr = q(ids).logits, ref(ids).logits
    assert lq.shape == (2, 9, 128)
    assert close(lq, lr) < 1e-2
    out = q.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7) and torch.equal(out[:, :4], ids[:1, :4])


def moe_blocks_in_context(q: nn.Module, ref: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """Run q on ids, catch what each MarlinMoEBlock receives and returns, run the reference's float
    block on exactly that input: {block name: max-relative error of the hidden output}. The
    return structure (tuple or not, router logits) must match."""
    seen = {}

    def catch(name):
        def hook(module, inputs, output):
            seen.setdefault(name, (inputs[0], output))  # returns None: the output is left alone
        return hook

    hooks = [m.register_forward_hook(catch(n)) for n, m in q.named_modules() if isinstance(m, MarlinMoEBlock)]
    try:
        with torch.no_grad():
            q(ids)
    finally:
        for h in hooks:
            h.remove()
    errors = {}
    for name, (x, got) in seen.items():
        with torch.no_grad():
            want = ref.get_submodule(name)(x)
        assert type(got) is type(want), name
        if isinstance(want, tuple):
            assert torch.equal(got[1], want[1]), f"{name}: router logits differ"
            got, want = got[0], want[0]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        errors[name] = close(got, want)
    return errors


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_hf_moe_blocks_in_context(kind, cpu_kernels):
    """Top-2 routing inside the model: every block against the float block on its actual input."""
    f = hf_model(kind)
    q = copy.deepcopy(f)
    quantize_model(q, device="cpu")
    errors = moe_blocks_in_context(q, dequantized_reference(q, f), torch.randint(0, 128, (3, 40)))
    assert len(errors) == (1 if kind == "qwen2_moe" else 2)
    assert max(errors.values()) < 5e-3, errors


def test_hf_act_order_and_zero_points(cpu_kernels):
    f = hf_model("mixtral", top_k="all")
    q = copy.deepcopy(f)
    quantize_model(q, device="cpu", act_order=True, sym=False, group_size=64)
    block = q.model.layers[0]
    moe = next(m for m in q.modules() if isinstance(m, MarlinMoE))
    assert moe.w13_perm is not None and moe.w13_qzeros is not None and moe.group_size == 64
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert close(q(ids).logits, dequantized_reference(q, f)(ids).logits) < 1e-2
    assert block is not None


# ================================================================ save_quantized / load_quantized


def _assert_same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_save_load_round_trip_toy(tmp_path, cpu_kernels, monkeypatch):
    q = toy_model()
    quantize_model(q, device="cpu", act_order=True)
    out = save_quantized(q, tmp_path / "saved")
    assert out == tmp_path / "saved" and (out / WEIGHTS).is_file()
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == "jitmarlin-marlin-packed" and manifest["jitmarlin"] == jitmarlin.__version__
    assert manifest["tied"] == {"lm_head.weight": "embed.weight"}
    assert manifest["modules"]["layers.0.q_proj"] == {
        "class": "MarlinLinear", "in_features": 256, "out_features": 256, "bits": 4, "group_size": 128,
        "zero_points": False, "act_order": True, "bias": True, "dtype": "float16"}
    fresh = toy_model(seed=5)  # other float values everywhere
    rep = load_quantized(fresh, out, device="cpu")
    assert rep.num_linear == 10 and not rep.missing_keys and not rep.unexpected_keys
    _assert_same_state(fresh, q)
    assert fresh.lm_head.weight is fresh.embed.weight
    ids = torch.randint(0, 128, (2, 4))
    with torch.no_grad():
        assert torch.equal(fresh(ids), q(ids))
    # the weights file itself names the saved model too; and nothing is repacked on the way
    def no_packing(*a, **k):
        raise AssertionError("load_quantized repacked weights")

    monkeypatch.setattr(packed_module, "pack_weights", no_packing)
    again = toy_model(seed=6)
    load_quantized(again, out / WEIGHTS, device="cpu")
    _assert_same_state(again, q)
    with pytest.raises(AssertionError, match="repacked"):  # the guard works: quantizing does pack
        quantize_model(toy_model(), device="cpu")


def test_load_into_meta_model(tmp_path):
    q = toy_model()
    quantize_model(q, device="cpu")
    save_quantized(q, tmp_path)
    with init_empty_weights():
        meta = ToyModel()
    assert meta.embed.weight.is_meta and not meta.freq.is_meta
    load_quantized(meta, tmp_path, device="cpu")
    _assert_same_state(meta, q)
    assert meta.lm_head.weight is meta.embed.weight
    assert not any(t.is_meta for t in list(meta.parameters()) + list(meta.buffers()))
    with torch.device("meta"):
        all_meta = ToyModel()
    with pytest.raises(ValueError, match=r"buffer 'freq' is on the meta device and no checkpoint holds it .*"
                                         r"jitmarlin.init_empty_weights\(\)"):
        load_quantized(all_meta, tmp_path, device="cpu")


def test_save_load_moe_custom_and_errors(tmp_path, clean_registry, cpu_kernels):
    register_moe(ToyMoE, toy_adapter)
    q = toy_moe_model()
    quantize_model(q, device="cpu", group_size=64, act_order=True)
    save_quantized(q, tmp_path)
    entry = json.loads((tmp_path / MANIFEST).read_text())["modules"]["moe"]
    assert entry["class"] == "MarlinMoEBlock" and entry["source"] == "ToyMoE" and entry["act_order"]
    fresh = toy_moe_model(seed=3)
    load_quantized(fresh, tmp_path, device="cpu")
    _assert_same_state(fresh, q)
    x = torch.randn(5, 256, dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(fresh(x), q(x))
    unregister_moe(ToyMoE)
    with pytest.raises(ValueError, match=r"'moe' was saved as a MarlinMoEBlock \(from ToyMoE\) but the model's ToyMoE "
                                         r"there is no known MoE block: register it with jitmarlin.register_moe"):
        load_quantized(toy_moe_model(), tmp_path, device="cpu")
    with pytest.raises(ValueError, match=r"'layers.0.q_proj' was saved as a MarlinLinear\(256, 256\) but the model has "
                                         r"Linear\(256, 128\)"):
        t = toy_model()
        quantize_model(t, device="cpu")
        save_quantized(t, tmp_path / "toy")
        other = toy_model()
        other.layers[0].q_proj = nn.Linear(256, 128)
        load_quantized(other, tmp_path / "toy", device="cpu")
    with pytest.raises(ValueError, match=r"module 'layers.1.mlp.down_proj' not found in the model"):
        load_quantized(toy_model(layers=1), tmp_path / "toy", device="cpu")
    with pytest.raises(ValueError, match=r"holds a model saved by jitmarlin.save_quantized: quant_config is not used"):
        load_quantized(toy_model(), tmp_path / "toy", {"quant_method": "gptq", "bits": 4, "group_size": 128},
                       device="cpu")
    with pytest.raises(ValueError, match=r"the model has no MarlinLinear / MarlinMoE modules"):
        save_quantized(toy_model(), tmp_path / "none")
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 but the saved model is float16"):
        load_quantized(toy_model(), tmp_path / "toy", device="cpu", dtype=torch.bfloat16)


def test_standalone_marlin_moe_round_trip(tmp_path):
    class Holder(nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.inner = moe
            self.proj = nn.Linear(256, 256)

    torch.manual_seed(0)
    w13 = torch.randn(3, 2 * 128, 256, dtype=torch.float16) * 0.05
    w2 = torch.randn(3, 256, 128, dtype=torch.float16) * 0.05
    router = torch.randn(3, 256, dtype=torch.float16)
    h = Holder(MarlinMoE.from_float(w13, w2, router, 1, renormalize=False)).half()
    save_quantized(h, tmp_path)
    assert json.loads((tmp_path / MANIFEST).read_text())["modules"]["inner"]["class"] == "MarlinMoE"
    fresh = Holder(nn.Identity()).half()
    load_quantized(fresh, tmp_path, device="cpu")
    assert isinstance(fresh.inner, MarlinMoE) and fresh.inner.top_k == 1 and not fresh.inner.renormalize
    _assert_same_state(fresh, h)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_hf_save_load_round_trip(kind, tmp_path, cpu_kernels):
    q = hf_model(kind)
    quantize_model(q, device="cpu")
    save_quantized(q, tmp_path)
    fresh = hf_model(kind, seed=7)
    rep = load_quantized(fresh, tmp_path, device="cpu")
    assert rep.num_moe == (1 if kind == "qwen2_moe" else 2)
    _assert_same_state(fresh, q)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, q(ids).logits)
    # and into a skeleton without memory
    tf = _transformers()
    with init_empty_weights():
        skeleton = type(q)(q.config)
    load_quantized(skeleton, tmp_path, device="cpu")
    _assert_same_state(skeleton, q)
    assert tf is not None


# ================================================================ GPTQ / AWQ checkpoints


def _gptq_tensors(k, n, *, bits, group, sym, act_order, fmt, rng, g_idx=None, dtype=torch.float16):
    """Random GPTQ tensors of one [K, N] layer written with the public format (the numpy writers
    of tests/test_formats.py) and the float weight [N, K] (nn.Linear layout) they stand for."""
    g = k if group == -1 else group
    groups = k // g
    q = rng.integers(0, 1 << bits, size=(k, n))
    z = np.full((groups, n), 1 << (bits - 1)) if sym else rng.integers(0, 1 << bits, size=(groups, n))
    # weights of a trained layer's size (|w| up to ~0.06), so that the models' activations stay in range
    top = 4e-3 if bits == 4 else 2.5e-4
    s = torch.from_numpy(rng.uniform(top / 8, top, size=(groups, n)).astype(np.float32)).to(dtype)
    if g_idx is None:
        if act_order:
            p = rng.permutation(k)
            g_idx = np.empty(k, dtype=np.int64)
            g_idx[p] = np.arange(k) // g
        else:
            g_idx = np.arange(k) // g
    gi = torch.from_numpy(g_idx)
    w = s.float()[gi] * (torch.from_numpy(q) - torch.from_numpy(z)[gi]).float()  # [K, N]
    t = {"qweight": write_gptq_qweight(q, bits), "qzeros": write_gptq_qzeros(z, bits, fmt), "scales": s,
         "g_idx": gi.to(torch.int32)}
    return t, w.t().contiguous(), g_idx


def _awq_tensors(k, n, *, group, rng, dtype=torch.float16):
    groups = k // group
    q = rng.integers(0, 16, size=(k, n))
    z = rng.integers(0, 16, size=(groups, n))
    s = torch.from_numpy(rng.uniform(5e-4, 4e-3, size=(groups, n)).astype(np.float32)).to(dtype)
    gi = torch.arange(k) // group
    w = s.float()[gi] * (torch.from_numpy(q) - torch.from_numpy(z)[gi]).float()
    return {"qweight": write_awq(q), "qzeros": write_awq(z), "scales": s}, w.t().contiguous()


def write_checkpoint(model: nn.Module, directory: Path, cfg: dict, *, moe_prefixes=(), seed=0, skip=("lm_head",)):
    """Turn a float model into a GPTQ/AWQ checkpoint on disk: every nn.Linear (not skipped, kernel
    shapes) and the per-expert linears of the listed MoE blocks get random quantized tensors;
    everything else is stored as float. Returns {module name: float weight [N, K]} and
    {block: (w13 [E, 2I, H], w2 [E, H, I])}: what the loaded modules must dequantize to."""
    from jitmarlin.quant.checkpoint import save_safetensors

    rng = np.random.default_rng(seed)
    method = cfg["quant_method"]
    bits, group = cfg.get("bits", 4), cfg.get("group_size", 128)
    sym, act = cfg.get("sym", method == "gptq"), cfg.get("desc_act", False)
    fmt = cfg.get("checkpoint_format", "gptq")
    sd: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    experts: dict[str, tuple] = {}

    def quantized(prefix, n, k, g_idx=None):
        if method == "awq":
            t, w = _awq_tensors(k, n, group=group, rng=rng)
            g_idx = None
        else:
            t, w, g_idx = _gptq_tensors(k, n, bits=bits, group=group, sym=sym, act_order=act, fmt=fmt, rng=rng,
                                        g_idx=g_idx)
        sd.update({prefix + key: v for key, v in t.items()})
        return w, g_idx

    owned = []  # names (modules and tensors) the MoE blocks' experts and routers cover
    for block_name in moe_prefixes:
        block = model.get_submodule(block_name)
        spec = registry.find_adapter(block)(block)
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        w13, w2 = [], []
        for x in range(e):
            gname, uname, dname = (f"{block_name}.{f.format(e=x)}." for f in spec.checkpoint_experts)
            wg, g_idx = quantized(gname, i, h)
            wu, _ = quantized(uname, i, h, g_idx=g_idx)  # gate and up see the same input: same groups
            wd, _ = quantized(dname, h, i)
            w13.append(torch.cat([wg, wu]))
            w2.append(wd)
        experts[block_name] = (torch.stack(w13), torch.stack(w2))
        sd[f"{block_name}.{spec.checkpoint_router}"] = spec.router_weight.detach().clone()
        owned += [f"{block_name}.{m}" for m in spec.expert_modules] + [f"{block_name}.{spec.checkpoint_router}"]

    def covered(name):
        return any(name == o or name.startswith(o + ".") for o in owned)

    for name, m in model.named_modules():
        if covered(name):
            continue
        if isinstance(m, nn.Linear) and not any(name.endswith(s) for s in skip) and m.in_features % 64 == 0 \
                and m.out_features % 64 == 0 and m.in_features % max(group, 1) == 0:
            dense[name], _ = quantized(name + ".", m.out_features, m.in_features)
            if m.bias is not None:
                sd[name + ".bias"] = m.bias.detach().clone()
    for key, t in model.state_dict().items():
        if key.rpartition(".")[0] in dense or covered(key) or key in sd:
            continue
        sd[key] = t.clone()
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(sd, directory / "model.safetensors")
    (directory / "quantize_config.json").write_text(json.dumps(cfg))
    return dense, experts


GPTQ_CASES = [
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True},
    {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": True, "sym": False,
     "checkpoint_format": "gptq_v2"},
    {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
]


def _case_id(c):
    return f"{c['quant_method']}-{c['bits']}b-g{c['group_size']}{'-act' if c.get('desc_act') else ''}" \
           f"{'-v2' if c.get('checkpoint_format') == 'gptq_v2' else ''}"


@pytest.mark.parametrize("cfg", GPTQ_CASES, ids=_case_id)
def test_checkpoint_into_toy_model(cfg, tmp_path, cpu_kernels):
    src = toy_model(seed=2, tie=False)
    dense, _ = write_checkpoint(src, tmp_path, cfg)
    for meta in (False, True):
        if meta:
            with init_empty_weights():
                model = ToyModel(tie=False)
        else:
            model = toy_model(seed=9, tie=False)
        rep = load_quantized(model, tmp_path, device="cpu")
        assert rep.num_linear == len(dense) == 10 and rep.dtype == torch.float16
        assert not rep.unexpected_keys and not rep.missing_keys
        for name, w in dense.items():
            layer = model.get_submodule(name)
            assert isinstance(layer, MarlinLinear)
            assert torch.equal(layer.dequantize(), w.to(torch.float16)), name
            assert layer.bits == cfg["bits"] and layer.group_size == cfg["group_size"]
        assert model.layers[0].q_proj.bias is not None and torch.equal(model.layers[0].q_proj.bias,
                                                                         src.layers[0].q_proj.bias)
        assert torch.equal(model.embed.weight, src.embed.weight) and torch.equal(model.lm_head.weight, src.lm_head.weight)
        assert isinstance(model.lm_head, nn.Linear)
        ids = torch.randint(0, 128, (1, 3))
        with torch.no_grad():
            model(ids)


@pytest.mark.parametrize("cfg", GPTQ_CASES, ids=_case_id)
def test_checkpoint_into_custom_moe(cfg, tmp_path, clean_registry, cpu_kernels):
    register_moe(ToyMoE, toy_adapter)
    src = toy_moe_model()
    dense, experts = write_checkpoint(src, tmp_path, {**cfg, "group_size": 64}, moe_prefixes=("moe",), skip=())
    model = toy_moe_model(seed=4)
    rep = load_quantized(model, tmp_path, device="cpu")
    assert rep.num_moe == 1 and isinstance(model.moe, MarlinMoEBlock)
    w13, w2 = model.moe.moe.dequantize()
    assert torch.equal(w13, experts["moe"][0].half()) and torch.equal(w2, experts["moe"][1].half())
    assert torch.equal(model.moe.moe.router.weight, src.moe.router.weight)
    assert (model.moe.moe.w13_perm is not None) == bool(cfg.get("desc_act"))
    assert set(dense) == {"proj", "out"} and torch.equal(model.proj.dequantize(), dense["proj"].half())


@pytest.mark.parametrize("kind", MOE_KINDS + ["llama"])
@pytest.mark.parametrize("cfg", GPTQ_CASES[:2] + GPTQ_CASES[3:], ids=_case_id)
def test_checkpoint_into_hf_model(kind, cfg, tmp_path, cpu_kernels):
    src = hf_model(kind)
    blocks = [n for n, _ in _moe_blocks(src)]
    dense, experts = write_checkpoint(src, tmp_path, {**cfg, "group_size": 64}, moe_prefixes=blocks)
    with init_empty_weights():
        model = type(src)(src.config)
    rep = load_quantized(model, tmp_path, device="cpu")
    assert rep.num_moe == len(blocks) and rep.num_linear == len(dense)
    for name, (w13, w2) in experts.items():
        block = model.get_submodule(name)
        assert isinstance(block, MarlinMoEBlock)
        d13, d2 = block.moe.dequantize()
        assert torch.equal(d13, w13.half()) and torch.equal(d2, w2.half())
    for name, w in dense.items():
        assert torch.equal(model.get_submodule(name).dequantize(), w.half()), name
    ids = torch.randint(0, 128, (1, 4))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_checkpoint_state_dict_and_errors(tmp_path, clean_registry):
    from jitmarlin.quant.checkpoint import QuantConfig, load_safetensors

    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    src = toy_model(tie=False)
    dense, _ = write_checkpoint(src, tmp_path, cfg)
    sd = dict(load_safetensors(tmp_path))
    model = toy_model(seed=1, tie=False)
    rep = load_quantized(model, sd, QuantConfig.from_dict(cfg), device="cpu")
    assert rep.num_linear == 10
    rep = load_quantized(toy_model(tie=False), tmp_path / "model.safetensors", device="cpu")  # config beside it
    assert rep.num_linear == 10
    m = toy_model(tie=False)
    with pytest.raises(ValueError, match=r"'layers.0.q_proj': .*group"):  # an explicit config wins over the file's
        load_quantized(m, tmp_path, {**cfg, "group_size": 64}, device="cpu")
    with pytest.raises(ValueError, match=r"a state dict needs quant_config"):
        load_quantized(toy_model(tie=False), sd, device="cpu")
    with pytest.raises(TypeError, match=r"quant_config must be a QuantConfig or a dict, got str"):
        load_quantized(toy_model(tie=False), sd, "gptq", device="cpu")
    extra = dict(sd)
    extra["ghost.qweight"] = sd["layers.0.q_proj.qweight"]
    with pytest.raises(ValueError, match=r"quantized layers the model has no nn.Linear or MoE block for: ghost"):
        load_quantized(toy_model(tie=False), extra, cfg, device="cpu")
    odd = dict(sd)
    odd["stray.weight"] = torch.zeros(3)
    del odd["norm.bias"]
    with pytest.warns(UserWarning) as caught:
        rep = load_quantized(toy_model(tie=False), odd, cfg, device="cpu")
    assert sorted(str(w.message) for w in caught) == [
        "load_quantized: 1 checkpoint tensor(s) match nothing in the model and were ignored: stray.weight",
        "load_quantized: 1 model tensor(s) are not in the checkpoint and keep their values: norm.bias"]
    assert rep.unexpected_keys == ["stray.weight"] and rep.missing_keys == ["norm.bias"]
    with init_empty_weights():
        meta = ToyModel(tie=False)
    with pytest.raises(ValueError, match=r"'norm.bias' is on the meta device and the checkpoint has no tensor for it"):
        load_quantized(meta, odd, cfg, device="cpu")
    bad = dict(sd)
    bad["embed.weight"] = torch.zeros(10, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'embed.weight' has shape \(10, 256\) but the model's is "
                                         r"\(128, 256\)"):
        load_quantized(toy_model(tie=False), bad, cfg, device="cpu")
    small = toy_model(tie=False)
    small.layers[0].q_proj = nn.Linear(256, 128)
    with pytest.raises(ValueError, match=r"'layers.0.q_proj': the checkpoint's layer is 256 -> 256 but the model's "
                                         r"nn.Linear is 256 -> 128"):
        load_quantized(small, sd, cfg, device="cpu")
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist"):
        load_quantized(toy_model(), tmp_path / "nowhere", device="cpu")
    # a MoE block with only some experts quantized
    register_moe(ToyMoE, toy_adapter)
    src = toy_moe_model()
    write_checkpoint(src, tmp_path / "moe", {**cfg, "group_size": 64}, moe_prefixes=("moe",), skip=())
    msd = dict(load_safetensors(tmp_path / "moe"))
    for key in [k for k in msd if k.startswith("moe.experts.1.wd.")]:
        del msd[key]
    with pytest.raises(ValueError, match=r"MoE block 'moe': the checkpoint quantizes some experts but not "
                                         r"moe.experts.1.wd.qweight"):
        load_quantized(toy_moe_model(), msd, {**cfg, "group_size": 64}, device="cpu")


# ================================================================ examples


EXAMPLE_SCRIPTS = ["quantize_hf_model.py", "load_gptq_checkpoint.py", "moe_custom_model.py"]


def test_examples_exist_and_compile(tmp_path):
    for name in EXAMPLE_SCRIPTS:
        py_compile.compile(str(EXAMPLES / name), cfile=str(tmp_path / (name + "c")), doraise=True)
    sh = EXAMPLES / "prebuild_cache.sh"
    assert sh.is_file()
    r = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "jitmarlin build" in sh.read_text() and "--arch" in sh.read_text()


@pytest.mark.parametrize("name", EXAMPLE_SCRIPTS)
def test_example_help(name, subprocess_env):
    r = subprocess.run([sys.executable, str(EXAMPLES / name), "--help"], capture_output=True, text=True,
                       env=subprocess_env, timeout=120, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:") and "Traceback" not in r.stderr


def test_prebuild_script_help(subprocess_env):
    r = subprocess.run(["bash", str(EXAMPLES / "prebuild_cache.sh"), "--help"], capture_output=True, text=True,
                       env=subprocess_env, timeout=60, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout.lower()


# ================================================================ demo


def test_demo_model_check_on_cpu(cpu_kernels, clean_registry, capsys):
    """The quantize_model part of `jitmarlin demo`, run here with the reference kernels."""
    from jitmarlin import demo

    assert demo.model_check(torch.device("cpu"), vocab=1024, hidden=512, heads=4, inter=1024, moe_inter=256) is True
    out = capsys.readouterr().out
    assert "quantize_model on a 2-layer decoder (CPU -> cpu)" in out
    assert "11 nn.Linear -> MarlinLinear, 1 MoE block(s) -> MarlinMoE, 1 kept in float" in out
    assert cpu_kernels["moe"] == 1 and cpu_kernels["gemm"] == 11
