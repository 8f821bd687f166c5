"""Quantized mixture-of-experts: token routing to blocks, the MoE GEMM, and the fused layer.

The MoE GEMM is the dense GEMM template compiled with MOE=true (jitmarlin/ops/_kernels.py): each
m tile of `block_size` rows belongs to one expert; A rows are gathered through the sorted
(token, k) slot ids (token = slot // top_k), and output row = slot id, so the caller gets
[T * top_k, N] in slot order. Shape tags: T tokens, E experts, k = top_k, H hidden, I
intermediate, L = T*k + E*(B-1) padded slots (upper bound), B block size.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import _kernels as K
from ._kernels import DTYPES, Family
from .gemm import check_perm_values, launch_params, prepare_launch

BLOCK_SIZES = (8, 16, 32, 48, 64)
# Blocks of 24, 80 and 96 rows: the sm_90a wgmma kernel's producer form only (m64nNTk16 on inputs
# gathered by position), where its (NT, FW, STAGES) config is built (K.WGMMA_MOE_PROD_CONFIGS); blocks of
# 48 take it there too (with A gathered by position), else the mma.sync kernel's 48-row tile. (Blocks of
# 40 / 56 / 72, Humming's sizes, were probe-only in session 28: 72 led by 2-3% at Mixtral and E=64 512
# tokens in one draw each, lost at 1024, 40 / 56 lost everywhere; never routed, so removed: commit 10ec672
# has them, NOTES.md session 28 the numbers.)
PROD_ONLY_BLOCKS = (24, 80, 96)
# On sm_90 the wgmma MoE kernel (blocks of 64 or 128 rows) costs less than the mma.sync kernel's
# blocks of 32-64 even when half the rows are padding. H200, 2026-11-30 (benchmarks/NOTES.md, "MoE
# block sizes"): Mixtral at 64 tokens (16 rows per expert) blocks of 64 452 us vs 32 534; at 256
# tokens (64 rows) blocks of 128 694 vs 64 800; E=64 top-6 at 256 tokens (24 rows) 64 238 vs 32
# 349; at 1024 tokens (96 rows) 128 385 vs 64 502; below ~8 rows blocks of 8 stay fastest.
WGMMA_BLOCK = 128
WGMMA_64_MIN_ROWS = 14  # rows per expert (average) from which blocks of 64, when the wgmma kernel runs both GEMMs
# Blocks of 32 on the wgmma kernel (32-token tiles, session 13; NOTES.md "token tiles of 16 and
# 32"), by rows per expert (average): Mixtral 64 / 80 tokens (16 / 20 rows) 415 / 419 us vs 448 /
# 450 with blocks of 64, but 96 tokens (24 rows) 474 vs 448; E=64 top-6 (experts of 2048 x 1408)
# 96-256 tokens (9-24 rows) 150 / 156 / 161 / 165 / 183 vs 158 / 164 / 229 / 234 / 241.
WGMMA_32_ROWS = (14, 22)  # [lo, hi) rows per expert ...
WGMMA_32_ROWS_SMALL = (9, 25)  # ... or this range for experts of K*N <= WGMMA_32_SMALL_KN
WGMMA_32_SMALL_KN = 1 << 24
# 4-bit small experts keep blocks of 32 (the producer form at four CTAs per SM, K.WGMMA_PROD_CTAS_MOE_U4) below
# this many rows per expert, where small_cover's blocks of 48 take over (8-bit: WGMMA_32_ROWS_SMALL's end). Experts
# past 32 rows take a second block, which streams their small weights again; up to ~29.5 rows that costs less than
# the 48-row tiles' work. H200 session 33 (probe_moe_tiles --block, E=64 top-6 layer us, one draw per token count,
# two timings each, 48 (the rule then) / 32): 272 tokens (25.5 rows) 184.3, 186.3 / 171.1, 172.0; 288 (27) 186.4,
# 186.5 / 169.2, 167.6; 296 (27.75) 265.0, 265.0 / 177.1, 177.9 (an expert past 48 rows in that draw); 304 (28.5)
# 185.8, 185.7 / 177.9, 178.0; 312 (29.25) 190.0, 188.6 / 184.4, 185.6; 320 (30) 189.1, 190.3 / 195.7, 195.4; 352
# (33) 191.4, 193.4 / 217.1, 218.4. bf16 288: 269.7, 269.0 / 178.4, 178.8.
WGMMA_32_SMALL_U4_HI = 29.5
# ... and blocks of 24 (the producer form at four CTAs per SM) in this range of rows per expert (less padding than
# 32 where few experts pass 24 rows), blocks of 8 (the mma.sync kernel) below it. H200 session 33 (probe_moe_tiles,
# E=64 top-6 layer us, two timings each; more in benchmarks/NOTES.md session 33), 32 / 24: 96 tokens (9 rows)
# 148.8, 148.3 / 142.9, 141.3; 128 (12) 149.5, 150.4 / 143.0, 143.4; 160 (15) 153.3, 151.2 / 144.6, 144.6; 192 (18)
# 153.4, 154.0 / 150.7, 151.2; 208 (19.5) 156.0, 154.9 / 156.2, 156.2; 224 (21) 156.8, 155.3 / 175.9, 176.0; 256
# (24) 163.9, 164.5 / 195.3, 196.1; bf16 128 152.9, 153.1 / 148.2, 147.4. 24 / 8: 80 (7.5; the mma.sync rule's 16
# there: 145.8) 139.3, 139.3 / 122.0, 123.1; 96 141.5, 141.4 / 136.7, 136.8; 112 (10.5) 142.2, 142.6 / 153.1,
# 153.4; 128 142.8, 143.8 / 167.4, 167.9.
WGMMA_24_ROWS_SMALL_U4 = (9.5, 19)
# ... and blocks of 16 (the producer form's m64n16k16 at four CTAs per SM, both inputs gathered) in this range of
# rows per expert, ahead of the 8 / 24 rules above. H200 session 37 (probe_moe_tiles, E=64 top-6 layer us, two
# interleaved draws each, after the wgmma stage loop was unrolled over its ring), the 8 / 24 rule / blocks of 16,
# f16: 80 tokens (7.5 rows) 121.6, 122.1 / 122.4, 122.1; 88 (8.25) 129.5, 129.9 / 120.9, 120.8; 96 135.8, 135.4 /
# 122.7, 122.5; 104 136.9, 135.8 / 120.3, 119.9; 112 137.1, 135.7 / 123.7, 124.2; 120 136.5, 136.3 / 120.7, 121.0;
# 128 (12) 136.6, 136.5 / 126.9, 127.3; 136 (12.75) 136.8, 136.8 / 132.4, 132.9; 144 (13.5) 138.9, 137.6 / 138.1,
# 138.0. bf16: 80 131.7 / 131.5; 88 138.2 / 131.9; 96 146.1 / 133.7; 104 142.5 / 131.8; 112 142.3 / 135.4; 120
# 142.1 / 139.8; 128 142.3 / 140.9; 136 142.6 / 144.6 (+1.4%, where f16 gains 3%); 144 level. (Session 35, before
# the unrolled ring: 88-128 tokens 4-11% faster too.)
WGMMA_16_ROWS_SMALL_U4 = (7.8, 13.0)


def wgmma_block32(per_expert: float, kn: int, bits: int = 4) -> bool:
    """Whether blocks of 32 rows go to the wgmma kernel at `per_expert` rows per expert (average)
    for experts of K*N = kn with `bits`-bit weights (the shape rule only; the device and switch:
    _use_wgmma_moe)."""
    if kn <= WGMMA_32_SMALL_KN:
        lo, hi = WGMMA_32_ROWS_SMALL[0], WGMMA_32_SMALL_U4_HI if bits == 4 else WGMMA_32_ROWS_SMALL[1]
    else:
        lo, hi = WGMMA_32_ROWS
    return lo <= per_expert < hi


# Below this many rows per expert the mma.sync kernel's blocks of 16 beat the producer form's blocks of 24
# (H200 session 26, Mixtral layer us, blocks of 16 / 24 at three CTAs per SM: 40 tokens (10 rows) 296.9 /
# 306.2, 48 (12) 300.4 / 309.7; 56 (14) 335.7 / 317.7). Session 28, blocks of 24 at four CTAs per SM (4-bit,
# K.WGMMA_PROD_CTAS_U4): 48 tokens 297.7 / 301.6 in two rounds against blocks of 16 at 328.6 / 328.8 in
# that draw (an expert past 16 rows streams its weights twice; 24 rows hold r + 3.5 sd at 12 rows): 12.
WGMMA_COVER_MIN_ROWS = 12

# Blocks that cover the expected largest experts: each expert's row count is binomial (mean r = T*k/E,
# standard deviation sqrt(r (1 - k/E))), and an expert past its block takes a second block that streams
# its weights again, so the wgmma kernel's blocks must hold r + WGMMA_COVER_Z standard deviations. On
# experts above WGMMA_32_SMALL_KN weights from WGMMA_COVER_MIN_ROWS rows per expert: the smallest block of
# WGMMA_COVER_BLOCKS that does (24, 32, 48, 80, 96, all on the producer form; 64, the plain form, measured
# level in session 27 and left the list in session 32, below), else 128. Elsewhere (smaller experts, or where
# the producer form cannot run): 128 where 64 does not cover, else the rules below. H200 session 27
# (probe_moe_tiles, Mixtral layer us by block size; each token count one routing draw, a probe's token list
# decides the draw): 96 tokens (24 rows per expert)
# 32: 573.7 / 48: 411.9 in one draw, 32: 332.6 / 48: 417.9 in another (92 tokens 333.9 / 412.8; 84 and
# 88 tokens 336.8 / 416.1 and 338.7 / 413.1): blocks of 32 win unless an expert overflows them, which
# then costs about three times what they save; 128 (32 rows) 48: 423.9 (32: 855.9, 64: 465.7), 160 (40)
# 48: 482.9, 64: 479.9, 80: 474.5, 192 (48) 64: 490.4, 80: 492.4 (the rule then, 128: 649.2), 224 (56)
# 80: 525.4, 64: 561.4, 256 (64) 80: 546.1, 96: 558.7, 288 (72) 96: 569.5, 128: 719.4, 320 (80) 96:
# 606.3, 542.3 and (the rule's pick in a third draw) 760.3, 128: 665.1 and 732.1; 384 (96) 128: 745.0,
# 96: 766.9. Z = 1.75 takes the faster block in expectation at each (at 24 rows the chance that one of
# Mixtral's 8 experts passes 32 rows is ~17%, at 26 rows ~45%; session 26: 18 rows 24: 350.5-357.6, 32:
# 334.4). E=64 top-6 (2048 x 2816 experts) 512 tokens (48 rows) 64 plain: 260.4, 128: 299.1 (80 on the
# producer form 261.1), 768 (72) 128: 310.9, 96 on the producer form: 307.1, 1024 (96) 128: 327.3 (on
# the producer form 367.6).
# Session 32 (the producer form's blocks of 48 at three CTAs per SM since then; probe_moe_tiles --block, two
# timings each, one draw per token count, us, 48 / 64 / 80): 160 tokens (40 rows) 424.0, 442.5 / 508.3, 503.4 /
# 443.8, 457.0; 176 437.5, 436.0 / 509.4, 502.0 / 461.6, 479.4; 192 588.6, 582.1 / 507.4, 512.6 / 448.6, 511.4;
# 208 714.2, 735.3 / 522.7, 529.3 / 493.2, 500.0 — the plain form's 64 now the slowest that covers, so it left
# WGMMA_COVER_BLOCKS (Mixtral 155-211 tokens take 80; 48 where no expert overflows it, as in these draws at
# 160 / 176, but an overflow costs 30-45% at 192 / 208).
WGMMA_COVER_Z = 1.75
WGMMA_COVER_BLOCKS = (24, 32, 48, 80, 96)
# Past one block of 128 per expert (covered rows above 128), several blocks of 96 rows per expert on the
# producer form. Measured (session 28, probe_moe_tiles, Mixtral layer us, blocks 80 / 96 / 128): 512 tokens
# 1102 / 1155 / 1130, 768 1670 / 1519 / 1620, 1024 2235 / 1913 / 2002 (blocks of 56 / 72: 1351 / 1074 at
# 512, 2452 / 2288 at 1024). The fewest-padded-rows choice among 80 / 96 / 128 (the prepared rule) took 80
# at 768 tokens, which lost; 96 wins or ties at each point within the run's ~5% noise. (The multi-block
# time is tensor-bound: the prepared estimate of ~0.53 us per padded row from 384 tokens did not hold.)
WGMMA_MULTI_BLOCK = 96
# Small experts (K*N <= WGMMA_32_SMALL_KN, e.g. E=64 top-6's 2048 x 2816) past wgmma_block32's range take the
# cover rule too, on the producer form only (blocks of WGMMA_COVER_SMALL_BLOCKS; the plain form's 64 lost there),
# with both inputs gathered, while the covered rows fit a block of 96; past that the rule below (128 on the plain
# form: the producer form lost at 96 rows per expert in session 27). H200 session 31 (probe_moe_tiles, E=64 top-6
# layer us, two rounds, the rule then / blocks of 48 / 80 on the producer form): 288 tokens (27 rows per expert)
# 242.1, 248.5 / 198.1, 200.2 / 223.4, 223.3; 320 (30) 244.6, 246.0 / 199.3, 201.0 / 223.6, 225.6; 352 (33)
# 247.3, 248.0 / 202.0, 201.8 / 225.5; 384 (36) 248.5, 249.8 / 201.9, 204.2 / 224.8, 226.6; 448 (42) 256.8,
# 256.6 / 233.4, 233.6 / 230.7, 228.6; 512 (48) 281.5, 280.4 / 280.7, 279.6 / 232.5, 231.3. At 256 tokens (24
# rows) blocks of 32 stay (plain 168.8, on the producer form 167.4; 48: 187-196).
WGMMA_COVER_SMALL_MIN_ROWS = 25
WGMMA_COVER_SMALL_BLOCKS = (48, 80, 96)


def _small_u4(expert_kn: int, bits: int) -> bool:
    """Experts of K*N = expert_kn <= WGMMA_32_SMALL_KN (the first GEMM's) with 4-bit weights."""
    return bits == 4 and expert_kn <= WGMMA_32_SMALL_KN


def small_block16(per_expert: float, expert_kn: int, bits: int = 4) -> bool:
    """Whether small 4-bit experts (_small_u4) at per_expert rows per expert take the producer form's blocks of 16
    (WGMMA_16_ROWS_SMALL_U4; both inputs gathered)."""
    lo, hi = WGMMA_16_ROWS_SMALL_U4
    return _small_u4(expert_kn, bits) and lo <= per_expert < hi


def small_block24(per_expert: float, expert_kn: int, bits: int = 4) -> bool:
    """Whether small 4-bit experts (_small_u4) at per_expert rows per expert take the producer form's blocks of 24
    (WGMMA_24_ROWS_SMALL_U4; both inputs gathered)."""
    lo, hi = WGMMA_24_ROWS_SMALL_U4
    return _small_u4(expert_kn, bits) and lo <= per_expert < hi


def covered_rows(per_expert: float, top_k: int, num_experts: int) -> float:
    """Rows per expert a block should hold: the mean plus WGMMA_COVER_Z binomial standard deviations."""
    return per_expert + WGMMA_COVER_Z * math.sqrt(per_expert * max(0.0, 1.0 - top_k / max(1, num_experts)))


def small_cover(per_expert: float, top_k: int, num_experts: int, expert_kn: int, bits: int = 4) -> bool:
    """Whether experts of K*N = expert_kn (the first GEMM's) of `bits`-bit weights at per_expert rows per expert
    take the small-expert cover rule (from WGMMA_COVER_SMALL_MIN_ROWS rows, 4-bit from WGMMA_32_SMALL_U4_HI if
    that is more): producer-form blocks, both inputs gathered."""
    lo = max(WGMMA_COVER_SMALL_MIN_ROWS, WGMMA_32_SMALL_U4_HI) if bits == 4 else WGMMA_COVER_SMALL_MIN_ROWS
    return (expert_kn <= WGMMA_32_SMALL_KN and per_expert >= lo
            and covered_rows(per_expert, top_k, num_experts) <= WGMMA_COVER_SMALL_BLOCKS[-1])


def choose_block_size(num_tokens: int, top_k: int, num_experts: int, large_blocks: bool = False,
                      expert_kn: int = 1 << 30, prod_blocks: bool = True, bits: int = 4) -> int:
    """Rows per expert block (= the kernel's m tile): the first B with T*k/E/B < 0.9, else 64.
    Small blocks waste few padded rows at small batch; large ones reuse weights at large batch.
    With large_blocks (the wgmma MoE kernel runs both GEMMs): on experts of K*N = expert_kn (the first
    GEMM's) above WGMMA_32_SMALL_KN from WGMMA_COVER_MIN_ROWS rows per expert the smallest block of
    WGMMA_COVER_BLOCKS that holds covered_rows, else 128 (unless not prod_blocks: the producer form
    cannot take them); on smaller experts where small_cover says so, the smallest of
    WGMMA_COVER_SMALL_BLOCKS that holds them; elsewhere 128 where 64 does not cover, on 4-bit small experts 8
    below WGMMA_24_ROWS_SMALL_U4 (16 where small_block16 says so, producer form only) and 24 where small_block24
    says so (producer form only), 32 where wgmma_block32
    says so, 64 from WGMMA_64_MIN_ROWS. `bits`: of the expert weights (small_cover, small_block24,
    wgmma_block32)."""
    per_expert = num_tokens * top_k / max(1, num_experts)
    if large_blocks:
        cover = covered_rows(per_expert, top_k, num_experts)
        if prod_blocks and expert_kn > WGMMA_32_SMALL_KN and per_expert >= WGMMA_COVER_MIN_ROWS:
            if cover > WGMMA_BLOCK:
                return WGMMA_MULTI_BLOCK
            return next((b for b in WGMMA_COVER_BLOCKS if b >= cover), WGMMA_BLOCK)
        if prod_blocks and small_cover(per_expert, top_k, num_experts, expert_kn, bits):
            return next(b for b in WGMMA_COVER_SMALL_BLOCKS if b >= cover)
        if cover > 64:
            return WGMMA_BLOCK
    if large_blocks and prod_blocks and small_block16(per_expert, expert_kn, bits):
        return 16
    if large_blocks and _small_u4(expert_kn, bits) and per_expert < WGMMA_24_ROWS_SMALL_U4[0]:
        return 8
    if large_blocks and prod_blocks and small_block24(per_expert, expert_kn, bits):
        return 24
    if large_blocks and wgmma_block32(per_expert, expert_kn, bits):
        return 32
    if large_blocks and per_expert >= WGMMA_64_MIN_ROWS:
        return 64
    for b in BLOCK_SIZES:
        if per_expert / b < 0.9:
            return b
    return BLOCK_SIZES[-1]


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """Sort the (token, k) slots by expert and pad every expert's run to a multiple of
    block_size, on the device (no host synchronisation, CUDA-graph capturable).

    topk_ids: [T, k] integer expert ids in [0, E).
    Returns (sorted_ids int32 [L], expert_ids int32 [ceil(L/B)], num_padded int32 [1]) where
    L = T*k + E*(B-1); padding slots hold the sentinel T*k; blocks past num_padded have expert
    id E-1 (they are never read).
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if block_size <= 0 or num_experts <= 0:
        raise ValueError(f"block_size={block_size} and num_experts={num_experts} must be positive")
    if topk_ids.is_cuda and use_moe_kernels():
        return _align_cuda(topk_ids, block_size, num_experts)
    return _align_torch(topk_ids, block_size, num_experts)


def use_moe_kernels() -> bool:
    """Our align and SiLU-mul kernels instead of torch ops (on by default; JITMARLIN_MOE_KERNELS=0
    turns them off). On the H200 they took the Mixtral MoE at 1 token from 129 to 83 us (graph) and
    622 to 209 us eager."""
    return K.env_flag("JITMARLIN_MOE_KERNELS", default=True)


def _align_cuda(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    dev = topk_ids.device
    index = K.cuda_index(dev)
    from .gemm import _cc, use_pdl

    ids = topk_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    ids = ids.contiguous()
    numel = ids.numel()
    max_len = numel + num_experts * (block_size - 1)
    blocks = -(-max_len // block_size)
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    p = K.MoeParams()
    p.ids, p.sorted_ids, p.expert_ids, p.num_padded = ids.data_ptr(), sorted_ids.data_ptr(), expert_ids.data_ptr(), \
        num_padded.data_ptr()
    p.numel, p.num_experts, p.block, p.max_len, p.blocks = numel, num_experts, block_size, max_len, blocks
    p.ids_64 = int(ids.dtype == torch.int64)
    fn = K.get_moe_util_kernel("jm_moe_align", index, _cc(index))
    fn.launch(1, 1024, _align_smem_bytes(numel, num_experts), K.current_stream_handle(dev), p,
              pdl=use_pdl(_cc(index)))
    return sorted_ids, expert_ids, num_padded


ALIGN_PARALLEL_MIN_SLOTS = 256  # from here the 32 warps place their own chunks of slots (jm_moe_align)
_ALIGN_SMEM_MAX = 48 * 1024     # dynamic shared memory without the opt-in attribute


def _align_smem_bytes(numel: int, num_experts: int) -> int:
    """Dynamic shared memory of jm_moe_align: counts and starts (8 bytes per expert), plus a table of
    32 per-warp counts per expert when the slots are many enough that placing them by one warp (a
    serial loop of 32 slots per step) costs more than the per-warp table's prefix (H200 session 23:
    E=64 top-6 at 64 tokens, 384 slots) and the table fits. The kernel reads which from its launch."""
    parallel = 4 * (2 + 32) * num_experts
    if numel >= ALIGN_PARALLEL_MIN_SLOTS and parallel <= _ALIGN_SMEM_MAX:
        return parallel
    return 8 * num_experts


def _launch_chunked(name: str, x: torch.Tensor, rows: int, cols: int, top_k: int = 0, dtype: torch.dtype | None = None,
                    **fields) -> torch.Tensor:
    """y [rows, cols] = one of our elementwise MoE kernels (jm_<name>_f16 / _bf16) on x: one thread
    per 8-value chunk (jm_moe_util.cuh, chunk_of_thread); `fields`: more JmMoeParams fields. A
    programmatic dependent of the kernel before it when its grid is small (the rule of the act-order
    gather: a large grid parked beside a running GEMM costs more than it saves)."""
    from .gemm import _cc, gather_pdl, use_pdl

    dtype = x.dtype if dtype is None else dtype
    y = torch.empty(rows, cols, dtype=dtype, device=x.device)
    if rows == 0:
        return y
    index = K.cuda_index(x.device)
    p = K.MoeParams()
    p.x, p.y, p.rows, p.inter, p.top_k = x.data_ptr(), y.data_ptr(), rows, cols, top_k
    for key, value in fields.items():
        if not hasattr(K.MoeParams, key):  # a ctypes Structure would take a misspelt name silently
            raise TypeError(f"JmMoeParams has no field {key!r}")
        setattr(p, key, value)
    fn = K.get_moe_util_kernel(f"jm_{name}_{'bf16' if dtype == torch.bfloat16 else 'f16'}", index, _cc(index))
    grid = -(-(rows * (cols // 8)) // 256)
    fn.launch(grid, 256, 0, K.current_stream_handle(x.device), p, pdl=use_pdl(_cc(index)) and gather_pdl(grid))
    return y


ROUTE_MAX_EXPERTS = 512  # jm_moe_route: 16 logits per lane of one warp (kRouteMaxPerLane)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE routing: softmax of the logits [T, E] in fp32 over all experts, the top_k, divided by
    their sum when renormalize. Returns (weights fp32 [T, k], ids [T, k]): on CUDA one kernel of ours
    (jm_moe_route, int32 ids; unless JITMARLIN_MOE_KERNELS=0 or JITMARLIN_MOE_ROUTE=0, E > ROUTE_MAX_EXPERTS
    or top_k > 32), else torch ops (int64 ids), the reference."""
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"route_topk: logits must be [tokens, experts] with 1 <= top_k <= experts, got "
                         f"{tuple(logits.shape)} and top_k={top_k}")
    t, e = logits.shape
    if not (logits.is_cuda and use_moe_kernels() and logits.dtype in DTYPES and e <= ROUTE_MAX_EXPERTS
            and top_k <= 32 and logits.is_contiguous() and K.env_flag("JITMARLIN_MOE_ROUTE", default=True)):
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    return _route_cuda(logits, top_k, renormalize)


def _route_cuda(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_topk by jm_moe_route (the caller has checked the kernel's conditions)."""
    from .gemm import _cc, use_pdl

    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    index = K.cuda_index(logits.device)
    p = K.MoeParams()
    p.x, p.y, p.route_ids = logits.data_ptr(), weights.data_ptr(), ids.data_ptr()
    p.rows, p.num_experts, p.top_k, p.renorm = t, e, top_k, int(renormalize)
    fn = K.get_moe_util_kernel(f"jm_moe_route_{DTYPES[logits.dtype]}", index, _cc(index))
    fn.launch(-(-t * 32 // 256), 256, 0, K.current_stream_handle(logits.device), p, pdl=use_pdl(_cc(index)))
    return weights, ids


def silu_mul(c1: torch.Tensor, inter: int) -> torch.Tensor:
    """SiLU(c1[:, :inter]) * c1[:, inter:], one kernel on CUDA (unless JITMARLIN_MOE_KERNELS=0)."""
    if not (c1.is_cuda and use_moe_kernels() and inter % 8 == 0 and c1.is_contiguous()):
        return F.silu(c1[:, :inter]) * c1[:, inter:]
    return _launch_chunked("silu_mul", c1, c1.shape[0], inter)


def topk_sum(c3: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """c3 [T*k, H] -> [T, H], the sum over each token's k slots (fp32 accumulation in slot order,
    one rounding), one kernel of ours on CUDA that launches as a programmatic dependent of the
    expert GEMM before it (unless JITMARLIN_MOE_KERNELS=0: torch's sum). c3 fp32 [S, T*k, H] (the
    expert GEMM split along K, moe_gemm_ready_tables with k_splits = S): the sum over the S partial
    sums too, rounded once to dtype."""
    if c3.dim() == 3:
        if c3.dtype != torch.float32 or dtype is None:
            raise ValueError(f"topk_sum of K-split partial sums needs fp32 [S, T*k, H] and an output dtype, got "
                             f"{c3.dtype} {tuple(c3.shape)}, dtype={dtype}")
        s, _, h = c3.shape
        if not (c3.is_cuda and use_moe_kernels() and h % 8 == 0 and c3.is_contiguous()):
            return c3.view(s, tokens, top_k, h).sum((0, 2)).to(dtype)
        return _launch_chunked("topk_sum_f32", c3, tokens, h, top_k, dtype=dtype, splits=s)
    h = c3.shape[1]
    if not (c3.is_cuda and use_moe_kernels() and h % 8 == 0 and c3.is_contiguous()) or top_k == 1:
        return c3.view(tokens, top_k, h).sum(1)
    return _launch_chunked("topk_sum", c3, tokens, h, top_k)


def _align_torch(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """The reference (CPU, and CUDA by default): torch ops only."""
    dev = topk_ids.device
    with torch.cuda.device(dev) if dev.type == "cuda" else _null():
        flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k] expert of each slot
        numel = flat.numel()
        max_len = numel + num_experts * (block_size - 1)
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, flat.clamp(0, num_experts), torch.ones_like(flat))  # id >= E lands in a spare bin
        counts = counts[:num_experts]
        padded = (counts + block_size - 1) // block_size * block_size
        pad_end = torch.cumsum(padded, 0)
        pad_start = pad_end - padded
        raw_start = torch.cumsum(counts, 0) - counts
        order = torch.sort(flat, stable=True).indices  # slots grouped by expert
        sorted_e = flat[order].clamp(max=num_experts - 1)
        rank = torch.arange(numel, device=dev) - raw_start[sorted_e]
        sorted_ids = torch.full((max_len,), numel, dtype=torch.int32, device=dev)
        sorted_ids.scatter_(0, pad_start[sorted_e] + rank, order.to(torch.int32))
        blocks = -(-max_len // block_size)
        starts = torch.arange(blocks, device=dev, dtype=torch.int64) * block_size
        expert_ids = torch.searchsorted(pad_end, starts, right=True).clamp(max=num_experts - 1).to(torch.int32)
        num_padded = pad_end[-1:].to(torch.int32)
    return sorted_ids, expert_ids, num_padded


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _check_moe_args(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m, top_k,
                    block_size):
    if a.dtype not in DTYPES:
        raise TypeError(f"activations must be float16 or bfloat16, got {a.dtype}")
    if b.dtype != torch.int32 or b.dim() != 4 or b.shape[3] not in (128, 256):
        raise TypeError(f"expert weights must be int32 [E, N/64, K/16, 32*bits], got {b.dtype} {tuple(b.shape)}")
    e, bits = b.shape[0], b.shape[3] // 32
    n, k = b.shape[1] * 64, b.shape[2] * 16
    if a.dim() != 2 or a.shape[1] != k or not a.is_contiguous():
        raise ValueError(f"MoE activations must be a contiguous [rows, {k}] matrix, got {tuple(a.shape)}")
    if scales.dtype != a.dtype or scales.dim() != 3 or scales.shape[0] != e or scales.shape[2] != n \
            or k % scales.shape[1] or not scales.is_contiguous():
        raise ValueError(f"expert scales must be contiguous [{e}, groups, {n}] in {a.dtype}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    groups = scales.shape[1]
    if zeros is not None and (zeros.dtype != torch.int32 or tuple(zeros.shape) != (e, groups, n * bits // 32)):
        raise ValueError(f"expert zero points must be int32 [{e}, {groups}, {n * bits // 32}], got {tuple(zeros.shape)}")
    if block_size not in BLOCK_SIZES and block_size != WGMMA_BLOCK and block_size not in PROD_ONLY_BLOCKS:
        raise ValueError(f"block_size={block_size} must be one of {BLOCK_SIZES} (or {WGMMA_BLOCK} on the sm_90a "
                         f"wgmma path, {' / '.join(map(str, PROD_ONLY_BLOCKS))} on its producer form)")
    for name, t in (("sorted_ids", sorted_ids), ("expert_ids", expert_ids), ("num_padded", num_padded)):
        if t.dtype != torch.int32 or t.device != a.device:
            raise ValueError(f"{name} must be int32 on {a.device} (from moe_align_block_size), got {t.dtype} on {t.device}")
    if topk_weights is not None and (topk_weights.dtype != torch.float32 or topk_weights.numel() != size_m):
        raise ValueError(f"topk_weights must be float32 with {size_m} elements, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    for name, t in (("weights", b), ("scales", scales), ("zero points", zeros), ("topk_weights", topk_weights)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} are on {t.device} but the activations on {a.device}")
    return n, k, _expert_family(a, b, scales, zeros)


from .gemm import _lib  # noqa: E402  (the "jitmarlin" op library)

_lib.define("moe_gemm(Tensor a, Tensor b, Tensor scales, Tensor? zeros, Tensor sorted_ids, Tensor expert_ids, "
            "Tensor num_padded, Tensor? topk_weights, int size_m, int top_k, int block_size, "
            "bool a_by_position=False, int ids_shift=0, int num_experts=0) -> Tensor")


def _moe_gemm_cuda(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_padded: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], size_m: int, top_k: int, block_size: int,
                   a_by_position: bool = False, ids_shift: int = 0, num_experts: int = 0,
                   tables_ready: bool = False, k_splits: int = 1) -> torch.Tensor:
    """Grouped expert GEMM: out[slot] = A[row(slot)] @ dequant(b[expert of slot]) (* topk weight).

    a: [rows, K]; row(slot) = slot // top_k, or the slot's position in sorted_ids when
    a_by_position (A pre-gathered in padded order). b/scales/zeros: per-expert packed weights
    [E, N/64, K/16, 32*bits], [E, K/G, N], [E, K/G, N*bits/32]. size_m = T*k slots.
    Returns [size_m, N]; every slot's row is written exactly once. ids_shift = 1: the expert of
    block i is expert_ids[2 i] (int64 ids viewed as int32 pairs: one_token_tables); num_experts > 0
    clamps the expert ids read to num_experts - 1 (memory safety for ids not checked by an alignment).
    k_splits > 1 (the wgmma kernel only): K cut into k_splits contiguous runs of 64-k stages, one CTA
    each, returning their fp32 partial sums [k_splits, size_m, N] (topk_sum adds them up).
    """
    n, k, fam = _check_moe_args(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m,
                                top_k, block_size)
    _check_expert_table(sorted_ids, expert_ids, block_size, ids_shift, num_experts, b.shape[0])
    _check_k_splits(k_splits, k)
    if k_splits > 1:
        out = torch.empty(k_splits, size_m, n, dtype=torch.float32, device=a.device)
    else:
        out = torch.empty(size_m, n, dtype=a.dtype, device=a.device)
    if size_m == 0:
        return out
    index = K.cuda_index(a.device)
    by_position = bool(a_by_position) and a.data_ptr() % 16 == 0  # (the producer form's TMA boxes)
    if k_splits > 1 and (block_size > 64 or not _use_wgmma_moe(block_size, n, k, fam, index, size_m / b.shape[0],
                                                                by_position)):
        raise ValueError(f"k_splits={k_splits} needs the sm_90a wgmma MoE kernel with blocks of 32 or 64 rows "
                         f"(blocks of {block_size} rows, N={n}, K={k} do not take it here); use k_splits=1")
    if block_size == WGMMA_BLOCK and not _use_wgmma_moe(block_size, n, k, fam, index):
        raise ValueError(f"block_size={block_size} needs the sm_90a wgmma MoE kernel: compute capability 9.0, "
                         f"N % 128 == 0 and K % 64 == 0 (got N={n}, K={k}), JITMARLIN_WGMMA not 0")
    if block_size in PROD_ONLY_BLOCKS and not (a_by_position and block_size in MOE_WGMMA_PROD_BLOCKS
                                               and a.data_ptr() % 16 == 0
                                               and _use_wgmma_moe(block_size, n, k, fam, index)):
        raise ValueError(f"block_size={block_size} needs the sm_90a wgmma MoE kernel's producer form: compute "
                         f"capability 9.0, N % 128 == 0 and K % 64 == 0 (got N={n}, K={k}), a built ({block_size}, "
                         f"{MOE_WGMMA_PROD_FW}, stages) config in K.WGMMA_MOE_PROD_CONFIGS, {block_size} in "
                         f"MOE_WGMMA_PROD_BLOCKS, and A gathered by position (a_by_position=True, 16-byte aligned)")
    strip = strip_moe_config(sorted_ids, block_size, k_splits, n, k, fam, index)
    if strip is not None:
        _launch_strip_moe(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, out, size_m, n, k, fam,
                          top_k, a_by_position, ids_shift, num_experts, tables_ready, index, strip)
        return out
    if _use_wgmma_moe(block_size, n, k, fam, index, size_m / b.shape[0], by_position):
        if ids_shift:
            raise ValueError(f"ids_shift={ids_shift}: the wgmma MoE kernel (blocks of {block_size}) reads int32 "
                             "alignment tables only")
        _launch_wgmma_moe(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, out, size_m, n, k,
                          fam, top_k, block_size, a_by_position, index, k_splits=k_splits, tables_ready=tables_ready)
        return out
    launch = prepare_launch(block_size, sorted_ids.numel(), n, k, fam, index, tuned=False,
                            experts=min(b.shape[0], size_m))
    assert launch.plan.tile.rows == block_size, (launch.plan, block_size)
    p = launch_params(launch, K.default_workspace(a.device), a, b, scales, zeros, out, size_m, n, k)
    _expert_tables(p, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights)
    p.top_k, p.a_by_position, p.tables_ready = top_k, int(a_by_position), int(tables_ready)
    p.ids_shift, p.num_experts = ids_shift, num_experts
    launch.fn.launch(launch.grid, launch.threads, launch.plan.smem, K.current_stream_handle(a.device), p,
                     pdl=launch.pdl)
    return out


# Expert blocks of 8 rows (small experts, and one-token calls: one_token_tables' block j holds slot j) on the strip
# kernel's MoE form: each (block, 64-column strip) one CTA streaming the block's expert, no partial sums in global
# memory; blocks past the padded list leave at once. Routed where the tables hold at most STRIP_MOE_MAX_BLOCKS
# blocks (or the strip route is forced, gemm.strip_route_on). H200 session 55 (stage s50d, bench_moe, layer us,
# strip form off / on): Mixtral 1 token (2 blocks) 61.8 / 56.9, 16 tokens (11) 200.1 / 193.8, 64 tokens (23) 270.4 /
# 269.1; E=64 top-6 1 token (6) 21.2 / 17.4, 16 tokens (68) 77.0 / 83.4, 64 tokens (104) 100.5 / 118.4: a win up to
# 11 blocks, a loss from 68 (most of a large grid's CTAs leave at once), 12-67 not measured. Candidates in order:
# the most warps per CTA whose grid (every block the tables can hold) runs in one wave, else the smallest CTAs.
STRIP_MOE_MAX_BLOCKS = 12
STRIP_MOE_ORDER: tuple[tuple[int, int, int, int], ...] = ((16, 1, 1, 0), (8, 1, 1, 0), (4, 1, 1, 0))


def strip_moe_config(sorted_ids: torch.Tensor, block_size: int, k_splits: int, n: int, k: int, fam: K.Family,
                     index: int) -> tuple[int, int, int, int] | None:
    """(warps, cluster, token blocks, smem ring) of the strip kernel's MoE form for an expert GEMM, or None."""
    from ..jit import driver
    from .gemm import _cc, strip_route_on

    cc = _cc(index)
    if not (block_size == 8 and k_splits == 1 and n % 64 == 0 and k % 16 == 0 and K.strip_built(fam, cc)):
        return None
    blocks = strip_moe_blocks(sorted_ids)
    if not (strip_route_on() or blocks <= STRIP_MOE_MAX_BLOCKS):
        return None
    sms, ctas = driver.device(index).sm_count, n // 64 * blocks
    for cfg in STRIP_MOE_ORDER:
        fn = K.get_strip_kernel(fam, *cfg, index, cc)
        if ctas <= sms * fn.occupancy(32 * cfg[0], K.strip_smem_bytes(fam, cfg[0], cfg[3])):
            return cfg
    return STRIP_MOE_ORDER[-1]


def strip_moe_blocks(sorted_ids: torch.Tensor) -> int:
    """Blocks of 8 the tables can hold (the launch's grid: the kernel skips those past num_padded)."""
    return -(-sorted_ids.numel() // 8)


def _launch_strip_moe(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, out, slots: int, n: int,
                      k: int, fam: K.Family, top_k: int, a_by_position: bool, ids_shift: int, num_experts: int,
                      tables_ready: bool, index: int, cfg: tuple[int, int, int, int]) -> None:
    """out[slot] = A[slot // top_k (or its position)] @ dequant(b[expert of its block]) (* its routing weight) on the
    strip kernel's MoE form: N / 64 x cluster CTAs per block of 8, block after block."""
    from .gemm import _cc, use_pdl

    warps, cluster, toks, smem = cfg
    fn = K.get_strip_kernel(fam, warps, cluster, toks, smem, index, _cc(index))
    p = K.GemmParams()
    p.a, p.b, p.s, p.c = a.data_ptr(), b.data_ptr(), scales.data_ptr(), out.data_ptr()
    p.z = zeros.data_ptr() if zeros is not None else None
    _expert_tables(p, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights)
    p.m, p.n, p.k, p.lda, p.ldc = slots, n, k, k, n
    p.top_k, p.a_by_position, p.tables_ready = top_k, int(a_by_position), int(tables_ready)
    p.ids_shift, p.num_experts = ids_shift, num_experts
    p.nwarps, p.grid = warps, n // 64 * cluster * strip_moe_blocks(sorted_ids)
    fn.launch(p.grid, 32 * warps, K.strip_smem_bytes(fam, warps, smem), K.current_stream_handle(a.device), p,
              pdl=use_pdl(_cc(index)), cluster=cluster)


def _expert_tables(p: K.GemmParams, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights) -> None:
    """The fields every expert-GEMM launch sets alike: the alignment's tables, the routing weights, the strides
    between two experts' packed weights, scales and zero points."""
    p.sorted_ids, p.expert_ids, p.num_padded = sorted_ids.data_ptr(), expert_ids.data_ptr(), num_padded.data_ptr()
    p.topk_weights = topk_weights.data_ptr() if topk_weights is not None else None
    p.b_expert_stride = b.shape[1] * b.shape[2] * b.shape[3]
    p.s_expert_stride = scales.shape[1] * scales.shape[2]
    p.z_expert_stride = zeros.shape[1] * zeros.shape[2] if zeros is not None else 0


def _use_wgmma_moe(block_size: int, n: int, k: int, fam: K.Family, index: int,
                   per_expert: float | None = None, by_position: bool = False) -> bool:
    """The sm_90a wgmma kernel for blocks of 64 and 128 rows; of MOE_WGMMA_PROD_BLOCKS rows on its
    producer form where A is gathered by position (by_position: the caller gathers it, or it is);
    of PROD_ONLY_BLOCKS rows (producer form only: moe_gemm raises a clear error off it); and
    otherwise of 32 at per_expert rows per expert where wgmma_block32 says so — unless
    JITMARLIN_WGMMA=0 (or, chosen automatically, its module cannot be built). H200: Mixtral shape at
    1024 tokens 3306 us on the mma.sync kernel -> 2157 (blocks of 64) -> 1899 (128)."""
    from .gemm import wgmma_allowed

    prod = wgmma_prod_moe_config(block_size, MOE_WGMMA_PROD_FW, fam.bits) is not None
    if by_position and block_size in MOE_WGMMA_PROD_BLOCKS and prod:
        wanted = True
    elif block_size in PROD_ONLY_BLOCKS:
        wanted = prod  # (moe_gemm raises a clear error where A is not by position)
    elif block_size == 32:
        wanted = per_expert is not None and wgmma_block32(per_expert, n * k, fam.bits)
    else:
        wanted = block_size in (64, WGMMA_BLOCK)
    return wanted and n % 128 == 0 and k % 64 == 0 and wgmma_allowed(fam, index, True)


MOE_WGMMA_FW: int | None = None  # probe switch (probe_moe_tiles.py --fw): strips per warpgroup for blocks of 32 / 64
# The wgmma MoE kernel's producer form (K.WGMMA_MOE_PROD_CONFIGS: one compute warpgroup, two to four CTAs
# per SM (K.prod_ctas), every copy issued by the producer warpgroup) for expert blocks of these row counts. It reads A
# pre-gathered in slot-list order (gather_by_position), a block's rows one TMA box, so fused_marlin_moe
# gathers both GEMMs' inputs for it (act-order experts do anyway), where the first GEMM's experts hold
# more than MOE_WGMMA_PROD_MIN_KN weights (act-order experts: any size). H200 session 25
# (probe_moe_tiles, layer us, plain -> producer form with both gathers, two runs): Mixtral 64 tokens
# 411-415 -> 376-380; E=64 top-6 (experts of 2048 x 2816: the gathers cost what the kernel saves) 96
# tokens 157 -> 155 / 161 / 163, 256 tokens 179 -> 181 / 183 / 184; act-order experts (gathered either
# way): Mixtral 64 tokens 420 -> 378, E=64 96 / 256 tokens 166 / 193 -> 155 / 181. Blocks of 64 (the
# (64, 1, 6) form, probes: --prod-configs 64-1-6): Mixtral 96 / 256 tokens 477 / 709 -> 476 / 696 with
# act-order, level without. Probe switch: probe_moe_tiles.py --prod 0|1.
# Since session 34 also blocks of 16 where the experts' weights are 4-bit (K.WGMMA_MOE_PROD_CONFIGS_U4, four CTAs
# per SM), in place of the mma.sync kernel's 16-row tile: large experts from 7.2 to 12 rows per expert (the plain
# rule's 16 below WGMMA_COVER_MIN_ROWS; small experts take blocks of 8 or 24 there on sm_90). H200 session 34
# (probe_moe_tiles, Mixtral layer us, the mma.sync tile / the producer form, one draw per token count): fp16 32
# tokens 292.7 / 256.8, 40 ~292 / 259.7-261.8; bf16 32 301.4 / 290.0, 40 303.6 / 290.9.
MOE_WGMMA_PROD_BLOCKS: tuple[int, ...] = (16, 24, 32, 48, 80, 96)
MOE_WGMMA_PROD_MIN_KN = WGMMA_32_SMALL_KN
# Smaller experts' blocks of 32 rows (wgmma_block32's range, from 9 rows per expert) take the producer form
# too from this many rows per expert (average), both inputs gathered: since session 32 that form's blocks of 32
# run at four CTAs per SM in 4-bit MoE families (K.WGMMA_PROD_CTAS_MOE_U4), where session 25's three measured
# level with the plain form. H200 session 32 (probe_moe_tiles --ab "minkn=16777216;minkn=0", E=64 top-6 layer
# us, plain / producer form, two interleaved rounds): 96 tokens (9 rows) 156.7, 156.5 / 149.4, 150.3; 128 (12)
# 159.3, 158.4 / 151.5, 152.1; 160 (15) 160.8, 160.2 / 153.9, 153.6; 192 (18) 163.1, 162.7 / 154.9, 154.9; 256
# (24) 168.7, 167.6 / 159.1, 159.0. 4-bit weights only (8-bit blocks of 32 stay at three CTAs per SM: not
# measured there). (A probe switch: a larger value keeps the plain form below it.) Since session 33 also the blocks
# of 24 (small_block24, from 9.5 rows).
WGMMA_PROD_SMALL32_MIN_ROWS = 9
# The blocks that rule applies to (small_block24's 24 since session 33; probe_moe_tiles --ab smallblocks=32
# takes them off).
WGMMA_PROD_SMALL_BLOCKS: tuple[int, ...] = (24, 32)
# Strips per warpgroup pair of that producer form (its config (32, FW, stages) must be built): 1 = two
# strips on its compute warpgroup, 128 features per CTA, three CTAs per SM; 2 = four strips, 256 features
# per CTA (as Humming's MoE blocks of 24 x 512 / 32 x 256), two CTAs per SM — slower (H200 session 26,
# probe_moe_tiles --prod 1 --prod-fw 1 / 2, Mixtral 64 tokens 374.9-377.5 / 406.4-408.7 us): a probe switch.
MOE_WGMMA_PROD_FW = 1
# The producer form runs stream-K (as the dense kernel): every resident CTA takes an even run of all
# (feature tile, expert block) tiles' 64-k stages over the blocks that hold rows (counted on the device),
# tiles cut between CTAs summed through the workspace by their last piece in a fixed order, so neither
# GEMM ends on a partly filled wave of whole tiles. H200 session 26 (probe_moe_chain --gathered, Mixtral
# 64 tokens, marginal us, stream-K on / off): gate/up GEMM 205.7 / 206.7, down projection 105.2 / 144.1;
# the layer (probe_moe_tiles --stream-k, off = the K splits of a rule since dropped instead) 336.2 / 340.8
# vs 332.4 / 342.8, 80 tokens 344.3 / 341.5 vs 348.3 / 344.9, E=64 act-order-like (pre-gathered) 96 / 256
# tokens 166.3 / 184.6 vs 165.6 / 185.7: level with the split rule, kept for needing no estimate of the
# blocks (skewed routing) and covering both GEMMs. Probe switch: probe_moe_tiles.py --stream-k 0,1.
MOE_STREAM_K = True


def wgmma_prod_moe_config(block_size: int, fw: int = 1, bits: int = 4) -> tuple[int, int, int] | None:
    """The producer-form MoE config (NT, FW, STAGES) for expert blocks of block_size rows of `bits`-bit weights
    (K.moe_prod_configs), or None."""
    return next((c for c in K.moe_prod_configs(bits) if c[:2] == (block_size, fw)), None)


def _launch_wgmma_moe(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, out, size_m, n, k, fam,
                      top_k, block_size, a_by_position, index, fw: int | None = None, k_splits: int = 1,
                      silu: bool = False, tables_ready: bool = False) -> None:
    from ..jit import driver
    from .gemm import _cc, use_pdl, wgmma_act_map, wgmma_strips

    fw_asked = fw if fw is not None else MOE_WGMMA_FW
    if block_size == WGMMA_BLOCK:  # compiled with one strip per warpgroup only
        fw = 1
    elif fw is None and MOE_WGMMA_FW:
        fw = MOE_WGMMA_FW
    elif fw is None and block_size == 32:
        # one strip (two CTAs per SM) for blocks of 32 rows. H200 session 17 (probe_moe_tiles, us, one vs
        # two strips): E=64 128 / 256 tokens 165.9 / 195.9 vs 203.7 / 234.7, Mixtral 64 tokens 413.1 vs 419.7
        fw = 1
    elif fw is None:  # blocks of 64 (blocks: an upper bound of the expert blocks); session 17: Mixtral 128 /
        # 256 tokens with one strip 467 / 700 us, with two 477 / 668, with this rule 477 / 683
        fw = wgmma_strips(n, -(-sorted_ids.numel() // block_size), driver.device(index).sm_count)
    # the producer form: A pre-gathered (a block's rows contiguous), read through a TMA descriptor (its
    # base 16-byte aligned; rows are: K % 64 == 0)
    pfw = fw_asked or MOE_WGMMA_PROD_FW
    cfg = wgmma_prod_moe_config(block_size, pfw, fam.bits) \
        if block_size in MOE_WGMMA_PROD_BLOCKS and a_by_position and a.data_ptr() % 16 == 0 else None
    prod = cfg is not None
    if prod:
        nt, fw, stages = cfg
        amap = wgmma_act_map(a, a.shape[0], k, nt, True)  # boxes of a block's rows
    else:
        cfg = next((c for c in K.WGMMA_MOE_CONFIGS if c[:2] == (block_size, fw)), None)
        if cfg is None:
            raise ValueError(f"no wgmma MoE kernel is built for blocks of {block_size} rows with {fw} strip(s) per "
                             f"warpgroup (plain form: {K.WGMMA_MOE_CONFIGS}; producer form, A gathered by position: "
                             f"{K.moe_prod_configs(fam.bits)})")
        nt, fw, stages = cfg
        amap = K.NO_TENSOR_MAP
    if silu and not (prod and fw == 1 and k_splits == 1 and zeros is None and topk_weights is None and n % 128 == 0):
        raise AssertionError("the SiLU epilogue needs the producer form of two strips per CTA, no K splits, zero "
                             "points or routing weights")
    fn = K.get_wgmma_kernel(fam, nt, fw, stages, index, prod=prod)
    p = K.GemmParams()
    p.a, p.b, p.s, p.c = a.data_ptr(), b.data_ptr(), scales.data_ptr(), out.data_ptr()
    p.z = zeros.data_ptr() if zeros is not None else None
    _expert_tables(p, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights)
    p.m, p.n, p.k, p.lda, p.ldc = size_m, n, k, k, (n // 2 if silu else n)
    p.top_k, p.a_by_position, p.k_splits, p.silu_out = top_k, int(a_by_position), k_splits, int(silu)
    # tables complete before the previous kernel (moe_gemm_ready_tables): the producer form streams its first
    # weight stages before waiting for that kernel (jm_wgmma.cuh; MOE_PROD_EARLY_WEIGHTS, a probe switch)
    p.tables_ready = int(tables_ready and prod and MOE_PROD_EARLY_WEIGHTS)
    p.grid = -(-sorted_ids.numel() // block_size)  # m tiles, an upper bound (the kernel reads num_padded)
    grid, smem = (n // (128 * fw)) * k_splits * p.grid, K.wgmma_smem_bytes(fam, nt, fw, stages)
    if prod and k_splits == 1 and MOE_STREAM_K:
        per_sm = fn.occupancy(256, smem)  # three (8-bit stages: two)
        ws = _stream_k_workspace(a.device, index, n, fw, nt, p.grid, per_sm)
        if ws is not None:
            grid = driver.device(index).sm_count * per_sm  # every resident CTA slot
            p.k_splits = -1
            p.ws, p.counters = ws.ws.data_ptr(), ws.counters.data_ptr()
    fn.launch(grid, 256, smem, K.current_stream_handle(a.device), p, pdl=use_pdl(_cc(index)), extra=amap)


def _stream_k_workspace(device: torch.device, index: int, n: int, fw: int, nt: int, m_tiles: int, per_sm: int):
    """The shared workspace for a stream-K launch of the MoE producer form (two partial-sum regions per
    CTA, one arrival counter per (feature tile, block) of the bound), grown at least to the dense
    kernel's bound; None while a CUDA graph is captured and it would have to grow (the launch then
    takes whole tiles)."""
    from ..jit import driver
    from .gemm import wgmma_split_bound, wgmma_stream_workspace

    sms = driver.device(index).sm_count
    floats, counters = wgmma_stream_workspace(sms * per_sm, m_tiles, n // (128 * fw), nt, fw)
    ws = K.default_workspace(device)
    if floats <= ws.ws.numel() and counters <= ws.counters.numel():
        return ws
    if torch.cuda.is_current_stream_capturing():
        return None
    ws.ensure(max(floats, wgmma_split_bound(sms)), counters)
    return ws


def _check_k_splits(k_splits: int, k: int) -> None:
    if not 1 <= k_splits <= k // 64:
        raise ValueError(f"k_splits={k_splits} must be in [1, K/64 = {k // 64}] (runs of whole 64-k stages)")


def _check_expert_table(sorted_ids, expert_ids, block_size, ids_shift, num_experts, e):
    """The expert table's reading rule: block i's expert is expert_ids[i << ids_shift] (ids_shift 0 or
    1), clamped to num_experts - 1 when num_experts > 0 (at most E)."""
    blocks = -(-sorted_ids.numel() // block_size)
    if ids_shift not in (0, 1) or expert_ids.numel() < blocks << ids_shift or not 0 <= num_experts <= e:
        raise ValueError(f"ids_shift={ids_shift} must be 0 or 1 with expert_ids holding {blocks} << ids_shift entries "
                         f"(got {expert_ids.numel()}), num_experts={num_experts} in [0, E={e}]")


def _moe_gemm_fake(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m, top_k,
                   block_size, a_by_position=False, ids_shift=0, num_experts=0, k_splits=1):
    n, k, _ = _check_moe_args(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m,
                              top_k, block_size)
    _check_expert_table(sorted_ids, expert_ids, block_size, ids_shift, num_experts, b.shape[0])
    _check_k_splits(k_splits, k)
    if k_splits > 1:
        return a.new_empty(k_splits, size_m, n, dtype=torch.float32)
    return a.new_empty(size_m, n)


def _moe_gemm_cpu(a, *args):
    raise ValueError(f"jitmarlin's MoE kernels run on CUDA tensors; the activations are on {a.device}")


_lib.impl("moe_gemm", _moe_gemm_cuda, "CUDA")
_lib.impl("moe_gemm", _moe_gemm_cpu, "CPU")
torch.library.register_fake("jitmarlin::moe_gemm", _moe_gemm_fake, lib=_lib)

# The same GEMM for fused_marlin_moe's second expert GEMM, and its first where gather_by_position runs
# just before it: their routing tables were written by the alignment, which every kernel between had
# waited for before letting the next one launch (the first GEMM; jm_moe_gather triggers its dependent
# only after its own wait), so on sm_90 the kernel reads them and streams its first weight tiles while
# the kernel before it still runs (it waits for that kernel before reading activations). Not for direct
# use: with the tables from the kernel just before, that early read would see them half-written.
_lib.define("moe_gemm_ready_tables(Tensor a, Tensor b, Tensor scales, Tensor? zeros, Tensor sorted_ids, "
            "Tensor expert_ids, Tensor num_padded, Tensor? topk_weights, int size_m, int top_k, int block_size, "
            "bool a_by_position=False, int ids_shift=0, int num_experts=0, int k_splits=1) -> Tensor")


def _moe_gemm_ready_tables_cuda(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m,
                                top_k, block_size, a_by_position=False, ids_shift=0, num_experts=0, k_splits=1):
    return _moe_gemm_cuda(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m, top_k,
                          block_size, a_by_position, ids_shift, num_experts, tables_ready=True, k_splits=k_splits)


_lib.impl("moe_gemm_ready_tables", _moe_gemm_ready_tables_cuda, "CUDA")
_lib.impl("moe_gemm_ready_tables", _moe_gemm_cpu, "CPU")
torch.library.register_fake("jitmarlin::moe_gemm_ready_tables", _moe_gemm_fake, lib=_lib)


# The gate/up GEMM with SiLU-mul in its epilogue (the sm_90a producer form, jm_wgmma.cuh "SiLU epilogue"): from
# the input gathered by position, SiLU(gate) * up of each position straight into the down projection's input
# [L, I] (L = the slot list's length), the values jm_silu_gather would write from the GEMM's [slots, 2I]
# output (bit for bit: the same rounding of the sums to the activation dtype, then the same formula), with no
# SiLU-gather kernel and no [slots, 2I] round trip. fused_marlin_moe takes it where silu_epilogue_ok says;
# MOE_SILU_EPILOGUE = False (probe switch) keeps the two-kernel path.
MOE_SILU_EPILOGUE = True
# The producer form launched by moe_gemm_ready_tables (the down projection, its routing tables complete before
# the kernel just before it started) issues its first stages' weight copies before waiting for that kernel,
# as the dense kernels and the mma.sync MoE tiles do (p.tables_ready). False (a probe switch): it waits first.
MOE_PROD_EARLY_WEIGHTS = True
# The first expert GEMM right after gather_by_position launched with ready tables too (jm_moe_gather lets it
# launch only after its own wait for the alignment). False (a probe switch, to pair with the build flag
# -DJM_MOE_GATHER_TRIGGER_FIRST, which makes the gather trigger at once again): it waits first.
MOE_W13_READY_TABLES = True

_lib.define("moe_gemm_silu(Tensor a, Tensor b, Tensor scales, Tensor sorted_ids, Tensor expert_ids, "
            "Tensor num_padded, int size_m, int top_k, int block_size, bool tables_ready=False) -> Tensor")


def silu_epilogue_ok(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros, size_m: int,
                     block_size: int) -> bool:
    """Whether moe_gemm_silu runs these gate/up experts (b [E, 2I/64, K/16, .], the gate columns first) on
    input `a` gathered by position: the producer form of the wgmma MoE kernel at this block size (sm_90a, the
    switches, a built config of two strips per CTA, A 16-byte aligned), I a multiple of 64 (one 64-feature
    strip of gate and the same of up in a CTA), no zero points."""
    if not (a.is_cuda and zeros is None and b.dim() == 4 and b.shape[1] % 2 == 0 and a.dtype in DTYPES
            and a.data_ptr() % 16 == 0 and block_size in MOE_WGMMA_PROD_BLOCKS and MOE_WGMMA_PROD_FW == 1):
        return False
    fam = _expert_family(a, b, scales, zeros)
    n, k = b.shape[1] * 64, b.shape[2] * 16
    return fam is not None and wgmma_prod_moe_config(block_size, MOE_WGMMA_PROD_FW, fam.bits) is not None \
        and _use_wgmma_moe(block_size, n, k, fam, K.cuda_index(a.device), size_m / b.shape[0], by_position=True)


def _moe_gemm_silu_cuda(a, b, scales, sorted_ids, expert_ids, num_padded, size_m, top_k, block_size,
                        tables_ready=False):
    n, k, fam = _check_moe_args(a, b, scales, None, sorted_ids, expert_ids, num_padded, None, size_m, top_k,
                                block_size)
    _check_expert_table(sorted_ids, expert_ids, block_size, 0, 0, b.shape[0])
    if not silu_epilogue_ok(a, b, scales, None, size_m, block_size):
        raise ValueError(f"moe_gemm_silu needs the sm_90a wgmma MoE kernel's producer form: compute capability 9.0, "
                         f"N = 2I with I % 64 == 0 and K % 64 == 0 (got N={n}, K={k}), block_size in "
                         f"{MOE_WGMMA_PROD_BLOCKS} with a built config (got {block_size}), input gathered by "
                         f"position and 16-byte aligned, JITMARLIN_WGMMA not 0")
    out = torch.empty(sorted_ids.numel(), n // 2, dtype=a.dtype, device=a.device)
    if size_m == 0:
        return out
    _launch_wgmma_moe(a, b, scales, None, sorted_ids, expert_ids, num_padded, None, out, size_m, n, k, fam, top_k,
                      block_size, True, K.cuda_index(a.device), silu=True, tables_ready=tables_ready)
    return out


def _moe_gemm_silu_fake(a, b, scales, sorted_ids, expert_ids, num_padded, size_m, top_k, block_size,
                        tables_ready=False):
    n, _, _ = _check_moe_args(a, b, scales, None, sorted_ids, expert_ids, num_padded, None, size_m, top_k,
                              block_size)
    _check_expert_table(sorted_ids, expert_ids, block_size, 0, 0, b.shape[0])
    return a.new_empty(sorted_ids.shape[0], n // 2)


_lib.impl("moe_gemm_silu", _moe_gemm_silu_cuda, "CUDA")
_lib.impl("moe_gemm_silu", _moe_gemm_cpu, "CPU")
torch.library.register_fake("jitmarlin::moe_gemm_silu", _moe_gemm_silu_fake, lib=_lib)


def moe_gemm_silu(a, b, scales, sorted_ids, expert_ids, num_padded, size_m: int, top_k: int,
                  block_size: int, tables_ready: bool = False) -> torch.Tensor:
    """The gate/up expert GEMM with SiLU-mul in its epilogue (torch.ops.jitmarlin.moe_gemm_silu); see
    _moe_gemm_silu_cuda. tables_ready: the routing tables were complete before the kernel just before this
    one started (fused_marlin_moe, after gather_by_position), so the kernel may read them, and stream its
    first weight stages, before waiting for that kernel; never for tables the kernel before writes."""
    return torch.ops.jitmarlin.moe_gemm_silu(a, b, scales, sorted_ids, expert_ids, num_padded, size_m, top_k,
                                             block_size, tables_ready)


def moe_gemm_ready_tables(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m: int,
                          top_k: int, block_size: int, a_by_position: bool = False) -> torch.Tensor:
    """moe_gemm for tables complete before the kernel just before it started (torch.ops.jitmarlin.
    moe_gemm_ready_tables: fused_marlin_moe's GEMMs only)."""
    return torch.ops.jitmarlin.moe_gemm_ready_tables(a, b, scales, zeros, sorted_ids, expert_ids, num_padded,
                                                     topk_weights, size_m, top_k, block_size, a_by_position)


def moe_gemm(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights, size_m: int, top_k: int,
             block_size: int, a_by_position: bool = False, ids_shift: int = 0, num_experts: int = 0) -> torch.Tensor:
    """Grouped expert GEMM (torch.ops.jitmarlin.moe_gemm); see _moe_gemm_cuda."""
    return torch.ops.jitmarlin.moe_gemm(a, b, scales, zeros, sorted_ids, expert_ids, num_padded, topk_weights,
                                        size_m, top_k, block_size, a_by_position, ids_shift, num_experts)


def gather_by_position(x: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                       num_padded: torch.Tensor, perm: torch.Tensor | None, top_k: int,
                       block_size: int) -> torch.Tensor:
    """A'[pos] = x[slot(pos) // top_k][perm[expert(pos)]] for the positions of the expert-sorted
    slot list (perm: [E, K], act-order; None: the rows as they are, for the wgmma producer form).
    On CUDA one kernel of ours (jm_moe_gather, unless JITMARLIN_MOE_KERNELS=0): padding positions
    get zeros, positions at or past num_padded are not written (the expert GEMM reads none of
    them). Else the torch reference below."""
    k = x.shape[1]
    if not (x.is_cuda and use_moe_kernels() and k % 8 == 0 and x.is_contiguous() and x.dtype in DTYPES):
        return _gather_by_position_torch(x, sorted_ids, expert_ids, perm, top_k, block_size)
    return _launch_gather("moe_gather", x, k, top_k, sorted_ids, expert_ids, num_padded, perm, block_size)


def _launch_gather(name: str, x: torch.Tensor, cols: int, top_k: int, sorted_ids: torch.Tensor,
                   expert_ids: torch.Tensor, num_padded: torch.Tensor, perm: torch.Tensor | None,
                   block_size: int) -> torch.Tensor:
    """[L, cols] by position from x's slot rows (x.shape[0] * top_k slots): jm_moe_gather / jm_silu_gather."""
    perm_ptr = None
    if perm is not None:
        perm32 = perm if perm.dtype == torch.int32 and perm.is_contiguous() else perm.to(torch.int32).contiguous()
        if perm32.data_ptr() % 16:  # read 8 entries at a time
            perm32 = perm32.clone()
        perm_ptr = perm32.data_ptr()
    return _launch_chunked(name, x, sorted_ids.numel(), cols, top_k, sorted_ids=sorted_ids.data_ptr(),
                           expert_ids=expert_ids.data_ptr(), num_padded=num_padded.data_ptr(),
                           numel=x.shape[0] * top_k, block=block_size, perm=perm_ptr)


# SiLU-mul and the down projection's gather by position in one kernel (jm_silu_gather) where the down
# projection reads its input by position (the producer form, act-order experts). Probe switch.
MOE_SILU_GATHER = True


def silu_gather_by_position(c1: torch.Tensor, inter: int, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                            num_padded: torch.Tensor, perm: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """gather_by_position(silu_mul(c1, inter), ..., perm, 1, block_size) in one kernel on CUDA (jm_silu_gather:
    the same values; padding positions zeros, positions at or past num_padded not written), c1 being the
    first expert GEMM's [slots, 2 * inter] output in slot order. Else those two ops."""
    if not (c1.is_cuda and use_moe_kernels() and inter % 8 == 0 and c1.is_contiguous() and c1.dtype in DTYPES
            and c1.shape[1] == 2 * inter):
        return gather_by_position(silu_mul(c1, inter), sorted_ids, expert_ids, num_padded, perm, 1, block_size)
    return _launch_gather("silu_gather", c1, inter, 1, sorted_ids, expert_ids, num_padded, perm, block_size)


def _gather_by_position_torch(x: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                              perm: torch.Tensor | None, top_k: int, block_size: int) -> torch.Tensor:
    """The reference: torch ops through an [L, K] int64 index (L = the list's length); every
    position gets a row (padding positions some token's)."""
    numel = x.shape[0] * top_k
    rows = sorted_ids.clamp(max=numel - 1).to(torch.int64) // top_k  # [L]
    if perm is None:
        return x[rows]
    experts = expert_ids.to(torch.int64).repeat_interleave(block_size)[: sorted_ids.numel()]  # [L]
    cols = perm.to(torch.int64)[experts]  # [L, K]
    return torch.gather(x[rows], 1, cols)


def _expert_family(hidden: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros) -> K.Family | None:
    """The kernel family of one expert GEMM, or None for tensors moe_gemm will reject anyway."""
    if hidden.dtype not in DTYPES or b.dim() != 4 or scales.dim() != 3 or scales.shape[1] < 1:
        return None
    k, groups = b.shape[2] * 16, scales.shape[1]
    return Family(DTYPES[hidden.dtype], b.shape[3] // 32, zeros is not None, -1 if groups == 1 else k // groups,
                  moe=True)


def _large_blocks_ok(hidden: torch.Tensor, gemms) -> bool:
    """Blocks of 64 rows at few rows per expert, and of 128, need both expert GEMMs ((n, k, family)
    each) on the sm_90a wgmma MoE kernel (the device, the switch, shapes it tiles, a module that can
    be built); see choose_block_size."""
    if not hidden.is_cuda or any(fam is None for _, _, fam in gemms):
        return False
    index = K.cuda_index(hidden.device)
    return all(_use_wgmma_moe(WGMMA_BLOCK, n, k, fam, index) for n, k, fam in gemms)


def _prod_route(hidden: torch.Tensor, block_size: int, per_expert: float, gemms) -> bool:
    """Whether both expert GEMMs ((n, k, w, scales, zeros) each) of blocks of block_size rows at
    per_expert rows per expert (average) run the wgmma kernel's producer form (MOE_WGMMA_PROD_BLOCKS),
    which reads its input pre-gathered in slot-list order."""
    if block_size not in MOE_WGMMA_PROD_BLOCKS or not hidden.is_cuda or not use_moe_kernels():
        return False  # (a built config for the experts' bits: _use_wgmma_moe, per GEMM)
    index = K.cuda_index(hidden.device)
    for n, k, w, scales, zeros in gemms:
        fam = _expert_family(hidden, w, scales, zeros)
        if fam is None or not _use_wgmma_moe(block_size, n, k, fam, index, per_expert, by_position=True):
            return False
    return True


# K splits of the down projection (the second expert GEMM) on the wgmma MoE kernel, a probe switch: each
# CTA takes one contiguous run of K (= I) and writes fp32 partial sums into its own slice, which the top-k
# sum adds up (no workspace, no arrival counters). A down projection whose (feature tile, expert block) CTAs
# fill few of the resident slots (Mixtral at 64 tokens: 32 feature tiles x ~8 blocks on 396 slots, each CTA
# 224 stages) runs as long as one CTA's chain of stages; splits put more CTAs on the SMs. Stream-K on the
# producer form does the same without an estimate of the blocks (MOE_STREAM_K), so no rule routes splits.
# H200 session 26 (probe_moe_tiles --down-splits, layer us, stream-K off, splits 1 / 2 / 3 / 4 / 6 / 8):
# Mixtral 64 tokens 382.7 / 360.3 / 345.5 / 347.5 / 354.0 / 366.1, 80 tokens 388.4 / 360.9 / 349.7 / 356.2 /
# 360.5 / 371.9; blocks of 64 on the plain form lose (Mixtral 96 / 128 / 256 tokens, splits 1 / 2 / 3: 474.6
# / 484.5 / 493.1, 477.4 / 487.6 / 494.5, 657.6 / 685.8 / 658.5), E=64 too (22 stages; 96 / 256 tokens with
# 2 splits 169.4 / 185.6 vs 158.9 / 171.7).
MOE_DOWN_SPLITS = 1  # this many splits (at most K/64) where the wgmma kernel runs the down projection


def _down_splits(hidden: torch.Tensor, block_size: int, slots_used: int, num_experts: int, inter: int,
                 w2: torch.Tensor, w2_scales: torch.Tensor, w2_zeros) -> int:
    """The k_splits of fused_marlin_moe's down projection: MOE_DOWN_SPLITS where the wgmma kernel runs it
    with blocks of up to 64 rows, else 1."""
    if not hidden.is_cuda or MOE_DOWN_SPLITS <= 1 or block_size > 64:
        return 1
    fam = _expert_family(hidden, w2, w2_scales, w2_zeros)
    h = w2.shape[1] * 64
    if fam is None or not _use_wgmma_moe(block_size, h, inter, fam, K.cuda_index(hidden.device),
                                         slots_used / num_experts):
        return 1
    return min(MOE_DOWN_SPLITS, inter // 64)


# One token, blocks of 8 (decode at batch 1, the most common MoE call): the alignment's tables are known
# but for the expert of each block, which is the router's id of that slot. So no alignment kernel runs:
# the slot and padding tables are built once per (top_k, device) and the kernels read the router's ids
# (int32, or the low words of int64 ids) as the expert table, clamped to E - 1.
_ONE_TOKEN_TABLES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


@torch.compiler.disable  # run eagerly under torch.compile: the cached tables must be real tensors
def one_token_tables(topk_ids: torch.Tensor):
    """(sorted_ids, expert_ids, num_padded, ids_shift) for one token's top-k ids ([1, k], int32 or int64,
    contiguous, on CUDA) in blocks of 8: block j holds slot j then 7 padding slots; or None where the
    alignment must run (JITMARLIN_MOE_ONE_TOKEN=0, other shapes or dtypes, or a CUDA graph capture before
    the tables of this top_k exist on the device)."""
    if not (topk_ids.is_cuda and topk_ids.dim() == 2 and topk_ids.shape[0] == 1 and topk_ids.is_contiguous()
            and topk_ids.dtype in (torch.int32, torch.int64) and K.env_flag("JITMARLIN_MOE_ONE_TOKEN", default=True)):
        return None
    k = topk_ids.shape[1]
    key = (k, K.cuda_index(topk_ids.device))
    tables = _ONE_TOKEN_TABLES.get(key)
    if tables is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        sorted_ids = torch.full((k, 8), k, dtype=torch.int32)
        sorted_ids[:, 0] = torch.arange(k, dtype=torch.int32)
        tables = (sorted_ids.reshape(-1).to(topk_ids.device), torch.tensor([8 * k], dtype=torch.int32,
                                                                            device=topk_ids.device))
        _ONE_TOKEN_TABLES[key] = tables
    ids = topk_ids.reshape(-1)
    shift = 1 if ids.dtype == torch.int64 else 0
    return tables[0], ids.view(torch.int32), tables[1], shift


def fused_marlin_moe(hidden: torch.Tensor, w13: torch.Tensor, w13_scales: torch.Tensor, w2: torch.Tensor,
                     w2_scales: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                     w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None,
                     w13_perm: torch.Tensor | None = None, w2_perm: torch.Tensor | None = None,
                     block_size: int | None = None) -> torch.Tensor:
    """Experts of a quantized MoE layer: gate+up GEMM -> SiLU(gate) * up -> down GEMM with the
    routing weights -> sum over the top-k experts. No host synchronisation.

    hidden [T, H]; w13 packed [E, 2I/64, H/16, 32*bits] with the gate columns first, then up;
    w2 packed [E, H/64, I/16, 32*bits]; scales [E, groups, N]; topk_weights [T, k] (any float
    dtype, used in fp32); topk_ids [T, k]; w13_perm [E, H] / w2_perm [E, I] for act-order.
    Returns [T, H] in hidden's dtype. One token without act-order runs no alignment kernel
    (one_token_tables).
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [tokens={hidden.shape[0]}, top_k]")
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    e = w13.shape[0]
    i2 = w13.shape[1] * 64
    if i2 % 2 or w2.shape[2] * 16 != i2 // 2 or w2.shape[1] * 64 != h or w13.shape[2] * 16 != h or w2.shape[0] != e:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not form experts of hidden={h}: need "
                         f"w13 [E, 2I/64, {h}/16, .] and w2 [E, {h}/64, I/16, .]")
    inter = i2 // 2
    bits = w13.shape[-1] // 32  # packed words per 16 x 64 piece: 32 * bits
    for name, perm, k in (("w13_perm", w13_perm, h), ("w2_perm", w2_perm, inter)):
        if perm is None:
            continue
        if perm.shape != (e, k) or perm.dtype.is_floating_point or perm.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor [E={e}, {k}], got {perm.dtype} {tuple(perm.shape)}")
        if perm.device != hidden.device:
            raise ValueError(f"{name} is on {perm.device} but hidden on {hidden.device}: all must be on one device")
        check_perm_values(perm, k)
    bs = block_size
    if bs is None:  # the expert families are only needed when the wgmma blocks would differ
        bs, wide = choose_block_size(t, top_k, e), choose_block_size(t, top_k, e, True, i2 * h, bits=bits)
        # (48 rows: the mma.sync kernel's tile too, the producer form's where the wide rule chose it; 32 rows
        # on large experts: the producer form's from the cover rule, else the plain form's rule)
        # (blocks of 16: the producer form's where small_block16 says so, else the mma.sync kernel's; where the
        # producer form cannot take them, the rule without it, as for the producer-only blocks)
        small16 = wide == 16 and small_block16(t * top_k / e, i2 * h, bits)
        if (wide != bs or wide == 48 or small16) and _large_blocks_ok(
                hidden, ((i2, h, _expert_family(hidden, w13, w13_scales, w13_zeros)),
                         (h, inter, _expert_family(hidden, w2, w2_scales, w2_zeros)))):
            if (wide in PROD_ONLY_BLOCKS + (32, 48) or small16) and not _prod_route(hidden, wide, t * top_k / e,
                                                                     ((i2, h, w13, w13_scales, w13_zeros),
                                                                      (h, inter, w2, w2_scales, w2_zeros))):
                # the producer form cannot
                wide = choose_block_size(t, top_k, e, True, i2 * h, prod_blocks=False, bits=bits)
            bs = wide
    one = None
    if t == 1 and bs == 8 and w13_perm is None and w2_perm is None and topk_ids.device == hidden.device \
            and use_moe_kernels():
        one = one_token_tables(topk_ids)
    if one is not None:  # no alignment kernel (one_token_tables)
        sorted_ids, expert_ids, num_padded, shift = one
        clamp = e
    else:
        sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, bs, e)
        shift = clamp = 0
    hidden = hidden.contiguous()
    # blocks on the wgmma kernel's producer form read both GEMMs' inputs gathered in slot-list order
    # (no column order), as act-order experts do (theirs in each expert's column order)
    gathered = w13_perm is None and w2_perm is None and one is None \
        and (i2 * h > MOE_WGMMA_PROD_MIN_KN or small_cover(t * top_k / e, top_k, e, i2 * h, bits)
             or (bs in WGMMA_PROD_SMALL_BLOCKS and bits == 4 and t * top_k / e >= WGMMA_PROD_SMALL32_MIN_ROWS)
             or (bs == 16 and small_block16(t * top_k / e, i2 * h, bits))) \
        and _prod_route(hidden, bs, t * top_k / e, ((i2, h, w13, w13_scales, w13_zeros),
                                                    (h, inter, w2, w2_scales, w2_zeros)))
    # SiLU-mul in the gate/up GEMM's epilogue (moe_gemm_silu): _prod_route has already put w13 on the producer
    # form for these blocks; what silu_epilogue_ok asks beyond that is this (a1 is a fresh, aligned allocation)
    silu_epi = gathered and MOE_SILU_EPILOGUE and w13_zeros is None and MOE_WGMMA_PROD_FW == 1 \
        and w13.shape[1] % 2 == 0
    if w13_perm is None and not gathered:
        c1 = moe_gemm(hidden, w13, w13_scales, w13_zeros, sorted_ids, expert_ids, num_padded, None, t * top_k,
                      top_k, bs, False, shift, clamp)  # [T*k, 2I]
    else:
        a1 = gather_by_position(hidden, sorted_ids, expert_ids, num_padded, w13_perm, top_k, bs)
        if silu_epi:  # SiLU-mul in the GEMM's epilogue: the down projection's input by position, [L, I]
            a2 = moe_gemm_silu(a1, w13, w13_scales, sorted_ids, expert_ids, num_padded, t * top_k, top_k, bs,
                               tables_ready=MOE_W13_READY_TABLES)
        else:
            gemm1 = moe_gemm_ready_tables if MOE_W13_READY_TABLES else moe_gemm
            c1 = gemm1(a1, w13, w13_scales, w13_zeros, sorted_ids, expert_ids, num_padded, None, t * top_k, top_k, bs,
                       True)
    tw = topk_weights.reshape(-1).to(torch.float32)
    by_position = w2_perm is not None or gathered
    splits = 1 if shift else _down_splits(hidden, bs, t * top_k, e, inter, w2, w2_scales, w2_zeros)
    if not by_position:
        c2 = silu_mul(c1, inter)  # [T*k, I]
        c3 = torch.ops.jitmarlin.moe_gemm_ready_tables(c2, w2, w2_scales, w2_zeros, sorted_ids, expert_ids,
                                                       num_padded, tw, t * top_k, 1, bs, False, shift, clamp, splits)
    else:
        if not silu_epi:  # (else a2 came from the gate/up GEMM's SiLU epilogue)
            if MOE_SILU_GATHER:  # SiLU-mul and the gather in one kernel: [L, I] by position
                a2 = silu_gather_by_position(c1, inter, sorted_ids, expert_ids, num_padded, w2_perm, bs)
            else:
                a2 = gather_by_position(silu_mul(c1, inter), sorted_ids, expert_ids, num_padded, w2_perm, 1, bs)
        c3 = torch.ops.jitmarlin.moe_gemm_ready_tables(a2, w2, w2_scales, w2_zeros, sorted_ids, expert_ids,
                                                       num_padded, tw, t * top_k, 1, bs, True, 0, 0, splits)
    return topk_sum(c3, t, top_k, hidden.dtype)  # [T, H] (c3: [T*k, H], or [splits, T*k, H] fp32)
