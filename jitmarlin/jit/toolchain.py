"""Finding the CUDA compiler and ninja, and checking the GPU.

Nothing here runs at import time: the checks happen at the first build (or in `jitmarlin info`).

A CUDA home is accepted only when it holds `bin/nvcc`, `include/cuda_runtime.h` and a library
folder. Validating matters: an `nvcc` on PATH can be a wrapper script in /usr/local/bin, and the
guess "parent of bin" would then be /usr/local, which has no CUDA headers.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import ToolchainError, UnsupportedDeviceError

MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class CudaToolchain:
    home: Path
    nvcc: Path
    version: tuple[int, int]  # (major, minor)
    version_full: str  # e.g. "13.0.88"
    found_by: str  # which rule found it, for `jitmarlin info`


def _problems(home: Path) -> list[str]:
    """What a candidate CUDA home lacks (empty list: it is a usable toolkit)."""
    missing = []
    nvcc = home / "bin" / "nvcc"
    if not (nvcc.is_file() and os.access(nvcc, os.X_OK)):
        missing.append("bin/nvcc")
    if not (home / "include" / "cuda_runtime.h").is_file():
        missing.append("include/cuda_runtime.h")
    libdirs = [home / "lib64", home / "lib"] + [Path(p) for p in glob.glob(str(home / "targets" / "*" / "lib"))]
    if not any(d.is_dir() for d in libdirs):
        missing.append("lib64 (or lib)")
    return missing


def _candidates() -> list[tuple[str, Path, bool]]:
    """(rule, path, strict). A strict candidate comes from an explicit env var: if it is not a
    toolkit we stop with an error instead of silently using another one."""
    out: list[tuple[str, Path, bool]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        val = os.environ.get(var)
        if val:
            out.append((f"${var}", Path(val), True))
    which = shutil.which("nvcc")
    if which:
        # Both the literal location and the resolved one (symlinks into a toolkit resolve there).
        for p in dict.fromkeys([Path(which), Path(os.path.realpath(which))]):
            out.append((f"nvcc on PATH ({which})", p.parent.parent, False))
    out.append(("/usr/local/cuda", Path("/usr/local/cuda"), False))
    for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        out.append((p, Path(p), False))
    return out


def _nvcc_version(nvcc: Path) -> tuple[tuple[int, int], str]:
    """nvcc's version, memoized on disk by (path, size, mtime) so that finding a cached module
    never has to run nvcc."""
    try:
        st = nvcc.resolve().stat()
        fingerprint = f"{nvcc.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        fingerprint = None
    memo_file = None
    if fingerprint:
        from .cache import cache_root

        memo_file = cache_root()[0] / "nvcc-versions.json"
        try:
            memo = json.loads(memo_file.read_text())
            hit = memo.get(fingerprint)
            if hit:
                return (int(hit[0]), int(hit[1])), hit[2]
        except (OSError, ValueError, TypeError, IndexError, AttributeError):
            pass
    version, full = _run_nvcc_version(nvcc)
    if memo_file is not None:
        try:
            try:
                memo = json.loads(memo_file.read_text())
                if not isinstance(memo, dict):
                    memo = {}
            except (OSError, ValueError):
                memo = {}
            memo[fingerprint] = [version[0], version[1], full]
            if memo_file.parent.is_dir():
                tmp = memo_file.with_name(f".nvcc-versions.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(memo))
                os.replace(tmp, memo_file)
        except OSError:
            pass
    return version, full


def _run_nvcc_version(nvcc: Path) -> tuple[tuple[int, int], str]:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"running '{nvcc} --version' failed: {e}") from e
    m = re.search(r"release (\d+)\.(\d+), V([\d.]+)", out)
    if not m:
        raise ToolchainError(f"cannot read the CUDA version from '{nvcc} --version':\n{out}")
    return (int(m.group(1)), int(m.group(2))), m.group(3)


@functools.lru_cache(maxsize=None)
def find_cuda() -> CudaToolchain:
    """Locate a CUDA toolkit: $CUDA_HOME, $CUDA_PATH, nvcc on PATH, /usr/local/cuda, /usr/local/cuda-*."""
    tried = []
    for rule, home, strict in _candidates():
        missing = _problems(home)
        if not missing:
            version, full = _nvcc_version(home / "bin" / "nvcc")
            return CudaToolchain(home=home, nvcc=home / "bin" / "nvcc", version=version,
                                 version_full=full, found_by=rule)
        if strict:
            raise ToolchainError(
                f"{rule[1:]}={home} is not a CUDA toolkit: it lacks {', '.join(missing)}. "
                f"Point {rule[1:]} at the folder that holds bin/nvcc, include/ and lib64/ "
                f"(for example /usr/local/cuda), or unset it.")
        tried.append(f"  {home} ({rule}): lacks {', '.join(missing)}")
    listing = "\n".join(tried) if tried else "  (no candidate)"
    raise ToolchainError(
        "jitmarlin compiles its CUDA kernels on first use and needs the CUDA compiler nvcc, "
        "but found no CUDA toolkit. Tried:\n" + listing +
        "\nInstall the CUDA toolkit (the same major version as torch.version.cuda) and set "
        "CUDA_HOME to its folder, e.g. CUDA_HOME=/usr/local/cuda.")


def check_cuda_matches_torch(tc: CudaToolchain) -> None:
    """nvcc's major version must equal torch's CUDA major version; a minor mismatch only warns."""
    import torch

    tv = torch.version.cuda
    if tv is None:
        return  # CPU build of torch: cross-compiling with --arch is still possible
    major, minor = (int(x) for x in tv.split(".")[:2])
    if tc.version[0] != major:
        raise ToolchainError(
            f"nvcc at {tc.nvcc} is CUDA {tc.version[0]}.{tc.version[1]} but torch {torch.__version__} "
            f"was built with CUDA {tv}: the major versions must match. Set CUDA_HOME to a CUDA "
            f"{major}.x toolkit, or install a torch build for CUDA {tc.version[0]}.")
    if tc.version[1] != minor:
        warnings.warn(
            f"nvcc at {tc.nvcc} is CUDA {tc.version[0]}.{tc.version[1]}, torch was built with CUDA {tv}; "
            "minor versions differ (usually fine).", stacklevel=3)


@functools.lru_cache(maxsize=None)
def find_ninja() -> Path:
    """The ninja binary of the `ninja` Python package, else one on PATH."""
    tried = []
    try:
        import ninja  # type: ignore

        bindir = getattr(ninja, "BIN_DIR", None)
        if bindir:
            p = Path(bindir) / "ninja"
            if p.is_file() and os.access(p, os.X_OK):
                return p
            tried.append(f"  {p} (the ninja package's BIN_DIR): not an executable")
        else:
            tried.append("  the ninja package has no BIN_DIR")
    except ImportError:
        tried.append("  the Python package 'ninja': not installed")
    w = shutil.which("ninja")
    if w:
        return Path(w)
    tried.append("  ninja on PATH: not found")
    raise ToolchainError("jitmarlin builds its kernels with ninja, which was not found. Tried:\n"
                         + "\n".join(tried) + "\nRun `pip install ninja`.")


def device_capability(device) -> tuple[int, int]:
    """Compute capability of a CUDA device, checked against the >= 8.0 requirement."""
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedDeviceError(
            "jitmarlin needs a CUDA GPU with compute capability >= 8.0 (Ampere or newer), but "
            f"torch {torch.__version__} sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}).")
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(idx)
    if cc < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(idx)
        raise UnsupportedDeviceError(
            f"GPU cuda:{idx} '{name}' has compute capability {cc[0]}.{cc[1]}; jitmarlin's kernels need "
            f"compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ampere or newer: "
            "mma.sync bf16, cp.async).")
    return cc


def arch_name(cc: tuple[int, int]) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def parse_arch(text: str) -> tuple[int, int]:
    """'8.0', '80', 'sm_80' or '9.0' -> (major, minor)."""
    t = text.strip().lower().removeprefix("sm_").removeprefix("compute_")
    m = re.fullmatch(r"(\d+)\.(\d+)", t) or re.fullmatch(r"(\d+)(\d)", t)
    if not m:
        raise ValueError(f"arch '{text}' is not of the form 8.0, 80 or sm_80")
    cc = (int(m.group(1)), int(m.group(2)))
    if cc < MIN_CAPABILITY:
        raise UnsupportedDeviceError(f"arch {text} is below the required compute capability 8.0")
    return cc
