"""Find a module in the cache or build it, safely under concurrency and faults.

Protocol: look (no lock) -> take the module's file lock -> look again -> compile into a private
staging directory -> write meta.json -> atomic rename to the final name. The lock is a flock
(filelock), released by the kernel when a builder dies, so a builder killed mid-build never
blocks the next one; its staging directory is removed by the next builder that holds the lock.
A failed build leaves no module behind, keeps its log under `logs/`, and raises BuildError with
the compile command and the log tail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import filelock

from .._version import __version__
from ..errors import BuildError, CacheMissError, ToolchainError
from . import cache
from .spec import BuildSpec, source_dir
from .toolchain import CudaToolchain, check_cuda_matches_torch, find_cuda, find_ninja


@dataclass
class CompiledModule:
    path: Path
    meta: dict

    def cubin(self, stem: str) -> Path:
        return self.path / f"{stem}.cubin"


# A compile step writes one <stem>.cubin per source into `out_dir` and returns a dict of extra
# metadata. Tests replace it with a fake to exercise locking without nvcc.
CompileFn = Callable[[BuildSpec, Path, "CudaToolchain | None"], dict]

_memo: dict[tuple[str, str], CompiledModule] = {}
_memo_lock = threading.Lock()


def _quiet() -> bool:
    return os.environ.get("JITMARLIN_QUIET", "0") not in ("", "0")


def _say(msg: str) -> None:
    if not _quiet():
        print(f"jitmarlin: {msg}", file=sys.stderr, flush=True)


def nvcc_command(spec: BuildSpec, tc: CudaToolchain, stem: str = "$in") -> list[str]:
    arch = f"{spec.cc[0]}{spec.cc[1]}" + ("a" if spec.arch_specific else "")
    return [str(tc.nvcc), "-std=c++17", "-O3", "-cubin", "-lineinfo",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
            f"-I{source_dir()}", "-Xptxas", "-v", "--expt-relaxed-constexpr",
            *spec.flags, "-o", f"{stem}.cubin" if stem != "$in" else "$out", f"{stem}.cu" if stem != "$in" else "$in"]


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_REGS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict:
    """Per kernel: registers, stack frame and spill bytes from `-Xptxas -v` output."""
    out: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = _SPILL_RE.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _REGS_RE.search(line)
        if m:
            cur["registers"] = int(m.group(1))
    return out


def build_jobs() -> int:
    for var in ("JITMARLIN_BUILD_JOBS", "MAX_JOBS"):
        v = os.environ.get(var)
        if v:
            try:
                return max(1, int(v))
            except ValueError:
                raise ValueError(f"{var}={v!r} is not an integer: set it to the number of "
                                 "parallel nvcc jobs, e.g. 4") from None
    return max(1, os.cpu_count() or 1)


def compile_with_ninja(spec: BuildSpec, out_dir: Path, tc: CudaToolchain | None) -> dict:
    """Write the sources and a build.ninja into out_dir, compile each .cu to a cubin in parallel."""
    assert tc is not None
    ninja = find_ninja()
    for stem, text in spec.sources:
        (out_dir / f"{stem}.cu").write_text(text)
    cmd = nvcc_command(spec, tc)
    lines = ["ninja_required_version = 1.3", "",
             "rule cubin", "  command = " + " ".join(shlex.quote(c) if not c.startswith("$") else c for c in cmd),
             "  description = nvcc $out", ""]
    for stem, _ in spec.sources:
        lines.append(f"build {stem}.cubin: cubin {stem}.cu")
    (out_dir / "build.ninja").write_text("\n".join(lines) + "\n")
    jobs = build_jobs()
    t0 = time.time()
    proc = subprocess.run([str(ninja), "-C", str(out_dir), "-j", str(jobs)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout
    (out_dir / "build.log").write_text(log)
    if proc.returncode != 0:
        example = " ".join(shlex.quote(c) for c in nvcc_command(spec, tc, stem=spec.sources[0][0]))
        raise _BuildFailed(example, log)
    missing = [s for s, _ in spec.sources if not (out_dir / f"{s}.cubin").is_file()]
    if missing:
        raise _BuildFailed("ninja", log + f"\nmissing outputs: {missing}")
    return {"compile_seconds": round(time.time() - t0, 2), "jobs": jobs, "ptxas": parse_ptxas(log)}


class _BuildFailed(Exception):
    def __init__(self, command: str, log: str):
        super().__init__(command)
        self.command = command
        self.log = log


def _find_by_source_hash(adir: Path, spec: BuildSpec) -> Path | None:
    """Without a toolkit (e.g. a deployment image without nvcc, cache prebuilt elsewhere), accept
    any complete module whose meta records the same source hash."""
    if not adir.is_dir():
        return None
    want = spec.source_hash()
    for d in sorted(adir.glob(f"{spec.family}_*")):
        if cache.is_staging(d):
            continue  # a build in progress, or one killed after writing its meta.json
        meta = cache.read_meta(d)
        if meta and meta.get("source_hash") == want:
            return d
    return None


def _load(mdir: Path, root: Path) -> CompiledModule:
    cache.check_safe(mdir, stop=root)
    meta = cache.read_meta(mdir)
    if meta is None:
        raise BuildError(f"cached module {mdir} has an unreadable meta.json; run `jitmarlin cache clear`")
    return CompiledModule(path=mdir, meta=meta)


def get_module(spec: BuildSpec, compile_fn: CompileFn | None = None) -> CompiledModule:
    """The compiled module for `spec`, from the in-process memo, the disk cache, or a fresh build."""
    memo_key = (spec.family, spec.source_hash())
    mod = _memo.get(memo_key)
    if mod is not None:
        return mod
    with _memo_lock:
        mod = _memo.get(memo_key)
        if mod is None:
            mod = _get_module_uncached(spec, compile_fn)
            _memo[memo_key] = mod
    return mod


def _get_module_uncached(spec: BuildSpec, compile_fn: CompileFn | None) -> CompiledModule:
    root, _ = cache.cache_root()
    adir = cache.arch_dir(spec.arch, root)
    tc: CudaToolchain | None = None
    tc_error: ToolchainError | None = None
    if compile_fn is None:
        try:
            tc = find_cuda()
        except ToolchainError as e:
            tc_error = e
    nvcc_version = tc.version_full if tc is not None else ("fake" if compile_fn is not None else None)

    if nvcc_version is not None:
        mdir = adir / spec.module_name(nvcc_version)
        if (mdir / cache.META).is_file():
            return _load(mdir, root)
    else:
        found = _find_by_source_hash(adir, spec)
        if found is not None:
            return _load(found, root)
        mdir = None

    if os.environ.get("JITMARLIN_DISABLE_JIT", "0") not in ("", "0"):
        hint = spec.cli_hint or f"jitmarlin build --arch {spec.cc[0]}.{spec.cc[1]}"
        raise CacheMissError(
            f"JITMARLIN_DISABLE_JIT is set and the {spec.family} module "
            f"({', '.join(f'{k}={v}' for k, v in spec.key)}) for {spec.arch} is not in the cache "
            f"at {adir}. Fill the cache with:\n    {hint}")
    if tc_error is not None:
        raise tc_error
    assert mdir is not None
    if tc is not None:
        check_cuda_matches_torch(tc)
        find_ninja()

    cache.make_private_dir(adir, root)
    lock = filelock.FileLock(str(mdir) + ".lock", mode=0o600)
    with lock:
        if (mdir / cache.META).is_file():
            return _load(mdir, root)
        for stale in adir.glob(f"{mdir.name}{cache.STAGING}*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died; we hold the lock
        if mdir.exists():
            # No meta.json, so not a finished module (e.g. a half-deleted one): os.rename below
            # cannot replace a non-empty directory, so clear it while we hold the lock.
            cache.check_safe(mdir, stop=root)
            shutil.rmtree(mdir)
        staging = Path(tempfile.mkdtemp(prefix=f"{mdir.name}{cache.STAGING}", dir=adir))  # mode 0700
        t0 = time.time()
        _say(f"compiling {spec.family} module [{', '.join(f'{k}={v}' for k, v in spec.key)}] for "
             f"{spec.arch}: {len(spec.sources)} kernels, {build_jobs()} jobs ...")
        try:
            info = (compile_fn or compile_with_ninja)(spec, staging, tc)
            meta = {
                "family": spec.family, "arch": spec.arch, "key": [list(kv) for kv in spec.key],
                "kernels": [s for s, _ in spec.sources], "source_hash": spec.source_hash(),
                "jitmarlin_version": __version__, "torch_tag": cache.torch_tag(),
                "nvcc_version": nvcc_version, "built_at": time.time(), "flags": list(spec.flags),
                **info,
            }
            tmp = staging / (cache.META + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, staging / cache.META)
            os.rename(staging, mdir)
        except _BuildFailed as e:
            logs = adir / "logs"
            logs.mkdir(mode=0o700, exist_ok=True)
            log_path = logs / f"{mdir.name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
            log_path.write_text(e.log)
            shutil.rmtree(staging, ignore_errors=True)
            tail = "\n".join(e.log.splitlines()[-40:])
            raise BuildError(
                f"compiling the {spec.family} module for {spec.arch} failed.\ncommand: {e.command}\n"
                f"full log: {log_path}\n--- log tail ---\n{tail}") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _say(f"built {mdir.name} in {time.time() - t0:.1f} s")
        return _load(mdir, root)
