"""torch.nn modules built on jitmarlin's kernels."""

from .linear import MarlinLinear
from .moe import MarlinMoE

__all__ = ["MarlinLinear", "MarlinMoE"]
