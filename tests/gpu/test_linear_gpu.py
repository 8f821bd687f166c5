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


def test_act_order_chain_in_cuda_graph():
    """Act-order layers back to back, as in a decoder (three read one input, one reads the previous
    output): the gather kernel + GEMM pairs, launched as programmatic dependents on sm_90, must
    give the reference result eagerly and when replayed from a CUDA graph, with the input changed
    between replays (output buffers poisoned first)."""
    torch.manual_seed(1)
    k, n = 4096, 1024
    lins = [torch.nn.Linear(k, n, bias=False, dtype=torch.float16, device="cuda") for _ in range(3)]
    layers = [MarlinLinear.from_linear(lin, act_order=True) for lin in lins]
    last = MarlinLinear.from_linear(torch.nn.Linear(n, k, bias=False, dtype=torch.float16, device="cuda"),
                                    act_order=True)
    ws = [layer.dequantize().float() for layer in layers]
    w_last = last.dequantize().float()

    def run(x):
        outs = [layer(x) for layer in layers]
        return outs + [last(outs[0])]

    def reference(x):
        outs = [x.float() @ w.t() for w in ws]
        return outs + [outs[0].half().float() @ w_last.t()]

    for m in (1, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        for got, want in zip(run(x), reference(x)):
            check_close(got, want, 1e-3, f"eager M={m}")
        static_x = x.clone()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = run(static_x)
        for step in range(3):
            for o in static_out:
                o.fill_(float("nan"))
            static_x.copy_(torch.randn(m, k, device="cuda", dtype=torch.float16))
            g.replay()
            torch.cuda.synchronize()
            for got, want in zip(static_out, reference(static_x)):
                check_close(got, want, 1e-3, f"graph M={m} replay {step}")


def test_gemm_perm_errors():
    import jitmarlin

    layer = MarlinLinear.from_linear(torch.nn.Linear(256, 128, dtype=torch.float16, device="cuda"), act_order=True)
    x = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    args = (x, layer.qweight, layer.scales)
    with pytest.raises(ValueError, match="perm must be a contiguous int32"):
        jitmarlin.marlin_gemm(*args, perm=layer.perm.long())
    with pytest.raises(ValueError, match="perm must be a contiguous int32"):
        jitmarlin.marlin_gemm(*args, perm=layer.perm[:128])
    with pytest.raises(ValueError, match="perm is on cpu"):
        jitmarlin.marlin_gemm(*args, perm=layer.perm.cpu())
    out = jitmarlin.marlin_gemm(*args, perm=layer.perm)
    check_close(out, x.float() @ layer.dequantize().float().t(), 1e-3, "perm")
