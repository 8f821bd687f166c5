"""`jitmarlin tune` on the CPU: the choice per problem class from timings (a fake timer here; the
real one is tests/gpu/test_tuning_gpu.py), the stored table (atomic, private, ignored with a
warning when unreadable or for another GPU), and the GEMM's plan taking the tuned config first."""

from __future__ import annotations

import json
import os
import stat

import pytest

from jitmarlin import cli
from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.ops import tuning as T

INFO = T.DeviceInfo("Fake GPU 80GB", (9, 0), 132, 232448 - G.SMEM_RESERVE)
FAM = K.Family("f16", 4, False, 128)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", str(root))
    monkeypatch.delenv("JITMARLIN_TUNE", raising=False)
    T.invalidate()
    yield root
    T.invalidate()


def test_candidates_are_runnable_configs_of_the_class():
    for m, rows in ((1, 8), (8, 8), (16, 16), (32, 32), (48, 48), (64, 64), (300, 64)):
        cands = T.candidates(m, 4096, 4096, INFO, FAM)
        assert cands, m
        for tile, w in cands:
            assert tile.rows == rows and 4096 % tile.tile_k == 0 and (4096 // 64) % w == 0
            assert w <= tile.max_warps and K.smem_bytes(FAM, tile, w) <= INFO.smem_per_block
    # the sm_90 bulk-copy tiles only where they exist
    assert any(t.bulk for t, _ in T.candidates(1, 4096, 4096, INFO, FAM))
    a100 = T.DeviceInfo("Fake A100", (8, 0), 108, 166912 - G.SMEM_RESERVE)
    assert not any(t.bulk for t, _ in T.candidates(1, 4096, 4096, a100, FAM))


def test_choose_uses_mean_relative_slowdown_over_common_configs():
    # by total time b would win (920 < 1010 us); relative to each shape's best, a does: one large
    # shape does not outvote the others
    tag, slowdown = T.choose({(1, 1): {"a": 10.0, "b": 20.0}, (2, 2): {"a": 1000.0, "b": 900.0}})
    assert tag == "a" and slowdown == pytest.approx((1 + 1000 / 900) / 2)
    # c is fastest where it exists but cannot run (2, 2): never chosen
    assert T.choose({(1, 1): {"a": 10.0, "b": 12.0, "c": 5.0}, (2, 2): {"a": 100.0, "b": 90.0}})[0] == "a"
    assert T.choose({(1, 1): {"a": 1.0}, (2, 2): {"b": 1.0}}) is None
    assert T.choose({}) is None


def _target(m, n, k):
    """The config the fake timer favours for a problem: the last candidate of its class."""
    return T.candidates(m, n, k, INFO, FAM)[-1]


def fake_timer(k, n, m, tile, w):
    fav = _target(m, n, k)
    return 10.0 if (tile, w) == fav else 20.0 + w + tile.stages


def test_tune_picks_the_fastest_per_class_and_records_everything():
    shapes, ms = [(4096, 4096), (8192, 28672)], [1, 16, 64]
    table = T.tune(INFO, fake_timer, shapes, ms)
    assert table["format"] == T.FORMAT and table["device"] == INFO.name and table["cc"] == [9, 0]
    assert set(table["choices"]) == {f"{c}/{s}" for c in ("w8", "m1", "m4") for s in ("small", "large")}
    for key, entry in table["choices"].items():
        k, n, m = (int(v) for v in entry["problems"][0].split("x"))
        tile, w = _target(m, n, k)
        assert entry["config"] == T.config_tag(tile, w) and entry["mean_slowdown"] == 1.0
        assert T.parse_tag(entry["config"], INFO.cc) == (tile, w)
    n_cands = sum(len(T.candidates(m, n, k, INFO, FAM)) for k, n in shapes for m in ms)
    assert len(table["measurements"]) == n_cands


def test_tune_skips_configs_that_fail_their_check():
    def timer(k, n, m, tile, w):
        return float("inf") if (tile, w) == _target(m, n, k) else fake_timer(k, n, m, tile, w)

    table = T.tune(INFO, timer, [(4096, 4096)], [1])
    assert table["choices"]["w8/small"]["config"] != T.config_tag(*_target(1, 4096, 4096))
    with pytest.raises(ValueError, match="multiple of 64"):
        T.tune(INFO, fake_timer, [(4096, 100)], [1])


def test_table_round_trip_is_private_and_used_first(cache_dir):
    table = T.tune(INFO, fake_timer, [(4096, 4096)], [1, 64])
    path = T.save_table(table, INFO)
    assert path == T.table_path(INFO) and path.parent.name == "tune" and "sm_90" in str(path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tune-")]  # no temp file left
    assert T.read_table(INFO)["choices"] == table["choices"]
    for m in (1, 64):
        want = _target(m, 4096, 4096)
        assert T.tuned_choice(INFO, m, 4096, 4096) == want
        plan = G.select_plan(m, 4096, 4096, FAM, INFO.smem_per_block, INFO.cc, first=want)
        assert (plan.tile, plan.nwarps) == want
    assert T.tuned_choice(INFO, 1, 28672, 8192) is None  # a class the table does not have
    os.environ["JITMARLIN_TUNE"] = "0"
    try:
        assert T.tuned_choice(INFO, 1, 4096, 4096) is None
    finally:
        del os.environ["JITMARLIN_TUNE"]
    assert T.remove_table(INFO) == path and not path.exists()
    assert T.tuned_choice(INFO, 1, 4096, 4096) is None


def test_bad_tables_are_ignored_with_a_warning(cache_dir):
    path = T.save_table(T.tune(INFO, fake_timer, [(4096, 4096)], [1]), INFO)
    path.write_text("{ not json")
    T.invalidate()
    with pytest.warns(UserWarning, match="ignoring the tuning table"):
        assert T.tuned_choice(INFO, 1, 4096, 4096) is None
    other = dict(json.loads(json.dumps(T.tune(INFO, fake_timer, [(4096, 4096)], [1]))), device="Another GPU")
    path.write_text(json.dumps(other))
    T.invalidate()
    with pytest.warns(UserWarning, match="made for Another GPU"):
        assert T.read_table(INFO) is None
    good = T.tune(INFO, fake_timer, [(4096, 4096)], [1])
    good["choices"]["w8/small"]["config"] = "no_such_tile-w4"
    path.write_text(json.dumps(good))
    T.invalidate()
    assert T.tuned_choice(INFO, 1, 4096, 4096) is None  # unknown config names are skipped


def test_select_plan_ignores_a_first_choice_of_another_m_tile():
    w16 = next(t for t in K.tiles_for((9, 0)) if t.rows == 16)
    plan = G.select_plan(8, 4096, 4096, FAM, INFO.smem_per_block, INFO.cc, first=(w16, 4))
    assert plan.tile.rows == 8  # the MoE kernel needs tile rows == block size


def test_cli_tune_without_gpu_and_bad_shapes(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_gpus", lambda: ([], "no CUDA device (test)"))
    assert cli.main(["tune", "--quick"]) == cli.EXIT_NO_GPU
    assert "no CUDA device (test)" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_gpus", lambda: ([(0, "Fake GPU 80GB", (9, 0))], None))
    assert cli.main(["tune", "--shapes", "4096by4096"]) == cli.EXIT_ERROR
    assert "is not KxN" in capsys.readouterr().err


def test_a_table_in_an_unsafe_directory_is_ignored(cache_dir):
    path = T.save_table(T.tune(INFO, fake_timer, [(4096, 4096)], [1]), INFO)
    path.parent.chmod(0o777)
    try:
        T.invalidate()
        with pytest.warns(UserWarning, match="ignoring the tuning table"):
            assert T.tuned_choice(INFO, 1, 4096, 4096) is None
    finally:
        path.parent.chmod(0o700)


def test_prepare_launch_takes_the_table_only_when_asked(cache_dir, monkeypatch):
    """The dense GEMM uses the tuned config; the MoE kernel (tuned=False) keeps the built-in one: the
    table is measured on dense problems, and on the H200 its M=64 choice made the Mixtral MoE at 1024
    tokens 2x slower."""
    def builtin(m):
        plan = G.select_plan(m, 4096, 4096, FAM, INFO.smem_per_block, INFO.cc)
        return plan.tile, plan.nwarps

    def favourite(m):  # a candidate the built-in order does not pick
        return next(c for c in T.candidates(m, 4096, 4096, INFO, FAM) if c != builtin(m))

    def timer(k, n, m, tile, w):
        return 10.0 if (tile, w) == favourite(m) else 20.0

    T.save_table(T.tune(INFO, timer, [(4096, 4096)], [1, 64]), INFO)
    monkeypatch.setattr(G, "device_info", lambda index: INFO)
    monkeypatch.setattr(G, "_make_launch", lambda plan, rows, n, k, fam, index, allow_cluster=False: plan)
    G.prepare_launch.cache_clear()
    try:
        for m in (1, 64):
            plan = G.prepare_launch(m, m, 4096, 4096, FAM, 0)
            assert (plan.tile, plan.nwarps) == favourite(m)
            plan = G.prepare_launch(m, 4 * m, 4096, 4096, FAM, 0, tuned=False)
            assert (plan.tile, plan.nwarps) == builtin(m)
    finally:
        G.prepare_launch.cache_clear()
