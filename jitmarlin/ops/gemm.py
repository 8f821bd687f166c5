"""The dense mixed-precision GEMM: C = A @ dequant(B), its tile heuristic and its custom op.

Shapes: A [..., K] fp16/bf16 (contiguous), B packed int32 [N/64, K/16, 32*bits]
(jitmarlin.quant.pack_weights), scales [K/G, N] (permuted, jitmarlin.quant.permute_scales) or
[1, N] per channel, zero points int32 [K/G, N*bits/32] (jitmarlin.quant.pack_zeros) or None for
symmetric weights, bias [N] or None. Result [..., N] in A's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..jit import driver
from ..jit.toolchain import device_capability
from . import _kernels as K
from . import tuning
from ._kernels import DTYPES, Family, Tile, Workspace

# ---- tile heuristic: a pure function, unit-tested on the CPU ----


@dataclass(frozen=True)
class Plan:
    tile: Tile
    nwarps: int  # CTA = 32 * nwarps threads, 64 * nwarps output columns
    smem: int  # dynamic shared memory bytes


# Preferred (tile, warps per CTA), most preferred first, per m class and problem size. From the
# H200 sweep of every tile config x CTA width on the six benchmark shapes (benchmarks/NOTES.md,
# "tuning sweep"); the alternatives only serve shapes the first choice cannot take.
_SMALL_KN = 1 << 26  # K*N below this: few tiles per SM, deeper pipelines and fewer CTAs win
_TINY_KN = 1 << 25  # K*N below this at M <= 8: the k-split ring beats the direct-load tile
DIRECT_W8 = Tile(1, True, 8, 6, True, direct=2)
DIRECT_W8_1 = Tile(1, True, 8, 6, True, direct=1)  # one tile ahead (8-bit weights: the only depth, tile_fits)
# Below K*N = 64M the one-ahead tile also wins on wide problems (many 256-column units) with K >= 4096.
# H200 session 23 (probe_configs, us at M = 1 / 4 / 8, one ahead vs two): 4096x12288 12.1 / 12.4 / 12.4 vs
# 12.7 / 13.0 / 13.1, 4096x11008 11.8 / 12.1 / 12.2 vs 12.3 / 12.6 / 12.8, 4096x14336 13.3 / 13.4 / 13.5 vs
# 13.7 / 14.0 / 14.2; two ahead stays ahead on 4096x8192 (10.4 vs 10.9 at M=1), 5120x8192 (11.4 vs 11.9),
# 2048x16384 (9.3 vs 9.6), 11008x4096 (14.3 vs 14.6) and 12288x4096 (14.6 vs 15.1; its route there: 13.0).
DIRECT1_MIN_K, DIRECT1_MIN_N = 4096, 10240
# M = 9-16, 4-bit dense, K*N in [32M, 72M]: the 16-row direct-load tile one tile ahead. H200, session
# 10 (probe_configs.py, M = 9 / 16, us): 8192^2 18.9 / 19.2 vs 20.6 / 20.4 (five-slot ring),
# 14336x4096 20.1 / 20.3 vs 20.9 / 21.3 (m1_k128_s6), 4096x11008 15.3 / 15.5 vs 18.5 / 18.8; slower
# on 4096x28672 (26.7 / 26.9 vs 26.1 / 25.6); 8-bit weights spill in it (tile_fits)
DIRECT_W16 = Tile(2, True, 8, 6, True, direct=1)
_W16_DIRECT_MAX = 72 << 20
# 4-bit MoE, three CTAs per SM (tile_fits): blocks of 8 when the launch streams more than _SMALL_KN
# weights, blocks of 16 always. H200, session 10 (probe_moe_tiles.py --tile): Mixtral 1 / 16 tokens
# 70.6 -> 67.3 / 229.5 -> 208.5 us, 32 tokens 343.8 -> 283.9; E=64 top-6 16 tokens 90.5 -> 82.0, but
# 1 token (six experts of 2048 x 2816) 25.2 -> 28.6
MOE_DIRECT_O3 = Tile(1, True, 8, 6, True, direct=1, occ=3)
MOE_W16_O3 = Tile(2, True, 8, 3, True, occ=3)


def _preferences(m: int, n: int, k: int, cc: tuple[int, int] = (8, 0),
                 large: bool = False, experts: int = 0, bits: int = 4) -> tuple[tuple[Tile, int], ...]:
    """Candidate (tile, warps) pairs for M x N x K, best first. `large`: take the routes of large
    problems whatever K*N (the sm_90 MoE kernel: one launch streams every active expert's weights;
    H200, session 8: Mixtral 1 / 16 tokens 85 -> 77 / 277 -> 232 us, E=64 top-6 31 -> 28 /
    125 -> 95 us, benchmarks/probe_moe_tiles.py). `experts`: MoE, at most this many experts'
    weights are streamed (min(E, slots)); 0 for dense problems. `bits`: of the weights."""
    small = k * n < _SMALL_KN and not large
    cls = m_class(m)
    if cc >= (9, 0) and experts and cls == "w8" and experts * k * n > _SMALL_KN:
        return ((MOE_DIRECT_O3, 4),) + _preferences(m, n, k, cc, large)
    if cc >= (9, 0) and experts and cls == "m1":
        return ((MOE_W16_O3, 4),) + _preferences(m, n, k, cc, large)
    if cc >= (9, 0) and cls == "w8":
        # sm_90: the producer-warp / bulk-copy ring (NOTES.md, "bulk-copy pipeline"); from K*N = 32M
        # on, the direct-load tile (weights straight into registers, NOTES.md session 7) where the
        # family takes it (dense: tile_fits), else the ring. Session 9: one tile ahead beats two
        # above K*N = 64M (8192x28672 M=1 35.0 vs 37.5 us) and is the only depth 8-bit weights take
        ring = (Tile(1, True, 8, 6, True, 2), 4) if small else (Tile(1, True, 8, 6, True), 4)
        if k * n < _TINY_KN and not large:
            first = ()
        elif k * n > _SMALL_KN or (k >= DIRECT1_MIN_K and n >= DIRECT1_MIN_N):
            first = ((DIRECT_W8_1, 4), (DIRECT_W8, 4))
        else:
            first = ((DIRECT_W8, 4), (DIRECT_W8_1, 4))
        return first + (ring,) + _preferences(m, n, k)
    if cc >= (9, 0) and cls == "m1":
        # mid-size problems: the 16-row direct-load tile (4-bit dense, tile_fits)
        first = ((DIRECT_W16, 4),) if not large and _TINY_KN <= k * n <= _W16_DIRECT_MAX else ()
        if small and not first:
            return _preferences(m, n, k)
        # five ring slots: two CTAs per SM still fit at 4 bits (NOTES.md session 7); also after the
        # direct-load tile on mid-size problems (8-bit weights, which it does not serve: H200 session
        # 10, 14336x4096 M=16 23.7 us vs 27.6 on m1_k128_s6)
        ring = ((Tile(2, True, 8, 5, True), 4), (Tile(2, True, 8, 4, True), 4))
        if bits == 8 and not experts:
            # 8-bit weights: one CTA per SM at five slots already, so the sixth costs no CTA (H200
            # session 12, M=16: 8192x28672 67.4 -> 64.5 us, 8192^2 24.7 -> 23.4, 4096x28672 37.5 -> 37.1)
            ring = ((Tile(2, True, 8, 6, True), 4),) + ring
        return first + ring + _preferences(m, n, k)
    if cc >= (9, 0) and cls == "m2" and not small:
        # the 32-row bulk-copy ring (M = 17-32 on large problems; smaller ones go to the wgmma kernel)
        return ((Tile(2, False, 8, 4, True), 4),) + _preferences(m, n, k)
    if cls == "w8":
        first = (Tile(1, True, 4, 8), 4) if small else (Tile(1, True, 8, 6), 4)
        return (first, (Tile(1, True, 8, 4), 4), (Tile(1, True, 4, 8), 4))
    if cls == "m1":
        first = (Tile(1, False, 8, 6), 4) if small else (Tile(1, False, 8, 4), 4)
        return (first, (Tile(1, False, 8, 4), 4), (Tile(1, False, 4, 8), 4))
    if cls == "m2":
        return ((Tile(2, False, 8, 4), 2 if small else 4), (Tile(2, False, 4, 6), 4))
    if cls == "m3":
        return ((Tile(3, False, 8, 3), 4), (Tile(3, False, 4, 4), 4))
    if n >= 16384:
        return ((Tile(4, False, 8, 3), 8), (Tile(4, False, 4, 4), 4))
    return ((Tile(4, False, 4, 4), 4), (Tile(4, False, 8, 3), 4))


# Shared memory per block kept free for the kernels' static shared variables.
SMEM_RESERVE = 1024


def m_class(m: int) -> str:
    if m <= 8:
        return "w8"
    if m <= 16:
        return "m1"
    if m <= 32:
        return "m2"
    if m <= 48:
        return "m3"
    return "m4"


def check_problem(n: int, k: int, group_size: int) -> None:
    if k <= 0 or k % 64:
        raise ValueError(f"K={k} (input features) must be a positive multiple of 64")
    if n <= 0 or n % 64:
        raise ValueError(f"N={n} (output features) must be a positive multiple of 64")
    if group_size != -1 and k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")


def select_plan(m: int, n: int, k: int, fam: Family, smem_per_block: int, cc: tuple[int, int] = (8, 0),
                first: tuple[Tile, int] | None = None, experts: int = 1) -> Plan:
    """Tile config and CTA width for an M x N x K problem (MoE families: M = the block size, and
    at most `experts` experts active). Candidates are tried in order of
    preference (`first`, a measured choice from `jitmarlin tune`, before the built-in order); a
    candidate must divide K (k tile) and N (64 * warps), agree with the group size and fit the
    per-block shared memory. Fewer warps per CTA are tried before giving up."""
    check_problem(n, k, fam.group_size)
    strips = n // 64
    prefs = _preferences(m, n, k, cc, large=fam.moe and cc >= (9, 0), experts=max(1, experts) if fam.moe else 0,
                         bits=fam.bits)
    if first is not None and first[0].rows == prefs[0][0].rows and first[1] <= first[0].max_warps:
        prefs = (first,) + prefs  # same m tile as the built-in choice (the MoE kernel relies on it)
    for want_warps in (None, 4, 2, 1):
        for tile, warps in prefs:
            w = warps if want_warps is None else min(warps, want_warps)
            while strips % w:
                w //= 2
            if k % tile.tile_k or not K.tile_fits(fam, tile):
                continue
            smem = K.smem_bytes(fam, tile, w)
            if smem <= smem_per_block:
                return Plan(tile, w, smem)
    raise ValueError(f"no GEMM tile config fits M={m}, N={n}, K={k}, {fam} in {smem_per_block} bytes "
                     "of shared memory per block")


def tile_count(plan: Plan, m: int, n: int, k: int) -> int:
    """(n tile, m tile, k tile) triples of an M x N x K problem: the most CTAs that get work."""
    return (n // (64 * plan.nwarps)) * -(-m // plan.tile.rows) * (k // plan.tile.tile_k)


def grid_size(plan: Plan, m: int, n: int, k: int, sms: int, ctas_per_sm: int) -> int:
    """CTAs to launch: all that fit at once, but never more than there are tiles."""
    return max(1, min(sms * max(1, ctas_per_sm), tile_count(plan, m, n, k)))


# ---- argument checks (shared by the real op and its fake) ----


def check_args(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               bias: Optional[torch.Tensor]) -> tuple[int, int, int, Family]:
    """Validate, and return (M, N, K, family)."""
    if a.dtype not in DTYPES:
        raise TypeError(f"activations must be float16 or bfloat16, got {a.dtype}")
    if b.dtype != torch.int32 or b.dim() != 3 or b.shape[2] not in (128, 256):
        raise TypeError(f"packed weights must be int32 [N/64, K/16, 32*bits] (from jitmarlin.quant.pack_weights), "
                        f"got {b.dtype} {tuple(b.shape)}")
    bits = b.shape[2] // 32
    n, k = b.shape[0] * 64, b.shape[1] * 16
    if a.dim() == 0 or a.shape[-1] != k:
        raise ValueError(f"activations have {a.shape[-1] if a.dim() else 0} features but the packed weights expect K={k}")
    if not a.is_contiguous():
        raise ValueError(f"activations of shape {tuple(a.shape)} must be contiguous; call .contiguous() first")
    if not b.is_contiguous():
        raise ValueError("packed weights must be contiguous")
    if scales.dtype != a.dtype:
        raise TypeError(f"scales must have the activation dtype {a.dtype}, got {scales.dtype}")
    if scales.dim() != 2 or scales.shape[1] != n or scales.shape[0] < 1 or k % scales.shape[0]:
        raise ValueError(f"scales must be [K/G, N] = [groups, {n}] with groups dividing K={k}, got {tuple(scales.shape)}")
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")
    group_size = -1 if scales.shape[0] == 1 else k // scales.shape[0]
    if zeros is not None:
        if zeros.dtype != torch.int32 or zeros.shape != (scales.shape[0], n * bits // 32) or not zeros.is_contiguous():
            raise ValueError(f"zero points must be contiguous int32 [{scales.shape[0]}, {n * bits // 32}] "
                             f"(jitmarlin.quant.pack_zeros), got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None:
        if bias.dtype != a.dtype or bias.shape != (n,) or not bias.is_contiguous():
            raise ValueError(f"bias must be a contiguous [{n}] tensor of dtype {a.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    for name, t in (("packed weights", b), ("scales", scales), ("zero points", zeros), ("bias", bias)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} are on {t.device} but the activations on {a.device}: all must be on one device")
    fam = Family(DTYPES[a.dtype], bits, zeros is not None, group_size)
    check_problem(n, k, group_size)
    m = a.numel() // k
    return m, n, k, fam


def check_perm(perm: Optional[torch.Tensor], k: int, device: torch.device) -> None:
    """Act-order column order: int32 [K] on the activations' device (shape, dtype and device; the
    values are checked by check_perm_values where the order is used)."""
    if perm is None:
        return
    if perm.dtype != torch.int32 or perm.dim() != 1 or perm.shape[0] != k or not perm.is_contiguous():
        raise ValueError(f"perm must be a contiguous int32 [K={k}] tensor (the act-order column order), got "
                         f"{perm.dtype} {tuple(perm.shape)}")
    if perm.device != device:
        raise ValueError(f"perm is on {perm.device} but the activations on {device}: all must be on one device")


# Act-order orders whose values were checked (id -> (weak reference, version counter, address)):
# a gather with an index outside [0, K) would read out of bounds (an illegal-address error that
# ends the CUDA context), so every order is checked once, and again after an in-place change.
_PERMS_CHECKED: dict[int, tuple] = {}


def check_perm_values(perm: torch.Tensor, k: int) -> None:
    """Every row of perm ([K] or [E, K]) must be a permutation of range(K). Checked on the first
    use of each tensor (one sort and one host sync) and after any in-place change (its version
    counter moves); later calls cost a dictionary lookup. Inside CUDA-graph capture (no sync
    possible) an unchecked order is trusted: run once eagerly first, as for the workspace; so is
    one seen while torch.compile traces (the MoE path calls this from traced Python)."""
    if torch.compiler.is_compiling():
        return
    hit = _PERMS_CHECKED.get(id(perm))
    if hit is not None and hit[0]() is perm and hit[1] == perm._version and hit[2] == perm.data_ptr():
        return
    if perm.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    want = torch.arange(k, device=perm.device, dtype=perm.dtype)
    if not bool((torch.sort(perm, dim=-1).values == want).all()):
        rows = "every row of perm" if perm.dim() == 2 else "perm"
        raise ValueError(f"{rows} must be a permutation of range(K={k}) (the act-order column order): "
                         f"values outside [0, {k}) or repeated")
    if len(_PERMS_CHECKED) >= 4096:  # drop the entries of tensors that no longer exist
        for key in [key for key, v in _PERMS_CHECKED.items() if v[0]() is None]:
            del _PERMS_CHECKED[key]
    _PERMS_CHECKED[id(perm)] = (weakref.ref(perm), perm._version, perm.data_ptr())


# ---- launch ----


@functools.lru_cache(maxsize=None)
def _cc(index: int) -> tuple[int, int]:
    return device_capability(torch.device("cuda", index))


@dataclass(frozen=True)
class Launch:
    """A kernel and how to launch it for one problem size on one device."""

    fn: driver.Function
    plan: Plan
    grid: int
    ws_floats: int  # partial-sum space the launch needs
    pdl: bool = False  # programmatic dependent launch (sm_90 kernels wait on the previous kernel)

    @property
    def threads(self) -> int:
        return self.plan.tile.threads(self.plan.nwarps)


def _make_launch(plan: Plan, rows: int, n: int, k: int, fam: Family, index: int,
                 allow_cluster: bool = False) -> Launch:
    """The launch of `plan`; with allow_cluster (the planner's own choices, not overrides) the
    plan's cluster twin replaces it where choose_cluster takes it."""
    fn = K.get_kernel(fam, plan.tile, index, _cc(index))
    threads = plan.tile.threads(plan.nwarps)
    occ = fn.occupancy(threads, plan.smem)
    if occ < 1:
        raise RuntimeError(f"kernel {fn.name} cannot run one CTA of {threads} threads with {plan.smem} B "
                           f"shared memory on cuda:{index} ({fn.num_regs} registers per thread)")
    if plan.tile.cluster:  # an explicit cluster tile: one cluster per unit, all at once
        grid = cluster_grid(plan, rows, n, k)
        c = plan.tile.cluster
        if grid == 0 or grid > c * fn.max_active_clusters(threads, plan.smem, c):
            raise ValueError(f"{plan.tile.tag()} with {plan.nwarps} warps cannot run M={rows}, N={n}, K={k} on "
                             f"cuda:{index}: K/{plan.tile.tile_k} must be a multiple of {c} and every unit's "
                             f"cluster must fit on the device at once")
        return Launch(fn, plan, grid, 0, pdl=use_pdl(_cc(index)))
    grid = grid_size(plan, rows, n, k, driver.device(index).sm_count, occ)
    if allow_cluster and cluster_launches_allowed(_cc(index)):
        smem_limit = device_info(index).smem_per_block

        def max_clusters(p: Plan) -> int:
            if p.smem > smem_limit or not K.tile_fits(fam, p.tile):
                return 0
            f = K.get_kernel(fam, p.tile, index, _cc(index))
            return f.max_active_clusters(p.tile.threads(p.nwarps), p.smem, p.tile.cluster)

        twin = choose_cluster(plan, rows, n, k, fam, grid, max_clusters)
        if twin is not None:
            return _make_launch(twin, rows, n, k, fam, index)
    return Launch(fn, plan, grid, K.workspace_floats(grid, plan.nwarps, plan.tile), pdl=use_pdl(_cc(index)))


# ---- cluster launches: each output unit split along K across the CTAs of one cluster ----
# The striped split sums a unit's partial sums through global memory: a store, a fence, an atomic
# and the last CTA's loads, several microseconds at the end of every launch where all CTAs finish
# together (H200 session 11, timing with the fixup left out: 8192^2 M=1 14.7 -> 11.5 us, 14336x4096
# 15.3 -> 10.4, 4096^2 8.7 -> 6.1). Where the units times a cluster size fill the GPU about as well
# as the striped grid, a cluster tile reduces through distributed shared memory instead.
CLUSTER_MIN_FILL = 0.9  # cluster grid / striped grid
# bf16 dequantizes with more instructions per weight than fp16, and a cluster CTA runs 2 math warps:
# with many k tiles per CTA it falls behind the striped launch (H200 session 12, M=1: 14336x4096,
# 14 k tiles per cluster CTA, 16.6 us vs 15.8 striped; 4096^2, 4 k tiles, 7.2 vs 8.7 striped)
CLUSTER_BF16_MAX_KTILES = 8


def cluster_launches_allowed(cc: tuple[int, int]) -> bool:
    """sm_90 and newer, unless JITMARLIN_CLUSTER=0 (read once, K.env_flag)."""
    return cc >= (9, 0) and K.env_flag("JITMARLIN_CLUSTER", default=True)


def cluster_grid(plan: Plan, rows: int, n: int, k: int) -> int:
    """CTAs of a cluster launch of `plan` (a cluster tile): units x cluster size, or 0 when the k
    tiles do not split evenly across a cluster."""
    c = plan.tile.cluster
    k_tiles = k // plan.tile.tile_k
    if c <= 1 or k_tiles % c:
        return 0
    return (n // (64 * plan.nwarps)) * -(-rows // plan.tile.rows) * c


CLUSTER_TILE = K.CLUSTER_TILE  # the k-split ring, clusters of 8 (defined with the tile lists)


def cluster_twin(tile: Tile) -> Tile | None:
    """The cluster tile that may replace an 8-row bulk tile (M <= 8), or None."""
    if not (tile.bulk and tile.swap and tile.m_blocks == 1) or tile.cluster or CLUSTER_TILE not in K.BULK_TILES:
        return None
    return CLUSTER_TILE


def choose_cluster(plan: Plan, rows: int, n: int, k: int, fam: Family, striped_grid: int,
                   max_clusters) -> Plan | None:
    """The cluster plan replacing `plan` (4-bit, M <= 8: CLUSTER_TILE at the plan's warps per CTA or
    half), or None: its k tiles split evenly over a cluster, all its clusters fit at once
    (max_clusters(plan) -> clusters of it the device runs together, 0 if it cannot run) and it
    launches at least CLUSTER_MIN_FILL of the striped grid; bf16 only up to CLUSTER_BF16_MAX_KTILES k
    tiles per CTA. Pure given max_clusters (CPU-tested).
    H200, session 11 (probe_configs.py, M=1, us): 4096^2 8.6 (striped k-split ring) -> 7.2 at 2
    warps; 14336x4096 15.8 (direct-load tile) -> 14.8 at 2 warps; the cases it turns down were slower
    or did not fit (8192^2: 32 clusters needed, 15 / 30 run at once)."""
    twin = cluster_twin(plan.tile)
    if twin is None or fam.bits != 4 or not K.tile_fits(fam, twin):
        return None
    if fam.dtype == "bf16" and k // twin.tile_k > CLUSTER_BF16_MAX_KTILES * twin.cluster:
        return None
    strips = n // 64
    for nw in (plan.nwarps, plan.nwarps // 2):
        if nw < 1 or strips % nw:
            continue
        cand = Plan(twin, nw, K.smem_bytes(fam, twin, nw))
        grid = cluster_grid(cand, rows, n, k)
        if grid == 0 or grid < CLUSTER_MIN_FILL * striped_grid:
            continue
        if grid <= twin.cluster * max_clusters(cand):
            return cand
    return None


def use_pdl(cc: tuple[int, int]) -> bool:
    """Programmatic dependent launch: on by default on sm_90 and newer (every sm_90 kernel
    waits for the previous kernel before reading its outputs); JITMARLIN_PDL=0 turns it off
    (read once, like the other switches: K.env_flag)."""
    return cc >= (9, 0) and K.env_flag("JITMARLIN_PDL", default=True)


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> "tuning.DeviceInfo":
    dev = driver.device(index)
    return tuning.DeviceInfo(torch.cuda.get_device_name(index), _cc(index), dev.sm_count,
                             dev.smem_per_block_optin - SMEM_RESERVE)


@functools.lru_cache(maxsize=4096)
def prepare_launch(m: int, rows: int, n: int, k: int, fam: Family, index: int, tuned: bool = True,
                   experts: int = 1) -> Launch:
    """The launch for `rows` rows of A in m tiles chosen for M = m (dense: m == rows; MoE: m = the
    block size, rows = the padded slot count, an upper bound the kernel refines on the device,
    experts = how many experts can be active: min(E, slots)).
    With `tuned`, a tuning table of this GPU (`jitmarlin tune`) puts its measured choice first. The
    table is measured on dense problems of M rows; the MoE kernel runs many blocks of M rows over
    several experts, where those choices can be 2-3x slower (H200, 1024 tokens), so it passes False."""
    info = device_info(index)
    first = tuning.tuned_choice(info, m, n, k) if tuned else None
    plan = select_plan(m, n, k, fam, info.smem_per_block, info.cc, first=first, experts=experts)
    # a choice measured by `jitmarlin tune` is launched as measured (no cluster form in its place)
    return _make_launch(plan, rows, n, k, fam, index, allow_cluster=not fam.moe and first is None)


def launch_params(launch: Launch, ws: Workspace, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                  zeros: Optional[torch.Tensor], out: torch.Tensor, m: int, n: int, k: int) -> K.GemmParams:
    """The kernel parameters shared by the dense and the MoE GEMM; reserves the workspace."""
    ws.ensure(launch.ws_floats, launch.grid)
    p = K.GemmParams()
    p.a, p.b, p.s, p.c = a.data_ptr(), b.data_ptr(), scales.data_ptr(), out.data_ptr()
    p.z = zeros.data_ptr() if zeros is not None else None
    p.ws, p.counters = ws.ws.data_ptr(), ws.counters.data_ptr()
    p.m, p.n, p.k, p.lda, p.ldc = m, n, k, k, n
    p.nwarps, p.grid, p.top_k = launch.plan.nwarps, launch.grid, 1
    return p


# For large M the dense path dequantizes the weights once into fp16/bf16 and calls cuBLAS, whose
# tensor-core GEMM beats an mma.sync kernel that re-dequantizes the weights for every m tile.
def use_dequant_path(m: int, n: int, k: int) -> bool:
    """(Checked after use_wgmma_path, which takes M <= 1024 on sm_90.) Sweep result (mma.sync
    kernels): dequantize + cuBLAS wins from M=512 everywhere, from M=256 unless K is large
    (then the fused kernel's L2 reuse still wins), and already from M=64 on small matrices."""
    return m >= 512 or (m >= 256 and k <= 8192) or (m >= 64 and k * n <= (1 << 24))


def dequantize_weights(b: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], fam: Family,
                       n: int, k: int) -> torch.Tensor:
    """Packed weights -> W^T [N, K] in the scales' dtype, with one kernel."""
    index = K.cuda_index(b.device)
    fn = K.get_kernel(fam, None, index, _cc(index))
    wt = torch.empty(n, k, dtype=scales.dtype, device=b.device)
    p = K.GemmParams()
    p.b, p.s, p.c = b.data_ptr(), scales.data_ptr(), wt.data_ptr()
    p.z = zeros.data_ptr() if zeros is not None else None
    p.n, p.k = n, k
    threads = 256
    grid = -(-(n // 64) * (k // 16) * 32 // threads)
    fn.launch(grid, threads, 0, K.current_stream_handle(b.device), p)
    return wt


GATHER_THREADS = 256  # the scattered gather kernel: one thread per 8 columns of one row
GATHER_SMEM_MIN_M = 8  # from this M on, the gather staged through shared memory (gather_smem_body)
GATHER_SMEM_THREADS = 512  # kGatherSmemThreads
GATHER_SMEM_CHUNKS = 4  # kGatherSmemChunks: 8-column chunks per thread
GATHER_SMEM_CTAS = 64  # aim: about this many CTAs (a programmatic dependent: gather_pdl)


def gather_grid(m: int, k: int) -> int:
    """CTAs of the scattered act-order gather kernel (one thread per 8 columns of one row)."""
    return -(-(m * (k // 8)) // GATHER_THREADS)


def gather_smem_grid(m: int, k: int) -> tuple[int, int]:
    """(parts per row, CTAs) of the shared-memory gather kernel: each CTA holds one row of A and
    writes one part of its output; enough parts that no thread has more than GATHER_SMEM_CHUNKS
    chunks, and about GATHER_SMEM_CTAS CTAs in all."""
    chunks = k // 8
    parts = max(-(-chunks // (GATHER_SMEM_THREADS * GATHER_SMEM_CHUNKS)), GATHER_SMEM_CTAS // m)
    parts = max(1, min(parts, chunks))
    return parts, m * parts


def use_gather_smem(m: int, k: int, fn) -> bool:
    """The shared-memory gather from M = GATHER_SMEM_MIN_M on, where a row (2 K bytes) fits the
    kernel's dynamic shared memory. H200 session 15 (probe_act_order, gather alone at M = 8 / 16,
    scattered vs shared memory, us): 14336x4096 2.6 / 3.2 vs 2.3 / 2.4, 8192^2 1.6 / 2.5 vs 1.7 / 1.9,
    28672x8192 3.3 / 4.8 vs 2.7 / 3.2, 8192x28672 1.7 / 2.5 vs 1.7 / 1.8; at M = 1-4 level (the
    scattered kernel's loads are one L2 round trip on few rows)."""
    return m >= GATHER_SMEM_MIN_M and 2 * k <= fn.max_dynamic_smem


def gather_columns(a: torch.Tensor, perm: torch.Tensor, m: int, k: int, fam: Family,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """A[:, perm] for the act-order layout, by our gather kernel: on sm_90 it is launched as a
    programmatic dependent of the previous kernel and lets the GEMM after it start streaming
    weights at once (a torch index_select in between would serialize all three). `out`: a
    contiguous tensor shaped like `a` to write into (tests poison it)."""
    index = K.cuda_index(a.device)
    cc = _cc(index)
    if out is None:
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    p = K.GemmParams()
    p.a, p.c, p.perm = a.data_ptr(), out.data_ptr(), perm.data_ptr()
    p.m, p.k, p.lda, p.ldc = m, k, k, k
    fn = K.get_kernel(fam, "gather_smem", index, cc)
    if use_gather_smem(m, k, fn):
        parts, grid = gather_smem_grid(m, k)
        p.n = parts
        fn.launch(grid, GATHER_SMEM_THREADS, 2 * k, K.current_stream_handle(a.device), p,
                  pdl=use_pdl(cc) and gather_pdl(grid))
        return out
    fn = K.get_kernel(fam, "gather", index, cc)
    grid = gather_grid(m, k)
    fn.launch(grid, GATHER_THREADS, 0, K.current_stream_handle(a.device), p, pdl=use_pdl(cc) and gather_pdl(grid))
    return out


GATHER_PDL_MAX_CTAS = 96


def gather_pdl(grid: int) -> bool:
    """Launch the act-order gather as a programmatic dependent only while its grid is small: on the
    H200 a gather of 112 / 224 CTAs (K=28672, M=8 / 16) parked beside the previous GEMM made the
    gather -> GEMM pair 1.3 / 9.7 us slower than a plain launch, while one of 4-64 CTAs gains up
    to 2 us from the overlap (benchmarks/NOTES.md session 7). The GEMM after it keeps PDL. The MoE
    path's SiLU-mul between the two expert GEMMs and its top-k sum after the second follow the
    same rule (moe.silu_mul, moe.topk_sum)."""
    return grid < GATHER_PDL_MAX_CTAS


def wgmma_setting() -> str:
    """JITMARLIN_WGMMA: "0" never uses the sm_90a warpgroup-MMA kernel, "1" uses it wherever the
    shape allows (M >= 17), unset = where it measured faster (use_wgmma_path, MoE blocks of 64 and 128)."""
    if K.env_flag("JITMARLIN_WGMMA"):
        return "on"
    return "auto" if K.env_flag("JITMARLIN_WGMMA", default=True) else "off"


# H200, 2026-11-30 (benchmarks/NOTES.md, "wgmma split-K"): with K split across CTAs when the
# output tiles are too few to fill the SMs, the wgmma kernel beat the mma.sync kernel and
# dequantize + cuBLAS at M = 64, 128 and 256 on all six benchmark shapes (e.g. M=64: 4096^2 12.7 vs
# 26.5 us, 14336x4096 28.0 vs 56.5, 8192^2 30.0 vs 48.6, 28672x8192 84.5 vs 114.7); at M=1024
# dequantize + cuBLAS stays level or ahead. M=48 beat the mma.sync kernel on every shape measured
# (4096^2 13.9 vs 29.2 us, 8192x28672 85.4 vs 94.5).
# Session 13 (NOTES.md, "token tiles of 16 and 32"): at M = 17-32 the 32-token tile (m64n32k16,
# no padding to 64) beat the mma.sync route on 4-bit weights where K*N <= 2^27 (8192^2 M=32 23.1 vs
# 27.8 us, 4096^2 10.4 vs 12.3, 4096x28672 37.3 vs 39.7) but not on 8192x28672 (71.1 vs 66.5), and
# on 8-bit weights everywhere (28672x8192 70.5 vs 78.5, 4096x28672 39.5 vs 45.4, 8192x28672 level);
# at M = 9-16 the 16-token tile only on 4096^2 (9.8 vs 11.0), 2-2.5x slower on the large shapes.
# Session 16 (TMA activations since session 15; probe_configs, route vs JITMARLIN_WGMMA=1, us): the
# wgmma kernel now beats dequantize + cuBLAS at M=512 on all six benchmark shapes (8192x28672 555 ->
# 477, 28672x8192 614 -> 433, 14336x4096 154 -> 99) and, with one strip per warpgroup, at M=1024
# (853 vs 916, 820 vs 953, 8192^2 234 vs 244); at M=1536 they tie, at M=2048 dequantize + cuBLAS
# wins (1630 vs 1746). bf16 with 8-bit weights: the wgmma kernel wins at M=512 (8192x28672 492 vs
# 571) but not at M=1024 (975 vs 917, 8192^2 274 vs 254), so it stops at 512 there.
WGMMA_AUTO_M = (17, 1025)  # M range the automatic route sends to the wgmma kernel (M <= 32: see below)
WGMMA_BF16_U8_MAX_M = 512
WGMMA_N32_MAX_KN = 1 << 27  # M in [17, 32], 4-bit weights: only where K*N <= this (8-bit: always)
WGMMA_N16_M = (9, 16)  # M range of the 16-token tile (automatic route only) ...
WGMMA_N16_MAX_KN = 1 << 24  # ... where K*N <= this (8-bit weights since session 16, H200 probe_configs,
# 4096^2 M = 9 / 16: f16 9.7 / 9.8 us vs 13.0 / 13.1 on the mma.sync route, bf16 10.2 / 10.2 vs 13.9 /
# 14.2; 8192^2 level, larger shapes 3-23% slower on the 16-token tile)


def wgmma_allowed(fam: Family, index: int, wanted: bool) -> bool:
    """The switch and the device, for a shape the kernel tiles: forced on (a build failure then
    raises), off, or automatic where `wanted` and its module can be built (K.wgmma_module_ready)."""
    setting = wgmma_setting()
    if setting == "off" or _cc(index) != (9, 0):
        return False
    return setting == "on" or (wanted and K.wgmma_module_ready(fam))


def use_wgmma_path(m: int, n: int, k: int, fam: Family, index: int) -> bool:
    """The dense GEMM on the sm_90a wgmma kernel (see wgmma_setting; JITMARLIN_WGMMA=1 forces it
    from M = 17, the 16-token tile is taken by the automatic route only)."""
    if fam.moe or m < WGMMA_N16_M[0] or n % 128 or k % 64:
        return False
    if m < WGMMA_AUTO_M[0]:
        wanted = m <= WGMMA_N16_M[1] and (k * n <= WGMMA_N16_MAX_KN  # (8-bit too since session 16)
                                          or wgmma_route_prod(n, k, WGMMA_PROD_N16 + (False,), fam) is not None)
        return wanted and wgmma_setting() == "auto" and wgmma_allowed(fam, index, True)
    if m <= 32:  # (above WGMMA_N32_MAX_KN: only the 32-token producer form, wgmma_route_prod)
        wanted = (fam.bits == 8 or k * n <= WGMMA_N32_MAX_KN
                  or wgmma_route_prod(n, k, WGMMA_PROD_N32 + (False,), fam) is not None)
    else:
        wanted = m < WGMMA_AUTO_M[1] and (m <= WGMMA_BF16_U8_MAX_M or fam.bits == 4 or fam.dtype != "bf16")
    return wgmma_allowed(fam, index, wanted)


def wgmma_strips(n: int, m_tiles: int, sms: int) -> int:
    """Two 64-feature strips per warpgroup (256 features per CTA) when that still gives about
    three quarters of the SMs a CTA; else one (and two CTAs per SM). MoE blocks of 64 rows only
    since session 17 (dense 64-token tiles take one strip: wgmma_config)."""
    return 2 if n % 256 == 0 and (n // 256) * m_tiles * 4 >= 3 * sms else 1


def _wgmma_span(n: int, m_tiles: int, k: int, nt: int, fw: int, sms: int) -> float:
    """Relative time of a wgmma launch: CTAs per SM (rounded up) times the 64-k stages each runs
    (a CTA with two strips per warpgroup does twice the work per stage)."""
    tiles = (n // (128 * fw)) * m_tiles
    if wgmma_stream_grid(tiles, k, nt, fw, sms):  # stream-K: the stages spread evenly
        return fw * tiles * (k // 64) / sms
    splits = wgmma_splits(tiles, k, nt, fw, sms)
    return -(-tiles * splits // sms) * fw * (k // 64) / splits


def wgmma_config(m: int, n: int, sms: int, k: int | None = None) -> tuple[int, int, int]:
    """(token tile, strips per warpgroup, stages) for the wgmma kernel: the smallest of 16 / 32 /
    64 token tiles holding M (16 only from 9 rows), else 128. Strips per warpgroup: one for
    64- and 128-token tiles (the route may take the wide two-strip kernel: wgmma_route_config);
    for 32-token tiles two unless one strip
    spreads the work over more SMs or ties it with 8 K splits or stream-K (_wgmma_span; H200: 4096^2,
    14336x4096 and 8192x28672 take one, the other three benchmark shapes two); 16-token tiles one."""
    nt = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    if nt == 16:
        fw = 1
    elif nt == 32:
        if k is None:
            raise ValueError(f"wgmma_config needs K for a 32-token tile (M={m}): the strips depend on the K split")
        s2, s1 = _wgmma_span(n, 1, k, nt, 2, sms), _wgmma_span(n, 1, k, nt, 1, sms)
        # a tie goes to two strips (H200 session 13: 8192^2, 28672x8192), unless they split K more
        # than 4 ways or one strip runs stream-K (two CTAs per SM; session 14: 14336x4096 M=32 with 8
        # splits f1 21.4 us vs f2 23.9; stream-K f1 68.2 / 38.5 / 31.3 vs f2 72.0 / 40.2 / 32.8 us on
        # 8192x28672 / 4096x28672 / 4096x22016)
        tie_f2 = wgmma_splits(n // 256, k, nt, 2, sms) <= 4 and not wgmma_stream_grid(n // 128, k, nt, 1, sms)
        fw = 2 if n % 256 == 0 and (s2 < s1 or (s2 == s1 and tie_f2)) else 1
    else:  # 64 and 128 tokens: one strip, two CTAs per SM (4 warps per scheduler). H200 (probe_configs,
        # us, one vs two strips): session 16, 128 tokens: M=128 8192x28672 104.7 vs 115.7, 28672x8192
        # 103.8 vs 114.4, 4096x28672 54.2 vs 60.7, 8192^2 37.5 vs 43.1; M=256 220 vs 230 (8192x28672),
        # 60.4 vs 67.4 (8192^2); M=1024 853 vs 896, 820 vs 870, 435 vs 458, 234 vs 250, 188 vs 211
        # (14336x4096), 54.3 vs 60.3 (4096^2). Session 17, 64 tokens (wgmma_strips gave two only on the
        # N=28672 shapes): M = 33 / 48 / 64 8192x28672 76.0 / 76.3 / 77.1 vs 80.0 / 80.8 / 81.2,
        # 4096x28672 40.9 / 41.1 / 41.6 vs 44.2 / 44.5 / 44.6; 8-bit M=64 83.5 vs 86.5, 43.6 vs 46.7
        fw = 1
    for cfg in K.WGMMA_CONFIGS:
        if cfg[:2] == (nt, fw):
            return cfg
    raise AssertionError((nt, fw))


# The wide form of the two-strip 128-token config (four warpgroups of one strip, 512 threads, one
# CTA per SM sharing each activation tile) where M > 128 and K*N > 2^26. H200 session 17 (s17a,
# probe_configs, wide vs route = two one-strip CTAs per SM, us): M=256 8192x28672 208.7 vs 220.2,
# 28672x8192 190.5 vs 196.3, 4096x28672 107.0 vs 106.2; M=1024 822 vs 846, 788 vs 813, 388 vs 437;
# it loses on 8192^2 (M=256 62.3 vs 60.0, M=1024 225 vs 213) and at M=128 (14336x4096 52.1 vs 34.5).
WGMMA_WIDE_ROUTE = (128, 2, 4)
WGMMA_WIDE_MIN_M = 129
WGMMA_WIDE_ABOVE_KN = 1 << 26  # K*N strictly above this


def wgmma_route_config(m: int, n: int, k: int, sms: int, moe: bool = False) -> tuple[int, int, int, bool]:
    """(token tile, strips per warpgroup, stages, wide) of the automatic route: wgmma_config, or the
    wide two-strip 128-token kernel (dense, N % 256 == 0, built: K.WGMMA_WIDE_CONFIGS) on large
    problems."""
    if (not moe and m >= WGMMA_WIDE_MIN_M and k * n > WGMMA_WIDE_ABOVE_KN and n % 256 == 0
            and WGMMA_WIDE_ROUTE in K.WGMMA_WIDE_CONFIGS):
        return WGMMA_WIDE_ROUTE + (True,)
    return wgmma_config(m, n, sms, k) + (False,)


# The producer form with two compute warpgroups of two strips (K.WGMMA_PROD2_CONFIGS: 256 features x 128 tokens
# per CTA, one CTA per SM) running stream-K, where the route's whole 128-token tiles fill the SMs poorly: its
# CTAs (tiles x K splits; the plain form two per SM, the wide form one) over the SMs' CTA rounds,
# ctas / (sms * ceil(ctas / sms)), under WGMMA_STREAM2_MAX_FILL. (Counting rounds per SM, not CTA slots: a lone
# one-strip CTA on an SM runs faster than two sharing it; 4096x12288 M=512, 384 CTAs, loses 11% with stream-K.)
# H200 session 39 (s39a, probe_configs, f16 4-bit, route -> (128, 2, 4) stream-K, us): fill 0.73: 8192^2 M=384
# 103.4 -> 94.4, 14336x4096 M=384 98.2 -> 86.2, 4096x12288 M=384 91.8 -> 75.6, 28672x8192 M=384 354.1 -> 316.3,
# 4096x12288 M=128 43.3 -> 42.4 and M=256 57.5 -> 60.5 (the one loss); fill 0.65: 4096x22016 M=128 61.0 -> 56.3,
# M=256 111.2 -> 95.5. Fill 0.85-0.87 (8192x28672 / 4096x28672 M=256-512, 4096x22016 M=512 / 1024) level within
# +-4% (not taken); fill 0.97 slower by 5-33% (14336x4096 M=128 40.0 -> 53.3, 8192^2 M=512 106.0 -> 121.7).
# Session 39 (s39b, route with / without this rule, same run, f16 4-bit unless named): it lost where the stream-K
# CTAs get under about 48 stages each (the pieces' sums weigh more): 4096x12288 M=96 / 256 (23 / 47 stages) 37.0 ->
# 37.2, 52.2 -> 55.7 (bf16 M=128 / 256 34.6 -> 38.7, 50.9 -> 55.8; 8-bit 35.1 -> 40.7, 52.3 -> 59.0), 4096x11008 M=256
# (42) 51.9 -> 52.8; hence WGMMA_STREAM2_MIN_STAGES (it also drops two gains: 4096x22016 M=96, 42 stages, 58.1 ->
# 53.9, 13824x5120 M=96, 33, 55.3 -> 52.5). With it, faster or level everywhere it fires: 4096x12288 M=384 84.9 ->
# 74.4 (bf16 83.8 -> 74.4, 8-bit 88.2 -> 76.8), 4096x22016 M=256 107.3 -> 90.1, 8192^2 M=384 103.9 -> 97.5,
# 14336x4096 M=640 174.2 -> 141.7, 28672x8192 M=320 / 384 / 640 / 768 344.0 / 354.9 / 678.9 / 707.1 -> 311.9 /
# 335.0 / 544.4 / 642.5, 5120x13824 M=320 / 640 130.7 / 201.0 -> 99.3 / 158.4, 13824x5120 M=512 168.9 -> 127.8,
# 8192x22016 M=96 / 192 103.5 / 200.3 -> 87.2 / 156.7, 11008x4096 M=640 139.4 -> 114.5; 13824x5120 M=640 level.
WGMMA_STREAM2_ROUTE = (128, 2, 4)
WGMMA_STREAM2_MAX_FILL = 0.8
WGMMA_STREAM2_MIN_KN = 1 << 25  # K*N at least this (the smallest where it fires and was measured: 8192x4096)
WGMMA_STREAM2_MIN_STAGES = 48  # 64-k stages per stream-K CTA at least this


def wgmma_route_stream2(m: int, n: int, k: int, cfg: tuple[int, int, int, bool], fam: Family, sms: int) -> bool:
    """Whether the automatic route runs the two-compute-warpgroup producer form WGMMA_STREAM2_ROUTE with stream-K
    instead of `cfg` (wgmma_route_config's (NT, FW, stages, wide)): dense 128-token tiles, N % 256 == 0, K*N from
    WGMMA_STREAM2_MIN_KN, the route's CTAs filling under WGMMA_STREAM2_MAX_FILL of their rounds per SM, and every
    stream-K CTA getting at least WGMMA_STREAM2_MIN_STAGES stages (one CTA per SM)."""
    nt, fw, _, _ = cfg
    if (fam.moe or nt != 128 or n % 256 or k * n < WGMMA_STREAM2_MIN_KN
            or WGMMA_STREAM2_ROUTE not in K.WGMMA_PROD2_CONFIGS):
        return False
    m_tiles = -(-m // nt)
    tiles = (n // (128 * fw)) * m_tiles
    ctas = tiles * wgmma_splits(tiles, k, nt, fw, sms)
    if ctas / (sms * -(-ctas // sms)) >= WGMMA_STREAM2_MAX_FILL:
        return False
    stages = (n // 256) * m_tiles * (k // 64)  # the stream-K sequence of the 256-feature tiles
    return sms * max(WGMMA_STREAM2_MIN_STAGES, WGMMA_SPLIT_MIN_STAGES) <= stages < 1 << 31


# Token tiles past 128 rows (sessions 41-42): where the route would run 128-token tiles (M = 129-1024), the
# two-compute-warpgroup producer form with tiles of 144-256 tokens (K.WGMMA_PROD2_CONFIGS) computes fewer
# padded rows (M = 129-256 as one tile) or runs faster per row (two to four 192- / 256-token tiles). H200 s41b
# (bench_gemm, f16 4-bit, us, ours / fp16 cuBLAS / Humming): 8192x28672 M = 129 194.9 / 115.7 / 96.7, 8192^2 M = 129
# 57.7 / 39.6 / 34.2. Session 42 (s42a, probe_configs, f16 4-bit, us, route without this rule -> the row's tile):
# - M = 129-144 (144, 2, 4) stream-K on K*N >= 2^27: 8192x28672 192.7 -> 111.9, 28672x8192 176.3 -> 112.3; one
#   strip ((144, 1, 6)) below: 4096x28672 103.0 -> 65.6, 8192^2 58.3 -> 41.2, 14336x4096 52.9 -> 38.1, 4096x12288
#   50.0 -> 34.0, 4096x11008 49.9 -> 31.9, 4096^2 24.3 -> 20.3 (stream-K; the two-strip tile there 48.0 / 46.9 /
#   40.8 / 39.2 / 31.6).
# - M = 145-160 (160, 2, 4) on K*N >= 2^27: 8192x28672 194.9 -> 132.7, 28672x8192 183.3 -> 129.9 ((192, 1, 6) 145.8 /
#   140.2); M = 145-192 (192, 1, 6) elsewhere, M = 161-192 everywhere: M = 192 8192x28672 202.7 -> 156.9,
#   28672x8192 185.6 -> 146.1, 4096x28672 104.1 -> 80.6, 8192^2 59.6 -> 45.5, 14336x4096 53.0 -> 42.8, 4096x12288
#   50.1 -> 37.3, 4096x11008 50.0 -> 36.9, 4096^2 24.5 -> 21.2.
# - M = 193-256 (256, 1, 4) above K*N = 2^24: M = 256 8192x28672 211.7 -> 193.3, 28672x8192 199.1 -> 178.6,
#   4096x28672 112.8 -> 98.0, 8192^2 61.7 -> 58.4, 4096x12288 51.0 -> 45.5, 4096x11008 50.4 -> 45.2, 14336x4096
#   55.2 -> 55.0; 4096^2 25.0 -> 26.5 (not taken).
# - M = 257-384 two (192, 1, 6) tiles from K = 8192 (stream-K, M = 288 / 384): 8192x28672 303.4 / 322.4 -> 268.9 /
#   297.3, 28672x8192 295.3 / 313.9 -> 263.0 / 285.6, 8192^2 88.5 / 92.3 -> 80.8 / 84.9, 14336x4096 81.0 / 84.5 ->
#   71.9 / 78.4; at K = 4096 mixed (M = 288 4096x28672 153.9 -> 170.9, 4096x11008 52.5 -> 74.2; not taken).
# - M = 385-512, 641-768, 897-1024 (256, 1, 4) tiles (where they pad no more than 128-token ones would, or a third
#   more at 385-512; per row they ran 0.85-0.91 of their time), M = 512 / 768 / 1024: 8192x28672 436.5 / 662.5 /
#   832.6 -> 391.4 / 569.0 / 747.6, 28672x8192 388.9 / 633.0 / 839.1 -> 334.6 / 585.9 / 759.7, 8192^2 104.6 / 176.8
#   / 221.1 -> 92.1 / 163.9 / 189.2, 4096x12288 84.5 / 145.6 / 165.9 -> 88.3 / 125.2 / 149.2, 4096^2 35.3 / 50.3 /
#   53.4 -> 35.3 / 44.1 / 48.2.
# - session 43 (s43a, probe_configs, f16 4-bit, us, route of session 42 -> the row's tile): two (160, 2, 4) tiles at
#   M = 257-320 from K*N = 3 * 2^24 (M = 257): 8192x28672 276.0 -> 220.2 (stream-K), 28672x8192 269.0 -> 205.3,
#   4096x28672 155.5 -> 120.4, 8192^2 78.7 -> 71.9, 14336x4096 72.3 -> 66.7, 4096x12288 72.6 -> 59.9 (4096x11008
#   53.2 -> 59.0: not taken); four at M = 513-640 above K*N = 2^24 (M = 544 / 640): 28672x8192 521.3 / 588.9 -> 385.2 /
#   448.1, 8192^2 173.6 / 169.9 -> 115.3 / 127.0, 14336x4096 134.2 / 141.3 -> 112.7 / 122.3, 8192x28672 544.8 /
#   587.6 -> 489.3 / 552.1, 4096x28672 277.2 / 291.2 -> 252.6 / 265.7, 4096x11008 109.7 / 115.3 -> 104.3 / 110.3
#   (4096x12288 106.4 / 114.7 -> 111.3 / 119.5, the one loss); five at M = 769-800 (M = 800): 8192x28672 708.7 ->
#   642.5, 28672x8192 737.8 -> 643.4, 4096x28672 360.3 -> 332.8, 8192^2 222.0 -> 188.6, 14336x4096 191.7 -> 156.5,
#   4096x12288 174.0 -> 130.1, 4096x11008 144.7 -> 124.0. (192, 1, 6) tiles on K*N in (2^23, 2^24] at M = 257-384
#   and 513-640 (4096^2, M = 288 / 544 / 640: 32.9 / 49.5 / 49.3 -> 28.5 / 36.2 / 38.4). (256, 1, 4) tiles at M = 801-896
#   where N <= 16384 (M = 896: 28672x8192 759.9 -> 718.9, 8192^2 226.7 -> 194.8, 14336x4096 193.0 -> 161.7, 4096x12288
#   170.1 -> 152.9, 4096x11008 152.6 -> 147.1, 4096^2 51.9 -> 47.0; N = 28672 lost: 8192x28672 740.0 -> 758.4,
#   4096x28672 371.6 -> 378.7). s43d (same probe, the stream-K hybrid built): four (192, 1, 6) tiles at M = 641-768 on
#   K*N in (2^23, 2^24] (M = 700 / 768, (256, 1, 4) -> (192, 1, 6)): 4096^2 43.8 / 43.4 -> 38.8 / 39.1, 2048x8192
#   50.0 / 50.6 -> 41.9 / 43.1 (the 256-token tiles lost to the route without the tall rule there, 43.1 / 44.1).
# - session 47 (s47e, probe_configs, f16 4-bit, us, two rounds, the (192, 1, 6) row -> two 144-token tiles, their K
#   splits as wgmma_tall_splits gives them) at M = 145-192 where N <= 2560 and K*N <= 2^24 (M = 160 / 192): 2048^2
#   14.8 / 14.9 -> 12.8 / 12.7, 2048x2560 14.9 / 15.0 -> 13.7 / 13.6, 5632x2048 21.1 / 21.2 -> 20.6 / 19.9, 8192x2048
#   25.9 / 26.0 -> 24.5 / 24.2 (the 192-token tile's 32-64 CTAs leave most SMs idle); not where N = 3584 (3584^2
#   M = 160 20.6 -> 22.4) or on the large shapes (11008x4096 M = 160 34.2 -> 45.9 with the cost model's pick).
# - session 48 (s48e, probe_configs, f16 4-bit, us, one round, the route (the 256-token row) -> the smallest of the
#   new 208- / 224- / 240-token tiles that holds M, K splits automatic) on 4096x12288, 4096x28672, 8192^2, 14336x4096,
#   28672x8192: M = 200 44.8 / 93.9 / 52.0 / 52.0 / 161.7 -> 38.8 / 81.8 / 45.1 / 45.8 / 150.3 (M = 208 alike), M = 224
#   45.4 / 96.5 / 52.2 / 53.0 / 168.0 -> 40.4 / 91.8 / 47.8 / 47.9 / 157.2, M = 240 45.7 / 98.8 / 53.5 / 53.9 / 176.0
#   -> 43.4 / 96.8 / 50.4 / 50.9 / 168.2, hence rows of these tiles at K*N > 2^24 (the 256-token row's bound; the old
#   table: probe config routeR47). s48f (9 other shapes x M = 200 / 224 / 240, two rounds; bf16 and fp16 8-bit on
#   three): faster in every cell, 4-15% (e.g. 18944x3584 M = 200 64.1 -> 55.0, 4096x22016 83.0 -> 73.3, 5120^2 M = 224
#   32.3 -> 29.8; bf16 14336x4096 M = 208 51.9 -> 44.8; 8-bit 4096x12288 M = 208 46.9 -> 39.9). The 176-token tile
#   at M = 145-176 (instead of the 192-token row) gained 0-5% on 8 shapes but lost where K splits in three through
#   the workspace (s48f 5120^2 M = 150 / 176 25.3 / 25.7 -> 27.6 / 28.1, 13824x5120 M = 176 49.9 -> 51.6): no row.
# The first row holding M whose bounds hold and whose kernel is built (K.WGMMA_PROD2_CONFIGS) is taken. Since
# session 44 the rows from M = 257 on are the A/B baseline only: the cost model below (wgmma_route_cost) routes there.
# WGMMA_TALL_MAX_M: none above it (0: the rule off).
class TallRow(NamedTuple):
    """A row of WGMMA_TALL_ROUTE: M in [lo, hi], min_kn <= K*N <= max_kn, K >= min_k, min_n <= N <= max_n."""
    lo: int
    hi: int
    tile: tuple[int, int, int]  # (NT, FW, STAGES)
    min_kn: int = 0
    max_kn: int = 1 << 62
    min_k: int = 0
    max_n: int = 1 << 62
    min_n: int = 0


WGMMA_TALL_ROUTE: tuple[TallRow, ...] = (
    TallRow(129, 144, (144, 2, 4), min_kn=1 << 27),
    TallRow(145, 160, (160, 2, 4), min_kn=1 << 27),
    TallRow(129, 144, (144, 2, 4), min_kn=(1 << 26) + 1, min_n=24576),
    TallRow(145, 160, (160, 2, 4), min_kn=(1 << 26) + 1, min_n=24576),
    TallRow(129, 144, (144, 1, 6)),
    TallRow(145, 192, (144, 1, 6), max_kn=1 << 24, max_n=2560),
    TallRow(145, 192, (192, 1, 6)),
    TallRow(193, 208, (208, 1, 6), min_kn=(1 << 24) + 1),
    TallRow(209, 224, (224, 1, 5), min_kn=(1 << 24) + 1),
    TallRow(225, 240, (240, 1, 5), min_kn=(1 << 24) + 1),
    TallRow(241, 256, (256, 1, 4), min_kn=(1 << 24) + 1),
    TallRow(257, 320, (160, 2, 4), min_kn=3 << 24),
    TallRow(257, 384, (192, 1, 6), min_kn=(1 << 23) + 1, max_kn=1 << 24),
    TallRow(257, 384, (192, 1, 6), min_k=8192),
    TallRow(385, 512, (256, 1, 4)),
    TallRow(513, 640, (192, 1, 6), min_kn=(1 << 23) + 1, max_kn=1 << 24),
    TallRow(513, 640, (160, 2, 4), min_kn=(1 << 24) + 1),
    TallRow(641, 768, (192, 1, 6), min_kn=(1 << 23) + 1, max_kn=1 << 24),
    TallRow(641, 768, (256, 1, 4)),
    TallRow(769, 800, (160, 2, 4), min_kn=(1 << 24) + 1),
    TallRow(801, 896, (256, 1, 4), max_n=16384),
    TallRow(897, 1024, (256, 1, 4)),
)
WGMMA_TALL_MAX_M = 1024
# Stream-K over the tiles (one CTA per SM) instead of whole tiles / K splits (wgmma_splits) where the idle part of
# the last round of CTAs is worth at least this many 64-k stages (its sums through the workspace cost about as much:
# s42a, (256, 1, 4), us, whole tiles vs stream-K: 4096x12288 M = 256 (17 stages idle) 45.5 vs 51.4, 8192x28672
# M = 1024 (27) 747.6 vs 837.1, 4096x12288 M = 768 (52) 142.5 vs 125.2, 8192^2 M = 768 (70) 183.9 vs 163.9,
# 14336x4096 M = 768 (60) 152.3 vs 141.0; 4096x12288 M = 512 (35) 93.7 vs 88.3).
WGMMA_TALL_SK_IDLE_STAGES = 32


def wgmma_tall_splits(m: int, n: int, k: int, c: tuple[int, int, int], sms: int) -> int:
    """K splits of a tall-tile launch (wgmma_route_tall's config `c`): -1 (stream-K) where the whole-tile / K-split
    launch leaves at least WGMMA_TALL_SK_IDLE_STAGES stages idle in its last round and every stream-K CTA gets
    WGMMA_SPLIT_MIN_STAGES, else wgmma_splits (one CTA per SM)."""
    nt, fw, _ = c
    tiles = -(-m // nt) * (n // (128 * fw))
    splits = wgmma_splits(tiles, k, nt, fw, sms, 1)
    ctas, per_cta = tiles * splits, (k // 64) / splits
    idle = (-(-ctas // sms) - ctas / sms) * per_cta
    stages = tiles * (k // 64)  # the stream-K sequence
    if idle >= WGMMA_TALL_SK_IDLE_STAGES and sms * WGMMA_SPLIT_MIN_STAGES <= stages < 1 << 31:
        return -1
    return splits


# Above M = 256 the tall tile comes from a cost model (session 44; the table rows above 256 stay for A/Bs:
# WGMMA_TALL_MODEL = False, probe_configs `routeTab`). Time of a launch ~ a + c[form] x the 64-k stages each CTA runs
# in sequence (rounds of whole tiles / K-split runs; the two-compute-warpgroup stream-K's hybrid rounds plus its
# share of the tiles left) + a K-split fix-up (split + per_split x splits) + a stream-K fix-up (sk + sk_stage x
# stages). Least squares on relative error (benchmarks/fit_tall_cost.py) over s43d (11 shapes x M = 300-1024, every
# tall tile whole and stream-K) and s44a (12 shapes, 9 of them new, x M = 257-1000: table route, model route, no
# tall tiles), H200, fp16 4-bit g128: median error 5%. Measured on s44a's 9 new shapes and 3 old (model fitted to s43d
# only): 3.0% faster than the table route (geometric mean over 120 cells), > 5% faster in 28, > 5% slower in 5.
# Forms: (NT, FW, "p2") the two-compute-warpgroup producer form, "plain" / "w" (wide) the 128-token plain forms.
WGMMA_TALL_MODEL = True
WGMMA_TALL_MODEL_MIN_M = 257  # the table's rows (and its 144-token tiles) below
# Session 47 (s47b, probe_configs, two interleaved rounds, 8 shapes x M = 257 / 300 / 448 / 544 / 1024, H200): the
# model refitted in session 46 (benchmarks/fit_tall_cost.py s43d s44a --clustered s45d --clustered s46a, 205 cells,
# median error 4.9%) with the 144-token tile and the clustered two-way split's term, against session 44's fit (kept in
# probe_configs as config `routeC0`): geometric mean 0.97 over the 40 cells, > 3% faster in 9 (us, old -> new: 4096^2
# M = 257 28.7 -> 22.1 and M = 544 36.3 -> 33.6, 3584x4608 M = 257 / 300 34.4 / 34.6 -> 27.5 / 27.5, 11008x4096 M = 257
# 54.7 -> 47.4, 14336x4096 M = 257 65.5 -> 59.4, 4096x6144 M = 257 37.4 -> 33.9, 5120^2 M = 448 47.9 -> 44.7,
# 28672x8192 M = 544 443.1 -> 424.6), > 3% slower in one: 5120x13824 M = 544 133.9 -> 143.5 (the 192-token tile's
# 324 whole tiles instead of its stream-K, priced within 0.2 us of each other).
# Session 48: the 176- / 208- / 224- / 240-token tiles built and priced (refit: fit_tall_cost.py as above plus
# --clustered s48a.log --clustered s48b.log, every tall tile whole and stream-K on 6 shapes x M = 300-1024, 1080 cells;
# 1011 launches in the fit, median error 4.8%). Leave-one-shape-out on s48's 60 cells: the model's pick 0.948 of the
# shipped route's time (geometric mean; > 3% faster in 34, > 3% slower in one: 14336x4096 M = 528 +4.5%), e.g. M = 416
# / 448 / 800 on 4096^2 and 8192^2 12-19% faster (2 x 208 / 2 x 224 / 4 x 208 rows instead of 256-row padding).
# Measured (s48d, routeC47 -> route, 12 shapes outside the fit x M = 300-960, two rounds, plus bf16 / fp16 8-bit on
# three of the fit's): geometric mean 0.972 over 144 cells (fp16 4-bit held-out alone 0.983), > 3% faster in 56,
# > 3% slower in 20, up to +10% where the model now takes the 144-token tile's whole tiles (3584x4608 M = 300 27.3 ->
# 30.2, 2048x2560 M = 448 17.1 -> 18.5; see benchmarks/NOTES.md session 48). Session 47's model: probe routeC47.
WGMMA_COST_PER_STAGE = {(128, 1, "plain"): 0.777, (128, 2, "p2"): 0.826, (128, 2, "w"): 0.858, (144, 1, "p2"): 0.504,
                        (160, 2, "p2"): 0.962, (176, 1, "p2"): 0.566, (192, 1, "p2"): 0.589, (208, 1, "p2"): 0.637,
                        (224, 1, "p2"): 0.659, (240, 1, "p2"): 0.705, (256, 1, "p2"): 0.762}
WGMMA_COST_TERMS = {"a": -0.275, "split": 4.135, "per_split": 2.721, "sk": 15.476, "sk_stage": 0.04, "cluster": -2.259}
# "cluster": added to a two-way K split's fix-up where its CTAs sum as a cluster (wgmma_cost_clusterable; session
# 45's cluster sum against the workspace fix-up).
# Prepared in session 48 (off; probe config routeC49 turns it on with its own fit): the fix-up terms (split,
# per_split, sk, cluster) times the tile's rows / 128 (NT x FW / 128: the fp32 partial sums a fix-up moves).
# Leave-one-shape-out over s43d-s48d (fit_tall_cost.py --fixup-rows): picks 0.7% slower than the best measured
# launch on average instead of 0.9%, 16 instead of 24 of 337 cells > 5% slower; not measured as a route yet.
WGMMA_COST_FIXUP_ROWS = False


def wgmma_cost_stages(m: int, n: int, k: int, form: tuple[int, int, str], splits: int, slots: int) -> float:
    """The cost model's feature: the 64-k stages each of `slots` resident CTAs runs in sequence in a launch of `form`
    with `splits` (-1: stream-K; the two-compute-warpgroup form's whole-tile rounds first, as jm_wgmma.cuh
    wgmma_pieces runs them)."""
    nt, fw, kind = form
    tiles, ks = -(-m // nt) * (n // (128 * fw)), k // 64
    if splits != -1:
        return -(-tiles * splits // slots) * ks / splits
    dp = 0
    if kind == "p2":
        dp = tiles // slots
        if dp > 0 and tiles > dp * slots and (tiles - dp * slots) * ks < slots * WGMMA_SPLIT_MIN_STAGES:
            dp -= 1
    return dp * ks + (tiles - dp * slots) * ks / slots


def wgmma_cost_clusterable(form: tuple[int, int, str]) -> bool:
    """Whether a two-way K split of `form` can sum as a cluster of 2 by wgmma_cluster_sum's share rule (256 compute
    threads, 512 in the wide form). The launch itself asks the device too (its one-round rule); the cost model
    does not."""
    nt, fw, kind = form
    return wgmma_cluster_shares_even(nt, fw, 512 if kind == "w" else 256, 2)


def wgmma_cost_us(m: int, n: int, k: int, form: tuple[int, int, str], splits: int, per_sm: int, sms: int) -> float:
    """The cost model's time (us, H200 fp16 4-bit) of a wgmma launch of `form` with `splits` (-1: stream-K)."""
    t = WGMMA_COST_TERMS
    stages = wgmma_cost_stages(m, n, k, form, splits, sms * per_sm)
    rows = form[0] * form[1] / 128 if WGMMA_COST_FIXUP_ROWS else 1.0
    if splits == -1:
        fix = t["sk"] * rows + t["sk_stage"] * stages
    else:
        fix = (t["split"] + t["per_split"] * splits) * rows if splits > 1 else 0.0
        if splits == 2 and t["cluster"] and WGMMA_CLUSTER_SUM and wgmma_cost_clusterable(form):
            fix += t["cluster"] * rows
    return t["a"] + WGMMA_COST_PER_STAGE[form] * stages + fix


def wgmma_route_cost(m: int, n: int, k: int, cfg: tuple[int, int, int, bool], fam: Family,
                     sms: int) -> tuple[tuple[int, int, int], int] | None:
    """wgmma_route_tall by the cost model: the cheapest of each built tall tile (whole tiles / K splits, and stream-K
    where every CTA gets WGMMA_SPLIT_MIN_STAGES) and the launch the route makes without tall tiles (None)."""
    nt, fw, _, wide = cfg
    if wgmma_route_stream2(m, n, k, cfg, fam, sms):
        best = wgmma_cost_us(m, n, k, (128, 2, "p2"), -1, 1, sms)
    else:
        form = (nt, fw, "w" if wide else "plain")
        if form not in WGMMA_COST_PER_STAGE:
            return None
        per_sm = 1 if wide else wgmma_ctas_per_sm(fw)
        best = wgmma_cost_us(m, n, k, form, wgmma_splits(-(-m // nt) * (n // (128 * fw)), k, nt, fw, sms, per_sm),
                             per_sm, sms)
    pick = None
    for c in K.WGMMA_PROD2_CONFIGS:
        form = (c[0], c[1], "p2")
        if c[0] <= 128 or form not in WGMMA_COST_PER_STAGE or n % (128 * c[1]):
            continue
        tiles = -(-m // c[0]) * (n // (128 * c[1]))
        options = [wgmma_splits(tiles, k, c[0], c[1], sms, 1)]
        if sms * WGMMA_SPLIT_MIN_STAGES <= tiles * (k // 64) < 1 << 31:
            options.append(-1)
        for sp in options:
            us = wgmma_cost_us(m, n, k, form, sp, 1, sms)
            if us < best:
                best, pick = us, (c, sp)
    return pick


def wgmma_route_tall(m: int, n: int, k: int, cfg: tuple[int, int, int, bool], fam: Family,
                     sms: int) -> tuple[tuple[int, int, int], int] | None:
    """((NT, FW, STAGES), splits) of the two-compute-warpgroup producer form with token tiles of more than 128
    rows, instead of `cfg` (wgmma_route_config's) where that runs 128-token tiles and 128 < M <= WGMMA_TALL_MAX_M:
    from M = WGMMA_TALL_MODEL_MIN_M the cost model's pick (wgmma_route_cost), below it the first WGMMA_TALL_ROUTE row
    that holds, with splits from wgmma_tall_splits (-1: stream-K). None: not routed."""
    if fam.moe or cfg[0] != 128 or not 128 < m <= WGMMA_TALL_MAX_M:
        return None
    if WGMMA_TALL_MODEL and m >= WGMMA_TALL_MODEL_MIN_M:
        return wgmma_route_cost(m, n, k, cfg, fam, sms)
    for r in WGMMA_TALL_ROUTE:
        c = r.tile
        if (r.lo <= m <= r.hi and r.min_kn <= k * n <= r.max_kn and k >= r.min_k and r.min_n <= n <= r.max_n
                and n % (128 * c[1]) == 0 and c in K.WGMMA_PROD2_CONFIGS):
            return c, wgmma_tall_splits(m, n, k, c, sms)
    return None


# The producer form (jm_wgmma.cuh: a producer warpgroup with setmaxnreg + one compute warpgroup of
# two strips, two CTAs per SM; K.WGMMA_PROD_CONFIGS). H200, session 18 (benchmarks/NOTES.md), µs:
# - the routed (64, 1, 6) config at M = 33-64, plain -> producer: f16 4-bit 8192x28672 76.5 -> 71.6
#   (M=48), 28672x8192 74.8 -> 70.3, 4096x28672 41.2 -> 39.4; 8-bit M=64 88.3 -> 82.0, 85.5 -> 79.7,
#   44.7 -> 40.8; bf16 2-3% faster; 8192^2, 14336x4096, 4096^2 level or slower (kept plain).
# - 32-token tiles at M = 17-32, 4-bit, route -> (32, 1, 8) producer: 8192x28672 65.9 -> 64.7
#   (M=32), 28672x8192 67.5 -> 63.6, 4096x28672 39.0 -> 36.1, 8192^2 25.0 -> 23.3 (the route was the
#   mma.sync 32-row kernel above K*N = 2^27, the plain wgmma kernel below).
# (16, 1, 8) in the producer form lost to the route at M = 9-16 for 4-bit weights (8192x28672 59.0 vs
# 42.6; session 21: 4096x28672 M=16 32.7 vs 26.0, 8192^2 20.0 vs 19.1).
# - session 21: fp16 8-bit weights at M = 9-16 take (16, 1, 8) (two CTAs per SM) where K*N >= 2^26 and
#   N >= 8192 (probe_configs, s21d, us, route = the six-slot mma.sync ring -> producer form, M = 9 / 16):
#   28672x8192 66.6 / 66.4 -> 61.1 / 61.1, 4096x28672 37.4 / 37.3 -> 32.2 / 32.5, 8192^2 23.8 / 23.3 ->
#   22.4 / 22.4, 5120x13824 25.0 / 24.3 -> 23.0 / 23.1, 8192x28672 64.2 / 63.8 -> 63.5 / 64.0 (level).
#   Not taken: 13824x5120 (27.9 / 26.7 -> 27.9 / 28.4), 14336x4096 (+5-10%), 4096x12288 (+1-3%),
#   2048x5632 and 4096^2 (+0-5%; the last already runs the plain 16-token tile), bf16 (its dequantization
#   is costlier: 3-20% slower on most shapes; faster only on 8192^2 and the K or N = 11008 Llama shapes).
#   Also faster but below the bounds: 4096x11008 18.9 -> 16.8, 11008x4096 21.5 -> 20.3 (M=9).
# - session 20: 32-token tiles at three CTAs per SM ((32, 1, 6), K.WGMMA_PROD_CTAS: 12 compute warps per
#   SM) where K*N >= 2^26 (4-bit): probe_configs, us, M = 32, (32, 1, 8) at two CTAs per SM / the
#   four-strip (32, 2, 6) / (32, 1, 6) at three: 8192x28672 64.9 / 59.0 / 56.0, 28672x8192 63.8 / 56.7 /
#   55.1, 4096x28672 36.1 / 33.2 / 32.6, 8192^2 24.2 / 25.3 / 21.5 (M=17 the same within 1%); below
#   2^26 slower than the plain route (14336x4096 24.5 vs 21.4, 4096^2 10.7 vs 10.3).
WGMMA_PROD_ABOVE_KN = 1 << 26  # 64-token tiles: K*N strictly above this
WGMMA_PROD_N32_MIN_KN = 1 << 26  # 32-token tiles (4-bit): K*N at least this
WGMMA_PROD_N32 = (32, 1, 6)
WGMMA_PROD_N16 = (16, 1, 8)  # fp16 8-bit weights, M = 9-16:
WGMMA_PROD_N16_MIN_KN = 1 << 26  # K*N at least this
WGMMA_PROD_N16_MIN_N = 8192  # and N at least this
# - session 37 (after the wgmma stage loop was unrolled over its ring): 4-bit weights at M = 9-16, the route (the
#   mma.sync 16-row tiles) -> (16, 1, 8) in the producer form, probe_configs, two passes each, us, M = 9 / 16: f16
#   4096x11008 15.2 / 15.5 -> 13.5 / 13.6, 11008x4096 18.1 / 18.3 -> 17.1 / 17.1, 8192^2 18.6 / 18.8 -> 16.9 / 17.1;
#   bf16 4096x11008 15.4 / 15.8 -> 14.7 / 14.9 (8192^2 -2%, 11008x4096 level: not taken). Slower on every other
#   shape measured, with no size rule that separates them (f16 M=16: 4096x12288 15.9 -> 16.7, 14336x4096 20.1 ->
#   21.8, 5120x13824 19.8 -> 20.2, 13824x5120 21.4 -> 25.4, 4096x22016 22.9 -> 24.1, 4096x28672 25.6 -> 28.0,
#   8192x28672 42.5 -> 51.3, 28672x8192 42.6 -> 50.0), so the measured shapes (K, N) are listed per dtype.
# - session 38: (16, 1, 7) at three CTAs per SM (K.WGMMA_PROD_CONFIGS_U4), probe_configs, us, M = 9 / 16, route /
#   (16, 1, 7) / (16, 1, 8), two runs: f16 4096x12288 15.5 / 15.8 -> 14.1 / 14.2 and 15.8 / 15.9 -> 14.3 / 14.4
#   (16.5 / 16.6, 16.7 / 16.8 on (16, 1, 8)); bf16 15.7 / 16.0 -> 15.1 / 15.1 and 15.9 / 16.2 -> 15.3 / 15.5. Level
#   or slower elsewhere (f16 M=16: 4096x22016 22.9 -> 22.8, 5120x13824 20.1 -> 19.9, 4096x28672 25.6 -> 26.7, 8192^2
#   17.1 -> 21.1, 14336x4096 20.3 -> 21.6, 28672x8192 43.0 -> 61.4); four CTAs per SM ((16, 1, 6)): behind (16, 1, 7)
#   on 4096x12288 (15.0 / 15.1) and level or slower elsewhere. Not taken where (16, 1, 8) runs: 4096x11008 13.6 /
#   13.8 vs 13.5 / 13.6, 11008x4096 17.4 vs 17.4 (within noise).
WGMMA_PROD_N16_U4 = {"f16": {(4096, 11008): (16, 1, 8), (11008, 4096): (16, 1, 8), (8192, 8192): (16, 1, 8),
                             (4096, 12288): (16, 1, 7)},
                     "bf16": {(4096, 11008): (16, 1, 8), (4096, 12288): (16, 1, 7)}}


def wgmma_route_prod(n: int, k: int, cfg: tuple[int, int, int, bool], fam: Family) -> tuple | None:
    """The producer-form config (NT, FW, stages) the automatic route runs instead of `cfg`
    (wgmma_route_config's (NT, FW, stages, wide)), or None."""
    if fam.moe or cfg[3]:
        return None
    if cfg[0] == 64 and k * n > WGMMA_PROD_ABOVE_KN and cfg[:3] in K.WGMMA_PROD_CONFIGS:
        return cfg[:3]
    if (cfg[0] == 32 and fam.bits == 4 and k * n >= WGMMA_PROD_N32_MIN_KN and n % 128 == 0
            and WGMMA_PROD_N32 in K.WGMMA_PROD_CONFIGS):
        return WGMMA_PROD_N32
    if (cfg[0] == 16 and fam.bits == 8 and fam.dtype == "f16" and k * n >= WGMMA_PROD_N16_MIN_KN
            and n >= WGMMA_PROD_N16_MIN_N and n % 128 == 0 and WGMMA_PROD_N16 in K.WGMMA_PROD_CONFIGS):
        return WGMMA_PROD_N16
    if cfg[0] == 16 and fam.bits == 4:
        want = WGMMA_PROD_N16_U4.get(fam.dtype, {}).get((k, n))
        # (membership in K.dense_prod_configs(4) without building that tuple: the general path asks per call)
        if want is not None and (want in K.WGMMA_PROD_CONFIGS or want in K.WGMMA_PROD_CONFIGS_U4):
            return want
    return None


WGMMA_SPLIT_MIN_STAGES = 16  # a K split keeps at least this many 64-k stages (pipeline fill)


def wgmma_ctas_per_sm(fw: int, prod: tuple[int, int, int] | None = None, bits: int = 0) -> int:
    """Resident CTAs per SM: two with one strip per warpgroup, one with two; the producer form `prod`
    (its (NT, FW, STAGES): one compute warpgroup of 2 fw strips + the producer warpgroup, 256
    threads) K.prod_ctas(prod, bits) of a dense family of `bits`-bit weights, two to four."""
    if prod is not None:
        return K.prod_ctas(prod, bits)
    return 2 if fw == 1 else 1


def wgmma_splits(tiles: int, k: int, nt: int, fw: int, sms: int, per_sm: int = 0) -> int:
    """CTAs per output tile along K: as many as fit the resident CTA slots (per_sm per SM when given,
    else two with one strip per warpgroup, one with two), each with at least WGMMA_SPLIT_MIN_STAGES stages, at most 8
    with 32- and 64-token tiles and 4 with 128 (the last CTA reads every split's partials: 32 / 64 KB per
    CTA). H200 (benchmarks/NOTES.md, "wgmma split-K"): 4096^2 M=64 4 splits 12.7 us vs 8 14.2;
    14336x4096 M=64 8 splits 28.0 vs 4 31.8; M=128 4 splits 42.0 vs 8 44.5."""
    slots = sms * (per_sm or wgmma_ctas_per_sm(fw))
    cap = 8 if nt in (32, 64) else 4  # 32 tokens: 8 since session 14 (14336x4096 M=32 25.1 -> 21.4 us)
    return max(1, min(slots // max(1, tiles), (k // 64) // WGMMA_SPLIT_MIN_STAGES, cap))


WGMMA_STREAM_MAX_FILL = 0.9  # stream-K where whole tiles would keep more than 10% of the CTA slots idle
WGMMA_STREAM_MIN_GAIN_STAGES = 16


def wgmma_stream_grid(tiles: int, k: int, nt: int, fw: int, sms: int, per_sm: int = 0) -> int:
    """CTAs of a stream-K launch (cuda_src/jm_wgmma.cuh, wgmma_body: the tiles' 64-k stages in one
    sequence cut evenly over the resident CTA slots), or 0 for a tile-per-CTA launch. Taken where
    tiles do not split along K (wgmma_splits == 1) and fill under WGMMA_STREAM_MAX_FILL of the slots
    over their waves, e.g. 112 two-strip tiles of 4096x28672 / 8192x28672 on 132 SMs (85%); runs
    of at least WGMMA_SPLIT_MIN_STAGES stages; up to 64 tokens (the 128-token kernel spills with
    it)."""
    slots = sms * (per_sm or wgmma_ctas_per_sm(fw))
    if tiles < 1 or nt > 64 or wgmma_splits(tiles, k, nt, fw, sms, per_sm) > 1 or tiles * (k // 64) >= 1 << 31:
        return 0  # (the kernel counts the stages of a stream-K launch in 32-bit integers)
    # Every CTA's run must hold stages: a tile's pieces are counted as the CTAs between its first
    # and last stage, so a CTA with an empty run inside that span never arrives, the tile is never
    # written and its counter stays non-zero (H200 session 19: K=1408 N=512 M=24, 4 tiles x 22
    # stages on 264 CTAs, NaN outputs and later launches' sums corrupted). Runs of at least
    # WGMMA_SPLIT_MIN_STAGES stages, as for K splits.
    if tiles * (k // 64) < slots * WGMMA_SPLIT_MIN_STAGES:
        return 0
    waves = -(-tiles // slots)
    idle = 1 - tiles / (waves * slots)
    # the gain must outweigh the cut tiles' sums (H200 session 14, NOTES.md: about 7-10 us per launch):
    # idle slots x stages per CTA of the plain launch >= 16 stages. 8192x28672 M=64 (0.15 x 128) 94.7
    # -> 88.4 us; 4096x22016 (0.35 x 64) 48.4 -> 41.4; 4096x28672 (0.15 x 64) 48.7 -> 50.3, not taken
    if idle < 1 - WGMMA_STREAM_MAX_FILL or idle * waves * (k // 64) < WGMMA_STREAM_MIN_GAIN_STAGES:
        return 0
    return slots


def wgmma_split_workspace(m_tiles: int, f_tiles: int, splits: int, nt: int, fw: int) -> tuple[int, int]:
    """(floats, counters) a split launch needs: a region of 256 * fw * nt / 2 partial sums per CTA
    (mirrors the kernel's kRegion), one arrival counter per output tile."""
    return m_tiles * f_tiles * splits * 256 * fw * (nt // 2), m_tiles * f_tiles


def wgmma_stream_workspace(grid: int, m_tiles: int, f_tiles: int, nt: int, fw: int) -> tuple[int, int]:
    """(floats, counters) a stream-K launch of `grid` CTAs needs: two regions of 256 * fw * nt / 2
    partial sums per CTA (its first and last tile's pieces), one arrival counter per output tile."""
    return 2 * grid * 256 * fw * (nt // 2), m_tiles * f_tiles


def wgmma_split_bound(sms: int) -> int:
    """Partial-sum floats that cover every split launch the heuristic makes (grid <= resident
    slots, two regions per slot of at most 256 x 64 floats, 256 x 128 with a 128-token two-compute-warpgroup
    producer config built: K.WGMMA_PROD2_CONFIGS). The first split launch reserves this much, so a
    CUDA graph captured later never needs the workspace to grow (≈ 17 MB on 132 SMs, 35 MB with that config)."""
    return 2 * sms * 256 * max([64] + [fw * nt // 2 for nt, fw, _ in K.WGMMA_PROD2_CONFIGS])


@dataclass(frozen=True)
class WgmmaLaunch:
    """The wgmma kernel and its launch for one problem size on one device."""

    fn: driver.Function
    smem: int
    m_tiles: int
    grid: int
    splits: int  # CTAs per tile along K; -1: stream-K (wgmma_stream_grid)
    ws: tuple[int, int]  # (floats, counters) to reserve when splits != 1 (at least wgmma_split_bound)
    pdl: bool
    nt: int  # tokens per tile (the TMA box of the activations)
    threads: int = 256  # 512: the wide form (four warpgroups of one strip); the producer form K.WGMMA_PROD_THREADS,
    # its two-compute-warpgroup form K.WGMMA_PROD2_THREADS
    fw: int = 1  # 64-feature strips per warpgroup (of the two-warpgroup form)
    stages: int = 4
    prod: int = 0  # 1 the producer form (its activations by TMA at every token tile), 2 its two-compute-warpgroup form
    cluster: int = 0  # > 1: launched in clusters of the K splits, summed through distributed shared memory


@functools.lru_cache(maxsize=4096)
def wgmma_launch(m: int, n: int, k: int, fam: Family, index: int, nt: int | None = None, fw: int | None = None,
                 stages: int | None = None, splits: int | None = None, wide: bool = False,
                 prod: int = 0) -> WgmmaLaunch:
    """Config, kernel and grid of the wgmma kernel for (M, N, K) (memoized: the eager launch path
    runs this once per shape, not per call). prod: 1 (True) the producer form, 2 its two-compute-warpgroup
    form (K.WGMMA_PROD2_CONFIGS; one CTA per SM, stream-K at any token tile; routed: wgmma_route_stream2)."""
    if n % 128 or k % 64:
        raise ValueError(f"the wgmma kernel needs N % 128 == 0 and K % 64 == 0, got N={n}, K={k}")
    sms = driver.device(index).sm_count
    if nt is None or fw is None or stages is None:
        nt, fw, stages, auto_wide = wgmma_route_config(m, n, k, sms, fam.moe)
        wide = wide or auto_wide
        routed = wgmma_route_prod(n, k, (nt, fw, stages, wide), fam)
        tall = None if routed is not None or splits is not None else wgmma_route_tall(
            m, n, k, (nt, fw, stages, wide), fam, sms)
        if tall is not None and wgmma_halve_over_tall(m, n, k, (nt, fw, stages, wide), tall[0][0], fam, sms):
            tall = None  # the plain 128-token tile, whose K splits wgmma_halve_splits then clusters in two
        if routed is not None:
            (nt, fw, stages), wide, prod = routed, False, 1
        elif tall is not None:
            (nt, fw, stages), splits = tall
            wide, prod = False, 2
        elif splits is None and wgmma_route_stream2(m, n, k, (nt, fw, stages, wide), fam, sms):
            (nt, fw, stages), wide, prod, splits = WGMMA_STREAM2_ROUTE, False, 2, -1
    if n % (128 * fw):
        raise ValueError(f"the wgmma kernel with {fw} strips per warpgroup needs N % {128 * fw} == 0, got N={n}")
    m_tiles, f_tiles = -(-m // nt), n // (128 * fw)
    if prod == 2 and ((nt, fw, stages) not in K.WGMMA_PROD2_CONFIGS or wide or fam.moe):
        raise ValueError(f"no two-compute-warpgroup producer-form wgmma kernel for NT={nt}, FW={fw}, stages={stages} "
                         f"(built: {K.WGMMA_PROD2_CONFIGS}, dense, never wide)")
    if prod == 1 and ((nt, fw, stages) not in K.dense_prod_configs(fam.bits) or wide or fam.moe):
        raise ValueError(f"no producer-form wgmma kernel for NT={nt}, FW={fw}, stages={stages}, wide={wide} "
                         f"(built for {fam.bits}-bit weights: {K.dense_prod_configs(fam.bits)}, dense, never wide)")
    per_sm = 1 if prod == 2 else wgmma_ctas_per_sm(fw, (nt, fw, stages) if prod else None, fam.bits)
    auto_splits = splits is None
    if splits is None:
        splits = wgmma_splits(m_tiles * f_tiles, k, nt, fw, sms, per_sm)
        if splits == 1 and wgmma_stream_grid(m_tiles * f_tiles, k, nt, fw, sms, per_sm):
            splits = -1
    if splits == -1:  # stream-K over the resident CTA slots: two regions per CTA
        if nt > 64 and prod != 2:
            raise ValueError(f"stream-K (splits=-1) needs a token tile of at most 64 (or the two-compute-warpgroup "
                             f"producer form), got {nt}")
        grid = sms * per_sm
        if m_tiles * f_tiles * (k // 64) < grid:  # (wgmma_stream_grid: an empty run breaks the sums)
            raise ValueError(f"stream-K (splits=-1) needs at least one 64-k stage per CTA: {m_tiles * f_tiles} "
                             f"tiles x {k // 64} stages < {grid} CTAs (M={m}, N={n}, K={k})")
        floats, counters = wgmma_stream_workspace(grid, m_tiles, f_tiles, nt, fw)
    elif not 1 <= splits <= k // 64:
        raise ValueError(f"wgmma K splits must be in [1, K/64 = {k // 64}] (or -1: stream-K), got {splits}")
    else:
        grid = f_tiles * m_tiles * splits
        floats, counters = wgmma_split_workspace(m_tiles, f_tiles, splits, nt, fw)
    if wide and not prod and ((nt, fw, stages) not in K.WGMMA_WIDE_CONFIGS or fam.moe):
        raise ValueError(f"no wide (four-warpgroup) wgmma kernel for NT={nt}, FW={fw}, stages={stages} "
                         f"(built: {K.WGMMA_WIDE_CONFIGS}, dense only)")
    fn = K.get_wgmma_kernel(fam, nt, fw, stages, index, wide, prod)
    smem = K.wgmma_smem_bytes(fam, nt, fw, stages)
    threads = K.WGMMA_PROD2_THREADS if prod == 2 else K.WGMMA_PROD_THREADS if prod else 512 if wide else 256
    paired = 0
    if auto_splits and wgmma_halve_splits(m_tiles * f_tiles, splits, nt, fw, prod, wide, sms, k):
        paired = wgmma_cluster_sum(fn, fam, nt, fw, 2, threads, smem, prod, f_tiles * m_tiles * 2, sms * per_sm)
    if paired:  # only as a cluster: two splits through the workspace were not measured faster
        splits, grid, cluster = 2, f_tiles * m_tiles * 2, paired
        floats, counters = wgmma_split_workspace(m_tiles, f_tiles, splits, nt, fw)
    else:
        cluster = wgmma_cluster_sum(fn, fam, nt, fw, splits, threads, smem, prod, grid, sms * per_sm)
    return WgmmaLaunch(fn, smem, m_tiles, grid, splits, (max(floats, wgmma_split_bound(sms)), counters),
                       use_pdl(_cc(index)), nt, threads, fw, stages, prod, cluster)


# The K splits of a dense wgmma tile summed through distributed shared memory (jm_wgmma.cuh, wgmma_tile:
# a cluster launch of the splits) instead of the workspace fixup. H200 session 45 (s45c, route, us,
# workspace -> cluster): clusters of 2 gained 4-9% wherever the route splits K in two (8192^2 M = 129 / 256 /
# 300 38.5 / 58.2 / 74.2 -> 36.8 / 54.1 / 68.4, 14336x4096 M = 544 113.6 -> 104.8, 4096x12288 M = 64 24.8 ->
# 22.7); clusters of 4 ran up to 1.8x slower (14336x4096 M = 256 54.0 -> 93.5, 8192^2 M = 16 17.4 -> 29.0)
# or level, so they are not launched (the kernel sums clusters of 2, 3 or 4: the GPU tests run all three).
# Off (WGMMA_CLUSTER_SUM = False): the workspace (A/B probes, `+ws` configs of probe_configs.py).
WGMMA_CLUSTER_SUM = True
WGMMA_CLUSTER_MAX = 2  # clusters of up to this many splits (jm_wgmma.cuh sums 2, 3 or 4 and no other size)


# Two clustered K splits instead of the plain 128- or 64-token form's three or four through the workspace, where two
# per tile give an SM at most one CTA and fill enough of them (WGMMA_HALVE_MIN_FILL[NT] x SMs <= 2 x tiles <= SMs)
# and K <= WGMMA_HALVE_MAX_K x NT / 128 (the fixup saved scales with the token tile, the one-CTA stream's loss with
# K): the form runs two CTAs per SM, so the halved launch streams the same K per SM with one CTA and drops the last
# CTA's read of three or four whole tiles of partial sums (past one CTA per SM some SMs would stream twice the K of
# the split launch's busiest SM).
# H200, session 46 (s46c, probe_configs, us, two rounds, rule off -> on): 4096^2 M = 200 / 256 24.7 / 25.2 -> 20.1 /
# 20.1, 3072x4096 M = 256 22.9 -> 16.6, 4096x8192 M = 72 / 128 26.3 / 25.5 -> 21.1 / 20.2, 3072x8192 M = 96 22.1 ->
# 16.4, 8192^2 M = 96 / 128 35.8 / 37.5 -> 34.3 / 34.6 (M = 72 35.1 -> 35.4); bf16 and 8-bit alike (s46d); with
# longer K one CTA per SM streams too slowly: 28672x8192 M = 72 / 96 99.1 / 95.0 -> 112.3 / 105.3, 14336x8192
# M = 96 53.0 -> 55.6, 11008x8192 M = 72 / 96 43.0 / 43.8 -> 44.5 / 44.7, hence the K bound. The 64-token tile
# (s46g, M = 40 / 64, route -> two clustered splits): 3072x8192 15.1 / 15.7 -> 13.1 / 13.3, 4096x8192 16.4 / 17.1 ->
# 16.3 / 16.4; 5120x8192 18.7 / 19.2 -> 19.4 / 19.5 and 8192^2 25.4 / 25.8 -> 28.8 / 29.1 (so K <= 4096 there);
# the rule on it, s46h (f16 / bf16 / fp16 8-bit, rule off -> on, M = 64): 3072x8192 15.8 / 16.0 / 17.1 -> 13.4 /
# 13.5 / 14.2, 4096x8192 17.2 / 17.3 / 19.1 -> 16.6 / 16.6 / 17.6.
# Session 48 (s48c, probe_configs, two rounds, fill 0.9 -> 0.8: two splits of 56 tiles, 112 CTAs, now halve): N = 3584
# M = 160-256 3072x3584 19.0-23.4 -> 16.3-16.6, 3584^2 20.6-25.6 -> 18.3, 4096x3584 M = 224 / 256 25.5 / 26.0 -> 20.1
# (M = 160 20.7 -> 19.9), 8192x3584 M = 224 / 256 36.6 / 37.6 -> 34.5 / 34.4; N = 7168 M = 40-128 3584x7168 16.8-25.1
# -> 14.8-18.3, 4096x7168 M = 96 / 128 24.4 / 25.4 -> 20.0 / 20.1, 7168^2 M = 96 / 128 32.8 / 34.2 -> 30.7 / 31.1;
# level (within 1.5%) at 8192x3584 M = 160 / 192, 7168^2 M = 40 / 64, 8192x7168 M = 40 / 64. Geometric mean over the
# 32 cells 0.873 (probe config routeHF9: the old fill). s48e (two rounds, fill 0.8 -> 0.7 / 0.6 / 0.5): 48 tiles (96
# CTAs) halved at 0.7 and below: 3072^2 M = 160 / 192 / 224 / 256 18.8 / 19.2 / 23.0 / 23.2 -> 16.3-16.6, 4096x3072
# M = 224 / 256 24.3 / 24.5 -> 19.8-20.1, 8192x3072 M = 256 36.0 -> 34.0, 4096x6144 M = 96 / 128 23.6 / 24.5 -> 19.6
# / 19.9 (M = 40 15.9 -> 16.4, the one loss); 40 tiles (80 CTAs) at 0.6: 5120^2 M = 96 / 128 25.8 / 27.1 -> 23.2 /
# 23.4, 2560^2 M = 160-256 level; 36 tiles (72 CTAs) at 0.5 lost: 3584x4608 M = 40 / 64 / 128 12.4 / 12.8 / 16.9 ->
# 14.8 / 14.9 / 18.0. Hence 0.6, except the 64-token tile: s48f (two rounds, fill 0.8 -> 0.6) 3072x5120 M = 64 (40
# tiles) 11.9 -> 13.2, where 48 tiles gained (3072x6144 M = 64 15.8 -> 13.2; s48e 4096x6144 M = 40 / 64 15.9 / 16.8 ->
# 16.4 / 16.5): 0.7 there. s48f elsewhere (route 0.8 -> 0.6 / 0.7): 3072x6144 M = 96 / 128 21.9 / 22.9 -> 16.1 /
# 16.3, 4096x5120 M = 96 / 128 23.0 / 24.0 -> 19.5 / 19.6, 6144^2 M = 96 / 128 28.7 / 30.0 -> 26.5 / 26.8, 4096x2560
# M = 200 / 256 23.3 / 23.7 -> 19.6 / 19.6, 6144x3072 M = 256 30.8 -> 26.9; bf16 and fp16 8-bit alike (3072^2 M = 256
# 23.6 / 23.7 -> 16.6 / 16.5, 5120^2 M = 128 27.6 / 28.0 -> 23.4 / 23.8). Geometric mean 0.906 over 51 cells.
WGMMA_CLUSTER_HALVE = True
WGMMA_HALVE_MIN_FILL = {64: 0.7, 128: 0.6}  # the token tile -> the fill of the SMs two splits per tile must reach
WGMMA_HALVE_MAX_K = 8192


# At M = 145-256 on N = 4096 the plain 128-token tile's two clustered splits (the halving rule above) instead of the
# table's tall tile, where K <= WGMMA_HALVE_TALL_MAX_K[the tall tile's token count]. H200, session 47 (s47a,
# probe_configs, us, two f16 rounds, route -> rule): under the 256-token tile (M = 224 / 256; four K splits) 5120x4096
# 28.2 / 28.8 -> 23.5 / 23.5, 6144x4096 31.0 / 31.4 -> 26.9 / 27.1, 8192x4096 36.2 / 37.0 -> 33.9 / 34.1 (bf16 8192x4096
# M = 256 36.6 -> 34.4); under the 192-token tile (M = 145-192; 96-128 CTAs) only at short K: 3072x4096 18.1-18.4 ->
# 16.2-16.4, 4096^2 20.0-20.4 -> 19.8-20.0, but 5120x4096 22.2-22.7 -> 23.3-23.5, 6144x4096 24.1-24.7 -> 26.9,
# 8192x4096 28.3-29.2 -> 34.0 (one CTA per SM streams K too slowly against the tall tile's single pass over the
# weights). s46a: 4096^2 M = 129 16.8 on the 144-token tile vs 20.4 halved, hence M > 144. Probe config `routeHT0`
# turns only this off (`routeH0` the halving rule with it), `routeHTK` lifts its K bound under the 256-token tile.
WGMMA_HALVE_OVER_TALL = True
WGMMA_HALVE_TALL_MIN_M = 145
# (session 48: the 208- / 224- / 240-token rows that split the old 256-token one take its bound)
WGMMA_HALVE_TALL_MAX_K = {192: 4096, 208: 8192, 224: 8192, 240: 8192, 256: 8192}  # token count -> K bound


def wgmma_halve_over_tall(m: int, n: int, k: int, cfg: tuple[int, int, int, bool], tall_nt: int, fam: Family,
                          sms: int) -> bool:
    """Whether the route keeps `cfg` (wgmma_route_config's plain 128-token tile) instead of the `tall_nt`-token tall
    tile at WGMMA_HALVE_TALL_MIN_M <= M <= 256, K <= WGMMA_HALVE_TALL_MAX_K[tall_nt], where wgmma_halve_splits takes
    its K splits (the caller's cluster check still applies; WGMMA_HALVE_OVER_TALL off: never)."""
    nt, fw, _, wide = cfg
    if not WGMMA_HALVE_OVER_TALL or fam.moe or (nt, fw, wide) != (128, 1, False):
        return False
    if not WGMMA_HALVE_TALL_MIN_M <= m <= 256 or k > WGMMA_HALVE_TALL_MAX_K.get(tall_nt, 0):
        return False
    tiles = -(-m // nt) * (n // 128)
    return wgmma_halve_splits(tiles, wgmma_splits(tiles, k, nt, fw, sms, wgmma_ctas_per_sm(fw)), nt, fw, 0, False,
                              sms, k)


def wgmma_halve_splits(tiles: int, splits: int, nt: int, fw: int, prod: int, wide: bool, sms: int,
                       k: int) -> bool:
    """Whether an automatic launch of `tiles` output tiles with `splits` K splits runs two clustered splits instead
    (the plain 128- or 64-token form with one strip per warpgroup, three or more splits, and 2 x tiles CTAs fill
    WGMMA_HALVE_MIN_FILL[NT] of the SMs, at most one per SM, K at most WGMMA_HALVE_MAX_K x NT / 128; the caller keeps
    the splits where the cluster of 2 is refused)."""
    return (WGMMA_CLUSTER_HALVE and WGMMA_CLUSTER_SUM and WGMMA_CLUSTER_MAX >= 2 and nt in (64, 128) and fw == 1
            and not prod and not wide and splits >= 3 and WGMMA_HALVE_MIN_FILL[nt] * sms <= 2 * tiles <= sms
            and k * 128 <= WGMMA_HALVE_MAX_K * nt)


def wgmma_cluster_shares_even(nt: int, fw: int, compute: int, size: int) -> bool:
    """Whether each of `compute` threads' float4s of an NT x 128 FW tile's fp32 sums split into `size` equal shares
    (jm_wgmma.cuh's cluster sum: FW * NT / 8 float4s per compute thread)."""
    per_thread, rest = divmod(nt * 128 * fw * 4, 16 * compute)
    return rest == 0 and per_thread % size == 0


def wgmma_cluster_sum(fn, fam: Family, nt: int, fw: int, splits: int, threads: int, smem: int, prod: int,
                      grid: int, slots: int) -> int:
    """The cluster size of a wgmma launch (0: none): its K splits, where each CTA's share of the tile's
    float4s of sums divides evenly (FW * NT / 8 float4s per compute thread), the S - 1 shares a CTA receives
    fit in its ring (the shared memory less the 1 KB alignment), and the device runs enough such clusters
    at once that the launch takes no more rounds than without them (`slots`: the CTAs it runs at once)."""
    if not WGMMA_CLUSTER_SUM or fam.moe or not 2 <= splits <= min(WGMMA_CLUSTER_MAX, 4) or fn is None:
        return 0
    if not wgmma_cluster_shares_even(nt, fw, threads - 128 if prod else threads, splits):
        return 0
    tile_bytes = nt * 128 * fw * 4  # fp32 sums of the CTA's tile (NT tokens x 128 FW features)
    if (splits - 1) * (tile_bytes // splits) > smem - 1024:
        return 0
    at_once = splits * fn.max_active_clusters(threads, smem, splits)
    if at_once < splits or -(-grid // at_once) > -(-grid // slots):
        return 0
    return splits


_ACT_MAPS: dict = {}  # (address, M, K, NT, dtype) -> TensorMap: eager calls reuse their descriptor


def wgmma_act_map(a: torch.Tensor, m: int, k: int, nt: int, tma: bool | None = None) -> driver.TensorMap:
    """The TMA descriptor of the activations a [m, k] (rows k elements apart) for the wgmma
    kernel: boxes of nt tokens x 64 k in the 128-byte swizzle layout, rows past m as zeros. Tiles
    under K.WGMMA_TMA_MIN_NT tokens copy with cp.async and get the empty map (nothing encoded),
    unless `tma` (the producer form reads every token tile by TMA)."""
    if not (nt >= K.WGMMA_TMA_MIN_NT if tma is None else tma):
        return K.NO_TENSOR_MAP
    code = driver.TMAP_BF16 if a.dtype == torch.bfloat16 else driver.TMAP_F16
    key = (a.data_ptr(), m, k, nt, code)
    hit = _ACT_MAPS.get(key)
    if hit is None:
        if len(_ACT_MAPS) >= 256:
            _ACT_MAPS.clear()
        hit = _ACT_MAPS[key] = driver.tensor_map_2d(code, a.data_ptr(), k, m, 2 * k, 64, nt)
    return hit


def _weight_params(m: int, n: int, k: int, b, scales, zeros, bias) -> K.GemmParams:
    """A dense launch's parameter struct with the weights, scales, zero points, bias and shape (contiguous A and C);
    the launch's own fields, the activations and the output are the caller's."""
    p = K.GemmParams()
    p.b, p.s = b.data_ptr(), scales.data_ptr()
    p.z = zeros.data_ptr() if zeros is not None else None
    p.bias = bias.data_ptr() if bias is not None else None
    p.m, p.n, p.k, p.lda, p.ldc = m, n, k, k, n
    return p


def _wgmma_params(wl: WgmmaLaunch, m: int, n: int, k: int, b, scales, zeros, bias) -> K.GemmParams:
    """A wgmma launch's parameter struct with every field but the activations, the output and the
    workspace (set per call)."""
    p = _weight_params(m, n, k, b, scales, zeros, bias)
    p.grid = wl.m_tiles
    p.k_splits = wl.splits
    return p


def launch_wgmma(a, b, scales, zeros, bias, out, m: int, n: int, k: int, fam: Family, index: int,
                 nt: int | None = None, fw: int | None = None, stages: int | None = None,
                 splits: int | None = None, wide: bool = False, prod: int = 0, *,
                 workspace: Workspace | None = None, pdl: bool = True) -> None:
    """pdl=False: a plain launch even where programmatic dependent launch is on (after the act-order
    gather on small problems: launch_gemm, wgmma_pdl_after_gather). wide: the four-warpgroup form of
    a two-strip config (K.WGMMA_WIDE_CONFIGS; the automatic config takes it where
    wgmma_route_config says). prod: 1 (True) its producer form (K.dense_prod_configs; the automatic config
    takes it where wgmma_route_prod says), 2 the two-compute-warpgroup form (K.WGMMA_PROD2_CONFIGS; where
    wgmma_route_stream2 says)."""
    wl = wgmma_launch(m, n, k, fam, index, nt, fw, stages, splits, wide, prod)
    p = _wgmma_params(wl, m, n, k, b, scales, zeros, bias)
    p.a, p.c = a.data_ptr(), out.data_ptr()
    if wl.splits != 1:
        ws = workspace if workspace is not None else K.default_workspace(a.device)
        ws.ensure(*wl.ws)
        p.ws, p.counters = ws.ws.data_ptr(), ws.counters.data_ptr()
    wl.fn.launch(wl.grid, wl.threads, wl.smem, K.current_stream_handle(a.device), p, pdl=wl.pdl and pdl,
                 cluster=wl.cluster,
                 extra=wgmma_act_map(a, m, k, wl.nt, True if wl.prod else None))


# After the act-order gather the wgmma kernel launches as a programmatic dependent only on problems
# above K*N = 2^24. H200 session 15 (probe_act_order, layer us, M = 16 / 32 / 64, PDL vs plain):
# 4096^2 16.7 / 14.6 / 19.5 vs 12.8 / 13.7 / 15.5; 14336x4096 - / 24.8 / 33.3 vs - / 27.9 / 35.9,
# 8192^2 - / 26.8 / 33.1 vs - / 29.4 / 35.8, 4096x28672 - / 41.1 / 48.2 vs - / 43.4 / 50.3. (Session
# 13 found plain launches faster everywhere, with the gather of sessions 3-14.)
WGMMA_PDL_AFTER_GATHER_MIN_KN = 1 << 24
WGMMA_PDL_AFTER_GATHER: bool | None = None  # probe switch (probe_act_order.py --wgmma-pdl); None: the rule


def wgmma_pdl_after_gather(n: int, k: int) -> bool:
    if WGMMA_PDL_AFTER_GATHER is not None:
        return WGMMA_PDL_AFTER_GATHER
    return k * n > WGMMA_PDL_AFTER_GATHER_MIN_KN


# ---- the strip kernel (cuda_src/jm_strip.cuh): M <= 32, one 64-column strip per CTA or cluster ----

def strip_grid(n: int, cluster: int) -> int:
    return n // 64 * cluster


def check_strip(m: int, n: int, k: int, fam: Family, warps: int, cluster: int, toks: int, smem: int, fn,
                perm: bool = False) -> None:
    """Clear errors for a strip launch the kernel cannot run (M, N, K, the cluster's fit; perm: an act-order form)."""
    if not 1 <= m <= 8 * toks:
        raise ValueError(f"the strip kernel with {toks} block(s) of 8 tokens takes M = 1..{8 * toks}, got M={m}")
    if n % 64 or k % 16 or (fam.group_size > 0 and k % fam.group_size):
        raise ValueError(f"the strip kernel needs N % 64 == 0 and K a multiple of 16 and of the group size "
                         f"{fam.group_size}, got N={n}, K={k}")
    grid, dyn = strip_grid(n, cluster), K.strip_smem_bytes(fam, warps, smem, perm, k, cluster, toks)
    if dyn > fn.max_dynamic_smem:
        what = "a shared-memory ring" if smem else f"the permutation of K={k} (act-order, clusters of {cluster})"
        raise ValueError(f"strip kernel with {warps} warps and {what} needs {dyn} B of shared memory per CTA; this "
                         f"device allows {fn.max_dynamic_smem} B")
    if cluster > 1 and grid > cluster * fn.max_active_clusters(32 * warps, dyn, cluster):
        raise ValueError(f"strip kernel with {warps} warps in clusters of {cluster}: the {grid // cluster} clusters "
                         f"of N={n} do not all fit on the device at once")


# The strip kernel's route. Measured on the H200 (session 52, stage s50a, every config against the route at M = 1-16
# on nine shapes): correct everywhere but slower on every shape from 8192^2 up (1.14-1.59x the route's time with its
# best config: a CTA per 64-column strip streams a whole column of K, and those CTAs fill the SMs unevenly or
# too thinly), and faster on the small ones only: 4096^2 at M <= 8 (7.1-7.8 -> 5.8-6.6 us), where the route's
# K-split fix-up is a large share of a short call. So it is routed only there: STRIP_SMALL (M <= STRIP_SMALL_MAX_M,
# K x N <= STRIP_SMALL_MAX_KN; stage s52a measured that region). STRIP_ROUTE = True (or JITMARLIN_STRIP=1) forces it on
# every dense problem of M <= 32 and on the MoE layer's one-token form (the A/B switch of probe_configs' `routeS` and
# bench_e2e / bench_moe). Candidates in order: the most warps per strip whose grid runs in one wave (every CTA the same
# bytes, so the launch ends together), clusters where the strips alone fill too few SMs.
STRIP_ROUTE = False
STRIP_SMALL = True
STRIP_SMALL_MAX_M = 8
STRIP_SMALL_MAX_KN = 1 << 24
# Session 55 (H200, stage s53q, every config against the route on nine shapes, logs/s55/s53q.log), after session 54's
# changes (one wait per batch of rows, not per row): the strip kernel now wins on tall layers whose strips fill the
# SMs in one even wave — M = 1-8: K x N = 11008x4096 14.0-14.2 -> 9.5-10.7 us, 14336x4096 14.5-16.7 -> 11.2-12.6,
# 8192^2 14.7-15.0 -> 12.2-13.3, 28672x8192 35.2-35.8 -> 33.1-34.2; M = 12-16 the N = 4096 pair only (11008x4096
# 17.5 -> 14.3-15.2, 14336x4096 19.4-19.8 -> 16.8-17.4; 8192^2 and 28672x8192 lost 2-22%). Wide layers (K < N:
# 4096x11008 / 12288 / 28672, 8192x28672) stay slower or even (N / 64 strips that do not divide over the SMs).
# STRIP_TALL: K >= N, N <= STRIP_TALL_MAX_N at M <= STRIP_SMALL_MAX_M; K >= 2 N, N <= STRIP_TALL2_MAX_N at M up to
# STRIP_TALL2_MAX_M; either only where the chosen config's grid fills STRIP_TALL_MIN_FILL of what the device runs at
# once (the winners filled 0.97: 64 strips x 2 on 132 SMs, 128 x 2 CTAs of 8 warps on 264 slots).
STRIP_TALL = True
STRIP_TALL_MAX_N = 8192
STRIP_TALL2_MAX_M = 16
STRIP_TALL2_MAX_N = 4096
STRIP_TALL_MIN_FILL = 0.9
# Weight bits the tall region takes: s53q measured 4-bit (fp16) only; 8-bit forms hold half the rows ahead
STRIP_TALL_BITS: tuple[int, ...] = (4,)
# Act-order calls on the tall region (at M <= STRIP_PERM_MAX_M, as on the small one): the strip kernel's act-order form
# (its in-kernel gather) instead of the gather kernel + the route. Session 56 (s55b, probe_act_order, H100 — the H200
# refused that day; same run, layer us at M = 1, off -> on): 11008x4096 16.9 -> 12.4, 8192^2 17.7 -> 16.5, 28672x8192
# 47.3 -> 45.4 (M = 8, where the rule does not reach: 17.5 / 18.8 / 48.7 -> 17.2 / 18.7 / 48.2).
STRIP_TALL_PERM = True
# The shared-memory ring forms lost to the register forms on every cell of s53q after session 54 (11008x4096 M = 1
# w16-c2 9.5 vs 13.0 us with the ring, 8192^2 w16-c1 12.3 vs 15.5, 4096^2 c2-t2 8.7 vs 11.0), so the route no longer
# takes them (None; sessions 52-54: from K = 8192). They stay built for A/B runs (probe_configs' -s configs).
STRIP_RING_MIN_K: int | None = None
# Act-order calls take the strip kernel's act-order form (its in-kernel column gather) only up to this M: s52b, layer
# time against the gather kernel + the old route, M = 1: 4096^2 7.4 vs 7.7 us, 2048^2 4.3 vs 5.4, 4096x1024 4.5 vs 11.1;
# M = 8: 10.7 vs 9.2, 6.3 vs 6.3, 7.6 vs 12.1 (each lane's gather grows with the tokens). M = 2-7 not measured.
STRIP_PERM_MAX_M = 1
# Past that M, act-order calls the strip route would take without the permutation: off = the gather kernel, then the
# usual (mma.sync / wgmma) route, as measured above; on = the gather kernel, then the strip kernel's plain form (its
# weight stream starts before the gather ends, as a programmatic dependent). Not measured yet (stage s53a; the plain
# strip call alone measured 6.5 vs 7.7 us on 4096^2 M = 8, 4.2 vs 10.2 on 4096x1024), so off.
STRIP_GATHER_PLAIN = False


def strip_route_on() -> bool:
    """gemm.STRIP_ROUTE, or JITMARLIN_STRIP=1 (read once: K.env_flag): the strip kernel forced on (A/B runs)."""
    return STRIP_ROUTE or K.env_flag("JITMARLIN_STRIP")


def strip_small(m: int, n: int, k: int) -> bool:
    """Whether (M, N, K) is in the region the strip kernel is routed on by default (STRIP_SMALL)."""
    return STRIP_SMALL and m <= STRIP_SMALL_MAX_M and k * n <= STRIP_SMALL_MAX_KN


def strip_tall(m: int, n: int, k: int, bits: int) -> bool:
    """Whether (M, N, K) with `bits`-bit weights is in the tall-layer region (STRIP_TALL, STRIP_TALL_BITS;
    strip_choice also asks the grid to fill the SMs)."""
    if not STRIP_TALL or bits not in STRIP_TALL_BITS:
        return False
    if m <= STRIP_SMALL_MAX_M:
        return k >= n and n <= STRIP_TALL_MAX_N
    return m <= STRIP_TALL2_MAX_M and k >= 2 * n and n <= STRIP_TALL2_MAX_N


STRIP_ORDER: tuple[tuple[int, int, int, int], ...] = (  # (warps, cluster, token blocks, smem ring); blocks hold M
    (16, 4, 1, 0), (16, 2, 1, 0), (8, 2, 1, 0), (16, 1, 1, 0), (8, 1, 1, 0), (4, 1, 1, 0),
    (16, 2, 2, 0), (16, 1, 2, 0), (8, 1, 2, 0), (4, 1, 2, 0),
    (8, 1, 3, 1), (4, 1, 3, 1), (8, 2, 4, 1), (8, 1, 4, 1), (4, 1, 4, 1))


def strip_choice(m: int, n: int, k: int, fam: Family, sms: int, at_once) -> tuple[int, int, int, int] | None:
    """(warps, cluster, token blocks, smem ring) of the strip kernel for a dense M <= 32 problem, or None (outside
    strip_small / strip_tall with STRIP_ROUTE off, MoE, shape). at_once(warps, cluster, toks, smem) -> CTAs of that
    config the device runs together (0: cannot run). The first of STRIP_ORDER with the fewest token blocks that hold M
    whose N / 64 x cluster CTAs all run at once, in its shared-memory ring form from K = STRIP_RING_MIN_K where that
    is set, built and fits; on the tall region only (not small, not forced) where that grid fills STRIP_TALL_MIN_FILL
    of what runs at once (pure given at_once; CPU-tested)."""
    small, forced = strip_small(m, n, k), strip_route_on()
    if not (forced or small or strip_tall(m, n, k, fam.bits)) or fam.moe or not 1 <= m <= K.STRIP_MAX_M or n % 64 \
            or k % 16:
        return None
    if fam.group_size > 0 and k % fam.group_size:
        return None
    strips, toks = n // 64, K.strip_token_blocks(m)
    for cfg in STRIP_ORDER:
        warps, cluster, t, _ = cfg
        if t != toks or cfg not in K.STRIP_CONFIGS:
            continue
        grid, fit = strips * cluster, at_once(*cfg)
        if grid <= fit:
            if not (forced or small) and grid < STRIP_TALL_MIN_FILL * fit:
                return None  # the tall region's first one-wave config leaves SMs idle: the usual route
            ring = (warps, cluster, t, 1)  # long K: the same config with its weights' ring in shared memory
            if (STRIP_RING_MIN_K is not None and k >= STRIP_RING_MIN_K and ring in K.STRIP_CONFIGS
                    and grid <= at_once(*ring)):
                return ring
            return cfg
    return None


def strip_route(m: int, n: int, k: int, fam: Family, index: int, perm: bool = False) -> tuple[int, int, int, int] | None:
    """strip_choice on this device (sm_90 and newer; the kernels' occupancy and cluster fit from the driver; perm:
    of the act-order forms, which the default route takes up to M = STRIP_PERM_MAX_M only, on the small region, and
    on the tall one with STRIP_TALL_PERM)."""
    small, forced = strip_small(m, n, k), strip_route_on()
    if m > K.STRIP_MAX_M or not (forced or small or strip_tall(m, n, k, fam.bits)) or fam.moe:
        return None
    if perm and not forced and (m > STRIP_PERM_MAX_M or not (small or STRIP_TALL_PERM)):
        return None
    if not K.strip_built(fam, _cc(index)):
        return None
    sms = driver.device(index).sm_count

    def at_once(warps: int, cluster: int, toks: int, smem: int) -> int:
        fn = K.get_strip_kernel(fam, warps, cluster, toks, smem, index, _cc(index), perm)
        dyn = K.strip_smem_bytes(fam, warps, smem, perm, k, cluster, toks)
        if dyn > fn.max_dynamic_smem:
            return 0
        if cluster > 1:
            return cluster * fn.max_active_clusters(32 * warps, dyn, cluster)
        return sms * fn.occupancy(32 * warps, dyn)

    return strip_choice(m, n, k, fam, sms, at_once)


def strip_params(m: int, n: int, k: int, warps: int, cluster: int, a, b, scales, zeros, bias, out,
                 perm=None) -> K.GemmParams:
    p = _weight_params(m, n, k, b, scales, zeros, bias)
    p.a, p.c = a.data_ptr(), out.data_ptr()
    p.nwarps, p.grid, p.top_k = warps, strip_grid(n, cluster), 1
    p.perm = perm.data_ptr() if perm is not None else None
    return p


def launch_strip(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], out: torch.Tensor, m: int, n: int, k: int, fam: Family, index: int,
                 warps: int, cluster: int, toks: int | None = None, smem: int = 0, pdl: bool = True,
                 perm: Optional[torch.Tensor] = None) -> None:
    """out[m, n] = a @ dequant(b) (+ bias) by the strip kernel of (warps, cluster, token blocks, shared-memory ring)
    (K.STRIP_CONFIGS; toks None: the fewest blocks of 8 tokens that hold M); with perm (act-order, int32 [K])
    a[:, perm] @ dequant(b), the columns gathered by the kernel's act-order form (no gather kernel)."""
    toks = toks if toks is not None else K.strip_token_blocks(m)
    fn = K.get_strip_kernel(fam, warps, cluster, toks, smem, index, _cc(index), perm is not None)
    check_strip(m, n, k, fam, warps, cluster, toks, smem, fn, perm is not None)
    p = strip_params(m, n, k, warps, cluster, a, b, scales, zeros, bias, out, perm)
    fn.launch(p.grid, 32 * warps, K.strip_smem_bytes(fam, warps, smem, perm is not None, k, cluster, toks),
              K.current_stream_handle(a.device), p,
              pdl=pdl and use_pdl(_cc(index)), cluster=cluster)


def launch_gemm(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], out: torch.Tensor, m: int, n: int, k: int, fam: Family,
                workspace: Workspace | None = None, plan_override: tuple[Tile, int] | str | None = None,
                perm: Optional[torch.Tensor] = None) -> None:
    """Compute out[m, n] = a @ dequant(b) (+ bias), or with perm (act-order) a[:, perm] @
    dequant(b): the gather kernel runs first, except before the strip kernel, whose act-order form
    gathers the columns itself. plan_override (for tuning): a (tile, warps) pair for the fused
    kernel, or "dequant" for the dequantize + cuBLAS path."""
    index = K.cuda_index(a.device)
    # the strip kernel gathers act-order columns itself; every other route reads a gathered copy
    if isinstance(plan_override, tuple) and plan_override and plan_override[0] == "strip":
        launch_strip(a, b, scales, zeros, bias, out, m, n, k, fam, index, *plan_override[1:5], perm=perm)
        return
    strip = strip_route(m, n, k, fam, index, perm is not None) if plan_override is None else None
    if strip is not None:
        launch_strip(a, b, scales, zeros, bias, out, m, n, k, fam, index, *strip, perm=perm)
        return
    if perm is not None:
        a = gather_columns(a, perm, m, k, fam)
        strip = strip_route(m, n, k, fam, index) if STRIP_GATHER_PLAIN and plan_override is None else None
        if strip is not None:  # (A/B switch, off: the gather kernel, then the strip kernel's plain form)
            launch_strip(a, b, scales, zeros, bias, out, m, n, k, fam, index, *strip)
            return
    if isinstance(plan_override, tuple) and plan_override and plan_override[0] == "wgmma":
        launch_wgmma(a, b, scales, zeros, bias, out, m, n, k, fam, index, *plan_override[1:], workspace=workspace,
                     pdl=perm is None or wgmma_pdl_after_gather(n, k))
        return
    if plan_override is None and use_wgmma_path(m, n, k, fam, index):
        launch_wgmma(a, b, scales, zeros, bias, out, m, n, k, fam, index, workspace=workspace,
                     pdl=perm is None or wgmma_pdl_after_gather(n, k))
        return
    if plan_override == "dequant" or (plan_override is None and use_dequant_path(m, n, k)):
        wt = dequantize_weights(b, scales, zeros, fam, n, k)
        a2, o2 = a.reshape(m, k), out.view(m, n)
        if bias is not None:
            torch.addmm(bias, a2, wt.t(), out=o2)
        else:
            torch.mm(a2, wt.t(), out=o2)
        return
    if plan_override is None:
        launch = prepare_launch(m, m, n, k, fam, index)
    else:  # used by the tuning sweep; a third element sets the grid (experiments: probe_configs -gN),
        # fewer CTAs than fit or more (a second wave), at most one per tile
        tile, nwarps = plan_override[:2]
        if tile not in K.tiles_for(_cc(index)):
            raise ValueError(f"tile {tile.tag()} is not built for sm_{_cc(index)[0]}{_cc(index)[1]} (not in "
                             "jitmarlin.ops._kernels.TILES / BULK_TILES; probe_configs.py --extra-tiles adds tiles)")
        if not K.tile_fits(fam, tile):
            raise ValueError(f"tile {tile.tag()} is not built for {fam} (tile_fits: the direct-load tiles are "
                             "dense 8-row / 4-bit 16-row ones and 4-bit MoE three-CTA ones, 8-bit weights one "
                             "tile ahead and 8 rows only; the k tile must suit the group size)")
        plan = Plan(tile, nwarps, K.smem_bytes(fam, tile, nwarps))
        launch = _make_launch(plan, m, n, k, fam, index)
        if len(plan_override) > 2 and plan_override[2] > 0 and not tile.cluster:
            grid = min(plan_override[2], tile_count(plan, m, n, k))
            launch = dataclasses.replace(launch, grid=grid, ws_floats=K.workspace_floats(grid, nwarps, tile))
    ws = workspace if workspace is not None else K.default_workspace(a.device)
    p = launch_params(launch, ws, a, b, scales, zeros, out, m, n, k)
    p.bias = bias.data_ptr() if bias is not None else None
    launch.fn.launch(launch.grid, launch.threads, launch.plan.smem, K.current_stream_handle(a.device), p,
                     pdl=launch.pdl, cluster=launch.plan.tile.cluster)


# ---- the custom op (torch.compile and CUDA graphs see one opaque op) ----
# Registered through torch.library.Library rather than the custom_op decorator: the decorator's
# wrapper imports torch._dynamo on the first call (seconds), which a cached kernel must not cost.

_lib = torch.library.Library("jitmarlin", "DEF")
_lib.define("gemm(Tensor a, Tensor b, Tensor scales, Tensor? zeros, Tensor? bias, Tensor? perm=None) -> Tensor")


def _gemm_cuda(a, b, scales, zeros, bias, perm=None, workspace: Workspace | None = None):
    m, n, k, fam = check_args(a, b, scales, zeros, bias)
    check_perm(perm, k, a.device)
    if perm is not None:
        check_perm_values(perm, k)
    if a.device.type != "cuda":
        raise ValueError(f"jitmarlin.ops.marlin_gemm runs on CUDA tensors; the activations are on {a.device}")
    if a.data_ptr() % 16:
        raise ValueError(f"activations must start at a 16-byte aligned address (the kernel copies 16-byte "
                         f"chunks); this view starts at byte offset {a.data_ptr() % 16}: call .clone() first")
    out = torch.empty(a.shape[:-1] + (n,), dtype=a.dtype, device=a.device)
    if m > 0:
        launch_gemm(a, b, scales, zeros, bias, out, m, n, k, fam, workspace, perm=perm)
    return out


# ---- the eager fast path of one layer (MarlinLinear.forward) ----
# An eager call's host time was ~25-35 us (H200 session 17: W4 Llama-7B prefill at batch 1 and
# 128 tokens host-bound at 23.9 ms against fp16's 19.6; host profile of a mocked launch: argument
# checks ~10 us, route choice + parameter struct ~10 us). A layer's weights are the same tensors on
# every call, so what depends only on them (the checks, the family) and on M (the route, kernel,
# grid, the parameter struct with its static fields) is kept per layer; a call checks its
# activations, sets the two pointers that change and launches. Anything else (act-order, the
# dequantize + cuBLAS route, a new or moved weight tensor, an input the checks would reject) takes
# the general path, which raises the same errors as before.
FAST_MAX_M_ENTRIES = 16  # M values a layer remembers (decode and a few prefill lengths)


class FastGemm:
    """Per-layer cache of validated launches (see above); owned by the layer. It holds no tensor:
    its key is the weights' addresses, shapes and dtype, so a moved, replaced or freed weight
    tensor (`.to()`, a new buffer, a deep copy) never matches and the entries are rebuilt."""

    __slots__ = ("key", "n", "k", "fam", "dtype", "device_index", "by_m")

    def __init__(self):
        self.key: tuple = ()
        self.by_m: dict = {}

    def __reduce__(self):  # copies and pickles of a layer start empty (the entries hold raw pointers)
        return (FastGemm, ())


@dataclass
class _FastEntry:
    fn: driver.Function
    grid: int
    threads: int
    smem: int
    params: K.GemmParams
    pdl: bool
    cluster: int
    nt: int  # wgmma: the activation box's token count (0: mma.sync, no tensor map)
    uses_ws: bool
    tma: bool | None = None  # wgmma_act_map's `tma` (True: the producer form)


def _fast_entry(m: int, n: int, k: int, fam: Family, index: int, b, scales, zeros, bias, a) -> _FastEntry | None:
    """The launch the general path (launch_gemm without a perm) makes for M = m, with its static
    parameters filled in; None for the dequantize + cuBLAS route."""
    ws = K.default_workspace(a.device)
    strip = strip_route(m, n, k, fam, index)
    if strip is not None:
        warps, cluster, toks, smem = strip  # (strip_choice took only configs the launch can run)
        fn = K.get_strip_kernel(fam, warps, cluster, toks, smem, index, _cc(index))
        p = strip_params(m, n, k, warps, cluster, a, b, scales, zeros, bias, a.new_empty(0))
        return _FastEntry(fn, p.grid, 32 * warps, K.strip_smem_bytes(fam, warps, smem, toks=toks), p, use_pdl(_cc(index)),
                          cluster, 0, False)
    if use_wgmma_path(m, n, k, fam, index):
        wl = wgmma_launch(m, n, k, fam, index)
        p = _wgmma_params(wl, m, n, k, b, scales, zeros, bias)
        if wl.splits != 1:
            ws.ensure(*wl.ws)
        return _FastEntry(wl.fn, wl.grid, wl.threads, wl.smem, p, wl.pdl, wl.cluster, wl.nt, wl.splits != 1,
                          True if wl.prod else None)
    if use_dequant_path(m, n, k):
        return None
    launch = prepare_launch(m, m, n, k, fam, index)
    out = a.new_empty(0)  # launch_params reads its pointer; the call sets the real one
    p = launch_params(launch, ws, a, b, scales, zeros, out, m, n, k)
    p.bias = bias.data_ptr() if bias is not None else None
    return _FastEntry(launch.fn, launch.grid, launch.plan.tile.threads(launch.plan.nwarps), launch.plan.smem, p,
                      launch.pdl, launch.plan.tile.cluster, 0, True)


def gemm_fast(cache: FastGemm, a: torch.Tensor, b, scales, zeros, bias) -> torch.Tensor | None:
    """C = a @ dequant(b) (+ bias) through the layer's cache, or None where the general path must
    run (the caller then calls _gemm_cuda). a: a CUDA tensor, not act-order."""
    key = (b.data_ptr(), scales.data_ptr(), zeros.data_ptr() if zeros is not None else 0,
           bias.data_ptr() if bias is not None else 0, b.shape, scales.shape, scales.dtype)
    if key != cache.key:
        _, n, k, fam = check_args(a, b, scales, zeros, bias)  # (raises for bad weights or inputs)
        cache.key, cache.by_m = key, {}
        cache.n, cache.k, cache.fam, cache.dtype = n, k, fam, a.dtype
        cache.device_index = a.get_device()
    k = cache.k
    if (a.dtype is not cache.dtype or a.dim() == 0 or a.shape[-1] != k or not a.is_contiguous()
            or a.get_device() != cache.device_index or a.data_ptr() % 16):
        return None  # the general path checks (and raises) as usual
    m = a.numel() // k
    if m == 0:
        return None
    entry = cache.by_m.get(m, False)
    if entry is False:
        if len(cache.by_m) >= FAST_MAX_M_ENTRIES:
            cache.by_m.clear()
        entry = cache.by_m[m] = _fast_entry(m, cache.n, k, cache.fam, cache.device_index, b, scales, zeros, bias, a)
    if entry is None:
        return None
    n = cache.n
    out = torch.empty(a.shape[:-1] + (n,), dtype=a.dtype, device=a.device)
    p = K.GemmParams.from_buffer_copy(entry.params)  # a copy per call: layers may be called from several threads
    p.a, p.c = a.data_ptr(), out.data_ptr()
    if entry.uses_ws:  # the shared workspace's buffers are replaced when a launch needs more
        ws = K.default_workspace(a.device)
        p.ws, p.counters = ws.ws.data_ptr(), ws.counters.data_ptr()
    stream = K.current_stream_handle(a.device)
    if entry.nt:
        entry.fn.launch(entry.grid, entry.threads, entry.smem, stream, p, pdl=entry.pdl, cluster=entry.cluster,
                        extra=wgmma_act_map(a, m, k, entry.nt, entry.tma))
    else:
        entry.fn.launch(entry.grid, entry.threads, entry.smem, stream, p, pdl=entry.pdl, cluster=entry.cluster)
    return out


def _gemm_cpu(a, b, scales, zeros, bias, perm=None):
    check_args(a, b, scales, zeros, bias)
    raise ValueError(f"jitmarlin.ops.marlin_gemm runs on CUDA tensors; the activations are on {a.device}")


def _gemm_fake(a, b, scales, zeros, bias, perm=None):
    _, n, k, _ = check_args(a, b, scales, zeros, bias)
    check_perm(perm, k, a.device)
    return a.new_empty(a.shape[:-1] + (n,))


_lib.impl("gemm", _gemm_cuda, "CUDA")
_lib.impl("gemm", _gemm_cpu, "CPU")
torch.library.register_fake("jitmarlin::gemm", _gemm_fake, lib=_lib)


def marlin_gemm(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, workspace: Workspace | None = None,
                perm: torch.Tensor | None = None) -> torch.Tensor:
    """C = a @ dequant(b) (+ bias).

    a: [..., K] float16/bfloat16, contiguous, on a CUDA device with compute capability >= 8.0.
    b: packed weights int32 [N/64, K/16, 32*bits] (jitmarlin.pack / jitmarlin.quant.pack_weights).
    scales: [K/G, N] group scales (permuted, jitmarlin.quant.permute_scales) or [1, N] per
        channel, in a's dtype.
    zeros: packed zero points int32 [K/G, N*bits/32] (jitmarlin.quant.pack_zeros), or None for
        symmetric weights (zero 2**(bits-1)).
    bias: [N] in a's dtype, or None.
    perm: act-order column order, int32 [K], or None: the result is a[..., perm] @ dequant(b)
        (b holds the weight rows sorted by group); the columns are gathered by a kernel of ours.
    workspace: a jitmarlin.ops.Workspace; by default one per device. Calls that may run at the
        same time (different streams) need different workspaces. With an explicit workspace the
        call runs eagerly, outside the registered op.
    Returns [..., N] in a's dtype. Registered as torch.ops.jitmarlin.gemm (torch.compile and CUDA
    graph capture work; run once eagerly before capturing).
    """
    if workspace is None:
        return torch.ops.jitmarlin.gemm(a, b, scales, zeros, bias, perm)
    return _gemm_cuda(a, b, scales, zeros, bias, perm, workspace)  # eager only: the op schema takes tensors
