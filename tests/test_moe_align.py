"""CPU checks of moe_align_block_size's contract on random routing."""

import pytest
import torch

from jitmarlin.ops.moe import BLOCK_SIZES, choose_block_size, moe_align_block_size


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block", [8, 16, 64])
def test_align_contract(seed, block):
    g = torch.Generator().manual_seed(seed)
    t = int(torch.randint(1, 300, (1,), generator=g))
    e = int(torch.randint(1, 70, (1,), generator=g))
    k = int(torch.randint(1, min(e, 8) + 1, (1,), generator=g))
    if seed % 3 == 0:  # skewed: most tokens on one expert, others empty
        ids = torch.zeros(t, k, dtype=torch.int64)
        ids[:, 1:] = torch.randint(0, e, (t, k - 1), generator=g) if k > 1 else ids[:, 1:]
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, block, e)
    numel = t * k
    assert sorted_ids.dtype == torch.int32 and expert_ids.dtype == torch.int32 and num_padded.dtype == torch.int32
    assert sorted_ids.numel() == numel + e * (block - 1)
    assert expert_ids.numel() == -(-sorted_ids.numel() // block)
    npad = int(num_padded)
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert npad == int(((counts + block - 1) // block * block).sum())
    valid = sorted_ids[sorted_ids < numel]
    # every (token, k) slot appears exactly once, all inside the padded prefix
    assert sorted(valid.tolist()) == list(range(numel))
    assert (sorted_ids[npad:] == numel).all()
    flat = ids.flatten()
    for b in range(npad // block):
        blk = sorted_ids[b * block:(b + 1) * block]
        real = blk[blk < numel].long()
        assert (flat[real] == expert_ids[b]).all(), "a block mixes experts"
        # padding only at the end of an expert's run
        if (blk == numel).any():
            first_pad = int((blk == numel).nonzero()[0])
            assert (blk[first_pad:] == numel).all()
    # each expert gets ceil(count / block) blocks
    for ex in range(e):
        assert int((expert_ids[: npad // block] == ex).sum()) == -(-int(counts[ex]) // block)


def test_align_example():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]])
    s, _, n = moe_align_block_size(ids, 4, 5)
    assert s[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert int(n) == 16


def test_choose_block_size():
    assert choose_block_size(1, 2, 8) == 8
    assert choose_block_size(1024, 2, 8) == 64
    assert all(choose_block_size(t, 6, 64) in BLOCK_SIZES for t in (1, 7, 100, 5000))


def test_align_errors():
    with pytest.raises(ValueError, match="tokens, top_k"):
        moe_align_block_size(torch.zeros(5, dtype=torch.int64), 8, 4)
    with pytest.raises(TypeError, match="integer"):
        moe_align_block_size(torch.zeros(5, 2), 8, 4)


def test_large_blocks_only_when_asked_and_experts_are_full():
    """With the wgmma MoE kernel (sm_90), rows per expert r (average): on large experts from 14 rows
    the smallest block of 24 / 32 / 48 / 80 / 96 that holds r + 1.75 binomial standard deviations,
    else 128; on small experts (or without the producer form) 128 where 64 does not, 32 in the
    wgmma_block32 range, 64 from 14 rows; never without large_blocks; CPU tensors never ask for them."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import moe as M

    # past one block of 128 per expert (covered rows above 128): blocks of 96; up to it the cover rule
    assert [choose_block_size(t, 2, 8, True) for t in (384, 444, 448, 512, 768, 1024, 1792)] == [128, 128, 96, 96, 96, 96, 96]
    for t in range(448, 3000, 37):
        assert M.covered_rows(t * 2 / 8, 2, 8) > 128 and choose_block_size(t, 2, 8, True) == 96, t
    assert choose_block_size(1024, 2, 8, True, prod_blocks=False) == 128  # no producer form: blocks of 128
    # Mixtral (top-2 of 8): sd = sqrt(0.75 r)
    tokens = (44, 48, 56, 64, 68, 72, 96, 100, 128, 160, 192, 224, 256, 288, 320, 330)
    assert [choose_block_size(t, 2, 8, True) for t in tokens] == [16, 24, 24, 24, 24, 32, 32, 48, 48, 80, 80, 80, 80, 96,
                                                                  96, 128]
    assert 64 not in M.WGMMA_COVER_BLOCKS  # (the plain form's blocks of 64 lost to 48 / 80 there: session 32)
    for t in range(56, 440, 7):  # the block holds the covered rows, and the next smaller one does not
        b = choose_block_size(t, 2, 8, True)
        cover = M.covered_rows(t * 2 / 8, 2, 8)
        assert b >= cover or b == M.WGMMA_BLOCK, (t, b, cover)
        smaller = [s for s in M.WGMMA_COVER_BLOCKS if s < b]
        assert not smaller or smaller[-1] < cover, (t, b, cover)
    assert abs(M.covered_rows(64, 2, 8) - (64 + 1.75 * 48 ** 0.5)) < 1e-9
    assert [choose_block_size(t, 2, 8, True, prod_blocks=False) for t in (72, 88, 210, 213)] == [32, 64, 64, 128]
    assert choose_block_size(40, 2, 8, True) == 16  # 10 rows (large experts): the mma.sync kernel's
    # E=64 experts, 4-bit: blocks of 8 below 7.8 rows per expert (the mma.sync rule alone: 16 from 7.2), of 16 to
    # 12.99 (WGMMA_16_ROWS_SMALL_U4, session 37), of 24 to 18.99 (WGMMA_24_ROWS_SMALL_U4), of 32 to 29.49
    # (WGMMA_32_SMALL_U4_HI), then (small_cover) the smallest producer-form block of 48 / 80 / 96 that holds the
    # covered rows, then 128
    small = 2048 * 2816
    assert [choose_block_size(t, 6, 64, True, small) for t in (77, 83, 84, 101, 102, 138, 139, 202, 203, 256, 266,
                                                               267, 314, 315, 320, 402, 403, 512, 560, 708, 709,
                                                               864, 865, 1024)] == \
        [8, 8, 16, 16, 16, 16, 24, 24, 32, 32, 32, 32, 32, 48, 48, 48, 80, 80, 80, 80, 96, 96, 128, 128]
    assert choose_block_size(80, 6, 64) == 16 and choose_block_size(80, 6, 64, True, small, bits=8) == 16
    assert choose_block_size(150, 6, 64, True, small, prod_blocks=False) == 32  # 24 is a producer-form block
    for t in range(315, 865, 11):
        b, cover = choose_block_size(t, 6, 64, True, small), M.covered_rows(t * 6 / 64, 6, 64)
        assert M.small_cover(t * 6 / 64, 6, 64, small) and b >= cover, (t, b, cover)
        assert b in M.WGMMA_COVER_SMALL_BLOCKS and all(s < cover for s in M.WGMMA_COVER_SMALL_BLOCKS if s < b), t
    # 8-bit small experts: blocks of 32 up to 24.99 rows (WGMMA_32_ROWS_SMALL), the cover rule from 25
    assert [choose_block_size(t, 6, 64, True, small, bits=8) for t in (96, 150, 266, 267, 298, 320)] == \
        [32, 32, 32, 48, 48, 48]
    assert not M.small_cover(26.0, 6, 64, small) and M.small_cover(26.0, 6, 64, small, bits=8)
    for t in range(1, 330):  # no gap between the rules: every count takes 8, 16, 24, 32 or a covering block
        want = 8 if t < 84 else 16 if t < 139 else 24 if t < 203 else 32 if t < 315 else 48
        assert choose_block_size(t, 6, 64, True, small) == want, t
    assert choose_block_size(320, 6, 64, True, small, prod_blocks=False) == 64  # no producer form: as before
    assert not M.small_cover(30.0, 6, 64, 4096 * 28672)  # large experts: the cover rule above
    assert choose_block_size(64, 2, 8) == 32  # (the mma.sync kernel's choice)
    assert choose_block_size(16, 2, 8, True) == 8 and choose_block_size(64, 6, 64, True) == 8  # 4, 6 rows
    assert choose_block_size(1024, 2, 8) == 64 and choose_block_size(100000, 8, 8) == 64
    fam = K.Family("f16", 4, False, 128, moe=True)
    assert not M._large_blocks_ok(torch.zeros(4, 1024), ((1024, 512, fam), (512, 512, fam)))
    b, s = torch.zeros(8, 16, 64, 128, dtype=torch.int32), torch.zeros(8, 8, 1024, dtype=torch.float16)
    assert M._expert_family(torch.zeros(4, 1024, dtype=torch.float16), b, s, None) == fam
    assert M._expert_family(torch.zeros(4, 1024), b, s, None) is None  # fp32: moe_gemm raises the error


@pytest.mark.parametrize("dtype,bits,groups,zp", [(torch.float16, 4, 8, False), (torch.bfloat16, 8, 1, True),
                                                   (torch.float16, 4, 32, True)])
def test_moe_args_give_the_kernel_family(dtype, bits, groups, zp):
    """The family moe_gemm compiles for (dtype, bits, zero points, group size from the scales' rows:
    one row = per channel) is the one the block-size choice asks the wgmma route about."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import moe as M

    e, n, k = 4, 256, 1024
    a = torch.zeros(8, k, dtype=dtype)
    b = torch.zeros(e, n // 64, k // 16, 32 * bits, dtype=torch.int32)
    s = torch.zeros(e, groups, n, dtype=dtype)
    z = torch.zeros(e, groups, n * bits // 32, dtype=torch.int32) if zp else None
    ids = torch.zeros(64, dtype=torch.int32)
    want = K.Family(K.DTYPES[dtype], bits, zp, -1 if groups == 1 else k // groups, moe=True)
    assert M._check_moe_args(a, b, s, z, ids, ids[:4], ids[:1], None, 8, 1, 16) == (n, k, want)
    assert M._expert_family(a, b, s, z) == want


@pytest.mark.parametrize("wgmma", [False, True])
def test_fused_moe_block_choice(monkeypatch, wgmma):
    """fused_marlin_moe asks for the wgmma kernel's blocks only where they differ from the mma.sync
    choice, and takes them only when both expert GEMMs can run there."""
    from jitmarlin.ops import moe as M

    asked, chosen = [], []

    class Stop(Exception):
        pass

    def fake_ok(hidden, gemms):
        asked.append([(n, k) for n, k, _ in gemms])
        return wgmma

    def fake_align(topk_ids, block, num_experts):
        chosen.append(block)
        raise Stop

    monkeypatch.setattr(M, "_large_blocks_ok", fake_ok)
    monkeypatch.setattr(M, "moe_align_block_size", fake_align)
    e, h, inter, top_k = 8, 256, 128, 2
    w13 = torch.zeros(e, 2 * inter // 64, h // 16, 128, dtype=torch.int32)
    w2 = torch.zeros(e, h // 64, inter // 16, 128, dtype=torch.int32)
    s13, s2 = torch.zeros(e, 2, 2 * inter, dtype=torch.float16), torch.zeros(e, 1, h, dtype=torch.float16)
    # 16 rows per expert: the producer form's blocks of 24 for these small 4-bit experts (small_block24), asked
    # for, and 32 where the producer form does not run (here: CPU tensors) or the kernels cannot (moe_gemm sends
    # blocks of 32 to the wgmma kernel where it runs); 28 rows: 32 both (4-bit small experts keep blocks of 32 up
    # to WGMMA_32_SMALL_U4_HI rows); 64 rows: 128 vs 64
    for t, want, asks in ((16, 8, False), (64, 32, True), (112, 32, False), (256, 128 if wgmma else 64, True)):
        x = torch.zeros(t, h, dtype=torch.float16)
        ids = torch.zeros(t, top_k, dtype=torch.int64)
        asked.clear()
        with pytest.raises(Stop):
            M.fused_marlin_moe(x, w13, s13, w2, s2, torch.ones(t, top_k), ids)
        assert chosen[-1] == want, (t, chosen)
        assert asked == ([[(2 * inter, h), (h, inter)]] if asks else [])


def test_moe_gemm_ready_tables_op_mirrors_moe_gemm():
    """The private op of fused_marlin_moe's second expert GEMM takes moe_gemm's arguments, then
    k_splits (and shares its fake implementation, so torch.compile traces it the same way)."""
    import jitmarlin.ops.moe  # noqa: F401  (registers the ops)

    a = torch.ops.jitmarlin.moe_gemm.default._schema
    b = torch.ops.jitmarlin.moe_gemm_ready_tables.default._schema
    assert [(x.name, str(x.type)) for x in a.arguments] + [("k_splits", "int")] == \
        [(x.name, str(x.type)) for x in b.arguments]
    assert [str(x.type) for x in a.returns] == [str(x.type) for x in b.returns]


def _meta_down_args(e=8, h=256, inter=512, slots=128, block=32):
    meta = dict(device="meta")
    return (torch.empty(slots, inter, dtype=torch.float16, **meta),
            torch.empty(e, h // 64, inter // 16, 128, dtype=torch.int32, **meta),
            torch.empty(e, inter // 128, h, dtype=torch.float16, **meta), None,
            torch.empty(slots + e * (block - 1), dtype=torch.int32, **meta),
            torch.empty(-(-(slots + e * (block - 1)) // block), dtype=torch.int32, **meta),
            torch.empty(1, dtype=torch.int32, **meta), torch.empty(slots, dtype=torch.float32, **meta),
            slots, 1, block)


def test_moe_gemm_k_splits_shapes_and_bounds():
    """k_splits > 1: fp32 partial sums [k_splits, T*k, N]; k_splits outside [1, K/64] is a clear error
    (the fake implementation, as torch.compile sees the op)."""
    import jitmarlin.ops.moe  # noqa: F401

    op = torch.ops.jitmarlin.moe_gemm_ready_tables
    args = _meta_down_args()
    out = op(*args)
    assert out.shape == (128, 256) and out.dtype == torch.float16
    out = op(*args, False, 0, 0, 3)
    assert out.shape == (3, 128, 256) and out.dtype == torch.float32
    assert op(*args, False, 0, 0, 8).shape == (8, 128, 256)  # K = 512: 8 stages, each its own split
    for bad in (0, -1, 9):
        with pytest.raises(ValueError, match=f"k_splits={bad} must be in \\[1, K/64 = 8\\]"):
            op(*args, False, 0, 0, bad)


def test_topk_sum_of_k_split_partials_cpu():
    """topk_sum over fp32 partial sums [S, T*k, H]: the sum over splits and each token's k slots,
    rounded once to the asked dtype; without a dtype (or not fp32) a clear error."""
    from jitmarlin.ops.moe import topk_sum

    t, k, h, s = 5, 3, 64, 4
    part = torch.randn(s, t * k, h, generator=torch.Generator().manual_seed(0))
    got = topk_sum(part, t, k, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h)
    want = part.double().view(s, t, k, h).sum((0, 2))
    # an fp32 sum (in an order torch picks) rounded once to bf16: within one bf16 ulp of the exact sum
    torch.testing.assert_close(got.double(), want, rtol=2.0 ** -8, atol=1e-6)
    with pytest.raises(ValueError, match="fp32"):
        topk_sum(part, t, k)
    with pytest.raises(ValueError, match="fp32"):
        topk_sum(part.half(), t, k, torch.float16)


def test_down_splits_host_rules(monkeypatch):
    """The down projection is split (MOE_DOWN_SPLITS, a probe switch: 1 by default) only on CUDA tensors
    where the wgmma kernel runs it with blocks of up to 64 rows."""
    from jitmarlin.ops import moe as M

    assert M.MOE_DOWN_SPLITS == 1
    x = torch.zeros(64, 256, dtype=torch.float16)
    w2 = torch.zeros(8, 4, 32, 128, dtype=torch.int32)
    s2 = torch.zeros(8, 4, 256, dtype=torch.float16)
    assert M._down_splits(x, 32, 128, 8, 512, w2, s2, None) == 1
    monkeypatch.setattr(M, "MOE_DOWN_SPLITS", 4)
    assert M._down_splits(x, 32, 128, 8, 512, w2, s2, None) == 1  # CPU tensors
    assert M._down_splits(x, 128, 128, 8, 512, w2, s2, None) == 1  # blocks of 128


@pytest.mark.parametrize("top_k,block", [(2, 8), (1, 16), (6, 8)])
def test_gather_by_position_cpu(top_k, block):
    """Act-order experts on the CPU (the torch reference): each real position of the sorted list
    holds its slot's row of x in its expert's column order, written out element by element here."""
    from jitmarlin.ops.moe import gather_by_position

    g = torch.Generator().manual_seed(top_k * 10 + block)
    t, e, k = 9, 8, 32
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, block, e)
    perm = torch.stack([torch.randperm(k, generator=g) for _ in range(e)])
    x = torch.randn(t, k, generator=g, dtype=torch.float32).half()
    got = gather_by_position(x, sorted_ids, expert_ids, num_padded, perm, top_k, block)
    assert got.shape == (sorted_ids.numel(), k)
    for r in range(int(num_padded)):
        slot = int(sorted_ids[r])
        if slot >= t * top_k:
            continue
        row, ex = slot // top_k, int(expert_ids[r // block])
        assert int(ids.flatten()[slot]) == ex
        for j in range(k):
            assert got[r, j] == x[row, int(perm[ex, j])]
    # no column order (the wgmma producer form's input): each real position holds its slot's row
    same = gather_by_position(x, sorted_ids, expert_ids, num_padded, None, top_k, block)
    for r in range(int(num_padded)):
        slot = int(sorted_ids[r])
        if slot < t * top_k:
            assert torch.equal(same[r], x[slot // top_k])


def test_producer_form_route_host_rules(monkeypatch):
    """fused_marlin_moe takes the wgmma producer-form route (both inputs gathered in slot-list order)
    only for blocks in MOE_WGMMA_PROD_BLOCKS with a built config, on CUDA tensors, with our MoE
    kernels on, and when both GEMMs go to the wgmma kernel."""
    from jitmarlin.ops import moe as M

    x = torch.zeros(4, 256, dtype=torch.float16)
    gemms = ((256, 256, torch.zeros(8, 4, 16, 128, dtype=torch.int32), torch.zeros(8, 2, 256, dtype=torch.float16),
              None),) * 2
    assert not M._prod_route(x, 32, 16.0, gemms)  # CPU tensors
    assert M.wgmma_prod_moe_config(32) is not None and M.wgmma_prod_moe_config(64) is None
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_BLOCKS", ())
    assert not M._prod_route(x, 32, 16.0, gemms)


@pytest.mark.parametrize("route,silu", [(False, True), (True, False), (True, True)])
def test_fused_moe_gathers_for_the_producer_form(monkeypatch, route, silu):
    """Where the producer-form route applies, fused_marlin_moe gathers the first GEMM's input in
    slot-list order (no column order) and runs that GEMM on positions with ready tables (the gather lets it
    launch only after the alignment is complete) — with SiLU-mul in its epilogue where MOE_SILU_EPILOGUE is
    on (moe_gemm_silu); elsewhere it passes the hidden states as they are (the second GEMM's side runs on
    CUDA only)."""
    from jitmarlin.ops import moe as M

    calls = []

    class Stop(Exception):
        pass

    def fake_gather(x, sorted_ids, expert_ids, num_padded, perm, top_k, block):
        calls.append(("gather", perm, top_k, block))
        return torch.zeros(sorted_ids.numel(), x.shape[1], dtype=x.dtype)

    def fake_gemm(a, *args):
        calls.append(("gemm", tuple(a.shape), args[10]))  # a_by_position
        raise Stop

    def fake_gemm_ready(a, *args):  # after the gather: the tables were complete before it
        calls.append(("gemm_ready", tuple(a.shape), args[10]))
        raise Stop

    def fake_gemm_silu(a, *args, tables_ready=False):
        calls.append(("gemm_silu", tuple(a.shape), args[-1], tables_ready))  # block_size
        raise Stop

    monkeypatch.setattr(M, "_prod_route", lambda *a: route)
    monkeypatch.setattr(M, "MOE_SILU_EPILOGUE", silu)
    monkeypatch.setattr(M, "moe_gemm_silu", fake_gemm_silu)
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 0)
    monkeypatch.setattr(M, "gather_by_position", fake_gather)
    monkeypatch.setattr(M, "moe_gemm", fake_gemm)
    monkeypatch.setattr(M, "moe_gemm_ready_tables", fake_gemm_ready)
    e, h, inter, top_k, t = 8, 256, 128, 2, 64
    _fused_moe_first_calls(M, e, h, inter, top_k, t, Stop)
    if route and silu:
        assert calls[0] == ("gather", None, top_k, 32) and calls[1][0] == "gemm_silu" and calls[1][2:] == (32, True)
    elif route:
        assert calls[0] == ("gather", None, top_k, 32) and calls[1][0] == "gemm_ready" and calls[1][2] is True
        monkeypatch.setattr(M, "MOE_W13_READY_TABLES", False)  # (the probe switch: the plain launch)
        calls.clear()
        _fused_moe_first_calls(M, e, h, inter, top_k, t, Stop)
        assert calls[1][0] == "gemm", calls
        monkeypatch.setattr(M, "MOE_W13_READY_TABLES", True)
    else:
        assert calls == [("gemm", (t, h), False)]
    # small experts (K*N <= MOE_WGMMA_PROD_MIN_KN, no cover rule at these rows): blocks of 32 gather for the
    # producer form from WGMMA_PROD_SMALL32_MIN_ROWS rows per expert (t * top_k / e), not below
    monkeypatch.setattr(M, "MOE_WGMMA_PROD_MIN_KN", 1 << 24)
    assert M.WGMMA_PROD_SMALL32_MIN_ROWS == M.WGMMA_32_ROWS_SMALL[0] == 9
    for tokens, bits, gathers in ((64, 4, True), (36, 4, True), (32, 4, False), (64, 8, False)):  # (8-bit: not
        calls.clear()                                                               # at four CTAs per SM)
        _fused_moe_first_calls(M, e, h, inter, top_k, tokens, Stop, bits)
        assert (calls[0][0] == "gather") == (gathers and route), (tokens, bits, calls)


def _fused_moe_first_calls(M, e, h, inter, top_k, t, stop, bits=4):
    """fused_marlin_moe on zero experts of this shape (blocks of 32) until its first GEMM (which raises `stop`)."""
    w13 = torch.zeros(e, 2 * inter // 64, h // 16, 32 * bits, dtype=torch.int32)
    w2 = torch.zeros(e, h // 64, inter // 16, 32 * bits, dtype=torch.int32)
    s13, s2 = torch.zeros(e, 2, 2 * inter, dtype=torch.float16), torch.zeros(e, 1, h, dtype=torch.float16)
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)])
    with pytest.raises(stop):
        M.fused_marlin_moe(torch.zeros(t, h, dtype=torch.float16), w13, s13, w2, s2, torch.ones(t, top_k), ids,
                           block_size=32)


def test_one_token_tables_host_rules(monkeypatch):
    """moe.one_token_tables (the MoE layer at one token without the alignment kernel) declines what its
    kernels cannot read: CPU ids, more than one token, float or non-contiguous ids, the switch off; and
    moe_gemm takes ids_shift / num_experts in both of its ops (the second GEMM's mirrors the first)."""
    from jitmarlin.ops import moe as M

    ids = torch.tensor([[3, 5]])
    assert M.one_token_tables(ids) is None  # CPU tensors: the alignment (the reference path) runs
    meta = torch.empty(1, 2, dtype=torch.int64, device="meta")
    assert M.one_token_tables(meta) is None
    for name in ("moe_gemm", "moe_gemm_ready_tables"):
        args = {a.name: a for a in getattr(torch.ops.jitmarlin, name).default._schema.arguments}
        assert str(args["ids_shift"].type) == "int" and args["ids_shift"].default_value == 0
        assert str(args["num_experts"].type) == "int" and args["num_experts"].default_value == 0
    from torch._subclasses.fake_tensor import FakeTensorMode

    e, h, n, k = 8, 256, 128, 2
    with FakeTensorMode():
        x = torch.empty(1, h, dtype=torch.float16, device="cuda")
        w = torch.empty(e, n // 64, h // 16, 128, dtype=torch.int32, device="cuda")
        s = torch.empty(e, h // 128, n, dtype=torch.float16, device="cuda")
        sorted_ids = torch.empty(8 * k, dtype=torch.int32, device="cuda")  # one block of 8 per slot
        npad = torch.empty(1, dtype=torch.int32, device="cuda")
        ids64 = torch.empty(1, k, dtype=torch.int64, device="cuda").view(-1).view(torch.int32)  # 2k words
        out = torch.ops.jitmarlin.moe_gemm(x, w, s, None, sorted_ids, ids64, npad, None, k, k, 8, False, 1, e)
        assert tuple(out.shape) == (k, n)
        for shift, table, clamp in ((1, ids64[:k], e), (2, ids64, e), (0, ids64, e + 1), (0, ids64, -1)):
            with pytest.raises(ValueError, match="ids_shift"):
                torch.ops.jitmarlin.moe_gemm(x, w, s, None, sorted_ids, table, npad, None, k, k, 8, False, shift,
                                             clamp)


def test_route_topk_reference_path():
    """moe.route_topk off CUDA: torch's softmax in fp32, top-k, renormalized or not; bad top_k refused."""
    from jitmarlin.ops import moe as M

    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, -2.0, 0.5, 0.25]], dtype=torch.float16)
    w, ids = M.route_topk(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 2]]
    assert torch.allclose(w.sum(-1), torch.ones(2))
    p = torch.softmax(logits.float(), -1)
    w2, _ = M.route_topk(logits, 2, False)
    assert torch.allclose(w2, torch.stack([p[0, [1, 2]], p[1, [0, 2]]]))
    for bad in (0, 5):
        with pytest.raises(ValueError, match="top_k"):
            M.route_topk(logits, bad, True)


def test_blocks_of_24_host_rules():
    """Blocks of 24 rows: accepted by the argument checks (the wgmma producer form's blocks), the
    alignment pads to them, the (24, 1, 6) producer-form MoE kernel is built (three CTAs per SM) and
    chosen by the rule's rows per expert, and other block sizes outside BLOCK_SIZES stay a clear error."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import moe as M

    op = torch.ops.jitmarlin.moe_gemm
    args = list(_meta_down_args(block=24))
    assert op(*args).shape == (128, 256)
    args[-1] = 20
    with pytest.raises(ValueError, match="block_size=20 must be one of"):
        op(*args)
    ids = torch.randint(0, 8, (37, 2))
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, 24, 8)
    assert int(num_padded) % 24 == 0 and sorted_ids.numel() == 74 + 8 * 23
    names = [n for n, _ in K.wgmma_build_spec(K.Family("f16", 4, False, 128, moe=True), (9, 0)).sources]
    assert "jm_wgmma_f16_u4b8_g128_moe_n24_f1_s6_prod_c4" in names  # 4-bit: four CTAs per SM, 8-bit three
    u8 = [n for n, _ in K.wgmma_build_spec(K.Family("bf16", 8, True, 64, moe=True), (9, 0)).sources]
    assert "jm_wgmma_bf16_u8_g64_moe_n24_f1_s6_prod_c3" in u8
    assert M.wgmma_prod_moe_config(24) == (24, 1, 6) and K.prod_ctas((24, 1, 6)) == 3
    # blocks of 16 (session 34): the producer form in 4-bit MoE families only, at four CTAs per SM
    assert "jm_wgmma_f16_u4b8_g128_moe_n16_f1_s6_prod_c4" in names and not any("_n16_" in n for n in u8)
    assert M.wgmma_prod_moe_config(16) == (16, 1, 6) and M.wgmma_prod_moe_config(16, 1, 8) is None
    assert K.prod_ctas((16, 1, 6), 4, moe=True) == 4 and 16 in M.MOE_WGMMA_PROD_BLOCKS
    dense = [n for n, _ in K.wgmma_build_spec(K.Family("f16", 4, False, 128), (9, 0)).sources]
    assert not any("_n16_f1_s6_prod" in n for n in dense)
    assert K.prod_ctas((24, 1, 6), 4) == 4 and K.prod_ctas((24, 1, 6), 8) == 3 and K.prod_ctas((32, 1, 6), 4) == 3
    assert 24 in M.MOE_WGMMA_PROD_BLOCKS
    # the rule: experts above 2^24 weights at 12-17 rows per expert (Mixtral 48-70 tokens), with large blocks
    mixtral_kn = 4096 * 28672
    assert [M.choose_block_size(t, 2, 8, True, mixtral_kn) for t in (40, 44, 48, 56, 64, 68, 72)] == \
        [16, 16, 24, 24, 24, 24, 32]
    assert M.choose_block_size(64, 2, 8, True, mixtral_kn, prod_blocks=False) == 32
    # small experts (K*N <= 2^24, 4-bit): blocks of 24 at 9-19 rows per expert too (small_block24, session 33), on
    # the producer form only; 8-bit keeps 32
    assert M.choose_block_size(64, 2, 8, True, 2048 * 2816) == 24
    assert M.choose_block_size(64, 2, 8, True, 2048 * 2816, prod_blocks=False) == 32
    assert M.choose_block_size(64, 2, 8, True, 2048 * 2816, bits=8) == 32
    assert M.choose_block_size(64, 2, 8) == 32  # the mma.sync choice never takes 24


def test_small_blocks_of_16_host_rules(monkeypatch):
    """Small 4-bit experts' blocks of 16 on the producer form (moe.WGMMA_16_ROWS_SMALL_U4, on since session 37):
    off ((0, 0)) the 8 / 24 rules hold; with the default range, blocks of 16 at its rows per expert when the
    producer form may take them (prod_blocks), 8-bit and large experts untouched, and fused_marlin_moe gathers
    both inputs for them."""
    from jitmarlin.ops import moe as M

    e64 = 2048 * 2816  # E=64 top-6 gate/up experts (K*N <= 2^24)
    assert M.WGMMA_16_ROWS_SMALL_U4 == (7.8, 13.0)
    monkeypatch.setattr(M, "WGMMA_16_ROWS_SMALL_U4", (0.0, 0.0))
    rule = [M.choose_block_size(t, 6, 64, True, e64) for t in (72, 88, 96, 104, 120, 128, 144)]
    assert rule == [8, 8, 8, 24, 24, 24, 24]
    monkeypatch.setattr(M, "WGMMA_16_ROWS_SMALL_U4", (7.8, 13.0))
    assert [M.choose_block_size(t, 6, 64, True, e64) for t in (72, 88, 96, 104, 120, 128, 144)] == \
        [8, 16, 16, 16, 16, 16, 24]
    assert M.choose_block_size(96, 6, 64, True, e64, prod_blocks=False) == 8  # (no producer form: the 8 rule)
    assert M.choose_block_size(96, 6, 64, True, e64, bits=8) != 16
    assert M.choose_block_size(36, 2, 8, True, 4096 * 28672) == 16  # large experts: the cover rule's, as before
    assert M.small_block16(9.0, e64) and not M.small_block16(9.0, e64, bits=8) and not M.small_block16(9.0, 1 << 26)
    # fused_marlin_moe: blocks of 16 in that range gather both inputs (the producer route stood in for)
    calls = []

    class Stop(Exception):
        pass

    def fake_gather(x, sorted_ids, expert_ids, num_padded, perm, top_k, block):
        calls.append(("gather", block))
        raise Stop

    def fake_gemm(a, *args):
        calls.append(("gemm", args[9]))  # block_size
        raise Stop

    monkeypatch.setattr(M, "_prod_route", lambda *a: True)
    monkeypatch.setattr(M, "gather_by_position", fake_gather)
    monkeypatch.setattr(M, "moe_gemm", fake_gemm)
    e, h, inter, top_k, t = 8, 256, 128, 2, 36  # 9 rows per expert: the plain rule's 16 too
    w13 = torch.zeros(e, 2 * inter // 64, h // 16, 128, dtype=torch.int32)
    w2 = torch.zeros(e, h // 64, inter // 16, 128, dtype=torch.int32)
    s13, s2 = torch.zeros(e, 2, 2 * inter, dtype=torch.float16), torch.zeros(e, 1, h, dtype=torch.float16)
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(t)])
    for rng, want in (((7.8, 13.0), ("gather", 16)), ((0.0, 0.0), ("gemm", 16))):
        monkeypatch.setattr(M, "WGMMA_16_ROWS_SMALL_U4", rng)
        calls.clear()
        with pytest.raises(Stop):
            M.fused_marlin_moe(torch.zeros(t, h, dtype=torch.float16), w13, s13, w2, s2, torch.ones(t, top_k), ids)
        assert calls == [want], (rng, calls)
    # where the producer form cannot take them (wgmma kernels usable, producer route not): the rule without it,
    # here (9 rows per expert, below WGMMA_24_ROWS_SMALL_U4) blocks of 8, not the mma.sync kernel's 16 (the GPU
    # run of session 37 caught that fallback)
    monkeypatch.setattr(M, "WGMMA_16_ROWS_SMALL_U4", (7.8, 13.0))
    monkeypatch.setattr(M, "_prod_route", lambda *a: False)
    monkeypatch.setattr(M, "_large_blocks_ok", lambda *a: True)
    monkeypatch.setattr(M, "_expert_family", lambda *a: None)
    want = M.choose_block_size(t, top_k, e, True, 2 * inter * h, prod_blocks=False)
    assert want == 8 and M.choose_block_size(t, top_k, e) == 16
    calls.clear()
    with pytest.raises(Stop):
        M.fused_marlin_moe(torch.zeros(t, h, dtype=torch.float16), w13, s13, w2, s2, torch.ones(t, top_k), ids)
    assert calls == [("gemm", want)], calls


def test_moe_gemm_silu_op_shapes_and_host_rules(monkeypatch):
    """moe_gemm_silu (the gate/up GEMM with SiLU-mul in its epilogue): torch.compile's view of it is the
    down projection's input by position, [L, I] in the activation dtype (L = the slot list's length, I half
    the GEMM's N); CPU tensors are a clear error; silu_epilogue_ok declines what the epilogue cannot take
    (CPU or meta tensors, zero points, four strips per CTA, a block size off the producer form)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from jitmarlin.ops import moe as M

    e, h, inter, slots, block = 8, 256, 512, 96, 32
    L = slots + e * (block - 1)

    def args(device, dtype=torch.float16):
        return (torch.empty(L, h, dtype=dtype, device=device),
                torch.empty(e, 2 * inter // 64, h // 16, 128, dtype=torch.int32, device=device),
                torch.empty(e, h // 128, 2 * inter, dtype=dtype, device=device),
                torch.empty(L, dtype=torch.int32, device=device),
                torch.empty(-(-L // block), dtype=torch.int32, device=device),
                torch.empty(1, dtype=torch.int32, device=device), slots, 2, block)

    with FakeTensorMode():
        for dtype in (torch.float16, torch.bfloat16):
            out = torch.ops.jitmarlin.moe_gemm_silu(*args("cuda", dtype))
            assert tuple(out.shape) == (L, inter) and out.dtype == dtype
        bad = list(args("cuda"))
        bad[2] = torch.empty(e, h // 128, 2 * inter, dtype=torch.bfloat16, device="cuda")  # scales' dtype
        with pytest.raises(ValueError, match="expert scales"):
            torch.ops.jitmarlin.moe_gemm_silu(*bad)
    cpu = args("cpu")
    with pytest.raises(ValueError, match="run on CUDA tensors"):
        torch.ops.jitmarlin.moe_gemm_silu(*cpu)
    a, b, s = cpu[:3]
    assert not M.silu_epilogue_ok(a, b, s, None, slots, block)  # CPU
    # on a CUDA device that takes the producer form (stood in for: the device rule is _use_wgmma_moe's):
    asked = []
    monkeypatch.setattr(M, "_use_wgmma_moe", lambda bs, n, k, fam, index, per_expert=None, by_position=False:
                        asked.append((bs, n, k, fam.zero_points, by_position)) or True)
    monkeypatch.setattr(M.K, "cuda_index", lambda device: 0)
    import warnings

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (FakeTensor.data_ptr: the alignment rule reads 0 here)
        a, b, s = args("cuda")[:3]
        assert M.silu_epilogue_ok(a, b, s, None, slots, block)
        assert asked == [(block, 2 * inter, h, False, True)]
        zeros = torch.empty(e, h // 128, 2 * inter // 8, dtype=torch.int32, device="cuda")
        assert not M.silu_epilogue_ok(a, b, s, zeros, slots, block)  # zero points
        assert not M.silu_epilogue_ok(a, b, s, None, slots, 64)  # blocks of 64: the plain form
        monkeypatch.setattr(M, "MOE_WGMMA_PROD_FW", 2)  # four strips per CTA
        assert not M.silu_epilogue_ok(a, b, s, None, slots, block)
        assert len(asked) == 1
    schema = {x.name for x in torch.ops.jitmarlin.moe_gemm_silu.default._schema.arguments}
    assert "zeros" not in schema and "topk_weights" not in schema  # the epilogue takes neither
