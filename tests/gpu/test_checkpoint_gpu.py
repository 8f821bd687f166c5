"""Checkpoint tensors -> MarlinMoE / MarlinLinear repacked on the GPU, run by the kernels, against
plain PyTorch on the dense weights the checkpoint means (computed by the test from its own random
integers; the checkpoint words come from the numpy packers of tests/test_formats.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from jitmarlin.nn import MarlinLinear, MarlinMoE
from jitmarlin.quant import QuantConfig, linear_from_checkpoint, load_safetensors, save_safetensors

from ..test_checkpoint import act_order_g_idx, awq_layer, gptq_layer, put
from .helpers import check_close
from .test_moe_gpu import reference

# Mixtral-shaped (gate/up/down per expert, top-2), scaled down: E=8, H=1024, I=2048
E, H, I, TOP_K = 8, 1024, 2048, 2
GROUP = 128


@functools.lru_cache(maxsize=3)
def mixtral_checkpoint(method: str, act_order: bool):
    """CPU checkpoint tensors of one MoE layer in Mixtral naming, the router, and the dense
    experts w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I] they mean (fp32, CPU)."""
    sd, gp, upp, dp, w13, w2 = {}, [], [], [], [], []
    for e in range(E):
        base = f"model.layers.0.block_sparse_moe.experts.{e}."
        g13 = act_order_g_idx(H, GROUP, 1000 + e) if act_order else None  # w1 and w3 share their input
        g2 = act_order_g_idx(I, GROUP, 2000 + e) if act_order else None
        mats = []
        for j, (name, k, n, g) in enumerate((("w1.", H, I, g13), ("w3.", H, I, g13), ("w2.", I, H, g2))):
            seed = 10 * e + j
            if method == "awq":
                t, w = awq_layer(k, n, GROUP, seed)
            else:
                t, w = gptq_layer(k, n, 4, GROUP, True, g, "gptq", seed)
            put(sd, base + name, t)
            mats.append(w)
        gp.append(base + "w1.")
        upp.append(base + "w3.")
        dp.append(base + "w2.")
        w13.append(torch.cat([mats[0].t(), mats[1].t()], 0))
        w2.append(mats[2].t())
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(7)) * 0.05
    return sd, gp, upp, dp, router, torch.stack(w13), torch.stack(w2)


def _cfg(method, act_order):
    if method == "awq":
        return QuantConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                      "version": "gemm"})
    return QuantConfig.from_dict({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
                                  "sym": True, "checkpoint_format": "gptq"})


@pytest.mark.parametrize("method,act_order", [("gptq", False), ("gptq", True), ("awq", False)],
                         ids=["gptq", "gptq-act-order", "awq"])
def test_mixtral_moe_from_checkpoint(method, act_order):
    sd, gp, upp, dp, router, w13, w2 = mixtral_checkpoint(method, act_order)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, TOP_K, _cfg(method, act_order), device="cuda")
    assert moe.w13_qweight.is_cuda and moe.router.weight.is_cuda
    assert (moe.w13_perm is not None) == act_order and (moe.w2_perm is not None) == act_order
    assert (moe.w13_qzeros is not None) == (method == "awq")
    d13, d2 = moe.dequantize()  # the repack on the GPU kept the checkpoint's meaning exactly
    assert torch.equal(d13.cpu(), w13.half()) and torch.equal(d2.cpu(), w2.half())
    w13c, w2c = w13.cuda(), w2.cuda()
    torch.manual_seed(0)
    for t in (1, 5, 64, 300):
        x = torch.randn(t, H, device="cuda", dtype=torch.float16)
        out = moe(x)
        assert out.shape == (t, H) and out.dtype == torch.float16
        weights, ids = moe.route(x)
        check_close(out, reference(x, w13c, w2c, weights, ids, torch.float16), 1e-3, f"{method} T={t}")


def test_mixtral_moe_from_checkpoint_bf16_act_order():
    sd, gp, upp, dp, router, *_ = mixtral_checkpoint("gptq", True)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, TOP_K, _cfg("gptq", True), dtype=torch.bfloat16,
                                    device="cuda")
    assert moe.dtype == torch.bfloat16
    w13, w2 = (w.float() for w in moe.dequantize())
    for t in (3, 128):
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe.route(x)
        check_close(moe(x), reference(x, w13, w2, weights, ids, torch.bfloat16), 1e-2, f"bf16 T={t}")


@pytest.mark.parametrize("act_order", [False, True])
def test_linear_from_safetensors_on_cuda(tmp_path, act_order):
    k, n, prefix = 2048, 768, "model.layers.5.mlp.down_proj."
    g = act_order_g_idx(k, GROUP, 3) if act_order else None
    t, w = gptq_layer(k, n, 4, GROUP, False, g, "gptq", seed=11)
    sd = {}
    put(sd, prefix, t)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).half()
    sd[prefix + "bias"] = bias
    save_safetensors(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_safetensors(tmp_path, device="cuda")
    assert all(v.is_cuda for v in loaded.values())
    cfg = QuantConfig("gptq", 4, GROUP, desc_act=act_order, sym=False)
    layer = linear_from_checkpoint(loaded, prefix, cfg)
    assert isinstance(layer, MarlinLinear) and layer.qweight.is_cuda and layer.act_order == act_order
    assert torch.equal(layer.dequantize().cpu(), w.t().half())
    wc, bc = w.cuda(), bias.cuda().float()
    for m in (1, 16, 100):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        check_close(layer(x), x.float() @ wc + bc, 1e-3, f"M={m}")


def test_awq_linear_from_checkpoint_device_argument(tmp_path):
    k, n, prefix = 4096, 1024, "model.layers.0.self_attn.o_proj."
    t, w = awq_layer(k, n, GROUP, seed=12)
    sd = {}
    put(sd, prefix, t)
    save_safetensors(sd, tmp_path / "awq.safetensors")
    loaded = load_safetensors(tmp_path / "awq.safetensors")  # CPU (memory-mapped) ...
    layer = linear_from_checkpoint(loaded, prefix, _cfg("awq", False), device="cuda")  # ... repacked on the GPU
    assert layer.qweight.is_cuda and not layer.sym
    wc = w.cuda()
    for m in (1, 33):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        check_close(layer(x), x.float() @ wc, 1e-3, f"M={m}")
