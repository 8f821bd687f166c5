"""The per-device kernel cache: where it lives, its layout, permission checks, listing, clearing.

Layout::

    <root>/<jitmarlin version>/torch<version>-cu<cuda>/sm_XY/<family>_<key>_<hash>/
        meta.json      key, versions, build time, compile log summary (written last)
        *.cubin        one per generated source
    <root>/<jitmarlin version>/torch<version>-cu<cuda>/sm_XY/logs/   logs of failed builds

root = $JITMARLIN_CACHE_DIR, else $XDG_CACHE_HOME/jitmarlin, else ~/.cache/jitmarlin.
Directories we create are 0700. We refuse to load from a directory owned by another user or
writable by group/others: a cubin from such a place could be replaced by someone else's code.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .._version import __version__
from ..errors import CachePermissionError

META = "meta.json"


def cache_root() -> tuple[Path, str]:
    """(root, why) — why says which rule chose it, for `jitmarlin info`."""
    v = os.environ.get("JITMARLIN_CACHE_DIR")
    if v:
        return Path(v).expanduser(), "$JITMARLIN_CACHE_DIR"
    v = os.environ.get("XDG_CACHE_HOME")
    if v:
        return Path(v).expanduser() / "jitmarlin", "$XDG_CACHE_HOME/jitmarlin"
    return Path.home() / ".cache" / "jitmarlin", "~/.cache/jitmarlin (default)"


def torch_tag() -> str:
    import torch

    return f"torch{torch.__version__}-cu{torch.version.cuda or 'none'}"


def version_dir(root: Path | None = None) -> Path:
    root = root if root is not None else cache_root()[0]
    return root / __version__ / torch_tag()


def arch_dir(arch: str, root: Path | None = None) -> Path:
    return version_dir(root) / arch


def check_safe(path: Path, stop: Path | None = None) -> None:
    """Raise CachePermissionError unless `path` (and each parent up to `stop`) is owned by us and
    not writable by group or others."""
    uid = os.getuid()
    p = path
    while True:
        try:
            st = p.stat()
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid != uid:
                raise CachePermissionError(
                    f"refusing to use jitmarlin cache directory {p}: it is owned by uid {st.st_uid}, "
                    f"not by you (uid {uid}). Set JITMARLIN_CACHE_DIR to a directory of your own.")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise CachePermissionError(
                    f"refusing to use jitmarlin cache directory {p}: its mode {stat.filemode(st.st_mode)} "
                    f"lets group or others write to it. Run `chmod go-w {p}` or set "
                    "JITMARLIN_CACHE_DIR to a private directory.")
        if stop is None or p == stop or p.parent == p:
            return
        p = p.parent


def make_private_dir(path: Path, root: Path) -> Path:
    """Create `path` and missing parents (below and including root) with mode 0700, then check
    that every level from root down to path is ours and not writable by others."""
    # The folders above root are not ours (e.g. ~/.cache on a fresh account): create them with
    # the default mode, like any program writing under ~/.cache would.
    root.parent.mkdir(parents=True, exist_ok=True)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p == root or p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)  # the umask can only remove bits: never wider than 0700
        except FileExistsError:
            pass
    check_safe(path, stop=root)
    return path


@dataclass
class ModuleInfo:
    path: Path
    arch: str
    family: str
    key: dict
    size: int
    built_at: float
    jitmarlin_version: str
    torch_tag: str


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


STAGING = ".staging-"


def is_staging(p: Path) -> bool:
    """A build's private staging directory (<module name>.staging-XXXX), complete or not."""
    return STAGING in p.name


def read_meta(module: Path) -> dict | None:
    try:
        return json.loads((module / META).read_text())
    except (OSError, ValueError):
        return None


def list_modules(root: Path | None = None, all_versions: bool = False) -> list[ModuleInfo]:
    root = root if root is not None else cache_root()[0]
    if all_versions:
        tops = [p for p in root.glob("*/*") if p.is_dir()] if root.is_dir() else []
    else:
        tops = [version_dir(root)]
    out = []
    for top in tops:
        if not top.is_dir():
            continue
        for archd in sorted(top.iterdir()):
            if not archd.is_dir() or not archd.name.startswith("sm_"):
                continue
            for mod in sorted(archd.iterdir()):
                # A staging dir of a running (or killed) build can already hold its meta.json.
                meta = read_meta(mod) if mod.is_dir() and not is_staging(mod) else None
                if meta is None:
                    continue
                out.append(ModuleInfo(path=mod, arch=archd.name, family=meta.get("family", "?"),
                                      key=dict(meta.get("key", [])), size=_dir_size(mod),
                                      built_at=meta.get("built_at", 0.0),
                                      jitmarlin_version=top.parent.name, torch_tag=top.name))
    return out


def clear(root: Path | None = None, all_versions: bool = False, arch: str | None = None,
          dry_run: bool = False) -> list[Path]:
    """Remove cached modules of this jitmarlin + torch version (all versions with all_versions),
    optionally only those of one arch. Returns what was (with dry_run: would be) removed."""
    root = root if root is not None else cache_root()[0]
    if not root.is_dir():
        return []
    check_safe(root)
    if all_versions:
        torch_dirs = [p for p in root.glob("*/*") if p.is_dir()]
    else:
        torch_dirs = [version_dir(root)] if version_dir(root).is_dir() else []
    if arch is not None:
        victims = [t / arch for t in torch_dirs if (t / arch).is_dir()]
    elif all_versions:
        victims = [p for p in root.iterdir() if p.is_dir()]
    else:
        victims = torch_dirs
    if not dry_run:
        for v in victims:
            shutil.rmtree(v, ignore_errors=True)
    return victims


def describe_age(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "?"
