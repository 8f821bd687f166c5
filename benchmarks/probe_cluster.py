"""Which launches take a cluster tile (gemm.choose_cluster), and why not: for each shape and M,
the striped plan and grid, each cluster candidate's grid and how many of its clusters the device
runs at once (cuOccupancyMaxActiveClusters), and the choice.

    python benchmarks/probe_cluster.py --shapes 8192x8192,4096x4096 --m 1,16
"""

from __future__ import annotations

import argparse

import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096,8192x8192,4096x11008,11008x4096")
    ap.add_argument("--m", default="1,8,16")
    args = ap.parse_args()
    fam = K.Family("f16", 4, False, 128)
    index = torch.cuda.current_device()
    info = G.device_info(index)
    for shape in args.shapes.split(","):
        k, n = (int(x) for x in shape.split("x"))
        for m in (int(x) for x in args.m.split(",")):
            plan = G.select_plan(m, n, k, fam, info.smem_per_block, info.cc)
            fn = K.get_kernel(fam, plan.tile, index, info.cc)
            occ = fn.occupancy(plan.tile.threads(plan.nwarps), plan.smem)
            striped = G.grid_size(plan, m, n, k, info.sms, occ)
            line = f"{shape} M={m}: {plan.tile.tag()}-w{plan.nwarps} grid {striped} ({occ}/SM)"
            twin = G.cluster_twin(plan.tile)
            if twin is None or not K.tile_fits(fam, twin):
                print(line + " | no cluster form")
                continue
            for nw in (plan.nwarps, plan.nwarps // 2):
                if nw < 1 or (n // 64) % nw:
                    continue
                cand = G.Plan(twin, nw, K.smem_bytes(fam, twin, nw))
                f2 = K.get_kernel(fam, twin, index, info.cc)
                threads = twin.threads(nw)
                line += (f" | {twin.tag()}-w{nw}: grid {G.cluster_grid(cand, m, n, k)}, {f2.num_regs} regs, "
                         f"{f2.occupancy(threads, cand.smem)}/SM, clusters at once "
                         f"{f2.max_active_clusters(threads, cand.smem, twin.cluster)}")
            launch = G.prepare_launch(m, m, n, k, fam, index)
            print(line + f" | chosen {launch.plan.tile.tag()}-w{launch.plan.nwarps} grid {launch.grid}")


if __name__ == "__main__":
    main()
