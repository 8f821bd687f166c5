"""Timing and reporting helpers shared by the benchmarks.

Method (see /benchmarks/NOTES.md): every kernel is timed inside a CUDA graph of `calls` launches
that rotate over enough weight copies to exceed 3x the L2 cache, so weights come from HBM, not
L2; the graph is replayed `replays` times and the median per launch is reported.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import jitmarlin.demo


def l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except Exception:  # noqa: BLE001 - older torch
        return 50 << 20


def copies_for(bytes_per_copy: int, factor: float = 3.0, cap: int = 64) -> int:
    return max(2, min(cap, math.ceil(factor * l2_bytes() / max(1, bytes_per_copy))))


def time_graph(step, n_copies: int, calls: int = 20, replays: int = 15, warmup: int = 2) -> float:
    """Median µs per call of step(i) (i = copy index), timed as a CUDA graph of `calls` calls."""
    return jitmarlin.demo.time_graph(step, n_copies, calls, replays, warmup)


SETTLE_S = 0.5  # idle time before each timed block (0: none); benchmarks pass --settle


def gpu_state() -> str:
    """SM / memory clock, power, temperature and active clock-limit reasons, from nvidia-smi
    (a few per benchmark: it takes tens of ms); '?' where it is not there."""
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", "-i",
                              str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or out.stderr.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


def settle(what: str, log: list | None = None) -> None:
    """Before a timed block: wait for the GPU, then leave it idle SETTLE_S seconds so that the
    clocks recover from the block before (a memory-bound kernel timed right after compute-heavy
    cuBLAS calls at M=1024 read up to 1.4x slower in sessions 6-7), and log the GPU's state."""
    torch.cuda.synchronize()
    if SETTLE_S > 0:
        time.sleep(SETTLE_S)
    if log is not None:
        log.append(f"{what}: {gpu_state()}")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1000.0)
    del src, dst
    return nbytes / statistics.median(ts)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        driver = "?"
    import jitmarlin

    return {"gpu": props.name, "sms": props.multi_processor_count, "cc": f"{props.major}.{props.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
            "jitmarlin": jitmarlin.__version__, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d")}


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return "–" if v is None else str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))
