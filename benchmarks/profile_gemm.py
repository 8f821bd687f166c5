"""Run one GEMM a few times, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats ... \
        -k regex:jm_gemm -c 1 python3 benchmarks/profile_gemm.py --k 8192 --n 28672 --m 1

--dtype bf16: bf16 activations and scales (the wgmma kernels are named jm_wgmma_*).
"""

import argparse

import torch

import jitmarlin
from jitmarlin.quant import pack_weights, permute_scales
from jitmarlin.quant.packed import Packed

ap = argparse.ArgumentParser()
ap.add_argument("--k", type=int, default=8192)
ap.add_argument("--n", type=int, default=28672)
ap.add_argument("--m", type=int, default=1)
ap.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
args = ap.parse_args()
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
q = torch.randint(0, 16, (args.k, args.n), device="cuda", dtype=torch.int32)
s = (torch.rand(args.k // 128, args.n, device="cuda") * 0.02 + 0.005).to(dtype)
packed = Packed(pack_weights(q, 4), permute_scales(s), None, 4, 128)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
a = torch.randn(args.m, args.k, device="cuda", dtype=dtype)
for _ in range(3):
    flush.zero_()  # evict the weights from L2
    jitmarlin.marlin_gemm(a, packed.b, packed.scales)
torch.cuda.synchronize()
