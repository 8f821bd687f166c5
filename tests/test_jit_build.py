"""The build protocol of jitmarlin.jit.build.get_module with a fake compile step (no nvcc):
build once, load from the cache, failed builds, JITMARLIN_DISABLE_JIT, permission checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jitmarlin.errors import BuildError, CacheMissError, CachePermissionError, ToolchainError
from jitmarlin.jit import build, cache
from jitmarlin.jit.build import _BuildFailed, get_module
from jitmarlin.ops import _kernels as K

pytestmark = pytest.mark.usefixtures("jm_cache")


def no_toolkit(monkeypatch):
    def missing():
        raise ToolchainError("no CUDA toolkit here (test)")

    monkeypatch.setattr(build, "find_cuda", missing)


def refuse_compile(spec, out_dir, tc):
    raise AssertionError("compile step called although the module is cached")


# ---------------------------------------------------------------- build once, then load


def test_builds_once_then_memo_then_disk(fake_compile, spec_factory):
    spec = spec_factory()
    first = get_module(spec, compile_fn=fake_compile)
    assert len(fake_compile.calls) == 1
    assert (first.path / "meta.json").is_file()
    assert first.cubin("k0_t").read_bytes().startswith(b"FAKE-CUBIN k0_t")

    assert get_module(spec, compile_fn=refuse_compile) is first  # in-process memo

    build._memo.clear()
    again = get_module(spec, compile_fn=refuse_compile)  # from disk
    assert again is not first and again.path == first.path and again.meta == first.meta


def test_an_equal_spec_object_hits_the_memo(fake_compile, spec_factory):
    a = get_module(spec_factory(), compile_fn=fake_compile)
    assert get_module(spec_factory(), compile_fn=refuse_compile) is a


def test_a_new_process_loads_from_the_cache(fake_compile, spec_factory, subprocess_env):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from conftest import small_spec\n"
        "from jitmarlin.jit.build import get_module\n"
        "def refuse(spec, out, tc):\n"
        "    raise SystemExit('compile step called in the second process')\n"
        "print(get_module(small_spec(), compile_fn=refuse).path)\n")
    tests_dir = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", code, tests_dir], env=subprocess_env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(mod.path)


def test_different_archs_are_different_modules(fake_compile, spec_factory):
    a = get_module(spec_factory(cc=(8, 0)), compile_fn=fake_compile)
    b = get_module(spec_factory(cc=(9, 0)), compile_fn=fake_compile)
    assert a.path.parent.name == "sm_80" and b.path.parent.name == "sm_90"
    assert len(fake_compile.calls) == 2


# ---------------------------------------------------------------- failures


def test_failed_compile_leaves_no_module_and_keeps_the_log(jm_cache, fake_compile, spec_factory):
    spec = spec_factory()
    log = "\n".join(f"log line {i}" for i in range(100)) + "\nk0_t.cu(3): error: identifier \"boom\" is undefined"

    def failing(spec, out_dir, tc):
        (out_dir / "k0_t.cu").write_text("junk")  # partial output that must not survive
        raise _BuildFailed("nvcc -cubin -o k0_t.cubin k0_t.cu", log)

    with pytest.raises(BuildError) as ei:
        get_module(spec, compile_fn=failing)
    msg = str(ei.value)
    assert "command: nvcc -cubin -o k0_t.cubin k0_t.cu" in msg
    assert 'error: identifier "boom" is undefined' in msg and "log line 99" in msg
    assert "log line 10\n" not in msg  # only the tail
    assert "sm_80" in msg

    adir = cache.arch_dir("sm_80", jm_cache)
    logs = list((adir / "logs").iterdir())
    assert len(logs) == 1 and logs[0].read_text() == log
    assert str(logs[0]) in msg
    assert sorted(p.name for p in adir.iterdir() if p.is_dir()) == ["logs"]  # no module, no staging
    assert cache.list_modules() == []
    assert build._memo == {}

    # the next attempt builds normally
    ok = get_module(spec, compile_fn=fake_compile)
    assert ok.cubin("k0_t").read_bytes().startswith(b"FAKE-CUBIN") and len(fake_compile.calls) == 1


def test_other_exceptions_in_the_compile_step_clean_up(jm_cache, spec_factory):
    def crashing(spec, out_dir, tc):
        (out_dir / "partial.cubin").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        get_module(spec_factory(), compile_fn=crashing)
    adir = cache.arch_dir("sm_80", jm_cache)
    assert [p for p in adir.iterdir() if p.is_dir()] == []


def test_unreadable_meta_is_a_clear_error(fake_compile, spec_factory):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)
    (mod.path / "meta.json").write_text("{broken")
    build._memo.clear()
    with pytest.raises(BuildError, match="unreadable meta.json.*jitmarlin cache clear"):
        get_module(spec, compile_fn=refuse_compile)


def test_a_leftover_module_dir_without_meta_is_rebuilt(jm_cache, fake_compile, spec_factory):
    spec = spec_factory()
    mdir = cache.arch_dir("sm_80", jm_cache) / spec.module_name("fake")
    mdir.mkdir(parents=True)
    (mdir / "k0_t.cubin").write_bytes(b"stale half-deleted module")
    mod = get_module(spec, compile_fn=fake_compile)
    assert mod.path == mdir and len(fake_compile.calls) == 1
    assert mod.cubin("k0_t").read_bytes().startswith(b"FAKE-CUBIN")


# ---------------------------------------------------------------- JITMARLIN_DISABLE_JIT, no toolkit


def test_disable_jit_cache_miss(monkeypatch, fake_compile, spec_factory):
    monkeypatch.setenv("JITMARLIN_DISABLE_JIT", "1")
    with pytest.raises(CacheMissError) as ei:
        get_module(spec_factory(), compile_fn=fake_compile)
    msg = str(ei.value)
    assert "JITMARLIN_DISABLE_JIT" in msg and "sm_80" in msg and "case=t" in msg
    assert "jitmarlin build --arch 8.0 --case t" in msg
    assert fake_compile.calls == []


def test_disable_jit_still_loads_cached_modules(monkeypatch, fake_compile, spec_factory):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)
    build._memo.clear()
    monkeypatch.setenv("JITMARLIN_DISABLE_JIT", "1")
    assert get_module(spec, compile_fn=refuse_compile).path == mod.path


def test_disable_jit_zero_means_enabled(monkeypatch, fake_compile, spec_factory):
    monkeypatch.setenv("JITMARLIN_DISABLE_JIT", "0")
    get_module(spec_factory(), compile_fn=fake_compile)
    assert len(fake_compile.calls) == 1


def test_real_spec_cache_miss_hint_without_toolkit(monkeypatch):
    no_toolkit(monkeypatch)
    monkeypatch.setenv("JITMARLIN_DISABLE_JIT", "1")
    fam = K.Family("bf16", 8, True, 64)
    with pytest.raises(CacheMissError) as ei:
        get_module(K.build_spec(fam, (9, 0)))
    assert "jitmarlin build --arch 9.0 --dtype bf16 --bits 8 --group-size 64 --zero-points" in str(ei.value)


def test_no_toolkit_and_cache_miss_raises_the_toolchain_error(monkeypatch, spec_factory):
    no_toolkit(monkeypatch)
    with pytest.raises(ToolchainError, match="no CUDA toolkit here"):
        get_module(spec_factory())


def test_no_toolkit_loads_a_prebuilt_module_by_source_hash(monkeypatch, fake_compile, spec_factory):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)  # "prebuilt elsewhere"
    build._memo.clear()
    no_toolkit(monkeypatch)
    assert get_module(spec).path == mod.path


def test_no_toolkit_ignores_a_killed_builds_staging_dir(jm_cache, monkeypatch, spec_factory):
    spec = spec_factory()
    adir = cache.arch_dir("sm_80", jm_cache)
    staging = adir / (spec.module_name("13.0.88") + ".staging-x1y2")
    staging.mkdir(parents=True)
    (staging / "meta.json").write_text(json.dumps({"family": "gemm", "source_hash": spec.source_hash()}))
    no_toolkit(monkeypatch)
    with pytest.raises(ToolchainError):
        get_module(spec)


# ---------------------------------------------------------------- permissions


def test_group_writable_module_dir_is_refused(fake_compile, spec_factory):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)
    mod.path.chmod(0o770)
    build._memo.clear()
    with pytest.raises(CachePermissionError) as ei:
        get_module(spec, compile_fn=refuse_compile)
    msg = str(ei.value)
    assert str(mod.path) in msg and "drwxrwx---" in msg and "chmod go-w" in msg
    mod.path.chmod(0o700)
    assert get_module(spec, compile_fn=refuse_compile).path == mod.path


def test_module_owned_by_another_user_is_refused(monkeypatch, fake_compile, spec_factory):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)
    build._memo.clear()
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 4242)
    with pytest.raises(CachePermissionError) as ei:
        get_module(spec, compile_fn=refuse_compile)
    msg = str(ei.value)
    assert f"owned by uid {me}" in msg and f"(uid {me + 4242})" in msg and "JITMARLIN_CACHE_DIR" in msg


# ---------------------------------------------------------------- helpers of the real compile step


def test_nvcc_command():
    from jitmarlin.jit.spec import source_dir
    from jitmarlin.jit.toolchain import CudaToolchain

    tc = CudaToolchain(home=Path("/opt/cuda"), nvcc=Path("/opt/cuda/bin/nvcc"), version=(13, 0),
                       version_full="13.0.88", found_by="test")
    spec = K.build_spec(K.Family("f16", 4, False, 128), (9, 0), K.TILES[:1])
    cmd = build.nvcc_command(spec, tc, stem="k")
    assert cmd[0] == "/opt/cuda/bin/nvcc"
    assert "-gencode=arch=compute_90,code=sm_90" in cmd and "-cubin" in cmd
    assert f"-I{source_dir()}" in cmd
    assert cmd[-3:] == ["-o", "k.cubin", "k.cu"]
    assert build.nvcc_command(spec, tc)[-3:] == ["-o", "$out", "$in"]  # the ninja rule


PTXAS_LOG = """\
[1/2] nvcc k_a.cubin
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_a' for 'sm_80'
ptxas info    : Function properties for k_a
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 448 bytes cmem[0]
[2/2] nvcc k_b.cubin
ptxas info    : Compiling entry function 'k_b' for 'sm_80'
ptxas info    : Function properties for k_b
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 448 bytes cmem[0]
"""


def test_parse_ptxas():
    assert build.parse_ptxas(PTXAS_LOG) == {
        "k_a": {"stack": 0, "spill_stores": 0, "spill_loads": 0, "registers": 96},
        "k_b": {"stack": 24, "spill_stores": 8, "spill_loads": 12, "registers": 255},
    }
    assert build.parse_ptxas("no ptxas output") == {}


def test_build_jobs(monkeypatch):
    assert build.build_jobs() == max(1, os.cpu_count() or 1)
    monkeypatch.setenv("MAX_JOBS", "3")
    assert build.build_jobs() == 3
    monkeypatch.setenv("JITMARLIN_BUILD_JOBS", "5")
    assert build.build_jobs() == 5  # ours wins over MAX_JOBS
    monkeypatch.setenv("JITMARLIN_BUILD_JOBS", "0")
    assert build.build_jobs() == 1
    monkeypatch.setenv("JITMARLIN_BUILD_JOBS", "many")
    with pytest.raises(ValueError, match="JITMARLIN_BUILD_JOBS='many' is not an integer"):
        build.build_jobs()
    monkeypatch.delenv("JITMARLIN_BUILD_JOBS")
    monkeypatch.setenv("MAX_JOBS", "x2")
    with pytest.raises(ValueError, match="MAX_JOBS='x2' is not an integer"):
        build.build_jobs()
