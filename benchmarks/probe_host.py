"""Host time of eager MarlinLinear calls: the layer's fast path (ops.gemm.gemm_fast) against the
general path, the same run. A chain of small calls is host-bound (the GPU finishes each GEMM
before the next launch arrives), so µs per call ~ the host's cost per call.

    python benchmarks/probe_host.py [--m 1,16,128] [--calls 3000]
"""

import argparse
import time

import torch

import jitmarlin
from jitmarlin.ops import gemm as G


def per_call_us(layer, x, calls: int) -> float:
    for _ in range(50):
        layer(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        layer(x)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,128")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--shape", default="4096x4096")
    args = ap.parse_args()
    k, n = map(int, args.shape.split("x"))
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.float16)
    layer = jitmarlin.MarlinLinear.from_linear(lin)
    fast = G.gemm_fast
    for m in (int(v) for v in args.m.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        same = torch.equal(layer(x), jitmarlin.marlin_gemm(x, layer.qweight, layer.scales))
        t_fast = per_call_us(layer, x, args.calls)
        G.gemm_fast = lambda *a, **kw: None  # the general path
        try:
            t_general = per_call_us(layer, x, args.calls)
        finally:
            G.gemm_fast = fast
        t_fp16 = per_call_us(lin, x, args.calls)
        print(f"{k}x{n} M={m}: fast path {t_fast:.1f} us/call, general path {t_general:.1f}, "
              f"nn.Linear fp16 {t_fp16:.1f} (outputs equal: {same})", flush=True)


if __name__ == "__main__":
    main()
