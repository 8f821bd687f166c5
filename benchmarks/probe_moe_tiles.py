"""A/B of the MoE kernel's tile choice (session 8): the expert GEMMs take the dense routes of
their per-expert K*N (K*N < 64M: the k-split ring), although a launch streams the weights of
every active expert. --small-kn 0 treats every expert GEMM as large (the plain ring).

    python benchmarks/probe_moe_tiles.py --small-kn 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_moe import moe_cases  # noqa: E402

from jitmarlin.ops import gemm as G  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-kn", type=int, default=None, help="override gemm._SMALL_KN (before any launch)")
    ap.add_argument("--tokens", default="1,16")
    args = ap.parse_args()
    if args.small_kn is not None:
        G._SMALL_KN = args.small_kn
    for name, t, ours, _ in moe_cases(("mixtral", "e64"), [int(v) for v in args.tokens.split(",")]):
        us = common.time_graph(lambda _i: ours(), 1, calls=10)
        print(f"[small_kn={G._SMALL_KN}] {name} T={t}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
