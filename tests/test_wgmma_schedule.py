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


def stream_pieces(tiles: int, ks: int, grid: int) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """tile -> [(cta, WgPiece fields)] of the cut tiles' pieces, as the kernel computes them."""
    w = tiles * ks
    cut: dict[int, list] = {}
    for c in range(grid):
        u0, u1 = c * w // grid, (c + 1) * w // grid
        u = u0
        while u < u1:
            t = u // ks
            x, x_end = t * ks, t * ks + ks
            e = min(u1, x_end)
            if e - u < ks:  # cut between CTAs
                c_first = ((x + 1) * grid + w - 1) // w - 1
                c_last = (x_end * grid + w - 1) // w - 1
                piece = (c_last - c_first + 1, 2 * c + (0 if u0 >= x else 1), 2 * c_first, 2,
                         0 if c_first * w // grid >= x else 1)
                cut.setdefault(t, []).append((c, piece))
            u = e
    return cut


def broken_tiles(tiles: int, ks: int, grid: int) -> list[int]:
    """Cut tiles whose sum would be wrong: a piece count that is not the number of pieces, or a
    summed region list that differs from the regions the pieces wrote; and any region two pieces
    share or outside [0, 2 grid) (the workspace holds two regions per CTA)."""
    bad, used = [], set()
    for t, pieces in stream_pieces(tiles, ks, grid).items():
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
