"""W4A16 GEMM benchmark: jitmarlin vs fp16 cuBLAS, PyTorch's int4 kernel and other W4A16
kernels (when importable), measured in one run on one GPU.

    python benchmarks/bench_gemm.py [--json out.json] [--m 1,16,64,256,1024] [--peers all|none|a,b]
    python benchmarks/bench_gemm.py --sweep   # time every tile config (tuning data)

Weights are random 4-bit integers with fp16 group-128 scales; every kernel rotates over enough
weight copies to exceed 3x L2 (weights come from HBM); CUDA-graph timing, medians.
Floor = (K*N/2 + K/128*N*2 + 2*M*(K+N)) bytes / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import jitmarlin  # noqa: E402
from jitmarlin.ops import _kernels as K  # noqa: E402
from jitmarlin.ops import gemm as G  # noqa: E402
from jitmarlin.quant import dequantize, pack_weights, permute_scales  # noqa: E402
from jitmarlin.quant.packed import Packed  # noqa: E402

SHAPES = [(4096, 4096), (4096, 28672), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192)]
GROUP = 128


def make_weights(k, n, seed=0, bits=4):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), device="cuda", dtype=torch.int32, generator=gen)
    s = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.02 + 0.005).half()
    return q, s


def floor_us(k, n, m, bw, bits=4):
    return (k * n * bits / 8 + k / GROUP * n * 2 + 2 * m * (k + n)) / bw * 1e6


def bench_ours(k, n, ms, q, s, results, override=None, tag="jitmarlin", bits=4, dtype=torch.float16):
    s = s.to(dtype)
    packed = Packed(pack_weights(q, bits), permute_scales(s), None, bits, GROUP)
    nbytes = packed.b.numel() * 4 + packed.scales.numel() * 2
    copies = [packed] + [Packed(packed.b.clone(), packed.scales.clone(), None, bits, GROUP)
                         for _ in range(common.copies_for(nbytes) - 1)]
    w = dequantize(q, s, None, bits, GROUP)
    fam = K.Family("bf16" if dtype == torch.bfloat16 else "f16", bits, False, GROUP)
    for m in ms:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # rows a launch misses show as err nan
        try:
            if override is not None:
                G.launch_gemm(a, packed.b, packed.scales, None, None, out, m, n, k, fam, plan_override=override)
            else:
                out = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
            err = ((out.float() - a.float() @ w).norm() / (a.float() @ w).norm()).item()
            if override is not None:
                def step(i, a=a, out=out, m=m):
                    c = copies[i]
                    G.launch_gemm(a, c.b, c.scales, None, None, out, m, n, k, fam, plan_override=override)
            else:
                def step(i, a=a):
                    c = copies[i]
                    jitmarlin.marlin_gemm(a, c.b, c.scales)
            us = common.time_graph(step, len(copies))
        except Exception as e:  # noqa: BLE001 - record and go on
            results.setdefault("errors", []).append(f"{tag} K={k} N={n} M={m}: {e!r}")
            continue
        results[(tag, k, n, m)] = {"us": us, "err": err}
    del copies


VARIANTS = {  # name: (activation dtype, bits, act-order, group size)
    "bf16": (torch.bfloat16, 4, False, GROUP),
    "u8": (torch.float16, 8, False, GROUP),
    "act_order": (torch.float16, 4, True, GROUP),
    "gc": (torch.float16, 4, False, -1),  # one scale per output channel
    "u8gc": (torch.float16, 8, False, -1),
}


def bench_variant(name, k, n, ms, results):
    """Formats beyond fp16 x int4: bf16 activations, 8-bit weights, act-order (activation
    columns gathered by the layer before the GEMM), per-channel scales, all through MarlinLinear,
    group 128 unless per channel."""
    from jitmarlin.nn import MarlinLinear

    dtype, bits, act, group = VARIANTS[name]
    groups = 1 if group == -1 else k // group
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randint(0, 1 << bits, (k, n), device="cuda", dtype=torch.int32, generator=gen)
    s = (torch.rand(groups, n, device="cuda", generator=gen) * 0.002 + 0.0005).to(dtype)
    perm = torch.randperm(k, device="cuda", generator=gen) if act else None

    def layer():
        packed = Packed(pack_weights(q, bits), permute_scales(s), None, bits, group)
        return MarlinLinear.from_packed(packed, perm=perm)

    first = layer()
    nbytes = k * n * bits // 8 + groups * n * 2
    copies = [first] + [layer() for _ in range(common.copies_for(nbytes) - 1)]
    w = first.dequantize().float().t()
    for m in ms:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        try:
            err = ((first(a).float() - a.float() @ w).norm() / (a.float() @ w).norm()).item()
            us = common.time_graph(lambda i, a=a: copies[i](a), len(copies))
        except Exception as e:  # noqa: BLE001
            results.setdefault("errors", []).append(f"{name} K={k} N={n} M={m}: {e!r}")
            continue
        results[(name, k, n, m)] = {"us": us, "err": err}
    del copies


def bench_fp16(k, n, ms, q, s, results):
    w16 = dequantize(q, s, None, 4, GROUP, torch.float16)
    copies = [w16] + [w16.clone() for _ in range(common.copies_for(w16.numel() * 2) - 1)]
    for m in ms:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        results[("fp16", k, n, m)] = {"us": common.time_graph(lambda i, a=a: torch.matmul(a, copies[i]), len(copies))}
    del copies


def bench_peer(name, k, n, ms, q, s, results):
    import peers

    first = peers.make_peer(name, q, s, GROUP, "cuda")
    if first is None:
        results.setdefault("unavailable", {})[name] = peers.unavailable.get(name, "unavailable")
        return
    a16 = torch.randn(16, k, device="cuda", dtype=first.dtype)
    check = peers.check_peer(first, q, s, GROUP, a16, tol=2e-2)
    err = check["rel_err"]
    results.setdefault("peer_notes", {})[name] = first.note
    if not check["ok"]:
        results.setdefault("errors", []).append(f"{name} K={k} N={n}: {check['error']}, not timed")
        return
    nbytes = k * n // 2 + k // GROUP * n * 2
    copies = [first] + [peers.make_peer(name, q, s, GROUP, "cuda") for _ in range(common.copies_for(nbytes) - 1)]
    for c in copies:
        for m, why in c.warmup(ms).items():
            results.setdefault("errors", []).append(f"{name} K={k} N={n} M={m} warm-up: {why}")
    for m in ms:
        a = torch.randn(m, k, device="cuda", dtype=first.dtype)
        try:
            results[(name, k, n, m)] = {"us": common.time_graph(lambda i, a=a: copies[i](a), len(copies)), "err": err}
        except Exception as e:  # noqa: BLE001
            results.setdefault("errors", []).append(f"{name} K={k} N={n} M={m}: {e!r}")
    del copies


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,16,32,64,256,1024")
    ap.add_argument("--shapes", default="all", help="all, or K1xN1,K2xN2")
    ap.add_argument("--peers", default="torch_int4,humming", help="all, none, or a comma list of torch_int4,humming,gemlite")
    ap.add_argument("--variants", default="bf16,u8,act_order", help="extra formats to time (or none): "
                    + ",".join(VARIANTS))
    ap.add_argument("--variant-m", default="1,16,64", help="M values for the extra formats")
    ap.add_argument("--settle", type=float, default=common.SETTLE_S,
                    help="seconds the GPU idles before each timed block, so its clocks recover from the block "
                         "before (0: back to back); the GPU's clocks and power at each block go to the JSON")
    ap.add_argument("--sweep", action="store_true", help="time every tile config and CTA width instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ms = [int(x) for x in args.m.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    env = common.environment()
    bw = common.copy_bandwidth()
    print(f"# {env['gpu']} ({env['sms']} SMs), torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}, "
          f"{env['date']}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results: dict = {}
    if args.sweep:
        return sweep(shapes, ms, env, bw, args.json)
    peer_names = [] if args.peers == "none" else (["torch_int4", "humming", "gemlite"] if args.peers == "all"
                                                  else args.peers.split(","))
    common.SETTLE_S = args.settle
    states = results.setdefault("gpu_state", [])
    for k, n in shapes:
        q, s = make_weights(k, n)
        common.settle(f"{k}x{n} jitmarlin", states)
        bench_ours(k, n, ms, q, s, results)
        common.settle(f"{k}x{n} fp16", states)
        bench_fp16(k, n, ms, q, s, results)
        variants = [] if args.variants == "none" else args.variants.split(",")
        vms = [int(x) for x in args.variant_m.split(",")]
        for v in variants:
            common.settle(f"{k}x{n} {v}", states)
            bench_variant(v, k, n, vms, results)
        for name in peer_names:
            common.settle(f"{k}x{n} {name}", states)
            try:
                bench_peer(name, k, n, ms, q, s, results)
            except Exception:  # noqa: BLE001
                results.setdefault("errors", []).append(f"{name} K={k} N={n}: {traceback.format_exc(limit=3)}")
        print(f"done {k}x{n}", flush=True)
        torch.cuda.empty_cache()

    header = ["K×N", "M", "jitmarlin µs", "fp16 µs", "× fp16", "% floor"] + [f"{p} µs" for p in peer_names] + \
             [f"× {p}" for p in peer_names]
    rows, flat = [], []
    for (k, n), m in itertools.product(shapes, ms):
        ours = results.get(("jitmarlin", k, n, m), {}).get("us")
        f16 = results.get(("fp16", k, n, m), {}).get("us")
        fl = floor_us(k, n, m, bw)
        pu = [results.get((p, k, n, m), {}).get("us") for p in peer_names]
        row = [f"{k}×{n}", m, ours, f16, (f16 / ours) if ours and f16 else None, (100 * fl / ours) if ours else None]
        row += pu + [(x / ours) if (x and ours) else None for x in pu]
        rows.append(row)
        flat.append({"k": k, "n": n, "m": m, "jitmarlin_us": ours, "fp16_us": f16, "floor_us": fl,
                     "err": results.get(("jitmarlin", k, n, m), {}).get("err"),
                     **{f"{p}_us": x for p, x in zip(peer_names, pu)}})
    table = common.markdown_table(header, rows)
    print(table)
    vrows = []
    variants = [] if args.variants == "none" else args.variants.split(",")
    vms = [int(x) for x in args.variant_m.split(",")]
    for (k, n), m in itertools.product(shapes, vms):
        base = results.get(("jitmarlin", k, n, m), {}).get("us")
        f16 = results.get(("fp16", k, n, m), {}).get("us")
        vus = [results.get((v, k, n, m), {}).get("us") for v in variants]
        vrows.append([f"{k}×{n}", m, base] + vus + [(x / base) if (x and base) else None for x in vus] +
                     [(f16 / x) if (x and f16) else None for x in vus])
        flat.append({"k": k, "n": n, "m": m, "variants": {v: results.get((v, k, n, m)) for v in variants}})
    if variants:
        vtable = common.markdown_table(["K×N", "M", "f16·u4 µs"] + [f"{v} µs" for v in variants] +
                                       [f"{v} ÷ f16·u4" for v in variants] + [f"{v} × fp16" for v in variants], vrows)
        print(vtable)
        table += "\n\n" + vtable
    for e in results.get("errors", []):
        print("ERROR:", e)
    for p, why in results.get("unavailable", {}).items():
        print(f"peer {p} unavailable: {why}")
    for p, note in results.get("peer_notes", {}).items():
        print(f"peer {p}: {note}")
    common.write_json(args.json, {"env": env, "copy_bw": bw, "rows": flat, "errors": results.get("errors", []),
                                  "unavailable": results.get("unavailable", {}),
                                  "peer_notes": results.get("peer_notes", {}), "table": table,
                                  "settle_s": args.settle, "gpu_state": results.get("gpu_state", [])})
    for line in results.get("gpu_state", []):
        print("gpu state before", line)


def sweep(shapes, ms, env, bw, json_path):
    out = []
    fam = K.Family("f16", 4, False, GROUP)
    smem_limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin - G.SMEM_RESERVE
    for k, n in shapes:
        q, s = make_weights(k, n)
        results: dict = {}
        for m in ms:
            allowed = {G.m_class(m)} | ({"m1"} if m <= 8 else set())  # at M <= 8 also time the m16 tile
            cc = torch.cuda.get_device_capability(0)
            for tile, nw in itertools.product(K.tiles_for(cc), (2, 4, 8, 16)):
                if G.m_class(tile.rows) not in allowed or nw > tile.max_warps or tile.cluster:
                    continue
                if k % tile.tile_k or (n // 64) % nw or K.smem_bytes(fam, tile, nw) > smem_limit:
                    continue
                bench_ours(k, n, [m], q, s, results, override=(tile, nw), tag=f"{tile.tag()}-w{nw}")
            if m >= 64:
                bench_ours(k, n, [m], q, s, results, override="dequant", tag="dequant+cublas")
        best = {}
        for key, v in results.items():
            if not isinstance(key, tuple):
                continue
            tag, _, _, m = key
            out.append({"k": k, "n": n, "m": m, "config": tag, "us": v["us"], "err": v["err"],
                        "floor_us": floor_us(k, n, m, bw)})
            if m not in best or v["us"] < best[m][1]:
                best[m] = (tag, v["us"])
        for m in ms:
            if m in best:
                print(f"{k}x{n} M={m}: best {best[m][0]} {best[m][1]:.1f} us "
                      f"(floor {floor_us(k, n, m, bw):.1f})", flush=True)
        for e in results.get("errors", []):
            print("ERROR:", e)
        torch.cuda.empty_cache()
    common.write_json(json_path, {"env": env, "copy_bw": bw, "sweep": out})


if __name__ == "__main__":
    main()
