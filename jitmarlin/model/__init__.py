"""Model-level use: quantize a whole float model, save it, load it back or load GPTQ/AWQ checkpoints.

    report = jitmarlin.quantize_model(model)          # nn.Linear -> MarlinLinear, MoE blocks -> MarlinMoE
    jitmarlin.save_quantized(model, "out/")
    jitmarlin.load_quantized(fresh_model, "out/")     # or a GPTQ / AWQ checkpoint directory
    jitmarlin.fuse_projections(model)                 # q/k/v and gate/up as one GEMM each (serving)
"""

from .blocks import MarlinMoEBlock
from .fuse import FusedSlice, FuseReport, fuse_linears, fuse_projections
from .io import load_quantized, save_quantized
from .patch import KeptModule, QuantReport, ReplacedModule, init_empty_weights, quantize_model
from .registry import MoESpec, find_adapter, hf_moe_adapter, register_moe, unregister_moe

__all__ = ["quantize_model", "QuantReport", "ReplacedModule", "KeptModule", "save_quantized", "load_quantized",
           "register_moe", "unregister_moe", "find_adapter", "hf_moe_adapter", "MoESpec", "MarlinMoEBlock",
           "init_empty_weights", "fuse_projections", "fuse_linears", "FuseReport", "FusedSlice"]
