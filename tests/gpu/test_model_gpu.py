"""Whole models on the GPU: quantize_model on tiny random transformers models (Llama, Mixtral,
Qwen2-MoE, Qwen3-MoE), generate(), GPTQ / AWQ checkpoints written by the tests, and
save_quantized / load_quantized.

Tests that build transformers models skip where transformers is not installed.

Accuracy criterion: the quantized model's logits against the same float model holding the
dequantized weights (so quantization error cancels and what is left is the kernels'),
max |diff| / max |logit| < 1e-2. Both sides run fp16 with fp32 accumulation; what differs is
the summation order and where intermediate results are rounded to fp16 (2^-11 relative each),
which after a few layers gives about 1e-3 (the CPU suite sees 1.0-1.1e-3 with its reference
kernels); a layout, routing or return-convention bug gives O(0.1) or more. bfloat16 has 8x
coarser rounding: 4e-2. Whole-model logits are compared on models that route every token to
every expert (top_k = number of experts): with top-2 routing, a token whose 2nd and 3rd router
scores tie within that rounding noise picks another expert in the reference now and then,
which is no bug; top-2 models are checked block by block on the blocks' actual inputs instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jitmarlin.model import MarlinMoEBlock, init_empty_weights, load_quantized, quantize_model, save_quantized
from jitmarlin.nn import MarlinLinear, MarlinMoE
from jitmarlin.quant import packed as packed_module

from ..test_model_cpu import (GPTQ_CASES, _case_id, _moe_blocks, close, dequantized_reference, hf_model,
                              moe_blocks_in_context, toy_model, write_checkpoint)

KINDS = ["llama", "mixtral", "qwen2_moe", "qwen3_moe"]


def _all_on_cuda(model: nn.Module) -> bool:
    return all(t.device.type == "cuda" for t in list(model.parameters()) + list(model.buffers()))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _ids(shape, seed=0):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_model_logits_and_generate(kind, dtype):
    f = hf_model(kind, dtype=dtype, top_k="all")  # on the CPU
    q = copy.deepcopy(f)
    rep = quantize_model(q, device="cuda")
    assert _all_on_cuda(q) and rep.dtype == dtype
    assert rep.num_moe == (0 if kind == "llama" else len(_moe_blocks(f)))
    ref = dequantized_reference(q, f).cuda()
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    for batch, seq in ((1, 1), (2, 9), (3, 70)):
        ids = _ids((batch, seq), seed=seq)
        err = close(_logits(q, ids), _logits(ref, ids))
        assert err < tol, f"{kind} {dtype} B={batch} S={seq}: {err:.2e}"
    prompt = _ids((2, 6))
    with torch.no_grad():
        out = q.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (2, 14) and torch.equal(out[:, :6], prompt)
    # the generated sequences as input: the cached decode steps agree with a full forward
    err = close(_logits(q, out), _logits(ref, out))
    assert err < tol, f"{kind} on generated tokens: {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_top2_blocks_in_context_and_generate(kind, dtype):
    f = hf_model(kind, dtype=dtype)  # top-2 of 4 or 6 experts
    q = copy.deepcopy(f)
    quantize_model(q, device="cuda")
    ref = dequantized_reference(q, f).cuda()
    for batch, seq in ((1, 1), (3, 70)):
        errors = moe_blocks_in_context(q, ref, _ids((batch, seq), seed=seq))
        assert errors and max(errors.values()) < (1e-2 if dtype == torch.float16 else 4e-2), (batch, seq, errors)
    prompt = _ids((2, 5))
    with torch.no_grad():
        out = q.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)


def test_quantize_from_cpu_fits_layer_by_layer():
    """A CPU model quantized onto the GPU: the GPU never holds much more than the quantized
    model plus the packing temporaries of one layer (fp32 and int64 copies of its weight, about
    13x its fp16 size), far less than the float model."""

    class Big(nn.Module):
        def __init__(self, layers=64, k=4096, n=4096):
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.layers = nn.ModuleList()
            for _ in range(layers):
                lin = nn.Linear(k, n, bias=False, device="meta")
                lin.weight = nn.Parameter(torch.randn(n, k, generator=gen, dtype=torch.float16) * 0.02)
                self.layers.append(lin)

    m = Big()
    fp16_bytes = sum(p.numel() * 2 for p in m.parameters())
    layer = 4096 * 4096 * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rep = quantize_model(m, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert rep.num_linear == 64 and _all_on_cuda(m)
    assert rep.bytes_after < 0.3 * fp16_bytes
    assert peak < rep.bytes_after + 16 * layer, (peak, rep.bytes_after, layer)
    assert peak < 0.6 * fp16_bytes, (peak, fp16_bytes)


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("cfg", GPTQ_CASES, ids=_case_id)
def test_checkpoint_logits(kind, cfg, tmp_path):
    """GPTQ (act-order off / on, 4- and 8-bit, v1 / v2) and AWQ checkpoints written by the tests,
    loaded into a meta skeleton on the GPU: logits vs the float model holding the checkpoint's
    weights."""
    src = hf_model(kind, top_k="all")
    blocks = [n for n, _ in _moe_blocks(src)]
    dense, experts = write_checkpoint(src, tmp_path, {**cfg, "group_size": 64}, moe_prefixes=blocks)
    with init_empty_weights():
        model = type(src)(src.config)
    rep = load_quantized(model, tmp_path, device="cuda")
    assert _all_on_cuda(model) and rep.num_linear == len(dense) and rep.num_moe == len(blocks)
    for name, w in dense.items():
        assert torch.equal(model.get_submodule(name).dequantize().cpu(), w.half()), name
    for name, (w13, w2) in experts.items():
        d13, d2 = model.get_submodule(name).moe.dequantize()
        assert torch.equal(d13.cpu(), w13.half()) and torch.equal(d2.cpu(), w2.half())
    ref = dequantized_reference(model, src).cuda()
    for batch, seq in ((1, 1), (2, 33)):
        ids = _ids((batch, seq), seed=seq)
        err = close(_logits(model, ids), _logits(ref, ids))
        assert err < 1e-2, f"B={batch} S={seq}: {err:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_reload_without_repacking(kind, tmp_path, monkeypatch):
    q = hf_model(kind)
    quantize_model(q, device="cuda", act_order=True)
    save_quantized(q, tmp_path)

    def no_packing(*a, **k):
        raise AssertionError("load_quantized repacked weights")

    monkeypatch.setattr(packed_module, "pack_weights", no_packing)  # every packing path goes through it
    with init_empty_weights():
        fresh = type(q)(q.config).half()  # rotary tables in fp16 too, as hf_model's .to(float16) made them
    load_quantized(fresh, tmp_path, device="cuda")
    assert _all_on_cuda(fresh)
    for name, m in q.named_modules():
        if isinstance(m, (MarlinLinear, MarlinMoE, MarlinMoEBlock)):
            assert type(fresh.get_submodule(name)) is type(m), name
    ids = _ids((2, 12))
    assert torch.equal(_logits(fresh, ids), _logits(q, ids))


def test_toy_model_cuda_graph():
    """A quantized model (MarlinLinear everywhere but the tied head) captured in a CUDA graph."""
    m = toy_model()
    quantize_model(m, device="cuda")
    ids = _ids((4, 8))
    with torch.no_grad():
        want = m(ids)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(ids)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("act_order", [False, True])
def test_fused_projections_match_unfused_eager_and_in_a_cuda_graph(act_order):
    """fuse_projections on a tiny Llama on the GPU: logits equal the unfused quantized model's
    (the same weights, column-sliced), greedy generate gives the same tokens, and a decode-style
    forward captured in a CUDA graph and replayed on new inputs matches eager execution."""
    from jitmarlin.model import fuse_projections

    f = hf_model("llama")
    q = copy.deepcopy(f)
    quantize_model(q, device="cuda", act_order=act_order)
    unfused = copy.deepcopy(q)
    rep = fuse_projections(q)
    assert len(rep.fused) == 2 * q.config.num_hidden_layers
    for batch, seq in ((1, 1), (8, 1), (2, 37)):
        ids = _ids((batch, seq), seed=batch + seq)
        assert close(_logits(q, ids), _logits(unfused, ids)) < 2e-3, (batch, seq)
    ids = _ids((1, 5), seed=7)
    out = q.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, unfused.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))

    # a decoder-like block (q/k/v read one input, gate/up read another) in a CUDA graph
    block = nn.ModuleDict({n: MarlinLinear.from_linear(nn.Linear(1024, 512, bias=False, dtype=torch.float16,
                                                                 device="cuda"), act_order=act_order)
                           for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")})
    plain = copy.deepcopy(block)
    assert len(fuse_projections(block).fused) == 2

    def run(mods, x):
        q_, k_, v_ = mods["q_proj"](x), mods["k_proj"](x), mods["v_proj"](x)
        h = (q_ + k_ + v_).repeat(1, 2)
        return torch.nn.functional.silu(mods["gate_proj"](h)) * mods["up_proj"](h)

    static_x = torch.randn(8, 1024, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        run(block, static_x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = run(block, static_x)
        for _ in range(2):
            static_x.copy_(torch.randn(8, 1024, device="cuda", dtype=torch.float16))
            static_out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert close(static_out, run(plain, static_x)) < 2e-3


def test_repeated_forwards_are_bit_identical():
    """Five forwards of a small Llama (K = 512 / 1408 projections: wgmma routes at 24 tokens that
    once took stream-K with empty CTA runs, session 19) give the same logits, finite, plain and
    with fused projections, at 1, 24 and 200 tokens; the workspace counters end at zero. A launch
    that leaves a counter set would corrupt the next launches' sums, so repetition shows it."""
    transformers = pytest.importorskip("transformers")
    from jitmarlin.model import fuse_projections
    from jitmarlin.ops import _kernels as K

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=1000)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    quantize_model(model, bits=4, group_size=128)
    ids = {t: torch.randint(0, 1000, (1, t), device="cuda") for t in (1, 24, 200)}
    for fused in (False, True):
        if fused:
            fuse_projections(model)
        for t, x in ids.items():
            with torch.no_grad():
                outs = [model(input_ids=x).logits for _ in range(5)]
            assert torch.isfinite(outs[0]).all(), (fused, t)
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (fused, t)
    assert int(K.default_workspace(torch.device("cuda")).counters.abs().sum()) == 0
