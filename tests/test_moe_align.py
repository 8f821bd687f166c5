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
    """With the wgmma MoE kernel (sm_90): blocks of 64 rows from 14 rows per expert on average,
    of 128 from 48; never without large_blocks; CPU tensors never ask for them."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import moe as M

    assert choose_block_size(1024, 2, 8, True) == M.WGMMA_BLOCK  # 256 rows per expert
    assert choose_block_size(192, 2, 8, True) == M.WGMMA_BLOCK  # 48
    assert choose_block_size(191, 2, 8, True) == 64
    assert choose_block_size(64, 2, 8, True) == 64  # 16 rows: the wgmma kernel's blocks of 64
    assert choose_block_size(64, 2, 8) == 32  # (the mma.sync kernel's choice)
    assert choose_block_size(16, 2, 8, True) == 8 and choose_block_size(64, 6, 64, True) == 8  # 4, 6 rows
    assert choose_block_size(1024, 2, 8) == 64 and choose_block_size(100000, 8, 8) == 64
    fam = K.Family("f16", 4, False, 128, moe=True)
    assert not M._large_blocks_ok(torch.zeros(4, 1024), ((1024, 512, fam), (512, 512, fam)))
    b, s = torch.zeros(8, 16, 64, 128, dtype=torch.int32), torch.zeros(8, 8, 1024, dtype=torch.float16)
    assert M._expert_family(torch.zeros(4, 1024, dtype=torch.float16), b, s, None) == fam
    assert M._expert_family(torch.zeros(4, 1024), b, s, None) is None  # fp32: moe_gemm raises the error
