"""Toolchain discovery (CUDA home validation, nvcc version, ninja) and the GPU capability checks.

Fake toolkits are folders under tmp_path whose bin/nvcc is a shell script printing a
`nvcc --version` text; no GPU and no real nvcc are needed except in the one test that checks
this machine's layout (/usr/local/bin/nvcc wrapper + /usr/local/cuda toolkit).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from jitmarlin.errors import ToolchainError, UnsupportedDeviceError
from jitmarlin.jit import toolchain
from jitmarlin.jit.toolchain import CudaToolchain, _problems, find_cuda

pytestmark = pytest.mark.usefixtures("jm_cache")


def make_toolkit(root: Path, release: str = "13.0", full: str = "13.0.88", *, nvcc: bool = True,
                 header: bool = True, lib: str | None = "lib64") -> Path:
    (root / "bin").mkdir(parents=True)
    if nvcc:
        write_nvcc(root / "bin" / "nvcc", release, full)
    if header:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("// fake header\n")
    if lib:
        (root / lib).mkdir(parents=True)
    return root


def write_nvcc(path: Path, release: str, full: str, mtime_ns: int | None = None) -> None:
    path.write_text("#!/bin/sh\n"
                    "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{full}'\n"
                    f"echo 'Build cuda_{release}.r{release}/compiler.0_0'\n")
    path.chmod(0o755)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def without_system_toolkits(monkeypatch) -> None:
    """Keep the real candidate rules ($CUDA_HOME, nvcc on PATH) but drop /usr/local/cuda*."""
    original = toolchain._candidates
    monkeypatch.setattr(toolchain, "_candidates",
                        lambda: [c for c in original() if not str(c[1]).startswith("/usr/local/cuda")])


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)


# ---------------------------------------------------------------- candidate validation


def test_problems_of_a_complete_fake_toolkit_is_empty(tmp_path):
    assert _problems(make_toolkit(tmp_path / "cuda")) == []


def test_problems_names_each_missing_part(tmp_path):
    assert _problems(make_toolkit(tmp_path / "a", header=False)) == ["include/cuda_runtime.h"]
    assert _problems(make_toolkit(tmp_path / "b", nvcc=False)) == ["bin/nvcc"]
    assert _problems(make_toolkit(tmp_path / "c", lib=None)) == ["lib64 (or lib)"]
    assert _problems(tmp_path / "does-not-exist") == ["bin/nvcc", "include/cuda_runtime.h", "lib64 (or lib)"]


def test_non_executable_nvcc_is_rejected(tmp_path):
    tk = make_toolkit(tmp_path / "cuda")
    (tk / "bin" / "nvcc").chmod(0o644)
    assert _problems(tk) == ["bin/nvcc"]


def test_library_folder_alternatives(tmp_path):
    assert _problems(make_toolkit(tmp_path / "a", lib="lib")) == []
    assert _problems(make_toolkit(tmp_path / "b", lib="targets/x86_64-linux/lib")) == []


def test_cuda_home_valid_fake_toolkit(tmp_path, monkeypatch):
    tk = make_toolkit(tmp_path / "cuda-fake")
    monkeypatch.setenv("CUDA_HOME", str(tk))
    tc = find_cuda()
    assert tc.home == tk
    assert tc.nvcc == tk / "bin" / "nvcc"
    assert tc.version == (13, 0)
    assert tc.version_full == "13.0.88"
    assert tc.found_by == "$CUDA_HOME"


def test_cuda_home_invalid_is_an_error_naming_it(tmp_path, monkeypatch):
    bad = tmp_path / "not-cuda"
    (bad / "bin").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(bad))
    with pytest.raises(ToolchainError) as ei:
        find_cuda()
    msg = str(ei.value)
    assert f"CUDA_HOME={bad}" in msg
    assert "bin/nvcc" in msg and "include/cuda_runtime.h" in msg and "lib64" in msg


def test_cuda_home_wins_over_cuda_path_and_a_bad_cuda_path_is_also_strict(tmp_path, monkeypatch):
    good = make_toolkit(tmp_path / "good")
    monkeypatch.setenv("CUDA_HOME", str(good))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "elsewhere"))
    assert find_cuda().home == good
    find_cuda.cache_clear()
    monkeypatch.delenv("CUDA_HOME")
    with pytest.raises(ToolchainError, match="CUDA_PATH="):
        find_cuda()


def test_no_toolkit_anywhere_lists_what_was_tried(tmp_path, monkeypatch, no_env):
    # An nvcc wrapper on PATH whose prefix is no toolkit, like /usr/local/bin/nvcc on this machine.
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    write_nvcc(prefix / "bin" / "nvcc", "13.0", "13.0.88")
    monkeypatch.setenv("PATH", str(prefix / "bin"))
    without_system_toolkits(monkeypatch)
    with pytest.raises(ToolchainError) as ei:
        find_cuda()
    msg = str(ei.value)
    assert "found no CUDA toolkit" in msg and "Tried:" in msg
    assert f"{prefix} (nvcc on PATH" in msg
    assert "lacks include/cuda_runtime.h, lib64 (or lib)" in msg
    assert "CUDA_HOME" in msg  # tells how to fix it


def test_no_candidate_at_all(tmp_path, monkeypatch, no_env):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    without_system_toolkits(monkeypatch)
    with pytest.raises(ToolchainError, match=r"Tried:\n  \(no candidate\)"):
        find_cuda()


def test_nvcc_on_path_symlinked_into_a_toolkit_is_found(tmp_path, monkeypatch, no_env):
    tk = make_toolkit(tmp_path / "opt" / "cuda-13.0")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvcc").symlink_to(tk / "bin" / "nvcc")
    monkeypatch.setenv("PATH", str(bindir))
    without_system_toolkits(monkeypatch)
    tc = find_cuda()
    assert tc.home == tk  # the literal prefix (tmp_path) is rejected, the resolved one is used
    assert tc.found_by.startswith("nvcc on PATH")


def test_this_machine_finds_usr_local_cuda_not_usr_local(monkeypatch, no_env):
    if not (Path("/usr/local/cuda") / "bin" / "nvcc").is_file():
        pytest.skip("this machine has no /usr/local/cuda toolkit")
    tc = find_cuda()
    assert tc.home == Path("/usr/local/cuda")
    assert tc.nvcc == Path("/usr/local/cuda/bin/nvcc")
    assert _problems(tc.home) == []
    which = shutil.which("nvcc")
    if which and Path(which).parent.parent == Path("/usr/local"):
        # the wrapper script's prefix was a candidate before /usr/local/cuda and was rejected
        assert "include/cuda_runtime.h" in _problems(Path("/usr/local"))
        assert tc.found_by == "/usr/local/cuda"


# ---------------------------------------------------------------- nvcc version


def test_unreadable_nvcc_version_is_an_error(tmp_path, monkeypatch):
    tk = make_toolkit(tmp_path / "cuda")
    (tk / "bin" / "nvcc").write_text("#!/bin/sh\necho 'this is not nvcc'\n")
    monkeypatch.setenv("CUDA_HOME", str(tk))
    with pytest.raises(ToolchainError, match="cannot read the CUDA version") as ei:
        find_cuda()
    assert str(tk / "bin" / "nvcc") in str(ei.value) and "this is not nvcc" in str(ei.value)


def test_nvcc_version_memo_avoids_running_nvcc(tmp_path, monkeypatch, jm_cache):
    jm_cache.mkdir(parents=True)  # the memo lives in the cache root, written only when it exists
    tk = make_toolkit(tmp_path / "cuda")
    monkeypatch.setenv("CUDA_HOME", str(tk))
    assert find_cuda().version_full == "13.0.88"
    memo = json.loads((jm_cache / "nvcc-versions.json").read_text())
    assert [13, 0, "13.0.88"] in memo.values()

    real_run = subprocess.run

    def refuse(*args, **kwargs):
        raise AssertionError(f"nvcc was run although its version is memoized: {args}")

    monkeypatch.setattr(toolchain.subprocess, "run", refuse)
    find_cuda.cache_clear()
    assert find_cuda().version == (13, 0)  # from the memo file

    # A different nvcc binary (new mtime/size) is not answered from the memo.
    write_nvcc(tk / "bin" / "nvcc", "13.1", "13.1.2", mtime_ns=1_700_000_000_000_000_000)
    find_cuda.cache_clear()
    with pytest.raises(AssertionError, match="memoized"):
        find_cuda()
    monkeypatch.setattr(toolchain.subprocess, "run", real_run)
    find_cuda.cache_clear()
    assert find_cuda().version == (13, 1)


def test_corrupt_memo_file_is_ignored(tmp_path, monkeypatch, jm_cache):
    jm_cache.mkdir(parents=True)
    (jm_cache / "nvcc-versions.json").write_text("[not, json")
    tk = make_toolkit(tmp_path / "cuda", "13.0", "13.0.77")
    monkeypatch.setenv("CUDA_HOME", str(tk))
    assert find_cuda().version_full == "13.0.77"
    assert [13, 0, "13.0.77"] in json.loads((jm_cache / "nvcc-versions.json").read_text()).values()


# ---------------------------------------------------------------- nvcc vs torch


def _tc(major: int, minor: int) -> CudaToolchain:
    return CudaToolchain(home=Path("/opt/cuda"), nvcc=Path("/opt/cuda/bin/nvcc"), version=(major, minor),
                         version_full=f"{major}.{minor}.1", found_by="test")


def test_major_mismatch_with_torch_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ToolchainError) as ei:
        toolchain.check_cuda_matches_torch(_tc(12, 4))
    msg = str(ei.value)
    assert "CUDA 12.4" in msg and "CUDA 13.0" in msg and "major versions must match" in msg
    assert "/opt/cuda/bin/nvcc" in msg


def test_minor_mismatch_only_warns(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.warns(UserWarning, match="minor versions differ"):
        toolchain.check_cuda_matches_torch(_tc(13, 1))


def test_exact_match_and_cpu_torch_are_silent(monkeypatch, recwarn):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    toolchain.check_cuda_matches_torch(_tc(13, 0))
    monkeypatch.setattr(torch.version, "cuda", None)
    toolchain.check_cuda_matches_torch(_tc(12, 1))  # CPU torch: cross-compiling is allowed
    assert not [w for w in recwarn if "nvcc" in str(w.message)]


# ---------------------------------------------------------------- ninja


def test_find_ninja_returns_an_executable():
    p = toolchain.find_ninja()
    assert p.is_file() and os.access(p, os.X_OK)


def test_find_ninja_missing_is_an_error(tmp_path, monkeypatch):
    import ninja

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(ninja, "BIN_DIR", str(empty), raising=False)
    monkeypatch.setenv("PATH", str(empty))
    toolchain.find_ninja.cache_clear()
    with pytest.raises(ToolchainError) as ei:
        toolchain.find_ninja()
    assert str(empty / "ninja") in str(ei.value) and "pip install ninja" in str(ei.value)


# ---------------------------------------------------------------- device checks


def _fake_gpu(monkeypatch, cc, name="Fake GPU", available=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if available else 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx=None: name)


def test_old_gpu_is_rejected_with_name_and_capability(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    with pytest.raises(UnsupportedDeviceError) as ei:
        toolchain.device_capability("cuda:0")
    msg = str(ei.value)
    assert "Tesla T4" in msg and "7.5" in msg and ">= 8.0" in msg and "cuda:0" in msg


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (9, 0), (12, 0)])
def test_supported_gpu_returns_its_capability(monkeypatch, cc):
    _fake_gpu(monkeypatch, cc)
    assert toolchain.device_capability("cuda:0") == cc


def test_no_cuda_device_is_rejected(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), available=False)
    with pytest.raises(UnsupportedDeviceError, match="sees no CUDA device") as ei:
        toolchain.device_capability("cuda:0")
    assert ">= 8.0" in str(ei.value)


@pytest.mark.parametrize("text,cc", [("8.0", (8, 0)), ("80", (8, 0)), ("sm_86", (8, 6)), ("9.0", (9, 0)),
                                     (" SM_90 ", (9, 0)), ("10.0", (10, 0)), ("100", (10, 0)),
                                     ("compute_120", (12, 0))])
def test_parse_arch(text, cc):
    assert toolchain.parse_arch(text) == cc
    assert toolchain.arch_name(cc) == f"sm_{cc[0]}{cc[1]}"


@pytest.mark.parametrize("text", ["", "8", "sm_90a", "eight", "8.0.1", "9.x"])
def test_parse_arch_rejects_malformed(text):
    with pytest.raises(ValueError, match="is not of the form 8.0, 80 or sm_80") as ei:
        toolchain.parse_arch(text)
    assert repr(text)[1:-1] in str(ei.value)


@pytest.mark.parametrize("text", ["7.5", "sm_70", "61"])
def test_parse_arch_rejects_old_architectures(text):
    with pytest.raises(UnsupportedDeviceError, match="below the required compute capability 8.0"):
        toolchain.parse_arch(text)
