"""The kernel cache: where it lives, its layout and meta.json, private directories, listing, clearing."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from jitmarlin import __version__
from jitmarlin.errors import CachePermissionError
from jitmarlin.jit import build, cache
from jitmarlin.jit.build import get_module

pytestmark = pytest.mark.usefixtures("jm_cache")


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def fake_module(root: Path, version: str, tag: str, arch: str, name: str, family: str = "gemm") -> Path:
    """A module as another jitmarlin/torch version would have left it."""
    d = root / version / tag / arch / name
    d.mkdir(parents=True)
    (d / "k.cubin").write_bytes(b"x" * 100)
    (d / "meta.json").write_text(json.dumps({"family": family, "arch": arch, "key": [["dtype", "f16"]],
                                             "built_at": 1_700_000_000.0}))
    return d


# ---------------------------------------------------------------- root resolution


def test_root_from_jitmarlin_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_root() == (tmp_path / "mine", "$JITMARLIN_CACHE_DIR")


def test_root_from_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("JITMARLIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == (tmp_path / "xdg" / "jitmarlin", "$XDG_CACHE_HOME/jitmarlin")


def test_root_default_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("JITMARLIN_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root, why = cache.cache_root()
    assert root == tmp_path / "home" / ".cache" / "jitmarlin"
    assert "default" in why


def test_empty_variables_are_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root()[0] == tmp_path / "xdg" / "jitmarlin"


def test_tilde_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", "~/jm")
    assert cache.cache_root()[0] == tmp_path / "h" / "jm"


# ---------------------------------------------------------------- layout and meta.json


def test_module_path_layout(jm_cache, fake_compile, spec_factory):
    spec = spec_factory()
    mod = get_module(spec, compile_fn=fake_compile)
    tag = f"torch{torch.__version__}-cu{torch.version.cuda or 'none'}"
    assert cache.torch_tag() == tag
    assert mod.path == jm_cache / __version__ / tag / "sm_80" / spec.module_name("fake")
    assert sorted(p.name for p in mod.path.iterdir()) == ["k0_t.cubin", "k1_t.cubin", "meta.json"]
    assert mod.cubin("k0_t") == mod.path / "k0_t.cubin"


def test_meta_json_content(fake_compile, spec_factory):
    spec = spec_factory(cc=(9, 0))
    t0 = time.time()
    mod = get_module(spec, compile_fn=fake_compile)
    meta = json.loads((mod.path / "meta.json").read_text())
    assert meta == mod.meta
    assert meta["family"] == "gemm" and meta["arch"] == "sm_90"
    assert meta["key"] == [["dtype", "f16"], ["case", "t"]]
    assert meta["kernels"] == ["k0_t", "k1_t"]
    assert meta["source_hash"] == spec.source_hash()
    assert meta["jitmarlin_version"] == __version__ and meta["torch_tag"] == cache.torch_tag()
    assert meta["nvcc_version"] == "fake" and meta["flags"] == []
    assert t0 - 1 <= meta["built_at"] <= time.time() + 1
    assert meta["fake_compile"] is True  # what the compile step returned is recorded


def test_created_directories_are_private(jm_cache, fake_compile, spec_factory):
    old = os.umask(0)  # even with a permissive umask
    try:
        mod = get_module(spec_factory(), compile_fn=fake_compile)
    finally:
        os.umask(old)
    p = mod.path
    while True:
        assert mode(p) == 0o700, f"{p} has mode {oct(mode(p))}"
        if p == jm_cache:
            break
        p = p.parent
    lock = mod.path.with_name(mod.path.name + ".lock")
    assert lock.is_file() and mode(lock) & 0o077 == 0


def test_missing_parents_of_the_root_are_created(monkeypatch, tmp_path, fake_compile, spec_factory):
    root = tmp_path / "fresh-home" / ".cache" / "jitmarlin"
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", str(root))
    mod = get_module(spec_factory(), compile_fn=fake_compile)
    assert mod.path.is_relative_to(root) and mode(root) == 0o700


def test_group_writable_root_is_refused(jm_cache, fake_compile, spec_factory):
    jm_cache.mkdir(mode=0o700)
    jm_cache.chmod(0o775)
    with pytest.raises(CachePermissionError) as ei:
        get_module(spec_factory(), compile_fn=fake_compile)
    msg = str(ei.value)
    assert str(jm_cache) in msg and "drwxrwxr-x" in msg and f"chmod go-w {jm_cache}" in msg
    assert fake_compile.calls == []


def test_check_safe_stops_at_stop(tmp_path):
    # tmp_path's ancestors include /tmp (world-writable): only path..stop is checked
    d = tmp_path / "a" / "b"
    d.mkdir(parents=True, mode=0o700)
    (tmp_path / "a").chmod(0o700)
    cache.check_safe(d, stop=tmp_path / "a")
    (tmp_path / "a").chmod(0o777)
    with pytest.raises(CachePermissionError, match="lets group or others write"):
        cache.check_safe(d, stop=tmp_path / "a")


# ---------------------------------------------------------------- list and clear


def _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory):
    m80 = get_module(spec_factory(cc=(8, 0)), compile_fn=fake_compile)
    m90 = get_module(spec_factory(cc=(9, 0)), compile_fn=fake_compile)
    old = fake_module(jm_cache, "0.0.1", "torch2.4.0-cu12.1", "sm_80", "gemm_old_0123456789abcdef")
    return m80, m90, old


def test_list_modules(jm_cache, fake_compile, spec_factory):
    m80, m90, old = _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory)
    mods = cache.list_modules()
    assert [(m.arch, m.path) for m in mods] == [("sm_80", m80.path), ("sm_90", m90.path)]
    m = mods[0]
    assert m.family == "gemm" and m.key == {"dtype": "f16", "case": "t"}
    assert m.size == sum(f.stat().st_size for f in m80.path.iterdir()) > 0
    assert m.jitmarlin_version == __version__ and m.torch_tag == cache.torch_tag()
    assert m.built_at == m80.meta["built_at"]

    everything = cache.list_modules(all_versions=True)
    assert {m.path for m in everything} == {m80.path, m90.path, old}
    (o,) = [m for m in everything if m.path == old]
    assert (o.jitmarlin_version, o.torch_tag, o.arch, o.size) == ("0.0.1", "torch2.4.0-cu12.1", "sm_80", 100 + len(
        (old / "meta.json").read_bytes()))


def test_list_modules_of_a_missing_cache_is_empty(jm_cache):
    assert not jm_cache.exists()
    assert cache.list_modules() == [] and cache.list_modules(all_versions=True) == []


def test_list_ignores_locks_logs_and_staging_dirs(jm_cache, fake_compile, spec_factory):
    m80 = get_module(spec_factory(), compile_fn=fake_compile)
    adir = m80.path.parent
    (adir / "logs").mkdir()
    staging = adir / (m80.path.name + ".staging-abc123")  # a killed build's, complete meta.json
    staging.mkdir()
    (staging / "meta.json").write_text((m80.path / "meta.json").read_text())
    assert [m.path for m in cache.list_modules()] == [m80.path]


def test_clear_dry_run_removes_nothing(jm_cache, fake_compile, spec_factory):
    m80, m90, old = _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory)
    victims = cache.clear(dry_run=True)
    assert victims == [cache.version_dir(jm_cache)]
    assert m80.path.is_dir() and m90.path.is_dir() and old.is_dir()


def test_clear_one_arch(jm_cache, fake_compile, spec_factory):
    m80, m90, old = _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory)
    assert cache.clear(arch="sm_80") == [m80.path.parent]
    assert not m80.path.exists() and m90.path.is_dir() and old.is_dir()  # other versions untouched


def test_clear_one_arch_of_all_versions(jm_cache, fake_compile, spec_factory):
    m80, m90, old = _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory)
    assert sorted(cache.clear(arch="sm_80", all_versions=True)) == sorted([m80.path.parent, old.parent])
    assert not m80.path.exists() and not old.exists() and m90.path.is_dir()


def test_clear_current_version(jm_cache, fake_compile, spec_factory):
    m80, m90, old = _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory)
    assert cache.clear() == [cache.version_dir(jm_cache)]  # the root is under /tmp: must work there
    assert not m80.path.exists() and not m90.path.exists() and old.is_dir()
    assert cache.list_modules() == []


def test_clear_all_versions(jm_cache, fake_compile, spec_factory):
    m80, m90, old = _two_archs_and_an_old_version(jm_cache, fake_compile, spec_factory)
    (jm_cache / "nvcc-versions.json").write_text("{}")
    victims = cache.clear(all_versions=True)
    assert sorted(victims) == sorted([jm_cache / __version__, jm_cache / "0.0.1"])
    assert sorted(p.name for p in jm_cache.iterdir()) == ["nvcc-versions.json"]


def test_clear_missing_cache_is_a_no_op(jm_cache):
    assert cache.clear() == [] and cache.clear(all_versions=True, arch="sm_90") == []


def test_clear_refuses_a_root_writable_by_others(jm_cache, fake_compile, spec_factory):
    m80 = get_module(spec_factory(), compile_fn=fake_compile)
    jm_cache.chmod(0o777)
    try:
        with pytest.raises(CachePermissionError, match=str(jm_cache)):
            cache.clear()
        assert m80.path.is_dir()
    finally:
        jm_cache.chmod(0o700)


def test_a_module_listed_is_loadable_again(jm_cache, fake_compile, spec_factory):
    spec = spec_factory()
    m = get_module(spec, compile_fn=fake_compile)
    build._memo.clear()
    assert get_module(spec, compile_fn=fake_compile).path == m.path
    assert len(fake_compile.calls) == 1
