"""jitmarlin: Marlin-class fp16/bf16 x 4/8-bit GPU kernels for PyTorch, compiled on first use.

    import jitmarlin
    qz = jitmarlin.quantize(w_kn, bits=4, group_size=128)   # w_kn: [K, N] = linear.weight.T
    packed = jitmarlin.pack(qz)
    y = jitmarlin.marlin_gemm(x, packed.b, packed.scales, packed.zeros)

    report = jitmarlin.quantize_model(model)     # a whole model: nn.Linear and MoE blocks replaced
"""

from ._version import __version__
from .errors import (BuildError, CacheMissError, CachePermissionError, JitMarlinError, LaunchError,
                     ToolchainError, UnsupportedDeviceError)
from .model import (MarlinMoEBlock, MoESpec, QuantReport, fuse_projections, init_empty_weights, load_quantized,
                    quantize_model, register_moe, save_quantized)
from .nn import MarlinLinear, MarlinMoE
from .ops import Workspace, fused_marlin_moe, marlin_gemm, moe_align_block_size
from .quant import Packed, Quantized, dequantize, pack, quantize

__all__ = [
    "__version__", "quantize", "pack", "dequantize", "Packed", "Quantized", "marlin_gemm", "Workspace", "MarlinLinear",
    "MarlinMoE", "fused_marlin_moe", "moe_align_block_size",
    "quantize_model", "QuantReport", "save_quantized", "load_quantized", "register_moe", "MoESpec", "MarlinMoEBlock",
    "init_empty_weights", "fuse_projections",
    "JitMarlinError", "UnsupportedDeviceError", "ToolchainError", "BuildError", "CacheMissError",
    "CachePermissionError", "LaunchError",
]
