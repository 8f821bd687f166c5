"""Real compiles with nvcc and ninja (no GPU needed): a small GEMM family for sm_80 and sm_90.

Kept to 2 tile configs x 2 architectures so it takes seconds. Checks the cubins, the ptxas
report in meta.json (no spills, no stack: a spill in the GEMM main loop costs a lot of speed),
loading back from the cache, and a compile error surfacing as BuildError.
"""

from __future__ import annotations

import re

import pytest

from jitmarlin.errors import BuildError
from jitmarlin.jit import build, cache
from jitmarlin.jit.build import get_module
from jitmarlin.jit.spec import BuildSpec
from jitmarlin.ops import _kernels as K

pytestmark = pytest.mark.nvcc

FAMILY = K.Family("f16", 4, False, 128)
TILES = K.TILES[:2]


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_small_family_compiles_without_spills(cuda_toolchain, cc):
    spec = K.build_spec(FAMILY, cc, TILES)
    mod = get_module(spec)
    assert mod.path.name == spec.module_name(cuda_toolchain.version_full)
    assert mod.meta["nvcc_version"] == cuda_toolchain.version_full
    assert mod.meta["arch"] == f"sm_{cc[0]}{cc[1]}"
    names = [stem for stem, _ in spec.sources]  # the tile kernels and any helper kernels of the family
    assert {K.kernel_name(FAMILY, t) for t in TILES} <= set(names)
    assert mod.meta["kernels"] == names
    for name in names:
        data = mod.cubin(name).read_bytes()
        assert data[:4] == b"\x7fELF", f"{name}.cubin is not an ELF image"
        assert name.encode() in data  # extern "C": the kernel's plain name is its symbol
        info = mod.meta["ptxas"][name]
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (name, info)
        assert info["stack"] == 0, (name, info)
        assert 0 < info["registers"] <= 255, (name, info)
    assert mod.meta["compile_seconds"] > 0 and mod.meta["jobs"] >= 1

    # a later process (memo cleared) loads it without compiling
    build._memo.clear()
    again = get_module(spec, compile_fn=None)
    assert again.path == mod.path and again.meta["built_at"] == mod.meta["built_at"]
    assert [m.path for m in cache.list_modules()] == [mod.path]


def test_compile_error_is_a_build_error_with_command_and_log(cuda_toolchain, jm_cache):
    spec = BuildSpec(family="gemm", cc=(8, 0), key=(("case", "broken"),),
                     sources=(("broken_kernel", '#include "jm_common.cuh"\n'
                                                'extern "C" __global__ void broken_kernel() { undefined_thing(); }\n'),))
    with pytest.raises(BuildError) as ei:
        get_module(spec)
    msg = str(ei.value)
    assert str(cuda_toolchain.nvcc) in msg and "broken_kernel.cu" in msg  # the command
    assert "undefined_thing" in msg  # nvcc's message, from the log tail
    adir = cache.arch_dir("sm_80", jm_cache)
    assert [p.name for p in adir.iterdir() if p.is_dir()] == ["logs"]
    (log,) = (adir / "logs").iterdir()
    assert "undefined_thing" in log.read_text()


def test_wgmma_family_compiles_for_sm90a_without_spills(cuda_toolchain):
    """The sm_90a wgmma kernels compile for the arch-specific target without spills, but for the routed
    two-compute-warpgroup kernels of two strips (128 tokens, session 39; 144 / 160, sessions 41-42): a few
    bytes in the stream-K epilogue, after the main loop, bounded here so that growth shows."""
    for fam in (K.Family("bf16", 4, True, 64), K.Family("f16", 8, True, 32, moe=True)):
        spec = K.wgmma_build_spec(fam, (9, 0))
        assert spec.arch_specific
        mod = get_module(spec)
        assert fam.moe or [n for n, _ in spec.sources if n.endswith("_n128_f2_s4_prod2")]
        for name, _ in spec.sources:
            assert mod.cubin(name).read_bytes()[:4] == b"\x7fELF"
            info = mod.meta["ptxas"][name]
            # two-strip two-compute-warpgroup kernels: 2 x NT / 2 sums per thread in the stream-K epilogue
            # (the tall tiles of 144 / 160 tokens a little more; the one-strip ones none)
            spills = {"_n128_f2_s4_prod2": 32, "_n144_f2_s4_prod2": 48, "_n160_f2_s4_prod2": 48}.get(
                name[name.index("_n"):] if "_prod2" in name else "", 0)
            assert info["spill_stores"] <= spills and info["spill_loads"] <= spills, (name, info)
            assert info["stack"] <= spills, (name, info)
    with pytest.raises(ValueError, match="sm_90a only"):
        K.wgmma_build_spec(FAMILY, (8, 0))


def test_wgmma_producer_form_compiles_without_spills(cuda_toolchain, monkeypatch):
    """The producer form (K.WGMMA_PROD_CONFIGS, and K.WGMMA_PROD_CONFIGS_U4 for 4-bit weights: a producer
    warpgroup + one compute warpgroup of two or four strips, setmaxnreg; two CTAs per SM, or three:
    K.WGMMA_PROD_CTAS / K.WGMMA_PROD_CTAS_U4) of the 16- to 64-token configs compiles for sm_90a without spills,
    with its register reallocation kept and its wgmma not serialized (ptxas C7507 / C751x; 8-bit
    with zero points: the largest dequantization)."""
    monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS", ((16, 1, 8), (32, 1, 6), (64, 1, 6), (32, 2, 6)))
    monkeypatch.setattr(K, "WGMMA_PROD_CTAS", {(32, 1, 6): 3})
    monkeypatch.setattr(K, "WGMMA_PROD2_CONFIGS", ())  # (its two-compute-warpgroup form: the test below)
    K.wgmma_build_spec.cache_clear()
    try:
        for fam in (K.Family("bf16", 8, True, 64), K.Family("f16", 4, False, 128)):
            spec = K.wgmma_build_spec(fam, (9, 0))
            prod = [(name, src) for name, src in spec.sources if "_prod" in name]
            # 4-bit families add K.WGMMA_PROD_CONFIGS_U4: (16, 1, 7) at three CTAs per SM (session 38)
            assert [name.split("_", 5)[-1] for name, _ in prod] == ["n16_f1_s8_prod", "n32_f1_s6_prod_c3",
                                                                   "n64_f1_s6_prod", "n32_f2_s6_prod"] + (
                ["n16_f1_s7_prod_c3"] if fam.bits == 4 else [])
            # (..., NT, strips on the compute warpgroup, STAGES, compute warpgroups, CTAs per SM)
            assert "JM_WGMMA_KERNEL_PROD(" in prod[2][1] and prod[2][1].rstrip().endswith(", 64, 2, 6, 1, 2)")
            assert prod[3][1].rstrip().endswith(", 32, 4, 6, 1, 2)")
            assert prod[1][1].rstrip().endswith(", 32, 2, 6, 1, 3)")  # three CTAs per SM
            mod = get_module(spec)
            for name, _ in prod:
                info = mod.meta["ptxas"][name]
                assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, (name, info)
            log = (mod.path / "build.log").read_text()
            for code in ("C7507", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515"):
                assert code not in log, [line for line in log.splitlines() if code in line]
    finally:
        K.wgmma_build_spec.cache_clear()
    for bad in ((32, 3, 8), (32, 1, 8, False), (64, 2, 8)):
        monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS", (bad,))
        with pytest.raises(ValueError, match="expected \\(NT, FW, STAGES\\) with FW 1 or 2"):
            K.wgmma_build_spec(K.Family("f16", 4, False, 128), (9, 0))
        K.wgmma_build_spec.cache_clear()
    for bad, ctas in (((64, 1, 6), 3), ((32, 2, 6), 3), ((32, 1, 6), 5), ((64, 1, 6), 4)):
        monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS", (bad,))
        monkeypatch.setattr(K, "WGMMA_PROD_CTAS", {bad: ctas})
        with pytest.raises(ValueError, match="CTAs per SM; 2, or 3 / 4 with FW 1 and NT <= 32"):
            K.wgmma_build_spec(K.Family("f16", 4, False, 128), (9, 0))
        K.wgmma_build_spec.cache_clear()


def test_wgmma_two_warpgroup_producer_form_compiles(cuda_toolchain, monkeypatch):
    """The producer form with two compute warpgroups (K.WGMMA_PROD2_CONFIGS; session 38, routed since 39): dense
    families only, named _prod2, JM_WGMMA_KERNEL_PROD with WGS = 2 and one CTA per SM; it compiles for sm_90a
    with its register reallocation kept and its wgmma not serialized. The 128-token config spills 28 bytes
    (stream-K's epilogue addresses, after the main loop; none without stream-K at 128 tokens): bounded here so
    that growth shows."""
    monkeypatch.setattr(K, "WGMMA_CONFIGS", ((16, 1, 8),))
    monkeypatch.setattr(K, "WGMMA_WIDE_CONFIGS", ())
    monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS", ())
    monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS_U4", ())
    monkeypatch.setattr(K, "WGMMA_PROD2_CONFIGS", ((128, 2, 4), (64, 2, 6)))
    K.wgmma_build_spec.cache_clear()
    try:
        assert not [n for n, _ in K.wgmma_build_spec(K.Family("f16", 4, False, 128, moe=True), (9, 0)).sources
                    if "prod2" in n]
        spec = K.wgmma_build_spec(K.Family("f16", 4, False, 128), (9, 0))
        prod2 = [(name, src) for name, src in spec.sources if name.endswith("_prod2")]
        assert [name.split("_", 5)[-1] for name, _ in prod2] == ["n128_f2_s4_prod2", "n64_f2_s6_prod2"]
        assert prod2[0][1].rstrip().endswith(", 128, 2, 4, 2, 1)")  # NT, FW per warpgroup, STAGES, WGS, MINB
        mod = get_module(spec)
        for name, _ in prod2:
            info = mod.meta["ptxas"][name]
            assert info["spill_stores"] <= (32 if "_n128_" in name else 0), (name, info)
        log = (mod.path / "build.log").read_text()
        for code in ("C7507", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515"):
            assert code not in log, [line for line in log.splitlines() if code in line]
    finally:
        K.wgmma_build_spec.cache_clear()


def test_moe_blocks_of_16_producer_form_compiles(cuda_toolchain, monkeypatch):
    """The 4-bit MoE families' producer form for blocks of 16 rows (K.WGMMA_MOE_PROD_CONFIGS_U4, session 34)
    compiles at four CTAs per SM (kernel names end in _c4) without spills, with its register reallocation
    kept and its wgmma not serialized, symmetric and with zero points; 8-bit MoE families do not build it."""
    monkeypatch.setattr(K, "WGMMA_MOE_CONFIGS", ())
    monkeypatch.setattr(K, "WGMMA_MOE_PROD_CONFIGS", ())
    K.wgmma_build_spec.cache_clear()
    try:
        assert K.wgmma_build_spec(K.Family("f16", 8, False, 128, moe=True), (9, 0)).sources == ()
        for fam in (K.Family("f16", 4, False, 128, moe=True), K.Family("bf16", 4, True, 64, moe=True)):
            spec = K.wgmma_build_spec(fam, (9, 0))
            assert [name for name, _ in spec.sources] == [K.wgmma_kernel_name(fam, 16, 1, 6, prod=True)]
            name = spec.sources[0][0]
            assert name.endswith("_moe_n16_f1_s6_prod_c4") and spec.sources[0][1].rstrip().endswith(", 16, 2, 6, 1, 4)")
            mod = get_module(spec)
            info = mod.meta["ptxas"][name]
            assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, (name, info)
            assert info["registers"] <= 64, info  # four CTAs of 256 threads in 64K registers
            log = (mod.path / "build.log").read_text()
            for code in ("C7507", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515"):
                assert code not in log, [line for line in log.splitlines() if code in line]
    finally:
        K.wgmma_build_spec.cache_clear()


def _elf_text(cubin: bytes) -> bytes:
    """The machine code of a cubin: its .text sections' bytes (ELF64, little-endian), without the
    metadata sections that record the build's flags."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab_off, strtab_size = heads[shstrndx][4], heads[shstrndx][5]
    names = cubin[strtab_off:strtab_off + strtab_size]
    text = b""
    for name_off, _, _, _, off, size in heads:
        name = names[name_off:names.index(b"\0", name_off)]
        if name.startswith(b".text"):
            text += name + cubin[off:off + size]
    assert text, "no .text section"
    return text


def test_wgmma_group_scales_on_sums_compile_and_match_the_mirror(cuda_toolchain, monkeypatch):
    """Group scales on the fp32 sums (jm_wgmma.cuh kGacc, session 29 default) on 4-bit plain and
    producer forms of 24 to 64 tokens (dense and MoE, fp16 and bf16, with and without zero points, one to
    four CTAs per SM, two and four strips) and 8-bit dense forms (fp16 and bf16, with and without zero
    points): no spills, wgmma not
    serialized; and exactly the kernels K.wgmma_scales_on_sums names change when -DJM_WG_NO_GACC turns it
    off (their machine code differs; every other kernel's is the same), so the tests that pick
    bit-identity checks by the mirror pick them right."""
    monkeypatch.setattr(K, "WGMMA_CONFIGS", ((32, 1, 8), (64, 1, 6)))
    monkeypatch.setattr(K, "WGMMA_WIDE_CONFIGS", ())
    monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS", ((32, 1, 6), (64, 1, 6), (32, 2, 6)))
    monkeypatch.setattr(K, "WGMMA_PROD_CONFIGS_U4", ())
    monkeypatch.setattr(K, "WGMMA_PROD_CTAS", {(32, 1, 6): 3, (24, 1, 6): 3, (48, 1, 6): 3})
    monkeypatch.setattr(K, "WGMMA_PROD_CTAS_U4", {(24, 1, 6): 4})
    monkeypatch.setattr(K, "WGMMA_PROD_CTAS_MOE_U4", {})
    monkeypatch.setattr(K, "WGMMA_MOE_CONFIGS", ((32, 1, 8),))
    monkeypatch.setattr(K, "WGMMA_MOE_PROD_CONFIGS", ((24, 1, 6), (48, 1, 6)))
    monkeypatch.setattr(K, "WGMMA_MOE_PROD_CONFIGS_U4", ())
    monkeypatch.setattr(K, "WGMMA_PROD2_CONFIGS", ())  # (its spill bound: the two tests above)
    cubins, expect = {}, {}
    fams = (K.Family("f16", 4, False, 128), K.Family("f16", 4, False, 64, moe=True), K.Family("f16", 4, True, 128),
            K.Family("bf16", 4, False, 128), K.Family("f16", 8, False, 128), K.Family("bf16", 8, True, 64))
    for flags in ("", "-DJM_WG_NO_GACC"):
        monkeypatch.setenv("JITMARLIN_NVCC_FLAGS", flags)
        K.wgmma_build_spec.cache_clear()
        try:
            for fam in fams:
                spec = K.wgmma_build_spec(fam, (9, 0))
                mod = get_module(spec)
                for name, _ in spec.sources:
                    cubins[(flags, name)] = _elf_text(mod.cubin(name).read_bytes())
                    info = mod.meta["ptxas"][name]
                    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, \
                        (flags, name, info)
                    if not flags:
                        nt, fw, st = (int(v) for v in re.search(r"_n(\d+)_f(\d)_s(\d+)", name).groups())
                        prod = "_prod" in name
                        ctas = K.prod_ctas((nt, fw, st), fam.bits, fam.moe) if prod else 1
                        expect[name] = K.wgmma_scales_on_sums(fam.bits, fam.group_size, nt, ctas, prod, fam.moe, fw,
                                                              fam.zero_points, fam.dtype)
                log = (mod.path / "build.log").read_text()
                for code in ("C7507", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515"):
                    assert code not in log, (flags, [line for line in log.splitlines() if code in line])
            if flags:
                assert not K.wgmma_scales_on_sums(4, 128, 32), "the mirror must see the flag"
        finally:
            K.wgmma_build_spec.cache_clear()
    # per dense family n32 / n64 plain and producer (n32 at three CTAs; n32 with four strips), MoE n32 plain,
    # n24 producer (four CTAs) and n48 producer at three CTAs (a probe config). fp16 4-bit: all but the dense
    # plain n64, the four strips, the MoE n48 at three CTAs (its registers: spills with the form) and, with zero
    # points (u4, not u4b8), the dense n32 tiles (the plain MoE n32 too: late fold); bf16 4-bit: the dense
    # plain n32 only; fp16 8-bit (two CTAs per SM at most): the plain n32 and the producer n64, not with zero
    # points; bf16 8-bit: none.
    assert len(expect) == 28, sorted(expect)
    assert sorted(n for n, on in expect.items() if on) == sorted(
        [n for n in expect if n.startswith("jm_wgmma_f16_u4") and ("_prod" in n or "_n32" in n) and "_f2_" not in n
         and not ("_u4_" in n and "_n32_" in n) and "_n48_" not in n]
        + ["jm_wgmma_bf16_u4b8_g128_n32_f1_s8"]
        + [n for n in expect if n.startswith("jm_wgmma_f16_u8b128_") and n.endswith(("_n32_f1_s8", "_n64_f1_s6_prod"))]
    ), expect
    for name, on in expect.items():
        assert (cubins[("", name)] != cubins[("-DJM_WG_NO_GACC", name)]) == on, (name, on)


def test_wgmma_smem_formula_matches_the_kernel(cuda_toolchain, tmp_path):
    """wgmma_smem_bytes (the launch's shared memory) equals the kernel's own stage size x stages,
    and K.WGMMA_TMA_MIN_NT the kernel's choice of TMA tiles, checked by static_asserts that nvcc
    evaluates."""
    import subprocess

    lines = ['#include "jm_wgmma.cuh"']
    for bits, zp, group in ((4, False, 128), (4, True, 32), (8, True, 64), (8, False, -1), (4, True, -1)):
        fam = K.Family("f16", bits, zp, group)
        for nt, fw, st in K.WGMMA_CONFIGS:
            want = K.wgmma_smem_bytes(fam, nt, fw, st)
            lines.append(f"static_assert(jm::WgmmaStage<{bits}, {'true' if zp else 'false'}, {fam.group_blocks}, {nt}, "
                         f"{fw}>::kBytes * {st} + 1024 == {want}, \"{bits} {zp} {group} {nt} {fw} {st}\");")
    # and which tiles read a tensor map (gemm.wgmma_act_map encodes one only for those)
    for nt in (16, 32, 64, 128):
        uses = nt >= K.WGMMA_TMA_MIN_NT
        lines.append(f"static_assert(jm::wg_tma({nt}, false) == {'true' if uses else 'false'}, \"tma {nt}\");")
    lines.append("static_assert(!jm::wg_tma(64, true) && !jm::wg_tma(128, true), \"tma moe\");")
    src = tmp_path / "smem_check.cu"
    src.write_text("\n".join(lines) + "\n")
    from jitmarlin.jit.spec import source_dir

    r = subprocess.run([str(cuda_toolchain.nvcc), "-std=c++17", "-arch=sm_90a", "-c", "-I", str(source_dir()), str(src),
                        "-o", str(tmp_path / "smem_check.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("probe", ["stream_probe.cu", "floor_probe.cu"])
def test_plain_cuda_probe_builds(cuda_toolchain, tmp_path, probe):
    """The plain-CUDA device-session probes (benchmarks/stream_probe.cu; floor_probe.cu, session 49's harness floor,
    stage s49c) keep compiling against our PTX wrappers for sm_90a (run_device.sh builds them on the GPU machine)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / probe.removesuffix(".cu")
    r = subprocess.run([str(cuda_toolchain.nvcc), "-std=c++17", "-O3", "-arch=sm_90a", "-I", str(root / "cuda_src"),
                        str(root / "benchmarks" / probe), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.stat().st_size > 0


def test_strip_probe_builds(cuda_toolchain, tmp_path):
    """benchmarks/strip_probe.cu (session 53: the strip kernel timed with its trace, -DJM_STRIP_TRACE; stage s53p
    builds it on the GPU machine, against this header and another jm_strip.cuh put first on the include path) keeps
    compiling for sm_90a."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "strip_probe"
    r = subprocess.run([str(cuda_toolchain.nvcc), "-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr",
                        "-DJM_STRIP_TRACE", "-I", str(root / "cuda_src"), str(root / "benchmarks" / "strip_probe.cu"),
                        "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.stat().st_size > 0


def test_timeline_build_of_a_bulk_tile_compiles(cuda_toolchain, monkeypatch):
    """The diagnostics build (-DJM_TIMELINE, benchmarks/probe_timeline.py) of the routed M=1 tile
    compiles for sm_90 without spills, as its own cached module (the flags are part of the key)."""
    tiles = (K.Tile.from_tag("w8_k128_s6_bk_dr1"),)
    plain = K.build_spec(FAMILY, (9, 0), tiles)
    monkeypatch.setenv("JITMARLIN_NVCC_FLAGS", "-DJM_TIMELINE")
    K.build_spec.cache_clear()
    try:
        spec = K.build_spec(FAMILY, (9, 0), tiles)
        assert spec.flags == ("-DJM_TIMELINE",) and spec.key == plain.key and spec != plain
        mod = get_module(spec)
        name = K.kernel_name(FAMILY, tiles[0])
        info = mod.meta["ptxas"][name]
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, info
    finally:
        K.build_spec.cache_clear()


def test_strip_kernels_compile_without_spills(cuda_toolchain):
    """The strip kernel (cuda_src/jm_strip.cuh) in its three forms — register ring with one and with two token blocks,
    shared-memory ring — and an act-order form compiles for sm_90 within its launch bounds (16 warps per SM: <= 128
    registers), no spills."""
    fam = K.Family("f16", 4, False, 128)
    cfgs = ((16, 2, 1, 0, False), (16, 1, 2, 0, False), (16, 2, 1, 1, False), (16, 2, 1, 0, True))
    sources = tuple((K.strip_kernel_name(fam, *c), K.strip_kernel_source(fam, *c)) for c in cfgs)
    # act-order forms with zero points, the most registers (before session 53 paired the gathered halves at use they
    # spilled 20-24 bytes, 80-84 reloaded), and 8-bit zero points through the shared slot (two jm::pass_on4)
    g32, zp8 = K.Family("f16", 4, True, 32), K.Family("bf16", 8, True, 64)
    sources += tuple((K.strip_kernel_name(f, *c), K.strip_kernel_source(f, *c))
                     for f, c in ((g32, (16, 1, 1, 0, True)), (g32, (4, 1, 1, 0, True)), (zp8, (16, 1, 1, 0, True)),
                                  (zp8, (8, 1, 2, 0, False))))
    spec = BuildSpec(family="strip", cc=(9, 0), key=fam.key() + (("case", "compile-test"),), sources=sources)
    mod = get_module(spec)
    for name, _ in spec.sources:
        info = mod.meta["ptxas"][name]
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, (name, info)
        assert 0 < info["registers"] <= 128, (name, info)


def _sass_tool():
    """benchmarks/sass_waits.py as a module and a cuobjdump to feed it (the test skips without one)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "sass_waits.py"
    spec = importlib.util.spec_from_file_location("sass_waits", path)
    sw = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sass_waits", sw)  # (its dataclasses look their module up)
    spec.loader.exec_module(sw)
    tool = sw.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton's CUDA backend)")
    return sw, tool


def test_strip_register_rings_wait_once_per_batch(cuda_toolchain):
    """The strip kernel's register-ring forms keep a whole batch of rows in flight: in the sm_90a machine code each
    iteration of the main loop (DEPTH k16 rows) waits for the warp's global loads once, read from the instructions'
    scoreboard bits (benchmarks/sass_waits.py); the act-order forms too (their indices from shared memory, their
    gathered halves a batch ahead). Before session 54 every row waited for the loads the row before it had issued:
    with a guard around each row a path skipped the batch's first wait, and a group's scales (an act-order row's
    indices) loaded into registers were waited for with the weights."""
    import subprocess

    sw, tool = _sass_tool()
    g128, chan = K.Family("f16", 4, False, 128), K.Family("f16", 4, False, -1)
    g32zp, u8zp = K.Family("f16", 4, True, 32), K.Family("bf16", 8, True, 64)
    moe = K.Family("f16", 4, False, 128, moe=True)
    # (family, (warps, cluster, token blocks, ring rows, act-order), waits per iteration)
    cases = [(g128, (16, 1, 1, 0, False), 1), (g128, (8, 2, 1, 0, False), 1), (g128, (4, 1, 1, 0, False), 1),
             (g128, (16, 1, 2, 0, False), 1), (chan, (16, 1, 1, 0, False), 1), (g32zp, (16, 1, 1, 0, False), 1),
             (u8zp, (8, 1, 2, 0, False), 1), (moe, (16, 1, 1, 0, False), 1), (g128, (16, 2, 1, 0, True), 1),
             (g32zp, (16, 1, 1, 0, True), 1), (g128, (8, 1, 2, 0, True), 1), (u8zp, (4, 1, 1, 0, True), 1)]
    sources = tuple((K.strip_kernel_name(f, *c), K.strip_kernel_source(f, *c)) for f, c, _ in cases)
    mod = get_module(BuildSpec(family="strip", cc=(9, 0), key=g128.key() + (("case", "waits-test"),), sources=sources))
    for (fam, cfg, want), (name, _) in zip(cases, sources):
        sass = subprocess.run([tool, "-sass", str(mod.cubin(name))], check=True, capture_output=True, text=True).stdout
        (f,) = [f for f in sw.parse(sass) if f.name == name]
        loop = sw.main_loop(f)
        assert loop is not None, name
        body = f.insns[loop[0]:loop[1] + 1]
        depth = K.strip_depth(fam.bits, cfg[2], 0, cfg[4], fam.zero_points)
        assert sum(x.opcode.startswith("HMMA") for x in body) == 4 * cfg[2] * depth, name  # the rows' loop
        drains = sw.loop_drains(f, loop)
        assert len(drains) == want, (name, [(f.insns[d.waiter].text, d.loads, d.dist) for d in drains])
    # the shared-memory-ring forms (session 54: the activations through the ring with the weights): no global load
    # into a register in the main loop but a group's scales (one per group, waited for a group later)
    ring_cases = [(chan, (16, 1, 1, 1)), (g128, (16, 2, 1, 1)), (g32zp, (16, 1, 2, 1)), (u8zp, (8, 1, 3, 1))]
    sources = tuple((K.strip_kernel_name(f, *c), K.strip_kernel_source(f, *c)) for f, c in ring_cases)
    mod = get_module(BuildSpec(family="strip", cc=(9, 0), key=g128.key() + (("case", "ring-waits"),), sources=sources))
    for (fam, cfg), (name, _) in zip(ring_cases, sources):
        sass = subprocess.run([tool, "-sass", str(mod.cubin(name))], check=True, capture_output=True, text=True).stdout
        (f,) = [f for f in sw.parse(sass) if f.name == name]
        loop = sw.main_loop(f)
        body = f.insns[loop[0]:loop[1] + 1]
        rows = K.strip_ring_rows(fam.bits, 1, cfg[2])
        assert sum(x.opcode.startswith("HMMA") for x in body) == 4 * cfg[2] * rows, name
        loads = [x.text for x in body if sw.is_global_load(x)]
        zp_loads = (2 if fam.bits == 8 else 1) if fam.zero_points else 0  # (8-bit: two jm::pass_on4)
        per_row = 1 + zp_loads if fam.group_size > 0 else 0
        assert len(loads) == per_row * rows, (name, loads)  # (each row's group-end block: pass_on16 / pass_on4)
        assert all(d.loads == per_row for d in sw.loop_drains(f, loop)), name


def test_gemm_epilogue_loads_its_bias_together(cuda_toolchain):
    """The mma.sync tiles' epilogue loads the bias of a thread's columns (and in MoE tiles the slots' routing
    weights) ahead of its stores, so the warp waits for them together: session 54 found each loaded inside its
    output's branch and waited for on its own (16-32 round trips per tile end for the routed M = 1 tiles with a
    bias; benchmarks/sass_waits.py). Counted here: waits that let a bias load through shortly after it was issued, per
    code site (a batch spread over a few dependency counters takes one wait each; main's code: 16-32 per tile)."""
    import subprocess

    sw, tool = _sass_tool()
    tiles = tuple(K.Tile.from_tag(t) for t in ("w8_k128_s6_bk_dr1", "w8_k128_s6_bk_ks2_cl8", "w16_k128_s6_bk"))
    spec = K.build_spec(FAMILY, (9, 0), tiles)
    mod = get_module(spec)
    for tile in tiles:
        name = K.kernel_name(FAMILY, tile)
        sass = subprocess.run([tool, "-sass", str(mod.cubin(name))], check=True, capture_output=True, text=True).stdout
        (f,) = [f for f in sw.parse(sass) if f.name == name]
        waits = {(w.setter, w.waiter) for w in sw.replay(f)
                 if not w.read and w.dist < 40 and f.insns[w.setter].opcode.startswith("LDG.E.U16")}
        assert len(waits) <= 8, (name, len(waits))
