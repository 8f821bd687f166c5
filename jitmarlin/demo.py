"""`jitmarlin demo`: the main job on a GPU machine, with nothing to download.

Builds the kernels it needs (one progress line per module), quantizes a random-weight
Llama-like MLP block and a Mixtral-like MoE block to 4-bit (group 128), checks both against the
float computation on the dequantized weights, and times them against fp16 at decode batch
sizes (CUDA graphs). Then quantizes a small hand-built decoder (attention projections, an MLP
layer and a MoE layer, on the CPU) with jitmarlin.quantize_model onto the GPU and checks its
logits the same way. Exit status 0 only if every check passes.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


def time_graph(step, n_copies: int = 1, calls: int = 20, replays: int = 10, warmup: int = 2) -> float:
    """Median µs per call of step(i), timed as a CUDA graph of `calls` calls; i cycles over
    n_copies (the benchmarks rotate weight copies so that they come from HBM, not L2)."""
    for i in range(min(n_copies, calls)):
        step(i % n_copies)  # builds / loads kernels and allocates outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            step(i % n_copies)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            step(i % n_copies)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del g
    return statistics.median(times)


def _time_us(fn) -> float:
    return time_graph(lambda _i: fn())


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run(hidden: int = 4096, intermediate: int = 11008, experts: int = 8, moe_inter: int = 14336,
        top_k: int = 2) -> int:
    from . import MarlinLinear, MarlinMoE
    from .jit.toolchain import device_capability

    dev = torch.device("cuda", torch.cuda.current_device())
    cc = device_capability(dev)
    print(f"jitmarlin demo on {torch.cuda.get_device_name(dev)} (sm_{cc[0]}{cc[1]})", flush=True)
    torch.manual_seed(0)
    ok = True

    # ---- a Llama-like MLP block: gate/up/down projections ----
    t0 = time.time()
    lin = {name: torch.nn.Linear(i, o, bias=False, dtype=torch.float16, device=dev)
           for name, (i, o) in {"gate": (hidden, intermediate), "up": (hidden, intermediate),
                                "down": (intermediate, hidden)}.items()}
    for layer in lin.values():
        torch.nn.init.normal_(layer.weight, std=0.02)
    q = {name: MarlinLinear.from_linear(layer, bits=4, group_size=128) for name, layer in lin.items()}
    deq = {name: layer.dequantize() for name, layer in q.items()}

    def mlp(x, mods):
        return mods["down"](F.silu(mods["gate"](x)) * mods["up"](x))

    def mlp_ref(x, w):
        h = (F.silu(x.float() @ w["gate"].float().t()) * (x.float() @ w["up"].float().t())).half().float()
        return h @ w["down"].float().t()

    x = torch.randn(16, hidden, dtype=torch.float16, device=dev)
    y = mlp(x, q)
    err = _rel(y, mlp_ref(x, deq))
    qerr = _rel(y, mlp(x, lin))
    print(f"Llama-like MLP ({hidden}->{intermediate}->{hidden}), W4 g128: quantized in "
          f"{time.time() - t0:.1f} s; error vs float on the dequantized weights {err:.1e} "
          f"(RTN quantization error vs the original fp16 weights {qerr:.1e})", flush=True)
    ok &= err < 1e-2
    for m in (1, 16):
        xm = torch.randn(m, hidden, dtype=torch.float16, device=dev)
        t_q = _time_us(lambda: mlp(xm, q))
        t_f = _time_us(lambda: mlp(xm, lin))
        print(f"  batch {m:>2}: jitmarlin {t_q:7.1f} us, fp16 {t_f:7.1f} us -> {t_f / t_q:.2f}x", flush=True)

    # ---- a Mixtral-like MoE block ----
    t0 = time.time()
    w13 = torch.randn(experts, 2 * moe_inter, hidden, dtype=torch.float16, device=dev) * 0.02
    w2 = torch.randn(experts, hidden, moe_inter, dtype=torch.float16, device=dev) * 0.02
    router = torch.randn(experts, hidden, dtype=torch.float16, device=dev) * 0.02
    moe = MarlinMoE.from_float(w13, w2, router, top_k)
    w13d, w2d = moe.dequantize()
    print(f"Mixtral-like MoE ({experts} experts, top-{top_k}, {hidden}x{moe_inter}), W4 g128: quantized in "
          f"{time.time() - t0:.1f} s", flush=True)

    def moe_ref(x, w13, w2):
        weights, ids = moe.route(x)
        out = torch.zeros(x.shape[0], hidden, device=dev)
        for e in range(experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                h1 = (x[tok].float() @ w13[e].float().t()).half().float()
                h2 = (F.silu(h1[:, :moe_inter]) * h1[:, moe_inter:]).half().float()
                out.index_add_(0, tok, (h2 @ w2[e].float().t()) * weights[tok, slot, None])
        return out

    x = torch.randn(32, hidden, dtype=torch.float16, device=dev)
    err = _rel(moe(x), moe_ref(x, w13d, w2d))
    print(f"  error vs float on the dequantized experts {err:.1e}", flush=True)
    ok &= err < 1e-2
    del w13, w2
    w13h = w13d.transpose(1, 2).contiguous()
    w2h = w2d.transpose(1, 2).contiguous()
    for m in (1, 16):
        xm = torch.randn(m, hidden, dtype=torch.float16, device=dev)
        weights, ids = moe.route(xm)
        t_q = _time_us(lambda: moe(xm))

        # fp16 reference timing: a per-expert loop, eager (it asks the GPU which tokens went where)
        def fp16_loop():
            out = torch.zeros_like(xm)
            for e in range(experts):
                tok, slot = torch.where(ids == e)
                if tok.numel():
                    h1 = xm[tok] @ w13h[e]
                    out.index_add_(0, tok, (F.silu(h1[:, :moe_inter]) * h1[:, moe_inter:]) @ w2h[e]
                                   * weights[tok, slot, None].half())
            return out

        for _ in range(3):
            fp16_loop()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fp16_loop()
        b.record()
        b.synchronize()
        t_f = a.elapsed_time(b) * 100
        print(f"  batch {m:>2}: jitmarlin MoE {t_q:7.1f} us (graph), fp16 per-expert loop {t_f:7.1f} us (eager) "
              f"-> {t_f / t_q:.1f}x", flush=True)
    ok &= model_check(dev)
    print("demo: all checks passed" if ok else "demo: a check FAILED", flush=True)
    return 0 if ok else 1


# ---- a small hand-built decoder for quantize_model (no transformers needed) ----


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _SparseMoE(nn.Module):
    """Mixtral-style routing: softmax in fp32, top-k, renormalized; one _MLP per expert."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_MLP(hidden, inter) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(torch.softmax(self.gate(x).float(), -1), self.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                out.index_add_(0, tok, (expert(x[tok]).float() * weights[tok, slot, None]).to(x.dtype))
        return out.reshape(shape)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: nn.Module):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.mlp = mlp

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o_proj(a)
        return x + self.mlp(self.norm2(x))


class _Decoder(nn.Module):
    def __init__(self, vocab=8192, hidden=2048, heads=16, inter=5632, experts=8, moe_inter=1408, top_k=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([_Layer(hidden, heads, _MLP(hidden, inter)),
                                     _Layer(hidden, heads, _SparseMoE(hidden, moe_inter, experts, top_k))])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def model_check(dev: torch.device, **sizes) -> bool:
    """quantize_model on a float decoder that lives on the CPU; logits vs the float model that
    holds the dequantized weights (relative error, as above)."""
    from . import MarlinLinear, MoESpec, quantize_model, register_moe
    from .model import MarlinMoEBlock

    register_moe(_SparseMoE, lambda b: MoESpec.from_module_list(b.gate, b.experts, top_k=b.top_k))
    torch.manual_seed(0)
    model = _Decoder(**sizes).half()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2 if name.endswith("mlp.gate.weight") else 0.02)  # decisive routing
    reference = copy.deepcopy(model)
    t0 = time.time()
    report = quantize_model(model, device=dev)
    print(f"quantize_model on a 2-layer decoder (CPU -> {dev}) in {time.time() - t0:.1f} s: {report.summary()}",
          flush=True)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, MarlinLinear):
                reference.get_submodule(name).weight.copy_(m.dequantize())
            elif isinstance(m, MarlinMoEBlock):
                w13, w2 = m.moe.dequantize()
                inter = w13.shape[1] // 2
                for e, expert in enumerate(reference.get_submodule(name).experts):
                    expert.gate_proj.weight.copy_(w13[e, :inter])
                    expert.up_proj.weight.copy_(w13[e, inter:])
                    expert.down_proj.weight.copy_(w2[e])
        reference.to(dev)
        ids = torch.randint(0, model.embed.num_embeddings, (2, 16), device=dev)
        err = _rel(model(ids), reference(ids))
    print(f"  logits: error vs float on the dequantized weights {err:.1e}", flush=True)
    return err < 1e-2


if __name__ == "__main__":
    sys.exit(run())
