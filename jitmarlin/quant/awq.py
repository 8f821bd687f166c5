"""AWQ checkpoints (AutoAWQ "GEMM" layout) -> jitmarlin's packed layout.

The public checkpoint tensors of one linear layer (weight B = [K, N], K = in_features), 4-bit only:

- ``qweight`` int32 [K, N/8], packed along N: field i (bits [4i, 4i+4)) of word c holds column
  8c + ORDER[i], ORDER = (0, 2, 4, 6, 1, 3, 5, 7).
- ``qzeros`` int32 [K/G, N/8], packed the same way; the zero points themselves (no -1).
- ``scales`` float16/bfloat16 [K/G, N].

W[k, n] = s[k // G, n] * (q[k, n] - z[k // G, n]). AWQ has no act-order, so there is no perm.
If every zero point is 8 the weights are repacked as symmetric (Packed.zeros None): the math is
identical and the symmetric kernel skips the zero-point loads. Otherwise the zero points are kept.
"""

from __future__ import annotations

import torch

from .gptq import _fields, check_kernel_shape, check_scales
from .packed import Packed, pack
from .rtn import Quantized, check_group

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i holds column 8c + AWQ_ORDER[i]


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ's interleaved 4-bit packing -> int32 [R, N] in column order."""
    rows, cols = words.shape
    f = _fields(words, 4)  # [R, N/8, 8], field i = column 8c + AWQ_ORDER[i]
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c of the word sits in field inverse[c]
    idx = torch.tensor(inverse, device=words.device, dtype=torch.int64)
    return f.index_select(2, idx).reshape(rows, cols * 8)


def repack_awq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, *, group_size: int = 128,
               bits: int = 4) -> Packed:
    """AutoAWQ GEMM checkpoint tensors of one layer -> Packed (see the module docstring)."""
    if bits != 4:
        raise ValueError(f"bits={bits} is not supported for AWQ checkpoints: the AutoAWQ GEMM layout is 4-bit only")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int32 tensor (AWQ packs 8 4-bit values per int32), got {got}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [K, N/8], got shape {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = check_group(k, group_size)
    check_kernel_shape(k, n)
    check_scales(scales, k, n, group_size)
    if tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"qzeros must be [K/group_size, N/8] = [{groups}, {n // 8}], got {tuple(qzeros.shape)}")
    dev = qweight.device
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros.to(dev))
    zeros = None if bool((z == 8).all()) else z
    return pack(Quantized(q=q, scales=scales.to(dev), zeros=zeros, bits=4, group_size=group_size))
