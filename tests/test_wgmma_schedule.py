"""The wgmma kernel's stream-K split, modelled on the CPU: every cut tile is summed exactly once,
from exactly the partial sums its pieces wrote, in regions no other piece uses.

The model below restates the index arithmetic of `wgmma_pieces` (cuda_src/jm_wgmma.cuh, the
stream branch: runs [c W / G, (c + 1) W / G), c_first / c_last, WgPiece) and of the sum in
`wgmma_tile` (regions first + sp * stride, + first_extra for sp = 0). If the kernel's arithmetic
changes, change it here too. Session 19 found that a launch with fewer stages than CTAs breaks it
(a CTA with an empty run inside a tile's span never arrives); the routes never make one now."""

from __future__ import annotations

import itertools

import pytest

from jitmarlin.ops import gemm as G


def hybrid_rounds(tiles: int, ks: int, grid: int) -> int:
    """Rounds of whole tiles before stream-K in the two-compute-warpgroup producer form (the kernel's `dp`,
    session 43): floor(tiles / grid), one fewer where the tiles left would give a CTA under 16 stages."""
    dp = tiles // grid
    left = tiles - dp * grid
    if dp > 0 and left > 0 and left * ks < grid * G.WGMMA_SPLIT_MIN_STAGES:
        dp -= 1
    return dp


def test_hybrid_stage_floor_is_the_hosts():
    """The kernel's kWgSkMinStages (the hybrid's least stream-K stages per CTA) is the host's
    WGMMA_SPLIT_MIN_STAGES, which the routes' stream-K rules and the model above use."""
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parents[1] / "cuda_src" / "jm_wgmma.cuh").read_text()
    (value,) = re.findall(r"constexpr int kWgSkMinStages = (\d+);", src)
    assert int(value) == G.WGMMA_SPLIT_MIN_STAGES == 16


def stream_pieces(tiles: int, ks: int, grid: int, dp: int = 0,
                  runs: list | None = None) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """tile -> [(cta, WgPiece fields)] of the cut tiles' pieces, as the kernel computes them, after `dp`
    rounds of whole tiles (tiles dp * grid on go stream-K). runs: gets every (cta, tile, first stage, stages)."""
    t_sk = dp * grid
    w = (tiles - t_sk) * ks
    cut: dict[int, list] = {}
    for c in range(grid):
        for r in range(dp):
            if runs is not None:
                runs.append((c, r * grid + c, 0, ks))
        u0, u1 = c * w // grid, (c + 1) * w // grid
        u = u0
        while u < u1:
            t = u // ks
            x, x_end = t * ks, t * ks + ks
            e = min(u1, x_end)
            if runs is not None:
                runs.append((c, t_sk + t, u - x, e - u))
            if e - u < ks:  # cut between CTAs
                c_first = ((x + 1) * grid + w - 1) // w - 1
                c_last = (x_end * grid + w - 1) // w - 1
                piece = (c_last - c_first + 1, 2 * c + (0 if u0 >= x else 1), 2 * c_first, 2,
                         0 if c_first * w // grid >= x else 1)
                cut.setdefault(t_sk + t, []).append((c, piece))
            u = e
    return cut


def broken_tiles(tiles: int, ks: int, grid: int, dp: int = 0) -> list[int]:
    """Cut tiles whose sum would be wrong: a piece count that is not the number of pieces, or a
    summed region list that differs from the regions the pieces wrote; and any region two pieces
    share or outside [0, 2 grid) (the workspace holds two regions per CTA)."""
    bad, used = [], set()
    for t, pieces in stream_pieces(tiles, ks, grid, dp).items():
        arrivals, _, first, stride, first_extra = pieces[0][1]
        written = sorted(p[1] for _, p in pieces)
        summed = sorted(first + sp * stride + (first_extra if sp == 0 else 0) for sp in range(arrivals))
        if (any(p[0] != arrivals for _, p in pieces) or arrivals != len(pieces) or written != summed
                or used & set(written) or not all(0 <= r < 2 * grid for r in written)):
            bad.append(t)
        used |= set(written)
    return bad


def test_stream_k_sums_hold_with_a_stage_per_cta():
    for tiles, ks, grid in itertools.product((1, 2, 3, 4, 7, 12, 33, 112, 224), (1, 2, 5, 16, 22, 64, 128),
                                             (8, 66, 132, 264)):
        if tiles * ks >= grid:
            assert not broken_tiles(tiles, ks, grid), (tiles, ks, grid)


def test_session_19_case_is_broken_and_no_route_makes_one():
    # K=1408 N=512 M=24: 4 one-strip tiles of 22 stages on 264 CTA slots (the route before the fix)
    assert broken_tiles(4, 22, 264)
    # the routes: every stream-K launch the heuristic makes has a stage (16, in fact) per CTA
    for sms in (78, 114, 132):
        for m, n, k in itertools.product((17, 24, 32, 33, 48, 64), (128, 256, 512, 768, 1408, 4096, 11008, 28672),
                                         (512, 1024, 1408, 1536, 2048, 4096, 8192)):
            nt, fw, _, wide = G.wgmma_route_config(m, n, k, sms)
            if wide or n % (128 * fw):
                continue
            tiles = -(-m // nt) * (n // (128 * fw))
            if G.wgmma_splits(tiles, k, nt, fw, sms) == 1 and G.wgmma_stream_grid(tiles, k, nt, fw, sms):
                grid = sms * (2 if fw == 1 else 1)
                assert tiles * (k // 64) >= G.WGMMA_SPLIT_MIN_STAGES * grid, (sms, m, n, k)
                assert not broken_tiles(tiles, k // 64, grid), (sms, m, n, k)


@pytest.mark.parametrize("tiles,ks,grid", [(8, 16, 132), (6, 18, 264)])
def test_fewer_stages_than_ctas_can_break(tiles, ks, grid):
    """Below one stage per CTA the sums depend on where the empty runs fall: 1024x2048 wide at M=33
    (8 tiles x 16 stages on 132 CTAs) happened to work, 1152x768 at M=24 (6 x 18 on 264) did not."""
    assert bool(broken_tiles(tiles, ks, grid)) == (tiles == 6)


def test_hybrid_rounds_cover_every_stage_once_and_sum_right():
    """Session 43: the two-compute-warpgroup form runs hybrid_rounds() rounds of whole tiles, then stream-K over
    the tiles left; every stage of every tile is computed exactly once, the cut tiles sum right, every CTA's
    stream-K run holds a stage, and the rounds come out as intended on the H200's 132 CTAs."""
    for tiles, ks, grid in itertools.product((1, 7, 112, 131, 132, 133, 192, 250, 264, 300, 448, 560, 700),
                                             (1, 16, 22, 64, 128, 448), (66, 132, 114)):
        if tiles * ks < grid * 16:
            continue  # (the routes never make such a stream-K launch)
        dp = hybrid_rounds(tiles, ks, grid)
        runs: list = []
        assert not broken_tiles(tiles, ks, grid, dp), (tiles, ks, grid)
        stream_pieces(tiles, ks, grid, dp, runs)
        covered = {}
        for c, t, k0, n in runs:
            assert n > 0 and 0 <= t < tiles, (tiles, ks, grid, c, t)
            for k in range(k0, k0 + n):
                assert (t, k) not in covered, (tiles, ks, grid, t, k)
                covered[t, k] = c
        assert len(covered) == tiles * ks, (tiles, ks, grid)
        w = (tiles - dp * grid) * ks
        assert w == 0 or w >= grid, (tiles, ks, grid)  # no CTA with an empty stream-K run
    assert [hybrid_rounds(t, 128, 132) for t in (112, 132, 192, 448, 560)] == [0, 1, 1, 3, 4]
    assert hybrid_rounds(133, 64, 132) == 0  # one tile left: 64 stages over 132 CTAs would be under 16 each


def test_every_routed_two_warpgroup_stream_k_launch_sums_right():
    """The tall-tile and 128-token two-compute-warpgroup stream-K launches the route makes (sessions 39-43) on
    78 / 114 / 132 SMs: hybrid rounds with every cut tile summed right."""
    from jitmarlin.ops import _kernels as K
    f4 = K.Family("f16", 4, False, 128)
    seen = 0
    for sms in (78, 114, 132):
        for m, n, k in itertools.product((129, 200, 300, 384, 512, 600, 700, 800, 1024),
                                         (2048, 4096, 11008, 12288, 28672), (4096, 8192, 14336)):
            cfg = G.wgmma_route_config(m, n, k, sms)
            tall = G.wgmma_route_tall(m, n, k, cfg, f4, sms)
            if tall is not None and tall[1] == -1:
                nt, fw, _ = tall[0]
            elif tall is None and G.wgmma_route_stream2(m, n, k, cfg, f4, sms):
                nt, fw, _ = G.WGMMA_STREAM2_ROUTE
            else:
                continue
            tiles, ks = -(-m // nt) * (n // (128 * fw)), k // 64
            assert tiles * ks >= 16 * sms, (sms, m, n, k)
            assert not broken_tiles(tiles, ks, sms, hybrid_rounds(tiles, ks, sms)), (sms, m, n, k)
            seen += 1
    assert seen > 20, seen
