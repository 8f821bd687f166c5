"""MarlinMoEBlock: what quantize_model / load_quantized put in place of a mixture-of-experts block."""

from __future__ import annotations

import torch
from torch import nn

from ..nn.moe import MarlinMoE
from ..ops.moe import fused_marlin_moe


class MarlinMoEBlock(nn.Module):
    """A MarlinMoE (router + quantized experts) plus an optional shared expert, with the call
    convention of the block it replaces.

    forward(hidden [..., H]) -> out [..., H] (same shape and dtype), or (out, router_logits
    [tokens, E]) when ``returns_router_logits`` (the transformers 4.x sparse MoE blocks return
    that tuple). The shared expert's output, times sigmoid(shared_expert_gate(x)) when there is
    such a gate, is added to the experts' output. Inference only: MarlinMoE has no backward.
    """

    def __init__(self, moe: MarlinMoE, *, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, returns_router_logits: bool = False,
                 source: str = ""):
        super().__init__()
        if not isinstance(moe, MarlinMoE):
            raise TypeError(f"moe must be a jitmarlin MarlinMoE, got {type(moe).__name__}")
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("shared_expert_gate without a shared_expert: the gate scales the shared expert's output")
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.returns_router_logits = returns_router_logits
        self.source = source

    @property
    def top_k(self) -> int:
        return self.moe.top_k

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    def forward(self, hidden_states: torch.Tensor):
        moe = self.moe
        if hidden_states.dtype != moe.dtype:
            raise TypeError(f"input dtype {hidden_states.dtype} differs from the quantized MoE block's {moe.dtype}: "
                            f"run the model in {moe.dtype}")
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != moe.hidden_size:
            raise ValueError(f"input has {hidden_states.shape[-1] if hidden_states.dim() else 0} features but the MoE "
                             f"block expects hidden_size={moe.hidden_size}")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = moe.router(x)
        weights, ids = moe.route_logits(logits)
        out = fused_marlin_moe(x, moe.w13_qweight, moe.w13_scales, moe.w2_qweight, moe.w2_scales, weights, ids,
                               w13_zeros=moe.w13_qzeros, w2_zeros=moe.w2_qzeros, w13_perm=moe.w13_perm,
                               w2_perm=moe.w2_perm)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        out = out.reshape(shape)
        return (out, logits) if self.returns_router_logits else out

    def extra_repr(self) -> str:
        return (f"source={self.source or '?'}, returns_router_logits={self.returns_router_logits}, "
                f"shared_expert={self.shared_expert is not None}")
