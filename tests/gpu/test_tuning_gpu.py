"""`jitmarlin tune` on the GPU: real timings on a small problem set, the stored table, and the
GEMM then running (correctly) with the tuned config first."""

from __future__ import annotations

import pytest
import torch

import jitmarlin
from jitmarlin import cli
from jitmarlin.ops import gemm as G
from jitmarlin.ops import tuning as T

from .helpers import check_close, random_weights


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    # a private cache: the kernels get built there too (a few seconds)
    monkeypatch.setenv("JITMARLIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("JITMARLIN_TUNE", raising=False)
    T.invalidate()
    yield tmp_path / "cache"
    T.invalidate()


def test_cli_tune_stores_a_table_the_gemm_uses(cache_dir, capsys):
    assert cli.main(["tune", "--shapes", "1024x2048", "--m", "1,16"]) == 0
    out = capsys.readouterr().out
    assert "stored" in out and "w8/small" in out and "m1/small" in out
    info = G.device_info(torch.cuda.current_device())
    table = T.read_table(info)
    assert table is not None and set(table["choices"]) == {"w8/small", "m1/small"}
    assert all(r["us"] > 0 for r in table["measurements"])
    packed, w = random_weights(1024, 2048, 4, 128)
    for m in (1, 16):
        launch = G.prepare_launch(m, m, 2048, 1024, jitmarlin.ops._kernels.Family("f16", 4, False, 128),
                                  torch.cuda.current_device())
        want = T.parse_tag(table["choices"][T.class_key(m, 2048, 1024)]["config"], info.cc)
        assert (launch.plan.tile, launch.plan.nwarps) == want
        a = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
        check_close(jitmarlin.marlin_gemm(a, packed.b, packed.scales), a.float() @ w, 1e-3, f"tuned M={m}")
    assert cli.main(["tune", "--show"]) == 0 and "w8/small" in capsys.readouterr().out
    assert cli.main(["tune", "--reset"]) == 0 and "removed" in capsys.readouterr().out
    assert T.read_table(info) is None
