"""The `jitmarlin` command line: info, cache list/clear/path, build, demo, and its error format.

Most cases call jitmarlin.cli.main in-process; a few run `python -m jitmarlin` in a child to
check the real entry point, the exit codes and the absence of tracebacks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from jitmarlin import __version__, cli
from jitmarlin.jit import build, cache
from jitmarlin.jit.build import get_module
from jitmarlin.ops import _kernels as K

pytestmark = pytest.mark.usefixtures("jm_cache")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_module(env: dict, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitmarlin", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(Path(__file__).resolve().parent.parent))


def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def fake_gpus(monkeypatch, *gpus: tuple[str, tuple[int, int]]):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: gpus[i][1])


# ---------------------------------------------------------------- info


def test_info_via_python_m(subprocess_env, jm_cache):
    r = run_module(subprocess_env, "info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "jitmarlin:" in out and __version__ in out
    assert f"torch:          {torch.__version__}" in out
    assert "python:" in out and sys.version.split()[0] in out
    assert f"cache:          {jm_cache} (chosen by $JITMARLIN_CACHE_DIR)" in out
    assert "cached modules: 0 for" in out
    assert "ninja:" in out and "nvcc:" in out
    if not torch.cuda.is_available():
        assert "no CUDA device" in out
    assert "Traceback" not in r.stderr


def test_info_without_gpu_and_without_nvcc(capsys, monkeypatch, tmp_path):
    no_gpu(monkeypatch)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    rc, out, err = run_cli(capsys, "info")
    assert rc == 0
    assert "GPUs:" in out and "no CUDA device" in out
    assert f"nvcc:           not found: CUDA_HOME={tmp_path / 'nowhere'} is not a CUDA toolkit" in out


def test_info_lists_gpus_and_flags_old_ones(capsys, monkeypatch):
    fake_gpus(monkeypatch, ("NVIDIA H200", (9, 0)), ("Tesla T4", (7, 5)))
    rc, out, _ = run_cli(capsys, "info")
    assert rc == 0
    assert "cuda:0:" in out and "NVIDIA H200, compute capability 9.0 (sm_90)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("cuda:1:"))
    assert "Tesla T4" in line and "7.5" in line and "UNSUPPORTED" in line


def test_info_shows_the_toolchain(capsys, cuda_toolchain):
    rc, out, _ = run_cli(capsys, "info")
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("nvcc:"))
    assert str(cuda_toolchain.nvcc) in line and cuda_toolchain.version_full in line
    assert f"found by: {cuda_toolchain.found_by}" in line


def test_info_counts_cached_modules(capsys, fake_compile, spec_factory):
    get_module(spec_factory(cc=(8, 0)), compile_fn=fake_compile)
    get_module(spec_factory(cc=(9, 0)), compile_fn=fake_compile)
    rc, out, _ = run_cli(capsys, "info")
    assert rc == 0 and "cached modules: 2 for" in out and "(2 for all versions)" in out


# ---------------------------------------------------------------- cache


def test_cache_path_prints_only_the_root(capsys, jm_cache):
    rc, out, err = run_cli(capsys, "cache", "path")
    assert (rc, out, err) == (0, f"{jm_cache}\n", "")


def test_cache_path_default(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("JITMARLIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert run_cli(capsys, "cache", "path")[1] == f"{tmp_path / 'xdg' / 'jitmarlin'}\n"


def test_cache_list_empty(capsys, jm_cache):
    rc, out, _ = run_cli(capsys, "cache", "list")
    assert rc == 0 and out.startswith("no cached modules in ")


def _two_modules_and_an_old_one(jm_cache, fake_compile, spec_factory):
    a = get_module(spec_factory(cc=(8, 0), tag="a"), compile_fn=fake_compile)
    b = get_module(spec_factory(cc=(9, 0), tag="b"), compile_fn=fake_compile)
    old = jm_cache / "0.0.1" / "torch2.4.0-cu12.1" / "sm_86" / "gemm_old_0011223344556677"
    old.mkdir(parents=True)
    (old / "meta.json").write_text(json.dumps({"family": "gemm", "key": [["dtype", "bf16"]], "built_at": 0}))
    return a, b, old


def test_cache_list_table(capsys, jm_cache, fake_compile, spec_factory):
    a, b, old = _two_modules_and_an_old_one(jm_cache, fake_compile, spec_factory)
    rc, out, _ = run_cli(capsys, "cache", "list")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["arch", "family", "key", "size", "built", "path"]
    assert len(lines) == 4 and lines[-1].startswith("2 module(s), ")
    row_a = lines[1]
    assert row_a.startswith("sm_80") and " gemm " in row_a and "dtype=f16 case=a" in row_a
    assert row_a.endswith(str(a.path)) and " B " in row_a  # a few hundred bytes
    assert lines[2].startswith("sm_90") and lines[2].endswith(str(b.path))
    assert str(old) not in out

    rc, out, _ = run_cli(capsys, "cache", "list", "--all")
    assert rc == 0 and out.splitlines()[0].split()[0] == "version"
    assert str(old) in out and "0.0.1/torch2.4.0-cu12.1" in out and "3 module(s)" in out


def test_cache_clear_dry_run_then_arch_then_all(capsys, jm_cache, fake_compile, spec_factory):
    a, b, old = _two_modules_and_an_old_one(jm_cache, fake_compile, spec_factory)
    vdir = cache.version_dir(jm_cache)

    rc, out, _ = run_cli(capsys, "cache", "clear", "--dry-run")
    assert rc == 0 and f"would remove {vdir}\n" in out and "nothing was deleted" in out
    assert a.path.is_dir() and b.path.is_dir()

    rc, out, _ = run_cli(capsys, "cache", "clear", "--arch", "8.0", "--dry-run")
    assert rc == 0 and f"would remove {vdir / 'sm_80'}\n" in out and "sm_90" not in out

    rc, out, _ = run_cli(capsys, "cache", "clear", "--arch", "sm_80")
    assert rc == 0 and f"removed {vdir / 'sm_80'}\n" in out
    assert not a.path.exists() and b.path.is_dir() and old.is_dir()

    rc, out, _ = run_cli(capsys, "cache", "clear")
    assert rc == 0 and not b.path.exists() and old.is_dir()

    rc, out, _ = run_cli(capsys, "cache", "clear")
    assert rc == 0 and out.startswith("nothing to remove")

    rc, out, _ = run_cli(capsys, "cache", "clear", "--all", "--dry-run")
    assert rc == 0 and f"would remove {jm_cache / '0.0.1'}" in out and old.is_dir()
    rc, out, _ = run_cli(capsys, "cache", "clear", "--all")
    assert rc == 0 and not old.exists()


def test_cache_clear_bad_arch_is_an_error(capsys):
    rc, out, err = run_cli(capsys, "cache", "clear", "--arch", "7.0")
    assert rc == 2 and out == ""
    assert err.startswith("jitmarlin: error: ") and "7.0" in err and "8.0" in err
    rc, _, err = run_cli(capsys, "cache", "clear", "--arch", "ampere")
    assert rc == 2 and "jitmarlin: error: arch 'ampere' is not of the form 8.0, 80 or sm_80" in err


def test_cache_permission_error_is_reported_without_traceback(jm_cache, subprocess_env, fake_compile,
                                                             spec_factory):
    get_module(spec_factory(), compile_fn=fake_compile)
    jm_cache.chmod(0o777)
    try:
        r = run_module(subprocess_env, "cache", "clear")
    finally:
        jm_cache.chmod(0o700)
    assert r.returncode == 2
    assert r.stderr.startswith("jitmarlin: error: refusing to use jitmarlin cache directory")
    assert "Traceback" not in r.stderr and str(jm_cache) in r.stderr


# ---------------------------------------------------------------- build


@pytest.fixture
def recorded_builds(monkeypatch, fake_compile):
    """Replace the build step by the fake compile, recording each spec."""
    specs = []
    real = build.get_module

    def record(spec, compile_fn=None):
        specs.append(spec)
        return real(spec, compile_fn=fake_compile)

    monkeypatch.setattr(build, "get_module", record)
    return specs


def test_build_selects_families_and_archs(capsys, recorded_builds):
    rc, out, err = run_cli(capsys, "build", "--arch", "8.0,sm_90", "--dtype", "f16,bf16", "--bits", "4,8",
                           "--group-size=-1,128", "--zero-points", "--tiles", "small")
    assert rc == 0, err
    assert len(recorded_builds) == 2 * 2 * 2 * 2
    expected = {K.build_spec(K.Family(d, b, True, g), cc, K.TILES[:2])
                for cc in ((8, 0), (9, 0)) for d in ("f16", "bf16") for b in (4, 8) for g in (-1, 128)}
    assert set(recorded_builds) == expected
    keys = {dict(s.key)["dtype"] + "/" + dict(s.key)["weight"] + "/" + dict(s.key)["group"] for s in recorded_builds}
    assert keys == {f"{d}/{w}/{g}" for d in ("f16", "bf16") for w in ("u4", "u8") for g in ("channel", "g128")}
    stems = {stem for s in recorded_builds for stem, _ in s.sources}
    assert not stems & {K.kernel_name(K.Family("f16", 4, True, 128), t) for t in K.TILES[2:]}  # small: 2 tiles
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert len(lines) == 16
    assert lines[0].startswith("[1/16] gemm dtype=f16 weight=u4 group=channel kind=dense sm_80: built in ")
    assert all(" s  " in ln for ln in lines)
    assert out.splitlines()[-1].startswith("done: 16 module(s) in ")


def test_build_defaults_and_moe(capsys, recorded_builds):
    rc, out, err = run_cli(capsys, "build", "--arch", "9.0")
    assert rc == 0, err
    spec, wgmma, strip = recorded_builds
    fam = K.Family("f16", 4, False, 128)
    assert spec == K.build_spec(fam, (9, 0))  # all tiles by default
    assert {K.kernel_name(fam, t) for t in K.TILES} <= {stem for stem, _ in spec.sources}
    assert wgmma == K.wgmma_build_spec(fam, (9, 0))  # and on sm_90 the warpgroup-MMA kernels
    assert strip == K.strip_build_spec(fam, (9, 0))  # and the strip kernels (routed on small problems)
    assert "strip dtype=f16 weight=u4b8 group=g128 kind=dense sm_90: " in out
    recorded_builds.clear()
    rc, out, err = run_cli(capsys, "build", "--arch", "9.0", "--act-order")
    assert rc == 0, err  # --act-order: their act-order forms too
    assert recorded_builds[-2:] == [K.strip_build_spec(fam, (9, 0)), K.strip_build_spec(fam, (9, 0), True)]
    assert "strip act-order dtype=f16" in out
    # a cache miss under JITMARLIN_DISABLE_JIT names these commands
    assert K.strip_build_spec(fam, (9, 0)).cli_hint == "jitmarlin build --arch 9.0 " + fam.cli_args()
    assert K.strip_build_spec(fam, (9, 0), True).cli_hint.endswith(" --act-order")
    for extra in ("--moe", "--tiles=small"):
        rc, _, err = run_cli(capsys, "build", "--arch", "9.0", "--act-order", extra)
        assert rc == 2 and "--act-order" in err and extra.split("=")[0] in err
    recorded_builds.clear()
    assert run_cli(capsys, "build", "--arch", "8.0", "--act-order")[0] == 0
    assert [s.family for s in recorded_builds] == ["gemm"]  # none on sm_80
    rc, _, _ = run_cli(capsys, "build", "--arch", "9.0", "--moe", "--tiles", "small")
    assert rc == 0 and recorded_builds[-2] == K.build_spec(K.Family("f16", 4, False, 128, moe=True), (9, 0),
                                                           K.TILES[:2])
    assert recorded_builds[-2].family == "moe"
    assert recorded_builds[-1] == K.moe_util_build_spec((9, 0))  # the MoE helper kernels come along


def test_build_reports_cached_modules(capsys, recorded_builds):
    assert run_cli(capsys, "build", "--arch", "8.0", "--tiles", "small")[0] == 0
    build._memo.clear()
    rc, out, _ = run_cli(capsys, "build", "--arch", "8.0", "--tiles", "small")
    assert rc == 0 and "sm_80: cached in " in out


def test_build_without_arch_and_without_gpu_is_an_error(capsys, monkeypatch, recorded_builds):
    no_gpu(monkeypatch)
    rc, out, err = run_cli(capsys, "build")
    assert rc == 2 and recorded_builds == []
    assert err.startswith("jitmarlin: error: ") and "no CUDA device" in err and "--arch 8.0,9.0" in err


def test_build_without_arch_uses_the_gpus(capsys, monkeypatch, recorded_builds):
    fake_gpus(monkeypatch, ("A100", (8, 0)), ("A100", (8, 0)), ("T4", (7, 5)))
    rc, _, err = run_cli(capsys, "build", "--tiles", "small")
    assert rc == 0, err
    assert [s.cc for s in recorded_builds] == [(8, 0)]  # once per distinct supported capability


def test_build_with_only_old_gpus_is_an_error(capsys, monkeypatch, recorded_builds):
    fake_gpus(monkeypatch, ("Tesla T4", (7, 5)))
    rc, _, err = run_cli(capsys, "build")
    assert rc == 2 and "Tesla T4" in err and "7.5" in err and recorded_builds == []


@pytest.mark.parametrize("args,words", [
    (["--dtype", "f32"], ["--dtype 'f32'", "f16 or bf16"]),
    (["--bits", "3"], ["--bits 3", "4 or 8"]),
    (["--bits", "four"], ["--bits 'four' is not an integer"]),
    (["--group-size", "100"], ["--group-size 100", "multiple of 128"]),
    (["--arch", "8.0,,9.0"], ["--arch '8.0,,9.0'", "comma-separated"]),
    (["--arch", "7.5"], ["7.5", "8.0"]),
])
def test_build_bad_values_are_errors(capsys, recorded_builds, args, words):
    argv = ["build", *args] if "--arch" in args else ["build", "--arch", "8.0", *args]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and recorded_builds == []
    assert err.startswith("jitmarlin: error: ")
    for w in words:
        assert w in err


def test_build_error_is_reported(capsys, monkeypatch):
    from jitmarlin.errors import BuildError

    def failing(spec, compile_fn=None):
        raise BuildError("compiling the gemm module for sm_80 failed.\ncommand: nvcc x")

    monkeypatch.setattr(build, "get_module", failing)
    rc, _, err = run_cli(capsys, "build", "--arch", "8.0")
    assert rc == 2 and err.startswith("jitmarlin: error: compiling the gemm module for sm_80 failed.")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["build", "--tiles", "tiny"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        cli.main([])
    assert ei.value.code == 2
    assert "jitmarlin" in capsys.readouterr().err


@pytest.mark.nvcc
def test_build_small_for_sm80_with_nvcc(capsys, cuda_toolchain, jm_cache):
    rc, out, err = run_cli(capsys, "build", "--arch", "8.0", "--tiles", "small")
    assert rc == 0, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("[1/1]")]
    assert "gemm dtype=f16 weight=u4b8 group=g128 kind=dense sm_80: built in " in line
    (mod,) = cache.list_modules()
    assert line.endswith(str(mod.path)) and mod.arch == "sm_80"
    spec = K.build_spec(K.Family("f16", 4, False, 128), (8, 0), K.TILES[:2])
    for name, _ in spec.sources:
        assert (mod.path / f"{name}.cubin").is_file()
    rc, out, _ = run_cli(capsys, "cache", "list")
    assert rc == 0 and str(mod.path) in out and "dtype=f16 weight=u4b8 group=g128 kind=dense" in out


# ---------------------------------------------------------------- demo


def test_demo_without_gpu_via_python_m(subprocess_env):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = run_module(subprocess_env, "demo")
    assert r.returncode == 3
    assert "torch:" in r.stdout and "no CUDA device" in r.stdout  # the info output comes first
    assert "demo: cannot run" in r.stderr and "compute capability >= 8.0" in r.stderr
    assert "Traceback" not in r.stderr


def test_demo_with_only_an_old_gpu(capsys, monkeypatch):
    fake_gpus(monkeypatch, ("Tesla V100", (7, 0)))
    rc, out, err = run_cli(capsys, "demo")
    assert rc == 3 and "Tesla V100" in err and "7.0" in err


def test_demo_runs_jitmarlin_demo(capsys, monkeypatch):
    fake_gpus(monkeypatch, ("NVIDIA H200", (9, 0)))
    calls = []
    fake = types.ModuleType("jitmarlin.demo")
    fake.run = lambda: calls.append("run") or 0
    monkeypatch.setitem(sys.modules, "jitmarlin.demo", fake)
    assert run_cli(capsys, "demo")[0] == 0 and calls == ["run"]
    fake.run = lambda: 7
    assert run_cli(capsys, "demo")[0] == 7


def test_demo_errors_are_reported(capsys, monkeypatch):
    from jitmarlin.errors import LaunchError

    fake_gpus(monkeypatch, ("NVIDIA H200", (9, 0)))
    fake = types.ModuleType("jitmarlin.demo")

    def run():
        raise LaunchError("launching jm_gemm failed: CUDA_ERROR_INVALID_VALUE")

    fake.run = run
    monkeypatch.setitem(sys.modules, "jitmarlin.demo", fake)
    rc, _, err = run_cli(capsys, "demo")
    assert rc == 2 and err == "jitmarlin: error: launching jm_gemm failed: CUDA_ERROR_INVALID_VALUE\n"


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out.strip() == f"jitmarlin {__version__}"
