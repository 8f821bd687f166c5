"""The GEMM tile heuristic is a pure function: check it on the CPU over a sweep of shapes and of
the shared-memory limits of the GPUs we support (sm_80 A100: 163 KB, sm_86/89: 99 KB, sm_90: 227 KB)."""

import itertools

import pytest

from jitmarlin.ops import _kernels as K
from jitmarlin.ops.gemm import grid_size, m_class, select_plan, use_dequant_path

SMEM = {"sm_80": 166912 - 1024, "sm_86": 101376 - 1024, "sm_90": 232448 - 1024}
CC = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_90": (9, 0)}
FAMILIES = [K.Family(d, b, z, g) for d, b, z, g in itertools.product(("f16", "bf16"), (4, 8), (False, True),
                                                                       (-1, 32, 64, 128, 256))]
MS = [1, 2, 7, 8, 9, 16, 17, 32, 33, 48, 49, 64, 65, 100, 128, 255, 256, 1000, 4099]
KN = [(64, 64), (128, 64), (192, 320), (256, 256), (4096, 4096), (4096, 11008), (11008, 4096), (5120, 13824),
      (14336, 4096), (8192, 28672), (28672, 8192), (1408, 2048), (2048, 2816)]


@pytest.mark.parametrize("arch", SMEM)
@pytest.mark.parametrize("fam", FAMILIES, ids=str)
def test_plan_is_valid(fam, arch):
    limit = SMEM[arch]
    for m, (k, n) in itertools.product(MS, KN):
        if fam.group_size != -1 and k % fam.group_size:
            continue
        plan = select_plan(m, n, k, fam, limit, CC[arch])
        t = plan.tile
        assert k % t.tile_k == 0, (m, k, n, plan)
        assert (n // 64) % plan.nwarps == 0 and plan.nwarps in (1, 2, 4, 8, 16) and plan.nwarps <= t.max_warps
        assert plan.smem == K.smem_bytes(fam, t, plan.nwarps) <= limit
        assert K.tile_fits(fam, t)
        assert t in K.tiles_for(CC[arch]), "the plan must use a tile compiled for the arch"
        # the m tile serves the row count it was chosen for
        assert m_class(t.rows) == m_class(m)
        grid = grid_size(plan, m, n, k, sms=132, ctas_per_sm=2)
        total = (n // (64 * plan.nwarps)) * -(-m // t.rows) * (k // t.tile_k)
        assert 1 <= grid <= min(264, total)


def test_small_batch_uses_the_transposed_mma():
    fam = K.Family("f16", 4, False, 128)
    for m in range(1, 9):
        assert select_plan(m, 28672, 8192, fam, SMEM["sm_90"]).tile.swap
    assert not select_plan(9, 28672, 8192, fam, SMEM["sm_90"]).tile.swap
    for m in (1, 8):  # the bulk-copy ring only where it is compiled (sm_90)
        assert select_plan(m, 28672, 8192, fam, SMEM["sm_90"], (9, 0)).tile.bulk
        assert not select_plan(m, 28672, 8192, fam, SMEM["sm_80"], (8, 0)).tile.bulk
    assert not select_plan(64, 28672, 8192, fam, SMEM["sm_90"], (9, 0)).tile.bulk


def test_sm90_small_m_routes():
    """The H200 measurements of NOTES.md sessions 7 and 9: M <= 8 takes the direct-load tile from
    K*N = 32M on (4-bit two tiles ahead up to K*N = 64M and one above it, 8-bit one), the k-split
    ring below; M = 9-16 on large problems takes the five-slot 16-row ring, M = 17-32 the 32-row bulk
    ring, from K*N = 32M to 72M on 4-bit the 16-row direct-load tile (session 10). 4-bit MoE blocks of 8 / 16 (session 10): the three-CTAs-per-SM tiles, blocks of 8 only when
    the active experts' weights (min(E, slots) * K * N) pass K*N = 64M."""
    sm90, cc = SMEM["sm_90"], (9, 0)
    u4, u8, moe = K.Family("f16", 4, False, 128), K.Family("f16", 8, False, 128), K.Family("f16", 4, False, 128, True)
    moe8 = K.Family("f16", 8, False, 128, True)
    for m in (1, 5, 8):
        for k, n in ((8192, 8192), (8192, 28672), (14336, 4096)):
            # 4-bit: one tile ahead above K*N = 64M, two up to it (session 9)
            assert select_plan(m, n, k, u4, sm90, cc).tile.tag() == ("w8_k128_s6_bk_dr1" if k * n > 1 << 26
                                                                    else "w8_k128_s6_bk_dr2")
            assert select_plan(m, n, k, u8, sm90, cc).tile.tag() == "w8_k128_s6_bk_dr1"  # session 9
            assert select_plan(m, n, k, moe, sm90, cc).tile.tag() == ("w8_k128_s6_bk_dr1_o3" if k * n > 1 << 26
                                                                     else "w8_k128_s6_bk")
            assert select_plan(m, n, k, moe, sm90, cc, experts=8).tile.tag() == "w8_k128_s6_bk_dr1_o3"
            assert not select_plan(m, n, k, moe, SMEM["sm_80"], (8, 0), experts=8).tile.direct
            assert not select_plan(m, n, k, moe8, sm90, cc, experts=8).tile.direct  # 8-bit spills at 3 CTAs/SM
        # below K*N = 64M: one tile ahead on wide problems with K >= 4096 (session 23), two elsewhere
        for k, n in ((4096, 11008), (4096, 12288), (4096, 14336)):
            assert select_plan(m, n, k, u4, sm90, cc).tile.tag() == "w8_k128_s6_bk_dr1"
        for k, n in ((4096, 8192), (5120, 8192), (2048, 16384), (11008, 4096)):
            assert select_plan(m, n, k, u4, sm90, cc).tile.tag() == "w8_k128_s6_bk_dr2"
        # E=64 top-6, one token: six experts of 2048 x 2816 (34.6M) stay on the ring; 16 tokens: 64
        assert select_plan(m, 2816, 2048, moe, sm90, cc, experts=6).tile.tag() == "w8_k128_s6_bk"
        assert select_plan(m, 2816, 2048, moe, sm90, cc, experts=64).tile.tag() == "w8_k128_s6_bk_dr1_o3"
        assert select_plan(m, 4096, 4096, u4, sm90, cc).tile.tag() == "w8_k128_s6_bk_ks2"
        assert not select_plan(m, 28672, 8192, u4, SMEM["sm_80"], (8, 0)).tile.direct
    for m in (9, 16):
        assert select_plan(m, 28672, 8192, u4, sm90, cc).tile.tag() == "w16_k128_s5_bk"
        assert select_plan(m, 28672, 8192, u8, sm90, cc).tile.tag() == "w16_k128_s6_bk"  # session 12: six slots
        assert not select_plan(m, 28672, 8192, u8, SMEM["sm_80"], (8, 0)).tile.bulk
        # session 10: the 16-row direct-load tile on 4-bit problems of K*N in [32M, 72M]
        for k, n in ((8192, 8192), (14336, 4096), (4096, 11008), (11008, 4096)):
            assert select_plan(m, n, k, u4, sm90, cc).tile.tag() == "w16_k128_s6_bk_dr1"
            assert select_plan(m, n, k, u8, sm90, cc).tile.tag() == "w16_k128_s6_bk"  # 8-bit: spills; the ring
            assert not select_plan(m, n, k, u4, SMEM["sm_80"], (8, 0)).tile.direct
        assert select_plan(m, 28672, 4096, u4, sm90, cc).tile.tag() == "w16_k128_s5_bk"  # 117M: the ring
        assert select_plan(m, 4096, 4096, u4, sm90, cc).tile.tag() == "m1_k128_s6"  # 16M: the cp.async tile
        assert select_plan(m, 14336, 4096, moe, sm90, cc).tile.tag() == "w16_k128_s3_bk_o3"
    for m in (17, 32):  # the 32-row bulk ring on large problems, the cp.async ring on small ones
        assert select_plan(m, 28672, 8192, u4, sm90, cc).tile.tag() == "m2_k128_s4_bk"
        assert not select_plan(m, 4096, 4096, u4, sm90, cc).tile.bulk
        assert not select_plan(m, 28672, 8192, u4, SMEM["sm_80"], (8, 0)).tile.bulk
    assert "w8_k128_s6_bk_dr2" in {t.tag() for t in K.tiles_for(cc)}
    names = {name for name, _ in K.build_spec(u4, cc).sources}
    assert K.kernel_name(u4, K.Tile.from_tag("w8_k128_s6_bk_dr2")) in names
    moe_direct = {name for name, _ in K.build_spec(moe, cc).sources if "_dr" in name or "_o3" in name}
    assert moe_direct == {K.kernel_name(moe, K.Tile.from_tag(t)) for t in ("w8_k128_s6_bk_dr1_o3", "w16_k128_s3_bk_o3")}
    assert not any("_dr" in name or "_o3" in name for name, _ in K.build_spec(moe8, cc).sources)
    assert not any("_o3" in name for name, _ in K.build_spec(u4, cc).sources)  # dense: measured slower
    u8_direct = {name for name, _ in K.build_spec(u8, cc).sources if "_dr" in name}
    assert u8_direct == {K.kernel_name(u8, K.Tile.from_tag("w8_k128_s6_bk_dr1"))}  # one tile ahead only
    assert K.kernel_name(u4, K.Tile.from_tag("w8_k128_s6_bk_dr1")) in {n for n, _ in K.build_spec(u4, cc).sources}
    assert select_plan(1, 4096, 4096, u8, sm90, cc).tile.tag() == "w8_k128_s6_bk_ks2"  # small: the ring
    for m, tag in ((16, "w16_k128_s3_bk_o3"), (32, "m2_k128_s4_bk")):  # MoE blocks on large experts too
        assert select_plan(m, 28672, 8192, moe, sm90, cc).tile.tag() == tag
        assert select_plan(m, 2816, 2048, moe, sm90, cc, experts=2).tile.tag() == tag
    assert select_plan(16, 28672, 8192, moe8, sm90, cc).tile.tag() == "w16_k128_s5_bk"


def test_dequant_path_only_for_large_m():
    assert not any(use_dequant_path(m, n, k) for m in (1, 16, 32, 48) for k, n in KN)
    assert all(use_dequant_path(1024, n, k) for k, n in KN)


@pytest.mark.parametrize("k,n,match", [(4100, 4096, "K=4100"), (4096, 4100, "N=4100"),
                                       (4160, 4096, "multiple of group_size=128")])
def test_bad_shapes(k, n, match):
    with pytest.raises(ValueError, match=match):
        select_plan(1, n, k, K.Family("f16", 4, False, 128), SMEM["sm_90"])


def test_bad_group_size():
    with pytest.raises(ValueError, match="group_size=96"):
        K.Family("f16", 4, False, 96)


def test_workspace_growth_keeps_old_buffers_alive():
    """A CUDA graph captured before the workspace grew still launches kernels on the old buffers:
    growing must not free them (the caching allocator would hand them to other tensors)."""
    import torch

    ws = K.Workspace(torch.device("cpu"), floats=16, slots=4)
    old_ws, old_counters = ws.ws, ws.counters
    ptrs = (old_ws.data_ptr(), old_counters.data_ptr())
    ws.ensure(1024, 64)
    assert ws.ws.numel() >= 1024 and ws.counters.numel() >= 64 and not bool(ws.counters.any())
    del old_ws, old_counters
    assert {t.data_ptr() for t in ws._retired} == set(ptrs)
    ws.ensure(512, 8)  # already large enough: nothing changes
    assert len(ws._retired) == 2


@pytest.mark.parametrize("setting", [None, "0", "1"])
def test_wgmma_route_rules(monkeypatch, setting):
    """Where the dense GEMM takes the sm_90a wgmma kernel: only on sm_90, shapes it tiles (N % 128,
    K % 64, M >= 17); by default (where it measured faster, with split-K) M in [33, 512), and
    M in [17, 32] where K*N <= 2^26;
    JITMARLIN_WGMMA=1 everywhere it can, =0 never. The MoE blocks of 64
    follow the switch. Strips per warpgroup: two while about 3/4 of the SMs still get a CTA."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops import moe as M

    if setting is None:
        monkeypatch.delenv("JITMARLIN_WGMMA", raising=False)
    else:
        monkeypatch.setenv("JITMARLIN_WGMMA", setting)
    K.env_flag.cache_clear()
    cc = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(G, "_cc", lambda index: cc[index])
    monkeypatch.setattr(K, "wgmma_module_ready", lambda fam: True)  # (its fallback: the next test)
    fam = K.Family("f16", 4, False, 128)
    mfam = K.Family("f16", 4, False, 128, moe=True)
    try:
        auto = [G.use_wgmma_path(m, n, k, fam, 0) for m, k, n in
                ((256, 4096, 28672), (256, 28672, 8192), (192, 8192, 8192), (511, 8192, 28672),
                 (64, 4096, 28672), (128, 8192, 16384), (512, 8192, 28672), (64, 28672, 8192),
                 (128, 8192, 8192), (256, 14336, 4096), (256, 4096, 4096), (4096, 8192, 28672),
                 (1024, 8192, 28672), (1025, 8192, 8192))]
        # session 16: up to M = 1024 (1536 ties, 2048 loses to dequantize + cuBLAS)
        want_auto = {None: [True] * 11 + [False, True, False], "0": [False] * 14, "1": [True] * 14}[setting]
        assert auto == want_auto
        bf8, f8 = K.Family("bf16", 8, False, 128), K.Family("f16", 8, False, 128)
        big = [G.use_wgmma_path(m, 8192, 8192, f, 0) for m, f in ((512, bf8), (513, bf8), (1024, f8), (1024, K.Family("bf16", 4, False, 128)))]
        assert big == {None: [True, False, True, True], "0": [False] * 4, "1": [True] * 4}[setting]  # bf16 x 8-bit: to 512
        small = [G.use_wgmma_path(m, n, k, fam, 0) for m, k, n in
                 ((33, 4096, 28672), (63, 28672, 8192), (32, 8192, 8192), (17, 4096, 4096), (32, 4096, 28672),
                  (17, 28672, 8192), (16, 4096, 4096))]
        # M = 17-32 (32-token tiles): 4-bit where K*N <= 2^27 (above: the producer form, session 18);
        # M = 9-16 (16-token tiles): automatic route only, K*N <= 2^24 (8-bit too since session 16)
        assert small == {None: [True] * 7, "0": [False] * 7, "1": [True] * 6 + [False]}[setting]
        fam8 = K.Family("f16", 8, False, 128)
        mid = [G.use_wgmma_path(m, n, k, f, 0) for m, k, n, f in
               ((32, 8192, 28672, fam8), (17, 28672, 8192, fam8), (16, 8192, 28672, fam), (9, 4096, 4096, fam),
                (16, 4096, 4096, fam8), (8, 4096, 4096, fam), (32, 8192, 28672, fam), (16, 8192, 8192, fam))]
        # (the last: 4-bit 8192^2 at M = 9-16 takes the 16-token producer form, automatic route only: session 37)
        assert mid == {None: [True, True, False, True, True, False, True, True], "0": [False] * 8,
                       "1": [True, True, False, False, False, False, True, False]}[setting]
        # M = 9-16, fp16 8-bit weights from K*N = 2^26 with N >= 8192: the 16-token producer form (session 21)
        n16 = [G.use_wgmma_path(m, n, k, f, 0) for m, k, n, f in
               ((9, 28672, 8192, fam8), (16, 4096, 28672, fam8), (12, 8192, 8192, fam8), (16, 5120, 13824, fam8),
                (16, 13824, 5120, fam8), (16, 14336, 4096, fam8), (16, 4096, 12288, fam8), (8, 28672, 8192, fam8),
                (17, 28672, 8192, fam8), (16, 28672, 8192, bf8), (16, 28672, 8192, fam))]
        assert n16 == {None: [True] * 4 + [False] * 4 + [True, False, False], "0": [False] * 11,
                       "1": [False] * 8 + [True, False, False]}[setting]
        for m, k, n in ((16, 4096, 28672), (256, 4096, 28672 + 64), (256, 4096 + 32, 28672)):
            assert not G.use_wgmma_path(m, n, k, fam, 0)  # shapes the kernel does not tile
        assert not G.use_wgmma_path(256, 28672, 4096, fam, 1)  # not sm_90
        assert not G.use_wgmma_path(256, 28672, 4096, K.Family("f16", 4, False, 128, moe=True), 0)
        assert M._use_wgmma_moe(64, 28672, 4096, mfam, 0) is (setting != "0")
        assert not M._use_wgmma_moe(32, 28672, 4096, mfam, 0) and not M._use_wgmma_moe(64, 28672, 4096, mfam, 1)
        # blocks of 32: by rows per expert and the experts' K*N (M.wgmma_block32)
        assert [M._use_wgmma_moe(32, n, k, mfam, 0, r) for n, k, r in
                ((28672, 4096, 16.0), (28672, 4096, 24.0), (28672, 4096, 12.0), (2816, 2048, 9.0), (2048, 1408, 24.0),
                 (2048, 1408, 8.0))] == [setting != "0", False, False, setting != "0", setting != "0", False]
        assert [G.wgmma_strips(n, mt, 132) for n, mt in ((28672, 1), (28672, 2), (8192, 2), (8192, 8), (8064, 8))] \
            == [2, 2, 1, 2, 1]
        assert G.wgmma_config(64, 28672, 132, 8192) == (64, 1, 6) and G.wgmma_config(256, 8192, 132) == (128, 1, 4)
        # 64-token tiles: one strip on every shape (session 17; wgmma_strips is the MoE rule only)
        assert {G.wgmma_config(m, n, 132, 4096)[:2] for m in (33, 48, 64) for n in (4096, 8192, 22016, 28672)} == {(64, 1)}
        # 128-token tiles: one strip per warpgroup on every shape (session 16)
        assert {G.wgmma_config(m, n, 132)[:2] for m in (65, 128, 256, 1024) for n in (4096, 8192, 28672)} == {(128, 1)}
        # 32-token tiles: two strips unless one spreads the work over more SMs (H200, session 13)
        assert [G.wgmma_config(32, n, 132, k)[:2] for k, n in
                ((8192, 8192), (4096, 4096), (14336, 4096), (8192, 28672), (28672, 8192), (4096, 28672),
                 (4096, 22016))] \
            == [(32, 2), (32, 1), (32, 1), (32, 1), (32, 2), (32, 2), (32, 1)]  # session 14: one strip on stream-K
        assert G.wgmma_config(17, 8064, 132, 4096)[:2] == (32, 1)  # N not a multiple of 256
        with pytest.raises(ValueError, match="needs K"):
            G.wgmma_config(32, 8192, 132)
        assert G.wgmma_config(16, 4096, 132, 4096) == (16, 1, 8) and G.wgmma_config(9, 4096, 132)[:2] == (16, 1)
        # the wide two-strip 128-token kernel: M > 128 on problems above K*N = 2^26, dense, N % 256 == 0
        # (session 17); else the config above, in its two-warpgroup form
        wide = [(k, n, m) for k, n in ((4096, 4096), (14336, 4096), (8192, 8192), (4096, 28672), (8192, 28672),
                                       (28672, 8192), (8192, 8320)) for m in (64, 128, 129, 256, 1024)
                if G.wgmma_route_config(m, n, k, 132)[3]]
        assert wide == [(k, n, m) for k, n in ((4096, 28672), (8192, 28672), (28672, 8192)) for m in (129, 256, 1024)]
        assert G.wgmma_route_config(256, 28672, 8192, 132) == (128, 2, 4, True)
        assert G.wgmma_route_config(256, 8192, 8192, 132) == G.wgmma_config(256, 8192, 132, 8192) + (False,)
        assert not G.wgmma_route_config(256, 28672, 8192, 132, moe=True)[3]
        assert G.WGMMA_WIDE_ROUTE in K.WGMMA_WIDE_CONFIGS  # built by default
        # the producer form (session 18): the routed 64-token config above K*N = 2^26, and a 32-token config
        # for 4-bit 32-token tiles from K*N = 2^26 on; dense only
        f4, f8 = K.Family("f16", 4, False, 128), K.Family("f16", 8, False, 128)
        shapes = ((4096, 4096), (14336, 4096), (8192, 8192), (4096, 28672), (8192, 28672), (28672, 8192),
                  (8192, 8320))
        prod = {(k, n, m): G.wgmma_route_prod(n, k, G.wgmma_route_config(m, n, k, 132), f4)
                for k, n in shapes for m in (16, 17, 32, 33, 64, 65, 128)}
        big = ((8192, 8192), (4096, 28672), (8192, 28672), (28672, 8192), (8192, 8320))
        assert {key for key, v in prod.items() if v} == {(k, n, m) for k, n in big for m in (17, 32)} | {
            (k, n, m) for k, n in big[1:] for m in (33, 64)} | {(8192, 8192, 16)}
        # 32-token tiles: (32, 1, 6) at three CTAs per SM since session 20
        assert all(v == (32, 1, 6) for (k, n, m), v in prod.items() if v and 16 < m <= 32)
        assert all(v == (64, 1, 6) for (k, n, m), v in prod.items() if v and m > 32)
        assert set(K.WGMMA_PROD_CONFIGS) == {(64, 1, 6), (32, 1, 6), (16, 1, 8)}  # built by default
        assert K.dense_prod_configs(4) == K.WGMMA_PROD_CONFIGS + ((16, 1, 7),)  # 4-bit: + three CTAs per SM
        assert K.dense_prod_configs(8) == K.WGMMA_PROD_CONFIGS
        # 16-token tiles: fp16 8-bit weights where K*N >= 2^26 and N >= 8192 (session 21); 4-bit weights on the
        # shapes measured faster there (session 37: fp16 4096x11008, 11008x4096, 8192^2; bf16 4096x11008), and
        # (16, 1, 7) at three CTAs per SM on 4096x12288 (session 38, fp16 and bf16)
        llama = ((4096, 11008), (11008, 4096), (4096, 12288), (4096, 22016))
        n16 = {(k, n, f.dtype, f.bits): G.wgmma_route_prod(n, k, G.wgmma_route_config(16, n, k, 132), f)
               for k, n in shapes + ((5120, 13824), (13824, 5120)) + llama
               for f in (f4, f8, K.Family("bf16", 8, False, 128), K.Family("bf16", 4, False, 128))}
        assert {key for key, v in n16.items() if v} == {(k, n, "f16", 8) for k, n in
                                                        ((8192, 8192), (4096, 28672), (8192, 28672), (28672, 8192),
                                                         (8192, 8320), (5120, 13824), (4096, 22016))} | {
            (8192, 8192, "f16", 4), (4096, 11008, "f16", 4), (11008, 4096, "f16", 4), (4096, 11008, "bf16", 4),
            (4096, 12288, "f16", 4), (4096, 12288, "bf16", 4)}
        assert all(v == ((16, 1, 7) if (k, n) == (4096, 12288) else (16, 1, 8))
                   for (k, n, _, _), v in n16.items() if v) and K.prod_ctas((16, 1, 8)) == 2
        assert K.prod_ctas((16, 1, 7), 4) == 3 and G.wgmma_ctas_per_sm(1, (16, 1, 7), 4) == 3
        assert K.prod_ctas((16, 1, 7), 8) == 2  # (not built for 8-bit weights)
        assert K.prod_ctas((32, 1, 6)) == 3 and K.prod_ctas((64, 1, 6)) == 2
        assert G.wgmma_ctas_per_sm(1, (32, 1, 6)) == 3
        assert G.wgmma_route_prod(28672, 8192, (32, 2, 8, False), f8) is None  # 8-bit 32-token tiles: plain
        assert G.wgmma_route_prod(28672, 8192, (64, 1, 6, False), f8) == (64, 1, 6)
        assert G.wgmma_route_prod(28672, 8192, (64, 1, 6, True), f4) is None  # never for a wide route
        assert G.wgmma_route_prod(28672, 8192, (64, 1, 6, False), K.Family("f16", 4, False, 128, moe=True)) is None
    finally:
        K.env_flag.cache_clear()


def test_wgmma_k_splits(monkeypatch):
    """Split-K of the wgmma kernel: fills the resident CTA slots (2 per SM with one strip per
    warpgroup) without runs shorter than 16 stages, at most 8 splits (4 with 128-token tiles); none
    once the tiles fill the GPU;
    the workspace a split launch reserves matches the kernel's region per CTA."""
    from jitmarlin.ops import gemm as G

    assert G.wgmma_splits(32, 4096, 64, 1, 132) == 4  # 4096^2 at M=64: 64 stages, runs of >= 16
    assert G.wgmma_splits(32, 14336, 64, 1, 132) == 8  # 14336x4096 at M=64: 32 tiles -> 256 CTAs
    assert G.wgmma_splits(32, 14336, 128, 1, 132) == 4  # 128-token tiles: at most 4
    assert G.wgmma_splits(32, 14336, 32, 1, 132) == 8  # 32-token tiles: up to 8 (session 14)
    assert G.wgmma_config(32, 4096, 132, 14336)[:2] == (32, 1)  # a span tie with 8 splits: one strip
    assert G.wgmma_splits(32, 1024, 64, 1, 132) == 1  # 16 stages: one run
    assert G.wgmma_splits(64, 8192, 64, 1, 132) == 4  # 8192^2 at M=64
    assert G.wgmma_splits(64, 8192, 64, 2, 132) == 2  # one CTA per SM with two strips
    assert G.wgmma_splits(100, 8192, 64, 1, 132) == 2
    assert G.wgmma_splits(133, 28672, 64, 1, 132) == 1 and G.wgmma_splits(448, 8192, 64, 2, 132) == 1
    from jitmarlin.ops import _kernels as K

    for sms in (78, 114, 132):  # every split launch the heuristic makes fits the reserved bound
        for nt, fw, _ in K.WGMMA_CONFIGS:
            for m in (17, 64, 100, 128, 256, 511, 1024):
                for k in (1024, 4096, 14336, 28672):
                    for n in (1024, 4096, 8192, 28672):
                        if n % (128 * fw):
                            continue
                        mt, ft = -(-m // nt), n // (128 * fw)
                        sp = G.wgmma_splits(mt * ft, k, nt, fw, sms)
                        need, _ = G.wgmma_split_workspace(mt, ft, sp, nt, fw)
                        assert sp == 1 or need <= G.wgmma_split_bound(sms), (sms, nt, fw, m, k, n, sp)
    # stream-K where whole tiles leave over 10% of the CTA slots idle and K does not split (session 14)
    assert G.wgmma_stream_grid(112, 8192, 64, 2, 132) == 132  # 8192x28672 at M=64: 112 tiles
    assert G.wgmma_stream_grid(224, 8192, 64, 1, 132) == 264
    assert G.wgmma_stream_grid(112, 8192, 128, 2, 132) == 0  # not with 128-token tiles
    assert G.wgmma_stream_grid(64, 8192, 64, 1, 132) == 0  # K splits instead
    assert G.wgmma_stream_grid(132, 8192, 64, 2, 132) == 0 and G.wgmma_stream_grid(260, 8192, 64, 1, 132) == 0
    assert G.wgmma_stream_grid(112, 512, 64, 2, 132) == 0  # under 16 stages per CTA
    assert G.wgmma_stream_grid(0, 4096, 32, 2, 132) == 0  # N < 256: no two-strip tile at all
    assert G.wgmma_stream_grid(100_000, 64 * 30_000, 64, 2, 132_000) == 0  # 2^31 stages or more
    # every CTA's run holds at least 16 stages (session 19: 4 tiles x 22 stages on 264 CTAs left CTAs
    # without a stage inside a tile's span: the tile was never summed, NaN outputs, counters left set)
    assert G.wgmma_stream_grid(4, 1408, 32, 1, 132) == 0 and G.wgmma_stream_grid(12, 1536, 32, 1, 132) == 0
    for sms in (78, 114, 132):
        for nt, fw in ((16, 1), (32, 1), (32, 2), (64, 1), (64, 2)):
            for k in range(64, 8193, 64):
                for tiles in (1, 2, 3, 4, 6, 8, 12, 16, 22, 32, 44, 64, 100, 112, 150, 224, 300, 448):
                    g = G.wgmma_stream_grid(tiles, k, nt, fw, sms)
                    assert g == 0 or tiles * (k // 64) >= g * G.WGMMA_SPLIT_MIN_STAGES, (sms, nt, fw, k, tiles, g)
    assert [G.wgmma_config(m, 128, 132, 4096)[:2] for m in (17, 32, 64)] == [(32, 1), (32, 1), (64, 1)]
    for sms in (78, 114, 132):  # its workspace fits the reserved bound too (the producer form: two CTAs per SM)
        configs = [(c, None) for c in K.WGMMA_CONFIGS] + [(c, c) for c in K.dense_prod_configs(4)] + [
            ((32, 1, 7), (32, 1, 7))]  # (another three-CTA producer config: K.WGMMA_PROD_CTAS, set here)
        monkeypatch.setitem(K.WGMMA_PROD_CTAS, (32, 1, 7), 3)
        for (nt, fw, _), prod in configs:
            if nt <= 64:
                per_sm = G.wgmma_ctas_per_sm(fw, prod, 4)
                assert 2 * sms * per_sm * 256 * fw * (nt // 2) <= G.wgmma_split_bound(sms), (nt, fw, prod)
                for tiles in (1, 16, 112, 448):  # split launches of the producer form too
                    sp = G.wgmma_splits(tiles, 8192, nt, fw, sms, per_sm)
                    assert sp * tiles <= sms * per_sm or sp == 1, (nt, fw, prod, tiles, sp)
        assert G.wgmma_ctas_per_sm(1, (32, 1, 7)) == 3
    assert G.wgmma_ctas_per_sm(2, (32, 2, 6)) == 2 and G.wgmma_ctas_per_sm(2) == 1 and G.wgmma_ctas_per_sm(1) == 2
    # the four-strip producer form (two CTAs per SM): 8192x28672 at M=32 (112 tiles) takes 2 K splits
    assert G.wgmma_splits(112, 8192, 32, 2, 132, 2) == 2 and G.wgmma_splits(112, 8192, 32, 2, 132) == 1
    assert G.wgmma_stream_grid(150, 8192, 32, 2, 132, 2) == 264
    assert G.wgmma_stream_grid(224, 8192, 32, 1, 132, 3) == 396  # three CTAs per SM
    floats, counters = G.wgmma_split_workspace(2, 32, 4, 128, 1)
    assert counters == 64 and floats == 2 * 32 * 4 * 256 * 64


def test_wgmma_two_warpgroup_stream_k_rule(monkeypatch):
    """Session 39: the route runs the two-compute-warpgroup producer form (128, 2, 4) with stream-K where its
    whole 128-token tiles fill the SMs' CTA rounds under 0.8 (dense, N % 256 == 0, K*N >= 2^25, every CTA at
    least 48 stages); the cells measured on the H200 (132 SMs) fall on the measured side; the reserved
    workspace covers its two regions of 256 x 128 floats per CTA."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G

    f4 = K.Family("f16", 4, False, 128)

    def fires(m, n, k, fam=f4, sms=132):
        return G.wgmma_route_stream2(m, n, k, G.wgmma_route_config(m, n, k, sms, fam.moe), fam, sms)

    # (K, N): M where it fires among 128-1024 (s39a: faster there; level or slower at the others measured)
    want = {(8192, 8192): {384}, (14336, 4096): {384}, (4096, 12288): {384}, (4096, 22016): {256},
            (28672, 8192): {384}, (8192, 28672): set(), (4096, 28672): set(), (4096, 11008): set()}
    for (k, n), ms in want.items():
        assert {m for m in (128, 256, 384, 512, 1024) if fires(m, n, k)} == ms, (k, n)
    assert fires(65, 22016, 8192) and fires(257, 12288, 4096)  # partial 128-token tiles: the same launches
    # under 48 stages per stream-K CTA (s39b: slower): 4096x12288 at M=256 (47), 4096x22016 at M=128 (42)
    assert not fires(256, 12288, 4096) and not fires(128, 22016, 4096)
    assert not fires(64, 12288, 4096)  # 64-token tiles
    assert not fires(384, 4096, 4096)  # K*N under 2^25 (4096^2: 0.73 of its rounds, not measured)
    assert not fires(384, 8320, 8192)  # N % 256 != 0
    assert not fires(384, 12288, 4096, K.Family("f16", 4, False, 128, moe=True))
    assert fires(384, 12288, 4096, K.Family("bf16", 8, True, 64))  # any dense format
    for sms in (78, 114, 132, 264):  # wherever it fires, every stream-K CTA gets at least 48 stages
        for k in (256, 1024, 4096, 8192, 28672):
            for n in (4096, 8192, 12288, 22016, 28672, 131072):
                for m in (65, 128, 256, 384, 640, 1024):
                    if fires(m, n, k, sms=sms):
                        assert (n // 256) * -(-m // 128) * (k // 64) >= sms * 48, (sms, m, n, k)
    # the fill: 4096x12288 at M=384 (288 one-strip CTAs: rounds of 3 per SM, 0.73) fires, at M=512 (384: 0.97) not
    assert G.wgmma_route_config(384, 12288, 4096, 132)[:2] == (128, 1) and fires(384, 12288, 4096)
    monkeypatch.setattr(G, "WGMMA_STREAM2_MAX_FILL", 0.7)
    assert not fires(384, 12288, 4096) and fires(256, 22016, 4096)  # 0.65: 172 wide CTAs in rounds of 2
    monkeypatch.setattr(K, "WGMMA_PROD2_CONFIGS", ())  # not built: never routed, the bound back to 256 x 64
    assert not fires(256, 22016, 4096) and G.wgmma_split_bound(132) == 2 * 132 * 256 * 64
    monkeypatch.undo()
    for sms in (78, 114, 132):
        floats, counters = G.wgmma_stream_workspace(sms, 3, 48, 128, 2)
        assert floats == 2 * sms * 256 * 128 and counters == 144
        # the bound: two regions per CTA of the largest two-compute-warpgroup tile built (session 41's tall tiles)
        widest = max(fw * nt // 2 for nt, fw, _ in K.WGMMA_PROD2_CONFIGS)
        assert G.wgmma_split_bound(sms) == 2 * sms * 256 * widest >= floats


def test_wgmma_tall_token_tile_rule(monkeypatch):
    """Sessions 41-43: where the route runs 128-token tiles at M = 129-1024 it takes the two-compute-warpgroup
    producer form with 144- / 160- / 192- / 256-token tiles (G.WGMMA_TALL_ROUTE); the cells measured on the H200
    (132 SMs, s42a, s43a) get the tile that measured fastest, stream-K only where the whole-tile launch leaves at least
    32 stages of its last round idle; none for MoE, formats aside, or a tile that is not built. Since session 44 the
    rows route M = 129-256 only; above, they are the A/B baseline of the cost model (test_wgmma_tall_cost_model), so
    this test checks them with the model off."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G

    f4 = K.Family("f16", 4, False, 128)
    assert G.WGMMA_TALL_MODEL is True
    monkeypatch.setattr(G, "WGMMA_TALL_MODEL", False)  # probe_configs routeTab

    def tall(m, n, k, fam=f4, sms=132):
        t = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms, fam.moe), fam, sms)
        return None if t is None else (t[0][0], t[0][1], "sk" if t[1] == -1 else t[1])

    # session 48 (s48e / s48f): the smallest of the 208- / 224- / 240- / 256-token tiles that holds M at M = 193-256
    # where K*N > 2^24
    big = {129: (144, 2), 144: (144, 2), 160: (160, 2), 176: (192, 1), 192: (192, 1), 200: (208, 1), 224: (224, 1),
           240: (240, 1), 256: (256, 1), 300: (160, 2),
           320: (160, 2), 352: (192, 1), 384: (192, 1), 512: (256, 1), 513: (160, 2), 640: (160, 2), 768: (256, 1),
           800: (160, 2), 1024: (256, 1)}
    for k, n in ((8192, 28672), (28672, 8192)):
        assert {m: tall(m, n, k)[:2] for m in big} == big, (k, n)
    # session 43: M = 801-896 takes 256-token tiles where N <= 16384 only (N = 28672 measured slower)
    assert tall(896, 8192, 28672)[:2] == (256, 1) and tall(801, 28672, 8192) is None
    mid = {129: (144, 1), 144: (144, 1), 160: (192, 1), 192: (192, 1), 208: (208, 1), 224: (224, 1), 256: (256, 1),
           512: (256, 1), 600: (160, 2), 768: (256, 1), 780: (160, 2), 1024: (256, 1)}
    for k, n in ((8192, 8192), (14336, 4096), (4096, 12288), (4096, 11008)):
        assert {m: tall(m, n, k)[:2] for m in mid} == mid, (k, n)
    # session 44 (s44c): two strips at M = 129-160 also on K*N in (2^26, 2^27) where N >= 24576 (4096x28672 M = 129 /
    # 144: (144, 2, 4) 58.7 / 59.4 us, (144, 1, 6) 67.3 / 67.6), not on 8192^2 (K*N = 2^26: 44.1 vs 39.6)
    assert {m: tall(m, 28672, 4096)[:2] for m in mid} == {**mid, 129: (144, 2), 144: (144, 2), 160: (160, 2)}
    # two 160-token tiles at M = 257-320 from K*N = 3 * 2^24 (4096x12288 in, 4096x11008 out)
    assert tall(288, 12288, 4096)[:2] == (160, 2) and tall(288, 11008, 4096) is None
    assert tall(896, 11008, 4096)[:2] == (256, 1) and tall(896, 28672, 4096) is None
    # 4096^2 (K*N in (2^23, 2^24]): 192-token tiles at M = 257-384, 513-768, none at 769-800 or below 2^23
    assert [tall(m, 4096, 4096) for m in (129, 192, 224, 256, 300, 400, 600, 700, 800, 896)] == [
        (144, 1, 4), (192, 1, 4), None, None, (192, 1, 2), (256, 1, 2), (192, 1, 1), (192, 1, 1), None, (256, 1, 1)]
    assert all(tall(m, 2048, 2048) is None for m in (300, 600, 780))
    # two 192-token tiles at M = 321-384 from K = 8192 only; none past M = 1024
    assert tall(352, 8192, 8192)[:2] == (192, 1) and tall(352, 12288, 4096) is None
    assert all(tall(m, 28672, 8192) is None for m in (128, 1025))
    # stream-K where the last round's idle part is worth >= 32 stages (s42a: faster there, slower under)
    assert [tall(m, 12288, 4096)[2] for m in (256, 512, 768, 1024)] == [1, "sk", "sk", 1]
    assert [tall(m, 8192, 8192)[2] for m in (256, 512, 768, 1024)] == [2, 1, "sk", 1]
    assert tall(1024, 28672, 8192)[2] == 1 and tall(768, 28672, 8192)[2] == "sk"
    for sms in (78, 114, 132, 264):  # a stream-K launch gives every CTA at least 16 stages
        for k in (1024, 4096, 8192, 28672):
            for n in (1024, 4096, 12288, 28672):
                for m in (129, 160, 200, 300, 512, 700, 1000):
                    t = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), f4, sms)
                    if t is not None and t[1] == -1:
                        (nt, fw, _) = t[0]
                        assert -(-m // nt) * (n // (128 * fw)) * (k // 64) >= sms * 16, (sms, m, n, k)
    assert tall(160, 12288, 4096, K.Family("bf16", 8, True, 32)) == tall(160, 12288, 4096)  # any dense format
    assert tall(160, 12288, 4096, K.Family("f16", 4, False, 128, moe=True)) is None
    monkeypatch.setattr(K, "WGMMA_PROD2_CONFIGS", ((128, 2, 4), (192, 1, 6)))  # 144 / 256 not built: rows skipped
    assert tall(129, 12288, 4096) is None and tall(160, 12288, 4096)[:2] == (192, 1) and tall(256, 12288, 4096) is None
    monkeypatch.setattr(G, "WGMMA_TALL_MAX_M", 0)  # the rule off (probe_configs routeT0)
    assert tall(160, 12288, 4096) is None


def test_wgmma_route_falls_back_when_its_module_cannot_be_built(monkeypatch):
    """Chosen automatically, a wgmma module that cannot be built (nvcc without sm_90a, a prebuilt
    cache without it under JITMARLIN_DISABLE_JIT) means the mma.sync path and one warning; forced
    with JITMARLIN_WGMMA=1 the route stays (and the launch raises the build error)."""
    from jitmarlin.errors import CacheMissError
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops import moe as M

    def no_module(spec):
        raise CacheMissError(f"{spec.family} module not in the cache (test)")

    monkeypatch.setattr(K, "get_module", no_module)
    monkeypatch.setattr(G, "_cc", lambda index: (9, 0))
    monkeypatch.delenv("JITMARLIN_WGMMA", raising=False)
    K.env_flag.cache_clear()
    K.wgmma_module_ready.cache_clear()
    fam = K.Family("f16", 4, False, 128)
    try:
        with pytest.warns(RuntimeWarning, match="not available.*using the mma.sync kernels"):
            assert not G.use_wgmma_path(256, 28672, 8192, fam, 0)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # cached: warned once
            assert not G.use_wgmma_path(256, 28672, 8192, fam, 0)
        with pytest.warns(RuntimeWarning, match="not available"):
            assert not M._use_wgmma_moe(64, 28672, 4096, K.Family("f16", 4, False, 128, moe=True), 0)
        monkeypatch.setenv("JITMARLIN_WGMMA", "1")
        K.env_flag.cache_clear()
        assert G.use_wgmma_path(256, 28672, 8192, fam, 0)
    finally:
        K.env_flag.cache_clear()
        K.wgmma_module_ready.cache_clear()


def test_tile_tags_round_trip():
    from jitmarlin.ops import _kernels as K

    extra = (K.Tile(2, True, 8, 5, True), K.Tile(1, False, 8, 4, True, 4), K.Tile(3, False, 4, 4),
             K.Tile(1, True, 4, 8, True, 1, 4))
    for tile in K.TILES + K.BULK_TILES + extra:
        assert K.Tile.from_tag(tile.tag()) == tile
    assert K.Tile.from_tag("w16_k128_s5_bk") == K.Tile(2, True, 8, 5, True)
    assert K.Tile.from_tag("w8_k64_s8_bk_dr4") == K.Tile(1, True, 4, 8, True, 1, 4)
    occ = K.Tile.from_tag("w16_k128_s3_bk_o3")  # experiments: three CTAs per SM at 4 math warps
    assert occ == K.Tile(2, True, 8, 3, True, occ=3) and occ.tag() == "w16_k128_s3_bk_o3"
    assert (occ.min_blocks, occ.max_warps, occ.max_threads) == (3, 4, 160)
    assert K.Tile.from_tag("w8_k128_s6_bk_dr1_o3") == K.Tile(1, True, 8, 6, True, direct=1, occ=3)
    for bad in ("w16_k128", "q1_k128_s4", "w12_k128_s4", "m1_k100_s4", "w8_k128_s6_bk_ks"):
        with pytest.raises(ValueError, match="tile tag"):
            K.Tile.from_tag(bad)


def test_perm_values_checked_once_and_after_changes():
    """check_perm_values (CPU tensors here; the GPU path runs the same torch ops): a permutation
    passes and is remembered; repeats, out-of-range values and in-place changes are caught."""
    import torch

    from jitmarlin.ops import gemm as G

    k = 256
    perm = torch.randperm(k).to(torch.int32)
    G.check_perm_values(perm, k)
    assert G._PERMS_CHECKED[id(perm)][0]() is perm
    perm[3] = perm[4]  # in place: the version counter moves, so it is checked again
    with pytest.raises(ValueError, match="permutation of range\\(K=256\\)"):
        G.check_perm_values(perm, k)
    bad = torch.arange(k, dtype=torch.int32)
    bad[0] = k  # outside [0, K)
    with pytest.raises(ValueError, match="values outside"):
        G.check_perm_values(bad, k)
    rows = torch.stack([torch.randperm(k) for _ in range(3)]).to(torch.int32)
    G.check_perm_values(rows, k)  # [E, K]: every row
    rows[1, 0] = -1
    with pytest.raises(ValueError, match="every row of perm"):
        G.check_perm_values(rows, k)


def test_pdl_switch(monkeypatch):
    """JITMARLIN_PDL is read through K.env_flag like the other switches: on by default on sm_90,
    off with "0", never before sm_90."""
    from jitmarlin.ops import gemm as G

    for value, want in ((None, True), ("1", True), ("0", False), ("", True)):
        if value is None:
            monkeypatch.delenv("JITMARLIN_PDL", raising=False)
        else:
            monkeypatch.setenv("JITMARLIN_PDL", value)
        K.env_flag.cache_clear()
        assert G.use_pdl((9, 0)) is want, value
        assert G.use_pdl((8, 9)) is False
    monkeypatch.delenv("JITMARLIN_PDL", raising=False)
    K.env_flag.cache_clear()


def test_gather_pdl_rule():
    from jitmarlin.ops.gemm import gather_grid, gather_pdl, gather_smem_grid

    # the scattered gather (M < GATHER_SMEM_MIN_M): one thread per 8 columns of a row, 256 per CTA
    assert gather_grid(1, 8192) == 4 and gather_grid(3, 28672) == 42
    for k in (4096, 8192, 14336, 28672):
        assert gather_pdl(gather_grid(1, k)), k
    assert not gather_pdl(gather_grid(16, 28672))  # 224 CTAs: why M >= 4 takes the shared-memory gather
    # the shared-memory gather: one row per CTA, 64 CTAs from M = 4 to 64 up to K = 65536 (at
    # most 2048 chunks of 8 per part: 512 threads x 4), so it overlaps the GEMM before it
    assert gather_smem_grid(16, 28672) == (4, 64) and gather_smem_grid(4, 4096) == (16, 64)
    assert gather_smem_grid(64, 28672) == (2, 128)  # 3584 chunks need two parts
    assert gather_smem_grid(128, 4096) == (1, 128)
    for k in (4096, 8192, 14336, 28672, 65536):
        for m in (4, 8, 16):
            assert gather_pdl(gather_smem_grid(m, k)[1]), (m, k)
    # the MoE gather's grid (one thread per 8 columns of a sorted position, 256 per CTA) keeps the rule
    assert gather_pdl(-(-28672 // 8 // 256)) and not gather_pdl(16 * 28672 // 8 // 256)


def test_sm90_moe_expert_gemms_take_the_large_routes():
    """NOTES.md session 8: one MoE launch streams every active expert's weights, so on sm_90 the
    expert GEMMs take the large-problem routes whatever one expert's K*N (Mixtral's 14336x4096 down
    projection, E=64's 2048x2816 / 1408x2048 experts); dense problems of the same size keep the
    small-problem routes, and sm_80 is unchanged. (Blocks of 8 / 16 of 4-bit experts: the
    three-CTAs-per-SM tiles of session 10, test_sm90_small_m_routes; 8-bit experts shown here.)"""
    sm90, cc = SMEM["sm_90"], (9, 0)
    u4, moe = K.Family("f16", 4, False, 128), K.Family("f16", 8, False, 128, True)
    for k, n in ((14336, 4096), (2048, 2816), (1408, 2048), (4096, 4096)):
        assert select_plan(8, n, k, moe, sm90, cc, experts=8).tile.tag() == "w8_k128_s6_bk"
        assert select_plan(16, n, k, moe, sm90, cc).tile.tag() == "w16_k128_s5_bk"
        assert select_plan(32, n, k, moe, sm90, cc).tile.tag() == "m2_k128_s4_bk"
    assert select_plan(8, 4096, 4096, u4, sm90, cc).tile.tag() == "w8_k128_s6_bk_ks2"
    assert select_plan(16, 4096, 14336, u4, sm90, cc).tile.tag() == "w16_k128_s6_bk_dr1"  # session 10
    assert not select_plan(16, 4096, 4096, u4, sm90, cc).tile.bulk
    sm80 = SMEM["sm_80"]
    u8 = K.Family("f16", 8, False, 128)
    assert select_plan(8, 4096, 14336, moe, sm80, (8, 0)) == select_plan(8, 4096, 14336, u8, sm80, (8, 0))


def test_cluster_choice():
    """Where a cluster launch replaces the striped one (gemm.choose_cluster, a pure function given
    how many clusters the device runs at once): 4-bit, M <= 8, the k-split ring in clusters of 8
    at the plan's warps or half, when units x 8 fill >= 90% of the striped grid, K tiles split
    evenly and all clusters fit at once; never for 16-row tiles, 8-bit or MoE families."""
    from jitmarlin.ops import gemm as G

    fam = K.Family("f16", 4, False, 128)
    h200 = lambda plan: {4: 15, 2: 45}[plan.nwarps]  # noqa: E731 - clusters at once, measured

    def plan_for(m, n, k, f=fam):
        return select_plan(m, n, k, f, SMEM["sm_90"], (9, 0))

    # 4096^2 M=1: the striped k-split ring runs 132 CTAs; in clusters 16 units of 4 warps need 16
    # clusters (15 fit), 32 units of 2 warps need 32 (45 fit)
    got = G.choose_cluster(plan_for(1, 4096, 4096), 1, 4096, 4096, fam, 132, h200)
    assert got is not None and got.tile == G.CLUSTER_TILE and got.nwarps == 2
    assert got.smem == K.smem_bytes(fam, got.tile, 2) == K.smem_bytes(fam, K.Tile(1, True, 8, 6, True, 2), 2) + 7 * 2 * 32 * 2 * 4
    assert G.cluster_grid(got, 1, 4096, 4096) == 256
    half = G.choose_cluster(plan_for(8, 4096, 14336), 8, 4096, 14336, fam, 264, h200)
    assert half is not None and half.nwarps == 2 and G.cluster_grid(half, 8, 4096, 14336) == 256
    # too many clusters (8192^2), too few CTAs, K tiles not a multiple of 8 (11008 / 128 = 86)
    assert G.choose_cluster(plan_for(1, 8192, 8192), 1, 8192, 8192, fam, 264, h200) is None
    assert G.choose_cluster(plan_for(1, 4096, 4096), 1, 4096, 4096, fam, 396, lambda p: 64) is None
    assert G.choose_cluster(plan_for(1, 4096, 11008), 1, 4096, 11008, fam, 264, h200) is None
    assert G.choose_cluster(plan_for(1, 28672, 8192), 1, 28672, 8192, fam, 396, h200) is None
    # bf16: only up to 8 k tiles per cluster CTA (4096^2: 4 yes; 14336x4096: 14 no)
    bf = K.Family("bf16", 4, False, 128)
    got = G.choose_cluster(plan_for(1, 4096, 4096, bf), 1, 4096, 4096, bf, 132, h200)
    assert got is not None and got.nwarps == 2
    assert G.choose_cluster(plan_for(1, 4096, 14336, bf), 1, 4096, 14336, bf, 264, h200) is None
    assert G.choose_cluster(plan_for(1, 4096, 14336), 1, 4096, 14336, fam, 264, h200) is not None
    # 16-row tiles, 8-bit weights, MoE families: none
    assert G.choose_cluster(plan_for(16, 4096, 4096), 16, 4096, 4096, fam, 132, h200) is None
    fam8 = K.Family("f16", 8, False, 128)
    assert G.choose_cluster(plan_for(1, 4096, 4096, fam8), 1, 4096, 4096, fam8, 132, h200) is None
    assert not K.tile_fits(K.Family("f16", 4, False, 128, moe=True), G.CLUSTER_TILE)
    assert G.cluster_twin(K.Tile(1, False, 8, 6)) is None


def test_wgmma_tall_cost_model(monkeypatch):
    """Session 44: from M = 257 the tall tile comes from the cost model (G.wgmma_route_cost; fitted to s43d + s44a by
    benchmarks/fit_tall_cost.py, refitted with s45d + s46a in session 46, shipped in session 47; with s48a + s48b and
    four more tiles in session 48). Its picks in cells measured on the H200, stream-K only where every CTA gets 16
    stages, the route without tall tiles where the model prices it lowest, the table's rows at M <= 256."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G

    f4 = K.Family("f16", 4, False, 128)
    assert G.WGMMA_TALL_MODEL is True and G.WGMMA_TALL_MODEL_MIN_M == 257

    def tall(m, n, k, sms=132):
        t = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), f4, sms)
        return None if t is None else (t[0][0], t[0][1], "sk" if t[1] == -1 else t[1])

    below = {(m, n, k): tall(m, n, k) for m in (129, 160, 200, 256) for n, k in ((28672, 8192), (4096, 4096))}
    monkeypatch.setattr(G, "WGMMA_TALL_MODEL", False)
    assert {(m, n, k): tall(m, n, k) for m, n, k in below} == below  # the table's rows below M = 257
    monkeypatch.setattr(G, "WGMMA_TALL_MODEL", True)
    # s43d's fastest launch in these cells (us): 28672x8192 M = 640 (160, 2) whole tiles 449.0, 8192^2 M = 544
    # (160, 2) 114.3, 4096x11008 M = 544 (192, 1) whole 78.7, 4096^2 M = 544 (192, 1) 36.3, 8192x28672 M = 800
    # (160, 2) stream-K 601.3
    assert tall(640, 8192, 28672) == (160, 2, 1) and tall(544, 8192, 8192)[:2] == (160, 2)
    assert tall(544, 11008, 4096) == (192, 1, 1)
    # session 47's refit (the 144-token tile priced): 4096^2 M = 544 on it, s47b 36.3 (192, 1) -> 33.6 us
    assert tall(544, 4096, 4096) == (144, 1, 1)
    assert tall(800, 28672, 8192) == (160, 2, "sk")
    # session 48's refit with the 176- / 208- / 224- / 240-token tiles (s48a-s48d, us): 2 x 208 / 2 x 224 / 4 x 208
    # rows where 256-token tiles padded (8192^2 M = 416 95.2 -> 79.8, 4096^2 M = 448 30.8 -> 28.6, M = 800 47.8 -> 41.4,
    # 14336x4096 M = 416 86.8 -> 73.3), 3 x 240 stream-K on 8192x28672 M = 704 (629.8 -> 557.5); 4096x12288 M = 544 on
    # the 144-token tile (s48d 114.6 -> 106.5 against the 128-token route)
    assert tall(416, 8192, 8192) == (208, 1, 1) and tall(416, 4096, 14336)[:2] == (208, 1)
    assert tall(448, 4096, 4096)[:2] == (224, 1) and tall(800, 4096, 4096) == (208, 1, 1)
    assert tall(704, 28672, 8192) == (240, 1, "sk")
    assert tall(544, 12288, 4096) == (144, 1, 1)
    # s44a (shapes the s43d fit never saw; table route -> model route, us): 4096x6144 M = 300 49.7 -> 36.9 (192, 1;
    # since session 48 (176, 1): s48d 37.0 -> 35.7); 3584x4608 M = 896 61.9 -> 48.0 (no tall tile); 14336x4096 M = 300
    # K split in four 67.9, stream-K 73.3 (the refit keeps the split)
    assert tall(300, 6144, 4096) == (176, 1, 1) and tall(896, 4608, 3584) is None
    assert tall(300, 4096, 14336) == (160, 2, 4)
    for sms in (78, 114, 132):
        for m in (257, 300, 400, 544, 700, 900, 1024):
            for n, k in ((4096, 4096), (12288, 4096), (28672, 8192), (8192, 28672), (1024, 2048)):
                t = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), f4, sms)
                if t is not None and t[1] == -1:
                    (nt, fw, _) = t[0]
                    assert -(-m // nt) * (n // (128 * fw)) * (k // 64) >= sms * 16, (sms, m, n, k)
    assert tall(300, 12288, 4096) is not None and G.wgmma_route_tall(
        300, 12288, 4096, G.wgmma_route_config(300, 12288, 4096, 132), K.Family("f16", 4, False, 128, moe=True),
        132) is None  # not for MoE


def test_wgmma_cluster_sum_rule(monkeypatch):
    """Session 45: the wgmma K splits of a dense tile are summed in a cluster of the splits (jm_wgmma.cuh) only
    where gemm.wgmma_cluster_sum says; the kernel sums clusters of 2, 3 and 4 whose size divides the FW * NT / 8
    float4s of sums per compute thread, and nothing else, so this rule is the guard: over every built config,
    form and split count it returns 0 or such a size, never above WGMMA_CLUSTER_MAX (2 by default: clusters of
    4 lost on the H200), never for MoE, never where the shares would not fit the ring or where the clusters the
    device runs at once would need more rounds than the plain launch."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G

    class Fn:
        def __init__(self, clusters):
            self.clusters = clusters

        def max_active_clusters(self, threads, smem, cluster):
            return self.clusters

    f16 = K.Family("f16", 4, False, 128)
    forms = [(c, 0, 256) for c in K.WGMMA_CONFIGS] + [(c, 0, 512) for c in K.WGMMA_WIDE_CONFIGS]
    forms += [(c, 1, K.WGMMA_PROD_THREADS) for c in K.dense_prod_configs(4)]
    forms += [(c, 2, K.WGMMA_PROD2_THREADS) for c in K.WGMMA_PROD2_CONFIGS]
    for cap in (2, 4, 8):
        monkeypatch.setattr(G, "WGMMA_CLUSTER_MAX", cap)
        seen = set()
        for (nt, fw, st), prod, threads in forms:
            smem = K.wgmma_smem_bytes(f16, nt, fw, st)
            wgs = (threads - 128) // 128 if prod else threads // 128
            per_thread = nt * 128 * fw // 4 // (128 * wgs)  # d[FW][NT / 2] of the kernel's compute threads
            for splits in range(-1, 9):
                got = G.wgmma_cluster_sum(Fn(64), f16, nt, fw, splits, threads, smem, prod, 64, 264)
                assert got in (0, splits), (nt, fw, prod, splits, got)
                if got:
                    seen.add(got)
                    assert got in (2, 3, 4) and got <= cap and per_thread % got == 0, (nt, fw, prod, splits)
                    assert (got - 1) * nt * 128 * fw * 4 // got <= smem - 1024
                assert G.wgmma_cluster_sum(Fn(64), K.Family("f16", 4, False, 128, moe=True), nt, fw, splits, threads,
                                           smem, prod, 64, 264) == 0
        assert seen == ({2} if cap == 2 else {2, 3, 4}), (cap, seen)
    monkeypatch.setattr(G, "WGMMA_CLUSTER_MAX", 2)
    smem = K.wgmma_smem_bytes(f16, 256, 1, 4)
    assert G.wgmma_cluster_sum(Fn(66), f16, 256, 1, 2, 384, smem, 2, 128, 132) == 2  # 8192^2 M = 256: one round
    assert G.wgmma_cluster_sum(Fn(60), f16, 256, 1, 2, 384, smem, 2, 128, 132) == 0  # 120 at once: two rounds
    assert G.wgmma_cluster_sum(Fn(0), f16, 256, 1, 2, 384, smem, 2, 128, 132) == 0  # the driver cannot tell
    assert G.wgmma_cluster_sum(None, f16, 256, 1, 2, 384, smem, 2, 128, 132) == 0
    assert G.wgmma_cluster_sum(Fn(66), f16, 256, 1, 4, 384, smem, 2, 128, 132) == 0  # above the cap
    monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", False)
    assert G.wgmma_cluster_sum(Fn(66), f16, 256, 1, 2, 384, smem, 2, 128, 132) == 0


def test_wgmma_halve_splits_rule(monkeypatch):
    """Session 46: the plain 128-token form's three or four K splits become two clustered ones only where the two
    splits give every SM of the device one CTA (60-100% of the SMs since session 48; 90% before) and K <= 8192 (the
    64-token form's: K <= 4096),
    only as a cluster, and only on the automatic route (a caller's explicit splits stay)."""
    import functools
    from jitmarlin.jit import driver
    from jitmarlin.ops import gemm as G

    class Dev:
        sm_count = 132

    class Fn:
        clusters = 66

        def max_active_clusters(self, threads, smem, cluster):
            return self.clusters

    fn = Fn()
    monkeypatch.setattr(G, "_cc", functools.lru_cache(None)(lambda index: (9, 0)))
    monkeypatch.setattr(driver, "device", lambda index: Dev())
    monkeypatch.setattr(K, "get_wgmma_kernel", lambda *a, **k: fn)
    f16 = K.Family("f16", 4, False, 128)

    def launch(m, n, k, **kw):
        G.wgmma_launch.cache_clear()
        return G.wgmma_launch(m, n, k, f16, 0, **kw)

    try:
        # the rule in isolation: 64, 48 or 40 tiles (128 / 96 / 80 CTAs of two splits on 132 SMs) yes; 86 or 36 no
        assert G.wgmma_halve_splits(64, 4, 128, 1, 0, False, 132, 4096)
        assert G.wgmma_halve_splits(64, 3, 128, 1, 0, False, 132, 8192)
        assert not G.wgmma_halve_splits(64, 2, 128, 1, 0, False, 132, 4096)  # already two
        assert not G.wgmma_halve_splits(86, 3, 128, 1, 0, False, 132, 4096)  # 172 CTAs: 40 SMs would run two
        # s48e: 96 / 80 CTAs (3072^2 M = 256 23.2 -> 16.5 us, 5120^2 M = 128 27.1 -> 23.4) yes, 72 (3584x4608 M = 64
        # 12.8 -> 14.9) no
        assert G.wgmma_halve_splits(48, 4, 128, 1, 0, False, 132, 4096)
        assert G.wgmma_halve_splits(40, 3, 128, 1, 0, False, 132, 5120)
        assert not G.wgmma_halve_splits(36, 4, 128, 1, 0, False, 132, 3584)
        assert not G.wgmma_halve_splits(64, 4, 128, 1, 0, False, 132, 11008)  # longer K: one CTA per SM too slow
        assert G.wgmma_halve_splits(64, 4, 64, 1, 0, False, 132, 4096)  # the 64-token tile: K up to 4096
        assert not G.wgmma_halve_splits(64, 4, 64, 1, 0, False, 132, 5120)
        for nt, fw, prod, wide in ((32, 1, 0, False), (16, 1, 0, False), (64, 1, 1, False), (128, 2, 0, False),
                                   (128, 1, 1, False), (128, 1, 2, False), (128, 1, 0, True), (192, 1, 2, False)):
            assert not G.wgmma_halve_splits(64, 4, nt, fw, prod, wide, 132, 4096), (nt, fw, prod, wide)
        # through the route: 4096^2 M = 256 (2 x 32 tiles of the plain 128-token form, four splits before)
        wl = launch(256, 4096, 4096)
        assert (wl.nt, wl.fw, wl.prod, wl.threads, wl.splits, wl.cluster, wl.grid) == (128, 1, 0, 256, 2, 2, 128)
        wl = launch(64, 8192, 4096)  # the 64-token tile's 64 tiles on N = 8192, K = 4096
        assert (wl.nt, wl.prod, wl.splits, wl.cluster, wl.grid) == (64, 0, 2, 2, 128)
        assert launch(64, 8192, 8192).splits == 4  # K = 8192 > 4096 for 64-token tiles
        wl = launch(96, 8192, 8192)  # 64 tiles at M = 65-128 on N = 8192
        assert (wl.nt, wl.splits, wl.cluster, wl.grid) == (128, 2, 2, 128)
        wl = launch(96, 8192, 14336)  # 64 tiles, K = 14336 > WGMMA_HALVE_MAX_K: four splits stay
        assert (wl.nt, wl.splits, wl.cluster) == (128, 4, 0)
        wl = launch(96, 11008, 8192)  # 86 tiles: three splits through the workspace stay
        assert (wl.nt, wl.splits, wl.cluster) == (128, 3, 0)
        assert launch(256, 4096, 4096, nt=128, fw=1, stages=4, splits=4).splits == 4  # explicit splits stay
        monkeypatch.setattr(G, "WGMMA_CLUSTER_HALVE", False)
        wl = launch(256, 4096, 4096)
        assert (wl.splits, wl.cluster, wl.grid) == (4, 0, 256)
        monkeypatch.setattr(G, "WGMMA_CLUSTER_HALVE", True)
        fn.clusters = 60  # 120 clusters of 2 at once: a second round, so no cluster and the four splits stay
        wl = launch(256, 4096, 4096)
        assert (wl.splits, wl.cluster, wl.grid) == (4, 0, 256)
        fn.clusters = 66
        monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", False)  # no clusters at all: the workspace's four splits
        assert launch(256, 4096, 4096).splits == 4
    finally:
        G.wgmma_launch.cache_clear()


def test_wgmma_halve_over_tall_rule(monkeypatch):
    """Session 47 (s47a): the route keeps the plain 128-token tile at M = 145-256 where its K splits are halved into
    a cluster of 2 (N = 4096 on 132 SMs) instead of the table's tall tile: under the 256-token tile for K <= 8192,
    under the 192-token tile for K <= 4096; off, or at M <= 144, or at longer K, the tall tile stays."""
    import functools
    from jitmarlin.jit import driver
    from jitmarlin.ops import gemm as G

    class Dev:
        sm_count = 132

    class Fn:
        def max_active_clusters(self, threads, smem, cluster):
            return 66

    monkeypatch.setattr(G, "_cc", functools.lru_cache(None)(lambda index: (9, 0)))
    monkeypatch.setattr(driver, "device", lambda index: Dev())
    monkeypatch.setattr(K, "get_wgmma_kernel", lambda *a, **k: Fn())
    f16 = K.Family("f16", 4, False, 128)

    def launch(m, n, k):
        G.wgmma_launch.cache_clear()
        w = G.wgmma_launch(m, n, k, f16, 0)
        return w.nt, w.prod, w.splits, w.cluster

    try:
        assert G.WGMMA_HALVE_OVER_TALL is True
        halved = (128, 0, 2, 2)
        for m, k in ((145, 3072), (160, 3072), (192, 4096), (224, 5120), (256, 8192), (193, 6144)):
            assert launch(m, 4096, k) == halved, (m, k)
        for m, k in ((145, 5120), (192, 8192)):  # the 192-token tile beyond K = 4096 stays
            assert launch(m, 4096, k)[:2] == (192, 2), (m, k)
        assert launch(224, 4096, 11008)[:2] == (224, 2)  # (session 48's 224-token row, K above the bound)
        assert launch(129, 4096, 4096)[0] == 144  # below WGMMA_HALVE_TALL_MIN_M: the 144-token tile
        assert launch(256, 4096, 11008)[:3] != halved[:3]  # K above the bound
        assert launch(192, 8192, 4096)[:3] != halved[:3]  # 2 x 64 tiles would leave no SM a single CTA: no halving
        assert not G.wgmma_halve_over_tall(192, 4096, 4096, (128, 1, 4, False), 192,
                                           K.Family("f16", 4, False, 128, moe=True), 132)
        assert not G.wgmma_halve_over_tall(192, 4096, 4096, (128, 2, 4, True), 192, f16, 132)
        assert not G.wgmma_halve_over_tall(192, 4096, 4096, (128, 1, 4, False), 144, f16, 132)  # tile without a bound
        monkeypatch.setattr(G, "WGMMA_HALVE_OVER_TALL", False)
        assert launch(160, 4096, 3072) == (192, 2, 3, 0)  # off: the table's tall tile (96 CTAs)
        assert launch(256, 4096, 5120) == (256, 2, 4, 0)
    finally:
        G.wgmma_launch.cache_clear()


def test_wgmma_cost_cluster_term(monkeypatch):
    """The cost model's `cluster` term (session 46's refit, shipped in session 47: negative, the cluster sum's fix-up
    is cheaper than the workspace's) is added to a two-way K split's fix-up only where the split can sum as a cluster
    of 2 (gemm.wgmma_cost_clusterable) and clusters are on; other split counts, stream-K and whole tiles are priced
    without it."""
    from jitmarlin.ops import gemm as G

    assert G.WGMMA_COST_TERMS["cluster"] < 0
    assert (144, 1, "p2") in G.WGMMA_COST_PER_STAGE and (144, 1, 6) in K.WGMMA_PROD2_CONFIGS
    monkeypatch.setitem(G.WGMMA_COST_TERMS, "cluster", 0.0)
    forms = [f for f in G.WGMMA_COST_PER_STAGE]
    before = {(f, sp): G.wgmma_cost_us(300, 8192, 8192, f, sp, 1, 132) for f in forms for sp in (-1, 1, 2, 3, 4)}
    assert all(G.wgmma_cost_clusterable(f) for f in forms)  # every tall / 128-token form splits its sums evenly
    assert not G.wgmma_cost_clusterable((24, 1, "plain"))  # 3 float4s per thread: no even halves
    monkeypatch.setitem(G.WGMMA_COST_TERMS, "cluster", -2.0)
    for (f, sp), us in before.items():
        got = G.wgmma_cost_us(300, 8192, 8192, f, sp, 1, 132)
        assert abs(got - (us - 2.0 if sp == 2 else us)) < 1e-9, (f, sp, us, got)
    monkeypatch.setattr(G, "WGMMA_CLUSTER_SUM", False)  # no clusters: no cluster term
    assert all(abs(G.wgmma_cost_us(300, 8192, 8192, f, 2, 1, 132) - before[(f, 2)]) < 1e-9 for f in forms)


def test_wgmma_cost_fixup_rows(monkeypatch):
    """Prepared in session 48 (off by default; probe config routeC49): with gemm.WGMMA_COST_FIXUP_ROWS the cost
    model's fix-up terms (K split, stream-K, cluster) are multiplied by the tile's rows / 128 and nothing else
    changes; off, the prices are the shipped ones."""
    from jitmarlin.ops import gemm as G

    assert G.WGMMA_COST_FIXUP_ROWS is False
    forms = list(G.WGMMA_COST_PER_STAGE)
    cases = [(f, sp) for f in forms for sp in (-1, 1, 2, 3)]
    off = {c: G.wgmma_cost_us(544, 8192, 8192, c[0], c[1], 1, 132) for c in cases}
    monkeypatch.setattr(G, "WGMMA_COST_FIXUP_ROWS", True)
    t = G.WGMMA_COST_TERMS
    for (f, sp), us in off.items():
        rows = f[0] * f[1] / 128
        fix = 0.0 if sp == 1 else t["sk"] if sp == -1 else t["split"] + t["per_split"] * sp + (
            t["cluster"] if sp == 2 and G.wgmma_cost_clusterable(f) else 0.0)
        got = G.wgmma_cost_us(544, 8192, 8192, f, sp, 1, 132)
        assert abs(got - (us + fix * (rows - 1))) < 1e-9, (f, sp, us, got)


def test_wgmma_tall_row_144_small_n():
    """Session 47 (s47e): at M = 145-192 on N <= 2560 with K*N <= 2^24 the table runs two 144-token tiles (twice the
    CTAs of one 192-token tile) instead of the 192-token tile; N = 3584, K*N above 2^24 and M outside 145-192 keep
    the rows they had."""
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G

    f4 = K.Family("f16", 4, False, 128)

    def tall(m, n, k, sms=132):
        t = G.wgmma_route_tall(m, n, k, G.wgmma_route_config(m, n, k, sms), f4, sms)
        return None if t is None else t[0]

    for n, k in ((2048, 2048), (2560, 2048), (2048, 5632), (2048, 8192), (1024, 4096)):
        for m in (145, 160, 192):
            assert tall(m, n, k) == (144, 1, 6), (m, n, k)
        assert tall(144, n, k) == (144, 1, 6) and tall(200, n, k) != (144, 1, 6), (n, k)
    for m, n, k in ((160, 3584, 3584), (160, 2048, 11008), (192, 4096, 4096)):
        assert tall(m, n, k) == (192, 1, 6), (m, n, k)


def test_strip_kernels_in_the_build():
    """The strip kernels (cuda_src/jm_strip.cuh) are modules of their own per sm_90 family (not in the family's
    usual module), one source per config with the family's template arguments: the configs the route takes
    ("strip"), the ones only A/B runs take ("strip_ab"); the act-order forms and the MoE form modules of their own."""
    for fam in (K.Family("f16", 4, False, 128), K.Family("bf16", 8, True, -1)):
        routed = [name for name, _ in K.strip_build_spec(fam, (9, 0)).sources]
        ab = [name for name, _ in K.strip_build_spec(fam, (9, 0), ab=True).sources]
        assert routed == [K.strip_kernel_name(fam, *cfg) for cfg in K.STRIP_ROUTED_CONFIGS]
        names = routed + ab
        assert sorted(names) == sorted(K.strip_kernel_name(fam, *cfg) for cfg in K.STRIP_CONFIGS)
        assert len(set(names)) == len(names) == len(K.STRIP_CONFIGS) and len(routed) == 10
        assert K.strip_build_spec(fam, (9, 0)).family == "strip"
        assert K.strip_build_spec(fam, (9, 0), ab=True).family == "strip_ab"
        assert "JITMARLIN_STRIP=1" in K.strip_build_spec(fam, (9, 0), ab=True).cli_hint
        for cc in ((8, 0), (9, 0)):
            assert not any(name.startswith("jm_strip") for name, _ in K.build_spec(fam, cc).sources)
        with pytest.raises(ValueError, match="sm_90 and newer"):
            K.strip_build_spec(fam, (8, 0))
        for toks, smem in ((1, 0), (2, 0), (1, 1), (2, 1)):
            spec = K.strip_build_spec(fam, (9, 0), ab=smem == 1)  # (since session 55 the ring forms are A/B-only)
            src = dict(spec.sources)[K.strip_kernel_name(fam, 16, 2, toks, smem)]
            assert '#include "jm_strip.cuh"' in src
            assert (f"{K.CTYPES[fam.dtype]}, {fam.bits}, {'true' if fam.zero_points else 'false'}, {fam.group_blocks}, "
                    f"16, {K.strip_depth(fam.bits, toks, smem)}, 2, {toks}, {K.strip_ring_rows(fam.bits, smem, toks)}, "
                    "false, false)") in src
        # the ring: weights and (since session 54) activations, at most 192 KB at 16 warps
        for toks in (1, 2):
            assert K.strip_smem_bytes(fam, 16, 1, toks=toks) == 16 * K.strip_ring_rows(fam.bits, 1, toks) * (
                fam.bits // 4 * 512 + 256 * toks) <= 192 * 1024
        assert K.strip_smem_bytes(fam, 16, 0) == 0
        # act-order register forms: the CTA's share of the permutation, 64 bytes per k16 row (session 54)
        assert K.strip_smem_bytes(fam, 16, 0, True, 4096, 2) == 64 * 128
        assert K.strip_smem_bytes(fam, 4, 0, True, 1152, 4) == 64 * 18 and K.strip_smem_bytes(fam, 16, 1, True, 4096) \
            == 16 * (24 if fam.bits == 4 else 12) * fam.bits // 4 * 512  # (act-order ring forms: the weights only)
        assert [K.strip_depth(4, 1, 0, True), K.strip_depth(4, 1, 0, True, True), K.strip_depth(4, 2, 0, True),
                K.strip_depth(8, 1, 0, True, True), K.strip_depth(4, 1, 1, True)] == [8, 6, 4, 4, 4]
        # the act-order forms: a module of their own (built on the first act-order strip launch), names ending _p
        perm = K.strip_build_spec(fam, (9, 0), True)
        assert perm.family == "strip_perm" and perm.key == K.strip_build_spec(fam, (9, 0)).key
        assert [name for name, _ in perm.sources] == [n + "_p" for n in routed]
        assert [n for n, _ in K.strip_build_spec(fam, (9, 0), True, True).sources] == [n + "_p" for n in ab]
        assert all(src.rstrip().endswith(", true, false)") for _, src in perm.sources)
    # MoE families: the MoE form (one token block, no act-order), a module of its own
    moe = K.Family("f16", 4, False, 128, moe=True)
    spec = K.strip_build_spec(moe, (9, 0))
    assert spec.family == "strip_moe" and len(spec.sources) == len(K.STRIP_MOE_CONFIGS)
    assert all("_moe_w" in name and src.rstrip().endswith(", false, true)") for name, src in spec.sources)
    with pytest.raises(ValueError, match="act-order forms and A/B configs for dense families"):
        K.strip_build_spec(moe, (9, 0), True)
    with pytest.raises(ValueError, match="act-order forms and A/B configs for dense families"):
        K.strip_build_spec(moe, (9, 0), ab=True)
    with pytest.raises(ValueError, match="no strip kernel"):
        K.get_strip_kernel(moe, 16, 2, 1, 0, 0, (9, 0))  # (no clusters in the MoE form)
    with pytest.raises(ValueError, match="sm_90 and newer"):
        K.strip_build_spec(moe, (8, 0))
    with pytest.raises(ValueError, match="no strip kernel"):
        K.get_strip_kernel(K.Family("f16", 4, False, 128), 12, 1, 1, 0, 0, (9, 0))
    with pytest.raises(ValueError, match="no strip kernel"):  # two token blocks come without clusters of 4
        K.get_strip_kernel(K.Family("f16", 4, False, 128), 16, 4, 2, 0, 0, (9, 0))


def test_strip_small_route_takes_the_routed_module_only(monkeypatch):
    """Whatever the device's fit, the default route (gemm.strip_small / strip_tall) picks configs of the routed strip
    module, never a shared-memory ring form, so a model never builds the A/B-only one; forcing the strip kernel
    (STRIP_ROUTE) reaches the others."""
    from jitmarlin.ops import gemm as G

    monkeypatch.delenv("JITMARLIN_STRIP", raising=False)
    K.env_flag.cache_clear()
    fam = K.Family("f16", 4, False, 128)
    seen, forced = set(), set()
    for sms in (78, 108, 132, 170):
        for per_sm in (1, 2, 4):
            def at_once(warps, cluster, toks, smem):
                return sms * max(1, per_sm * 16 // warps // 2) // (1 if cluster == 1 else 2)
            for n in range(64, 16385, 64 * 7):
                for k in (1024, 2048, 4096, 8192, 14336, 16384):
                    for m in (1, 3, 8, 12, 16):
                        cfg = G.strip_choice(m, n, k, fam, sms, at_once)
                        if cfg is not None:
                            assert G.strip_small(m, n, k) or G.strip_tall(m, n, k, fam.bits), (m, n, k, cfg)
                            assert cfg in K.STRIP_ROUTED_CONFIGS and cfg[3] == 0, (m, n, k, cfg)
                            seen.add(cfg)
    assert len(seen) >= 7, seen
    monkeypatch.setattr(G, "STRIP_ROUTE", True)
    for m in (17, 32):
        forced.add(G.strip_choice(m, 8192, 8192, fam, 132, lambda w, c, t, s: 132 * (16 // w)))
    assert forced and not forced & set(K.STRIP_ROUTED_CONFIGS), forced


def test_strip_choice_rule(monkeypatch):
    """Off by default but on small problems (gemm.strip_small) and tall ones whose grid fills the SMs (strip_tall,
    STRIP_TALL_MIN_FILL); on, the first of STRIP_ORDER whose grid runs in one wave."""
    from jitmarlin.ops import gemm as G

    fam = K.Family("f16", 4, False, 128)
    sms = 132

    def at_once(warps, cluster, toks, smem):  # H200-like: 1 / 2 / 4 CTAs per SM at 16 / 8 / 4 warps; clusters of 4: 30 at 1/SM
        per_sm = {16: 1, 8: 2, 4: 4}[warps]
        return {1: sms * per_sm, 2: 2 * 66 * per_sm, 4: 4 * 30 * per_sm}[cluster]

    monkeypatch.delenv("JITMARLIN_STRIP", raising=False)
    K.env_flag.cache_clear()
    # by default the small region (STRIP_SMALL: M <= 8, K x N <= 2^24), where the H200 measured it faster
    assert G.strip_choice(1, 4096, 4096, fam, sms, at_once) == (16, 2, 1, 0)
    assert G.strip_choice(8, 4096, 4096, fam, sms, at_once) == (16, 2, 1, 0)
    assert G.strip_choice(8, 1920, 8192, fam, sms, at_once) == (16, 4, 1, 0)  # 30 strips x 4 (small: no fill rule)
    assert G.strip_choice(1, 2048, 8192, fam, sms, at_once) == (16, 2, 1, 0)  # 32 x 2 (no ring: STRIP_RING_MIN_K None)
    assert G.strip_choice(1, 2048, 4096, fam, sms, at_once) == (16, 2, 1, 0)
    assert G.strip_choice(9, 4096, 4096, fam, sms, at_once) is None  # M past STRIP_SMALL_MAX_M, K < 2 N
    assert G.strip_choice(1, 8256, 4096, fam, sms, at_once) is None  # K x N past 2^24, K < N
    assert G.strip_choice(1, 28672, 4096, fam, sms, at_once) is None  # wide layers: the usual route
    assert G.strip_choice(1, 28672, 8192, fam, sms, at_once) is None
    assert G.strip_choice(1, 4096, 4096, K.Family("f16", 4, False, 128, moe=True), sms, at_once) is None
    # and the tall region (STRIP_TALL, session 55): K >= N, N <= 8192 at M <= 8 ...
    assert G.strip_choice(1, 4096, 11008, fam, sms, at_once) == (16, 2, 1, 0)  # 64 strips x 2: 128 of 132
    assert G.strip_choice(8, 4096, 14336, fam, sms, at_once) == (16, 2, 1, 0)
    assert G.strip_choice(1, 8192, 8192, fam, sms, at_once) == (8, 2, 1, 0)  # 128 x 2 CTAs of 8 warps: 256 of 264
    assert G.strip_choice(4, 8192, 28672, fam, sms, at_once) == (8, 2, 1, 0)
    assert G.strip_choice(1, 6144, 8192, fam, sms, at_once) is None  # 96 x 2 = 192 of 264 (0.73): SMs left idle
    assert G.strip_choice(1, 8256, 8256 * 2, fam, sms, at_once) is None  # N past STRIP_TALL_MAX_N
    assert G.strip_choice(1, 4096, 11008, K.Family("f16", 8, False, 128), sms, at_once) is None  # 4-bit only
    assert G.strip_choice(1, 4096, 11008, K.Family("bf16", 4, True, 128), sms, at_once) == (16, 2, 1, 0)
    # ... and K >= 2 N, N <= 4096 at M = 9-16
    assert G.strip_choice(16, 4096, 11008, fam, sms, at_once) == (16, 2, 2, 0)
    assert G.strip_choice(12, 4096, 14336, fam, sms, at_once) == (16, 2, 2, 0)
    assert G.strip_choice(16, 8192, 28672, fam, sms, at_once) is None  # N past STRIP_TALL2_MAX_N
    assert G.strip_choice(16, 4096, 8000, fam, sms, at_once) is None  # K < 2 N
    assert G.strip_choice(17, 4096, 14336, fam, sms, at_once) is None  # M past STRIP_TALL2_MAX_M
    monkeypatch.setattr(G, "STRIP_TALL", False)
    assert G.strip_choice(1, 8192, 8192, fam, sms, at_once) is None
    assert G.strip_choice(1, 4096, 4096, fam, sms, at_once) == (16, 2, 1, 0)
    monkeypatch.setattr(G, "STRIP_SMALL", False)
    assert G.strip_choice(1, 4096, 4096, fam, sms, at_once) is None
    monkeypatch.setattr(G, "STRIP_SMALL", True)
    monkeypatch.setattr(G, "STRIP_TALL", True)
    monkeypatch.setattr(G, "STRIP_RING_MIN_K", 8192)  # the ring forms' switch (the route of sessions 52-54)
    assert G.strip_choice(1, 2048, 8192, fam, sms, at_once) == (16, 2, 1, 1)
    assert G.strip_choice(1, 2048, 4096, fam, sms, at_once) == (16, 2, 1, 0)
    monkeypatch.setattr(G, "STRIP_RING_MIN_K", None)
    monkeypatch.setenv("JITMARLIN_STRIP", "1")
    K.env_flag.cache_clear()
    try:
        assert G.strip_choice(1, 28672, 8192, fam, sms, at_once) == (4, 1, 1, 0)  # the switch for whole models
    finally:
        monkeypatch.delenv("JITMARLIN_STRIP")
        K.env_flag.cache_clear()
    monkeypatch.setattr(G, "STRIP_ROUTE", True)
    assert G.strip_choice(1, 8192, 8192, fam, sms, at_once) == (8, 2, 1, 0)  # 128 strips x 2 of 8 warps
    assert G.strip_choice(1, 6144, 4096, fam, sms, at_once) == (8, 2, 1, 0)  # forced: no fill rule
    assert G.strip_choice(8, 4096, 4096, fam, sms, at_once) == (16, 2, 1, 0)  # 64 strips x 2
    assert G.strip_choice(1, 1920, 4096, fam, sms, at_once) == (16, 4, 1, 0)  # 30 strips x 4 = 120 clusters' CTAs
    assert G.strip_choice(1, 2048, 4096, fam, sms, at_once) == (16, 2, 1, 0)  # 32 x 4 = 128 > 120 fit: pairs
    assert G.strip_choice(1, 11008, 4096, fam, sms, at_once) == (8, 1, 1, 0)  # 172 strips: two CTAs per SM
    assert G.strip_choice(1, 28672, 4096, fam, sms, at_once) == (4, 1, 1, 0)  # 448 strips: four per SM
    assert G.strip_choice(1, 64 * 600, 4096, fam, sms, at_once) is None  # more than one wave of anything
    assert G.strip_choice(9, 4096, 4096, fam, sms, at_once) == (16, 2, 2, 0)  # M = 9-16: two token blocks
    assert G.strip_choice(16, 1920, 4096, fam, sms, at_once) == (16, 2, 2, 0)  # (no clusters of 4 with two blocks)
    assert G.strip_choice(16, 28672, 8192, fam, sms, at_once) == (4, 1, 2, 0)
    assert G.strip_choice(16, 28672, 4096, fam, sms, at_once) == (4, 1, 2, 0)
    assert G.strip_choice(16, 4096, 8192, fam, sms, at_once) == (16, 2, 2, 0)
    assert G.strip_choice(9, 1920, 8192, fam, sms, at_once) == (16, 2, 2, 0)
    # M = 17-32: three / four token blocks in the shared-memory ring form (at most 8 warps per CTA)
    assert G.strip_choice(17, 8192, 8192, fam, sms, at_once) == (8, 1, 3, 1)
    assert G.strip_choice(32, 4096, 4096, fam, sms, at_once) == (8, 2, 4, 1)  # 64 strips x 2
    assert G.strip_choice(32, 28672, 8192, fam, sms, at_once) == (4, 1, 4, 1)  # 448 strips: four per SM
    assert G.strip_choice(33, 8192, 8192, fam, sms, at_once) is None  # M past 32
    assert G.strip_choice(1, 8192, 8192, K.Family("f16", 4, False, 128, moe=True), sms, at_once) is None
    assert G.strip_choice(1, 8192, 8200, fam, sms, at_once) is None  # K not a multiple of the group
