"""Mixture-of-experts blocks that quantize_model / load_quantized can replace, and how to read them.

An *adapter* is a callable ``adapter(block) -> MoESpec``: it tells where the router and the
experts' weights of one block are, how the block routes (top-k, renormalization), which parts
stay as ordinary modules (a shared expert) and what the block's forward returns. The built-in
adapter reads the Hugging Face sparse MoE blocks of Mixtral, Qwen2-MoE and Qwen3-MoE in both
layouts transformers has used:

- transformers 4.x: ``block.gate`` is an nn.Linear router and ``block.experts`` an nn.ModuleList
  of per-expert MLPs (Mixtral: w1 = gate, w3 = up, w2 = down; Qwen: gate_proj, up_proj,
  down_proj). The block returns ``(hidden [B, S, H], router_logits [B*S, E])``.
- transformers 5.x: ``block.gate`` is a top-k router module with a ``weight`` [E, H] and
  ``block.experts`` holds fused 3-D parameters ``gate_up_proj`` [E, 2I, H] (gate rows, then up
  rows) and ``down_proj`` [E, H, I]. The block returns the hidden states [B, S, H] only.

Both route the same way: softmax of the router logits in fp32 over all experts, top-k, and a
renormalization of the k weights to sum 1 -- always for Mixtral, when ``norm_topk_prob`` is set
for Qwen. Qwen2-MoE adds a shared expert (an MLP every token goes through) scaled by
``sigmoid(shared_expert_gate(x))``.

Blocks are recognised by class name and defining module (``transformers.models.*``), so
nothing here imports transformers. ``register_moe`` adds user block types; user entries are
tried before the built-in ones, the most recent first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoESpec:
    """What a MoE block holds, as an adapter describes it.

    router_weight: [E, H], the router (no bias) in nn.Linear layout.
    gate_up(e): the fused gate and up projections of expert e, [2I, H] (nn.Linear layout:
        the I gate rows first, then the I up rows); the expert computes
        down(SiLU(x @ gate.T) * (x @ up.T)).
    down(e): the down projection of expert e, [H, I].
    top_k, renormalize: routing = softmax(router logits in fp32) -> top-k -> divide the k
        weights by their sum if renormalize.
    shared_expert / shared_expert_gate: modules kept as they are (their nn.Linear layers are
        quantized like any other): the block adds shared_expert(x), times
        sigmoid(shared_expert_gate(x)) when that gate exists.
    returns_router_logits: the block's forward returns (hidden, router_logits) instead of hidden.
    checkpoint_experts: names, relative to the block and with ``{e}`` for the expert index, of the
        gate, up and down linear layers in GPTQ/AWQ checkpoints, e.g. ("experts.{e}.w1",
        "experts.{e}.w3", "experts.{e}.w2"); None when the block cannot be loaded from one.
    checkpoint_router: name of the router weight in checkpoints, relative to the block.
    expert_modules: names of the block's submodules that hold the experts (for skip patterns).
    name: a short name of the adapter, for reports and saved manifests.
    """

    router_weight: torch.Tensor
    gate_up: Callable[[int], torch.Tensor]
    down: Callable[[int], torch.Tensor]
    top_k: int
    renormalize: bool = True
    shared_expert: nn.Module | None = None
    shared_expert_gate: nn.Module | None = None
    returns_router_logits: bool = False
    checkpoint_experts: tuple[str, str, str] | None = None
    checkpoint_router: str | None = None
    expert_modules: tuple[str, ...] = ("experts",)
    name: str = "custom"

    @property
    def num_experts(self) -> int:
        return int(self.router_weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.router_weight.shape[1])

    @property
    def intermediate_size(self) -> int:
        return int(self.down(0).shape[1])

    @classmethod
    def from_module_list(cls, router: nn.Module | torch.Tensor, experts: nn.ModuleList, *, top_k: int,
                         renormalize: bool = True, gate: str = "gate_proj", up: str = "up_proj",
                         down: str = "down_proj", **kwargs) -> "MoESpec":
        """A spec for the common layout of one MLP module per expert with three nn.Linear
        (bias-free) children named ``gate``, ``up`` and ``down``. ``router`` is an nn.Linear or
        a weight [E, H]. Extra keyword arguments go to MoESpec."""
        weight = router.weight if isinstance(router, nn.Module) else router
        if isinstance(router, nn.Linear) and router.bias is not None:
            raise ValueError("the router has a bias: MarlinMoE's router is an nn.Linear without bias")
        if not isinstance(experts, nn.ModuleList) or len(experts) != weight.shape[0]:
            got = len(experts) if isinstance(experts, nn.ModuleList) else type(experts).__name__
            raise ValueError(f"experts must be an nn.ModuleList of {weight.shape[0]} expert modules (one per router "
                             f"output), got {got}")
        for e, mlp in enumerate(experts):
            for attr in (gate, up, down):
                lin = getattr(mlp, attr, None)
                if not isinstance(lin, nn.Linear):
                    raise ValueError(f"expert {e} has no nn.Linear '{attr}' (found {type(lin).__name__})")
                if lin.bias is not None:
                    raise ValueError(f"expert {e}.{attr} has a bias: MarlinMoE experts have none")
        return cls(router_weight=weight, top_k=top_k, renormalize=renormalize,
                   gate_up=lambda e: torch.cat([getattr(experts[e], gate).weight, getattr(experts[e], up).weight]),
                   down=lambda e: getattr(experts[e], down).weight, **kwargs)


Adapter = Callable[[nn.Module], MoESpec]


@dataclass
class _Entry:
    key: type | Callable[[nn.Module], bool]
    adapter: Adapter
    matches: Callable[[nn.Module], bool] = field(repr=False, default=None)


_user: list[_Entry] = []


def register_moe(cls_or_predicate: type | Callable[[nn.Module], bool], adapter: Adapter) -> None:
    """Make quantize_model / load_quantized / save_quantized treat matching modules as MoE blocks.

    cls_or_predicate: an nn.Module subclass (instances of it and of its subclasses match) or a
    function module -> bool. adapter: module -> MoESpec. Registering the same class or
    predicate again replaces its adapter. An adapter may raise ValueError to refuse one block;
    quantize_model then keeps that block in float and reports the message.
    """
    if isinstance(cls_or_predicate, type):
        if not issubclass(cls_or_predicate, nn.Module):
            raise TypeError(f"register_moe: {cls_or_predicate.__name__} is not a torch.nn.Module subclass")
        cls = cls_or_predicate
        matches = lambda m: isinstance(m, cls)  # noqa: E731
    elif callable(cls_or_predicate):
        matches = cls_or_predicate
    else:
        raise TypeError(f"register_moe: the first argument must be an nn.Module subclass or a function "
                        f"module -> bool, got {type(cls_or_predicate).__name__}")
    if not callable(adapter):
        raise TypeError(f"register_moe: adapter must be a function module -> MoESpec, got {type(adapter).__name__}")
    unregister_moe(cls_or_predicate)
    _user.insert(0, _Entry(cls_or_predicate, adapter, matches))


def unregister_moe(cls_or_predicate) -> bool:
    """Remove a registration made with register_moe; True if there was one."""
    n = len(_user)
    _user[:] = [e for e in _user if e.key is not cls_or_predicate]
    return len(_user) != n


def find_adapter(module: nn.Module) -> Adapter | None:
    """The adapter of the first registration matching module (user ones first), or None."""
    for entry in _user:
        if entry.matches(module):
            return entry.adapter
    if _hf_kind(module) is not None:
        return hf_moe_adapter
    return None


# ---------------------------------------------------------------- Hugging Face blocks

# class name -> (adapter name, (gate, up, down) expert linear names, routing renormalization attribute or None
# for "always")
_HF_BLOCKS = {
    "MixtralSparseMoeBlock": ("mixtral", ("w1", "w3", "w2"), None),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", ("gate_proj", "up_proj", "down_proj"), "norm_topk_prob"),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", ("gate_proj", "up_proj", "down_proj"), "norm_topk_prob"),
}


def _hf_kind(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in _HF_BLOCKS and cls.__module__.startswith("transformers.models."):
            return cls.__name__
    return None


def _check_silu(act, where: str) -> None:
    """The experts' activation must be SiLU (the fused kernel path computes SiLU(gate) * up)."""
    if act is None or isinstance(act, nn.SiLU) or act is F.silu:
        return
    try:
        x = torch.tensor([-6.0, -1.5, -0.25, 0.0, 0.5, 2.0, 7.0])
        ok = torch.allclose(act(x).float(), F.silu(x), atol=1e-6, rtol=1e-5)
    except Exception:  # an activation that cannot run on a small CPU tensor is not known to be SiLU
        ok = False
    if not ok:
        raise ValueError(f"{where} uses the activation {type(act).__name__}, not SiLU: MarlinMoE computes "
                         "SiLU(gate) * up")


def hf_moe_adapter(block: nn.Module) -> MoESpec:
    """Adapter of the Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks (4.x and 5.x layouts)."""
    kind = _hf_kind(block)
    if kind is None:
        raise ValueError(f"{type(block).__name__} is not a Hugging Face block this adapter knows "
                         f"({', '.join(_HF_BLOCKS)})")
    name, (g, u, d), renorm_attr = _HF_BLOCKS[kind]
    experts, router = block.experts, block.gate
    shared = getattr(block, "shared_expert", None)
    shared_gate = getattr(block, "shared_expert_gate", None)
    names = (f"experts.{{e}}.{g}", f"experts.{{e}}.{u}", f"experts.{{e}}.{d}")
    common = dict(shared_expert=shared, shared_expert_gate=shared_gate, checkpoint_experts=names,
                  checkpoint_router="gate.weight", expert_modules=("experts",), name=name)
    if isinstance(experts, nn.ModuleList):  # transformers 4.x: one MLP module per expert
        renorm = True if renorm_attr is None else bool(getattr(block, renorm_attr, False))
        _check_silu(getattr(experts[0], "act_fn", None), f"{kind} expert 0")
        return MoESpec.from_module_list(router, experts, top_k=int(block.top_k), renormalize=renorm, gate=g, up=u,
                                        down=d, returns_router_logits=True, **common)
    # transformers 5.x: fused 3-D expert parameters and a router module
    w_gu = getattr(experts, "gate_up_proj", None)
    w_d = getattr(experts, "down_proj", None)
    if not isinstance(w_gu, torch.Tensor) or not isinstance(w_d, torch.Tensor) or w_gu.dim() != 3:
        raise ValueError(f"{kind}.experts ({type(experts).__name__}) has neither a ModuleList of experts nor 3-D "
                         "gate_up_proj/down_proj parameters: unknown transformers layout")
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise ValueError(f"{kind} experts have biases: MarlinMoE experts have none")
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"{kind} experts have no gate projection: MarlinMoE computes SiLU(gate) * up")
    _check_silu(getattr(experts, "act_fn", None), f"{kind}.experts")
    if getattr(router, "bias", None) is not None:
        raise ValueError(f"{kind} router has a bias: MarlinMoE's router has none")
    top_k = getattr(router, "top_k", None) or getattr(block, "top_k")
    if renorm_attr is None:
        renorm = True
    else:
        renorm = bool(getattr(router, renorm_attr, getattr(block, renorm_attr, False)))
    transposed = bool(getattr(experts, "is_transposed", False))
    concatenated = bool(getattr(experts, "is_concatenated", True))

    def gate_up(e: int) -> torch.Tensor:
        w = w_gu[e].t() if transposed else w_gu[e]  # [2I, H]
        if not concatenated:  # rows interleaved gate0, up0, gate1, up1, ...
            w = torch.cat([w[0::2], w[1::2]])
        return w

    def down(e: int) -> torch.Tensor:
        return w_d[e].t() if transposed else w_d[e]  # [H, I]

    return MoESpec(router_weight=router.weight, gate_up=gate_up, down=down, top_k=int(top_k), renormalize=renorm,
                   returns_router_logits=False, **common)
