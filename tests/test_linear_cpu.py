"""MarlinLinear on the CPU: construction, state dict, repr, RTN accuracy, errors (no GPU needed)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import jitmarlin
from jitmarlin.nn import MarlinLinear
from jitmarlin.quant import dequantize, pack, quantize


def _linear(k, n, dtype=torch.float16, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        if bias:
            lin.bias.normal_(0, 0.1)
    return lin.to(dtype)


def _element_scales(layer: MarlinLinear) -> torch.Tensor:
    """Scale of every weight element, [out, in], in the original input order."""
    u = layer.packed().unpack()
    k = layer.in_features
    s = u.scales.float().repeat_interleave(k // u.scales.shape[0], dim=0)  # [K, N], sorted rows
    if layer.perm is not None:
        orig = torch.empty_like(s)
        orig[layer.perm.long()] = s
        s = orig
    return s.t()


def test_exported():
    assert jitmarlin.MarlinLinear is MarlinLinear
    assert "MarlinLinear" in jitmarlin.__all__


@pytest.mark.parametrize("bits,group_size,sym,act_order,dtype", [
    (4, 128, True, False, torch.float16),
    (4, 64, False, True, torch.float16),
    (8, 128, True, True, torch.bfloat16),
    (8, -1, False, False, torch.float16),
    (4, -1, True, True, torch.bfloat16),
])
def test_from_linear_rtn_error_bound(bits, group_size, sym, act_order, dtype):
    lin = _linear(512, 192, dtype)
    layer = MarlinLinear.from_linear(lin, bits=bits, group_size=group_size, act_order=act_order, sym=sym)
    assert layer.act_order == (act_order and group_size != -1)
    assert layer.sym == sym and layer.dtype == dtype and layer.bits == bits and layer.group_size == group_size
    assert (layer.in_features, layer.out_features) == (512, 192)
    w = lin.weight.detach().float()
    deq = layer.dequantize()
    assert deq.shape == (192, 512) and deq.dtype == dtype
    err = (deq.float() - w).abs()
    # RTN: at most half a step (plus the scale's own rounding), then the output cast
    bound = 0.51 * _element_scales(layer) + w.abs() * 2.0 ** -7 + 1e-6
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    rel = float((deq.float() - w).norm() / w.norm())
    assert rel < (0.15 if bits == 4 else 0.01)
    assert torch.equal(layer.bias, lin.bias.detach())


def test_from_linear_act_order_matches_reference_and_is_deterministic():
    lin = _linear(256, 128)
    layer = MarlinLinear.from_linear(lin, bits=4, group_size=64, act_order=True, generator=123)
    # reference: groups formed by the seeded permutation P, quantized with RTN, unsorted
    p = torch.randperm(256, generator=torch.Generator().manual_seed(123))
    w_kn = lin.weight.detach().t()
    qz = quantize(w_kn[p], bits=4, group_size=64)
    ref = torch.empty(256, 128)
    ref[p] = dequantize(qz.q, qz.scales, qz.zeros, 4, 64)
    assert torch.equal(layer.dequantize(), ref.t().half())
    # the groups really differ from the plain ones
    plain = MarlinLinear.from_linear(lin, bits=4, group_size=64)
    assert not torch.equal(plain.dequantize(), layer.dequantize())
    # perm sorts rows by group: group g = rows p[g*64:(g+1)*64]
    perm = layer.perm.long()
    for g in range(4):
        assert set(perm[g * 64:(g + 1) * 64].tolist()) == set(p[g * 64:(g + 1) * 64].tolist())
    again = MarlinLinear.from_linear(lin, bits=4, group_size=64, act_order=True, generator=123)
    assert torch.equal(again.perm, layer.perm) and torch.equal(again.qweight, layer.qweight)
    default1 = MarlinLinear.from_linear(lin, act_order=True, group_size=64)
    default2 = MarlinLinear.from_linear(lin, act_order=True, group_size=64,
                                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(default1.perm, default2.perm) and not torch.equal(default1.perm, layer.perm)


def test_from_packed_and_perm_validation():
    lin = _linear(128, 64, bias=False)
    packed = pack(quantize(lin.weight.detach().t(), bits=4, group_size=64))
    layer = MarlinLinear.from_packed(packed)
    assert layer.perm is None and layer.bias is None and layer.qzeros is None
    assert torch.equal(layer.dequantize(), packed.dequantize(torch.float16).t())
    perm = torch.randperm(128)
    permuted = MarlinLinear.from_packed(packed, bias=torch.ones(64), perm=perm)
    assert permuted.perm.dtype == torch.int32 and permuted.bias.dtype == torch.float16
    assert torch.equal(permuted.dequantize()[:, perm], packed.dequantize(torch.float16).t())
    with pytest.raises(ValueError, match=r"perm must be a permutation of range\(K=128\)"):
        MarlinLinear.from_packed(packed, perm=torch.zeros(128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"perm must be an integer tensor of shape \[K=128\]"):
        MarlinLinear.from_packed(packed, perm=torch.arange(64))
    with pytest.raises(ValueError, match=r"bias must have shape \[out_features=64\]"):
        MarlinLinear.from_packed(packed, bias=torch.ones(65))


def _roundtrip(layer: MarlinLinear, **config) -> MarlinLinear:
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    fresh = MarlinLinear(layer.in_features, layer.out_features, **config)
    fresh.load_state_dict(sd)
    return fresh


@pytest.mark.parametrize("bits,group_size,sym,act_order,bias,dtype", [
    (4, 128, False, True, True, torch.float16),
    (4, 64, True, False, False, torch.bfloat16),
    (8, -1, True, False, True, torch.float16),
    (8, 64, False, True, False, torch.float16),
])
def test_state_dict_round_trip(bits, group_size, sym, act_order, bias, dtype):
    layer = MarlinLinear.from_linear(_linear(384, 128, dtype, bias=bias), bits=bits, group_size=group_size,
                                     act_order=act_order, sym=sym)
    expected_keys = {"qweight", "scales"} | ({"qzeros"} if not sym else set()) | \
        ({"perm"} if act_order else set()) | ({"bias"} if bias else set())
    assert set(layer.state_dict()) == expected_keys
    fresh = _roundtrip(layer, bits=bits, group_size=group_size, dtype=dtype, zero_points=not sym,
                       act_order=act_order, bias=bias)
    for name, t in layer.state_dict().items():
        assert torch.equal(getattr(fresh, name), t), name
    assert torch.equal(fresh.dequantize(), layer.dequantize())
    assert repr(fresh) == repr(layer)


def test_state_dict_structure_mismatch_errors():
    layer = MarlinLinear.from_linear(_linear(256, 64), bits=4, group_size=64, act_order=True, sym=False)
    sd = layer.state_dict()
    with pytest.raises(RuntimeError, match=r"'qzeros' but this MarlinLinear was built without it.*zero_points=True"):
        MarlinLinear(256, 64, group_size=64, act_order=True, bias=True).load_state_dict(sd)
    with pytest.raises(RuntimeError, match=r"'perm'.*act_order=True"):
        MarlinLinear(256, 64, group_size=64, zero_points=True, bias=True).load_state_dict(sd, strict=False)
    with pytest.raises(RuntimeError, match=r"'scales' in state_dict is torch.float16 .*torch.bfloat16"):
        MarlinLinear(256, 64, group_size=64, zero_points=True, act_order=True, bias=True,
                     dtype=torch.bfloat16).load_state_dict(sd)
    with pytest.raises(RuntimeError, match=r"size mismatch for scales"):
        MarlinLinear(256, 64, group_size=128, zero_points=True, act_order=True, bias=True).load_state_dict(sd)
    with pytest.raises(RuntimeError, match=r"Missing key"):
        sd2 = dict(sd)
        del sd2["perm"]
        MarlinLinear(256, 64, group_size=64, zero_points=True, act_order=True, bias=True).load_state_dict(sd2)


def test_repr():
    layer = MarlinLinear.from_linear(_linear(512, 128), bits=4, group_size=128, act_order=True, sym=False)
    r = repr(layer)
    for part in ("MarlinLinear(", "in_features=512", "out_features=128", "bits=4", "group_size=128",
                 "sym=False (zero points)", "act_order=True", "bias=True", "dtype=torch.float16"):
        assert part in r, (part, r)
    r2 = repr(MarlinLinear.from_linear(_linear(256, 64, bias=False), bits=8, group_size=-1))
    for part in ("bits=8", "group_size=-1", "sym=True", "act_order=False", "bias=False"):
        assert part in r2, (part, r2)


def test_to_dtype_and_device_follow_buffers():
    layer = MarlinLinear.from_linear(_linear(256, 64), group_size=64, act_order=True)
    moved = layer.to(torch.bfloat16)
    assert moved.dtype == torch.bfloat16 and moved.scales.dtype == torch.bfloat16
    assert moved.bias.dtype == torch.bfloat16
    assert moved.qweight.dtype == torch.int32 and moved.perm.dtype == torch.int32
    assert repr(moved).endswith("dtype=torch.bfloat16)")
    meta = MarlinLinear.from_linear(_linear(256, 64), group_size=64).to("meta")
    assert all(t.device.type == "meta" for t in meta.buffers())


def test_forward_on_cpu_says_cuda():
    for act_order in (False, True):
        layer = MarlinLinear.from_linear(_linear(256, 64), group_size=64, act_order=act_order)
        x = torch.randn(3, 256, dtype=torch.float16)
        with pytest.raises(ValueError, match=r"CUDA"):
            layer(x)


def test_forward_input_checks():
    layer = MarlinLinear.from_linear(_linear(256, 64), group_size=64)
    with pytest.raises(TypeError, match=r"input dtype torch.float32 does not match the layer dtype torch.float16"):
        layer(torch.randn(2, 256))
    with pytest.raises(ValueError, match=r"input has 128 features but the layer expects in_features=256"):
        layer(torch.randn(2, 128, dtype=torch.float16))


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"K=96 .*multiple of 64"):
        MarlinLinear(96, 64, group_size=32)
    with pytest.raises(ValueError, match=r"K=256 must be a multiple of group_size=96"):
        MarlinLinear(256, 64, group_size=96)
    with pytest.raises(TypeError, match=r"dtype=torch.float32 is not supported"):
        MarlinLinear(256, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"bits=3 is not supported"):
        MarlinLinear(256, 64, bits=3)
    with pytest.raises(TypeError, match=r"linear.weight must be float16 or bfloat16.*torch.float32"):
        MarlinLinear.from_linear(nn.Linear(256, 64))
