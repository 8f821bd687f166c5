"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout) -> jitmarlin's packed layout.

The public checkpoint tensors of one linear layer (weight B = [K, N], K = in_features):

- ``qweight`` int32 [K*bits/32, N], packed along K, low bits first: field j (bits
  [bits*j, bits*(j+1))) of row r holds q[r*(32/bits) + j, n].
- ``qzeros`` int32 [K/G, N*bits/32], packed along N: field j of word c holds the zero point
  of column c*(32/bits) + j.
- ``scales`` float16/bfloat16 [K/G, N].
- ``g_idx`` int32 [K]: the group of every input row (k // G unless the checkpoint was
  quantized with act-order / desc_act).

``checkpoint_format="gptq"`` (v1, AutoGPTQ) stores zero - 1 in qzeros, so a symmetric 4-bit
checkpoint holds 7 in every field (0x77777777) and an 8-bit one 127; "gptq_v2" (GPTQModel)
stores the zero itself. v1 cannot represent a zero point of 0: AutoGPTQ writes -1, which we
read back modulo 2**bits as 0 -- but AutoGPTQ's writer ORs the sign-extended -1 into the
fields above it too, so such v1 checkpoints are damaged at the source and nothing can recover
them. group_size = -1 means one group over all of K.

Act-order: when g_idx is not arange(K) // G, the rows are sorted by group (stable), so the
packed weight holds W[perm] with perm = argsort(g_idx). The kernel then needs A[:, perm], and
repack_gptq returns perm for the caller to apply to the activations
(jitmarlin.nn.MarlinLinear does it with one index_select).

Every step is a torch op on whole tensors: GPU inputs are repacked on the GPU.
"""

from __future__ import annotations

import warnings

import torch

from .packed import Packed, pack
from .rtn import Quantized, check_group

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16)


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: use 4 or 8")


def check_kernel_shape(k: int, n: int) -> None:
    """What the GEMM kernel needs of a [K, N] weight."""
    if k <= 0 or k % 64:
        raise ValueError(f"K={k} (in_features) must be a positive multiple of 64: the jitmarlin GEMM kernel "
                         "reads K in tiles of 64")
    if n <= 0 or n % 64:
        raise ValueError(f"N={n} (out_features) must be a positive multiple of 64: the jitmarlin GEMM kernel "
                         "works on 64-column strips")



def check_scales(scales, k: int, n: int, group_size: int) -> None:
    """scales must be a float16/bfloat16 [K/group_size, N] tensor."""
    groups = check_group(k, group_size)
    if not isinstance(scales, torch.Tensor) or scales.dtype not in _FLOAT_DTYPES:
        got = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"scales must be a float16 or bfloat16 tensor, got {got}")
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales must be [K/group_size, N] = [{groups}, {n}] for K={k}, N={n}, "
                         f"group_size={group_size}, got {tuple(scales.shape)}")

def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [...] -> int32 fields [..., 32/bits], field j = bits [bits*j, bits*(j+1))."""
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask


def unpack_gptq_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K*bits/32, N] (packed along K) -> int32 q [K, N]."""
    rows, n = qweight.shape
    f = _fields(qweight, bits)  # [rows, N, 32/bits]: f[r, n, j] = q[r*(32/bits) + j, n]
    return f.permute(0, 2, 1).reshape(rows * (32 // bits), n)


def unpack_gptq_qzeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [groups, N*bits/32] (packed along N, sequential fields) -> int32 stored fields [groups, N]
    (for v1 these are zero - 1)."""
    groups, words = qzeros.shape
    return _fields(qzeros, bits).reshape(groups, words * (32 // bits))


def _check_int(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


def pack_grouped(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                 *, bits: int, group_size: int) -> tuple[Packed, torch.Tensor | None]:
    """Pack plain integer weights whose rows are assigned to groups by g_idx (act-order aware).

    q: int [K, N] in ORIGINAL row order; scales [K/G, N]; zeros int [K/G, N] or None (symmetric);
    g_idx: int [K] or None (= arange(K) // G). Returns (Packed of q[perm], perm) with perm int32 [K]
    = stable argsort(g_idx), or (Packed of q, None) when g_idx is trivial. Rows [g*G, (g+1)*G) of
    the sorted weight must all belong to group g; anything else raises ValueError.
    """
    k, n = q.shape
    groups = check_group(k, group_size)
    g = k // groups
    perm = None
    if g_idx is not None:
        _check_int("g_idx", g_idx)
        if g_idx.dim() != 1 or g_idx.shape[0] != k:
            raise ValueError(f"g_idx must be 1-D of length K={k} (one group index per input row), "
                             f"got shape {tuple(g_idx.shape)}")
        g_idx = g_idx.to(device=q.device, dtype=torch.int64)
        lo, hi = int(g_idx.min()), int(g_idx.max())
        if lo < 0 or hi >= groups:
            raise ValueError(f"g_idx values must lie in [0, {groups - 1}] (K={k} / group_size={group_size} groups), "
                             f"found [{lo}, {hi}]")
        expected = torch.arange(k, device=q.device, dtype=torch.int64) // g
        if not torch.equal(g_idx, expected):
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], expected):
                counts = torch.bincount(g_idx, minlength=groups)
                bad = int(torch.nonzero(counts != g)[0, 0])
                raise ValueError(f"g_idx is inconsistent with group_size={group_size}: every group must hold exactly "
                                 f"{g} input rows so that, after sorting, rows [g*{g}, (g+1)*{g}) all belong to group g; "
                                 f"group {bad} has {int(counts[bad])} rows")
            perm = order.to(torch.int32)
            q = q.index_select(0, order)
    packed = pack(Quantized(q=q, scales=scales, zeros=zeros, bits=bits, group_size=group_size))
    return packed, perm


def repack_gptq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None = None,
                g_idx: torch.Tensor | None = None, *, bits: int = 4, group_size: int = 128, sym: bool = True,
                checkpoint_format: str = "gptq") -> tuple[Packed, torch.Tensor | None]:
    """GPTQ checkpoint tensors of one layer -> (Packed, perm or None). See the module docstring.

    Zero points: if every zero point equals 2**(bits-1) the result is symmetric (Packed.zeros is
    None, the cheaper kernel) whatever ``sym`` says; otherwise the zero points are kept. ``sym``
    only matters when ``qzeros`` is None (then it must be True); a sym=True checkpoint whose zero
    points are not all 2**(bits-1) gets a warning (often a v1/v2 mix-up) and is loaded as is.

    perm (int32 [K], on qweight's device) is returned for act-order checkpoints: the kernel
    computes A[..., perm] @ dequant(Packed), so the caller must gather the activation columns.
    """
    _check_bits(bits)
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format={checkpoint_format!r} is not supported: use one of {CHECKPOINT_FORMATS}")
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != torch.int32:
        got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise TypeError(f"qweight must be an int32 tensor (GPTQ packs {32 // bits} {bits}-bit values per int32), "
                        f"got {got}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [K*{bits}/32, N], got shape {tuple(qweight.shape)}")
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    if g_idx is not None and isinstance(g_idx, torch.Tensor) and g_idx.dim() == 1 and g_idx.shape[0] != k:
        raise ValueError(f"g_idx has length {g_idx.shape[0]} but qweight {tuple(qweight.shape)} holds "
                         f"K={k} input rows ({qweight.shape[0]} rows x {32 // bits} per int32): they must agree")
    groups = check_group(k, group_size)
    check_kernel_shape(k, n)
    check_scales(scales, k, n, group_size)
    dev = qweight.device
    mid = 1 << (bits - 1)
    zeros = None
    if qzeros is None:
        if not sym:
            raise ValueError("qzeros is None but sym=False: asymmetric GPTQ weights need their zero points")
    else:
        if not isinstance(qzeros, torch.Tensor) or qzeros.dtype != torch.int32:
            got = qzeros.dtype if isinstance(qzeros, torch.Tensor) else type(qzeros).__name__
            raise TypeError(f"qzeros must be an int32 tensor, got {got}")
        if tuple(qzeros.shape) != (groups, n * bits // 32):
            raise ValueError(f"qzeros must be [K/group_size, N*{bits}/32] = [{groups}, {n * bits // 32}], "
                             f"got {tuple(qzeros.shape)}")
        z = unpack_gptq_qzeros(qzeros.to(dev), bits)
        if checkpoint_format == "gptq":
            z = (z + 1) & ((1 << bits) - 1)  # v1 stores zero - 1; -1 (a zero of 0) wraps back to 0
        if bool((z == mid).all()):
            zeros = None
        else:
            if sym:
                warnings.warn(f"sym=True but the {checkpoint_format} zero points are not all {mid} (found values in "
                              f"[{int(z.min())}, {int(z.max())}]); keeping them as asymmetric zero points. Check "
                              "checkpoint_format ('gptq' stores zero - 1, 'gptq_v2' the zero itself).", stacklevel=2)
            zeros = z
    q = unpack_gptq_qweight(qweight, bits)
    return pack_grouped(q, scales.to(dev), zeros, g_idx, bits=bits, group_size=group_size)
