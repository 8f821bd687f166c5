"""fuse_projections on the CPU (reference kernels of test_model_cpu): fused q/k/v and gate/up give
the unfused model's outputs, the slice cache cannot serve a stale or foreign input, formats that
cannot be fused are reported, and fused models refuse to be saved."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import jitmarlin
from jitmarlin.model import FusedSlice, fuse_linears, fuse_projections, quantize_model, save_quantized
from jitmarlin.nn import MarlinLinear

from .test_model_cpu import close, cpu_kernels, hf_model  # noqa: F401 - cpu_kernels is a fixture


def _seeded_linear(k, n, bias, seed):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias, dtype=torch.float16)


def _layers(n_out=(256, 128, 128), k=256, seed=0, bias=False, **opts):
    return [MarlinLinear.from_linear(_seeded_linear(k, n, bias, seed + i), **opts) for i, n in enumerate(n_out)]


@pytest.mark.parametrize("opts", [dict(), dict(bits=8, group_size=64, bias=True), dict(group_size=-1)])
def test_fuse_linears_is_the_concatenation(cpu_kernels, opts):
    layers = _layers(**opts)
    fused = fuse_linears(layers)
    assert fused.out_features == sum(m.out_features for m in layers)
    want = torch.cat([m.dequantize() for m in layers], 0)
    assert torch.equal(fused.dequantize(), want)
    x = torch.randn(3, 256, dtype=torch.float16)
    assert close(fused(x), torch.cat([m(x) for m in layers], -1)) < 1e-3


def test_fuse_linears_rejects_mixed_formats():
    a = MarlinLinear.from_linear(_seeded_linear(256, 128, False, 0))
    b = MarlinLinear.from_linear(_seeded_linear(256, 128, False, 1), bits=8)
    c = MarlinLinear.from_linear(_seeded_linear(256, 128, True, 2))
    with pytest.raises(ValueError, match="bits differs"):
        fuse_linears([a, b])
    with pytest.raises(ValueError, match="bias"):
        fuse_linears([a, c])
    d = MarlinLinear.from_linear(_seeded_linear(256, 128, False, 3), act_order=True,
                                 generator=torch.Generator().manual_seed(3))
    e = MarlinLinear.from_linear(_seeded_linear(256, 128, False, 4), act_order=True,
                                 generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="column orders differ"):
        fuse_linears([d, e])


class Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = _layers()

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def test_slices_follow_the_call_pattern(cpu_kernels):
    m = Siblings()
    plain = copy.deepcopy(m)
    rep = fuse_projections(m)
    assert rep.fused == ["<model>: q_proj+k_proj+v_proj"] and rep.skipped == []
    assert all(isinstance(getattr(m, n), FusedSlice) for n in ("q_proj", "k_proj", "v_proj"))
    x, y = torch.randn(2, 256, dtype=torch.float16), torch.randn(2, 256, dtype=torch.float16)

    def want(name, t):
        return getattr(plain, name)(t)

    cpu_kernels["gemm"] = 0
    outs = m(x)
    assert cpu_kernels["gemm"] == 1  # one fused GEMM served all three
    for got, name in zip(outs, ("q_proj", "k_proj", "v_proj")):
        assert close(got, want(name, x)) < 1e-3
    # a sibling called with another tensor computes its own result
    assert close(m.q_proj(x), want("q_proj", x)) < 1e-3
    assert close(m.k_proj(y), want("k_proj", y)) < 1e-3
    assert close(m.v_proj(x), want("v_proj", x)) < 1e-3
    # the input modified in place between two calls: not served from the old result
    m.q_proj(x)
    x.mul_(-1)
    assert close(m.k_proj(x), want("k_proj", x)) < 1e-3
    # the same sibling twice with the same input: recomputed, still right
    m.q_proj(y)
    assert close(m.q_proj(y), want("q_proj", y)) < 1e-3
    # nothing is kept once every slice of a result was taken
    m(x)
    assert m.q_proj._shared.x is None


def test_hf_llama_fused_logits_and_generate(cpu_kernels):
    f = hf_model("llama")
    q = copy.deepcopy(f)
    quantize_model(q, device="cpu")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = q(ids).logits
        unfused = copy.deepcopy(q)
        rep = fuse_projections(q)
        after = q(ids).logits
    assert len(rep.fused) == 2 * q.config.num_hidden_layers  # attention and MLP of every layer
    assert close(after, before) < 1e-3
    assert sum(isinstance(m, MarlinLinear) for m in q.modules()) < sum(
        isinstance(m, MarlinLinear) for m in unfused.modules())
    out = q.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    ref = unfused.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert fuse_projections(q).fused == []  # fusing twice changes nothing


def test_act_order_fuses_only_with_one_column_order(tmp_path, cpu_kernels):
    # quantize_model's RTN act-order draws the same order for every layer of one K: fusable
    f = hf_model("llama")
    q = copy.deepcopy(f)
    quantize_model(q, device="cpu", act_order=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = q(ids).logits
        rep = fuse_projections(q)
        after = q(ids).logits
    assert len(rep.fused) == 2 * q.config.num_hidden_layers
    assert close(after, before) < 1e-3
    # checkpoint layers with their own g_idx orders stay separate, with the reason
    m = Siblings()
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        setattr(m, name, MarlinLinear.from_linear(_seeded_linear(256, 128, False, i), act_order=True,
                                                  generator=torch.Generator().manual_seed(i)))
    rep = fuse_projections(m)
    assert rep.fused == [] and len(rep.skipped) == 1 and "column orders differ" in rep.skipped[0][1]


def test_fused_models_do_not_save(tmp_path, cpu_kernels):
    q = hf_model("llama")
    quantize_model(q, device="cpu")
    fuse_projections(q)
    with pytest.raises(ValueError, match="fused projections"):
        save_quantized(q, tmp_path / "out")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        jitmarlin.fuse_projections("model")


def test_torch_compile_of_a_fused_model(monkeypatch):
    """torch.compile traces the slices' bookkeeping without a graph break and gives the unfused
    model's logits (CPU inductor, reference kernels; not the counting ones of cpu_kernels, whose
    counter dynamo would specialize on and recompile for)."""
    import torch._dynamo

    import jitmarlin.nn.linear as linear

    from .test_model_cpu import ref_gemm

    monkeypatch.setattr(linear, "marlin_gemm", ref_gemm)

    q = hf_model("llama")
    quantize_model(q, device="cpu")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = q(ids).logits
        fuse_projections(q)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(q)
        for _ in range(2):
            assert close(compiled(ids).logits, want) < 3e-3
        assert not torch._dynamo.utils.counters["graph_break"]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert close(compiled(ids).logits, want) < 3e-3
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompiles once warm
        assert close(q(ids).logits, want) < 1e-3  # eager again after compiled calls
