"""Read a probe_configs.py log with strip-kernel configs (stages s50a, s52a) and say, per (shape, M), the old route's
time (`routeS0` where the log has it, else `route`), the route's (where routeS0 is there too), the fastest strip config
(only those whose error is small), routeS's time (gemm.strip_choice's pick), and over all cells the geometric means of
routeS and the route over the old route: the numbers the strip route is turned on (or its order changed) from.

    python benchmarks/strip_pick.py benchmarks/logs/s50a.log
"""

from __future__ import annotations

import argparse
import math
import re
from collections import defaultdict

LINE = re.compile(r"\[[^\]]*\] (\S+) (\S+) (\d+x\d+) M=(\d+) (\S+): ([\d.]+) us .*err ([\d.e+-]+)")


def read(path: str, max_err: float) -> dict:
    cells: dict = defaultdict(dict)
    for line in open(path):
        m = LINE.search(line)
        if not m or float(m[7]) > max_err:
            continue
        cells[(m[1], m[2], m[3], int(m[4]))].setdefault(m[5], []).append(float(m[6]))
    return {key: {cfg: sum(v) / len(v) for cfg, v in cfgs.items()} for key, cfgs in cells.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--max-err", type=float, default=1e-2, help="drop timings whose error vs the reference is larger")
    args = ap.parse_args()
    cells = read(args.log, args.max_err)
    logs, new_logs = [], []
    print("| dtype | bits | K×N | M | old route µs | route µs | × | routeS µs | × | best strip config | µs | × |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (dt, bits, shape, m), t in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][3])):
        # routeS0 (session 52): the route without the strip kernel's small-shape region, the baseline where present
        base, route = t.get("routeS0", t.get("route")), t.get("route") if "routeS0" in t else None
        strips = {c: v for c, v in t.items() if c.startswith("strip-")}
        best = min(strips, key=strips.get) if strips else None
        rs = t.get("routeS")
        if base and rs:
            logs.append(math.log(rs / base))
        if base and route:
            new_logs.append(math.log(route / base))

        def fmt(x, digits=1):
            return f"{x:.{digits}f}" if x else "—"

        def ratio(x):
            return fmt(x / base if x and base else None, 2)

        print(f"| {dt} | {bits} | {shape} | {m} | {fmt(base)} | {fmt(route)} | {ratio(route)} | {fmt(rs)} | {ratio(rs)} | "
              f"{best or '—'} | {fmt(strips.get(best))} | {ratio(strips.get(best))} |")
    if logs:
        print(f"\nrouteS / old route: geometric mean {math.exp(sum(logs) / len(logs)):.3f} over {len(logs)} cells")
    if new_logs:
        print(f"route / old route: geometric mean {math.exp(sum(new_logs) / len(new_logs)):.3f} over {len(new_logs)} cells")


if __name__ == "__main__":
    main()
