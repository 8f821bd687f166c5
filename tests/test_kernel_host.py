"""Host-side checks of the kernel sources, compiled with nvcc on the CPU (no GPU needed):

- the ctypes launch struct matches JmGemmParams field by field, and the driver's ctypes mirrors of
  CUlaunchConfig / CUlaunchAttribute (programmatic dependent launch) match cuda.h;
- the Python shared-memory formula matches GemmShape::stage_bytes for every family x tile;
- the stream-K partition (jm_schedule.cuh, the very functions the kernel calls) covers every
  (unit, k tile) exactly once, gives every split unit a unique fixup slot < grid, and counts
  the CTAs of each unit right.
"""

from __future__ import annotations

import ctypes
import itertools
import random
import subprocess

import pytest

from jitmarlin.errors import ToolchainError
from jitmarlin.jit.spec import source_dir
from jitmarlin.jit.toolchain import find_cuda
from jitmarlin.ops import _kernels as K

pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module")
def nvcc():
    try:
        return find_cuda().nvcc
    except ToolchainError as e:
        pytest.skip(f"nvcc not available: {e}")


def _run_host(nvcc, tmp_path, body: str, stdin: str = "", include: str = "jm_gemm.cuh") -> str:
    src = tmp_path / "host.cu"
    src.write_text(f'#include <cstdio>\n#include <cstddef>\n#include "{include}"\nint main() {{\n' + body +
                   "\nreturn 0;\n}\n")
    exe = tmp_path / "host"
    subprocess.run([str(nvcc), "-std=c++17", "-O1", f"-I{source_dir()}", "-o", str(exe), str(src)],
                   check=True, capture_output=True, text=True)
    return subprocess.run([str(exe)], input=stdin, check=True, capture_output=True, text=True).stdout


def test_params_struct_matches_ctypes(nvcc, tmp_path):
    names = [f[0] for f in K.GemmParams._fields_]
    body = 'printf("size %zu\\n", sizeof(JmGemmParams));\n' + "".join(
        f'printf("{n} %zu\\n", offsetof(JmGemmParams, {n}));\n' for n in names)
    out = dict(line.split() for line in _run_host(nvcc, tmp_path, body).splitlines())
    assert int(out["size"]) == ctypes.sizeof(K.GemmParams)
    for n in names:
        assert int(out[n]) == getattr(K.GemmParams, n).offset, n


def test_launch_config_structs_match_cuda_h(nvcc, tmp_path):
    from jitmarlin.jit import driver

    body = 'printf("%zu %zu %zu %zu %zu %zu\\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value), '
    body += 'sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), '
    body += 'offsetof(CUlaunchConfig, numAttrs));\n'
    body += 'printf("%d\\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n'
    lines = _run_host(nvcc, tmp_path, body, include="cuda.h").splitlines()
    sizes = tuple(map(int, lines[0].split()))
    LA, LC = driver._LaunchAttribute, driver._LaunchConfig
    assert sizes == (ctypes.sizeof(LA), LA.value.offset, ctypes.sizeof(LC), LC.hStream.offset, LC.attrs.offset,
                     LC.numAttrs.offset)
    assert int(lines[1]) == driver._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def test_tensor_map_mirrors_match_cuda_h(nvcc, tmp_path):
    """The wgmma kernel's TMA descriptor: the driver's ctypes TensorMap has CUtensorMap's size, and
    the enum values driver.tensor_map_2d passes are cuda.h's."""
    from jitmarlin.jit import driver

    body = ('printf("%zu %d %d %d %d\\n", sizeof(CUtensorMap), (int)CU_TENSOR_MAP_DATA_TYPE_FLOAT16, '
            '(int)CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (int)CU_TENSOR_MAP_SWIZZLE_128B, (int)CU_TENSOR_MAP_L2_PROMOTION_L2_256B);')
    got = tuple(map(int, _run_host(nvcc, tmp_path, body, include="cuda.h").split()))
    assert got == (ctypes.sizeof(driver.TensorMap), driver.TMAP_F16, driver.TMAP_BF16, driver._TMAP_SWIZZLE_128B,
                   driver._TMAP_L2_256B)
    assert ctypes.sizeof(driver.TensorMap) == 128


def test_smem_formula_matches_kernel(nvcc, tmp_path):
    cases = []
    for bits, zp, g in itertools.product((4, 8), (False, True), (-1, 32, 64, 128, 256)):
        fam = K.Family("f16", bits, zp, g)
        for tile in K.TILES + K.BULK_TILES + (K.Tile.from_tag("w8_k64_s8_bk_dr4"),  # + a direct-load tile
                                               K.Tile.from_tag("w16_k128_s3_bk_o3")):  # + three CTAs per SM
            if K.tile_fits(fam, tile):
                cases.append((fam, tile))
    body = ""
    for fam, t in cases:
        shape = (f"jm::GemmShape<{fam.bits}, {'true' if fam.zero_points else 'false'}, {fam.group_blocks}, "
                 f"{t.m_blocks}, {'true' if t.swap else 'false'}, {t.k_blocks}, {'true' if t.bulk else 'false'}, "
                 f"{'true' if t.direct else 'false'}>")
        body += (f'printf("%d %d %d %d %d\\n", {shape}::stage_bytes(1), {shape}::stage_bytes(4), '
                 f'{shape}::stage_bytes(8), {shape}::kAcc, {shape}::reduce_bytes(4, {t.ksplit}));\n')
    lines = _run_host(nvcc, tmp_path, body).splitlines()
    assert len(lines) == len(cases)
    for (fam, t), line in zip(cases, lines):
        s1, s4, s8, acc, red = map(int, line.split())
        assert (s1, s4, s8) == tuple(K.stage_bytes(fam, t, w) for w in (1, 4, 8)), (fam, t)
        assert acc == t.acc
        assert red == K.reduce_bytes(t, 4)


def test_schedule_partition(nvcc, tmp_path):
    rng = random.Random(0)
    cases = [(1, 1, 1, 1), (1, 1, 2, 2), (3, 3, 3, 5), (448, 1, 64, 264), (56, 65, 128, 132), (7, 2, 5, 1000)]
    cases += [(rng.randint(1, 60), rng.randint(1, 9), rng.randint(1, 70), rng.randint(1, 400)) for _ in range(300)]
    body = r"""
    int nt, mt, kt, grid;
    while (scanf("%d %d %d %d", &nt, &mt, &kt, &grid) == 4) {
      jm::Schedule s = jm::make_schedule(nt, mt, kt, grid);
      printf("%d %d", s.total, s.iters);
      for (int u = 0; u < s.units; u++) printf(" %d %d", jm::unit_slot(s, u), jm::unit_ctas(s, u));
      printf("\n");
    }"""
    stdin = "".join(f"{a} {b} {c} {d}\n" for a, b, c, d in cases)
    lines = _run_host(nvcc, tmp_path, body, stdin).splitlines()
    assert len(lines) == len(cases)
    for (nt, mt, kt, grid), line in zip(cases, lines):
        vals = list(map(int, line.split()))
        total, iters = vals[0], vals[1]
        units = nt * mt
        assert total == units * kt
        assert iters * grid >= total and (iters - 1) * grid < total  # iters = ceil(total / grid)
        slots, ctas = vals[2::2], vals[3::2]
        assert len(slots) == units
        # simulate the CTA runs the kernel takes: [b*iters, min(total, (b+1)*iters))
        cover = [0] * total
        touching = [set() for _ in range(units)]
        for b in range(grid):
            for it in range(b * iters, min(total, (b + 1) * iters)):
                cover[it] += 1
                touching[it // kt].add(b)
        assert all(c == 1 for c in cover)
        split_slots = []
        for u in range(units):
            assert ctas[u] == len(touching[u])
            assert slots[u] == min(touching[u])  # the CTA that holds tile 0 of the unit
            assert 0 <= slots[u] < grid
            if ctas[u] > 1:
                split_slots.append(slots[u])
        assert len(split_slots) == len(set(split_slots)), "two split units share a fixup slot"


def test_moe_params_struct_matches_ctypes(nvcc, tmp_path):
    names = [f[0] for f in K.MoeParams._fields_]
    body = 'printf("size %zu\\n", sizeof(JmMoeParams));\n' + "".join(
        f'printf("{n} %zu\\n", offsetof(JmMoeParams, {n}));\n' for n in names)
    out = dict(line.split() for line in _run_host(nvcc, tmp_path, body, include="jm_moe_util.cuh").splitlines())
    assert int(out["size"]) == ctypes.sizeof(K.MoeParams)
    for n in names:
        assert int(out[n]) == getattr(K.MoeParams, n).offset, n


@pytest.mark.parametrize("value,off_default,on_default", [(None, False, True), ("1", True, True), ("0", False, False),
                                                         ("yes", False, True), ("", False, True)])
def test_env_flag_defaults(monkeypatch, value, off_default, on_default):
    """Off-by-default switches turn on only with "1"; on-by-default ones (JITMARLIN_MOE_KERNELS) off only with "0"."""
    from jitmarlin.ops import moe as M

    if value is None:
        monkeypatch.delenv("JM_TEST_FLAG", raising=False)
        monkeypatch.delenv("JITMARLIN_MOE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("JM_TEST_FLAG", value)
        monkeypatch.setenv("JITMARLIN_MOE_KERNELS", value)
    K.env_flag.cache_clear()
    try:
        assert K.env_flag("JM_TEST_FLAG") is off_default
        assert K.env_flag("JM_TEST_FLAG", default=True) is on_default
        assert M.use_moe_kernels() is on_default
    finally:
        K.env_flag.cache_clear()
