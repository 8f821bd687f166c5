"""Quantization formats: RTN reference quantizer, jitmarlin's packed layout, checkpoint loaders."""

from .awq import repack_awq
from .checkpoint import (QuantConfig, SafetensorsError, is_quantized_linear, linear_from_checkpoint, load_safetensors,
                         safetensors_metadata, save_safetensors)
from .gptq import pack_grouped, repack_gptq
from .layout import pack_weights, pack_zeros, permute_scales, unpack_weights, unpack_zeros, unpermute_scales
from .packed import Packed, pack
from .rtn import Quantized, check_group, dequantize, quantize

__all__ = ["Packed", "pack", "Quantized", "check_group", "dequantize", "quantize", "pack_weights", "unpack_weights",
           "permute_scales", "unpermute_scales", "pack_zeros", "unpack_zeros",
           "repack_gptq", "repack_awq", "pack_grouped",
           "QuantConfig", "SafetensorsError", "load_safetensors", "save_safetensors", "safetensors_metadata",
           "linear_from_checkpoint", "is_quantized_linear"]
