"""The wheel: pure Python (py3-none-any), carries every CUDA source as jitmarlin/cuda_src/*, every
module of the package, the `jitmarlin` console script; and installed, it finds its sources.

Built offline from a copy of the source tree (no build isolation, no index), so the checkout
gets no build/ or *.egg-info and stale build output cannot leak into the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jitmarlin import __version__

REPO = Path(__file__).resolve().parent.parent


def _pip(*args: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], cwd=str(cwd), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"pip {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    for name in ("jitmarlin", "cuda_src"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    out = tmp / "dist"
    _pip("wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), cwd=tmp)
    (whl,) = out.glob("*.whl")
    return whl


def test_wheel_is_pure_python(wheel):
    assert wheel.name == f"jitmarlin-{__version__}-py3-none-any.whl"


def test_wheel_has_every_cuda_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.is_file())
    assert "jm_common.cuh" in sources
    missing = [s for s in sources if f"jitmarlin/cuda_src/{s}" not in names]
    assert not missing, f"cuda_src files missing from the wheel: {missing}"


def test_wheel_has_every_python_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "jitmarlin").rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert "jitmarlin/cli.py" in modules and "jitmarlin/__main__.py" in modules
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules missing from the wheel (a package not listed in pyproject.toml?): {missing}"
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/")) or n.endswith(".pyc")]


def test_wheel_metadata_and_console_script(wheel):
    z = zipfile.ZipFile(wheel)
    dist = f"jitmarlin-{__version__}.dist-info"
    meta = z.read(f"{dist}/METADATA").decode()
    assert "Name: jitmarlin" in meta and f"Version: {__version__}" in meta
    for dep in ("torch", "ninja", "filelock", "packaging"):
        assert f"Requires-Dist: {dep}" in meta
    eps = z.read(f"{dist}/entry_points.txt").decode()
    assert "[console_scripts]" in eps and "jitmarlin = jitmarlin.cli:main" in eps


def test_installed_wheel_finds_its_sources(wheel, tmp_path):
    target = tmp_path / "target"
    _pip("install", "--no-deps", "--no-index", "--target", str(target), str(wheel), cwd=tmp_path)
    script = target / "bin" / "jitmarlin"
    assert script.is_file() and "jitmarlin.cli" in script.read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(target)
    env["JITMARLIN_CACHE_DIR"] = str(tmp_path / "cache")
    code = ("import json, jitmarlin, jitmarlin.cli\n"
            "from jitmarlin.jit.spec import source_dir\n"
            "print(json.dumps({'pkg': jitmarlin.__file__, 'src': str(source_dir()),\n"
            "                  'files': sorted(p.name for p in source_dir().iterdir())}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["pkg"]).resolve() == (target / "jitmarlin" / "__init__.py").resolve()
    assert Path(got["src"]).resolve() == (target / "jitmarlin" / "cuda_src").resolve()
    want = sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.is_file())
    assert [f for f in got["files"] if f != "__pycache__"] == want
