"""jitmarlin's ops: each module owns its heuristic, build spec and entry point."""

from ._kernels import Workspace
from .gemm import marlin_gemm
from .moe import fused_marlin_moe, moe_align_block_size, moe_gemm

__all__ = ["Workspace", "marlin_gemm", "fused_marlin_moe", "moe_align_block_size", "moe_gemm"]
