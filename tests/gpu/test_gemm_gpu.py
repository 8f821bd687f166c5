"""The dense GEMM against a plain-PyTorch reference on the dequantized weight.

Every call writes into an output poisoned with NaN; the reference is fp32 a @ W; the arrival
counters must be all zero again after every call (what makes CUDA-graph replay safe), and the
same call twice gives bit-identical results (split units are summed in a fixed order).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import jitmarlin
from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G

from .helpers import check_close, late_arrival_build, random_weights

M_LIST = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 200, 511, 1024, 4099]
KN_LIST = [(4096, 4096), (4096, 11008), (11008, 4096), (5120, 13824), (8192, 28672), (28672, 8192),
           (256, 256), (128, 64)]


def run_poisoned(a, packed, bias=None, override=None, workspace=None):
    """Launch into a NaN-filled output through the internal entry (the public op allocates its
    own output, so it cannot be poisoned)."""
    m, n, k, fam = G.check_args(a, packed.b, packed.scales, packed.zeros, bias)
    out = torch.full((m, n), float("nan"), dtype=a.dtype, device=a.device)
    G.launch_gemm(a, packed.b, packed.scales, packed.zeros, bias, out, m, n, k, fam,
                  workspace=workspace, plan_override=override)
    return out


def assert_workspace_clean(device=None):
    ws = K.default_workspace(torch.device("cuda") if device is None else device)
    torch.cuda.synchronize()
    assert int(ws.counters.abs().sum()) == 0, "split-unit arrival counters not reset"


@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("k,n", KN_LIST)
def test_fp16_int4_all_m(k, n, group):
    packed, w = random_weights(k, n, 4, group)
    for m in M_LIST:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        out = run_poisoned(a, packed)
        ref = a.float() @ w
        check_close(out, ref, 1e-3, f"M={m} K={k} N={n} g={group}")
    assert_workspace_clean()


@pytest.mark.parametrize("k,n", [(4096, 4096), (11008, 4096), (5120, 13824)])
def test_both_large_m_paths(k, n):
    """At large M both the fused kernel (several 64-row m tiles) and dequantize + cuBLAS must be
    right, whichever the heuristic picks."""
    packed, w = random_weights(k, n, 4, 128)
    for m in (65, 511, 1031):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ref = a.float() @ w
        check_close(run_poisoned(a, packed, override=(K.Tile(4, False, 8, 3), 4)), ref, 1e-3, f"fused M={m}")
        check_close(run_poisoned(a, packed, override="dequant"), ref, 1e-3, f"dequant M={m}")
    assert_workspace_clean()


def _all_overrides():
    out = []
    for tile, nw in itertools.product(K.TILES + K.BULK_TILES, (1, 2, 4, 8, 16)):
        if nw <= tile.max_warps:
            out.append(pytest.param((tile, nw), id=f"{tile.tag()}-w{nw}"))
    return out


@pytest.mark.parametrize("override", _all_overrides())
def test_every_tile_config(override):
    """Every compiled tile config and CTA width, not only the heuristic's choice."""
    tile, nw = override
    if tile.cluster:
        pytest.skip("cluster tiles run one cluster per output unit: test_cluster_launches")
    k, n = 1024, 1024 * 3  # N/64 = 48 strips: divisible by 1, 2, 4, 8, 16
    packed, w = random_weights(k, n, 4, 128)
    fam = K.Family("f16", 4, False, 128)
    if tile.bulk and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("bulk-copy tiles are built for sm_90 and newer only")
    if not K.tile_fits(fam, tile):  # e.g. the 8-bit direct-load tile (test_formats_gpu runs it)
        pytest.skip(f"{tile.tag()} is not built for {fam} (tile_fits)")
    if K.smem_bytes(fam, tile, nw) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin - G.SMEM_RESERVE:
        pytest.skip("does not fit shared memory")
    for m in sorted({1, tile.rows - 1, tile.rows, tile.rows + 3, 3 * tile.rows + 1}):
        if m < 1:
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        out = run_poisoned(a, packed, override=override)
        check_close(out, a.float() @ w, 1e-3, f"{tile} nwarps={nw} M={m}")
    assert_workspace_clean()


def test_override_with_a_tile_the_family_does_not_build():
    """A tile the family's module does not hold (8-bit weights two tiles ahead) is a clear
    ValueError naming the tile and the rule, not a missing kernel image."""
    packed, _ = random_weights(1024, 512, 8, 128)
    a = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="w8_k128_s6_bk_dr2 is not built for"):
        run_poisoned(a, packed, override=(K.Tile.from_tag("w8_k128_s6_bk_dr2"), 4))


def test_deterministic():
    k, n = 4096, 4096  # M=1 splits every unit over many CTAs
    packed, _ = random_weights(k, n, 4, 128)
    for m in (1, 16, 200):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        first = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
        for _ in range(5):
            assert torch.equal(jitmarlin.marlin_gemm(a, packed.b, packed.scales), first), f"M={m}"


@pytest.mark.parametrize("late", [False, True], ids=["usual", "late_arrival"])
def test_split_unit_fixup_paths(monkeypatch, late):
    """Every way a split unit gets summed on bulk tiles. The 8-row one-tile-ahead direct tile
    (jm_gemm.cuh kEarlyPublish): the unit's first CTA finding all others arrived (fast path) or
    arriving itself, a CTA whose unit ends mid-run having its producer warp arrive for it -- with
    -DJM_TEST_LATE_ARRIVAL that arrival comes 30 us late, after the first CTA's, so the mid-run
    CTA sums the unit at the end of its run (the deferred path); the other tiles: the plain
    protocol (store, fence, arrive, the last sums). Output vs the reference, poisoned output,
    counters back to zero, deterministic."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("bulk-copy tiles are built for sm_90 and newer only")
    fam = K.Family("f16", 4, False, 128)
    if late:
        late_arrival_build(monkeypatch, fam)
    # shapes whose striping leaves CTAs ending a split unit mid-run at 1, 2 or 3 CTAs per SM
    for (k, n), tag, nw in [((4096, 8704), "w8_k128_s6_bk_dr1", 4), ((7168, 5120), "w8_k128_s6_bk_ks2", 4),
                            ((4096, 9216), "w16_k128_s5_bk", 4), ((2048, 8704), "w16_k128_s6_bk_dr1", 2)]:
        packed, w = random_weights(k, n, 4, 128)
        tile = K.Tile.from_tag(tag)
        assert K.tile_fits(fam, tile), tag
        for m in (1, 5, 16):
            if m > tile.rows:
                continue
            plan = G.Plan(tile, nw, K.smem_bytes(fam, tile, nw))
            grid = G._make_launch(plan, m, n, k, fam, 0).grid
            k_tiles = k // tile.tile_k
            total = G.tile_count(plan, m, n, k)
            iters = -(-total // grid)
            # CTAs whose first unit is split, not started by them, and ends before their run does
            mid = [c for c in range(grid) if c * iters % k_tiles and (c * iters // k_tiles + 1) * k_tiles
                   < min(total, (c + 1) * iters)]
            assert mid, f"{tag} {k}x{n} M={m}: no CTA ends a split unit mid-run (grid {grid}, {iters} tiles each)"
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            out = run_poisoned(a, packed, override=(tile, nw))
            check_close(out, a.float() @ w, 1e-3, f"{tag} {k}x{n} M={m} late={late}")
            assert torch.equal(run_poisoned(a, packed, override=(tile, nw)), out), f"{tag} M={m}: not deterministic"
        assert_workspace_clean()


def test_bias_and_leading_dims():
    k, n = 1024, 768
    packed, w = random_weights(k, n, 4, 128)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    a = torch.randn(2, 3, 5, k, device="cuda", dtype=torch.float16)
    out = jitmarlin.marlin_gemm(a, packed.b, packed.scales, None, bias)
    assert out.shape == (2, 3, 5, n) and out.dtype == torch.float16
    check_close(out, (a.float() @ w) + bias.float(), 1e-3, "bias")


def test_empty_m():
    packed, _ = random_weights(256, 256, 4, 128)
    a = torch.randn(0, 256, device="cuda", dtype=torch.float16)
    out = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
    assert out.shape == (0, 256)


def test_errors():
    packed, _ = random_weights(256, 256, 4, 128)
    a = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        jitmarlin.marlin_gemm(a.float(), packed.b, packed.scales)
    with pytest.raises(ValueError, match="K=256"):
        jitmarlin.marlin_gemm(torch.randn(4, 192, device="cuda", dtype=torch.float16), packed.b, packed.scales)
    with pytest.raises(ValueError, match="contiguous"):
        jitmarlin.marlin_gemm(torch.randn(256, 4, device="cuda", dtype=torch.float16).t(), packed.b, packed.scales)
    with pytest.raises(ValueError, match="CUDA|cuda"):
        jitmarlin.marlin_gemm(a.cpu(), packed.b.cpu(), packed.scales.cpu())
    with pytest.raises(TypeError, match="scales must have the activation dtype"):
        jitmarlin.marlin_gemm(a, packed.b, packed.scales.bfloat16())
    with pytest.raises(TypeError, match="int32"):
        jitmarlin.marlin_gemm(a, packed.b.float(), packed.scales)


def test_cuda_graph_replay_matches_eager():
    k, n = 4096, 4096
    packed, w = random_weights(k, n, 4, 128)
    for m in (1, 16, 100):
        static_a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        jitmarlin.marlin_gemm(static_a, packed.b, packed.scales)  # warm-up: load + workspace
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = jitmarlin.marlin_gemm(static_a, packed.b, packed.scales)
        for _ in range(3):
            static_a.copy_(torch.randn(m, k, device="cuda", dtype=torch.float16))
            g.replay()
            eager = jitmarlin.marlin_gemm(static_a, packed.b, packed.scales)
            torch.cuda.synchronize()
            check_close(static_out, static_a.float() @ w, 1e-3, f"graph M={m}")
            assert (static_out.float() - eager.float()).abs().max().item() <= 1e-2 * eager.float().abs().max().item()
    assert_workspace_clean()


def test_torch_compile():
    k, n = 1024, 512
    packed, w = random_weights(k, n, 4, 128)

    class Mod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", packed.b)
            self.register_buffer("s", packed.scales)

        def forward(self, x):
            return torch.relu(jitmarlin.marlin_gemm(x * 2, self.b, self.s))

    mod = Mod()
    cmod = torch.compile(mod, fullgraph=True)
    x = torch.randn(7, k, device="cuda", dtype=torch.float16)
    check_close(cmod(x), torch.relu((x.float() * 2) @ w), 1e-3, "torch.compile")


def test_opcheck():
    k, n = 512, 256
    packed, _ = random_weights(k, n, 4, 128)
    a = torch.randn(5, k, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.jitmarlin.gemm.default, (a, packed.b, packed.scales, None, None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on the nvidia-h200-x2 machine)")
def test_non_current_device():
    k, n = 2048, 1024
    packed0, w = random_weights(k, n, 4, 128)
    packed = jitmarlin.Packed(packed0.b.to("cuda:1"), packed0.scales.to("cuda:1"), None, 4, 128)
    with torch.cuda.device(0):
        for m in (1, 16, 300):
            a = torch.randn(m, k, device="cuda:1", dtype=torch.float16)
            out = jitmarlin.marlin_gemm(a, packed.b, packed.scales)
            assert out.device == torch.device("cuda:1")
            torch.cuda.synchronize(1)
            check_close(out, (a.float() @ w.to("cuda:1")), 1e-3, f"cuda:1 M={m}")
        assert torch.cuda.current_device() == 0
    assert_workspace_clean(torch.device("cuda:1"))


def test_misaligned_activations_are_refused():
    k, n = 256, 128
    packed, w = random_weights(k, n, 4, 128)
    flat = torch.randn(2 * k + 1, device="cuda", dtype=torch.float16)
    a = flat[1:].view(2, k)  # contiguous, but 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte aligned"):
        jitmarlin.marlin_gemm(a, packed.b, packed.scales)
    check_close(jitmarlin.marlin_gemm(a.clone(), packed.b, packed.scales), a.float() @ w, 1e-3, "after clone")


@pytest.mark.parametrize("bits,zp", [(4, False), (4, True), (8, False), (8, True)])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_outlier_activations(bits, zp, m, dtype=torch.float16):
    """Activations with large outliers (as in LLM hidden states): the small-M kernels feed raw
    (1024 + q; bf16 4-bit: 128 + q) weights to the MMA and remove the base per column afterwards,
    which cancels large fp32 sums; the result must stay as accurate as the output dtype allows,
    row by row."""
    k, n = 8192, 1024
    packed, w = random_weights(k, n, bits, 128, zp, dtype)
    gen = torch.Generator(device="cuda").manual_seed(m)
    a = torch.randn(m, k, device="cuda", generator=gen)
    cols = torch.randperm(k, device="cuda", generator=gen)[: k // 100]
    a[:, cols] *= 300.0
    a = a.to(dtype)
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    ref = a.float() @ w
    plans = [None]  # the heuristic's choice, and the transposed (raw) tile of this M
    if torch.cuda.get_device_capability(0) >= (9, 0):
        plans.append((K.Tile(1 if m <= 8 else 2, True, 8, 4, True), 4))
    for plan in plans:
        out = run_poisoned(a, packed, override=plan)
        check_close(out, ref, tol, f"bits={bits} zp={zp} M={m} plan={plan}")
        for r in range(m):
            check_close(out[r:r + 1], ref[r:r + 1], tol, f"bits={bits} zp={zp} M={m} plan={plan} row {r}")


@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_outlier_activations_bf16(zp, m):
    """The same with bf16 4-bit weights (raw as 128 + q) and bf16 activations."""
    test_outlier_activations(4, zp, m, torch.bfloat16)


def test_act_order_public_op_small_m():
    """marlin_gemm with perm (the gather kernel, then the GEMM) at small M, against the reference."""
    k, n = 11008, 1024
    packed, w = random_weights(k, n, 4, 128)
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    for m in (1, 3, 8, 9, 16, 17):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        out = jitmarlin.marlin_gemm(a, packed.b, packed.scales, perm=perm)
        check_close(out, a[:, perm.long()].float() @ w, 1e-3, f"M={m}")


GATHER_FORMS = [("scattered", 10**9, 64), ("smem", 1, 64), ("smem-one-part", 1, 1), ("smem-many-parts", 1, 4096)]


@pytest.mark.parametrize("form,smem_min_m,ctas", GATHER_FORMS, ids=[f[0] for f in GATHER_FORMS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_kernels(dtype, form, smem_min_m, ctas, monkeypatch):
    """Both act-order gather kernels — scattered (one thread per 8 columns of a row) and staged
    through shared memory (one row per CTA, its output in parts) — are exact copies of A[:, perm]
    into a NaN-poisoned output, at M across part and block boundaries, a K whose last column block
    is partly idle (11008 / 8 = 1376 chunks) and one with more chunks than one CTA's threads take
    at once (28672: 3584 > 512 x 4, so at least two parts per row)."""
    monkeypatch.setattr(G, "GATHER_SMEM_MIN_M", smem_min_m)
    monkeypatch.setattr(G, "GATHER_SMEM_CTAS", ctas)
    fam = K.Family("f16" if dtype == torch.float16 else "bf16", 4, False, 128)
    for k in (11008, 28672):
        perm = torch.randperm(k, device="cuda").to(torch.int32)
        for m in (1, 3, 4, 5, 9, 16, 17, 33, 64, 100):
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            out = torch.full_like(a, float("nan"))
            G.gather_columns(a, perm, m, k, fam, out=out)
            assert torch.equal(out, a[:, perm.long()]), f"K={k} M={m}"


def test_gather_of_rows_too_long_for_shared_memory():
    """A row of 2^17 columns (256 KB) does not fit one CTA's shared memory: the scattered kernel
    gathers it, exactly."""
    k, m = 1 << 17, 9
    fam = K.Family("f16", 4, False, 128)
    fn = K.get_kernel(fam, "gather_smem", torch.cuda.current_device(), torch.cuda.get_device_capability())
    assert not G.use_gather_smem(m, k, fn) and G.use_gather_smem(m, 8192, fn)
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    out = torch.full_like(a, float("nan"))
    G.gather_columns(a, perm, m, k, fam, out=out)
    assert torch.equal(out, a[:, perm.long()])


def test_bad_act_order_is_refused_not_a_crash():
    """An order with a value outside [0, K) or a repeat would gather out of bounds: the op refuses
    it (checked once per tensor, and again after an in-place change), and the GPU stays usable."""
    k, n = 1024, 256
    packed, w = random_weights(k, n, 4, 128)
    a = torch.randn(4, k, device="cuda", dtype=torch.float16)
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales, perm=perm), a[:, perm.long()].float() @ w, 1e-3, "ok")
    perm[0] = 1 << 20  # in place, far outside K
    with pytest.raises(ValueError, match="permutation"):
        jitmarlin.marlin_gemm(a, packed.b, packed.scales, perm=perm)
    dup = torch.zeros(k, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="permutation"):
        jitmarlin.marlin_gemm(a, packed.b, packed.scales, perm=dup)
    torch.cuda.synchronize()  # no illegal-address error pending


CLUSTER_CASES = [(4096, 4096, (1, 3, 8)), (14336, 4096, (1, 5, 8))]


@pytest.mark.parametrize("k,n,ms", CLUSTER_CASES, ids=[f"{k}x{n}" for k, n, _ in CLUSTER_CASES])
def test_cluster_launches(k, n, ms):
    """Mid-size problems at M <= 8 take the cluster tile (each unit split along K across 8 CTAs of
    a cluster, summed through distributed shared memory; gemm.choose_cluster): the planner picks
    it on the H200, the output matches the reference (poisoned before), a repeat is bit-identical,
    and a CUDA graph replay equals the eager call."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("cluster tiles are built for sm_90 and newer only")
    fam = K.Family("f16", 4, False, 128)
    packed, w = random_weights(k, n, 4, 128)
    for m in ms:
        launch = G.prepare_launch(m, m, n, k, fam, 0)
        assert launch.plan.tile.cluster == 8, f"{k}x{n} M={m}: {launch.plan} is not a cluster launch"
        assert launch.grid % 8 == 0
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        out = run_poisoned(a, packed)
        check_close(out, a.float() @ w, 1e-3, f"cluster {k}x{n} M={m}")
        assert torch.equal(run_poisoned(a, packed), out), f"{k}x{n} M={m}: not deterministic"
        static_out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            G.launch_gemm(a, packed.b, packed.scales, None, None, static_out, m, n, k, fam)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out), f"{k}x{n} M={m}: graph replay differs"
    assert_workspace_clean()


def test_cluster_switch_and_explicit_tiles(monkeypatch):
    """JITMARLIN_CLUSTER=0 keeps the striped launch; a cluster tile named as an override runs
    (every cluster form, bias and per-channel scales included) or, where its clusters cannot all
    run at once or K does not split evenly, is a clear ValueError."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("cluster tiles are built for sm_90 and newer only")
    k, n = 4096, 4096
    fam = K.Family("f16", 4, False, 128)
    monkeypatch.setenv("JITMARLIN_CLUSTER", "0")
    K.env_flag.cache_clear()
    G.prepare_launch.cache_clear()
    try:
        assert G.prepare_launch(1, 1, n, k, fam, 0).plan.tile.cluster == 0
    finally:
        monkeypatch.delenv("JITMARLIN_CLUSTER")
        K.env_flag.cache_clear()
        G.prepare_launch.cache_clear()
    for group in (128, -1):
        packed, w = random_weights(4096, 2048, 4, group)
        bias = torch.randn(2048, device="cuda", dtype=torch.float16)
        for tile in [t for t in K.BULK_TILES if t.cluster]:
            for m in (1, tile.rows):
                a = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
                out = run_poisoned(a, packed, bias=bias, override=(tile, 2))
                check_close(out, a.float() @ w + bias.float(), 1e-3, f"{tile.tag()} g={group} M={m}")
    packed, _ = random_weights(1152, 2048, 4, 128)  # 9 k tiles: not a multiple of 8
    a = torch.randn(1, 1152, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="must be a multiple of 8"):
        run_poisoned(a, packed, override=(G.CLUSTER_TILE, 2))
    with pytest.raises(ValueError, match="is not built"):  # a cluster form the build does not hold
        run_poisoned(a, packed, override=(K.Tile.from_tag("w8_k128_s6_bk_dr2_cl8"), 2))
    assert_workspace_clean()
