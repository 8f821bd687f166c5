"""MarlinMoE: a mixture-of-experts layer with quantized experts (router in the activation dtype)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe import fused_marlin_moe, route_topk
from ..quant.checkpoint import QuantConfig, decode_layer, pack_decoded, with_zero_points
from ..quant.packed import Packed, pack
from ..quant.rtn import dequantize, quantize


def _stack(packs: list[Packed], what: str):
    bits = {p.bits for p in packs}
    groups = {p.group_size for p in packs}
    zps = {p.zeros is not None for p in packs}
    shapes = {tuple(p.b.shape) for p in packs}
    if len(bits) != 1 or len(groups) != 1 or len(zps) != 1 or len(shapes) != 1:
        raise ValueError(f"all experts' {what} must share bits, group size, zero-point use and shape; got bits "
                         f"{sorted(bits)}, group sizes {sorted(groups)}, shapes {sorted(shapes)}")
    b = torch.stack([p.b for p in packs]).contiguous()
    s = torch.stack([p.scales for p in packs]).contiguous()
    z = torch.stack([p.zeros for p in packs]).contiguous() if packs[0].zeros is not None else None
    return b, s, z, packs[0].bits, packs[0].group_size


def _check_perm(perm, e: int, k: int, device: torch.device, name: str) -> torch.Tensor | None:
    """None, or int32 [E, K] on device with every row a permutation of range(K)."""
    if perm is None:
        return None
    if not isinstance(perm, torch.Tensor) or perm.dtype.is_floating_point or perm.dtype.is_complex \
            or perm.dtype == torch.bool:
        got = perm.dtype if isinstance(perm, torch.Tensor) else type(perm).__name__
        raise TypeError(f"{name} must be an integer tensor [E, K], got {got}")
    if tuple(perm.shape) != (e, k):
        raise ValueError(f"{name} must be [E={e}, K={k}] (one input-row permutation per expert), got "
                         f"{tuple(perm.shape)}")
    perm = perm.to(device=device, dtype=torch.int32).contiguous()
    ok = torch.sort(perm.long(), dim=1).values == torch.arange(k, device=device)
    if not bool(ok.all()):
        bad = int(torch.nonzero(~ok.all(dim=1))[0, 0])
        raise ValueError(f"{name}[{bad}] is not a permutation of range(K={k})")
    return perm


class MarlinMoE(nn.Module):
    """Router (nn.Linear, no bias) -> softmax over all experts in fp32 -> top-k (renormalized if
    `renormalize`, as Mixtral does) -> quantized experts (gate+up, SiLU(gate)*up, down) -> the
    routing-weighted sum. Input [..., H] fp16/bf16 on a CUDA device."""

    def __init__(self, w13: list[Packed], w2: list[Packed], router_weight: torch.Tensor, top_k: int, *,
                 renormalize: bool = True, w13_perm: torch.Tensor | None = None,
                 w2_perm: torch.Tensor | None = None):
        super().__init__()
        if len(w13) != len(w2) or len(w13) != router_weight.shape[0]:
            raise ValueError(f"{len(w13)} gate/up experts, {len(w2)} down experts and a router for "
                             f"{router_weight.shape[0]} experts: the three counts must match")
        self.num_experts = len(w13)
        if not 1 <= top_k <= self.num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={self.num_experts}]")
        b13, s13, z13, bits, group = _stack(w13, "gate/up weights")
        b2, s2, z2, bits2, group2 = _stack(w2, "down weights")
        if (bits, group) != (bits2, group2):
            raise ValueError(f"gate/up ({bits}-bit, group {group}) and down ({bits2}-bit, group {group2}) differ")
        self.hidden_size = w13[0].k
        self.intermediate_size = w13[0].n // 2
        if w2[0].k != self.intermediate_size or w2[0].n != self.hidden_size:
            raise ValueError(f"down projection is [{w2[0].k}, {w2[0].n}] but must be [I={self.intermediate_size}, "
                             f"H={self.hidden_size}]")
        if router_weight.shape != (self.num_experts, self.hidden_size):
            raise ValueError(f"router weight must be [{self.num_experts}, {self.hidden_size}], got {tuple(router_weight.shape)}")
        dev = b13.device
        if b2.device != dev:
            raise ValueError(f"gate/up weights are on {dev} but down weights on {b2.device}: put all experts on one "
                             "device")
        if s2.dtype != s13.dtype:
            raise ValueError(f"gate/up scales are {s13.dtype} but down scales {s2.dtype}: the experts need one dtype")
        self.top_k, self.renormalize, self.bits, self.group_size = top_k, renormalize, bits, group
        self.dtype = s13.dtype
        self.router = nn.Linear(self.hidden_size, self.num_experts, bias=False, device=dev, dtype=self.dtype)
        with torch.no_grad():
            self.router.weight.copy_(router_weight.to(device=dev, dtype=self.dtype))
        self.register_buffer("w13_qweight", b13)
        self.register_buffer("w13_scales", s13)
        self.register_buffer("w13_qzeros", z13)
        self.register_buffer("w2_qweight", b2)
        self.register_buffer("w2_scales", s2)
        self.register_buffer("w2_qzeros", z2)
        self.register_buffer("w13_perm", _check_perm(w13_perm, self.num_experts, self.hidden_size, dev, "w13_perm"))
        self.register_buffer("w2_perm", _check_perm(w2_perm, self.num_experts, self.intermediate_size, dev, "w2_perm"))

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, router_weight: torch.Tensor, top_k: int, *,
                   renormalize: bool = True, bits: int = 4, group_size: int = 128, sym: bool = True) -> "MarlinMoE":
        """RTN-quantize float experts: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]
        (nn.Linear weight layout, [out, in]); router_weight [E, H]. Quantizes where the tensors are."""
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
        p13 = [pack(quantize(w13[e].t(), bits, group_size, sym)) for e in range(w13.shape[0])]
        p2 = [pack(quantize(w2[e].t(), bits, group_size, sym)) for e in range(w2.shape[0])]
        return cls(p13, p2, router_weight, top_k, renormalize=renormalize)

    @classmethod
    def from_checkpoint(cls, sd, gate_prefixes: list[str], up_prefixes: list[str], down_prefixes: list[str],
                        router_weight: torch.Tensor, top_k: int, cfg: QuantConfig, *, renormalize: bool = True,
                        dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "MarlinMoE":
        """From per-expert GPTQ/AWQ checkpoint tensors (see jitmarlin.quant.checkpoint): expert e's
        gate, up and down projections are the quantized linears at gate_prefixes[e], up_prefixes[e]
        and down_prefixes[e] (each ending with '.', e.g. "model.layers.0.block_sparse_moe.experts.3.w1.");
        router_weight [E, H] is the float router (gate) weight.

        Gate and up of an expert are packed side by side (gate columns first) in one row order. With
        act-order the rows are sorted by the gate's g_idx; up's g_idx must put the rows into the same
        groups (GPTQ quantizes both against the same input Hessian, so they normally agree), possibly
        numbered differently -- otherwise ValueError naming the expert. Experts without act-order get
        the identity permutation when others have one. Tensors are moved to ``device`` and repacked
        there; ``dtype`` (float16/bfloat16) converts the scales, default the first gate's scales dtype."""
        e = len(gate_prefixes)
        if e == 0 or len(up_prefixes) != e or len(down_prefixes) != e:
            raise ValueError(f"{e} gate, {len(up_prefixes)} up and {len(down_prefixes)} down prefixes: give one of "
                             "each per expert (at least one expert)")
        if not isinstance(router_weight, torch.Tensor) or router_weight.dim() != 2 or router_weight.shape[0] != e:
            got = (tuple(router_weight.shape) if isinstance(router_weight, torch.Tensor)
                   else type(router_weight).__name__)
            raise ValueError(f"router_weight must be [E={e}, hidden], got {got}")
        p13, p2, perm13, perm2 = [], [], [], []
        for i in range(e):
            gate = decode_layer(sd, gate_prefixes[i], cfg, dtype=dtype, device=device)
            dtype = gate.scales.dtype
            up = decode_layer(sd, up_prefixes[i], cfg, dtype=dtype, device=device)
            down = decode_layer(sd, down_prefixes[i], cfg, dtype=dtype, device=device)
            if (up.k, up.n) != (gate.k, gate.n) or (down.k, down.n) != (gate.n, gate.k):
                raise ValueError(f"expert {i}: gate [K, N] = [{gate.k}, {gate.n}], up [{up.k}, {up.n}] and down "
                                 f"[{down.k}, {down.n}] do not form an expert (need up = gate = [H, I], down = [I, H])")
            try:
                packed13, order13 = pack_decoded([gate, up])
            except ValueError as err:
                raise ValueError(f"expert {i}: {err}") from err
            packed2, order2 = pack_decoded([down])
            p13.append(packed13)
            p2.append(packed2)
            perm13.append(order13)
            perm2.append(order2)
            del gate, up, down
        # one kernel per projection: all experts with zero points if any has them
        if any(p.zeros is not None for p in p13):
            p13 = [with_zero_points(p) for p in p13]
        if any(p.zeros is not None for p in p2):
            p2 = [with_zero_points(p) for p in p2]

        def stack(perms, k):
            if all(p is None for p in perms):
                return None
            dev = p13[0].b.device
            return torch.stack([p if p is not None else torch.arange(k, dtype=torch.int32, device=dev) for p in perms])

        return cls(p13, p2, router_weight, top_k, renormalize=renormalize, w13_perm=stack(perm13, p13[0].k),
                   w2_perm=stack(perm2, p2[0].k))

    def _packed(self, which: str, e: int) -> Packed:
        b, s, z = (getattr(self, f"{which}_{x}") for x in ("qweight", "scales", "qzeros"))
        return Packed(b[e], s[e], z[e] if z is not None else None, self.bits, self.group_size)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float experts (w13 [E, 2I, H], w2 [E, H, I]) this layer computes with, in the
        original input order (act-order undone)."""
        out = []
        for which in ("w13", "w2"):
            perm = getattr(self, f"{which}_perm")
            mats = []
            for e in range(self.num_experts):
                u = self._packed(which, e).unpack()
                w = dequantize(u.q, u.scales, u.zeros, u.bits, u.group_size)  # [K, N], rows in kernel order
                if perm is not None:
                    w = torch.empty_like(w).index_copy_(0, perm[e].long(), w)
                mats.append(w.t())
            out.append(torch.stack(mats).to(self.dtype))
        return out[0], out[1]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 [T, k], topk_ids [T, k]) for x [T, H]."""
        return self.route_logits(self.router(x))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 [T, k], topk_ids [T, k]) from router logits [T, E]: softmax in fp32
        over all experts, top-k, renormalized to sum 1 if the layer renormalizes (ops.moe.route_topk:
        one kernel on CUDA, int32 ids; torch ops elsewhere, int64 ids)."""
        return route_topk(logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"input dtype {x.dtype} differs from the layer's {self.dtype}")
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        weights, ids = self.route(x2)
        out = fused_marlin_moe(x2, self.w13_qweight, self.w13_scales, self.w2_qweight, self.w2_scales, weights, ids,
                               w13_zeros=self.w13_qzeros, w2_zeros=self.w2_qzeros, w13_perm=self.w13_perm,
                               w2_perm=self.w2_perm)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, bits={self.bits}, group_size={self.group_size}, "
                f"zero_points={self.w13_qzeros is not None}, act_order={self.w13_perm is not None}, "
                f"renormalize={self.renormalize}")
