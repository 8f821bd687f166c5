"""JIT and cache behaviour on a GPU machine, measured in fresh processes:

1. first use of a kernel family (all its tile configs) compiles into an empty cache: time;
2. a second process loads it from the cache without nvcc or ninja (both made unusable): time
   from `import jitmarlin` done to the first GEMM result;
3. 8 processes started together on an empty cache build a family exactly once.

    python benchmarks/bench_jit.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CHILD = r"""
import os, sys, time, json, subprocess
forbid = os.environ.get("JM_FORBID_SUBPROCESS") == "1"
t0 = time.time()
import torch, jitmarlin
from jitmarlin.ops import _kernels as K
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
if forbid:
    def _no(*a, **k):
        raise RuntimeError(f"subprocess started: {a[:1]}")
    subprocess.run = subprocess.Popen = _no
t1 = time.time()
fam = K.Family(os.environ.get("JM_DTYPE", "f16"), 4, False, 128)
cc = torch.cuda.get_device_capability(0)
mod = K.module(fam, cc)
t2 = time.time()
q = torch.randint(0, 16, (4096, 4096), device="cuda", dtype=torch.int32)
s = torch.rand(32, 4096, device="cuda").to(torch.float16 if fam.dtype == "f16" else torch.bfloat16)
packed = jitmarlin.pack(jitmarlin.Quantized(q, s, None, 4, 128))
a = torch.randn(3, 4096, device="cuda", dtype=s.dtype)
out = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
torch.cuda.synchronize()
t3 = time.time()
print(json.dumps({"import_and_cuda_init_s": t1 - t0, "module_s": t2 - t1, "first_gemm_s": t3 - t2,
                  "load_to_result_s": t3 - t1, "compile_seconds": mod.meta.get("compile_seconds"),
                  "jobs": mod.meta.get("jobs"), "module": str(mod.path)}))
"""


def run_child(env, timeout=600):
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {"env": common.environment()}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, JITMARLIN_CACHE_DIR=str(Path(tmp) / "cache"))
        t = time.time()
        first, err1 = run_child(env)
        first["wall_s"] = time.time() - t
        res["first_use"] = first
        # second process: no toolkit reachable, no subprocess allowed
        env2 = dict(env, CUDA_HOME="/nonexistent-cuda", PATH="/usr/bin:/bin", JM_FORBID_SUBPROCESS="1")
        env2.pop("CUDA_PATH", None)
        second, err2 = run_child(env2)
        res["cached_use"] = second
        res["cached_use_compiled"] = "compiling" in err2
        # 8 processes racing on an empty cache (another family)
        env3 = dict(env, JITMARLIN_CACHE_DIR=str(Path(tmp) / "race"), JM_DTYPE="bf16")
        t = time.time()
        procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env3, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(8)]
        outs = [p.communicate(timeout=600) for p in procs]
        res["race"] = {"wall_s": time.time() - t, "returncodes": [p.returncode for p in procs],
                       "builds": sum(o[1].count("compiling") for o in outs),
                       "modules": sorted({json.loads(o[0].strip().splitlines()[-1])["module"] for o in outs
                                          if o[0].strip()})}
    print(json.dumps(res, indent=1))
    ok = (res["first_use"]["compile_seconds"] is not None and not res["cached_use_compiled"]
          and res["race"]["builds"] == 1 and all(r == 0 for r in res["race"]["returncodes"])
          and len(res["race"]["modules"]) == 1)
    print(f"first-use compile {res['first_use']['compile_seconds']} s ({res['first_use']['jobs']} jobs); "
          f"cached load->result {second['load_to_result_s']:.3f} s without nvcc; race builds "
          f"{res['race']['builds']} -> {'OK' if ok else 'FAIL'}")
    common.write_json(args.json, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
