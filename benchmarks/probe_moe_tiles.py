"""A/B probes of the MoE path (graph time of fused_marlin_moe, router excluded).

    --small-kn N      override gemm._SMALL_KN before any launch (session 8: 0 = every expert GEMM
                      on the large-problem routes, now the default on sm_90)
    --block B,..      force the expert block size (rows per m tile; 0: choose_block_size's); a
                      list is timed value by value in one process
    --ready-tables 0  the second expert GEMM through the plain moe_gemm op (waits for SiLU-mul
                      before it reads the routing tables or streams a weight tile)
    --torch-sum       the top-k sum by torch (view + sum) instead of our jm_topk_sum kernel
    --tile TAG        an mma.sync tile built into the MoE families for this run and taken first by
                      the expert blocks of its row count (sm_90 large-problem routes), e.g.
                      w8_k128_s6_bk_dr1_o3 (direct loads, three CTAs per SM) or w16_k128_s3_bk_o3
    --no-occ          the routes before session 10: no three-CTAs-per-SM tile first for MoE blocks
                      of 8 / 16 rows (gemm.MOE_DIRECT_O3, gemm.MOE_W16_O3)
    --wgmma NT-FW-S,..  wgmma MoE configs (block rows, strips per warpgroup, ring stages) built for this
                      run and taken before the built-in ones of the same (rows, strips), e.g. 64-2-8
    --fw 1|2          strips per warpgroup of the wgmma MoE kernel for blocks of 32 / 64 rows instead of
                      gemm.wgmma_strips (moe.MOE_WGMMA_FW)
    --prod-fw 1|2     strips per warpgroup pair of the producer form for blocks of 32 (2: four strips on
                      its compute warpgroup, 256 features per CTA; builds (32, 2, 6) and (32, 2, 8))
    --pregather       identity act-order permutations: both GEMMs read A pre-gathered in slot-list
                      order (gather_by_position; the producer form then copies whole blocks)
    --prod 0|1        the wgmma MoE kernel's producer form for no block size / every block size it is
                      built for (K.WGMMA_MOE_PROD_CONFIGS) instead of moe.MOE_WGMMA_PROD_BLOCKS
    --down-splits S,..  the down projection's wgmma launch split S ways along K (fp32 partial sums added
                      by the top-k sum; moe.MOE_DOWN_SPLITS; 1 = none), each value timed in turn (one
                      process; with the producer form, add --stream-k 0)
    --stream-k 0,1    the producer form's stream-K launch off / on (moe.MOE_STREAM_K), each timed in turn
    --silu-gather 0,1 SiLU-mul then the gather by position (two kernels) / jm_silu_gather (one) where the
                      down projection reads its input by position (moe.MOE_SILU_GATHER), each timed in turn
    --ab V1;V2;..     variants timed in turn in one process, --rounds times (interleaved A/B: drift and
                      routing draws hit each alike); a variant is comma-separated items: flags=F+F
                      ($JITMARLIN_NVCC_FLAGS, '+' between flags; none: empty), ctas=NT-FW-S:C (CTAs per SM of
                      a producer-form config, K.WGMMA_PROD_CTAS / _U4), fw=0|1|2 (as --fw; 0: the rule),
                      silu=0|1 (moe.MOE_SILU_EPILOGUE: SiLU-mul in the gate/up GEMM's epilogue off / on),
                      minkn=N (moe.MOE_WGMMA_PROD_MIN_KN: the producer route from experts of K*N > N),
                      smallcover=R (moe.WGMMA_COVER_SMALL_MIN_ROWS; 0: small experts never take the cover rule),
                      small32hi=R (moe.WGMMA_32_SMALL_U4_HI: 4-bit small experts' blocks of 32 below R rows),
                      smallblocks=B+B (moe.WGMMA_PROD_SMALL_BLOCKS: small experts' producer-form blocks),
                      small24=LO-HI|0 (moe.WGMMA_24_ROWS_SMALL_U4: small experts' blocks of 24; 0: never),
                      small16=LO-HI|0 (moe.WGMMA_16_ROWS_SMALL_U4: small experts' blocks of 16 on the producer
                      form; 0: never, the default until session 37),
                      smallmin=R (moe.WGMMA_PROD_SMALL32_MIN_ROWS: those blocks on the producer form from R rows),
                      prodblocks=B+B (moe.MOE_WGMMA_PROD_BLOCKS: blocks on the producer form where A is gathered;
                      prodblocks=24+32+48+80+96 takes session 34's blocks of 16 off it),
                      pfw=1|2 (moe.MOE_WGMMA_PROD_FW; the (NT, 2, S) configs from --prod-configs),
                      early=0|1 (moe.MOE_PROD_EARLY_WEIGHTS: the down projection's producer form streams its
                      first weight stages before waiting for the kernel before it), early13=0|1
                      (moe.MOE_W13_READY_TABLES: the first expert GEMM too, after the gather; with 0 pair it
                      with flags=-DJM_MOE_GATHER_TRIGGER_FIRST for the old launch order), e.g.
                      --ab "flags=none;flags=-DJM_WG_NO_GACC" or --ab "ctas=24-1-6:3;ctas=24-1-6:4"

    python benchmarks/probe_moe_tiles.py --tokens 1,16,32 --block 16
    python benchmarks/probe_moe_tiles.py --tokens 48,64 --shapes mixtral --block 24 --prod 1
        (blocks of 24 rows on the producer form, m64n24k16)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402
import common  # noqa: E402
import torch  # noqa: E402

from jitmarlin.ops import _kernels as K  # noqa: E402
from jitmarlin.ops import gemm as G  # noqa: E402
from jitmarlin.ops import moe as M  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-kn", type=int, default=None, help="override gemm._SMALL_KN (before any launch)")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--dtype", default="f16", choices=("f16", "bf16"), help="activations and scales")
    ap.add_argument("--shapes", default="mixtral,e64")
    ap.add_argument("--block", default="", help="B,..: expert block sizes, each timed in turn (default: the rule)")
    ap.add_argument("--prod-min-kn", type=int, default=None,
                    help="moe.MOE_WGMMA_PROD_MIN_KN: gather both GEMMs' inputs for the producer form from experts "
                         "of more than this many weights (0: any expert, e.g. E=64's)")
    ap.add_argument("--ready-tables", type=int, default=1)
    ap.add_argument("--torch-sum", action="store_true")
    ap.add_argument("--wgmma", default="")
    ap.add_argument("--tile", default="")
    ap.add_argument("--no-occ", action="store_true")
    ap.add_argument("--fw", type=int, default=None, choices=(1, 2),
                    help="strips per warpgroup of the wgmma MoE kernel for blocks of 32 / 64 (default: the rule)")

    ap.add_argument("--prod", type=int, default=None, choices=(0, 1),
                    help="the wgmma MoE kernel's producer form for no / every built block size (default: the rule)")
    ap.add_argument("--prod-ctas", default="", metavar="NT-FW-S=C,..",
                    help="CTAs per SM of producer-form MoE configs in every format (K.WGMMA_PROD_CTAS), e.g. 24-1-6=3")
    ap.add_argument("--prod-configs", default="",
                    help="NT-FW-S,..: producer-form MoE configs built for this run and taken first (with --prod 1)")
    ap.add_argument("--prod-fw", type=int, default=None, choices=(1, 2),
                    help="strips per warpgroup pair of the producer form for blocks of 32 (moe.MOE_WGMMA_PROD_FW; "
                         "2 builds the (32, 2, 6) and (32, 2, 8) configs for this run and takes the first)")
    ap.add_argument("--pregather", action="store_true",
                    help="identity act-order permutations (A pre-gathered in slot-list order for both GEMMs)")
    ap.add_argument("--down-splits", default="",
                    help="S,..: K splits of the down projection's wgmma launch, each timed (moe.MOE_DOWN_SPLITS; "
                         "default 1: none)")
    ap.add_argument("--stream-k", default="", help="0,1: the producer form's stream-K launch off / on, each timed "
                                                   "(moe.MOE_STREAM_K; default: as set)")
    ap.add_argument("--ab", default="", help="V1;V2;..: variants (flags=F+F, ctas=NT-FW-S:C, fw=0|1|2, silu=0|1, "
                    "minkn=N, smallcover=R, small32hi=R, smallblocks=B+B, small24=LO-HI|0, smallmin=R, prodblocks=B+B, pfw=1|2, early=0|1, early13=0|1, small16=LO-HI|0) "
                    "timed in turn")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the --ab variants")
    ap.add_argument("--silu-gather", default="", help="0,1: moe.MOE_SILU_GATHER off / on, each timed")
    args = ap.parse_args()
    if args.pregather:
        inner = bench_moe.fused_marlin_moe
        idents = {}

        def ident(e, k, dev):
            if (e, k) not in idents:
                idents[e, k] = torch.arange(k, device=dev, dtype=torch.int32).repeat(e, 1)
            return idents[e, k]

        def pregathered(x, w13, s13, w2, s2, weights, ids, **kw):
            kw["w13_perm"] = ident(w13.shape[0], x.shape[1], x.device)
            kw["w2_perm"] = ident(w2.shape[0], w2.shape[2] * 16, x.device)
            return inner(x, w13, s13, w2, s2, weights, ids, **kw)

        bench_moe.fused_marlin_moe = pregathered
    if args.prod_configs:  # before the first build: part of the module's cache key
        K.WGMMA_MOE_PROD_CONFIGS = tuple(dict.fromkeys(tuple(tuple(int(x) for x in c.split("-"))
                                                             for c in args.prod_configs.split(","))
                                                       + K.WGMMA_MOE_PROD_CONFIGS))
    if args.prod_ctas:  # before the first build: the kernel names (and the module's cache key) carry it
        for item in args.prod_ctas.split(","):
            _set_prod_ctas(*item.split("="))
    if args.prod_fw is not None:
        M.MOE_WGMMA_PROD_FW = args.prod_fw
        if args.prod_fw == 2 and not args.prod_configs:  # before the first build
            K.WGMMA_MOE_PROD_CONFIGS = ((32, 2, 6), (32, 2, 8)) + K.WGMMA_MOE_PROD_CONFIGS
    if args.prod is not None:
        M.MOE_WGMMA_PROD_BLOCKS = tuple(dict.fromkeys(c[0] for c in K.moe_prod_configs(4))) if args.prod else ()
    if args.small_kn is not None:
        G._SMALL_KN = args.small_kn
    if args.prod_min_kn is not None:
        M.MOE_WGMMA_PROD_MIN_KN = args.prod_min_kn
    fused = bench_moe.fused_marlin_moe
    if not args.ready_tables:  # the op namespace caches attributes: this shadows the op for this process
        torch.ops.jitmarlin.moe_gemm_ready_tables = torch.ops.jitmarlin.moe_gemm
    if args.tile:  # before the first build: the MoE family's module (and cache key) then holds it
        tile = K.Tile.from_tag(args.tile)
        K.BULK_TILES = K.BULK_TILES + tuple(t for t in (tile,) if t not in K.BULK_TILES)
        fits, prefs = K.tile_fits, G._preferences
        K.tile_fits = lambda fam, t: fits(fam, t) or t == tile
        G._preferences = lambda m, n, k, cc=(8, 0), large=False, experts=0, **kw: (
            (((tile, 4),) if large and prefs(m, n, k, cc, large=large)[0][0].rows == tile.rows else ())
            + prefs(m, n, k, cc, large=large, experts=experts, **kw))
    if args.no_occ:  # the routes before session 10: no three-CTAs-per-SM tiles first for MoE blocks
        prefs0 = G._preferences
        G._preferences = lambda m, n, k, cc=(8, 0), large=False, experts=0, **kw: prefs0(m, n, k, cc, large=large,
                                                                                          **kw)
    extra = tuple(tuple(int(x) for x in c.split("-")) for c in args.wgmma.split(",") if c)
    if extra:  # before the first build: part of the module's cache key; first match wins at launch
        K.WGMMA_MOE_CONFIGS = extra + K.WGMMA_MOE_CONFIGS
        blocks = {c[0] for c in extra}  # token tiles of 16 / 32: expert blocks of that size take the wgmma kernel
        use0 = M._use_wgmma_moe
        M._use_wgmma_moe = lambda bs, n, k, fam, index, *rest: (bs in blocks and n % 128 == 0 and k % 64 == 0) or use0(
            bs, n, k, fam, index, *rest)
    if args.fw is not None:
        _set_moe_fw(args.fw)
    if args.torch_sum:
        M.topk_sum = lambda c3, t, k, dtype=None: (c3.view(t, k, -1).sum(1) if c3.dim() == 2
                                                   else c3.view(c3.shape[0], t, k, -1).sum((0, 2)).to(dtype))
    tag = (f"small_kn={G._SMALL_KN} ready_tables={args.ready_tables} "
           f"sum={'torch' if args.torch_sum else 'ours'}" + (f" wgmma={args.wgmma}" if extra else "")
           + (f" tile={args.tile}" if args.tile else "") + (" no-occ" if args.no_occ else "")
           + (f" fw={args.fw}" if args.fw else "") + (f" prod={args.prod}" if args.prod is not None else "")
           + (" pregather" if args.pregather else "") + (f" prod_fw={args.prod_fw}" if args.prod_fw else "")
           + (f" prod_min_kn={args.prod_min_kn}" if args.prod_min_kn is not None else "")
           + (f" dtype={args.dtype}" if args.dtype != "f16" else ""))
    blocks = [int(v) or None for v in args.block.split(",") if v] or [None]  # (0: the rule)
    # the cases (weights, inputs, routing) once; each block size times the same ones
    cases = list(bench_moe.moe_cases(args.shapes.split(","), [int(v) for v in args.tokens.split(",")],
                                     torch.bfloat16 if args.dtype == "bf16" else torch.float16))
    variants = [v for v in args.ab.split(";") if v] or [None]
    for rnd in range(args.rounds if args.ab else 1):
        for variant in variants:
            vtag = _apply_variant(variant) if variant else ""
            if args.ab:
                vtag = f" [{vtag} r{rnd + 1}]"
            _time_cases(args, cases, blocks, fused, tag, vtag)


def _set_prod_ctas(cfg: str, ctas: str) -> None:
    """CTAs per SM of the producer-form config NT-FW-S in every format (its 4-bit override too)."""
    key = tuple(int(x) for x in cfg.split("-"))
    K.WGMMA_PROD_CTAS[key] = int(ctas)
    K.WGMMA_PROD_CTAS_U4.pop(key, None)
    K.WGMMA_PROD_CTAS_MOE_U4.pop(key, None)


def _set_moe_fw(fw: int) -> None:
    """Strips per warpgroup of the plain wgmma MoE kernel for blocks of 32 / 64 rows (0: the rule)."""
    M.MOE_WGMMA_FW = fw or None
    if fw == 2:  # blocks of 32 with two strips: not in the built set since session 17
        K.WGMMA_MOE_CONFIGS = tuple(dict.fromkeys(K.WGMMA_MOE_CONFIGS + ((32, 2, 8),)))


def _apply_variant(variant: str) -> str:
    """Set one --ab variant's flags / CTAs per SM and forget the kernels and launches chosen before."""
    for item in variant.split(","):
        key, val = item.split("=", 1)
        if key == "flags":
            os.environ["JITMARLIN_NVCC_FLAGS"] = "" if val == "none" else val.replace("+", " ")
        elif key == "ctas":
            _set_prod_ctas(*val.split(":"))
        elif key == "fw":
            _set_moe_fw(int(val))
        elif key == "silu":
            M.MOE_SILU_EPILOGUE = bool(int(val))
        elif key == "minkn":
            M.MOE_WGMMA_PROD_MIN_KN = int(val)
        elif key == "pfw":  # strips per warpgroup pair of the producer form (its configs: --prod-configs)
            M.MOE_WGMMA_PROD_FW = int(val)
        elif key == "early":  # the producer form's first weight stages before its griddep_wait (ready tables)
            M.MOE_PROD_EARLY_WEIGHTS = bool(int(val))
        elif key == "early13":  # the first expert GEMM after the gather with ready tables (moe.MOE_W13_READY_TABLES)
            M.MOE_W13_READY_TABLES = bool(int(val))
        elif key == "smallcover":  # rows per expert from which small experts take the cover rule (0: never)
            M.WGMMA_COVER_SMALL_MIN_ROWS = float(val) if float(val) > 0 else float("inf")
        elif key == "small32hi":  # 4-bit small experts: blocks of 32 below this many rows per expert
            M.WGMMA_32_SMALL_U4_HI = float(val)
        elif key == "smallblocks":  # blocks that small experts run on the producer form (e.g. 24+32)
            M.WGMMA_PROD_SMALL_BLOCKS = tuple(int(v) for v in val.split("+"))
        elif key == "smallmin":  # rows per expert from which small experts' blocks of 24 / 32 take the producer form
            M.WGMMA_PROD_SMALL32_MIN_ROWS = float(val)
        elif key == "small16":  # 4-bit small experts' blocks of 16 (producer form) at LO-HI rows per expert (0: never)
            M.WGMMA_16_ROWS_SMALL_U4 = (0.0, 0.0) if val == "0" else tuple(float(v) for v in val.split("-"))
        elif key == "small24":  # 4-bit small experts' blocks of 24 at LO-HI rows per expert (0: never)
            M.WGMMA_24_ROWS_SMALL_U4 = (0.0, 0.0) if val == "0" else tuple(float(v) for v in val.split("-"))
        elif key == "prodblocks":  # blocks that take the producer form where A is gathered (e.g. 24+32+48+80+96)
            M.MOE_WGMMA_PROD_BLOCKS = tuple(int(v) for v in val.split("+"))
        else:
            raise SystemExit(f"--ab item {item!r}: expected flags=..., ctas=NT-FW-S:C, fw=0|1|2, silu=0|1, minkn=N, "
                             "smallcover=R, small32hi=R, smallblocks=B+B, small24=LO-HI|0, smallmin=R, prodblocks=B+B, pfw=1|2, "
                             "early=0|1, early13=0|1 or small16=LO-HI|0")
    K.clear_kernel_caches()
    return variant


def _time_cases(args, cases, blocks, fused, tag, vtag) -> None:
    for sk in [int(v) for v in args.stream_k.split(",") if v] or [None]:
        if sk is not None:
            M.MOE_STREAM_K = bool(sk)
        for splits in [int(v) for v in args.down_splits.split(",") if v] or [None]:
            if splits is not None:
                M.MOE_DOWN_SPLITS = splits
            more = (f" stream_k={sk}" if sk is not None else "") + (f" down_splits={splits}" if args.down_splits else "")
            for name, t, ours, _ in cases:
                for block in blocks:
                    bench_moe.fused_marlin_moe = fused if block is None else functools.partial(fused, block_size=block)
                    for sg in [int(v) for v in args.silu_gather.split(",") if v] or [None]:
                        if sg is not None:
                            M.MOE_SILU_GATHER = bool(sg)
                        us = common.time_graph(lambda _i: ours(), 1, calls=10)
                        print(f"[{tag}{more} block={block or 'auto'}" + (f" silu_gather={sg}" if sg is not None else "")
                              + f"]{vtag} {name} T={t}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
