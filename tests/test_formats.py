"""Checkpoint formats (GPTQ v1/v2, AWQ) -> jitmarlin's packed layout, on the CPU.

The writers and readers below are this test's own, written from the public format descriptions
with numpy bit operations (independent of jitmarlin's torch code), and anchored by hand-computed
words. Round trip: random q/z/s -> checkpoint tensors -> repack_* -> Packed -> dense W.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jitmarlin.nn import MarlinLinear
from jitmarlin.quant import Packed, repack_awq, repack_gptq

AWQ_FIELD_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ: field i of a word holds column 8c + this[i]


# ---------------- the test's own writers / readers ----------------


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words.astype(np.uint32).view(np.int32)))


def _to_u64(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32).astype(np.uint64)


def write_gptq_qweight(q: np.ndarray, bits: int) -> torch.Tensor:
    """q [K, N] -> int32 [K*bits/32, N]; field j of row r = q[r*(32/bits) + j]."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint64)
    for j in range(per):
        out |= q[j::per].astype(np.uint64) << np.uint64(bits * j)
    return _to_int32(out)


def read_gptq_qweight(w: torch.Tensor, bits: int) -> np.ndarray:
    per, mask = 32 // bits, np.uint64((1 << bits) - 1)
    u = _to_u64(w)
    q = np.zeros((u.shape[0] * per, u.shape[1]), dtype=np.int64)
    for j in range(per):
        q[j::per] = (u >> np.uint64(bits * j)) & mask
    return q


def write_gptq_qzeros(z: np.ndarray, bits: int, fmt: str) -> torch.Tensor:
    """z [groups, N] true zero points -> int32 [groups, N*bits/32]; v1 ("gptq") stores z - 1.
    A v1 zero of 0 is written as -1 masked to the field (the idealized writer)."""
    per, mask = 32 // bits, (1 << bits) - 1
    stored = (z - 1) & mask if fmt == "gptq" else z
    out = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint64)
    for j in range(per):
        out |= stored[:, j::per].astype(np.uint64) << np.uint64(bits * j)
    return _to_int32(out)


def read_gptq_qzeros(w: torch.Tensor, bits: int, fmt: str) -> np.ndarray:
    per, mask = 32 // bits, (1 << bits) - 1
    u = _to_u64(w)
    z = np.zeros((u.shape[0], u.shape[1] * per), dtype=np.int64)
    for j in range(per):
        z[:, j::per] = (u >> np.uint64(bits * j)) & np.uint64(mask)
    return (z + 1) & mask if fmt == "gptq" else z


def write_awq(q: np.ndarray) -> torch.Tensor:
    """[R, N] 4-bit -> int32 [R, N/8], field i of word c = column 8c + AWQ_FIELD_COLUMN[i]."""
    out = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint64)
    for i, col in enumerate(AWQ_FIELD_COLUMN):
        out |= q[:, col::8].astype(np.uint64) << np.uint64(4 * i)
    return _to_int32(out)


def read_awq(w: torch.Tensor) -> np.ndarray:
    u = _to_u64(w)
    q = np.zeros((u.shape[0], u.shape[1] * 8), dtype=np.int64)
    for i, col in enumerate(AWQ_FIELD_COLUMN):
        q[:, col::8] = (u >> np.uint64(4 * i)) & np.uint64(15)
    return q


# ---------------- random cases ----------------


def make_case(k, n, bits, group_size, sym, act_order, seed, dtype=torch.float16):
    """Random q, z, s and g_idx, and the dense W [K, N] they define (from the ORIGINAL g_idx)."""
    rng = np.random.default_rng(seed)
    g = k if group_size == -1 else group_size
    groups = k // g
    q = rng.integers(0, 1 << bits, size=(k, n))
    z = np.full((groups, n), 1 << (bits - 1)) if sym else rng.integers(0, 1 << bits, size=(groups, n))
    s = torch.from_numpy(rng.uniform(1e-3, 2e-2, size=(groups, n)).astype(np.float32)).to(dtype)
    if act_order:
        p = rng.permutation(k)
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[p] = np.arange(k) // g  # group j is rows p[j*G:(j+1)*G]
    else:
        g_idx = np.arange(k) // g
    gi = torch.from_numpy(g_idx)
    w = s.float()[gi] * (torch.from_numpy(q) - torch.from_numpy(z)[gi]).float()
    return q, z, s, g_idx, w


# ---------------- the writers match the public format (hand-computed words) ----------------


def test_writers_match_hand_computed_words():
    q = np.tile(np.arange(8)[:, None], (1, 64))  # rows 0..7 hold their row index
    assert int(write_gptq_qweight(q, 4)[0, 0]) == 0x76543210
    q8 = np.tile(np.array([0x10, 0x20, 0x30, 0x40])[:, None], (1, 64))
    assert int(write_gptq_qweight(q8, 8)[0, 0]) == 0x40302010
    assert (write_gptq_qzeros(np.full((1, 64), 8), 4, "gptq") == 0x77777777).all()
    assert (write_gptq_qzeros(np.full((1, 64), 128), 8, "gptq") == 0x7F7F7F7F).all()
    assert (write_gptq_qzeros(np.full((1, 64), 8), 4, "gptq_v2") == 0x88888888 - (1 << 32)).all()
    cols = np.tile(np.arange(8), (1, 8))  # column c holds c % 8
    assert (write_awq(cols) == 0x75316420).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_readers_invert_writers(bits):
    q, z, *_ = make_case(256, 128, bits, 64, sym=False, act_order=False, seed=1)
    np.testing.assert_array_equal(read_gptq_qweight(write_gptq_qweight(q, bits), bits), q)
    for fmt in ("gptq", "gptq_v2"):
        np.testing.assert_array_equal(read_gptq_qzeros(write_gptq_qzeros(z, bits, fmt), bits, fmt), z)
    if bits == 4:
        np.testing.assert_array_equal(read_awq(write_awq(q)), q)


def test_repack_reads_hand_computed_words():
    """qweight words 0x76543210 everywhere: row k of the weight holds k % 8."""
    qweight = torch.full((64 // 8, 64), 0x76543210, dtype=torch.int32)
    scales = torch.ones(1, 64, dtype=torch.float16)
    packed, perm = repack_gptq(qweight, scales, group_size=-1)
    assert perm is None and packed.zeros is None
    expected = (torch.arange(64) % 8)[:, None].expand(64, 64)
    assert torch.equal(packed.unpack().q.long(), expected)
    awq = torch.full((64, 8), 0x75316420, dtype=torch.int32)
    zeros = torch.full((1, 8), 0x11111111, dtype=torch.int32)  # every zero point 1
    p = repack_awq(awq, scales, zeros, group_size=-1)
    u = p.unpack()
    assert torch.equal(u.q.long(), (torch.arange(64) % 8)[None, :].expand(64, 64))
    assert torch.equal(u.zeros.long(), torch.ones(1, 64, dtype=torch.long))


# ---------------- GPTQ round trips ----------------


def _check_gptq(k, n, bits, group_size, sym, act_order, fmt, seed=0, dtype=torch.float16):
    q, z, s, g_idx, w = make_case(k, n, bits, group_size, sym, act_order, seed, dtype)
    qweight = write_gptq_qweight(q, bits)
    qzeros = write_gptq_qzeros(z, bits, fmt)
    g = torch.from_numpy(g_idx).to(torch.int32)
    packed, perm = repack_gptq(qweight, s, qzeros, g, bits=bits, group_size=group_size, sym=sym,
                               checkpoint_format=fmt)
    assert isinstance(packed, Packed) and packed.k == k and packed.n == n and packed.bits == bits
    assert (packed.zeros is None) == sym
    if act_order and group_size != -1:
        assert perm is not None and perm.dtype == torch.int32 and perm.shape == (k,)
        assert torch.equal(g[perm.long()].long(), torch.arange(k) // group_size)  # sorted by group
        rows = perm.long()
    else:
        assert perm is None
        rows = torch.arange(k)
    u = packed.unpack()
    assert torch.equal(u.q.long(), torch.from_numpy(q)[rows])
    assert torch.equal(packed.dequantize(torch.float32), w[rows])
    layer = MarlinLinear.from_gptq(qweight, s, qzeros, g, bits=bits, group_size=group_size, sym=sym,
                                   checkpoint_format=fmt)
    assert layer.dequantize().dtype == dtype
    assert torch.equal(layer.dequantize(), w.t().to(dtype))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_round_trip(fmt, bits, group_size, sym):
    _check_gptq(384, 128, bits, group_size, sym, act_order=False, fmt=fmt, seed=bits * 1000 + group_size)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_act_order_round_trip(bits, group_size, sym):
    _check_gptq(384, 128, bits, group_size, sym, act_order=True, fmt="gptq", seed=7 + group_size)


@pytest.mark.parametrize("k,bits,group_size,sym,act_order,fmt", [
    (11008, 4, 128, True, True, "gptq"),
    (11008, 8, 64, False, False, "gptq_v2"),
    (5120, 4, 128, False, True, "gptq"),
    (5120, 8, -1, True, False, "gptq"),
])
def test_gptq_large_k(k, bits, group_size, sym, act_order, fmt):
    _check_gptq(k, 128, bits, group_size, sym, act_order, fmt)


def test_gptq_bfloat16_scales():
    _check_gptq(256, 192, 4, 64, False, True, "gptq_v2", dtype=torch.bfloat16)


def test_gptq_trivial_g_idx_and_no_qzeros_are_symmetric():
    q, z, s, g_idx, w = make_case(256, 64, 4, 128, sym=True, act_order=False, seed=3)
    qweight = write_gptq_qweight(q, 4)
    p1, perm1 = repack_gptq(qweight, s, None, torch.from_numpy(g_idx), group_size=128)
    p2, perm2 = repack_gptq(qweight, s, group_size=128)
    assert perm1 is None and perm2 is None and p1.zeros is None and p2.zeros is None
    assert torch.equal(p1.b, p2.b) and torch.equal(p1.dequantize(), w)


def test_gptq_sym_flag_ignored_when_zeros_are_mid():
    """sym=False but every zero is 2**(bits-1): packed as symmetric, same dense W."""
    q, z, s, g_idx, w = make_case(256, 64, 8, 64, sym=True, act_order=False, seed=4)
    packed, _ = repack_gptq(write_gptq_qweight(q, 8), s, write_gptq_qzeros(z, 8, "gptq"), bits=8, group_size=64,
                            sym=False)
    assert packed.zeros is None and torch.equal(packed.dequantize(), w)


def test_gptq_v1_zero_of_zero_wraps():
    """v1 stores z - 1; a zero of 0 is stored as the field's -1 (all ones) and must read back 0."""
    q, z, s, g_idx, w = make_case(128, 64, 4, 64, sym=False, act_order=False, seed=5)
    z[:] = 0
    z[0, 5] = 3
    w = s.float()[torch.from_numpy(g_idx)] * (torch.from_numpy(q) - torch.from_numpy(z)[torch.from_numpy(g_idx)]).float()
    qzeros = write_gptq_qzeros(z, 4, "gptq")
    assert int(qzeros[1, 0]) == -1  # eight fields of 0xF
    packed, _ = repack_gptq(write_gptq_qweight(q, 4), s, qzeros, group_size=64, sym=False)
    assert torch.equal(packed.unpack().zeros.long(), torch.from_numpy(z))
    assert torch.equal(packed.dequantize(), w)


def test_gptq_v2_read_as_v1_would_differ_and_warns():
    """A sym v1 checkpoint (fields 7) read as gptq_v2 gives zeros of 7: kept, with a warning."""
    q, z, s, g_idx, w = make_case(128, 64, 4, 64, sym=True, act_order=False, seed=6)
    qzeros = write_gptq_qzeros(z, 4, "gptq")
    with pytest.warns(UserWarning, match="checkpoint_format"):
        packed, _ = repack_gptq(write_gptq_qweight(q, 4), s, qzeros, group_size=64, checkpoint_format="gptq_v2")
    assert packed.zeros is not None and (packed.unpack().zeros == 7).all()


# ---------------- AWQ round trips ----------------


@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("all_eight", [False, True])
def test_awq_round_trip(group_size, all_eight):
    q, z, s, _, w = make_case(512, 128, 4, group_size, sym=all_eight, act_order=False, seed=11 + group_size)
    packed = repack_awq(write_awq(q), s, write_awq(z), group_size=group_size)
    assert (packed.zeros is None) == all_eight  # all-8 zero points are packed as symmetric
    u = packed.unpack()
    assert torch.equal(u.q.long(), torch.from_numpy(q))
    if not all_eight:
        assert torch.equal(u.zeros.long(), torch.from_numpy(z))
    assert torch.equal(packed.dequantize(), w)
    layer = MarlinLinear.from_awq(write_awq(q), s, write_awq(z), group_size=group_size)
    assert layer.perm is None and torch.equal(layer.dequantize(), w.t().half())


def test_awq_large_k_bf16():
    q, z, s, _, w = make_case(11008, 128, 4, 128, sym=False, act_order=False, seed=12, dtype=torch.bfloat16)
    layer = MarlinLinear.from_awq(write_awq(q), s, write_awq(z))
    assert layer.dtype == torch.bfloat16
    assert torch.equal(layer.dequantize(), w.t().to(torch.bfloat16))


def test_awq_is_not_gptq_order():
    """Reading AWQ words with sequential field order must give a different matrix (the test
    would not notice a missing interleave otherwise)."""
    q, z, s, _, _ = make_case(128, 64, 4, 64, sym=False, act_order=False, seed=13)
    packed = repack_awq(write_awq(q), s, write_awq(z), group_size=64)
    sequential = read_gptq_qzeros(write_awq(q), 4, "gptq_v2")  # fields in plain order along N
    assert not np.array_equal(sequential, q)
    assert torch.equal(packed.unpack().q.long(), torch.from_numpy(q))


# ---------------- errors ----------------


def _gptq_tensors(k=256, n=64, bits=4, group_size=128):
    q, z, s, g_idx, _ = make_case(k, n, bits, group_size, sym=False, act_order=False, seed=0)
    return write_gptq_qweight(q, bits), s, write_gptq_qzeros(z, bits, "gptq"), torch.from_numpy(g_idx)


def test_error_k_not_multiple_of_group():
    qweight = torch.zeros(192 // 8, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"K=192 must be a multiple of group_size=128"):
        repack_gptq(qweight, torch.ones(2, 64, dtype=torch.float16), group_size=128)
    with pytest.raises(ValueError, match=r"K=192 must be a multiple of group_size=128"):
        repack_awq(torch.zeros(192, 8, dtype=torch.int32), torch.ones(2, 64, dtype=torch.float16),
                   torch.zeros(2, 8, dtype=torch.int32), group_size=128)


def test_error_k_or_n_not_kernel_multiple():
    with pytest.raises(ValueError, match=r"K=96 .*multiple of 64"):
        repack_gptq(torch.zeros(12, 64, dtype=torch.int32), torch.ones(3, 64, dtype=torch.float16), group_size=32)
    with pytest.raises(ValueError, match=r"N=96 .*multiple of 64"):
        repack_gptq(torch.zeros(8, 96, dtype=torch.int32), torch.ones(1, 96, dtype=torch.float16), group_size=-1)


def test_error_qweight_dtype():
    qweight, s, qzeros, g_idx = _gptq_tensors()
    with pytest.raises(TypeError, match=r"qweight must be an int32.*torch.float32"):
        repack_gptq(qweight.float(), s, qzeros, g_idx)
    with pytest.raises(TypeError, match=r"qweight must be an int32.*torch.int64"):
        repack_awq(torch.zeros(128, 8, dtype=torch.int64), s, torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"scales must be a float16 or bfloat16.*torch.float32"):
        repack_gptq(qweight, s.float(), qzeros, g_idx)


def test_error_g_idx_length():
    qweight, s, qzeros, g_idx = _gptq_tensors()
    with pytest.raises(ValueError, match=r"g_idx has length 255 .*K=256"):
        repack_gptq(qweight, s, qzeros, g_idx[:255], sym=False)


def test_error_inconsistent_g_idx():
    qweight, s, qzeros, g_idx = _gptq_tensors()
    bad = g_idx.clone()
    bad[200] = 0  # group 0 gets 129 rows, group 1 127
    with pytest.raises(ValueError, match=r"inconsistent with group_size=128.*group 0 has 129 rows"):
        repack_gptq(qweight, s, qzeros, bad, sym=False)
    out_of_range = g_idx.clone()
    out_of_range[3] = 2
    with pytest.raises(ValueError, match=r"g_idx values must lie in \[0, 1\].*found \[0, 2\]"):
        repack_gptq(qweight, s, qzeros, out_of_range, sym=False)


def test_error_bits():
    qweight, s, qzeros, g_idx = _gptq_tensors()
    with pytest.raises(ValueError, match=r"bits=3 is not supported"):
        repack_gptq(qweight, s, qzeros, g_idx, bits=3)
    with pytest.raises(ValueError, match=r"bits=8 is not supported for AWQ"):
        repack_awq(torch.zeros(128, 8, dtype=torch.int32), s, torch.zeros(1, 8, dtype=torch.int32), bits=8)


def test_error_shapes_and_flags():
    qweight, s, qzeros, g_idx = _gptq_tensors()
    with pytest.raises(ValueError, match=r"scales must be \[K/group_size, N\] = \[2, 64\].*\(1, 64\)"):
        repack_gptq(qweight, s[:1], qzeros, g_idx, sym=False)
    with pytest.raises(ValueError, match=r"qzeros must be .*\[2, 8\].*\(2, 4\)"):
        repack_gptq(qweight, s, qzeros[:, :4], g_idx, sym=False)
    with pytest.raises(ValueError, match=r"qzeros is None but sym=False"):
        repack_gptq(qweight, s, None, g_idx, sym=False)
    with pytest.raises(ValueError, match=r"checkpoint_format='awq' is not supported"):
        repack_gptq(qweight, s, qzeros, g_idx, checkpoint_format="awq")
    with pytest.raises(ValueError, match=r"qzeros must be \[K/group_size, N/8\] = \[1, 8\]"):
        repack_awq(torch.zeros(128, 8, dtype=torch.int32), torch.ones(1, 64, dtype=torch.float16),
                   torch.zeros(2, 8, dtype=torch.int32))
