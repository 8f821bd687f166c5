"""Round-to-nearest quantization (a reference quantizer) and the dequantization reference.

Conventions, shared with every checkpoint loader: the weight is the B of C = A @ B, logical
shape [K, N] (an nn.Linear weight [out, in] is its transpose). Group g covers rows
[g*G, (g+1)*G); G = -1 means one group over all of K (per channel). Then

    W[k, n] = s[k // G, n] * (q[k, n] - z[k // G, n])

with q in [0, 2**bits). Symmetric quantization fixes z = 2**(bits-1) (as GPTQ sym does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Quantized:
    """Integer weights and their scales/zeros, in the plain (unpacked) layout."""

    q: torch.Tensor  # [K, N] int32 in [0, 2**bits)
    scales: torch.Tensor  # [K/G, N] (or [1, N] per channel), float dtype of the model
    zeros: torch.Tensor | None  # [K/G, N] int32, or None for symmetric (z = 2**(bits-1))
    bits: int
    group_size: int  # -1 = per channel


def check_group(k: int, group_size: int) -> int:
    """Number of groups along K; validates the group size."""
    if group_size == -1:
        return 1
    if group_size <= 0 or group_size % 16:
        raise ValueError(f"group_size={group_size} must be -1 (per channel) or a positive multiple of 16")
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    return k // group_size


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True) -> Quantized:
    """RTN-quantize a float weight w [K, N] (the B of A @ B). Runs where w lives.

    Symmetric (GPTQ's rule): s = 2*max|w| / (2**bits - 1), z = 2**(bits-1). Asymmetric: s = (max - min)/(2**bits - 1), z = round(-min / s).
    Scales are returned in w's dtype (fp16 or bf16) and the integers are computed against those
    rounded scales, so dequantize() reproduces exactly what the kernels compute from."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: use 4 or 8")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"w must be a float tensor, got {w.dtype}")
    k, n = w.shape
    groups = check_group(k, group_size)
    g = k // groups
    wf = w.float().reshape(groups, g, n)
    maxq = (1 << bits) - 1
    sdtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float16
    if sym:
        amax = wf.abs().amax(dim=1)
        s = (2 * amax / maxq).clamp_min(1e-8).to(sdtype)
        z = torch.full_like(s, 1 << (bits - 1), dtype=torch.int32)
    else:
        lo = wf.amin(dim=1).clamp(max=0)
        hi = wf.amax(dim=1).clamp(min=0)
        s = ((hi - lo) / maxq).clamp_min(1e-8).to(sdtype)
        z = torch.round(-lo / s.float()).clamp(0, maxq).to(torch.int32)
    q = torch.round(wf / s.float().unsqueeze(1)) + z.unsqueeze(1)
    q = q.clamp(0, maxq).to(torch.int32).reshape(k, n)
    return Quantized(q=q, scales=s, zeros=None if sym else z, bits=bits, group_size=group_size)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: W[k, n] = s[k // G, n] * (q[k, n] - z[k // G, n]) in fp32, returned as dtype."""
    k, n = q.shape
    groups = check_group(k, group_size)
    if scales.shape != (groups, n):
        raise ValueError(f"scales must be [{groups}, {n}] for K={k}, group_size={group_size}, got {tuple(scales.shape)}")
    z = zeros if zeros is not None else torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32, device=q.device)
    g = k // groups
    w = (q.reshape(groups, g, n).float() - z.float().unsqueeze(1)) * scales.float().unsqueeze(1)
    return w.reshape(k, n).to(dtype)
