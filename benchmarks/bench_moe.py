"""MoE benchmark: the whole expert computation of one MoE layer (router excluded: routing is
given), jitmarlin W4 g128 vs an fp16 per-expert loop of torch.matmul (what a plain model does)
and torch._grouped_mm in bf16 (when the installed torch has it), in one run.

    python benchmarks/bench_moe.py [--json out.json] [--tokens 1,16,64,256,1024]

jitmarlin and grouped_mm are timed as CUDA graphs (both are capturable); the per-expert loop
needs host synchronisation (it asks which tokens went where), so it is timed eagerly, with
events. Floor = bytes of the experts that receive tokens (4-bit + scales) / copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from jitmarlin.nn.moe import MarlinMoE  # noqa: E402
from jitmarlin.ops.moe import fused_marlin_moe  # noqa: E402
from jitmarlin.quant import pack_weights, permute_scales  # noqa: E402
from jitmarlin.quant.packed import Packed  # noqa: E402

SHAPES = {"mixtral": (8, 4096, 14336, 2), "e64": (64, 2048, 1408, 6)}


def _packed(k, n, gen):
    q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32, generator=gen)
    s = (torch.rand(k // 128, n, device="cuda", generator=gen) * 0.02 + 0.005).half()
    return Packed(pack_weights(q, 4), permute_scales(s), None, 4, 128)


def eager_us(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    return statistics.median(ts)


def moe_cases(names, tokens):
    """(shape name, tokens, fn, topk_ids) for every shape and token count (the probes' cases): one
    random layer per shape, seeded, fresh activations per token count; fn() runs its experts with
    their routing (router excluded)."""
    for name in names:
        e, h, i, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        moe = MarlinMoE([_packed(h, 2 * i, gen) for _ in range(e)], [_packed(i, h, gen) for _ in range(e)],
                        torch.randn(e, h, device="cuda", generator=gen) * 0.05, k)
        for t in tokens:
            x = torch.randn(t, h, device="cuda", dtype=torch.float16, generator=gen)
            weights, ids = moe.route(x)
            yield name, t, (lambda x=x, w=weights, ids=ids: fused_marlin_moe(
                x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, w, ids)), ids


def _act_order_times(moe, x, weights, ids, e, h, i) -> dict:
    """µs of the expert computation with act-order column orders (random per expert), the two
    gathers by jm_moe_gather and by the torch reference (same run); and whether they agree."""
    import jitmarlin.ops.moe as M

    gen = torch.Generator(device="cuda").manual_seed(1)
    p13 = torch.stack([torch.randperm(h, device="cuda", generator=gen) for _ in range(e)]).to(torch.int32)
    p2 = torch.stack([torch.randperm(i, device="cuda", generator=gen) for _ in range(e)]).to(torch.int32)

    def run():
        return fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, weights, ids,
                                w13_perm=p13, w2_perm=p2)

    out = {}
    kernel_out = run()
    out["kernel gather"] = round(common.time_graph(lambda _i: run(), 1, calls=10), 1)
    saved = M.gather_by_position
    M.gather_by_position = lambda x_, s_, e_, n_, p_, k_, b_: M._gather_by_position_torch(x_, s_, e_, p_, k_, b_)
    try:
        torch_out = run()
        out["torch gather"] = round(common.time_graph(lambda _i: run(), 1, calls=10), 1)
    finally:
        M.gather_by_position = saved
    out["equal"] = bool(torch.equal(kernel_out, torch_out))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,256,1024")
    ap.add_argument("--json", default=None)
    ap.add_argument("--blocks", default="", help="also time ours with these expert block sizes, e.g. 16,32,64 "
                    "(to check choose_block_size)")
    ap.add_argument("--act-order", action="store_true", help="also time ours with act-order column orders "
                    "(random per expert), gathered by our kernel and by the torch reference")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    env = common.environment()
    bw = common.copy_bandwidth()
    print(f"# {env['gpu']}, torch {env['torch']}, {env['date']}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, flat = [], []
    for name, (e, h, i, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13p = [_packed(h, 2 * i, gen) for _ in range(e)]
        w2p = [_packed(i, h, gen) for _ in range(e)]
        moe = MarlinMoE(w13p, w2p, torch.randn(e, h, device="cuda") * 0.05, k)
        w13f, w2f = moe.dequantize()  # [E, 2I, H], [E, H, I] fp16
        w13t = w13f.transpose(1, 2).contiguous()  # [E, H, 2I] for a @ w
        w2t = w2f.transpose(1, 2).contiguous()
        # grouped_mm wants the weights column-major: [E, K, N] views of [E, N, K] storage
        w13b, w2b = w13f.bfloat16().transpose(1, 2), w2f.bfloat16().transpose(1, 2)
        expert_bytes = (h * 2 * i + i * h) // 2 + (h // 128 * 2 * i + i // 128 * h) * 2
        for t in tokens:
            x = torch.randn(t, h, device="cuda", dtype=torch.float16)
            weights, ids = moe.route(x)
            active = int(torch.unique(ids).numel())
            floor = (active * expert_bytes + 2 * t * h * 2) / bw * 1e6

            def ours():
                return fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales,
                                        weights, ids)

            def loop():
                out = torch.zeros(t, h, device="cuda", dtype=torch.float16)
                for ex in range(e):
                    tok, slot = torch.where(ids == ex)
                    if tok.numel() == 0:
                        continue
                    h1 = x[tok] @ w13t[ex]
                    h2 = F.silu(h1[:, :i]) * h1[:, i:]
                    out.index_add_(0, tok, (h2 @ w2t[ex]) * weights[tok, slot, None].half())
                return out

            ref = loop().float()
            got = ours().float()
            err = ((got - ref).norm() / ref.norm()).item()
            us_ours = common.time_graph(lambda _i: ours(), 1, calls=10)
            us_ours_eager = eager_us(ours)
            by_block = {}
            for b in (int(v) for v in args.blocks.split(",") if v):
                try:
                    fn = (lambda b=b: fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight,
                                                       moe.w2_scales, weights, ids, block_size=b))
                    berr = ((fn().float() - ref).norm() / ref.norm()).item()
                    by_block[b] = round(common.time_graph(lambda _i: fn(), 1, calls=10), 1)
                    if berr > 1e-2:
                        by_block[b] = f"rel err {berr:.1e}"
                except Exception as ex:  # noqa: BLE001 - e.g. 128 off sm_90
                    by_block[b] = repr(ex)[:80]
            if by_block:
                print(f"{name} T={t}: ours by block size {by_block} (default {us_ours:.1f})", flush=True)
            if args.act_order:
                act = _act_order_times(moe, x, weights, ids, e, h, i)
                print(f"{name} T={t}: act-order {act} (plain {us_ours:.1f})", flush=True)
            us_loop = eager_us(loop, reps=10)
            us_grouped = None
            grouped_mode = "graph"
            if hasattr(torch, "_grouped_mm"):
                xb = x.bfloat16()

                def grouped():
                    flat_ids = ids.flatten()
                    order = torch.argsort(flat_ids, stable=True)
                    offs = torch.cumsum(torch.bincount(flat_ids, minlength=e), 0).to(torch.int32)
                    xs = xb[order // k]
                    h1 = torch._grouped_mm(xs, w13b, offs=offs)
                    h2 = F.silu(h1[:, :i]) * h1[:, i:]
                    y = torch._grouped_mm(h2, w2b, offs=offs) * weights.flatten()[order, None].bfloat16()
                    return torch.zeros(t, h, device="cuda", dtype=torch.bfloat16).index_add_(0, order // k, y)

                try:
                    gerr = ((grouped().float() - ref).norm() / ref.norm()).item()
                    if gerr > 2e-2:
                        print(f"grouped_mm rel err {gerr:.2e} (check the adapter)")
                    try:
                        us_grouped = common.time_graph(lambda _i: grouped(), 1, calls=10)
                    except Exception:  # noqa: BLE001 - not capturable here: time it eagerly
                        torch.cuda.synchronize()
                        us_grouped = eager_us(grouped)
                        grouped_mode = "eager"
                except Exception as ex:  # noqa: BLE001
                    print(f"grouped_mm unavailable: {ex!r}")
            if us_grouped is not None and grouped_mode == "eager":
                print(f"{name} T={t}: grouped_mm timed eagerly (it does not capture in a CUDA graph)")
            rows.append([name, t, us_ours, us_ours_eager, us_loop, us_grouped, us_loop / us_ours,
                         (us_grouped / us_ours) if us_grouped else None, floor, us_ours / floor, err])
            flat.append(dict(zip(["shape", "tokens", "jitmarlin_graph_us", "jitmarlin_eager_us", "fp16_loop_us",
                                  "bf16_grouped_mm_us", "x_loop", "x_grouped", "floor_us", "x_floor", "rel_err"],
                                 rows[-1])))
            print(f"{name} T={t}: ours {us_ours:.1f} us (eager {us_ours_eager:.1f}), loop {us_loop:.1f}, grouped "
                  f"{us_grouped}, floor {floor:.1f}, err {err:.2e}", flush=True)
        del moe, w13f, w2f, w13t, w2t, w13b, w2b
        torch.cuda.empty_cache()
    table = common.markdown_table(["shape", "tokens", "jitmarlin µs (graph)", "jitmarlin µs (eager)",
                                   "fp16 loop µs", "bf16 grouped_mm µs", "× loop", "× grouped", "W4 floor µs",
                                   "÷ floor", "rel err vs fp16 loop"], rows)
    print(table)
    common.write_json(args.json, {"env": env, "copy_bw": bw, "rows": flat, "table": table})


if __name__ == "__main__":
    main()
