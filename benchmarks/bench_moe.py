"""MoE benchmark: the whole expert computation of one MoE layer (router excluded: routing is
given), jitmarlin W4 g128 vs an fp16 per-expert loop of torch.matmul (what a plain model does),
torch._grouped_mm in bf16 (when the installed torch has it) and Humming's two expert GEMMs, in one run.

    python benchmarks/bench_moe.py [--json out.json] [--tokens 1,16,64,256,1024] [--shapes mixtral,e64]
                                   [--peers humming|none] [--no-humming]

jitmarlin and grouped_mm are timed as CUDA graphs (both are capturable); the per-expert loop
needs host synchronisation (it asks which tokens went where), so it is timed eagerly, with
events. Floor = bytes of the experts that receive tokens (4-bit + scales) / copy bandwidth.

Humming (humming-kernels, optional: benchmarks/peers.py make_humming_moe; when it is not importable or
fails the column is left out and the reason printed): only its two expert GEMMs, w13 [E, 2I, H] and
w2 [E, H, I], in its "indexed" MoE mode, W4 (uint4, zero point 8) group 128 fp16, built from the same
integer weights and scales as ours, with the same routing; its tables (vLLM moe_align contract, padded to
the block_shape[0] of the config Humming's heuristics pick for M = tokens*top_k) and the activation
between the two GEMMs are computed once outside the timed region, so its time leaves out the alignment,
SiLU-mul, routing weights and top-k sum that ours includes. Timed as a CUDA graph like ours, after every
one of our timings (a fault in it cannot spoil them), and only where its output rows match the
dequantized experts (peers.check_humming_moe). × columns: how many times faster we are than that
peer (its time / ours; below 1 the peer is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import peers  # noqa: E402

from jitmarlin.nn.moe import MarlinMoE  # noqa: E402
from jitmarlin.ops.moe import fused_marlin_moe  # noqa: E402
from jitmarlin.quant import pack_weights, permute_scales  # noqa: E402
from jitmarlin.quant.packed import Packed  # noqa: E402

SHAPES = {"mixtral": (8, 4096, 14336, 2), "e64": (64, 2048, 1408, 6)}


GROUP = 128
HUMMING = "humming"


def _quantized(k, n, gen):
    """Random W4 g128 weight in the common form: q [K, N] in [0, 16), scales fp16 [K/G, N]."""
    q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32, generator=gen)
    s = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.02 + 0.005).half()
    return q, s


def _packed(k, n, gen, humming=None):
    """Our packed expert; with a list `humming`, also appends the same integers and scales in Humming's
    checkpoint form (peers.humming_expert_tensors: int32 [N, K/8], fp16 [N, K/G])."""
    q, s = _quantized(k, n, gen)
    if humming is not None:
        humming.append(peers.humming_expert_tensors(q, s))
    return Packed(pack_weights(q, 4), permute_scales(s), None, 4, GROUP)


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


def moe_cases(names, tokens, dtype=torch.float16):
    """(shape name, tokens, fn, topk_ids) for every shape and token count (the probes' cases): one
    random layer per shape, seeded, fresh activations per token count; fn() runs its experts with
    their routing (router excluded). `dtype`: of the activations and scales (fp16 or bf16)."""
    def packed(k, n, gen):  # our fp16 expert, its scales in `dtype`
        p = _packed(k, n, gen)
        return dataclasses.replace(p, scales=p.scales.to(dtype))

    for name in names:
        e, h, i, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        moe = MarlinMoE([packed(h, 2 * i, gen) for _ in range(e)], [packed(i, h, gen) for _ in range(e)],
                        torch.randn(e, h, device="cuda", generator=gen) * 0.05, k)
        for t in tokens:
            x = torch.randn(t, h, device="cuda", dtype=dtype, generator=gen)
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,64,256,1024")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--json", default=None)
    ap.add_argument("--blocks", default="", help="also time ours with these expert block sizes, e.g. 16,32,64 "
                    "(to check choose_block_size)")
    ap.add_argument("--act-order", action="store_true", help="also time ours with act-order column orders "
                    "(random per expert), gathered by our kernel and by the torch reference")
    ap.add_argument("--peers", default=HUMMING, help="peers to time: humming (default: Humming's two expert GEMMs, "
                    "skipped with the reason printed when humming-kernels is missing or fails) or none")
    ap.add_argument("--no-humming", action="store_true", help="leave Humming out (same as --peers none)")
    args = ap.parse_args(argv)
    names = [] if args.peers.strip() in ("", "none") else [v.strip() for v in args.peers.split(",") if v.strip()]
    unknown = [v for v in names if v != HUMMING]
    if unknown:
        ap.error(f"--peers: unknown peer(s) {unknown}; known: {HUMMING}, none")
    args.humming = HUMMING in names and not args.no_humming
    try:
        args.token_list = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens must be a comma list of integers, got {args.tokens!r}")
    if not args.token_list or min(args.token_list) < 1:
        ap.error(f"--tokens must be positive, got {args.tokens!r}")
    args.shape_list = [v.strip() for v in args.shapes.split(",") if v.strip()]
    bad = [v for v in args.shape_list if v not in SHAPES]
    if bad or not args.shape_list:
        ap.error(f"--shapes: unknown shape(s) {bad}; known: {', '.join(SHAPES)}")
    return args


BASE_COLUMNS = [  # (table header, JSON key)
    ("shape", "shape"), ("tokens", "tokens"), ("jitmarlin µs (graph)", "jitmarlin_graph_us"),
    ("jitmarlin µs (eager)", "jitmarlin_eager_us"), ("fp16 loop µs", "fp16_loop_us"),
    ("bf16 grouped_mm µs", "bf16_grouped_mm_us"), ("× loop", "x_loop"), ("× grouped", "x_grouped"),
    ("W4 floor µs", "floor_us"), ("÷ floor", "x_floor"), ("rel err vs fp16 loop", "rel_err"),
]
HUMMING_COLUMNS = [("Humming 2 GEMMs µs", "humming_2gemm_us"), ("× Humming", "x_humming")]


def _ratio(num, den):
    return num / den if num and den else None


def report(cases: list[dict], humming_skip: str | None = None):
    """The table and the JSON rows of the measured cases, and the Humming summary.

    cases: one dict per (shape, tokens) with shape, tokens, jitmarlin_graph_us, jitmarlin_eager_us, fp16_loop_us,
    bf16_grouped_mm_us (None: not timed), floor_us, rel_err and, where Humming ran, humming_2gemm_us (None with
    humming_error where it failed). humming_skip: why Humming was not run at all (None: it was).
    The Humming columns (µs after bf16 grouped_mm, × Humming = its time / ours after × grouped: > 1 means we are
    faster) appear when at least one case has a Humming time; otherwise they are left out and summary["skip"]
    says why. Returns (table, rows, summary)."""
    if humming_skip is None and not any(c.get("humming_2gemm_us") for c in cases):
        errors = [c["humming_error"] for c in cases if c.get("humming_error")]
        humming_skip = f"no Humming time: {errors[0]}" if errors else "no Humming time"
    show = humming_skip is None
    columns = list(BASE_COLUMNS)
    if show:
        columns.insert(6, HUMMING_COLUMNS[0])
        columns.insert(9, HUMMING_COLUMNS[1])
    rows, flat = [], []
    for c in cases:
        ours = c["jitmarlin_graph_us"]
        d = {"shape": c["shape"], "tokens": c["tokens"], "jitmarlin_graph_us": ours,
             "jitmarlin_eager_us": c["jitmarlin_eager_us"], "fp16_loop_us": c["fp16_loop_us"],
             "bf16_grouped_mm_us": c.get("bf16_grouped_mm_us"), "x_loop": _ratio(c["fp16_loop_us"], ours),
             "x_grouped": _ratio(c.get("bf16_grouped_mm_us"), ours), "floor_us": c["floor_us"],
             "x_floor": _ratio(ours, c["floor_us"]), "rel_err": c["rel_err"]}
        if show:
            d["humming_2gemm_us"] = c.get("humming_2gemm_us")
            d["x_humming"] = _ratio(c.get("humming_2gemm_us"), ours)
            if c.get("humming_error"):
                d["humming_error"] = c["humming_error"]
        # the error is ~1e-4..1e-3: the table's float format (2 decimals) would print 0.00
        rows.append([f"{d[key]:.1e}" if key == "rel_err" and isinstance(d[key], float) else d[key]
                     for _, key in columns])
        flat.append(d)
    summary = {"columns": show, "skip": humming_skip}
    if show:
        slower = [f"{d['shape']} T={d['tokens']}" for d in flat if d["x_humming"] is not None and d["x_humming"] <= 1]
        missing = [f"{d['shape']} T={d['tokens']}" for d in flat if d["x_humming"] is None]
        summary.update(slower=slower, missing=missing,
                       faster_everywhere=not slower and not missing)
        verdict = "yes" if summary["faster_everywhere"] else "NO"
        detail = "".join([f"; not faster at {', '.join(slower)}" if slower else "",
                          f"; no Humming time at {', '.join(missing)}" if missing else ""])
        summary["text"] = f"ours faster than Humming's two expert GEMMs at every token count: {verdict}{detail}"
    else:
        summary["text"] = f"Humming 2 GEMMs column skipped: {humming_skip}"
    table = common.markdown_table([h for h, _ in columns], rows)
    return table, flat, summary


def _humming_case(hm, x, ids, w13_ref, w2_ref, inter) -> dict:
    """Humming's two expert GEMMs for one token count: plan (tuning configs, tables), one run to get the
    activation between them, the check against the dequantized experts, then the CUDA-graph time."""
    plan = hm.plan(ids)
    o13 = hm.up(plan, x)
    act = (F.silu(o13[:, :inter].float()) * o13[:, inter:].float()).half()  # precomputed, not timed
    o13, o2 = hm.run(plan, x, act)
    torch.cuda.synchronize()
    out = {"plan": plan.summary()}
    out["check"] = chk = peers.check_humming_moe(o13, o2, x, act, ids, w13_ref, w2_ref)
    if not chk["ok"]:
        out["error"] = f"check failed, not timed: {chk['error']}"
        return out
    out["us"] = common.time_graph(lambda _i: hm.run(plan, x, act), 1, calls=10)
    return out


def _run_humming(pending: list, case_index: dict) -> dict:
    """Humming for every shape, after all our timings. pending: (shape, hm or reason, w13_ref, w2_ref, inter, top_k,
    [(tokens, x, ids)]). Fills humming_2gemm_us / humming_error in the cases; returns the details for the JSON."""
    details, disabled = {}, None
    for name, hm, w13_ref, w2_ref, inter, top_k, inputs in pending:
        if isinstance(hm, str):  # the peer could not be built for this shape
            for t, _, _ in inputs:
                case_index[(name, t)]["humming_error"] = hm
            continue
        if disabled is None:
            try:
                hm.precompile([(t, top_k) for t, _, _ in inputs])
            except Exception as ex:  # noqa: BLE001 - only a speed-up: each call compiles its own kernel
                print(f"{name}: humming precompile failed ({peers._reason(ex)}); compiling per call", flush=True)
        for t, x, ids in inputs:
            case = case_index[(name, t)]
            if disabled is not None:
                case["humming_error"] = disabled
                continue
            try:
                res = _humming_case(hm, x, ids, w13_ref, w2_ref, inter)
            except Exception as ex:  # noqa: BLE001 - reported, the column shows – for this case
                print(traceback.format_exc(), flush=True)
                res = {"error": peers._reason(ex)}
            details[f"{name} T={t}"] = res
            if "us" in res:
                case["humming_2gemm_us"] = res["us"]
                plan = res["plan"]
                print(f"{name} T={t}: humming 2 GEMMs {res['us']:.1f} us (ours {case['jitmarlin_graph_us']:.1f}), "
                      f"block_m {plan['block_m13']}/{plan['block_m2']}, check rel err {res['check']['rel_err13']:.1e}"
                      f"/{res['check']['rel_err2']:.1e}", flush=True)
            else:
                case["humming_error"] = res["error"]
                print(f"{name} T={t}: humming FAILED: {res['error']}", flush=True)
                if "check" in res:  # a wrong adapter is wrong everywhere: stop here, loudly
                    disabled = f"not run: Humming disabled after its failed check at {name} T={t}"
    return details


def main(argv=None):
    args = parse_args(argv)
    tokens = args.token_list
    env = common.environment()
    bw = common.copy_bandwidth()
    print(f"# {env['gpu']}, torch {env['torch']}, {env['date']}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    humming_skip = None if args.humming else "not requested (--no-humming / --peers none)"
    if humming_skip is None and importlib.util.find_spec("humming") is None:
        humming_skip = "not installed: no module named 'humming' (pip install humming-kernels)"
    if humming_skip:
        print(f"humming: {humming_skip}", flush=True)
    cases, pending = [], []
    for name in args.shape_list:
        e, h, i, k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        hum13, hum2 = ([], []) if humming_skip is None else (None, None)
        w13p = [_packed(h, 2 * i, gen, hum13) for _ in range(e)]
        w2p = [_packed(i, h, gen, hum2) for _ in range(e)]
        moe = MarlinMoE(w13p, w2p, torch.randn(e, h, device="cuda") * 0.05, k)
        w13f, w2f = moe.dequantize()  # [E, 2I, H], [E, H, I] fp16
        w13t = w13f.transpose(1, 2).contiguous()  # [E, H, 2I] for a @ w
        w2t = w2f.transpose(1, 2).contiguous()
        # grouped_mm wants the weights column-major: [E, K, N] views of [E, N, K] storage
        w13b, w2b = w13f.bfloat16().transpose(1, 2), w2f.bfloat16().transpose(1, 2)
        expert_bytes = (h * 2 * i + i * h) // 2 + (h // 128 * 2 * i + i // 128 * h) * 2
        hm_inputs = []
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
            cases.append({"shape": name, "tokens": t, "jitmarlin_graph_us": us_ours,
                          "jitmarlin_eager_us": us_ours_eager, "fp16_loop_us": us_loop,
                          "bf16_grouped_mm_us": us_grouped, "floor_us": floor, "rel_err": err})
            hm_inputs.append((t, x, ids))
            print(f"{name} T={t}: ours {us_ours:.1f} us (eager {us_ours_eager:.1f}), loop {us_loop:.1f}, grouped "
                  f"{us_grouped}, floor {floor:.1f}, err {err:.2e}", flush=True)
        del w13t, w2t, w13b, w2b
        if humming_skip is None:
            # Humming's layers from the same integers and scales as ours; timed after all our shapes (_run_humming)
            hm = peers.make_humming_moe(torch.stack([w for w, _ in hum13]), torch.stack([s for _, s in hum13]),
                                        torch.stack([w for w, _ in hum2]), torch.stack([s for _, s in hum2]),
                                        GROUP, "cuda")
            del hum13, hum2
            if hm is None:
                why = peers.unavailable.get(peers.HUMMING_MOE, "unavailable")
                print(f"{name}: humming unavailable: {why}", flush=True)
                if peers.HUMMING_MOE in peers.tracebacks:
                    print(peers.tracebacks[peers.HUMMING_MOE], flush=True)
                pending.append((name, why, None, None, i, k, hm_inputs))
            else:
                pending.append((name, hm, w13f, w2f, i, k, hm_inputs))
        del moe, w13f, w2f
        torch.cuda.empty_cache()
    details = {}
    if pending:
        details = _run_humming(pending, {(c["shape"], c["tokens"]): c for c in cases})
        notes = {p[1].note for p in pending if not isinstance(p[1], str)}
        if notes:
            print(f"humming: {notes.pop()}", flush=True)
    table, flat, summary = report(cases, humming_skip)
    print(table)
    print(summary["text"], flush=True)
    summary["note"] = next((p[1].note for p in pending if not isinstance(p[1], str)), None)
    summary["version"] = next((p[1].version for p in pending if not isinstance(p[1], str)), None)
    summary["cases"] = details
    common.write_json(args.json, {"env": env, "copy_bw": bw, "rows": flat, "table": table, "humming": summary})


if __name__ == "__main__":
    main()
