#!/usr/bin/env python
"""Mixture-of-experts in your own PyTorch model with jitmarlin, two ways.

1. Use MarlinMoE directly as a layer of your model: build it from float expert weights
   (MarlinMoE.from_float quantizes them) and call it like any module.
2. Keep your float MoE block class and teach jitmarlin to read it with jitmarlin.register_moe;
   jitmarlin.quantize_model then replaces every instance with a MarlinMoEBlock (and quantizes the
   model's nn.Linear layers), save_quantized / load_quantized store and restore it.

    python examples/moe_custom_model.py [--experts 8] [--hidden 1024] [--intermediate 2048]

Needs a CUDA GPU of compute capability >= 8.0 (no transformers needed).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="MarlinMoE in a custom model, and register_moe for a custom MoE block.")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (a multiple of 128)")
    p.add_argument("--intermediate", type=int, default=2048, help="expert intermediate size (a multiple of 128)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


# ---------------------------------------------------------------- 1. MarlinMoE as a layer


class TinyMoEModel(nn.Module):
    """x -> proj -> MarlinMoE -> out. The MoE layer is quantized from the start."""

    def __init__(self, moe: nn.Module, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.moe = moe
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return self.out(self.moe(self.proj(x)))


# ---------------------------------------------------------------- 2. your own float block + register_moe


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w_gate = nn.Linear(hidden, inter, bias=False)
        self.w_up = nn.Linear(hidden, inter, bias=False)
        self.w_down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MyMoE(nn.Module):
    """A float MoE block: softmax router in fp32, top-k, renormalized weights, SiLU-gated experts."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inter) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                out.index_add_(0, tok, (expert(x[tok]).float() * weights[tok, slot, None]).to(x.dtype))
        return out.reshape(shape)


def my_moe_adapter(block: MyMoE):
    """Where MyMoE keeps its router and experts, and how it routes."""
    import jitmarlin

    return jitmarlin.MoESpec.from_module_list(
        block.router, block.experts, top_k=block.top_k, renormalize=True, gate="w_gate", up="w_up", down="w_down",
        # names of the expert layers in GPTQ/AWQ checkpoints, for load_quantized (optional)
        checkpoint_experts=("experts.{e}.w_gate", "experts.{e}.w_up", "experts.{e}.w_down"),
        checkpoint_router="router.weight")


class MyModel(nn.Module):
    def __init__(self, hidden, inter, experts, top_k):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.moe = MyMoE(hidden, inter, experts, top_k)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return self.out(self.moe(self.proj(x)))


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    args = parse_args(argv)
    import jitmarlin
    from jitmarlin import MarlinMoE

    if not torch.cuda.is_available():
        print("no CUDA GPU: jitmarlin's kernels need one (compute capability >= 8.0); see `jitmarlin info`",
              file=sys.stderr)
        return 1
    dev, h, i, e, k = torch.device(args.device), args.hidden, args.intermediate, args.experts, args.top_k
    torch.manual_seed(0)

    # 1. MarlinMoE directly: float experts w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]
    w13 = torch.randn(e, 2 * i, h, dtype=torch.float16, device=dev) * 0.02
    w2 = torch.randn(e, h, i, dtype=torch.float16, device=dev) * 0.02
    router = torch.randn(e, h, dtype=torch.float16, device=dev) * 0.1
    model1 = TinyMoEModel(MarlinMoE.from_float(w13, w2, router, k, bits=4, group_size=128), h).half().to(dev)
    x = torch.randn(args.tokens, h, dtype=torch.float16, device=dev)
    y = model1(x)
    print(f"1. MarlinMoE in a custom model: output {tuple(y.shape)} {y.dtype}; MarlinMoE({model1.moe.extra_repr()})")

    # 2. a float model with its own MoE block class, quantized as a whole
    jitmarlin.register_moe(MyMoE, my_moe_adapter)
    model2 = MyModel(h, i, e, k).half()  # on the CPU: quantize_model moves it layer by layer
    with torch.no_grad():
        model2.moe.router.weight.normal_(0, 0.1)
    float_model = copy.deepcopy(model2).to(dev)
    report = jitmarlin.quantize_model(model2, device=dev)
    print(f"2. quantize_model: {report.summary()}")
    print(f"   model.moe is now a {type(model2.moe).__name__}: MarlinMoE({model2.moe.moe.extra_repr()})")

    # the float model on the weights the quantized one computes with: the kernel's own error
    reference = copy.deepcopy(float_model)
    with torch.no_grad():
        w13d, w2d = model2.moe.moe.dequantize()
        for n, ex in enumerate(reference.moe.experts):
            ex.w_gate.weight.copy_(w13d[n, :i])
            ex.w_up.weight.copy_(w13d[n, i:])
            ex.w_down.weight.copy_(w2d[n])
        reference.proj.weight.copy_(model2.proj.dequantize())
        reference.out.weight.copy_(model2.out.dequantize())
        got = model2(x)
        print(f"   error vs float on the dequantized weights {rel_err(got, reference(x)):.1e}; "
              f"vs the original float model {rel_err(got, float_model(x)):.1e} (4-bit RTN)")

    # save, then load into a fresh float skeleton (MyMoE must be registered, as it is here)
    with tempfile.TemporaryDirectory() as tmp:
        jitmarlin.save_quantized(model2, tmp)
        fresh = MyModel(h, i, e, k)
        jitmarlin.load_quantized(fresh, tmp, device=dev)
        same = torch.equal(fresh(x), got)
    print(f"   save_quantized -> load_quantized: identical output: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
