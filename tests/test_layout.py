"""The packed weight layout, checked word by word against the formulas the kernel relies on
(jitmarlin/quant/layout.py docstring, cuda_src/jm_dequant.cuh), computed here with plain loops."""

import pytest
import torch

from jitmarlin.quant.layout import pack_weights, unpack_weights


def _ref_pack(q: torch.Tensor, bits: int) -> list[list[list[int]]]:
    k, n = q.shape
    words = [[[0] * (32 * bits) for _ in range(k // 16)] for _ in range(n // 64)]
    for strip in range(n // 64):
        for kt in range(k // 16):
            for g in range(8):
                for t in range(4):
                    lane = 4 * g + t
                    for a in range(2):
                        for b in range(2):
                            kk = 16 * kt + 8 * a + 2 * t + b
                            if bits == 4:
                                for j in range(4):
                                    for h in range(2):
                                        nn = 64 * strip + 16 * j + 8 * h + g
                                        nib = h + 2 * a + 4 * b
                                        words[strip][kt][4 * lane + j] |= int(q[kk, nn]) << (4 * nib)
                            else:
                                for e in range(8):
                                    nn = 64 * strip + 8 * e + g
                                    eh, el = e // 4, e % 4
                                    byte = a + 2 * b
                                    words[strip][kt][128 * eh + 4 * lane + el] |= int(q[kk, nn]) << (8 * byte)
    return words


@pytest.mark.parametrize("bits", [4, 8])
def test_words_follow_the_documented_layout(bits):
    g = torch.Generator().manual_seed(bits)
    k, n = 32, 128
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    packed = pack_weights(q, bits)
    assert packed.shape == (n // 64, k // 16, 32 * bits) and packed.dtype == torch.int32
    ref = torch.tensor(_ref_pack(q, bits), dtype=torch.int64)
    got = packed.to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got, ref)
    assert torch.equal(unpack_weights(packed, bits), q.to(torch.int64))


def test_low_nibbles_feed_the_even_column_block():
    """The kernel's raw dequantization relies on it: within each byte of a 4-bit word, the low
    nibble belongs to n8-block 2j and the high nibble to block 2j+1."""
    k, n = 16, 64
    q = torch.zeros(k, n, dtype=torch.int64)
    for j in range(4):
        q[:, 16 * j + 8:16 * j + 16] = 15  # every odd block all ones, even blocks zero
    w = pack_weights(q, 4).to(torch.int64) & 0xFFFFFFFF
    assert torch.all(w == 0xF0F0F0F0)
