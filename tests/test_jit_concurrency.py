"""Several processes building one module at once, and a builder killed mid-build.

Each child runs a small script that builds one spec with a fake compile step (it appends a line to
a counter file, sleeps, writes fake cubins), so the file lock and the staging/rename protocol of
jitmarlin.jit.build are exercised across real processes without nvcc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitmarlin.jit import cache

pytestmark = pytest.mark.usefixtures("jm_cache")

CHILD = r'''
import json, os, sys, time
from pathlib import Path

from jitmarlin.jit.build import get_module
from jitmarlin.jit.spec import BuildSpec

work, sleep_s, me, gate = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4] == "gate"


def fake_compile(spec, out_dir, tc):
    with open(work / "compiles.txt", "a") as f:
        f.write(f"{me} {os.getpid()} {out_dir}\n")
    time.sleep(sleep_s)
    for stem, _ in spec.sources:
        (out_dir / f"{stem}.cubin").write_bytes(b"FAKE " + stem.encode())
    return {"builder": me}


spec = BuildSpec(family="gemm", cc=(8, 0), key=(("case", "race"),),
                 sources=(("k0", "// kernel 0\n"), ("k1", "// kernel 1\n")))
spec.source_hash()  # import torch and hash the headers before the start signal
if gate:
    (work / f"ready-{me}").touch()
    deadline = time.time() + 300
    while not (work / "go").exists():
        if time.time() > deadline:
            sys.exit("no start signal")
        time.sleep(0.005)
t0 = time.time()
mod = get_module(spec, compile_fn=fake_compile)
print(json.dumps({"me": me, "path": str(mod.path), "builder": mod.meta["builder"],
                  "seconds": time.time() - t0}))
'''


@pytest.fixture
def child(tmp_path, subprocess_env):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    work = tmp_path / "work"
    work.mkdir()

    def start(me: str, sleep_s: float, gate: bool = False) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(work), str(sleep_s), me,
                                 "gate" if gate else "nogate"],
                                env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    start.work = work
    return start


def _wait_for(cond, what: str, procs=(), timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                pytest.fail(f"a child exited early (rc {p.returncode}) while waiting for {what}:\n{out}\n{err}")
        if time.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def _compiles(work: Path) -> list[list[str]]:
    f = work / "compiles.txt"
    return [ln.split(" ", 2) for ln in f.read_text().splitlines()] if f.exists() else []


def test_eight_processes_race_one_compile(child, jm_cache):
    n = 8
    procs = [child(f"p{i}", 1.0, gate=True) for i in range(n)]
    try:
        _wait_for(lambda: len(list(child.work.glob("ready-*"))) == n, "all children ready", procs)
        (child.work / "go").touch()
        results = [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    compiles = _compiles(child.work)
    assert len(compiles) == 1, f"expected exactly one compile, got {compiles}"
    builder = compiles[0][0]
    paths = {r["path"] for r in results}
    assert len(paths) == 1
    mdir = Path(paths.pop())
    assert all(r["builder"] == builder for r in results)  # everyone loaded the one build
    assert (mdir / "meta.json").is_file() and (mdir / "k0.cubin").read_bytes() == b"FAKE k0"
    # the lock was contended: besides the builder, others sat waiting for its 1 s compile
    assert sum(r["seconds"] > 0.5 for r in results) >= 2, results
    adir = mdir.parent
    assert not [p for p in adir.iterdir() if cache.is_staging(p)]
    assert [m.path for m in cache.list_modules()] == [mdir]


def test_builder_killed_mid_compile_does_not_block_the_next(child, jm_cache):
    victim = child("victim", 120.0)
    try:
        _wait_for(lambda: len(_compiles(child.work)) == 1, "the victim to start compiling", [victim])
        staging = Path(_compiles(child.work)[0][2])
        assert staging.is_dir() and cache.is_staging(staging)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert staging.is_dir()  # the dead builder's leftovers are still there ...
    assert cache.list_modules() == []

    t0 = time.time()
    result = _finish(child("next", 0.0))
    assert time.time() - t0 < 100  # not stuck behind the dead builder's lock
    assert result["builder"] == "next"
    assert not staging.exists()  # ... until the next builder removes them under the lock
    mdir = Path(result["path"])
    assert (mdir / "meta.json").is_file()
    assert not [p for p in mdir.parent.iterdir() if cache.is_staging(p)]
    assert [c[0] for c in _compiles(child.work)] == ["victim", "next"]
