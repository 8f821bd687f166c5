#!/usr/bin/env python
"""Diagnostics behind bench_e2e's numbers (GPU only): host time per call of a quantized linear,
a per-kernel GPU-time breakdown of one decode step / prefill of the model shapes, and checks that
a captured decode step reproduces eager execution bit for bit.

    python benchmarks/diag_decode.py host
    python benchmarks/diag_decode.py profile --layers 4 --variants fp16,w4,w4-fused --cases 8x128 --top 12
    python benchmarks/diag_decode.py graph --model mixtral --layers 2 --batch 8 --prefill 128
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e as E  # noqa: E402

import jitmarlin  # noqa: E402


def host(args) -> None:
    dev = torch.device("cuda")
    for (k, n) in ((4096, 4096), (4096, 11008)):
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.float16, device=dev)
        q = jitmarlin.MarlinLinear.from_linear(lin, bits=4, group_size=128)
        for m in (1, 128):
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            for label, fn in (("fp16 nn.Linear", lin), ("MarlinLinear", q)):
                for _ in range(20):
                    fn(x)
                torch.cuda.synchronize()
                reps = 500
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(x)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                print(f"host {label:15s} K={k} N={n} M={m}: {1e6 * (t1 - t0) / reps:6.1f} us/call on the CPU, "
                      f"{1e6 * (t2 - t0) / reps:6.1f} us/call until the GPU is done", flush=True)
    lin = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.float16, device=dev)
    for act in (False, True):
        q = jitmarlin.MarlinLinear.from_linear(lin, bits=4, group_size=128, act_order=act)
        for m in (1, 128):
            x = torch.randn(m, 4096, dtype=torch.float16, device=dev)
            for _ in range(20):
                q(x)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                q(x)
            prof.disable()
            torch.cuda.synchronize()
            print(f"== cProfile act_order={act} M={m}, 300 calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def _kernel_times(fn, reps: int = 3) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name] += ev.device_time / reps  # us
    return out


def _category(name: str) -> str:
    if name.startswith("jm_gemm"):
        return "jitmarlin gemm"
    if name.startswith("jm_wgmma"):
        return "jitmarlin wgmma"
    if name.startswith("jm_dequant"):
        return "jitmarlin dequant"
    low = name.lower()
    if any(s in low for s in ("gemm", "gemv", "cutlass", "sm90_xmma", "ampere_", "sm80_xmma", "cublas", "splitk")):
        return "cuBLAS gemm"
    if "flash" in low or "fmha" in low or "attention" in low or "efficient" in low:
        return "attention"
    return "other"


def profile_cmd(args) -> None:
    dev = torch.device("cuda")
    spec = E.SPECS[args.model]
    spec = E.ModelSpec(**{**spec.__dict__, "layers": args.layers})
    for vkey in args.variants.split(","):
        label, qopts = E.VARIANTS[vkey]
        model = E.build_model(spec, dev, 0)
        if qopts:
            jitmarlin.quantize_model(model, device=dev, **qopts)
        if vkey in E.FUSED_VARIANTS:
            jitmarlin.fuse_projections(model)
        api = E.ModelAPI(model)
        for batch, prefill in [tuple(map(int, c.split("x"))) for c in (args.cases or "1x128,8x128,1x512").split(",")]:
            ids = torch.randint(0, spec.vocab, (batch, prefill), device=dev)
            with torch.no_grad():
                fwd = lambda: model(input_ids=ids, use_cache=True, **api.keep_last())  # noqa: E731
                pre = _kernel_times(fwd)  # (its first call warms up)
                wall = sorted(E.time_call(fwd, dev) for _ in range(3))[1]
                print(f"{spec.label} {label} B={batch} P={prefill} prefill: {wall * 1e3:.3f} ms per forward (CUDA "
                      "events around the eager call: host gaps included)", flush=True)
                if args.host_profile:  # where the host time of the eager forward goes (python functions)
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.host_profile):
                        fwd()
                    prof.disable()
                    torch.cuda.synchronize()
                    print(f"== cProfile {label} B={batch} P={prefill}, {args.host_profile} forwards, by own time:")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top or 20)
                dec = E.Decoder(model, api, ids, 16)
                dec.reset()
                step = _kernel_times(dec.step)
            for what, times in (("prefill", pre), ("decode step", step)):
                cats: dict[str, float] = defaultdict(float)
                for name, us in times.items():
                    cats[_category(name)] += us
                total = sum(times.values())
                print(f"{spec.label} {label} B={batch} P={prefill} {what}: GPU {total / 1e3:.3f} ms in "
                      f"{len(times)} kernel names; " + ", ".join(f"{c} {us / 1e3:.3f} ms" for c, us in sorted(cats.items())),
                      flush=True)
                if args.top:
                    for name, us in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
                        print(f"    {us:9.1f} us  {name[:110]}")
        del model
        E.free_memory(dev)


def graph_cmd(args) -> None:
    dev = torch.device("cuda")
    spec = E.SPECS[args.model]
    spec = E.ModelSpec(**{**spec.__dict__, "layers": args.layers})
    label, qopts = E.VARIANTS[args.variant]
    model = E.build_model(spec, dev, 0)
    if qopts:
        jitmarlin.quantize_model(model, device=dev, **qopts)
    api = E.ModelAPI(model)
    print(f"JITMARLIN_PDL={os.environ.get('JITMARLIN_PDL', '(unset)')} {spec.label} {label}")
    for batch, prefill in [tuple(map(int, c.split("x"))) for c in (args.cases or "8x128,8x512,1x2048").split(",")]:
        ids = torch.randint(0, spec.vocab, (batch, prefill), device=dev, generator=torch.Generator(dev).manual_seed(1))
        with torch.no_grad():
            for _ in range(2):  # prefill as the benchmark does (grows the workspace)
                model(input_ids=ids, use_cache=True, **api.keep_last())
            dec = E.Decoder(model, api, ids, 32)

            def run_eager(n=3):
                dec.reset()
                return [dec.step().float().clone() for _ in range(n)]

            a, b = run_eager(), run_eager()
            eager_same = all(torch.equal(x, y) for x, y in zip(a, b))
            toks_a = [x.argmax(-1).tolist() for x in a]
            try:
                _, _, diff = E.capture_decode(dec, 32)
                res = f"graph check passed, max rel diff {diff:.3g}"
            except Exception as err:  # noqa: BLE001
                res = f"graph check FAILED: {err}"
            print(f"  B={batch} P={prefill}: eager run twice bit-identical: {eager_same}; {res}; eager tokens "
                  f"{toks_a[0][:4]}", flush=True)
            if not eager_same:
                for i, (x, y) in enumerate(zip(a, b)):
                    print(f"    step {i}: max |a-b| {(x - y).abs().max().item():.3g}, argmax equal "
                          f"{torch.equal(x.argmax(-1), y.argmax(-1))}")


def det_cmd(args) -> None:
    """Bitwise repeatability of the GEMM: the same call 30 times, per shape, M and tile."""
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops._kernels import Tile

    dev = torch.device("cuda")
    tiles = {"auto": None, "w8_ks2": (Tile(1, True, 8, 6, True, 2), 4), "w8_bk": (Tile(1, True, 8, 6, True), 4),
             "w8_cpasync": (Tile(1, True, 8, 6), 4)}
    for (k, n) in ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 1024)):
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.float16, device=dev)
        q = jitmarlin.MarlinLinear.from_linear(lin, bits=4, group_size=128)
        for m in (1, 2, 8, 16):
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            for tname, override in tiles.items():
                if override is not None and m > 8:
                    continue
                mm, nn_, kk, fam = G.check_args(x, q.qweight, q.scales, q.qzeros, None)
                outs = []
                for _ in range(30):
                    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=dev)
                    G.launch_gemm(x, q.qweight, q.scales, q.qzeros, None, out, mm, nn_, kk, fam, plan_override=override)
                    outs.append(out)
                torch.cuda.synchronize()
                bad = sum(not torch.equal(o, outs[0]) for o in outs[1:])
                worst = max((o.float() - outs[0].float()).abs().max().item() for o in outs[1:])
                rows = sorted({r for o in outs[1:] for r in (o != outs[0]).any(1).nonzero().flatten().tolist()})
                print(f"det K={k} N={n} M={m} {tname:10s}: {bad}/29 differ from the first, max diff {worst:.3g}, "
                      f"rows {rows[:8]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("host", "profile", "graph", "det"))
    ap.add_argument("--model", default="llama", choices=tuple(E.SPECS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", default="fp16,w4")
    ap.add_argument("--variant", default="w4")
    ap.add_argument("--cases", default=None, help="BATCHxPREFILL list (profile: 1x128,8x128,1x512; graph: "
                    "8x128,8x512,1x2048)")
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--host-profile", type=int, default=0, help="profile: cProfile this many prefill forwards "
                    "per case and print the functions with the most own time (--top of them, else 20)")
    args = ap.parse_args()
    {"host": host, "profile": profile_cmd, "graph": graph_cmd, "det": det_cmd}[args.what](args)


if __name__ == "__main__":
    main()
