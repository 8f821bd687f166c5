"""The GEMM kernel family shared by the dense and the MoE ops: compile-time keys, generated
instantiation sources, shared-memory sizes, the launch-parameter struct and the workspace.

A *family* (one cache module) fixes what changes the instruction stream of the whole kernel:
activation dtype, weight bits, zero points, group size, dense or MoE. Inside a family, a set of
*tile configs* (m tile, k tile, pipeline depth) is compiled, one cubin each, in parallel.
Everything else (columns per CTA, grid) is a run-time choice.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
from dataclasses import dataclass

import torch

from ..jit import driver
from ..jit.build import CompiledModule, get_module
from ..jit.spec import BuildSpec

DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
CTYPES = {"f16": "half", "bf16": "__nv_bfloat16"}


@dataclass(frozen=True)
class Family:
    dtype: str  # "f16" | "bf16"
    bits: int  # 4 | 8
    zero_points: bool  # False: symmetric, zero 2**(bits-1) folded into the constants
    group_size: int  # -1 (per channel) or G
    moe: bool = False

    def __post_init__(self):
        if self.dtype not in CTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported: use f16 or bf16")
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} is not supported: use 4 or 8")
        check_group_size(self.group_size)

    @property
    def group_blocks(self) -> int:
        return -1 if self.group_size == -1 else self.group_size // 16

    @property
    def weight_type(self) -> str:
        # vLLM-like names: u4b8 = unsigned 4-bit with bias 8 (symmetric), u4 = with zero points
        return f"u{self.bits}" if self.zero_points else f"u{self.bits}b{1 << (self.bits - 1)}"

    def key(self) -> tuple[tuple[str, str], ...]:
        return (("dtype", self.dtype), ("weight", self.weight_type),
                ("group", "channel" if self.group_size == -1 else f"g{self.group_size}"),
                ("kind", "moe" if self.moe else "dense"))

    def cli_args(self) -> str:
        return (f"--dtype {self.dtype} --bits {self.bits} --group-size {self.group_size}"
                + (" --zero-points" if self.zero_points else "") + (" --moe" if self.moe else ""))


def check_group_size(g: int) -> None:
    """Group sizes the kernel takes: -1, 32, 64, or a multiple of 128 (a group shorter than the
    k tile must divide it; a longer one must be a multiple of it)."""
    if g == -1 or g in (32, 64) or (g > 0 and g % 128 == 0):
        return
    raise ValueError(f"group_size={g} is not supported: use -1 (per channel), 32, 64, or a multiple of 128")


@dataclass(frozen=True)
class Tile:
    m_blocks: int  # m tile = 16 * m_blocks rows (8 * m_blocks when swap)
    swap: bool  # transposed MMA (weights in the 16-row slot, groups of 8 tokens in the 8-column slot)
    k_blocks: int  # k tile = 16 * k_blocks
    stages: int  # pipeline depth (shared-memory ring slots)
    bulk: bool = False  # sm_90: producer warp + bulk copies + mbarrier ring (else cp.async ring)
    ksplit: int = 1  # warps sharing one 64-column strip, each on 1/ksplit of every k tile (bulk only)
    # bulk: math warps load their weight words straight into registers, this many tiles ahead; the
    # producer brings only A and the scales. Built in: dense w8_k128_s6_bk_dr1 / _dr2 and
    # w16_k128_s6_bk_dr1 (8-bit families: w8 dr1 only), 4-bit MoE w8_k128_s6_bk_dr1_o3; other
    # depths for experiments: probe_configs.py --extra-tiles
    direct: int = 0
    # tag _oN: N CTAs per SM at 4 math warps — the launch bounds cap the registers for it (bulk
    # tiles; built in for 4-bit MoE: w8_k128_s6_bk_dr1_o3, w16_k128_s3_bk_o3)
    occ: int = 0
    # tag _clN (dense bulk tiles, sm_90): launched in clusters of N CTAs (2, 4 or 8), each output
    # unit split evenly along K across one cluster and summed through distributed shared memory
    # instead of the striped global-memory fixup (gemm.choose_cluster decides when)
    cluster: int = 0

    @property
    def rows(self) -> int:
        return 8 * self.m_blocks if self.swap else 16 * self.m_blocks

    @property
    def tile_k(self) -> int:
        return 16 * self.k_blocks

    @property
    def max_warps(self) -> int:  # strips (64 columns each) a CTA may have
        if self.direct or self.occ:
            return 4  # registers: the prefetched weights need up to ~200 per thread; occ: its budget
        return (16 if (self.bulk and self.swap and self.m_blocks == 1) else 8) // self.ksplit

    @property
    def max_threads(self) -> int:  # __launch_bounds__: math warps + the producer warp of bulk tiles
        return self.threads(self.max_warps)

    def threads(self, nwarps: int) -> int:
        return 32 * (nwarps * self.ksplit + (1 if self.bulk else 0))

    @property
    def min_blocks(self) -> int:  # __launch_bounds__ minimum CTAs/SM
        if self.occ:
            return self.occ
        if self.bulk:
            return 2 if self.direct else 1
        return 2 if self.m_blocks == 1 else 1

    @property
    def acc(self) -> int:  # fp32 accumulators per thread
        return 16 * self.m_blocks if self.swap else 32 * self.m_blocks

    def tag(self) -> str:
        m = f"w{8 * self.m_blocks}" if self.swap else f"m{self.m_blocks}"
        return (f"{m}_k{self.tile_k}_s{self.stages}" + ("_bk" if self.bulk else "")
                + (f"_ks{self.ksplit}" if self.ksplit > 1 else "") + (f"_dr{self.direct}" if self.direct else "")
                + (f"_o{self.occ}" if self.occ else "") + (f"_cl{self.cluster}" if self.cluster else ""))

    @classmethod
    def from_tag(cls, tag: str) -> "Tile":
        """The inverse of tag(): "w16_k128_s5_bk" -> Tile(2, True, 8, 5, True) (for experiments
        with tiles outside the built-in lists, e.g. benchmarks/probe_configs.py --extra-tiles)."""
        m = re.fullmatch(r"(w|m)(\d+)_k(\d+)_s(\d+)(_bk)?(?:_ks(\d+))?(?:_dr(\d+))?(?:_o(\d+))?(?:_cl(\d+))?", tag)
        if m is None:
            raise ValueError(f"not a tile tag: {tag!r} (expected e.g. w8_k128_s6_bk, m1_k128_s4, w16_k128_s4_bk_ks2)")
        swap, rows, tile_k = m.group(1) == "w", int(m.group(2)), int(m.group(3))
        if (swap and rows % 8) or tile_k % 16:
            raise ValueError(f"tile tag {tag!r}: w<rows> needs a multiple of 8 rows, k a multiple of 16")
        return cls(rows // 8 if swap else rows, swap, tile_k // 16, int(m.group(4)), m.group(5) is not None,
                   int(m.group(6) or 1), int(m.group(7) or 0), int(m.group(8) or 0), int(m.group(9) or 0))


# Compiled in every family. Chosen from the tuning sweep in benchmarks/ (see NOTES.md).
TILES: tuple[Tile, ...] = (
    Tile(1, True, 8, 4), Tile(1, True, 8, 6), Tile(1, True, 4, 8),
    Tile(1, False, 8, 4), Tile(1, False, 8, 6), Tile(1, False, 4, 8),
    Tile(2, False, 8, 4), Tile(2, False, 4, 6),
    Tile(3, False, 8, 3), Tile(3, False, 4, 4),
    Tile(4, False, 8, 3), Tile(4, False, 4, 4),
)


# dense 4-bit M <= 8: the k-split ring in clusters of 8 CTAs, each output unit split along K across
# one cluster (gemm.choose_cluster; H200 session 11: 4096^2 8.6 -> 7.2 us, 14336x4096 15.8 -> 14.8;
# the direct-load tiles and the 16-row tile in cluster form measured no gain)
CLUSTER_TILE = Tile(1, True, 8, 6, True, 2, cluster=8)


# sm_90 and newer also get the producer-warp / bulk-copy tiles for small M (the H200 sweeps of
# benchmarks/NOTES.md kept the first seven out of 15 candidates; session 7 added the five-slot
# 16-row ring, the direct-load tile and the 32-row tile, each measured on the H200; session 9 the
# direct-load tile one tile ahead: 8-bit weights, and 4-bit above K*N = 64M).
BULK_TILES: tuple[Tile, ...] = (
    Tile(1, True, 8, 4, True), Tile(1, True, 8, 6, True), Tile(1, True, 4, 8, True), Tile(1, True, 8, 6, True, 2),
    Tile(2, True, 8, 4, True), Tile(2, True, 8, 5, True), Tile(2, True, 8, 6, True), Tile(1, False, 8, 4, True),
    Tile(1, True, 8, 6, True, direct=2), Tile(2, False, 8, 4, True), Tile(1, True, 8, 6, True, direct=1),
    Tile(2, True, 8, 6, True, direct=1),  # 4-bit dense M = 9-16 on mid-size problems (gemm.DIRECT_W16)
    # 4-bit MoE only (tile_fits): three CTAs per SM (H200, session 10: Mixtral 1 / 16 tokens -5 / -9%,
    # 32 tokens -17%; benchmarks/NOTES.md "three CTAs per SM")
    Tile(1, True, 8, 6, True, direct=1, occ=3), Tile(2, True, 8, 3, True, occ=3),
    CLUSTER_TILE,
)


def tiles_for(cc: tuple[int, int]) -> tuple[Tile, ...]:
    return TILES + (BULK_TILES if cc >= (9, 0) else ())


def kernel_name(fam: Family, tile: Tile) -> str:
    g = "gc" if fam.group_size == -1 else f"g{fam.group_size}"
    return f"jm_gemm_{fam.dtype}_{fam.weight_type}_{g}_{'moe_' if fam.moe else ''}{tile.tag()}"


def kernel_source(fam: Family, tile: Tile) -> str:
    return (
        "// generated by jitmarlin.ops._kernels: one instantiation of the GEMM template\n"
        '#include "jm_gemm.cuh"\n'
        f"JM_GEMM_KERNEL({kernel_name(fam, tile)}, {CTYPES[fam.dtype]}, {fam.bits}, "
        f"{'true' if fam.zero_points else 'false'}, {fam.group_blocks}, {tile.m_blocks}, "
        f"{'true' if tile.swap else 'false'}, {tile.k_blocks}, {tile.stages}, "
        f"{'true' if fam.moe else 'false'}, {'true' if tile.bulk else 'false'}, {tile.ksplit}, {tile.max_threads}, "
        f"{tile.min_blocks}, {tile.direct}, {tile.cluster})\n")


def dequant_kernel_name(fam: Family) -> str:
    g = "gc" if fam.group_size == -1 else f"g{fam.group_size}"
    return f"jm_dequant_{fam.dtype}_{fam.weight_type}_{g}"


def dequant_kernel_source(fam: Family) -> str:
    return (
        "// generated by jitmarlin.ops._kernels: packed weights -> W^T for the large-M cuBLAS path\n"
        '#include "jm_gemm.cuh"\n'
        f"JM_DEQUANT_KERNEL({dequant_kernel_name(fam)}, {CTYPES[fam.dtype]}, {fam.bits}, "
        f"{'true' if fam.zero_points else 'false'}, {fam.group_blocks})\n")


def gather_kernel_name(fam: Family) -> str:
    return f"jm_gather_{fam.dtype}"


def gather_kernel_source(fam: Family) -> str:
    return (
        "// generated by jitmarlin.ops._kernels: act-order column gather A[:, perm] before the GEMM\n"
        '#include "jm_gemm.cuh"\n'
        f"JM_GATHER_KERNEL({gather_kernel_name(fam)}, {CTYPES[fam.dtype]})\n")


# ---- the strip kernel (cuda_src/jm_strip.cuh): M <= 32 with no partial sums in global memory ----
# A module of its own per dense family on sm_90 (it launches clusters and waits on the previous kernel with
# griddepcontrol), built on the first strip launch (since session 52 the route takes it on small problems; the
# configs only A/B runs take are a second module: STRIP_ROUTED_CONFIGS). Configs: (warps per CTA, cluster size,
# token blocks of 8, ring in shared memory), one cubin each. The register ring's depth follows the bits and the token
# blocks; the shared-memory ring (smem = 1) holds strip_ring_rows(bits) rows per lane. Two token blocks (M <= 16)
# come without clusters of 4.
STRIP_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (16, 1, 1, 0), (16, 2, 1, 0), (16, 4, 1, 0), (8, 1, 1, 0), (8, 2, 1, 0), (4, 1, 1, 0),
    (16, 1, 2, 0), (16, 2, 2, 0), (8, 1, 2, 0), (8, 2, 2, 0), (4, 1, 2, 0),
    (16, 1, 1, 1), (16, 2, 1, 1), (8, 1, 1, 1), (4, 1, 1, 1), (16, 1, 2, 1), (16, 2, 2, 1), (4, 1, 2, 1),
    # session 56: 8-warp ring forms in clusters of 2 (A/B only): two CTAs per SM fit (registers and ~100 KB each), so
    # a call's CTAs can be resident while the previous call runs and, on small layers (4096^2: 16 rows per warp = the
    # ring), copy their whole share of the weights before griddepcontrol.wait
    (8, 2, 1, 1), (8, 2, 2, 1),
    # M = 17-32 (session 50): three / four token blocks, at most 8 warps per SM (~150 registers per thread)
    (8, 1, 3, 1), (4, 1, 3, 1), (8, 1, 4, 1), (8, 2, 4, 1), (4, 1, 4, 1), (8, 1, 4, 0))
STRIP_MAX_M = 32  # tokens: four n8 blocks of the transposed MMA
# The MoE form (expert blocks of 8 rows: a CTA per (block, strip), moe._moe_gemm_cuda): one token block, its own module
# per MoE family (family "strip_moe"), built on the first MoE call in blocks of 8 with the strip route on.
STRIP_MOE_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (16, 1, 1, 0), (8, 1, 1, 0), (4, 1, 1, 0), (16, 1, 1, 1), (8, 1, 1, 1), (4, 1, 1, 1))


# The configs the default route can take (gemm.strip_small / strip_tall: gemm.STRIP_ORDER's register-ring entries of
# one and two token blocks; since session 55 no shared-memory ring form, gemm.STRIP_RING_MIN_K): a dense family's
# first strip module ("strip", 10 kernels). The others, which only A/B runs and JITMARLIN_STRIP=1 launch, are a module
# of their own ("strip_ab", built on their first launch), so a model on sm_90 compiles the 10 and not all 26.
STRIP_ROUTED_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (16, 1, 1, 0), (16, 2, 1, 0), (16, 4, 1, 0), (8, 1, 1, 0), (8, 2, 1, 0), (4, 1, 1, 0),
    (16, 1, 2, 0), (16, 2, 2, 0), (8, 1, 2, 0), (4, 1, 2, 0))


def strip_configs(fam: Family) -> tuple[tuple[int, int, int, int], ...]:
    return STRIP_MOE_CONFIGS if fam.moe else STRIP_CONFIGS


def strip_module_configs(fam: Family, ab: bool = False) -> tuple[tuple[int, int, int, int], ...]:
    """The configs of one strip module: the routed ones (ab False) or the A/B-only rest of a dense family's (a MoE
    family has one module: strip_build_spec refuses ab for it)."""
    if fam.moe:
        return STRIP_MOE_CONFIGS
    return tuple(c for c in STRIP_CONFIGS if (c in STRIP_ROUTED_CONFIGS) != ab)


def strip_depth(bits: int, toks: int, smem: int = 0, perm: bool = False, zp: bool = False) -> int:
    """Register ring rows per lane: the weights' (register ring: 4-bit 8 with one token block, 6 with two, 4 with
    three or four, whose activations and sums take the registers; 8-bit half of that, the same bytes) or, with the
    weights' ring in shared memory, the activations' lead (4 rows; they come from L2). The 4-bit act-order forms
    (perm) hold a batch of gathered halves next to the weights: 6 rows with zero points, 4 with two token blocks
    (within 128 registers without spills, ptxas sm_90, session 54)."""
    if smem:
        return 4
    rows = 8 if toks == 1 else 6 if toks == 2 else 4
    if perm and bits == 4:
        rows = 4 if toks > 1 else 6 if zp else 8
    return rows if bits == 4 else rows // 2


def strip_token_blocks(m: int) -> int:
    """Blocks of 8 tokens for M rows (1-4)."""
    return -(-m // 8)


def strip_ring_rows(bits: int, smem: int, toks: int = 1, perm: bool = False) -> int:
    """Rows per lane of the shared-memory ring (0: none). Act-order forms: 24 for 4-bit, 12 for 8-bit (12 KB of
    weights per warp). Else the activations ride in the ring too (TOKS x 256 bytes per row and warp, session 54):
    as many rows (a multiple of 4) as fit 12 KB per warp at 16 warps (one and two token blocks) or 24 KB at 8 (three
    and four): 4-bit 16 / 12 / 16 / 16, 8-bit 8 / 8 / 12 / 12 for one to four token blocks."""
    if not smem:
        return 0
    if perm:
        return 24 if bits == 4 else 12
    budget = 12 * 1024 if toks <= 2 else 24 * 1024
    return budget // ((bits // 4) * 512 + toks * 256) // 4 * 4


def strip_smem_bytes(fam: Family, warps: int, smem: int, perm: bool = False, k: int = 0, cluster: int = 1,
                     toks: int = 1) -> int:
    """Dynamic shared memory of a strip launch: the warps' rings (16 warps: 192 KB; one CTA per SM), or for an
    act-order form with register rings (perm) the CTA's part of the permutation, 64 bytes per k16 row of its
    share of K (cluster: CTAs splitting K)."""
    if perm and not smem:
        return 64 * -(-(k // 16) // cluster)
    act = 0 if perm else toks * 256
    return warps * strip_ring_rows(fam.bits, smem, toks, perm) * ((fam.bits // 4) * 512 + act)


def strip_kernel_name(fam: Family, warps: int, cluster: int, toks: int, smem: int = 0, perm: bool = False) -> str:
    g = "gc" if fam.group_size == -1 else f"g{fam.group_size}"
    return (f"jm_strip_{fam.dtype}_{fam.weight_type}_{g}_{'moe_' if fam.moe else ''}w{warps}_c{cluster}_t{toks}"
            + ("_s" if smem else "") + ("_p" if perm else ""))


def strip_kernel_source(fam: Family, warps: int, cluster: int, toks: int, smem: int = 0, perm: bool = False) -> str:
    """perm: the act-order form, which gathers the activation columns through the layer's permutation itself."""
    return (
        "// generated by jitmarlin.ops._kernels: the strip kernel for M <= 32 (cuda_src/jm_strip.cuh)\n"
        '#include "jm_strip.cuh"\n'
        f"JM_STRIP_KERNEL({strip_kernel_name(fam, warps, cluster, toks, smem, perm)}, {CTYPES[fam.dtype]}, "
        f"{fam.bits}, {'true' if fam.zero_points else 'false'}, {fam.group_blocks}, {warps}, "
        f"{strip_depth(fam.bits, toks, smem, perm, fam.zero_points)}, {cluster}, {toks}, "
        f"{strip_ring_rows(fam.bits, smem, toks, perm)}, "
        f"{'true' if perm else 'false'}, {'true' if fam.moe else 'false'})\n")


def strip_built(fam: Family, cc: tuple[int, int]) -> bool:
    """Whether the family has strip kernels (sm_90 and newer; MoE families: the MoE form)."""
    return cc >= (9, 0)


@functools.lru_cache(maxsize=None)
def strip_build_spec(fam: Family, cc: tuple[int, int], perm: bool = False, ab: bool = False) -> BuildSpec:
    """The family's strip kernels the route takes, one module (built on the first strip launch); perm: their act-order
    forms, a module of their own (on the first act-order strip launch); ab: the configs only A/B runs launch."""
    if not strip_built(fam, cc) or (perm and fam.moe) or (ab and fam.moe):
        raise ValueError(f"the strip kernels are built on sm_90 and newer (act-order forms and A/B configs for dense "
                         f"families), not {fam}{' act-order' if perm else ''}{' A/B' if ab else ''} on "
                         f"sm_{cc[0]}{cc[1]}")
    sources = tuple((strip_kernel_name(fam, *cfg, perm=perm), strip_kernel_source(fam, *cfg, perm=perm))
                    for cfg in strip_module_configs(fam, ab))
    family = ("strip_moe" if fam.moe else "strip_perm" if perm else "strip") + ("_ab" if ab else "")
    if fam.moe or ab:
        hint = ("(`jitmarlin build` does not prebuild the strip kernels only JITMARLIN_STRIP=1 and A/B runs launch"
                f"{' (the MoE form)' if fam.moe else ''}: unset JITMARLIN_DISABLE_JIT for their first launch)")
    else:
        hint = f"jitmarlin build --arch {cc[0]}.{cc[1]} {fam.cli_args()}{' --act-order' if perm else ''}"
    return BuildSpec(family=family, cc=cc, key=fam.key(), sources=sources, flags=extra_nvcc_flags(), cli_hint=hint)


@functools.lru_cache(maxsize=None)
def build_spec(fam: Family, cc: tuple[int, int], tiles: tuple[Tile, ...] | None = None) -> BuildSpec:
    if tiles is None:
        tiles = tiles_for(cc)
    tiles = tuple(t for t in tiles if tile_fits(fam, t))  # e.g. no direct-load tiles in MoE or 8-bit families
    sources = tuple((kernel_name(fam, t), kernel_source(fam, t)) for t in tiles)
    if not fam.moe:
        sources += ((dequant_kernel_name(fam), dequant_kernel_source(fam)),
                    (gather_kernel_name(fam), gather_kernel_source(fam)))
    return BuildSpec(
        family="moe" if fam.moe else "gemm", cc=cc, key=fam.key(), sources=sources, flags=extra_nvcc_flags(),
        cli_hint=f"jitmarlin build --arch {cc[0]}.{cc[1]} {fam.cli_args()}")


# ---- the MoE path's small kernels (cuda_src/jm_moe_util.cuh; on by default, JITMARLIN_MOE_KERNELS=0) ----

class MoeParams(ctypes.Structure):  # mirrors JmMoeParams
    _fields_ = [
        ("ids", ctypes.c_void_p), ("sorted_ids", ctypes.c_void_p), ("expert_ids", ctypes.c_void_p),
        ("num_padded", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
        ("numel", ctypes.c_int32), ("num_experts", ctypes.c_int32), ("block", ctypes.c_int32),
        ("max_len", ctypes.c_int32), ("blocks", ctypes.c_int32), ("ids_64", ctypes.c_int32),
        ("rows", ctypes.c_int32), ("inter", ctypes.c_int32), ("top_k", ctypes.c_int32),
        ("perm", ctypes.c_void_p), ("route_ids", ctypes.c_void_p), ("renorm", ctypes.c_int32),
        ("splits", ctypes.c_int32),
    ]


MOE_UTIL_KERNELS = (("jm_moe_align", "JM_MOE_ALIGN_KERNEL(jm_moe_align)"),
                    ("jm_silu_mul_f16", "JM_SILU_MUL_KERNEL(jm_silu_mul_f16, half)"),
                    ("jm_silu_mul_bf16", "JM_SILU_MUL_KERNEL(jm_silu_mul_bf16, __nv_bfloat16)"),
                    ("jm_topk_sum_f16", "JM_TOPK_SUM_KERNEL(jm_topk_sum_f16, half)"),
                    ("jm_topk_sum_bf16", "JM_TOPK_SUM_KERNEL(jm_topk_sum_bf16, __nv_bfloat16)"),
                    ("jm_topk_sum_f32_f16", "JM_TOPK_SUM_F32_KERNEL(jm_topk_sum_f32_f16, half)"),
                    ("jm_topk_sum_f32_bf16", "JM_TOPK_SUM_F32_KERNEL(jm_topk_sum_f32_bf16, __nv_bfloat16)"),
                    ("jm_moe_gather_f16", "JM_MOE_GATHER_KERNEL(jm_moe_gather_f16, half)"),
                    ("jm_moe_gather_bf16", "JM_MOE_GATHER_KERNEL(jm_moe_gather_bf16, __nv_bfloat16)"),
                    ("jm_silu_gather_f16", "JM_SILU_GATHER_KERNEL(jm_silu_gather_f16, half)"),
                    ("jm_silu_gather_bf16", "JM_SILU_GATHER_KERNEL(jm_silu_gather_bf16, __nv_bfloat16)"),
                    ("jm_moe_route_f16", "JM_MOE_ROUTE_KERNEL(jm_moe_route_f16, half)"),
                    ("jm_moe_route_bf16", "JM_MOE_ROUTE_KERNEL(jm_moe_route_bf16, __nv_bfloat16)"))


@functools.lru_cache(maxsize=None)
def moe_util_build_spec(cc: tuple[int, int]) -> BuildSpec:
    sources = tuple((name, "// generated by jitmarlin.ops._kernels: MoE helper kernel\n"
                           f'#include "jm_moe_util.cuh"\n{macro}\n') for name, macro in MOE_UTIL_KERNELS)
    return BuildSpec(family="moeutil", cc=cc, key=(("kind", "moe-util"),), sources=sources, flags=extra_nvcc_flags(),
                     cli_hint=f"jitmarlin build --arch {cc[0]}.{cc[1]} --moe")


@functools.lru_cache(maxsize=None)
def get_moe_util_kernel(name: str, device_index: int, cc: tuple[int, int]) -> driver.Function:
    mod = get_module(moe_util_build_spec(cc))
    return driver.get_function(mod.cubin(name), name, device_index)


# ---- the sm_90a warpgroup-MMA kernel (MoE blocks of 64 and 128 rows, mid-size M; see gemm.use_wgmma_path) ----
# (token tile NT, 64-feature strips per warpgroup FW, pipeline stages) compiled per family;
# cuda_src/jm_wgmma.cuh. A CTA covers 128 * FW features x NT tokens.
# 16- and 32-token tiles (m64n16k16 / m64n32k16) serve M = 9-32 without padding to 64 tokens.
# (128, 2, 4) left the list in session 16: 128-token tiles run one strip per warpgroup everywhere
# (gemm.wgmma_config); probes build it with --extra-wgmma 128-2-4.
# (64, 2, 4) left it in session 17: dense 64-token tiles take one strip too (--extra-wgmma 64-2-4 for probes;
# MoE blocks of 64 keep it).
WGMMA_CONFIGS: tuple[tuple[int, int, int], ...] = ((16, 1, 8), (32, 1, 8), (32, 2, 8), (64, 1, 6), (128, 1, 4))
# MoE: the m tile is the expert block: 64 rows, or 128 (many tokens per expert; JITMARLIN_WGMMA=1)
# with one strip per warpgroup (two spill registers in the MoE variant of some formats)
# Dense tiles of at least this many tokens read their activations by TMA (jm_wgmma.cuh, wg_tma);
# every wgmma kernel takes a tensor map as its second parameter, the others an unused empty one.
WGMMA_TMA_MIN_NT = 64
NO_TENSOR_MAP = driver.TensorMap()

# Two-strip dense configs (NT, 2, STAGES) also built in the "wide" form: four warpgroups of one
# strip each (512 threads, the same ring, grid and workspace; jm_wgmma.cuh JM_WGMMA_KERNEL_WIDE).
# (128, 2, 4): the route for M > 128 on large problems since session 17 (gemm.wgmma_route_config);
# probes add more (benchmarks/probe_configs.py --extra-wgmma NT-2-STAGES-w).
WGMMA_WIDE_CONFIGS: tuple[tuple[int, int, int], ...] = ((128, 2, 4),)

# The producer form (jm_wgmma.cuh, WgRing / JM_WGMMA_KERNEL_PROD): (NT, FW, STAGES) dense configs also
# built with a producer warpgroup that issues every copy (TMA activations at any token tile, bulk
# weights, scales, zero points) and gives its registers (setmaxnreg) to one compute warpgroup of
# 2 FW strips; 256 threads, two CTAs per SM (three: WGMMA_PROD_CTAS):
# FW = 1 (128 features): two strips, any token tile;
# FW = 2 (256 features, session 20): four strips, token tiles of up to 32 (64 tokens: slower, and the
# stream-K partial sums would outgrow gemm.wgmma_split_bound; 128: too many accumulators); probes only.
# (Session 19's FW = 2 form, two compute warpgroups of two strips and one CTA per SM, lost 5-10%.)
# (64, 1, 6), (32, 1, 6) at three CTAs per SM and (16, 1, 8) (fp16 8-bit weights at M = 9-16, session
# 21): routed on large problems (gemm.wgmma_route_prod); probes add others (probe_configs.py
# --extra-wgmma NT-FW-STAGES-p, or -p3 for three CTAs per SM).
WGMMA_PROD_CONFIGS: tuple[tuple[int, int, int], ...] = ((64, 1, 6), (32, 1, 6), (16, 1, 8))
# Dense 4-bit families also build these (dense_prod_configs): (16, 1, 7) at three CTAs per SM
# (WGMMA_PROD_CTAS_U4), the 16-token route of the shapes where it measured fastest (gemm.WGMMA_PROD_N16_U4,
# session 38: fp16 4096x12288 M = 9 / 16 15.8 / 15.9 -> 14.3 / 14.4 us).
WGMMA_PROD_CONFIGS_U4: tuple[tuple[int, int, int], ...] = ((16, 1, 7),)
WGMMA_PROD_FW2_MAX_NT = 32
# Producer configs built for three CTAs per SM instead of two (12 compute warps per SM; 120 registers
# per compute thread, one accumulator set: FW = 1 and token tiles of up to 32 only, where ptxas keeps
# the wgmma pipelined; six stages of a 4-bit 32-token tile take 3 x 55 KB of shared memory). Kernel
# names end in _c3.
WGMMA_PROD_CTAS: dict[tuple[int, int, int], int] = {(32, 1, 6): 3, (24, 1, 6): 3}


# 4-bit families' producer configs at four CTAs per SM (16 compute warps per SM): the MoE blocks of 24 rows,
# whose six 4-bit stages take 49 KB (8-bit stages do not fit four CTAs: WGMMA_PROD_CTAS's three). 64
# registers at launch, 88 for the compute warpgroup (setmaxnreg 40 + 88 = 2 x 64), no spills and no wgmma
# serialization in the 4-bit formats (the 32-token tile serializes at 88: not built). H200 session 28
# (probe_moe_tiles, Mixtral layer us, blocks of 24, three / four CTAs, two rounds each): 48 tokens 307.7,
# 307.2 / 297.7, 301.6; 56 308.2, 309.0 / 300.3, 303.3; 64 310.5, 313.0 / 310.7, 304.1; 72 349.7, 347.4 /
# 341.8, 337.3. ncu at 64 tokens: eligible warps per scheduler 1.1 -> 1.4, the gate/up GEMM 203 -> 197 us.
# The MoE blocks of 48 rows at three CTAs per SM (12 compute warps; 120 registers per compute thread, without
# the group-scale form there: it spilled, wgmma_scales_on_sums) — H200 session 32 (probe_moe_tiles, layer us,
# two / three CTAs per SM, interleaved rounds): E=64 top-6 288 tokens 197.7, 200.1 / 187.4, 185.4; 320 199.8,
# 199.4 / 189.3, 186.9; 384 207.3, 205.5 / 196.4, 193.9 (bf16 288 205.3, 207.1 / 190.0, 190.5); Mixtral 112
# tokens 378.4, 380.5, 379.2 / 352.3, 356.7, 354.7; 128 379.4, 386.1, 386.6 / 371.3, 379.9, 375.4; 144 385.5,
# 393.9, 391.1 / 385.1, 376.6, 381.3 (NOTES.md session 32).
# (16, 1, 7): the dense 16-token producer form at three CTAs per SM (WGMMA_PROD_CONFIGS_U4; 64 registers at
# launch, no spills), session 38.
WGMMA_PROD_CTAS_U4: dict[tuple[int, int, int], int] = {(24, 1, 6): 4, (48, 1, 6): 3, (16, 1, 7): 3}
# 4-bit MoE families only (the dense 32-token producer form lost 4-5% at four CTAs per SM, session 28): the
# MoE blocks of 32 rows at four CTAs per SM (two fragment buffers, 88 registers per compute thread, no
# group-scale form there). H200 session 32 (probe_moe_tiles, E=64 top-6 layer us, the plain form's blocks of 32
# / the producer form's at four CTAs, two interleaved rounds): 192 tokens 163.1, 162.7 / 154.9, 154.9; 256
# 168.7, 167.6 / 159.1, 159.0. Session 28 (Mixtral, three / four CTAs): 80 tokens 328.4, 327.2 / 323.8, 321.5;
# 96 358.7, 355.2 / 337.1, 357.4.
# Session 34: the 4-bit MoE blocks of 16 rows (WGMMA_MOE_PROD_CONFIGS_U4) at four CTAs per SM (64 registers at
# launch, no spills in the 4-bit formats). H200 (probe_moe_tiles --prod-configs 16-1-S --prod-ctas, Mixtral layer
# us at 16 / 32 / 40 tokens, blocks of 16 forced): two CTAs (16, 1, 8) 327.5 / 328.9 / 329.7, three (16, 1, 6)
# 273.1 / 273.7 / 273.2, (16, 1, 10) 276.2 / 277.0 / 278.1, four (16, 1, 6) 256.5 / 257.7 / 258.1, (16, 1, 7)
# 258.7 / 259.7 / 261.0.
WGMMA_PROD_CTAS_MOE_U4: dict[tuple[int, int, int], int] = {(32, 1, 6): 4, (16, 1, 6): 4}


def prod_ctas(cfg: tuple[int, int, int], bits: int = 0, moe: bool = False) -> int:
    """CTAs per SM of the producer-form config cfg = (NT, FW, STAGES) of a family of `bits`-bit weights
    (`moe`: a MoE family): 2, or WGMMA_PROD_CTAS's, or for 4 bits WGMMA_PROD_CTAS_U4's, or for 4-bit MoE
    WGMMA_PROD_CTAS_MOE_U4's (kernel names end in _c3 / _c4)."""
    cfg = tuple(cfg[:3])
    if bits == 4 and moe and cfg in WGMMA_PROD_CTAS_MOE_U4:
        return WGMMA_PROD_CTAS_MOE_U4[cfg]
    if bits == 4 and cfg in WGMMA_PROD_CTAS_U4:
        return WGMMA_PROD_CTAS_U4[cfg]
    return WGMMA_PROD_CTAS.get(cfg, 2)


def wgmma_scales_on_sums(bits: int, group: int, nt: int, ctas: int = 1, prod: bool = False, moe: bool = False,
                         fw: int = 1, zp: bool = False, dtype: str = "f16") -> bool:
    """Whether the wgmma kernel of this format and config (NT = nt, fw, producer form or not, `ctas` CTAs
    per SM) applies group scales to fp32 sums of whole groups (jm_wgmma.cuh kGacc, built unless
    -DJM_WG_NO_GACC) instead of to each weight: weights in groups of 64 or 128, at most two strips
    per warpgroup, token tiles of up to 32 (the producer form's up to 64); 4-bit weights at up to two
    CTAs per SM, three with tiles of up to 32 (four: up to 24), with zero points (`zp`) not on 32-token
    tiles; 8-bit at up to two, with zero points only on 16-token tiles; the plain MoE form only for fp16 4-bit; bf16 (`dtype`
    "bf16") only on the dense plain 4-bit tiles (with the probe flag -DJM_WG_GACC_BF16 by the fp16 rule).
    Kernels on either side of this round their fp32 sums differently (tests compare those bit for bit only
    on the same side)."""
    flags = extra_nvcc_flags()
    strips = 2 * fw if prod else fw
    fits = (((ctas <= 2 or (ctas == 3 and nt <= 32) or nt <= 24) and not (zp and nt == 32)) if bits == 4
            else (ctas <= 2 and (not zp or nt <= 16)))
    bf16 = dtype == "bf16" and "-DJM_WG_GACC_BF16" not in flags
    return (bits in (4, 8) and group in (64, 128) and strips <= 2 and fits
            and (nt <= 32 or (nt <= 64 and prod)) and (prod or not moe or bits == 4)
            and (not bf16 or (bits == 4 and not prod and not moe))
            and "-DJM_WG_NO_GACC" not in flags)


# (32, 2, 8) left the MoE list in session 17: blocks of 32 rows take one strip (moe._launch_wgmma_moe;
# probe_moe_tiles.py --fw 2 builds it back)
WGMMA_MOE_CONFIGS: tuple[tuple[int, int, int], ...] = ((32, 1, 8), (64, 1, 6), (64, 2, 4), (128, 1, 4))
# The MoE kernel's producer form (session 25; jm_wgmma.cuh JM_WGMMA_KERNEL_PROD_MOE): (NT, FW, STAGES) as
# the dense producer configs (one compute warpgroup of 2 FW strips, prod_ctas CTAs per SM: for 4-bit weights
# four for (32, 1, 6) and (24, 1, 6), three for (48, 1, 6); 8-bit three for (32, 1, 6) and (24, 1, 6); two
# otherwise — launch bounds: where the stages do not fit that many, the launch takes the occupancy), reading activations pre-gathered in slot-list order (moe.MOE_WGMMA_PROD_BLOCKS).
# (64, 1, 6) measured level with the plain kernel (moe.py): probes build it (probe_moe_tiles.py
# --prod-configs 64-1-6). (24, 1, 6) (session 26, three CTAs per SM; four in 4-bit families since session
# 28: WGMMA_PROD_CTAS_U4), (48, 1, 6), (80, 1, 6), (96, 1, 5)
# (session 27, two): blocks of 24 / 48 / 80 / 96 rows (m64nNTk16; 24, 80, 96 on this form only), chosen by
# moe.choose_block_size's cover rule; session 32: 4-bit (48, 1, 6) at three, MoE (32, 1, 6) at four.
WGMMA_MOE_PROD_CONFIGS: tuple[tuple[int, int, int], ...] = ((32, 1, 6), (24, 1, 6), (48, 1, 6), (80, 1, 6), (96, 1, 5))
# ... and in 4-bit MoE families only (8-bit stages do not fit four CTAs per SM, and at two this form lost to the
# mma.sync kernel's 16-row tile): (16, 1, 6), m64n16k16, for the blocks of 16 rows of large experts (session 34;
# moe.MOE_WGMMA_PROD_BLOCKS).
WGMMA_MOE_PROD_CONFIGS_U4: tuple[tuple[int, int, int], ...] = ((16, 1, 6),)


def moe_prod_configs(bits: int) -> tuple[tuple[int, int, int], ...]:
    """The producer-form configs (NT, FW, STAGES) a MoE family of `bits`-bit weights builds."""
    return WGMMA_MOE_PROD_CONFIGS + (tuple(c for c in WGMMA_MOE_PROD_CONFIGS_U4 if c not in WGMMA_MOE_PROD_CONFIGS)
                                     if bits == 4 else ())


def dense_prod_configs(bits: int) -> tuple[tuple[int, int, int], ...]:
    """The producer-form configs (NT, FW, STAGES) a dense family of `bits`-bit weights builds."""
    return WGMMA_PROD_CONFIGS + (tuple(c for c in WGMMA_PROD_CONFIGS_U4 if c not in WGMMA_PROD_CONFIGS)
                                 if bits == 4 else ())


def _checked_prod_configs(bits: int) -> tuple[tuple[int, int, int], ...]:
    """The producer form's kernels of a dense family of `bits`-bit weights: (NT, FW, STAGES), one compute
    warpgroup of 2 FW strips (FW 1, or 2 with token tiles of at most WGMMA_PROD_FW2_MAX_NT)."""
    configs = dense_prod_configs(bits)
    for cfg in configs:
        if len(cfg) != 3 or cfg[1] not in (1, 2) or (cfg[1] == 2 and cfg[0] > WGMMA_PROD_FW2_MAX_NT):
            raise ValueError(f"producer-form config {cfg}: expected (NT, FW, STAGES) with FW 1 or 2 "
                             f"(FW 2 only with NT <= {WGMMA_PROD_FW2_MAX_NT})")
        ctas = prod_ctas(cfg, bits)
        if ctas not in (2, 3, 4) or (ctas > 2 and (cfg[1] != 1 or cfg[0] > 32)):
            raise ValueError(f"producer-form config {cfg}: {ctas} CTAs per SM; 2, or 3 / 4 with FW 1 and NT <= 32")
    return configs


WGMMA_PROD_THREADS = 256  # a producer-form CTA: one compute warpgroup (of 2 FW strips) + the producer's

# (NT, FW, STAGES) dense configs also built in the producer form with two compute warpgroups of FW strips each
# (jm_wgmma.cuh JM_WGMMA_KERNEL_PROD with WGS = 2, MINB = 1: 384 threads, one CTA per SM, the compute warpgroups
# at 232 registers), which may run stream-K at 128 tokens (the plain and wide 128-token kernels spill with it;
# this one 28 bytes in the stream-K epilogue, after the main loop). Session 39: (128, 2, 4) with stream-K is routed
# where whole 128-token tiles fill SMs poorly (gemm.wgmma_route_stream2). Probes build others:
# benchmarks/probe_configs.py --extra-wgmma NT-FW-STAGES-p2, configs wgmma-n{NT}-f{FW}-s{STAGES}[-sk]-p2.
# Kernel names end in _prod2.
# Sessions 41-42: token tiles of 144 / 160 / 192 / 256 rows (gemm.wgmma_route_tall, M = 129-1024); session 48:
# 176 / 208 / 224 / 240 rows too (priced by the cost model above M = 256: less padding, e.g. M = 416 = 2 x 208).
WGMMA_PROD2_CONFIGS: tuple[tuple[int, int, int], ...] = ((128, 2, 4), (144, 2, 4), (160, 2, 4), (144, 1, 6), (176, 1, 6),
                                                         (192, 1, 6), (208, 1, 6), (224, 1, 5), (240, 1, 5), (256, 1, 4))
WGMMA_PROD2_THREADS = 384


def wgmma_kernel_name(fam: Family, nt: int, fw: int, stages: int, wide: bool = False, prod: int = 0) -> str:
    """prod: 0 the plain form, 1 (True) the producer form, 2 its two-compute-warpgroup form (WGMMA_PROD2_CONFIGS)."""
    g = "gc" if fam.group_size == -1 else f"g{fam.group_size}"
    ctas = prod_ctas((nt, fw, stages), fam.bits, fam.moe) if prod == 1 else 2
    return (f"jm_wgmma_{fam.dtype}_{fam.weight_type}_{g}_{'moe_' if fam.moe else ''}n{nt}_f{fw}_s{stages}"
            f"{'_wide' if wide else ''}{'_prod2' if prod == 2 else '_prod' if prod else ''}"
            f"{f'_c{ctas}' if ctas != 2 else ''}")


def wgmma_smem_bytes(fam: Family, nt: int, fw: int, stages: int) -> int:
    """Shared memory of the ring (mirrors WgmmaStage in cuda_src/jm_wgmma.cuh), plus 1 KB the kernel
    may skip to align it to 1024 bytes."""
    strips = 2 * fw
    gb = fam.group_blocks
    rows = 0 if gb <= 0 else (1 if gb >= 4 else 4 // gb)
    stage = (nt * 64 * 2 + strips * 4 * 32 * fam.bits * 4 + rows * strips * 64 * 2
             + (rows * strips * 64 * fam.bits // 8 if fam.zero_points else 0))
    return stages * (-(-stage // 1024) * 1024) + 1024


@functools.lru_cache(maxsize=None)
def wgmma_build_spec(fam: Family, cc: tuple[int, int]) -> BuildSpec:
    if cc != (9, 0):
        raise ValueError(f"the wgmma kernels are built for sm_90a only, not sm_{cc[0]}{cc[1]}")
    sources = tuple(
        (wgmma_kernel_name(fam, nt, fw, st),
         "// generated by jitmarlin.ops._kernels: one instantiation of the sm_90a wgmma GEMM\n"
         '#include "jm_wgmma.cuh"\n'
         f"JM_WGMMA_KERNEL({wgmma_kernel_name(fam, nt, fw, st)}, {CTYPES[fam.dtype]}, {fam.bits}, "
         f"{'true' if fam.zero_points else 'false'}, {fam.group_blocks}, {nt}, {fw}, {st}, "
         f"{'true' if fam.moe else 'false'})\n")
        for nt, fw, st in (WGMMA_MOE_CONFIGS if fam.moe else WGMMA_CONFIGS))
    if not fam.moe:
        sources += tuple(
            (wgmma_kernel_name(fam, nt, fw, st, wide=True),
             "// generated by jitmarlin.ops._kernels: one instantiation of the sm_90a wgmma GEMM, four warpgroups\n"
             '#include "jm_wgmma.cuh"\n'
             f"JM_WGMMA_KERNEL_WIDE({wgmma_kernel_name(fam, nt, fw, st, wide=True)}, {CTYPES[fam.dtype]}, "
             f"{fam.bits}, {'true' if fam.zero_points else 'false'}, {fam.group_blocks}, {nt}, {st})\n")
            for nt, fw, st in WGMMA_WIDE_CONFIGS)
    # JM_WGMMA_KERNEL_PROD / _PROD_MOE(..., NT, FW = 2 fw strips on the compute warpgroup, STAGES, WGS = 1
    # compute warpgroup, MINB = CTAs per SM: prod_ctas)
    macro, prod_configs = (("JM_WGMMA_KERNEL_PROD_MOE", moe_prod_configs(fam.bits)) if fam.moe
                           else ("JM_WGMMA_KERNEL_PROD", _checked_prod_configs(fam.bits)))
    sources += tuple(
        (wgmma_kernel_name(fam, nt, fw, st, prod=True),
         f"// generated by jitmarlin.ops._kernels: one instantiation of the sm_90a wgmma {'MoE ' if fam.moe else ''}"
         "GEMM, producer form\n"
         '#include "jm_wgmma.cuh"\n'
         f"{macro}({wgmma_kernel_name(fam, nt, fw, st, prod=True)}, {CTYPES[fam.dtype]}, "
         f"{fam.bits}, {'true' if fam.zero_points else 'false'}, {fam.group_blocks}, {nt}, {2 * fw}, "
         f"{st}, 1, {prod_ctas((nt, fw, st), fam.bits, fam.moe)})\n")
        for nt, fw, st in prod_configs)
    if not fam.moe:  # JM_WGMMA_KERNEL_PROD(..., NT, FW strips per compute warpgroup, STAGES, WGS = 2, MINB = 1)
        sources += tuple(
            (wgmma_kernel_name(fam, nt, fw, st, prod=2),
             "// generated by jitmarlin.ops._kernels: one instantiation of the sm_90a wgmma GEMM, producer form with "
             "two compute warpgroups\n"
             '#include "jm_wgmma.cuh"\n'
             f"JM_WGMMA_KERNEL_PROD({wgmma_kernel_name(fam, nt, fw, st, prod=2)}, {CTYPES[fam.dtype]}, "
             f"{fam.bits}, {'true' if fam.zero_points else 'false'}, {fam.group_blocks}, {nt}, {fw}, {st}, 2, 1)\n")
            for nt, fw, st in WGMMA_PROD2_CONFIGS)
    return BuildSpec(family="wgmma", cc=cc, key=fam.key(), sources=sources, flags=extra_nvcc_flags(),
                     arch_specific=True, cli_hint=f"jitmarlin build --arch 9.0 {fam.cli_args()}")


@functools.lru_cache(maxsize=None)
def wgmma_module_ready(fam: Family) -> bool:
    """Whether the sm_90a module of this family is (or can be) built. When the route to it is
    automatic, a failure (nvcc without sm_90a, a JITMARLIN_DISABLE_JIT cache built without it) falls
    back to the mma.sync kernels with one warning instead of failing the call."""
    import warnings

    from ..errors import JitMarlinError

    try:
        get_module(wgmma_build_spec(fam, (9, 0)))
        return True
    except JitMarlinError as e:
        warnings.warn(f"jitmarlin: the sm_90a warpgroup-MMA kernels for {fam.cli_args()} are not available ({e}); "
                      "using the mma.sync kernels. JITMARLIN_WGMMA=0 skips them without this warning.",
                      RuntimeWarning, stacklevel=3)
        return False


@functools.lru_cache(maxsize=None)
def get_wgmma_kernel(fam: Family, nt: int, fw: int, stages: int, device_index: int,
                     wide: bool = False, prod: int = 0) -> driver.Function:
    mod = get_module(wgmma_build_spec(fam, (9, 0)))
    name = wgmma_kernel_name(fam, nt, fw, stages, wide, prod)
    return driver.get_function(mod.cubin(name), name, device_index)


@functools.lru_cache(maxsize=None)
def env_flag(name: str, default: bool = False) -> bool:
    """An on/off switch from the environment, read once per process: the launch path asks on every
    call. Off by default: only "1" turns it on; on by default: only "0" turns it off. (Tests that
    flip one call env_flag.cache_clear().)"""
    import os

    value = os.environ.get(name)
    if value is None:
        return default
    return value != "0" if default else value == "1"


def clear_kernel_caches() -> None:
    """Forget the build specs and kernel handles of this process (they hold $JITMARLIN_NVCC_FLAGS as
    it was at their first use), and the launches chosen from them: for tests and probes that switch
    the flags within one process. The compiled modules stay in the cache, keyed by their flags."""
    from . import gemm

    for fn in (build_spec, get_kernel, strip_build_spec, get_strip_kernel, moe_util_build_spec, get_moe_util_kernel,
               wgmma_build_spec, get_wgmma_kernel, wgmma_module_ready, gemm.prepare_launch, gemm.wgmma_launch):
        fn.cache_clear()


def extra_nvcc_flags() -> tuple[str, ...]:
    """$JITMARLIN_NVCC_FLAGS (whitespace-separated), appended to every kernel compile; part of the
    cache hash, so modules built with other flags never mix."""
    import os
    import shlex

    return tuple(shlex.split(os.environ.get("JITMARLIN_NVCC_FLAGS", "")))


def module(fam: Family, cc: tuple[int, int]) -> CompiledModule:
    return get_module(build_spec(fam, cc))


# ---- shared memory (mirrors GemmShape in cuda_src/jm_gemm.cuh; a CPU test compares them) ----

def group_rows(fam: Family, tile: Tile) -> int:
    gb = fam.group_blocks
    return tile.k_blocks // gb if (gb > 0 and gb < tile.k_blocks) else 1


def stage_bytes(fam: Family, tile: Tile, nwarps: int) -> int:
    a = tile.rows * (tile.tile_k * 2 + (16 if tile.bulk else 0))
    b = 0 if tile.direct else tile.k_blocks * 16 * 64 * fam.bits // 8
    s = group_rows(fam, tile) * 128 if fam.group_size != -1 else 0
    z = group_rows(fam, tile) * 64 * fam.bits // 8 if fam.zero_points else 0
    return a + nwarps * (b + s + z)


def reduce_bytes(tile: Tile, nwarps: int) -> int:
    """fp32 exchange space of the in-CTA k reduction (ksplit warps per strip)."""
    return (tile.ksplit - 1) * nwarps * 32 * tile.acc * 4


def smem_bytes(fam: Family, tile: Tile, nwarps: int) -> int:
    return tile.stages * stage_bytes(fam, tile, nwarps) + reduce_bytes(tile, nwarps) + cluster_bytes(tile, nwarps)


def cluster_bytes(tile: Tile, nwarps: int) -> int:
    """Receive space of a cluster tile (jm_gemm.cuh, "Cluster launch"): each CTA owns 1/cluster of
    every thread's accumulators and receives that slice from the cluster's other CTAs."""
    if tile.cluster <= 1:
        return 0
    return (tile.cluster - 1) * nwarps * 32 * (tile.acc // tile.cluster) * 4


def tile_fits(fam: Family, tile: Tile) -> bool:
    """Constraints between family and tile: the kernel's static_asserts; direct-load tiles in dense
    families, 8-bit weights one tile ahead and 8 rows only (their words are twice as many registers:
    two tiles ahead or 16 rows spill); the three-CTAs-per-SM tiles (occ) in 4-bit MoE families only
    (8-bit spills under their 128-register cap; dense problems measured slower on them, NOTES.md
    session 10), where the direct-load tile is built in that form only."""
    if tile.occ and not (fam.moe and fam.bits == 4):
        return False
    if tile.cluster and (fam.moe or fam.bits != 4 or not tile.bulk or tile.cluster not in (2, 4, 8)
                         or tile.acc // tile.cluster < 2):  # routed for 4-bit dense only (gemm.choose_cluster)
        return False
    if tile.direct and ((fam.moe and not tile.occ) or (fam.bits == 8 and (tile.direct > 1 or tile.rows > 8))):
        return False
    gb = fam.group_blocks
    return gb < 0 or tile.k_blocks % gb == 0 or gb % tile.k_blocks == 0


# ---- the launch parameter struct (mirrors cuda_src/jm_gemm_params.h) ----

class GemmParams(ctypes.Structure):
    _fields_ = [
        ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p),
        ("bias", ctypes.c_void_p), ("c", ctypes.c_void_p), ("ws", ctypes.c_void_p), ("counters", ctypes.c_void_p),
        ("sorted_ids", ctypes.c_void_p), ("expert_ids", ctypes.c_void_p), ("num_padded", ctypes.c_void_p),
        ("topk_weights", ctypes.c_void_p), ("perm", ctypes.c_void_p),
        ("b_expert_stride", ctypes.c_int64), ("s_expert_stride", ctypes.c_int64), ("z_expert_stride", ctypes.c_int64),
        ("m", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("lda", ctypes.c_int32),
        ("ldc", ctypes.c_int32), ("nwarps", ctypes.c_int32), ("grid", ctypes.c_int32), ("top_k", ctypes.c_int32),
        ("a_by_position", ctypes.c_int32), ("k_splits", ctypes.c_int32), ("tables_ready", ctypes.c_int32),
        ("ids_shift", ctypes.c_int32), ("num_experts", ctypes.c_int32), ("silu_out", ctypes.c_int32),
        ("timeline", ctypes.c_void_p),
    ]


# ---- the current stream, cheaply (every launch asks) ----

_raw_stream_fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cuda_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current_stream_handle(device: torch.device) -> int:
    """cudaStream_t of torch's current stream on `device` (CUDA graph capture records launches on
    it). torch's private raw getter when present (a few times cheaper than building a Stream)."""
    index = cuda_index(device)
    if _raw_stream_fn is not None:
        return _raw_stream_fn(index)
    return torch.cuda.current_stream(index).cuda_stream


# ---- workspace: partial sums of split units, and arrival counters (zero between launches) ----

def workspace_floats(grid: int, nwarps: int, tile: Tile) -> int:
    """fp32 partial-sum space a launch needs: two regions per CTA (jm_schedule.cuh)."""
    return 2 * grid * nwarps * 32 * tile.acc


class Workspace:
    """fp32 partial sums + int32 arrival counters for one device. The kernels leave the counters
    all zero after every launch (the partial sums need no reset). Two launches sharing a
    workspace must not run concurrently (e.g. on two streams): give each stream its own."""

    def __init__(self, device: torch.device, floats: int = 1 << 20, slots: int = 4096):
        self.device = torch.device(device)
        self.ws = torch.empty(floats, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(slots, dtype=torch.int32, device=self.device)
        # Buffers replaced by a larger one stay allocated: a CUDA graph captured earlier still
        # launches kernels that use them (the counters stay all zero after every launch).
        self._retired: list[torch.Tensor] = []

    def ensure(self, floats: int, slots: int) -> None:
        if floats <= self.ws.numel() and slots <= self.counters.numel():
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"jitmarlin needs a larger GEMM workspace ({floats} floats, {slots} counters; it has "
                f"{self.ws.numel()}, {self.counters.numel()}) while a CUDA graph is being captured. Run "
                "the largest shape once eagerly before capturing (a usual warm-up), or pass a "
                "jitmarlin.ops.Workspace of the needed size.")
        if floats > self.ws.numel():
            self._retired.append(self.ws)
            self.ws = torch.empty(floats, dtype=torch.float32, device=self.device)
        if slots > self.counters.numel():
            self._retired.append(self.counters)
            self.counters = torch.zeros(slots, dtype=torch.int32, device=self.device)

    def zero_(self) -> None:
        """Restore the all-zero counters (only needed after a failed launch)."""
        self.counters.zero_()


_workspaces: dict[int, Workspace] = {}
_ws_lock = threading.Lock()


def default_workspace(device: torch.device) -> Workspace:
    idx = cuda_index(device)
    ws = _workspaces.get(idx)
    if ws is None:
        with _ws_lock:
            ws = _workspaces.get(idx)
            if ws is None:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        "jitmarlin's first GEMM on this device runs inside CUDA graph capture; run it "
                        "once eagerly before capturing (it compiles/loads kernels and allocates its "
                        "workspace).")
                ws = _workspaces[idx] = Workspace(torch.device("cuda", idx))
    return ws


@functools.lru_cache(maxsize=None)
def get_kernel(fam: Family, tile: Tile | str | None, device_index: int, cc: tuple[int, int]) -> driver.Function:
    """The GEMM kernel of `tile`; with tile None the family's dequantize kernel, with "gather"
    its act-order column gather kernel ("gather_smem": the shared-memory form)."""
    mod = module(fam, cc)
    if tile is None:
        name = dequant_kernel_name(fam)
    elif tile == "gather":
        name = gather_kernel_name(fam)
    elif tile == "gather_smem":  # the shared-memory form, in the same module
        return driver.get_function(mod.cubin(gather_kernel_name(fam)), gather_kernel_name(fam) + "_smem", device_index)
    else:
        name = kernel_name(fam, tile)
    return driver.get_function(mod.cubin(name), name, device_index)


@functools.lru_cache(maxsize=None)
def get_strip_kernel(fam: Family, warps: int, cluster: int, toks: int, smem: int, device_index: int,
                     cc: tuple[int, int], perm: bool = False) -> driver.Function:
    """The strip kernel of (warps, cluster, token blocks, shared-memory ring), one of STRIP_CONFIGS, from the
    family's module (perm: its act-order form)."""
    if not strip_built(fam, cc) or (warps, cluster, toks, smem) not in strip_configs(fam) or (perm and fam.moe):
        raise ValueError(f"no strip kernel with {warps} warps in clusters of {cluster} for {toks} block(s) of 8 tokens "
                         f"{'with' if smem else 'without'} a shared-memory ring for {fam}{' act-order' if perm else ''}"
                         f" on sm_{cc[0]}{cc[1]}: built on sm_90+ with (warps, cluster, token blocks, smem) in "
                         f"{strip_configs(fam)} (act-order forms for dense families)")
    name = strip_kernel_name(fam, warps, cluster, toks, smem, perm)
    ab = not fam.moe and (warps, cluster, toks, smem) not in STRIP_ROUTED_CONFIGS
    return driver.get_function(get_module(strip_build_spec(fam, cc, perm, ab)).cubin(name), name, device_index)
