"""Build specs: module names and the hash that must change with every input of a compile."""

from __future__ import annotations

import re
import shutil

import pytest

from jitmarlin.jit import spec as spec_mod
from jitmarlin.jit.spec import BuildSpec, source_dir
from jitmarlin.ops import _kernels as K


def make_spec(**over) -> BuildSpec:
    kw = dict(family="gemm", cc=(8, 0), key=(("dtype", "f16"), ("weight", "u4b8"), ("group", "g128")),
              sources=(("k_a", '#include "jm_common.cuh"\n// a\n'), ("k_b", "// b\n")), flags=())
    kw.update(over)
    return BuildSpec(**kw)


@pytest.fixture
def src_copy(tmp_path, monkeypatch):
    """A private copy of cuda_src that source_hash() reads instead of the real one."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(source_dir(), copy)
    monkeypatch.setattr(spec_mod, "source_dir", lambda: copy)
    yield copy
    source_dir.cache_clear()


def test_source_dir_is_the_checkout_cuda_src():
    d = source_dir()
    assert (d / "jm_common.cuh").is_file() and (d / "jm_gemm.cuh").is_file()


def test_module_name_has_family_slug_and_hash():
    s = make_spec()
    name = s.module_name("13.0.88")
    assert name.startswith("gemm_f16-u4b8-g128_")
    assert re.fullmatch(r"gemm_f16-u4b8-g128_[0-9a-f]{16}", name)
    assert s.arch == "sm_80"


def test_slug_keeps_only_safe_characters():
    s = make_spec(key=(("a", "x/y z"), ("b", "../evil")))
    assert "/" not in s.module_name("v") and " " not in s.slug()
    assert s.slug() == "x-y-z-..-evil"


def test_real_family_names():
    fam = K.Family("bf16", 8, True, -1)
    name = K.build_spec(fam, (9, 0)).module_name("13.0.88")
    assert name.startswith("gemm_bf16-u8-channel-dense_")
    moe = K.build_spec(K.Family("f16", 4, False, 128, moe=True), (9, 0))
    assert moe.family == "moe" and moe.module_name("13.0.88").startswith("moe_f16-u4b8-g128-moe_")
    assert "--moe" in moe.cli_hint and "--arch 9.0" in moe.cli_hint


def test_equal_specs_give_equal_hashes():
    a, b = make_spec(), make_spec(cli_hint="jitmarlin build --something")
    assert a is not b
    assert a.source_hash() == b.source_hash()
    assert a.module_name("13.0.88") == b.module_name("13.0.88")


@pytest.mark.parametrize("change", [
    dict(sources=(("k_a", '#include "jm_common.cuh"\n// A\n'), ("k_b", "// b\n"))),  # one source byte
    dict(sources=(("k_a", '#include "jm_common.cuh"\n// a\n'),)),  # one source fewer
    dict(sources=(("k_x", '#include "jm_common.cuh"\n// a\n'), ("k_b", "// b\n"))),  # a stem renamed
    dict(flags=("-DJM_DEBUG=1",)),
    dict(cc=(9, 0)),
    dict(family="moe"),
    dict(key=(("dtype", "bf16"), ("weight", "u4b8"), ("group", "g128"))),
])
def test_hash_changes_with_every_input(change):
    base = make_spec()
    other = make_spec(**change)
    assert other.source_hash() != base.source_hash()
    assert other.module_hash("13.0.88") != base.module_hash("13.0.88")


def test_nvcc_version_changes_the_module_hash_only():
    s = make_spec()
    assert s.module_hash("13.0.88") != s.module_hash("13.0.48")
    assert s.module_name("13.0.88") != s.module_name("13.0.48")
    assert make_spec().source_hash() == s.source_hash()  # source hash has no compiler in it


def test_a_header_byte_changes_the_hash(src_copy):
    before = make_spec().source_hash()
    assert make_spec().source_hash() == before  # deterministic over the copy
    hdr = src_copy / "jm_dequant.cuh"
    data = bytearray(hdr.read_bytes())
    data[len(data) // 2] ^= 0x01
    hdr.write_bytes(bytes(data))
    assert make_spec().source_hash() != before


def test_new_header_changes_the_hash_but_other_files_do_not(src_copy):
    before = make_spec().source_hash()
    (src_copy / "NOTES.txt").write_text("not a source\n")
    assert make_spec().source_hash() == before
    (src_copy / "jm_extra.cuh").write_text("// new header\n")
    assert make_spec().source_hash() != before


def test_hash_is_memoized_per_spec_object(src_copy):
    s = make_spec()
    h = s.source_hash()
    (src_copy / "jm_extra.cuh").write_text("// changed after the first hash\n")
    assert s.source_hash() == h  # the same object keeps its hash (one process = one source tree)
    assert make_spec().source_hash() != h


def test_versions_are_part_of_the_hash(monkeypatch):
    import torch

    before = make_spec().source_hash()
    monkeypatch.setattr(spec_mod, "__version__", "999.0")
    assert make_spec().source_hash() != before
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert make_spec().source_hash() != before


def test_missing_sources_are_a_clear_error(tmp_path, monkeypatch):
    fake_pkg = tmp_path / "site" / "jitmarlin" / "jit"
    fake_pkg.mkdir(parents=True)
    monkeypatch.setattr(spec_mod, "__file__", str(fake_pkg / "spec.py"))
    source_dir.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="reinstall jitmarlin") as ei:
            source_dir()
        assert str(tmp_path / "site" / "jitmarlin") in str(ei.value)
    finally:
        monkeypatch.undo()
        source_dir.cache_clear()
    assert (source_dir() / "jm_common.cuh").is_file()
