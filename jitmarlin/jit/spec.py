"""Build specs: what to compile, and the key + hash that name it in the cache.

A spec is produced by an op (e.g. `jitmarlin.ops.gemm`) from a typed key; this module knows
nothing about GEMMs. Each generated source is compiled on its own to a cubin, so ninja compiles
them in parallel and no source includes torch headers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .._version import __version__


@functools.lru_cache(maxsize=None)
def source_dir() -> Path:
    """Folder holding our .cu/.cuh sources: jitmarlin/cuda_src in an installed wheel, the
    repository's top-level cuda_src/ in a checkout or editable install."""
    here = Path(__file__).resolve().parent.parent  # .../jitmarlin
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / "jm_common.cuh").is_file():
            return cand
    raise FileNotFoundError(f"jitmarlin's CUDA sources (cuda_src/jm_common.cuh) are missing next to {here}; "
                            "the installation is incomplete: reinstall jitmarlin")


def _header_digest(src: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(p.name.encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class BuildSpec:
    """One cache module: a set of generated sources compiled for one architecture.

    family: short name of the kernel family ("gemm", ...).
    cc: target compute capability, e.g. (9, 0).
    key: ordered (name, value) pairs of the template choice; readable, used in the module name
        and recorded in meta.json.
    sources: (stem, text) pairs; `stem.cu` is compiled to `stem.cubin`.
    flags: extra nvcc flags.
    cli_hint: the `jitmarlin build ...` command that fills the cache with this module.
    arch_specific: compile for the architecture-specific target (sm_90a: wgmma), which runs only
        on GPUs of exactly that compute capability.
    """

    family: str
    cc: tuple[int, int]
    key: tuple[tuple[str, str], ...]
    sources: tuple[tuple[str, str], ...]
    flags: tuple[str, ...] = ()
    cli_hint: str = field(default="", compare=False)  # command that prebuilds this module
    arch_specific: bool = False
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def slug(self) -> str:
        text = "_".join(v for _, v in self.key)
        return re.sub(r"[^A-Za-z0-9.-]+", "-", text)[:80]

    def source_hash(self) -> str:
        """Covers every byte that goes into the compile except the compiler itself: generated
        sources, all files of cuda_src/, flags, arch, and the jitmarlin and torch versions."""
        if "src" not in self._memo:
            import torch

            h = hashlib.sha256()
            h.update(json.dumps({
                "family": self.family, "cc": list(self.cc), "key": [list(kv) for kv in self.key],
                "sources": [list(s) for s in self.sources], "flags": list(self.flags),
                **({"arch_specific": True} if self.arch_specific else {}),
                "jitmarlin": __version__, "torch": torch.__version__,
            }, sort_keys=True).encode())
            h.update(_header_digest(source_dir()).encode())
            self._memo["src"] = h.hexdigest()
        return self._memo["src"]

    def module_hash(self, nvcc_version: str) -> str:
        return hashlib.sha256(f"{self.source_hash()}|nvcc {nvcc_version}".encode()).hexdigest()[:16]

    def module_name(self, nvcc_version: str) -> str:
        return f"{self.family}_{self.slug()}_{self.module_hash(nvcc_version)}"
