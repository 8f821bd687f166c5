"""Where the act-order time goes at small M: the layer (gather kernel + GEMM) against the GEMM alone
on already-gathered activations and the gather alone, each timed as a CUDA graph over enough layer
copies to stream from HBM. Run it under JITMARLIN_PDL=0 / =1 to see what the programmatic launch
overlap gives, and with --w16-stages 4 to time the M = 9-16 ring of the previous route.

    python benchmarks/probe_act_order.py --shapes 28672x8192,8192x28672 --m 1,16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from jitmarlin.nn import MarlinLinear  # noqa: E402
from jitmarlin.ops import _kernels as K  # noqa: E402
from jitmarlin.ops import gemm as G  # noqa: E402
from jitmarlin.quant import Packed, pack_weights, permute_scales  # noqa: E402

GROUP = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="28672x8192,8192x28672")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--w16-stages", type=int, default=0, help="ring slots of the M = 9-16 tile (0: the route's)")
    ap.add_argument("--gather-pdl", default="route", choices=("route", "0", "1"),
                    help="launch the act-order gather as a programmatic dependent: the route's rule "
                         "(gemm.gather_pdl), never, or always (the GEMM after it keeps PDL)")
    ap.add_argument("--gather-smem-min-m", type=int, default=0,
                    help="smallest M for the shared-memory gather (0: the library's, gemm.GATHER_SMEM_MIN_M)")
    ap.add_argument("--wgmma-pdl", type=int, default=-1, choices=(-1, 0, 1),
                    help="launch the wgmma kernel after the gather as a programmatic dependent (-1: the library's rule)")
    ap.add_argument("--strip-small", type=int, default=-1, choices=(-1, 0, 1),
                    help="the strip kernel's small-problem route, whose act-order form gathers in the kernel "
                         "(gemm.STRIP_SMALL; -1: the library's)")
    ap.add_argument("--strip-gather-plain", type=int, default=-1, choices=(-1, 0, 1),
                    help="past gemm.STRIP_PERM_MAX_M, the gather kernel then the strip kernel's plain form where the "
                         "strip route takes the shape (gemm.STRIP_GATHER_PLAIN; -1: the library's)")
    ap.add_argument("--strip-perm-max-m", type=int, default=-1,
                    help="the largest M whose act-order calls take the strip kernel's in-kernel gather where the strip "
                         "route takes the shape (gemm.STRIP_PERM_MAX_M; -1: the library's)")
    ap.add_argument("--strip-tall-perm", type=int, default=-1, choices=(-1, 0, 1),
                    help="act-order calls on the strip kernel's tall-layer route take its act-order form "
                         "(gemm.STRIP_TALL_PERM; -1: the library's)")
    args = ap.parse_args()
    if args.strip_tall_perm >= 0:
        G.STRIP_TALL_PERM = bool(args.strip_tall_perm)
    if args.strip_perm_max_m >= 0:
        G.STRIP_PERM_MAX_M = args.strip_perm_max_m
    if args.strip_small >= 0:
        G.STRIP_SMALL = bool(args.strip_small)
    if args.strip_gather_plain >= 0:
        G.STRIP_GATHER_PLAIN = bool(args.strip_gather_plain)
    if args.gather_smem_min_m:
        G.GATHER_SMEM_MIN_M = args.gather_smem_min_m
    if args.wgmma_pdl >= 0:
        G.WGMMA_PDL_AFTER_GATHER = bool(args.wgmma_pdl)
    if args.gather_pdl != "route":
        G.gather_pdl = lambda grid: args.gather_pdl == "1"
    if args.w16_stages:
        base = G._preferences

        def prefs(m, n, k, cc=(8, 0), **kw):
            out = base(m, n, k, cc, **kw)
            if out and out[0][0].rows == 16 and out[0][0].bulk:
                return ((K.Tile(2, True, 8, args.w16_stages, True), 4),) + out
            return out
        G._preferences = prefs
        K.BULK_TILES = K.BULK_TILES + tuple(t for t in (K.Tile(2, True, 8, args.w16_stages, True),)
                                            if t not in K.BULK_TILES)
    tag = (f"PDL={os.environ.get('JITMARLIN_PDL', '1')} gather PDL={args.gather_pdl} "
           f"flags={os.environ.get('JITMARLIN_NVCC_FLAGS', '') or '-'} WGMMA={os.environ.get('JITMARLIN_WGMMA', 'auto')} "
           f"w16 stages={args.w16_stages or 'route'} smem gather from M={G.GATHER_SMEM_MIN_M} "
           f"wgmma PDL after gather={G.WGMMA_PDL_AFTER_GATHER} strip small={G.STRIP_SMALL} tall perm={G.STRIP_TALL_PERM} strip after gather={G.STRIP_GATHER_PLAIN} "
           f"in-kernel gather to M={G.STRIP_PERM_MAX_M}")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32, generator=gen)
        s = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.002 + 0.0005).half()
        perm = torch.randperm(k, device="cuda", generator=gen)
        packed = Packed(pack_weights(q, 4), permute_scales(s), None, 4, GROUP)
        copies = [MarlinLinear.from_packed(Packed(packed.b.clone(), packed.scales.clone(), None, 4, GROUP), perm=perm)
                  for _ in range(common.copies_for(k * n // 2))]
        fam = K.Family("f16", 4, False, GROUP)
        p32 = copies[0].perm
        for m in (int(x) for x in args.m.split(",")):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ag = a[:, p32.long()].contiguous()
            layer = common.time_graph(lambda i: copies[i](a), len(copies))
            out = torch.empty(m, n, device="cuda", dtype=torch.float16)
            gemm = common.time_graph(lambda i: G.launch_gemm(ag, copies[i].qweight, copies[i].scales, None, None,
                                                             out, m, n, k, fam), len(copies))
            gather = common.time_graph(lambda i: G.gather_columns(a, p32, m, k, fam), len(copies))
            plan = G.select_plan(m, n, k, fam, G.device_info(0).smem_per_block, G.device_info(0).cc)
            rc = G.wgmma_route_config(m, n, k, G.driver.device(0).sm_count)
            route = ("wgmma-n%d-f%d-s%d" % rc[:3] + ("-w" if rc[3] else "")
                     if G.use_wgmma_path(m, n, k, fam, 0) else f"{plan.tile.tag()}-w{plan.nwarps}")
            strip = G.strip_route(m, n, k, fam, 0)
            route = "strip-w%d-c%d-t%d%s" % (*strip[:3], "-s" if strip[3] else "") if strip else route
            print(f"[{tag}] {k}x{n} M={m}: layer {layer:.1f} us, gemm on gathered A {gemm:.1f}, gather alone "
                  f"{gather:.1f} ({route})", flush=True)


if __name__ == "__main__":
    main()
