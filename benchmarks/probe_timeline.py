"""Where the fixed cost of a GEMM call goes, inside a chain of calls (the way layers run): every
call of a CUDA graph of back-to-back GEMMs (programmatic dependent launch between them) records
per-CTA GPU timestamps (kernels built with -DJM_TIMELINE; bulk tiles on sm_90, see the
"Diagnostics" block of cuda_src/jm_gemm.cuh, and the sm_90a wgmma kernel, where "wait" is thread 0
past griddep_wait, "first" the first stage landed, "fixup" the split-K sum and output), and this prints, for the calls in the middle of the
chain, medians over calls of:

    step        end of the previous call -> end of this one (the per-call time in the chain)
    enter       previous end -> this call's first / median CTA entry (negative: entered early)
    wait        previous end -> median producer past griddep_wait (the programmatic-launch release)
    first       median past-wait -> median first tile landed in a math warp (first bytes)
    busy        median first tile -> last tile computed (the streaming part of a CTA)
    tail        median last-computed -> latest last-computed (the static split's spread)
    fixup       median / max ns a CTA's math warp 0 spent in unit fixups and outputs
    exit        latest last-computed -> latest CTA end (the final fixups)

    python benchmarks/probe_timeline.py --shapes 8192x28672,8192x8192,4096x4096 --m 1,16

The timer is %globaltimer (ns; its update granularity is printed: on some GPUs it ticks in µs
steps unless a profiler raises its rate). Timestamps of different SMs come from one GPU-wide
clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

flags = os.environ.get("JITMARLIN_NVCC_FLAGS", "")
if "-DJM_TIMELINE" not in flags.split():  # before jitmarlin builds anything: part of the cache key
    os.environ["JITMARLIN_NVCC_FLAGS"] = (flags + " -DJM_TIMELINE").strip()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_gemm import GROUP, make_weights  # noqa: E402

from jitmarlin.ops import _kernels as K  # noqa: E402
from jitmarlin.ops import gemm as G  # noqa: E402
from jitmarlin.quant import pack_weights, permute_scales  # noqa: E402

SLOTS = 8  # values per CTA (jm_gemm.cuh)


def chain(k: int, n: int, m: int, calls: int, override=None):
    """Per-call timeline arrays [grid, 8] of one replay of a graph of `calls` GEMMs, and the grid."""
    q, s = make_weights(k, n)
    b, sc = pack_weights(q, 4), permute_scales(s)
    copies = [(b, sc)] + [(b.clone(), sc.clone()) for _ in range(common.copies_for(k * n // 2) - 1)]
    fam = K.Family("f16", 4, False, GROUP)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    index = K.cuda_index(a.device)
    wgmma = (override is not None and override[0] == "wgmma") or (override is None and
                                                                   G.use_wgmma_path(m, n, k, fam, index))
    if wgmma:  # the sm_90a warpgroup-MMA kernel (its timeline: cuda_src/jm_wgmma.cuh, same slots)
        cfg = tuple(override[1:]) if override else ()
        wl = G.wgmma_launch(m, n, k, fam, index, *cfg)
        grid = wl.grid
        tag = "wgmma-n%d-f%d-s%d" % (cfg[:3] if cfg else (wl.nt, wl.fw, wl.stages)) + ("-w" if wl.threads == 512 else "")
    else:
        if override:  # the launch launch_gemm makes for it (its grid sizes the timeline buffers)
            tile, w = override
            launch = G._make_launch(G.Plan(tile, w, K.smem_bytes(fam, tile, w)), m, n, k, fam, index)
        else:
            launch = G.prepare_launch(m, m, n, k, fam, index)
        grid, tag = launch.grid, launch.plan.tile.tag()
        if not launch.plan.tile.bulk:
            return None, grid, tag
    bufs = torch.zeros(calls, grid, SLOTS, dtype=torch.int64, device="cuda")
    state = {"i": 0}
    orig = G.launch_params
    orig_params = K.GemmParams

    def with_timeline(*args, **kw):
        p = orig(*args, **kw)
        p.timeline = bufs[state["i"] % calls].data_ptr()
        return p

    class TimelineParams(orig_params):  # the wgmma launch builds its parameters itself
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.timeline = bufs[state["i"] % calls].data_ptr()

    G.launch_params = with_timeline
    if wgmma:
        K.GemmParams = TimelineParams
    try:
        def step(i):
            state["i"] = i
            G.launch_gemm(a, copies[i % len(copies)][0], copies[i % len(copies)][1], None, None, out, m, n, k,
                          fam, plan_override=override)

        for i in range(2):
            step(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                step(i)
        for _ in range(3):  # warm, then the replay we read
            bufs.zero_()
            g.replay()
        torch.cuda.synchronize()
    finally:
        G.launch_params = orig
        K.GemmParams = orig_params
    return bufs.cpu(), grid, tag


def summarize(t: torch.Tensor, grid: int) -> dict:
    calls = t.shape[0]
    med = statistics.median
    rows = []
    ends = [int(t[c, :, 4].max()) for c in range(calls)]
    ticks = sorted({int(x) for x in t[:, :, 0].flatten().tolist()})
    granularity = min((b - a for a, b in zip(ticks, ticks[1:]) if b > a), default=0)
    for c in range(calls // 4, calls - calls // 4):  # the middle of the chain
        if c == 0:
            continue
        e = t[c]
        prev = ends[c - 1]
        entry, waited, first, last, end, fix = (e[:, i].tolist() for i in (0, 1, 2, 3, 4, 7))
        rows.append({
            "step": ends[c] - prev,
            "enter_first": min(entry) - prev, "enter_median": med(entry) - prev,
            "wait": med(waited) - prev,
            "first": med(first) - med(waited),
            "busy": med(last) - med(first),
            "tail": max(last) - med(last),
            "fixup_median": med(fix), "fixup_max": max(fix),
            "exit": max(end) - max(last),
        })
    out = {key: med(r[key] for r in rows) / 1000.0 for key in rows[0]}
    out["granularity_ns"] = granularity
    out["tiles_per_cta"] = med(t[calls // 2, :, 6].tolist())
    out["ctas_per_sm"] = grid / max(1, len({int(x) for x in t[calls // 2, :, 5].tolist()}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x28672,8192x8192,4096x4096")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--config", default="", help="TILE_TAG-wN (or wgmma-n{NT}-f{FW}-s{STAGES}) instead of the "
                    "route's choice")
    args = ap.parse_args()
    tiles = {t.tag(): t for t in K.tiles_for(torch.cuda.get_device_capability(0))}
    override = None
    if args.config.startswith("wgmma"):
        override = ("wgmma",) + tuple(int(x[1:]) for x in args.config.split("-")[1:])
    elif args.config:
        tag, w = args.config.rsplit("-w", 1)
        override = (tiles[tag], int(w))
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for m in (int(x) for x in args.m.split(",")):
            t, grid, tag = chain(k, n, m, args.calls, override)
            if t is None:
                print(f"{k}x{n} M={m} {tag}: not a bulk tile (only those record a timeline)", flush=True)
                continue
            r = summarize(t, grid)
            print(f"{k}x{n} M={m} {tag} grid {grid} ({r['ctas_per_sm']:.1f}/SM, {r['tiles_per_cta']:.0f} tiles/CTA), "
                  f"timer step {r['granularity_ns']} ns | us: step {r['step']:.1f}, enter {r['enter_first']:.1f} / "
                  f"{r['enter_median']:.1f}, wait {r['wait']:.1f}, first {r['first']:.1f}, busy {r['busy']:.1f}, "
                  f"tail {r['tail']:.1f}, fixup {r['fixup_median']:.1f} / {r['fixup_max']:.1f}, exit {r['exit']:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
