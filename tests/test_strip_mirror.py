"""A CPU mirror of the strip kernel's index arithmetic (cuda_src/jm_strip.cuh), checked against the packer.

The GPU tests (tests/gpu/test_strip_gpu.py) are what prove the kernel; this test replays, in integer
arithmetic, where the kernel reads each weight, scale and zero point and where its sums land, and
asserts that every (k, feature) the MMA sees is the packer's q[k, n] with the scale and zero point of
column n, and that the warps' runs cover K once. It mirrors the .cuh's formulas (a change there must
change them here), and it exists because the kernel's first GPU run addressed the weights in Marlin's
k-major order instead of jitmarlin's strip-major one: a slip this test catches without a GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from jitmarlin.ops import _kernels as K
from jitmarlin.quant.layout import pack_weights, pack_zeros, permute_scales


def warp_runs(k: int, cluster: int, warps: int) -> list[tuple[int, int]]:
    """[kt0, kt1) of worker rank * warps + warp, as strip_body splits K (k16 rows, shares even to one row)."""
    rows, workers = k // 16, cluster * warps
    return [(rows * w // workers, rows * (w + 1) // workers) for w in range(workers)]


def mirror(q, s, z, bits, group, warps, cluster):
    """Per (k, n): the integer (q - z) the MMA multiplies, the scale multiplied in, as the kernel reads them."""
    k, n = q.shape
    k16, gb = k // 16, (-1 if group == -1 else group // 16)
    words = pack_weights(q, bits).reshape(-1).to(torch.int64) & 0xFFFFFFFF  # int32 words, unsigned
    sp = permute_scales(s).reshape(-1)
    zw = pack_zeros(z, bits).reshape(-1).to(torch.int64) & 0xFFFFFFFF if z is not None else None
    row_vecs = 8 * bits  # kRowVecs: 16-byte vectors per k16 row of a strip
    got_q = torch.full((k, n), -999, dtype=torch.int64)
    got_s = torch.zeros(k, n)
    seen = torch.zeros(k, n, dtype=torch.int64)
    runs = warp_runs(k, cluster, warps)
    for strip, (kt0, kt1) in itertools.product(range(n // 64), runs):
        for kt, lane in itertools.product(range(kt0, kt1), range(32)):
            g, t = lane >> 2, lane & 3
            base = (strip * k16 * row_vecs + lane + kt * row_vecs) * 4  # wbase + kt * kRowVecs, in words
            wv = [int(words[base + 4 * 32 * v + i]) for v in range(bits // 4) for i in range(4)]  # + 32 * v vectors
            grp = kt // gb if gb > 0 else 0
            for e in range(8):  # n8 block e of the strip: feature 8e + g (= 16j + g or 16j + 8 + g)
                f = strip * 64 + 8 * e + g
                if bits == 4:  # dequant4: word j = e >> 1; low nibbles -> block 2j, high -> 2j + 1
                    w, h = wv[e >> 1], e & 1
                    nib = {(0, 0): 0, (0, 1): 4, (1, 0): 2, (1, 1): 6}  # (b1?, k odd?) -> nibble, block 2j
                    vals = {kk: (w >> (4 * (nib[kk] + h))) & 0xF for kk in nib}
                else:  # dequant8: word e, bytes (0, 2) = b0 (k 2t, 2t+1), (1, 3) = b1 (k 2t+8, 2t+9)
                    w = wv[e]
                    vals = {(0, 0): w & 0xFF, (0, 1): (w >> 16) & 0xFF, (1, 0): (w >> 8) & 0xFF, (1, 1): w >> 24}
                if zw is not None:  # zbase + grp * zrow: nibble e of word g (4-bit), byte e % 4 of word 2g + e // 4
                    zrow = n * bits // 32
                    zi = grp * zrow + strip * 2 * bits + (g if bits == 4 else 2 * g + (e >> 2))
                    zv = (int(zw[zi]) >> (4 * e if bits == 4 else 8 * (e & 3))) & ((1 << bits) - 1)
                else:
                    zv = 1 << (bits - 1)
                # scale: grouped, half e of the vector at sbase + grp * N (sbase = strip*64 + 8g); per channel: s[col]
                sc = float(sp[grp * n + strip * 64 + 8 * g + e]) if gb > 0 else float(s[0, f])
                for (hi, odd), v in vals.items():
                    kk = 16 * kt + 2 * t + odd + 8 * hi
                    got_q[kk, f] = v - zv
                    got_s[kk, f] = sc
                    seen[kk, f] += 1
    return got_q, got_s, seen


CASES = [(4, 128, False, 16, 2, 512), (4, -1, False, 16, 1, 272), (4, 32, True, 8, 2, 256),
         (8, 64, False, 4, 1, 384), (8, 128, True, 16, 4, 1152)]


@pytest.mark.parametrize("bits,group,zp,warps,cluster,k", CASES)
def test_strip_kernel_reads_what_the_packer_wrote(bits, group, zp, warps, cluster, k):
    n = 128
    gen = torch.Generator().manual_seed(bits * 1000 + k)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    groups = 1 if group == -1 else k // group
    s = torch.rand(groups, n, generator=gen).to(torch.float16) + 0.5
    z = torch.randint(0, 1 << bits, (groups, n), generator=gen, dtype=torch.int32) if zp else None
    got_q, got_s, seen = mirror(q, s, z, bits, group, warps, cluster)
    assert bool((seen == 1).all()), "every (k, n) read exactly once across the warps' runs and strips"
    zfull = (z if z is not None else torch.full((groups, n), 1 << (bits - 1))).repeat_interleave(k // groups, 0)
    assert torch.equal(got_q, q.to(torch.int64) - zfull.to(torch.int64))
    assert torch.equal(got_s, s.float().repeat_interleave(k // groups, 0))


def test_warp_runs_cover_k_evenly():
    for k, c, w in ((4096, 2, 16), (1152, 1, 16), (272, 1, 16), (8192, 4, 8), (14336, 2, 16), (64, 4, 16)):
        runs = warp_runs(k, c, w)
        assert runs[0][0] == 0 and runs[-1][1] == k // 16
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        sizes = [r[1] - r[0] for r in runs]
        assert max(sizes) - min(sizes) <= 1


def test_strip_configs_fit_the_kernel_limits():
    """jm_strip.cuh's static_asserts: 1..16 warps, clusters of 1 / 2 / 4, one to four token blocks (three or four with
    at most 8 warps); the depth holds the same weight bytes per lane for 4- and 8-bit (4-bit 8 / 6 / 4 rows, 8-bit 4 /
    3 / 2)."""
    for w, c, t, sm in K.STRIP_CONFIGS + K.STRIP_MOE_CONFIGS:
        assert 1 <= w <= 16 and c in (1, 2, 4) and 1 <= t <= 4 and (t <= 2 or w <= 8) and sm in (0, 1)
        for bits, perm in itertools.product((4, 8), (False, True)):
            # the shared-memory ring: a multiple of the activations' ring, room for 2 KB of sums
            rows = K.strip_ring_rows(bits, sm, t, perm)
            assert not sm or (rows % K.strip_depth(bits, t, sm) == 0 and rows * bits // 4 * 512 >= 2048)
            fam = K.Family("f16", bits, False, 128)  # + static shared memory < 227 KB
            assert K.strip_smem_bytes(fam, w, sm, perm, 14336, c, t) <= 192 * 1024, (w, c, t, sm, bits, perm)
    for t in (1, 2, 3, 4):
        assert K.strip_depth(4, t) * 16 == K.strip_depth(8, t) * 32


def test_strip_pick_reads_probe_logs(tmp_path, capsys, monkeypatch):
    """benchmarks/strip_pick.py (stages s50a / s52a): means over rounds, drops wrong results, ratios to the old route
    (routeS0 where the log has it)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "strip_pick.py"
    spec = importlib.util.spec_from_file_location("strip_pick", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    log = tmp_path / "s.log"
    log.write_text("\n".join([
        "[default] f16 u4 8192x8192 M=1 route: 14.0 us (floor 8.2) err 2.1e-04",
        "[default] f16 u4 8192x8192 M=1 route: 16.0 us (floor 8.2) err 2.1e-04",
        "[default] f16 u4 8192x8192 M=1 routeS: 10.0 us (floor 8.2) err 2.1e-04",
        "[default] f16 u4 8192x8192 M=1 strip-w16-c1: 10.0 us (floor 8.2) err 2.1e-04",
        "[default] f16 u4 8192x8192 M=1 strip-w8-c1: 5.0 us (floor 8.2) err 1.4e+00",  # wrong: dropped
        "[default] f16 u4 8192x8192 M=1 strip-w4-c1: failed: [...]",
        # stage s52a: routeS0 (the route without the strip kernel's small-shape region) is the old route's time
        "[default] f16 u4 4096x4096 M=1 routeS0: 8.0 us (floor 2.1) err 2.1e-04",
        "[default] f16 u4 4096x4096 M=1 route: 6.0 us (floor 2.1) err 2.1e-04",
        "[default] f16 u4 4096x4096 M=1 routeS: 6.0 us (floor 2.1) err 2.1e-04",
    ]) + "\n")
    cells = mod.read(str(log), 1e-2)
    assert cells == {("f16", "u4", "8192x8192", 1): {"route": 15.0, "routeS": 10.0, "strip-w16-c1": 10.0},
                     ("f16", "u4", "4096x4096", 1): {"routeS0": 8.0, "route": 6.0, "routeS": 6.0}}
    monkeypatch.setattr("sys.argv", ["strip_pick.py", str(log)])
    mod.main()
    out = capsys.readouterr().out
    assert "| 8192x8192 | 1 | 15.0 | — | — | 10.0 | 0.67 | strip-w16-c1 | 10.0 | 0.67 |" in out
    assert "| 4096x4096 | 1 | 8.0 | 6.0 | 0.75 | 6.0 | 0.75 | — | — | — |" in out
    assert "routeS / old route: geometric mean 0.707 over 2 cells" in out
    assert "route / old route: geometric mean 0.750 over 1 cells" in out
