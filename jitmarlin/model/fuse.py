"""Fusing sibling projections that read the same input into one GEMM (q/k/v, gate/up).

At small batch a quantized GEMM's time is mostly fixed cost (launch, pipeline fill, the split-k
reduction), not weight bytes: one 4096 x 12288 GEMM costs far less than three 4096 x 4096 ones.
Serving engines therefore store q/k/v and gate/up as one matrix. ``fuse_projections`` does that
to a model whose modules call them separately (Hugging Face attention and MLP code), without
touching the model's code: the first projection called computes all of them at once, and its
siblings return their slices of that result when they are called with the same input tensor.

    jitmarlin.quantize_model(model)
    jitmarlin.fuse_projections(model)    # after quantizing / loading, before serving

A sibling called with another tensor (or with the input modified in place since, or out of
order) recomputes the fused GEMM and takes its own slice, so results never depend on the call
pattern; only the saving is lost. Outputs are column slices (views) of the fused result, as a
split of the fused matrix would give. Save models before fusing (save_quantized refuses fused
ones). Under torch.compile the bookkeeping is traced (no graph break) and the in-place version
check is skipped: functionalized graphs do not mutate the input between the projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..nn.linear import MarlinLinear
from ..quant.packed import Packed

# Children of one module that read the same input in the model families we know (Llama, Mistral,
# Mixtral and Qwen attention; Llama/Mistral/Qwen gated MLPs).
DEFAULT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _SharedResult:
    """The last fused result, kept until every sibling has taken its slice."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.x: torch.Tensor | None = None
        self.version = -1
        self.parts: tuple[torch.Tensor, ...] = ()
        self.pending: set[int] = set()

    def clear(self) -> None:
        self.x, self.version, self.parts, self.pending = None, -1, (), set()


class FusedSlice(nn.Module):
    """Stands in for one of several fused projections: returns columns [start, start + size) of
    the fused GEMM of its input. The first slice of a group owns the fused MarlinLinear as the
    submodule ``fused`` (so .to(), state_dict and parameters see it once); the others refer to it."""

    def __init__(self, index: int, fused: MarlinLinear, shared: _SharedResult, names: tuple[str, ...]):
        super().__init__()
        self.index = index
        self.names = names
        if index == 0:
            self.fused = fused
        else:
            self._fused_ref = [fused]  # a list: not registered as a submodule
        self._shared = shared
        self.in_features = fused.in_features
        self.out_features = shared.sizes[index]

    @property
    def fused_linear(self) -> MarlinLinear:
        return self.fused if self.index == 0 else self._fused_ref[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh = self._shared
        # (torch.compile traces this bookkeeping; the in-place version counter is not traceable
        # and functionalized graphs do not mutate their inputs between the projections anyway)
        version = -1 if torch.compiler.is_compiling() else x._version
        if sh.x is x and sh.version == version and self.index in sh.pending:
            part = sh.parts[self.index]
            sh.pending.discard(self.index)
        else:
            parts = self.fused_linear(x).split(sh.sizes, dim=-1)
            sh.x, sh.version, sh.parts = x, version, parts
            sh.pending = set(range(len(sh.sizes))) - {self.index}
            part = parts[self.index]
        if not sh.pending:
            sh.clear()
        return part

    def extra_repr(self) -> str:
        return (f"{self.names[self.index]} = columns of fused {'+'.join(self.names)}, "
                f"in_features={self.in_features}, out_features={self.out_features}")


@dataclass
class FuseReport:
    fused: list[str] = field(default_factory=list)  # "parent: q_proj+k_proj+v_proj"
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (group, reason)

    def __str__(self) -> str:
        return f"{len(self.fused)} projection group(s) fused, {len(self.skipped)} left separate"


def _why_not(layers: list[nn.Module]) -> str | None:
    if not all(isinstance(m, MarlinLinear) for m in layers):
        kinds = ", ".join(sorted({type(m).__name__ for m in layers}))
        return f"not all MarlinLinear ({kinds})"
    first = layers[0]
    for m in layers[1:]:
        for attr in ("in_features", "bits", "group_size", "dtype", "sym", "act_order"):
            if getattr(m, attr) != getattr(first, attr):
                return f"{attr} differs ({getattr(first, attr)} vs {getattr(m, attr)})"
        if (m.bias is None) != (first.bias is None):
            return "some have a bias, some do not"
        if m.qweight.device != first.qweight.device:
            return "on different devices"
        if first.perm is not None and not torch.equal(m.perm, first.perm):
            return "act-order column orders differ (each layer gathers its input differently)"
    return None


def fuse_linears(layers: list[MarlinLinear]) -> MarlinLinear:
    """One MarlinLinear computing the layers' outputs side by side (concatenated along out_features).
    The packed layout keeps every 64 output columns together, so the fused tensors are plain
    concatenations of the layers' qweight / scales / qzeros / bias."""
    reason = _why_not(layers)
    if reason is not None:
        raise ValueError(f"cannot fuse these layers: {reason}")
    first = layers[0]
    packed = Packed(b=torch.cat([m.qweight for m in layers], 0), scales=torch.cat([m.scales for m in layers], 1),
                    zeros=None if first.qzeros is None else torch.cat([m.qzeros for m in layers], 1),
                    bits=first.bits, group_size=first.group_size)
    bias = None if first.bias is None else torch.cat([m.bias for m in layers])
    return MarlinLinear.from_packed(packed, bias=bias, perm=first.perm)


def fuse_projections(model: nn.Module, groups: tuple[tuple[str, ...], ...] = DEFAULT_GROUPS) -> FuseReport:
    """Fuse, in every module of `model`, each group of MarlinLinear children named in `groups`
    (default: q_proj/k_proj/v_proj and gate_proj/up_proj) into one GEMM; see the module docstring.
    Groups whose members differ in format (bits, group size, act-order order, bias, ...) stay
    separate and are listed in the report with the reason."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = FuseReport()
    for parent_name, parent in list(model.named_modules()):
        for names in groups:
            if not all(hasattr(parent, n) and isinstance(getattr(parent, n), nn.Module) for n in names):
                continue
            layers = [getattr(parent, n) for n in names]
            label = f"{parent_name or '<model>'}: {'+'.join(names)}"
            if any(isinstance(m, FusedSlice) for m in layers):
                continue  # fused already
            reason = _why_not(layers)
            if reason is not None:
                report.skipped.append((label, reason))
                continue
            fused = fuse_linears(layers)
            shared = _SharedResult([m.out_features for m in layers])
            for i, n in enumerate(names):
                setattr(parent, n, FusedSlice(i, fused, shared, names))
            report.fused.append(label)
    return report
