"""Time a few explicit GEMM configs (tile tag + CTA width) on a few shapes, for A/B experiments
with kernel build switches ($JITMARLIN_NVCC_FLAGS). Prints one line per (shape, M, config).

    JITMARLIN_NVCC_FLAGS=-DJM_STREAM_ONLY python benchmarks/probe_configs.py \
        --shapes 8192x28672 --m 1 --configs w8_k128_s6_bk-w4,w8_k128_s6_bk-w8
    python benchmarks/probe_configs.py --m 16 --extra-tiles w16_k128_s5_bk \
        --configs w16_k128_s4_bk-w4,w16_k128_s5_bk-w4
    python benchmarks/probe_configs.py --shapes 8192x8192 --m 1 --max-per-sm 2 \
        --extra-tiles w8_k128_s6_bk_dr2_cl4 --configs w8_k128_s6_bk_dr2_cl4-w2
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_gemm import bench_ours, floor_us, make_weights  # noqa: E402

from jitmarlin.ops import _kernels as K  # noqa: E402
from jitmarlin.ops import gemm as G  # noqa: E402


# The tall-tile cost model of sessions 44-46 (gemm.WGMMA_COST_* before session 47 took session 46's refit with the
# cluster term and the 144-token tile): config routeC0
S44_FIT_PER_STAGE = {(128, 1, "plain"): 0.767, (128, 2, "p2"): 0.820, (128, 2, "w"): 0.857,
                     (160, 2, "p2"): 0.971, (192, 1, "p2"): 0.587, (256, 1, "p2"): 0.755}
S44_FIT_TERMS = {"a": 0.785, "split": 4.571, "per_split": 2.157, "sk": 15.248, "sk_stage": 0.048, "cluster": 0.0}
# Session 47's model (session 46's fit; no 176- / 208- / 224- / 240-token tiles, which it does not price so never
# picks): config routeC47
S47_FIT_PER_STAGE = {(128, 1, "plain"): 0.768, (128, 2, "p2"): 0.808, (128, 2, "w"): 0.858, (144, 1, "p2"): 0.533,
                     (160, 2, "p2"): 0.957, (192, 1, "p2"): 0.581, (256, 1, "p2"): 0.752}
S47_FIT_TERMS = {"a": 0.682, "split": 4.31, "per_split": 2.316, "sk": 15.253, "sk_stage": 0.054, "cluster": -1.972}
# Prepared in session 48 (not measured as a route): fix-up terms scaled by the tile's rows (gemm.WGMMA_COST_FIXUP_ROWS),
# fitted by fit_tall_cost.py s43d s44a --clustered s45d s46a s48a s48b --route48 s48d --fixup-rows: config routeC49
S49_FIT_PER_STAGE = {(128, 1, "plain"): 0.779, (128, 2, "p2"): 0.81, (128, 2, "w"): 0.854, (144, 1, "p2"): 0.514,
                     (160, 2, "p2"): 0.937, (176, 1, "p2"): 0.569, (192, 1, "p2"): 0.59, (208, 1, "p2"): 0.637,
                     (224, 1, "p2"): 0.655, (240, 1, "p2"): 0.702, (256, 1, "p2"): 0.751}
S49_FIT_TERMS = {"a": 0.822, "split": 4.625, "per_split": 0.353, "sk": 8.076, "sk_stage": 0.045, "cluster": -1.629}


# The table's rows at M = 129-256 before session 48 split its 256-token row (config routeR47; s48f also ran it
# against a 176-token row at M = 145-176, since dropped)
S47_TALL_ROUTE = tuple(G.TallRow(193, 256, (256, 1, 4), min_kn=(1 << 24) + 1) if r.tile[0] == 208 and r.hi <= 256 else r
                       for r in G.WGMMA_TALL_ROUTE if not (r.tile[0] in (224, 240, 256) and r.hi <= 256))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192x28672")
    ap.add_argument("--m", default="1")
    ap.add_argument("--configs", required=True, help="comma-separated TILE_TAG-wN[-gG], e.g. w8_k128_s6_bk-w4 "
                    "(route: the heuristic's choice, route0: it without the 128-token stream-K rule gemm.wgmma_route_stream2, routeT0: without the tall-tile rule gemm.wgmma_route_tall, routeTab: its table rows above M = 256 instead of the cost model, routeH0: without the rule that halves the plain 128- / 64-token tile's K splits into a cluster of 2 (gemm.WGMMA_CLUSTER_HALVE), routeHT0: without it taking M = 145-256 from the table's tall tiles (gemm.WGMMA_HALVE_OVER_TALL, session 47), routeHTK: with it at any K (WGMMA_HALVE_MAX_K, and WGMMA_HALVE_TALL_MAX_K for the 256-token tile), routeC0: the cost model above M = 256 of sessions 44-46 (S44_FIT_*, before session 47's refit), routeC47: session 47's (S47_FIT_*, without the 176- / 208- / 224- / 240-token tiles of session 48), routeC49: the cost model with its fix-up terms scaled by the tile's rows (S49_FIT_*, gemm.WGMMA_COST_FIXUP_ROWS; prepared in session 48), routeR47: the table's rows at M = 129-256 of session 47 (256-token tiles where session 48 runs 208 / 224 / 240), routeM129: the cost model's tall tile from M = 129 instead of the table's rows at M = 129-256 (gemm.WGMMA_TALL_MODEL_MIN_M), routeS: with the strip kernel's route at M <= 32 (gemm.STRIP_ROUTE, sessions 49-50); routeS0: without its default route on small shapes (gemm.STRIP_SMALL, session 52) and tall ones; routeL0: without it on tall shapes only (gemm.STRIP_TALL, session 55); strip-w{WARPS}-c{CLUSTER}[-t{BLOCKS}][-s]: the strip kernel of that config (K.STRIP_CONFIGS; -tB: B blocks of 8 tokens, M <= 8 B; default: the fewest that hold M; -s: its weights' ring in shared memory); routeHF<D>: the halving rule where two splits per tile fill 0.D of the SMs, either token tile (gemm.WGMMA_HALVE_MIN_FILL: 0.9 to session 47, then 0.6 / 0.7 for the 128- / 64-token tile; routeHF9 the old rule, routeHF55 0.55); a +ws suffix: wgmma K splits summed through the workspace instead of a cluster, +c4: in clusters of up to 4; wgmma-n{NT}-f{FW}-s{STAGES}[-k{SPLITS}|-sk][-w]: the sm_90a kernel, -sk "
                    "stream-K, -w its wide form (four warpgroups of one strip; FW = 2 configs added by --extra-wgmma "
                    "NT-2-S-w)) "
                    "or w8_k128_s6_bk-w4-g132 (132 CTAs: fewer than fit, or more for a second wave)")
    ap.add_argument("--extra-tiles", default="", help="comma-separated tile tags built into the families "
                    "for this run only (candidates outside the built-in lists), e.g. w16_k128_s5_bk")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8), help="weight bits (group 128)")
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16"), help="activation dtype")
    ap.add_argument("--extra-wgmma", default="", help="comma-separated NT-FW-STAGES wgmma configs built into the "
                    "dense wgmma module for this run only, e.g. 64-2-8 (then usable as wgmma-n64-f2-s8); NT-2-STAGES-w: the "
                    "wide form (four warpgroups of one strip), e.g. 128-2-6-w (then wgmma-n128-f2-s6-w); NT-FW-STAGES-p: "
                    "the producer form, e.g. 64-1-8-p or 32-2-8-p (then wgmma-n64-f1-s8-p, wgmma-n32-f2-s8-p); NT-1-STAGES-p3 / -p4: "
                    "its three- / four-CTA-per-SM build (NT <= 32), e.g. 32-1-6-p3 (then wgmma-n32-f1-s6-p); NT-FW-STAGES-p2: its "
                    "form with two compute warpgroups of FW strips, one CTA per SM, e.g. 128-2-6-p2 (then "
                    "wgmma-n128-f2-s6-p2, or wgmma-n128-f2-s6-sk-p2 for stream-K)")
    ap.add_argument("--max-per-sm", type=int, default=0, help="pad every config's dynamic shared memory so that "
                    "at most this many CTAs fit on one SM (their grid and cluster placement follow): e.g. 2 "
                    "spreads 256 CTAs of a cluster tile over 128 SMs instead of packing them onto fewer")
    ap.add_argument("--any-fit", action="store_true", help="build --extra-tiles into every family, also where "
                    "tile_fits excludes them (probe only: e.g. direct-load tiles of 8-bit weights)")
    ap.add_argument("--settle", type=float, default=0.0, help="idle seconds before each timed (config, shape) "
                    "block, so that clocks recover from the block before (common.settle)")
    args = ap.parse_args()
    common.SETTLE_S = args.settle
    for cfg in (c for c in args.extra_wgmma.split(",") if c):  # before the first build (part of the cache key)
        if cfg.endswith("-p2"):  # the producer form with two compute warpgroups (K.WGMMA_PROD2_CONFIGS)
            K.WGMMA_PROD2_CONFIGS = tuple(dict.fromkeys(K.WGMMA_PROD2_CONFIGS + (tuple(int(x) for x in cfg[:-3].split("-")),)))
        elif cfg.endswith(("-p", "-p3", "-p4")):  # the producer form (jm_wgmma.cuh WgRing; never wide):
            # NT-FW-S-p, or NT-FW-S-p3 / -p4 for three / four CTAs per SM (K.WGMMA_PROD_CTAS)
            nums = tuple(int(x) for x in cfg[:cfg.rindex("-")].split("-"))
            K.WGMMA_PROD_CONFIGS = tuple(dict.fromkeys(K.WGMMA_PROD_CONFIGS + (nums,)))
            if cfg[-1] in "34":
                K.WGMMA_PROD_CTAS[nums] = int(cfg[-1])
        elif cfg.endswith("-w"):  # the wide form of a two-strip config (its plain form need not be built)
            K.WGMMA_WIDE_CONFIGS = tuple(dict.fromkeys(K.WGMMA_WIDE_CONFIGS + (tuple(int(x) for x in cfg[:-2].split("-")),)))
        else:
            K.WGMMA_CONFIGS = tuple(dict.fromkeys(K.WGMMA_CONFIGS + (tuple(int(x) for x in cfg.split("-")),)))
    extra = tuple(K.Tile.from_tag(t) for t in args.extra_tiles.split(",") if t)
    if args.any_fit and extra:  # build the extra tiles even where tile_fits keeps them out (e.g. direct, 8-bit)
        fits = K.tile_fits
        K.tile_fits = lambda fam, tile: fits(fam, tile) or tile in extra
    if extra:  # before the first build: the family's module (and cache key) then holds them
        K.TILES = K.TILES + tuple(t for t in extra if not t.bulk and t not in K.TILES)
        K.BULK_TILES = K.BULK_TILES + tuple(t for t in extra if t.bulk and t not in K.BULK_TILES)
    if args.max_per_sm > 0:  # the kernels use only what they need; the rest keeps other CTAs off the SM
        smem_bytes = K.smem_bytes
        pad = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor // (args.max_per_sm + 1) + 1024
        K.smem_bytes = lambda fam, tile, nwarps: max(smem_bytes(fam, tile, nwarps), pad)
    tiles = {t.tag(): t for t in K.tiles_for(torch.cuda.get_device_capability(0))}
    bw = common.copy_bandwidth()
    flags = os.environ.get("JITMARLIN_NVCC_FLAGS", "")
    stream2_fill, tall_max_m, cluster_max = G.WGMMA_STREAM2_MAX_FILL, G.WGMMA_TALL_MAX_M, G.WGMMA_CLUSTER_MAX
    model_min_m = G.WGMMA_TALL_MODEL_MIN_M
    cost = dict(G.WGMMA_COST_PER_STAGE), dict(G.WGMMA_COST_TERMS)  # the shipped cost model (routeC0 swaps it)
    halve_k, tall_k, halve_fill = G.WGMMA_HALVE_MAX_K, dict(G.WGMMA_HALVE_TALL_MAX_K), dict(G.WGMMA_HALVE_MIN_FILL)
    tall_route, fixup_rows, strip_on = G.WGMMA_TALL_ROUTE, G.WGMMA_COST_FIXUP_ROWS, G.STRIP_ROUTE
    strip_small, strip_tall = G.STRIP_SMALL, G.STRIP_TALL
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        q, s = make_weights(k, n, bits=args.bits)
        for name in args.configs.split(","):
            # NAME+ws: the wgmma K splits summed through the workspace, not in clusters (gemm.WGMMA_CLUSTER_SUM);
            # NAME+c4: in clusters of up to 4 (gemm.WGMMA_CLUSTER_MAX; the route's default: 2)
            cfg = name[:-3] if name.endswith(("+ws", "+c4")) else name
            G.WGMMA_CLUSTER_SUM = not name.endswith("+ws")
            G.WGMMA_CLUSTER_MAX = 4 if name.endswith("+c4") else cluster_max
            # what the heuristic picks; route0: without the two-compute-warpgroup stream-K rule (session 39)
            G.WGMMA_STREAM2_MAX_FILL = 0.0 if cfg == "route0" else stream2_fill
            G.WGMMA_TALL_MAX_M = 0 if cfg == "routeT0" else tall_max_m  # routeT0: without the tall-tile rule
            G.WGMMA_TALL_MODEL = cfg != "routeTab"  # routeTab: tall tiles from the table's rows above M = 256 too
            G.WGMMA_TALL_MODEL_MIN_M = 129 if cfg == "routeM129" else model_min_m  # routeM129: the model from M = 129
            G.WGMMA_CLUSTER_HALVE = cfg != "routeH0"  # routeH0: without the two-clustered-splits rule (session 46)
            G.WGMMA_HALVE_OVER_TALL = cfg != "routeHT0"  # routeHT0: that rule not over the table's tall tiles
            # routeHTK: the halving rule without its K bounds (over the 256-token tall tile too; not the 192-token one)
            G.WGMMA_HALVE_MAX_K = 1 << 20 if cfg == "routeHTK" else halve_k
            # routeHF<D>: the halving rule at 0.D of the SMs (routeHF9: before session 48; routeHF55: at 0.55)
            hf = re.fullmatch(r"routeHF(\d+)", cfg)
            G.WGMMA_HALVE_MIN_FILL = {t: int(hf[1]) / 10 ** len(hf[1]) for t in halve_fill} if hf else halve_fill
            G.WGMMA_HALVE_TALL_MAX_K.clear()
            G.WGMMA_HALVE_TALL_MAX_K.update({192: tall_k[192], 256: 1 << 20} if cfg == "routeHTK" else tall_k)
            G.WGMMA_COST_PER_STAGE.clear(); G.WGMMA_COST_TERMS.clear()
            old_fit = {"routeC0": (S44_FIT_PER_STAGE, S44_FIT_TERMS), "routeC47": (S47_FIT_PER_STAGE, S47_FIT_TERMS),
                       "routeC49": (S49_FIT_PER_STAGE, S49_FIT_TERMS)}
            G.WGMMA_COST_FIXUP_ROWS = cfg == "routeC49" or fixup_rows  # routeC49: fix-up terms x the tile's rows
            G.WGMMA_COST_PER_STAGE.update(old_fit.get(cfg, cost)[0])
            G.WGMMA_COST_TERMS.update(old_fit.get(cfg, cost)[1])
            G.WGMMA_TALL_ROUTE = S47_TALL_ROUTE if cfg == "routeR47" else tall_route  # routeR47: session 47's rows
            G.STRIP_ROUTE = cfg == "routeS" or strip_on  # routeS: the strip kernel's route at M <= 32 (session 49)
            G.STRIP_SMALL = cfg != "routeS0" and strip_small  # routeS0: without it on small shapes (session 52)
            G.STRIP_TALL = cfg not in ("routeS0", "routeL0") and strip_tall  # routeL0: without it on tall ones (s55)
            G.wgmma_launch.cache_clear()
            G.prepare_launch.cache_clear()
            if cfg in ("route", "route0", "routeT0", "routeTab", "routeH0", "routeHT0", "routeHTK", "routeC0", "routeM129",
                       "routeC47", "routeR47", "routeC49", "routeS", "routeS0", "routeL0") or hf:
                override = None
            elif cfg.startswith("strip-"):  # the strip kernel: strip-w{WARPS}-c{CLUSTER}[-t{TOKEN BLOCKS}][-s]
                w, c, t, sm = re.fullmatch(r"strip-w(\d+)-c(\d+)(?:-t(\d))?(-s)?", cfg).groups()
                override = ("strip", int(w), int(c), int(t) if t else None, 1 if sm else 0)
            elif cfg.startswith("wgmma"):  # the sm_90a kernel: wgmma-n{NT}-f{FW}-s{STAGES}[-k{SPLITS}|-sk][-w][-p]
                parts = cfg.split("-")[1:]
                prod = 2 if parts[-1] == "p2" else 1 if parts[-1] == "p" else 0
                parts = parts[:-1] if prod else parts
                wide = parts[-1] == "w"
                nums = [-1 if x == "sk" else int(x[1:]) for x in (parts[:-1] if wide else parts)]
                override = ("wgmma",) + tuple(nums + [None] * (4 - len(nums))) + (wide, prod)
            else:  # TAG-wN, or TAG-wN-gG: G CTAs (default: all that fit at once)
                tag, w = cfg.rsplit("-w", 1)
                w, _, g = w.partition("-g")
                override = (tiles[tag], int(w)) + ((int(g),) if g else ())
            results: dict = {}
            ms = [int(x) for x in args.m.split(",")]
            if args.settle > 0:
                common.settle(name)
            bench_ours(k, n, ms, q, s, results, override=override, tag=name, bits=args.bits,
                       dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float16)
            for m in ms:
                r = results.get((name, k, n, m))
                what = f"{r['us']:.1f} us (floor {floor_us(k, n, m, bw, args.bits):.1f}) err {r['err']:.1e}" if r else \
                    f"failed: {results.get('errors')}"
                print(f"[{flags or 'default'}] {args.dtype} u{args.bits} {k}x{n} M={m} {name}: {what}", flush=True)


if __name__ == "__main__":
    main()
