"""Measured tile configs per GPU (`jitmarlin tune`).

The GEMM's built-in choice of tile config and CTA width (gemm._preferences) comes from sweeps on
our H200. Another GPU (an A100, an L40S, a clocked-down H100) may prefer other configs. `jitmarlin
tune` times every compiled config on a few shapes per class of problem -- M class (≤ 8, ≤ 16,
≤ 32, ≤ 48, larger) × size class (K·N below or above 2^26) -- and stores the winner of each class
in the kernel cache, next to the cubins of this jitmarlin + torch version:

    <cache>/<jitmarlin version>/torch<v>-cu<v>/sm_XY/tune/<GPU name>.json

From then on, problems of a tuned class on a GPU of that name try the tuned config first (the
built-in order stays as the fallback when it does not fit a shape). JITMARLIN_TUNE=0 ignores
tables. A table that cannot be read is ignored with a warning, never trusted in part. The dense
kernel's large-M dequantize + cuBLAS path is not affected.

The winner of a class is the config with the smallest mean slowdown against the fastest config
of each shape in the class (so one large shape does not outvote the others), among the configs
that can run every shape of the class.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .._version import __version__
from ..errors import JitMarlinError
from ..jit import cache
from . import _kernels as K

FORMAT = 1
ENV_DISABLE = "JITMARLIN_TUNE"
# the six shapes of the benchmark (Llama-7B/70B-like projections), K x N
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (4096, 28672), (14336, 4096), (8192, 8192),
                                              (8192, 28672), (28672, 8192))
QUICK_SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (8192, 28672))
DEFAULT_MS: tuple[int, ...] = (1, 8, 16, 32, 48, 64)
QUICK_MS: tuple[int, ...] = (1, 16, 64)
WARPS = (1, 2, 4, 8, 16)
# rows of the tiles that serve each M class (the MoE kernel needs tile rows == block size)
CLASS_ROWS = {"w8": 8, "m1": 16, "m2": 32, "m3": 48, "m4": 64}


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    cc: tuple[int, int]
    sms: int
    smem_per_block: int  # usable dynamic shared memory per block (opt-in limit minus our reserve)


def size_class(n: int, k: int) -> str:
    from .gemm import _SMALL_KN

    return "small" if k * n < _SMALL_KN else "large"


def class_key(m: int, n: int, k: int) -> str:
    from .gemm import m_class

    return f"{m_class(m)}/{size_class(n, k)}"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "gpu"


def table_path(info: DeviceInfo, root: Path | None = None) -> Path:
    return cache.arch_dir(f"sm_{info.cc[0]}{info.cc[1]}", root) / "tune" / f"{_slug(info.name)}.json"


def candidates(m: int, n: int, k: int, info: DeviceInfo, fam: K.Family) -> list[tuple[K.Tile, int]]:
    """Every compiled (tile, warps) that can run an M x N x K problem of this class on the device."""
    from .gemm import m_class

    rows = CLASS_ROWS[m_class(m)]
    out = []
    for tile in K.tiles_for(info.cc):
        if tile.rows != rows or k % tile.tile_k or not K.tile_fits(fam, tile):
            continue
        if tile.cluster:  # cluster forms replace a plan's tile at launch time (gemm.choose_cluster)
            continue
        for w in WARPS:
            if w > tile.max_warps or (n // 64) % w:
                continue
            if K.smem_bytes(fam, tile, w) <= info.smem_per_block:
                out.append((tile, w))
    return out


def choose(times: dict[tuple[int, int], dict[str, float]]) -> tuple[str, float] | None:
    """times: shape -> {config tag: µs}. The config present for every shape with the smallest mean
    of (its time / the shape's best time); returns (tag, that mean) or None."""
    if not times:
        return None
    common = set.intersection(*(set(t) for t in times.values()))
    if not common:
        return None
    best = {shape: min(t.values()) for shape, t in times.items()}
    scored = sorted((statistics.fmean(t[tag] / best[shape] for shape, t in times.items()), tag) for tag in common)
    return scored[0][1], scored[0][0]


def config_tag(tile: K.Tile, warps: int) -> str:
    return f"{tile.tag()}-w{warps}"


def parse_tag(tag: str, cc: tuple[int, int]) -> tuple[K.Tile, int] | None:
    tiles = {t.tag(): t for t in K.tiles_for(cc)}
    name, _, w = tag.rpartition("-w")
    if name not in tiles or not w.isdigit():
        return None
    return tiles[name], int(w)


Timer = Callable[[int, int, int, K.Tile, int], float]  # (k, n, m, tile, warps) -> µs per call


def tune(info: DeviceInfo, timer: Timer, shapes: Iterable[tuple[int, int]] = DEFAULT_SHAPES,
         ms: Iterable[int] = DEFAULT_MS, progress: Callable[[str], None] | None = None) -> dict:
    """Time every candidate config with `timer` and return the table (see module docstring)."""
    fam = K.Family("f16", 4, False, 128)
    shapes, ms = list(shapes), list(ms)
    for k, n in shapes:
        from .gemm import check_problem

        check_problem(n, k, 128)
    per_class: dict[str, dict[tuple[int, int, int], dict[str, float]]] = {}
    measurements = []
    t0 = time.time()
    for m in ms:
        for k, n in shapes:
            key = class_key(m, n, k)
            got = per_class.setdefault(key, {}).setdefault((k, n, m), {})
            for tile, w in candidates(m, n, k, info, fam):
                us = float(timer(k, n, m, tile, w))
                if not (us > 0 and us < float("inf")):
                    continue
                got[config_tag(tile, w)] = us
                measurements.append({"k": k, "n": n, "m": m, "config": config_tag(tile, w), "us": round(us, 3)})
            if progress is not None and got:
                tag = min(got, key=got.get)
                progress(f"  K={k} N={n} M={m} ({key}): {len(got)} configs, fastest {tag} {got[tag]:.1f} us")
    choices = {}
    for key, times in sorted(per_class.items()):
        picked = choose({shape: t for shape, t in times.items() if t})
        if picked is None:
            continue
        tag, slowdown = picked
        choices[key] = {"config": tag, "mean_slowdown": round(slowdown, 4),
                        "problems": [f"{k}x{n}x{m}" for (k, n, m) in sorted(times)]}
    return {"format": FORMAT, "device": info.name, "cc": list(info.cc), "sms": info.sms, "jitmarlin": __version__,
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - t0, 1),
            "family_timed": "f16 u4b8 g128 dense", "choices": choices, "measurements": measurements}


def save_table(table: dict, info: DeviceInfo, root: Path | None = None) -> Path:
    """Write atomically (temp file in the same directory, then rename) into a private directory."""
    root = root if root is not None else cache.cache_root()[0]
    path = table_path(info, root)
    cache.make_private_dir(path.parent, root)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    invalidate()
    return path


def read_table(info: DeviceInfo, root: Path | None = None) -> dict | None:
    """The stored table for this device, None when there is none; a table that is unreadable,
    of another format or for another device is ignored with a warning."""
    path = table_path(info, root)
    if not path.is_file():
        return None
    try:
        cache.check_safe(path.parent)
        table = json.loads(path.read_text())
        if not isinstance(table, dict) or table.get("format") != FORMAT or not isinstance(table.get("choices"), dict):
            raise ValueError(f"not a format-{FORMAT} jitmarlin tuning table")
        if table.get("device") != info.name or tuple(table.get("cc", ())) != info.cc:
            raise ValueError(f"it was made for {table.get('device')} sm_{table.get('cc')}")
    except (OSError, ValueError, TypeError, JitMarlinError) as e:  # JitMarlinError: an unsafe directory
        warnings.warn(f"jitmarlin: ignoring the tuning table {path}: {e}. Run `jitmarlin tune` again or remove it.",
                      stacklevel=2)
        return None
    return table


_loaded: dict[DeviceInfo, dict[str, tuple[K.Tile, int]]] = {}


def invalidate() -> None:
    """Forget loaded tables and the launches planned with them (after tune / reset)."""
    _loaded.clear()
    from .gemm import prepare_launch

    prepare_launch.cache_clear()


def tuned_choice(info: DeviceInfo, m: int, n: int, k: int) -> tuple[K.Tile, int] | None:
    """The tuned (tile, warps) for this problem's class on this device, or None."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    choices = _loaded.get(info)
    if choices is None:
        table = read_table(info)
        choices = {}
        for key, entry in ((table or {}).get("choices") or {}).items():
            parsed = parse_tag(str(entry.get("config", "")) if isinstance(entry, dict) else "", info.cc)
            if parsed is not None:
                choices[key] = parsed
        _loaded[info] = choices
    return choices.get(class_key(m, n, k))


def remove_table(info: DeviceInfo, root: Path | None = None) -> Path | None:
    path = table_path(info, root)
    if path.is_file():
        path.unlink()
        invalidate()
        return path
    return None


def gpu_timer(index: int, notes: list[str] | None = None) -> Timer:
    """A Timer that runs the real kernels on cuda:index: random 4-bit weights (several copies, so
    that they stream from memory and not from L2, as in serving), a CUDA graph of back-to-back
    calls, median µs per call. Each config is checked once per problem against a float reference
    first; a config that disagrees is reported in `notes` and not timed (it would be a bug)."""
    import math

    import torch

    from ..demo import time_graph
    from ..quant import dequantize
    from ..quant.layout import pack_weights, permute_scales
    from .gemm import launch_gemm

    dev = torch.device("cuda", index)
    fam = K.Family("f16", 4, False, 128)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    state: dict = {}

    def weights(k: int, n: int):
        if state.get("shape") != (k, n):
            state.clear()
            torch.cuda.empty_cache()
            gen = torch.Generator(device=dev).manual_seed(k * 131 + n)
            q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32, generator=gen)
            s = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.02 + 0.005).half()
            b, sp = pack_weights(q, 4), permute_scales(s)
            nbytes = b.numel() * 4 + sp.numel() * 2
            copies = max(2, min(32, math.ceil(3 * l2 / nbytes)))
            state.update(shape=(k, n), w=dequantize(q, s, None, 4, 128).float(),
                         copies=[(b, sp)] + [(b.clone(), sp.clone()) for _ in range(copies - 1)])
        return state

    def timer(k: int, n: int, m: int, tile: K.Tile, warps: int) -> float:
        try:
            return _time_one(k, n, m, tile, warps)
        except Exception as e:  # noqa: BLE001 - e.g. a config that cannot launch here: skip it, say why
            if notes is not None:
                notes.append(f"{config_tag(tile, warps)} K={k} N={n} M={m}: {type(e).__name__}: {e}, not used")
            return float("inf")

    def _time_one(k: int, n: int, m: int, tile: K.Tile, warps: int) -> float:
        st = weights(k, n)
        with torch.cuda.device(dev):
            a = torch.randn(m, k, device=dev, dtype=torch.float16)
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.float16)
            b0, s0 = st["copies"][0]
            launch_gemm(a, b0, s0, None, None, out, m, n, k, fam, plan_override=(tile, warps))
            ref = a.float() @ st["w"]
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-3:
                if notes is not None:
                    notes.append(f"{config_tag(tile, warps)} K={k} N={n} M={m}: relative error {err:.3g}, not used")
                return float("inf")

            def step(i: int) -> None:
                b, sc = st["copies"][i]
                launch_gemm(a, b, sc, None, None, out, m, n, k, fam, plan_override=(tile, warps))

            return time_graph(step, len(st["copies"]), calls=10, replays=5, warmup=1)

    return timer


def builtin_choice(info: DeviceInfo, m: int, n: int, k: int) -> str:
    """The config the built-in order picks (what tuning is compared against)."""
    from .gemm import select_plan

    plan = select_plan(m, n, k, K.Family("f16", 4, False, 128), info.smem_per_block, info.cc)
    return config_tag(plan.tile, plan.nwarps)
