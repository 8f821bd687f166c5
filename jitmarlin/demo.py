"""`jitmarlin demo`: the main job on a GPU machine, with nothing to download.

Builds the kernels it needs (one progress line per module), quantizes a random-weight
Llama-like MLP block and a Mixtral-like MoE block to 4-bit (group 128), checks both against the
float computation on the dequantized weights, and times them against fp16 at decode batch
sizes (CUDA graphs). Exit status 0 only if every check passes.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F


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
    print("demo: all checks passed" if ok else "demo: a check FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run())
