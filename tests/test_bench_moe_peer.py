"""benchmarks/bench_moe.py's Humming column on the CPU: the flags, the table / JSON builder with and
without Humming times, and the pieces of the Humming MoE adapter (benchmarks/peers.py) that need no
GPU: the routing -> indexed-tables conversion, the expert packing, the output check, and the adapter's
wiring (plan / up / down) against a stand-in layer that computes Humming's indexed GEMM as we read it
(row r of block b: activation row sorted_ids[b*M + r] // top_k, expert expert_ids[b], output row
sorted_ids[b*M + r]; humming/include/humming/scheduler.cuh, epilogue/pipeline.cuh)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"

OLD_KEYS = ["shape", "tokens", "jitmarlin_graph_us", "jitmarlin_eager_us", "fp16_loop_us", "bf16_grouped_mm_us",
            "x_loop", "x_grouped", "floor_us", "x_floor", "rel_err"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    saved = {n: sys.modules.get(n) for n in ("bench_moe", "peers", "common")}
    module = _load("bench_moe")
    yield module
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


@pytest.fixture(scope="module")
def peers(bench):
    return sys.modules["peers"]


# ---------------------------------------------------------------------------------------------------------
# flags


def test_humming_is_on_by_default(bench):
    args = bench.parse_args([])
    assert args.humming is True
    assert args.token_list == [1, 16, 64, 256, 1024] and args.shape_list == ["mixtral", "e64"]


@pytest.mark.parametrize("argv", [["--no-humming"], ["--peers", "none"], ["--peers", ""],
                                  ["--peers", "humming", "--no-humming"]])
def test_humming_can_be_left_out(bench, argv):
    assert bench.parse_args(argv).humming is False


def test_peers_humming_and_other_flags(bench):
    args = bench.parse_args(["--peers", "humming", "--tokens", "1,16,64", "--json", "out.json", "--shapes", "e64"])
    assert args.humming is True and args.token_list == [1, 16, 64] and args.json == "out.json"
    assert args.shape_list == ["e64"]


@pytest.mark.parametrize("argv", [["--peers", "gemlite"], ["--peers", "humming,bogus"], ["--shapes", "llama"],
                                  ["--tokens", "1,x"], ["--tokens", "0"]])
def test_bad_flags_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# table and JSON


def _case(shape, tokens, ours, humming=None, error=None):
    c = {"shape": shape, "tokens": tokens, "jitmarlin_graph_us": ours, "jitmarlin_eager_us": 3 * ours,
         "fp16_loop_us": 10 * ours, "bf16_grouped_mm_us": 5 * ours, "floor_us": ours / 2, "rel_err": 1e-3}
    if humming is not None:
        c["humming_2gemm_us"] = humming
    if error is not None:
        c["humming_2gemm_us"] = None
        c["humming_error"] = error
    return c


def _header(table):
    return [h.strip() for h in table.splitlines()[0].strip("|").split("|")]


def _body(table):
    return [[v.strip() for v in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_report_with_humming_times(bench):
    cases = [_case("mixtral", 1, 50.0, humming=80.0), _case("mixtral", 16, 100.0, humming=90.0),
             _case("e64", 1, 20.0, error="check failed, not timed: relative error 0.9")]
    table, rows, summary = bench.report(cases)
    header = _header(table)
    assert header == ["shape", "tokens", "jitmarlin µs (graph)", "jitmarlin µs (eager)", "fp16 loop µs",
                      "bf16 grouped_mm µs", "Humming 2 GEMMs µs", "× loop", "× grouped", "× Humming",
                      "W4 floor µs", "÷ floor", "rel err vs fp16 loop"]
    body = _body(table)
    assert len(body) == 3
    hu, xh = header.index("Humming 2 GEMMs µs"), header.index("× Humming")
    assert body[0][hu] == "80.0" and body[0][xh] == "1.60"  # 80 / 50: we are 1.6x faster
    assert body[1][hu] == "90.0" and body[1][xh] == "0.90"  # Humming faster here
    assert body[2][hu] == "–" and body[2][xh] == "–"
    for r in rows:
        assert set(OLD_KEYS) <= set(r)  # the JSON keys of before are all still there
        assert "humming_2gemm_us" in r and "x_humming" in r
    assert rows[0]["x_humming"] == pytest.approx(1.6) and rows[1]["x_humming"] == pytest.approx(0.9)
    assert rows[0]["x_loop"] == pytest.approx(10.0) and rows[0]["x_floor"] == pytest.approx(2.0)
    assert rows[2]["x_humming"] is None and "relative error" in rows[2]["humming_error"]
    assert summary["columns"] is True and summary["skip"] is None
    assert summary["faster_everywhere"] is False
    assert summary["slower"] == ["mixtral T=16"] and summary["missing"] == ["e64 T=1"]
    assert "NO" in summary["text"] and "mixtral T=16" in summary["text"]
    json.dumps({"rows": rows, "summary": summary})  # the JSON writer must take them


def test_report_faster_everywhere(bench):
    _, rows, summary = bench.report([_case("mixtral", 1, 50.0, humming=60.0), _case("e64", 64, 10.0, humming=11.0)])
    assert summary["faster_everywhere"] is True and summary["slower"] == [] and summary["missing"] == []
    assert summary["text"].endswith(": yes")
    assert [r["x_humming"] for r in rows] == [pytest.approx(1.2), pytest.approx(1.1)]


def test_report_without_humming_omits_the_columns(bench):
    cases = [_case("mixtral", 1, 50.0), _case("e64", 16, 30.0)]
    table, rows, summary = bench.report(cases, "not installed: no module named 'humming'")
    header = _header(table)
    assert not any("Humming" in h for h in header)
    assert header == [h for h, _ in bench.BASE_COLUMNS]
    assert all(len(line) == len(header) for line in _body(table))
    for r in rows:
        assert list(r) == OLD_KEYS  # the JSON rows of before, unchanged
    assert summary == {"columns": False, "skip": "not installed: no module named 'humming'",
                       "text": "Humming 2 GEMMs column skipped: not installed: no module named 'humming'"}


def test_report_when_humming_ran_nowhere(bench):
    cases = [_case("mixtral", 1, 50.0, error="failed to build: RuntimeError: boom"),
             _case("mixtral", 16, 60.0, error="not run")]
    table, rows, summary = bench.report(cases)
    assert "Humming" not in table.splitlines()[0]
    assert summary["columns"] is False and "failed to build: RuntimeError: boom" in summary["skip"]
    assert "boom" in summary["text"]
    assert all("humming_2gemm_us" not in r for r in rows)


# ---------------------------------------------------------------------------------------------------------
# routing -> indexed tables


def _tables_reference(ids, e, bm):
    """Plain loops: expert by expert, its slots in ascending order, padded with T*k to a multiple of bm."""
    flat = ids.flatten().tolist()
    n = len(flat)
    sorted_ids, expert_ids = [], []
    for ex in range(e):
        slots = [s for s in range(n) if flat[s] == ex]
        nb = -(-len(slots) // bm)
        sorted_ids += slots + [n] * (nb * bm - len(slots))
        expert_ids += [ex] * nb
    num_padded = len(sorted_ids)
    length = n + e * (bm - 1)
    sorted_ids += [n] * (length - num_padded)
    expert_ids += [e - 1] * (-(-length // bm) - len(expert_ids))
    return sorted_ids, expert_ids, num_padded


def _routing(gen, t, e, k, skewed):
    if skewed:  # most slots on expert 0, several experts empty
        ids = torch.zeros(t, k, dtype=torch.int64)
        if k > 1:
            ids[:, 1:] = torch.randint(1, max(2, e // 3), (t, k - 1), generator=gen)
        return ids
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("bm", [1, 4, 8, 16, 64])
def test_indexed_tables_match_the_reference(peers, seed, bm):
    gen = torch.Generator().manual_seed(seed)
    t = int(torch.randint(1, 200, (1,), generator=gen))
    e = int(torch.randint(2, 70, (1,), generator=gen))
    k = int(torch.randint(1, min(e, 8) + 1, (1,), generator=gen))
    ids = _routing(gen, t, e, k, skewed=seed % 3 == 0)
    for dtype in (torch.int64, torch.int32):
        sorted_ids, expert_ids, num_padded = peers.indexed_tables(ids.to(dtype), e, bm)
        assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
        assert num_padded.shape == (1,)
        ref_sorted, ref_experts, ref_padded = _tables_reference(ids, e, bm)
        assert sorted_ids.tolist() == ref_sorted
        assert expert_ids.tolist() == ref_experts
        assert int(num_padded) == ref_padded


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bm", [8, 16, 64])
def test_indexed_tables_equal_our_align(peers, seed, bm):
    """Same contract as jitmarlin's moe_align_block_size (its torch path here): the same tables."""
    from jitmarlin.ops.moe import moe_align_block_size

    gen = torch.Generator().manual_seed(100 + seed)
    t, e, k = [int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 300), (8, 65), (1, 7))]
    ids = _routing(gen, t, e, k, skewed=seed == 0)
    ours = moe_align_block_size(ids, bm, e)
    theirs = peers.indexed_tables(ids, e, bm)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_indexed_tables_refuse_bad_input(peers):
    with pytest.raises(ValueError, match="expert ids"):
        peers.indexed_tables(torch.tensor([[0, 8]]), 8, 16)
    with pytest.raises(ValueError, match="expert ids"):
        peers.indexed_tables(torch.tensor([[-1, 2]]), 8, 16)
    with pytest.raises(ValueError):
        peers.indexed_tables(torch.tensor([0, 1]), 8, 16)
    with pytest.raises(ValueError):
        peers.indexed_tables(torch.tensor([[0.0, 1.0]]), 8, 16)
    with pytest.raises(ValueError):
        peers.indexed_tables(torch.tensor([[0, 1]]), 8, 0)


# ---------------------------------------------------------------------------------------------------------
# expert packing and the output check


def test_humming_expert_tensors_layout(peers):
    gen = torch.Generator().manual_seed(3)
    k, n, g = 256, 24, 128
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    s = torch.rand(k // g, n, generator=gen).half()
    w, sc = peers.humming_expert_tensors(q, s)
    assert w.dtype == torch.int32 and tuple(w.shape) == (n, k // 8)
    assert sc.dtype == torch.float16 and tuple(sc.shape) == (n, k // g) and sc.is_contiguous()
    words = w.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(n, k)  # value k at 4*(k%8)
    assert torch.equal(nibbles.t().to(torch.int32), q)
    assert torch.equal(sc, s.t())


def _moe_problem(seed=0, e=4, h=32, inter=16, t=5, k=2):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, h, generator=gen)
    w2 = torch.randn(e, h, inter, generator=gen)
    x = torch.randn(t, h, generator=gen)
    act = torch.randn(t * k, inter, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return w13, w2, x, act, ids


def _dense_reference(x, act, ids, w13, w2):
    k = ids.shape[1]
    flat = ids.flatten()
    o13 = torch.stack([x[s // k] @ w13[flat[s]].t() for s in range(flat.numel())])
    o2 = torch.stack([act[s] @ w2[flat[s]].t() for s in range(flat.numel())])
    return o13, o2


def test_check_humming_moe_accepts_right_and_catches_wrong(peers):
    w13, w2, x, act, ids = _moe_problem()
    o13, o2 = _dense_reference(x, act, ids, w13, w2)
    ok = peers.check_humming_moe(o13, o2, x, act, ids, w13, w2)
    assert ok["ok"] and ok["error"] is None and ok["slots"] == ids.numel()
    assert ok["rel_err13"] < 1e-5 and ok["rel_err2"] < 1e-5
    # A rows taken as slot % T instead of slot // k (a wrong top_k convention)
    t, k = ids.shape
    flat = ids.flatten()
    wrong13 = torch.stack([x[s % t] @ w13[flat[s]].t() for s in range(t * k)])
    bad = peers.check_humming_moe(wrong13, o2, x, act, ids, w13, w2)
    assert not bad["ok"] and "relative error" in bad["error"] and bad["rel_err13"] > 0.1
    # every slot on expert 0's weights
    bad2 = peers.check_humming_moe(o13, torch.stack([act[s] @ w2[0].t() for s in range(t * k)]), x, act, ids, w13, w2)
    assert not bad2["ok"] and bad2["rel_err2"] > 0.1
    shape = peers.check_humming_moe(o13[:-1], o2, x, act, ids, w13, w2)
    assert not shape["ok"] and "outputs" in shape["error"]
    nan = o13.clone()
    nan[0, 0] = float("nan")
    assert "non-finite" in peers.check_humming_moe(nan, o2, x, act, ids, w13, w2)["error"]


def test_check_humming_moe_samples_large_cases(peers):
    w13, w2, x, act, ids = _moe_problem(seed=1, t=100, k=2)
    o13, o2 = _dense_reference(x, act, ids, w13, w2)
    res = peers.check_humming_moe(o13, o2, x, act, ids, w13, w2, max_slots=16)
    assert res["ok"] and res["slots"] == 16
    o13[-1] += 100.0  # the last slot is always among the samples
    assert not peers.check_humming_moe(o13, o2, x, act, ids, w13, w2, max_slots=16)["ok"]


def test_make_humming_moe_reports_instead_of_raising(peers):
    w = torch.zeros(2, 32, 8, dtype=torch.int32)
    assert peers.make_humming_moe(w, torch.ones(2, 32, 1).half(), torch.zeros(2, 64, 2, dtype=torch.int32),
                                  torch.ones(2, 64, 1).half(), 64, device="cpu") is None
    assert "CUDA" in peers.unavailable[peers.HUMMING_MOE]


# ---------------------------------------------------------------------------------------------------------
# the adapter's wiring, against a stand-in for HummingLayer's indexed GEMM


class FakeIndexedLayer:
    """Computes what HummingLayer.forward does in indexed mode (as we read humming's kernel), in torch."""

    def __init__(self, w, tag):
        self.w = w  # [E, N, K] float
        self.humming_config = tag
        self.calls = []

    def __call__(self, inputs, outputs=None, sorted_ids=None, expert_ids=None, num_tokens_padded=None, top_k=1,
                 compute_config=None, tuning_config=None):
        assert json.loads(compute_config) == {"gemm_type": "indexed"}
        bm = json.loads(tuning_config)["block_shape"][0]
        self.calls.append({"top_k": top_k, "block_m": bm, "rows": inputs.shape[0]})
        assert tuple(outputs.shape) == (inputs.shape[0] * top_k, self.w.shape[1])
        npad = int(num_tokens_padded[0])
        assert npad % bm == 0 and npad <= sorted_ids.numel()
        for b in range(npad // bm):
            ex = int(expert_ids[b])
            for r in range(bm):
                sid = int(sorted_ids[b * bm + r])
                if sid < outputs.shape[0]:  # the sentinel T*k marks padding
                    outputs[sid] = inputs[sid // top_k] @ self.w[ex].t()
        return outputs


@pytest.fixture
def fake_tune(monkeypatch):
    """humming.tune.get_heuristics_config stand-in: block_m 16 for the up GEMM, 8 for the down GEMM."""
    calls = []

    def get_heuristics_config(layer_config, shape_m=None, gemm_type="dense", device=None, **_):
        calls.append((layer_config, shape_m, gemm_type))
        return {"block_shape": (16 if layer_config == "w13" else 8, 128, 64), "warp_shape": (16, 32, 64)}

    humming = types.ModuleType("humming")
    tune = types.ModuleType("humming.tune")
    tune.get_heuristics_config = get_heuristics_config
    humming.tune = tune
    monkeypatch.setitem(sys.modules, "humming", humming)
    monkeypatch.setitem(sys.modules, "humming.tune", tune)
    return calls


@pytest.mark.parametrize("t,k", [(1, 2), (5, 2), (37, 6)])
def test_adapter_wiring_on_a_stand_in(peers, fake_tune, t, k):
    e, h, inter = 8, 32, 16
    w13, w2, x, act, ids = _moe_problem(seed=t, e=e, h=h, inter=inter, t=t, k=k)
    l13, l2 = FakeIndexedLayer(w13, "w13"), FakeIndexedLayer(w2, "w2")
    hm = peers.HummingMoE(l13, l2, e, h, inter, 128, torch.device("cpu"), torch.float32, "fake")
    plan = hm.plan(ids)
    assert [c[1:] for c in fake_tune] == [(t * k, "indexed"), (t * k, "indexed")]  # M = tokens * top_k
    assert plan.block_m13 == 16 and plan.block_m2 == 8 and sorted(plan.tables) == [8, 16]
    o13, o2 = hm.run(plan, x, act)
    assert l13.calls == [{"top_k": k, "block_m": 16, "rows": t}]
    assert l2.calls == [{"top_k": 1, "block_m": 8, "rows": t * k}]
    res = peers.check_humming_moe(o13, o2, x, act, ids, w13, w2)
    assert res["ok"], res
    s = plan.summary()
    assert s["block_m13"] == 16 and s["block_m2"] == 8 and s["tokens"] == t and s["top_k"] == k
    json.dumps(s)
    assert "indexed" in hm.note and "uint4" in hm.note


def test_adapter_refuses_a_config_without_block_shape(peers, monkeypatch):
    tune = types.ModuleType("humming.tune")
    tune.get_heuristics_config = lambda *a, **kw: [[0, 8, {"block_shape": (16, 128, 64)}]]
    monkeypatch.setitem(sys.modules, "humming", types.ModuleType("humming"))
    monkeypatch.setitem(sys.modules, "humming.tune", tune)
    layer = types.SimpleNamespace(humming_config="w13")
    hm = peers.HummingMoE(layer, layer, 4, 32, 16, 128, torch.device("cpu"), torch.float32, "fake")
    with pytest.raises(RuntimeError, match="expected one config dict"):
        hm.plan(torch.zeros(3, 2, dtype=torch.int64))
