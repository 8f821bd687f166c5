"""MarlinLinear on the GPU: from a float nn.Linear (with and without act-order) and from GPTQ
and AWQ checkpoint tensors written by the tests' own writers (tests/test_formats.py)."""

from __future__ import annotations

import pytest
import torch

from jitmarlin.nn import MarlinLinear

from ..test_formats import make_case, write_awq, write_gptq_qweight, write_gptq_qzeros
from .helpers import check_close


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(4, 128), (8, 64), (4, -1)])
def test_from_linear(bits, group, dtype, act_order):
    torch.manual_seed(0)
    lin = torch.nn.Linear(5120, 1536, bias=True, dtype=dtype, device="cuda")
    layer = MarlinLinear.from_linear(lin, bits=bits, group_size=group, act_order=act_order)
    w = layer.dequantize().float()
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    for m in (1, 7, 64, 300):
        x = torch.randn(2, m, 5120, device="cuda", dtype=dtype)
        y = layer(x)
        assert y.shape == (2, m, 1536)
        check_close(y, x.float() @ w.t() + lin.bias.float(), tol, f"M={m}")


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits,group,sym,act_order", [(4, 128, True, False), (4, 128, True, True),
                                                      (4, 32, False, True), (8, 128, True, True), (8, -1, False, False)])
def test_from_gptq_on_gpu(fmt, bits, group, sym, act_order):
    k, n = 11008, 512
    q, z, s, g_idx, w = make_case(k, n, bits, group, sym, act_order, seed=3)
    layer = MarlinLinear.from_gptq(
        write_gptq_qweight(q, bits).cuda(), s.cuda(), write_gptq_qzeros(z, bits, fmt).cuda(),
        torch.from_numpy(g_idx).to(torch.int32).cuda(), bits=bits, group_size=group, sym=sym,
        checkpoint_format=fmt)
    for m in (1, 16, 77):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        check_close(layer(x), x.float() @ w.cuda(), 1e-3, f"M={m}")


def test_from_awq_on_gpu():
    k, n, group = 5120, 1024, 128
    q, z, s, _, w = make_case(k, n, 4, group, False, False, seed=5)
    layer = MarlinLinear.from_awq(write_awq(q).cuda(), s.cuda(), write_awq(z).cuda(), group_size=group)
    for m in (1, 16, 129):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        check_close(layer(x), x.float() @ w.cuda(), 1e-3, f"M={m}")


def test_state_dict_reload_on_gpu():
    lin = torch.nn.Linear(1024, 512, dtype=torch.float16, device="cuda")
    layer = MarlinLinear.from_linear(lin, act_order=True)
    fresh = MarlinLinear(1024, 512, act_order=True, bias=True, device="cuda")
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(5, 1024, device="cuda", dtype=torch.float16)
    assert torch.equal(fresh(x), layer(x))
