"""Packed weights: the kernel-ready form of a quantized matrix, and the way back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import pack_weights, pack_zeros, permute_scales, unpack_weights, unpack_zeros, unpermute_scales
from .rtn import Quantized, check_group, dequantize


@dataclass
class Packed:
    """Kernel-ready weights of one [K, N] matrix (see jitmarlin.quant.layout)."""

    b: torch.Tensor  # int32 [N/64, K/16, 32*bits]
    scales: torch.Tensor  # [K/G, N] permuted, or [1, N] per channel
    zeros: torch.Tensor | None  # int32 [K/G, N*bits/32] or None (symmetric)
    bits: int
    group_size: int

    @property
    def k(self) -> int:
        return self.b.shape[1] * 16

    @property
    def n(self) -> int:
        return self.b.shape[0] * 64

    def unpack(self) -> Quantized:
        q = unpack_weights(self.b, self.bits).to(torch.int32)
        z = unpack_zeros(self.zeros, self.bits).to(torch.int32) if self.zeros is not None else None
        return Quantized(q=q, scales=unpermute_scales(self.scales), zeros=z, bits=self.bits, group_size=self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [K, N] matrix these weights represent (reference math, fp32 then cast)."""
        u = self.unpack()
        return dequantize(u.q, u.scales, u.zeros, u.bits, u.group_size, dtype)


def pack(qz: Quantized) -> Packed:
    """Quantized (plain layout) -> Packed (kernel layout). Runs where the tensors live."""
    k, n = qz.q.shape
    groups = check_group(k, qz.group_size)
    if qz.scales.shape != (groups, n):
        raise ValueError(f"scales must be [{groups}, {n}] for K={k}, group_size={qz.group_size}, got {tuple(qz.scales.shape)}")
    if qz.zeros is not None and qz.zeros.shape != (groups, n):
        raise ValueError(f"zero points must be [{groups}, {n}], got {tuple(qz.zeros.shape)}")
    return Packed(b=pack_weights(qz.q, qz.bits), scales=permute_scales(qz.scales),
                  zeros=pack_zeros(qz.zeros, qz.bits) if qz.zeros is not None else None,
                  bits=qz.bits, group_size=qz.group_size)
