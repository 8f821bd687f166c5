"""jitmarlin's ops: each module owns its heuristic, build spec and entry point."""

from ._kernels import Workspace
from .gemm import marlin_gemm

__all__ = ["Workspace", "marlin_gemm"]
