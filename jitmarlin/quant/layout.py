"""jitmarlin's packed weight layout: packing, unpacking, scale and zero-point permutations.

Every function is a handful of torch reshapes/permutes, so it runs on the CPU or, much faster,
on the GPU where the tensors already are.

Weights (q: integers in [0, 2**bits), logical shape [K, N], the B of C = A @ B) are stored as
int32 [N/64, K/16, 32*bits]: for each 64-column strip, K/16 blocks of 16 k, each block holding
32 lanes x (bits) words, so a strip's weights are contiguous along K and a kernel warp reads one
16-byte vector per lane per 16 k.

With k = 16*kt + 8*a + 2*t + b (a, b in {0,1}, t in [0,4)) and, inside a strip,
n = 16*j + 8*h + g (j in [0,4), h in {0,1}, g in [0,8)), lane = 4*g + t (g = groupID,
t = threadID_in_group of the mma.m16n8k16 fragment tables in the PTX ISA):

- 4-bit: word[strip, kt, 4*lane + j], nibble h + 2*a + 4*b.
  Nibbles (0, 4) are the b0 register pair (k 2t, 2t+1) of n8-block 2j, (2, 6) its b1 pair
  (k 2t+8, 2t+9), (1, 5) and (3, 7) those of n8-block 2j+1: one lop3 per pair extracts them, and
  the low nibble of every byte belongs to block 2j, the high nibble to block 2j+1.
- 8-bit: with column n = 8*e + g (e in [0,8), e = 4*eh + el),
  word[strip, kt, 128*eh + 4*lane + el], byte a + 2*b: bytes (0, 2) form b0 and (1, 3) b1 of
  n8-block e.

Group scales s [K/G, N] keep their shape; inside each 64 columns, new[8*g + e] = old[8*e + g],
so lane g finds the scales of its eight n8-blocks in one 16-byte vector. Per-channel scales
[1, N] are used as they are (applied in the epilogue).

Zero points z [K/G, N] (integers): for each 64 columns and each g, one (4-bit) or two (8-bit)
int32 words hold z[8*e + g] for e = 0..7 as nibble e (4-bit) or as byte e%4 of word e//4 (8-bit):
int32 [K/G, N*bits/32].
"""

from __future__ import annotations

import torch

# logical axes of a [K, N] matrix viewed as [K/16, a, t, b, N/64, j, h, g] (4-bit) ...
_PERM4 = (4, 0, 7, 2, 5, 3, 1, 6)  # -> [strip, kt, g, t, j, b, a, h]
# ... or [K/16, a, t, b, N/64, eh, el, g] (8-bit)
_PERM8 = (4, 0, 5, 7, 2, 6, 3, 1)  # -> [strip, kt, eh, g, t, el, b, a]


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def check_shape(k: int, n: int, bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: use 4 or 8")
    if k <= 0 or k % 16:
        raise ValueError(f"K={k} (input features) must be a positive multiple of 16 for packing")
    if n <= 0 or n % 64:
        raise ValueError(f"N={n} (output features) must be a positive multiple of 64")


def _combine(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Last axis holds 32/width small unsigned fields; pack them into int32 words, field i at
    bits [width*i, width*(i+1))."""
    count = fields.shape[-1]
    shifts = torch.arange(count, device=fields.device, dtype=torch.int64) * width
    words = (fields.to(torch.int64) << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # wrap to signed int32


def _split(words: torch.Tensor, width: int) -> torch.Tensor:
    count = 32 // width
    shifts = torch.arange(count, device=words.device, dtype=torch.int64) * width
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def pack_weights(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: integer tensor [K, N] with values in [0, 2**bits). Returns int32 [N/64, K/16, 32*bits]."""
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [K, N], got shape {tuple(q.shape)}")
    k, n = q.shape
    check_shape(k, n, bits)
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"q must be an integer tensor, got {q.dtype}")
    qmin, qmax = int(q.min()), int(q.max())
    if qmin < 0 or qmax >= (1 << bits):
        raise ValueError(f"q values must lie in [0, {(1 << bits) - 1}] for {bits}-bit weights, found [{qmin}, {qmax}]")
    if bits == 4:
        v = q.reshape(k // 16, 2, 4, 2, n // 64, 4, 2, 8).permute(_PERM4)
        return _combine(v.reshape(n // 64, k // 16, 128, 8), 4)
    v = q.reshape(k // 16, 2, 4, 2, n // 64, 2, 4, 8).permute(_PERM8)
    return _combine(v.reshape(n // 64, k // 16, 256, 4), 8)


def unpack_weights(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_weights: int32 [N/64, K/16, 32*bits] -> int64 [K, N]."""
    if packed.dim() != 3 or packed.shape[2] != 32 * bits:
        raise ValueError(f"packed weights must be [N/64, K/16, {32 * bits}] for {bits}-bit, got {tuple(packed.shape)}")
    strips, kt = packed.shape[0], packed.shape[1]
    k, n = kt * 16, strips * 64
    f = _split(packed, bits)
    if bits == 4:
        v = f.reshape(strips, kt, 8, 4, 4, 2, 2, 2).permute(_inverse(_PERM4))
    else:
        v = f.reshape(strips, kt, 2, 8, 4, 4, 2, 2).permute(_inverse(_PERM8))
    return v.reshape(k, n)


def permute_scales(s: torch.Tensor) -> torch.Tensor:
    """Group scales [K/G, N] -> kernel order (8x8 transpose inside every 64 columns).
    A single row ([1, N], per channel) is returned unchanged."""
    if s.dim() != 2 or s.shape[1] % 64:
        raise ValueError(f"scales must be [groups, N] with N a multiple of 64, got {tuple(s.shape)}")
    if s.shape[0] == 1:
        return s.contiguous()
    rows, n = s.shape
    return s.reshape(rows, n // 64, 8, 8).transpose(2, 3).reshape(rows, n).contiguous()


def unpermute_scales(s: torch.Tensor) -> torch.Tensor:
    return permute_scales(s)  # the 8x8 transpose is its own inverse


def pack_zeros(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer zero points [K/G, N] -> int32 [K/G, N*bits/32] in kernel order."""
    if z.dim() != 2 or z.shape[1] % 64:
        raise ValueError(f"zero points must be [groups, N] with N a multiple of 64, got {tuple(z.shape)}")
    zmin, zmax = int(z.min()), int(z.max())
    if zmin < 0 or zmax >= (1 << bits):
        raise ValueError(f"zero points must lie in [0, {(1 << bits) - 1}] for {bits}-bit, found [{zmin}, {zmax}]")
    rows, n = z.shape
    v = z.reshape(rows, n // 64, 8, 8).transpose(2, 3)  # [rows, strip, g, e]
    if bits == 4:
        return _combine(v, 4).reshape(rows, n // 8)
    return _combine(v.reshape(rows, n // 64, 8, 2, 4), 8).reshape(rows, n // 4)


def unpack_zeros(zp: torch.Tensor, bits: int) -> torch.Tensor:
    rows, words = zp.shape
    n = words * 32 // bits
    f = _split(zp, bits).reshape(rows, n // 64, 8, 8)  # [rows, strip, g, e]
    return f.transpose(2, 3).reshape(rows, n)
