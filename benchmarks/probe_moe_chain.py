"""Where one MoE layer's time goes along its chain of kernels: the expert computation cut after
each of its kernels (alignment, first expert GEMM, SiLU-mul, second expert GEMM, top-k sum), each
prefix timed as a CUDA graph of back-to-back calls (programmatic launch as in a model), so the
differences are each kernel's marginal cost in the chain; then each expert GEMM alone on fixed
routing tables, next to the dense GEMM of the same weight bytes on its route (the active experts'
columns side by side: N x experts); with --tiles, each GEMM alone on candidate tiles.

    python benchmarks/probe_moe_chain.py [--shapes mixtral,e64] [--tokens 1,16] [--tiles TAG,...]
        [--env-ab JITMARLIN_MOE_ONE_TOKEN] [--gathered [--silu-epi]]

--gathered: the chain of fused_marlin_moe's producer-form route instead (blocks of its wgmma rule; both
GEMMs' inputs gathered in slot-list order: align, gather, gate/up GEMM, SiLU-mul, gather, down GEMM,
top-k sum), only the prefix times.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402
import common  # noqa: E402

from jitmarlin.nn.moe import MarlinMoE  # noqa: E402
from jitmarlin.ops import _kernels as K  # noqa: E402
from jitmarlin.ops import gemm as G  # noqa: E402
from jitmarlin.ops import moe as M  # noqa: E402
from jitmarlin.quant import pack_weights, permute_scales  # noqa: E402


def _dense_us(k: int, n: int, m: int) -> float:
    q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32)
    s = (torch.rand(k // 128, n, device="cuda") * 0.02 + 0.005).half()
    b, sc = pack_weights(q, 4), permute_scales(s)
    fam = K.Family("f16", 4, False, 128)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    return common.time_graph(lambda _i: G.launch_gemm(a, b, sc, None, None, out, m, n, k, fam), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mixtral,e64", help="names of bench_moe.SHAPES or E-H-I-TOPK specs")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--dense", type=int, default=1, help="also time the dense GEMMs of the same weight bytes")
    ap.add_argument("--env-ab", default="", metavar="NAME",
                    help="also time the whole layer (fused_marlin_moe) with the on/off switch NAME (e.g. "
                         "JITMARLIN_MOE_ONE_TOKEN) set to 0 and 1 alternately, --ab-rounds times, same routing")
    ap.add_argument("--ab-rounds", type=int, default=3)
    ap.add_argument("--route", action="store_true",
                    help="also time the routing alone (router logits -> top-k weights and ids): our kernel "
                         "(moe.route_topk) against torch's softmax, top-k and renormalization")
    ap.add_argument("--tiles", default="", help="comma-separated mma.sync tile tags (e.g. w8_k128_s6_bk_dr1): each "
                    "expert GEMM alone and the whole layer with that tile first for expert blocks of its row count, "
                    "built into the MoE family for this run (also where tile_fits keeps it out)")
    ap.add_argument("--silu-epi", action="store_true",
                    help="with --gathered: also the chain with SiLU-mul in the gate/up GEMM's epilogue "
                         "(moe_gemm_silu), and the gate/up GEMM with / without it and SiLU-gather, each alone")
    ap.add_argument("--gathered", action="store_true",
                    help="the producer-form route's chain (inputs gathered in slot-list order), prefix times only")
    ap.add_argument("--stream-k", type=int, default=None, choices=(0, 1),
                    help="the producer form's stream-K launch off / on (moe.MOE_STREAM_K)")
    args = ap.parse_args()
    if "-DJM_SILU_" in os.environ.get("JITMARLIN_NVCC_FLAGS", ""):  # diagnostic epilogues (wrong results): the
        M.MOE_SILU_EPILOGUE = False  # layer without it, moe_gemm_silu timed alone only
    if args.stream_k is not None:
        M.MOE_STREAM_K = bool(args.stream_k)
    cands = [K.Tile.from_tag(tg) for tg in args.tiles.split(",") if tg]
    forced: list = [None]  # the tile taken first while a candidate is timed
    if cands:  # before the first build: the MoE family's module (and cache key) then holds them
        K.BULK_TILES = K.BULK_TILES + tuple(tl for tl in cands if tl.bulk and tl not in K.BULK_TILES)
        fits, prefs = K.tile_fits, G._preferences
        K.tile_fits = lambda fam, tl: fits(fam, tl) or (fam.moe and tl in cands)

        def prefs_forced(m, n, k, cc=(8, 0), large=False, experts=0, **kw):
            base = prefs(m, n, k, cc, large=large, experts=experts, **kw)
            tl = forced[0]
            return (((tl, 4),) if tl is not None and experts and base[0][0].rows == tl.rows else ()) + base
        G._preferences = prefs_forced
    for name in args.shapes.split(","):
        # a name of bench_moe.SHAPES, or E-H-I-TOPK (e.g. 8-6144-16384-2, Mixtral-8x22B's experts)
        e, h, i, top_k = bench_moe.SHAPES[name] if name in bench_moe.SHAPES else map(int, name.split("-"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        moe = MarlinMoE([bench_moe._packed(h, 2 * i, gen) for _ in range(e)],
                        [bench_moe._packed(i, h, gen) for _ in range(e)],
                        torch.randn(e, h, device="cuda", generator=gen) * 0.05, top_k)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, h, device="cuda", dtype=torch.float16, generator=gen)
            weights, ids = moe.route(x)
            if args.route:
                logits = moe.router(x)

                def torch_route():
                    probs = torch.softmax(logits.float(), dim=-1)
                    w, i_ = torch.topk(probs, top_k, dim=-1)
                    return w / w.sum(dim=-1, keepdim=True), i_

                ours = common.time_graph(lambda _i: M.route_topk(logits, top_k, True), 1, calls=10)
                ref = common.time_graph(lambda _i: torch_route(), 1, calls=10)
                print(f"{name} T={t}: routing alone, graph of 10: ours {ours:.1f} us, torch ops {ref:.1f} us",
                      flush=True)
            active = int(torch.unique(ids).numel())
            bs = M.choose_block_size(t, top_k, e)
            tw = weights.reshape(-1).to(torch.float32)
            if args.gathered:
                gbs = M.choose_block_size(t, top_k, e, True, 2 * i * h)

                def gchain(upto: int, epi: bool = False):  # the first upto + 1 kernels of the route (epi: with
                    # SiLU-mul in the gate/up GEMM's epilogue, whose steps 2, 3, 4 are its GEMMs and top-k sum)
                    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, gbs, e)
                    if upto == 0:
                        return sorted_ids
                    a1 = M.gather_by_position(x, sorted_ids, expert_ids, num_padded, None, top_k, gbs)
                    if upto == 1:
                        return a1
                    if epi:
                        a2 = torch.ops.jitmarlin.moe_gemm_silu(a1, moe.w13_qweight, moe.w13_scales, sorted_ids,
                                                               expert_ids, num_padded, t * top_k, top_k, gbs)
                        if upto == 2:
                            return a2
                        upto += 2  # (SiLU-mul and the second gather: in the epilogue)
                    else:
                        c1 = M.moe_gemm(a1, moe.w13_qweight, moe.w13_scales, None, sorted_ids, expert_ids,
                                        num_padded, None, t * top_k, top_k, gbs, True)
                        if upto == 2:
                            return c1
                        c2 = M.silu_mul(c1, i)
                        if upto == 3:
                            return c2
                        a2 = M.gather_by_position(c2, sorted_ids, expert_ids, num_padded, None, 1, gbs)
                        if upto == 4:
                            return a2
                    c3 = torch.ops.jitmarlin.moe_gemm_ready_tables(a2, moe.w2_qweight, moe.w2_scales, None, sorted_ids,
                                                                   expert_ids, num_padded, tw, t * top_k, 1, gbs, True)
                    if upto == 5:
                        return c3
                    return M.topk_sum(c3, t, top_k, x.dtype)

                full = bench_moe.fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales,
                                                  weights, ids).float()
                ref = gchain(6).float()
                assert ((full - ref).norm() / ref.norm()).item() < 1e-3, "the probe's chain differs from the layer"
                names = ["align", "+gather", "+gemm1", "+silu", "+gather", "+gemm2", "+topk_sum"]
                times = [common.time_graph(lambda _i, u=u: gchain(u), 1, calls=10) for u in range(7)]
                steps = " ".join(f"{nm} {tm:.1f}" for nm, tm in zip(names, times))
                print(f"{name} T={t} block {gbs} gathered ({active} experts): prefix graph us: {steps}", flush=True)
                if args.silu_epi and M.silu_epilogue_ok(gchain(1), moe.w13_qweight, moe.w13_scales, None,
                                                        t * top_k, gbs):
                    if "-DJM_SILU_" not in os.environ.get("JITMARLIN_NVCC_FLAGS", ""):  # (diagnostic builds: wrong
                        # results, the kernels alone only)
                        got = gchain(4, True).float()
                        assert ((got - ref).norm() / ref.norm()).item() < 1e-3, "the epilogue chain differs"
                        enames = ["align", "+gather", "+gemm1_silu", "+gemm2", "+topk_sum"]
                        etimes = [common.time_graph(lambda _i, u=u: gchain(u, True), 1, calls=10) for u in range(5)]
                        steps = " ".join(f"{nm} {tm:.1f}" for nm, tm in zip(enames, etimes))
                        print(f"{name} T={t} block {gbs} SiLU epilogue: prefix graph us: {steps}", flush=True)
                    # each kernel alone (tables and inputs made once), graphs of 10 back-to-back calls
                    sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, gbs, e)
                    a1 = M.gather_by_position(x, sorted_ids, expert_ids, num_padded, None, top_k, gbs)
                    c1 = M.moe_gemm(a1, moe.w13_qweight, moe.w13_scales, None, sorted_ids, expert_ids, num_padded,
                                    None, t * top_k, top_k, gbs, True)
                    alone = {
                        "gemm1": lambda _i: M.moe_gemm(a1, moe.w13_qweight, moe.w13_scales, None, sorted_ids,
                                                       expert_ids, num_padded, None, t * top_k, top_k, gbs, True),
                        "gemm1_silu": lambda _i: torch.ops.jitmarlin.moe_gemm_silu(
                            a1, moe.w13_qweight, moe.w13_scales, sorted_ids, expert_ids, num_padded, t * top_k, top_k,
                            gbs),
                        "silu_gather": lambda _i: M.silu_gather_by_position(c1, i, sorted_ids, expert_ids,
                                                                            num_padded, None, gbs),
                    }
                    steps = " ".join(f"{nm} {common.time_graph(fn, 1, calls=10):.1f}" for nm, fn in alone.items())
                    print(f"{name} T={t} block {gbs} alone graph us: {steps}", flush=True)
                continue

            def chain(upto: int):
                sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, bs, e)
                if upto == 0:
                    return sorted_ids
                c1 = M.moe_gemm(x, moe.w13_qweight, moe.w13_scales, None, sorted_ids, expert_ids, num_padded, None,
                                t * top_k, top_k, bs)
                if upto == 1:
                    return c1
                c2 = M.silu_mul(c1, i)
                if upto == 2:
                    return c2
                c3 = torch.ops.jitmarlin.moe_gemm_ready_tables(c2, moe.w2_qweight, moe.w2_scales, None, sorted_ids,
                                                               expert_ids, num_padded, tw, t * top_k, 1, bs)
                if upto == 3:
                    return c3
                return M.topk_sum(c3, t, top_k)

            full = bench_moe.fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales,
                                              weights, ids)
            ref = chain(4).float()  # the chain of the alignment path (one token: other block order, split points)
            assert ((full.float() - ref).norm() / ref.norm()).item() < 1e-3, "the probe's chain differs from the layer"
            if args.env_ab:
                ab: dict[str, list[float]] = {"0": [], "1": []}
                for _ in range(args.ab_rounds):
                    for v in ("0", "1"):
                        os.environ[args.env_ab] = v
                        K.env_flag.cache_clear()
                        ab[v].append(common.time_graph(
                            lambda _i: bench_moe.fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight,
                                                                  moe.w2_scales, weights, ids), 1, calls=10))
                os.environ.pop(args.env_ab)
                K.env_flag.cache_clear()
                print(f"{name} T={t} block {bs}: layer us, {args.env_ab}=0 " + " / ".join(f"{v:.1f}" for v in ab["0"])
                      + ", =1 " + " / ".join(f"{v:.1f}" for v in ab["1"]), flush=True)
            names = ["align", "+gemm1", "+silu", "+gemm2", "+topk_sum"]
            times = [common.time_graph(lambda _i, u=u: chain(u), 1, calls=10) for u in range(5)]
            steps = " ".join(f"{nm} {tm:.1f}" for nm, tm in zip(names, times))
            print(f"{name} T={t} block {bs} ({active} experts): prefix graph us: {steps}", flush=True)
            sorted_ids, expert_ids, num_padded = M.moe_align_block_size(ids, bs, e)
            c1 = chain(1)
            c2 = M.silu_mul(c1, i)
            g1 = common.time_graph(lambda _i: M.moe_gemm(x, moe.w13_qweight, moe.w13_scales, None, sorted_ids,
                                                         expert_ids, num_padded, None, t * top_k, top_k, bs), 1)
            g2 = common.time_graph(lambda _i: M.moe_gemm(c2, moe.w2_qweight, moe.w2_scales, None, sorted_ids,
                                                         expert_ids, num_padded, tw, t * top_k, 1, bs), 1)
            print(f"{name} T={t}: gemm1 alone {g1:.1f} us, gemm2 alone {g2:.1f} us (20 back-to-back calls)",
                  flush=True)
            ref1 = M.moe_gemm(x, moe.w13_qweight, moe.w13_scales, None, sorted_ids, expert_ids, num_padded, None,
                              t * top_k, top_k, bs).float()
            for tl in cands:
                forced[0] = tl
                G.prepare_launch.cache_clear()  # launches are cached per problem
                try:
                    o1 = M.moe_gemm(x, moe.w13_qweight, moe.w13_scales, None, sorted_ids, expert_ids, num_padded, None,
                                    t * top_k, top_k, bs).float()
                    err = ((o1 - ref1).norm() / ref1.norm()).item()
                    a1 = common.time_graph(lambda _i: M.moe_gemm(x, moe.w13_qweight, moe.w13_scales, None, sorted_ids,
                                                                 expert_ids, num_padded, None, t * top_k, top_k, bs), 1)
                    a2 = common.time_graph(lambda _i: M.moe_gemm(c2, moe.w2_qweight, moe.w2_scales, None, sorted_ids,
                                                                 expert_ids, num_padded, tw, t * top_k, 1, bs), 1)
                    lay = common.time_graph(lambda _i: chain(4), 1, calls=10)
                    print(f"{name} T={t} tile {tl.tag()}: gemm1 alone {a1:.1f} us, gemm2 alone {a2:.1f} us, "
                          f"layer {lay:.1f} us (gemm1 vs route rel. diff {err:.1e})", flush=True)
                except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                    print(f"{name} T={t} tile {tl.tag()}: failed: {exc}", flush=True)
                finally:
                    forced[0] = None
                    G.prepare_launch.cache_clear()
            if args.dense and t * top_k <= 8 * active:
                for kk, nn, tag in ((h, 2 * i * active, "gemm1"), (i, h * active, "gemm2")):
                    r = _dense_us(kk, nn, 1)
                    print(f"{name} T={t}: dense {kk}x{nn} M=1 (as {tag}) route {r:.1f} us", flush=True)


if __name__ == "__main__":
    main()
