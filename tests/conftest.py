"""Shared fixtures of the CPU tests of the JIT layer, the CLI and the packaging.

`jm_cache` points jitmarlin at a private, empty cache under tmp_path (never ~/.cache) and resets
the in-process memos (toolchain lookup, loaded modules) before and after the test.

`cuda_toolchain` is the real CUDA toolkit, or a skip where there is none. With
JITMARLIN_TEST_REQUIRE_NVCC=1 (set by .ci/run on machines that have nvcc) a missing toolkit fails
the test instead, so the nvcc tests cannot be skipped unnoticed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _reset_memos() -> None:
    from jitmarlin.jit import build, toolchain

    toolchain.find_cuda.cache_clear()
    toolchain.find_ninja.cache_clear()
    build._memo.clear()


@pytest.fixture
def jm_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "jmcache"
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", str(root))
    monkeypatch.setenv("JITMARLIN_QUIET", "1")
    for var in ("JITMARLIN_DISABLE_JIT", "JITMARLIN_BUILD_JOBS", "MAX_JOBS"):
        monkeypatch.delenv(var, raising=False)
    _reset_memos()
    yield root
    _reset_memos()


@pytest.fixture
def cuda_toolchain(jm_cache):
    from jitmarlin.errors import ToolchainError
    from jitmarlin.jit.toolchain import find_cuda

    try:
        return find_cuda()
    except ToolchainError as e:
        if os.environ.get("JITMARLIN_TEST_REQUIRE_NVCC", "0") not in ("", "0"):
            pytest.fail(f"JITMARLIN_TEST_REQUIRE_NVCC is set but no CUDA toolkit was found: {e}")
        pytest.skip(f"no CUDA toolkit (nvcc): {e}")


@pytest.fixture
def subprocess_env(jm_cache) -> dict:
    """Environment for a child python: same cache, and the repository importable first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class FakeCompile:
    """A compile step for get_module(spec, compile_fn=...) that needs no nvcc: writes one small
    <stem>.cubin per source and records each call."""

    def __init__(self):
        self.calls: list[Path] = []

    def __call__(self, spec, out_dir: Path, tc) -> dict:
        assert tc is None, "get_module passes no toolchain to an injected compile step"
        self.calls.append(out_dir)
        for stem, text in spec.sources:
            (out_dir / f"{stem}.cubin").write_bytes(b"FAKE-CUBIN " + stem.encode() + b"\n" + text.encode())
        return {"compile_seconds": 0.0, "fake_compile": True}


@pytest.fixture
def fake_compile() -> FakeCompile:
    return FakeCompile()


def small_spec(cc=(8, 0), tag: str = "t", family: str = "gemm"):
    from jitmarlin.jit.spec import BuildSpec

    return BuildSpec(family=family, cc=cc, key=(("dtype", "f16"), ("case", tag)),
                     sources=((f"k0_{tag}", "// kernel 0\n"), (f"k1_{tag}", "// kernel 1\n")),
                     cli_hint=f"jitmarlin build --arch {cc[0]}.{cc[1]} --case {tag}")


@pytest.fixture
def spec_factory():
    return small_spec
