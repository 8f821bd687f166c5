"""Where the time of one MoE layer's experts goes: GPU time of every kernel of fused_marlin_moe
(torch.profiler, eager calls, averaged), next to the whole call timed as a CUDA graph. The
difference between the graph time and the sum of the kernels is what the chain of dependent
launches costs (gaps, pipeline fills that do not overlap).

    python benchmarks/profile_moe.py [--shapes mixtral,e64] [--tokens 1,16,64] [--silu-epi 0,1]

--silu-epi 0,1: each case with moe.MOE_SILU_EPILOGUE off, then on (SiLU-mul in the gate/up GEMM's epilogue).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_moe import moe_cases  # noqa: E402
from diag_decode import _kernel_times  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,e64")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--silu-epi", default="", help="0,1: moe.MOE_SILU_EPILOGUE off / on, each profiled")
    args = ap.parse_args(argv)
    from jitmarlin.ops import moe as M

    for name, t, ours, ids in moe_cases(args.shapes.split(","), [int(v) for v in args.tokens.split(",")]):
        for se in [int(v) for v in args.silu_epi.split(",") if v] or [None]:
            if se is not None:
                M.MOE_SILU_EPILOGUE = bool(se)
                print(f"-- MOE_SILU_EPILOGUE={se}")
            _profile(name, t, ours, ids, args.reps)


def _profile(name, t, ours, ids, reps) -> None:
    graph_us = common.time_graph(lambda _i: ours(), 1, calls=10)
    kernels = _kernel_times(ours, reps=reps)
    total = sum(kernels.values())
    active = int(torch.unique(ids).numel())
    print(f"{name} T={t} ({active} experts active): graph {graph_us:.1f} us per call, kernels "
          f"{total:.1f} us, chain {graph_us - total:.1f} us", flush=True)
    for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"    {us:8.1f} us  {kname[:110]}")


if __name__ == "__main__":
    main()
