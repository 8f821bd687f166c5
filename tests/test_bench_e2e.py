"""benchmarks/bench_e2e.py on the CPU: the whole measurement path with tiny models (--smoke).

jitmarlin's kernel entry points are replaced by the plain-PyTorch references of
test_model_cpu.py (its `cpu_kernels` fixture), and CUDA is hidden, so the script runs its CPU
branch on any machine: model build, quantize_model, prefill timing, the static-cache greedy
decode loop (eager), the tables and the JSON. The CUDA-graph decode path needs a GPU; it replays
the same `Decoder.step`, whose correctness is checked here against a cache-free recomputation.

Skips when transformers is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from .test_model_cpu import cpu_kernels  # noqa: F401 - the fixture, used by name below

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_e2e.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_e2e", None)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


BATCHES = [1, 2]
CASES = [(8, 4), (16, 4), (8, 6)]  # --prefill 8,16 --decode 4,6 --base-prefill 8 --base-decode 4
VARIANT_LABELS = ["fp16", "jitmarlin W4 g128", "jitmarlin W4 g128 fused", "jitmarlin W4 g128 act_order"]


def test_smoke_runs_every_case_on_cpu(bench, cpu_kernels, no_cuda, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "e2e.json"
    result = bench.main(["--smoke", "--batches", ",".join(map(str, BATCHES)), "--prefill", "8,16", "--decode", "4,6",
                         "--base-prefill", "8", "--base-decode", "4", "--prefill-reps", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert result["failures"] == [], result["failures"]
    assert result["skipped"] == [] and result["complete"]
    assert cpu_kernels["gemm"] > 0 and cpu_kernels["moe"] > 0  # the quantized models ran through the kernel entries

    saved = json.loads(out.read_text())
    assert saved["complete"] and saved["env"]["device"] == "cpu" and saved["env"]["transformers"]
    assert sorted(map(tuple, saved["cases"])) == sorted(CASES)
    rows = saved["rows"]
    models = sorted({r["model"] for r in rows})
    assert models == ["tiny Llama (2 layers)", "tiny Mixtral (2 layers)"]
    got = {(r["model"], r["variant"], r["batch"], r["prefill_len"], r["decode_len"]) for r in rows}
    want = {(m, v, b, p, d) for m in models for v in VARIANT_LABELS for b in BATCHES for p, d in CASES}
    assert got == want and len(rows) == len(want)
    for r in rows:
        for key in ("prefill_tok_s", "decode_tok_s", "prefill_ms", "decode_ms_per_step"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["weight_memory_bytes"] > 0
        assert r["peak_memory_bytes"] is None  # no CUDA: not measured
        assert r["decode_mode"] == "eager" and r["prefill_mode"] == "eager"

    # ratios: every quantized row against the fp16 row of the same model, batch and lengths
    ratios = saved["ratios"]
    assert len(ratios) == len(want) - len(models) * len(BATCHES) * len(CASES)
    for q in ratios:
        assert q["variant"] != "fp16"
        assert q["decode_speedup"] > 0 and q["prefill_ratio"] > 0
        assert 0 < q["weight_memory_ratio"] < 1  # W4 linears and experts, fp16 embeddings and lm_head

    assert not any("still referenced" in n for n in saved["notes"])
    for header in ("| Model | Variant | Batch | Prefill len | Decode len | Prefill tok/s | Decode tok/s | "
                   "Peak memory | Weight memory | mode |", "Decode speedup vs fp16", "Summary"):
        assert header in printed
    assert saved["table"] in printed and saved["ratio_table"] in printed


def test_variant_failure_is_reported_not_raised(bench, no_cuda, tmp_path):
    """Without the reference kernels the quantized models cannot run on the CPU: those variants
    are listed as failures with the reason, the fp16 rows are still measured."""
    result = bench.main(["--smoke", "--models", "llama", "--variants", "fp16,w4", "--batches", "1", "--prefill", "8",
                         "--decode", "4", "--base-prefill", "8", "--base-decode", "4", "--prefill-reps", "1",
                         "--json", str(tmp_path / "e2e.json")])
    assert [r["variant"] for r in result["rows"]] == ["fp16"]
    assert len(result["failures"]) == 1 and result["failures"][0]["variant"] == "jitmarlin W4 g128"
    assert result["failures"][0]["error"]


@pytest.mark.parametrize("key", ["llama", "mixtral"])
def test_decoder_matches_cache_free_greedy(bench, key):
    """The static-cache decode step (4-D mask, positions, cache write position advanced on the
    device) gives the logits of a plain forward over the whole sequence so far, step after step,
    and reset() restarts the same sequence."""
    spec = bench.SMOKE_SPECS[key]
    model = bench.build_model(spec, torch.device("cpu"), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(10)  # std 0.2: attention and positions change the logits clearly
        api = bench.ModelAPI(model)
        ids = torch.randint(0, spec.vocab, (2, 7), generator=torch.Generator().manual_seed(0))
        dec = bench.Decoder(model, api, ids, 5)
        assert dec.length == 16  # 7 + 5 rounded up to 16
        seq, logits = ids, []
        tokens = [dec.first]
        for _ in range(5):
            logits.append(dec.step().float())
            tokens.append(dec.tok.clone())
        for i in range(5):
            seq = torch.cat([seq, tokens[i]], dim=1)
            ref = model(input_ids=seq, use_cache=False).logits[:, -1].float()
            err = ((logits[i] - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (i, err)
            assert torch.equal(tokens[i + 1], logits[i].argmax(-1, keepdim=True))  # greedy: its argmax is fed back
        dec.reset()
        again = dec.step().float()
        assert torch.allclose(again, logits[0], atol=1e-3, rtol=0)
        # a wrong position makes a clear difference (the comparison above is sensitive to it)
        dec.reset()
        dec.posid.add_(3)
        shifted = dec.step().float()
        assert (shifted - logits[0]).abs().max() / logits[0].abs().max() > 5e-2


def test_compiled_decoder_matches_eager(bench):
    """--compile: the decode step through torch.compile (inductor; on the CPU here) gives the
    eager step's logits and tokens, step after step, and its parse flag is off by default."""
    spec = bench.SMOKE_SPECS["llama"]
    model = bench.build_model(spec, torch.device("cpu"), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(10)
        api = bench.ModelAPI(model)
        ids = torch.randint(0, spec.vocab, (2, 7), generator=torch.Generator().manual_seed(0))
        compiled = bench.Decoder(model, api, ids, 5, bench.compiled_forward(model))
        assert compiled.forward is not model
        eager = bench.Decoder(model, api, ids, 5)
        for i in range(5):
            got, ref = compiled.step().float(), eager.step().float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (i, err)
            assert torch.equal(compiled.tok, eager.tok), i
    assert bench.parse_args([]).compile is False and bench.parse_args(["--compile"]).compile is True


def test_cases_and_arguments(bench):
    args = bench.parse_args([])
    assert bench.cases_for(args) == [(128, 32), (128, 128), (128, 256), (128, 1024), (512, 128), (1024, 128),
                                     (2048, 128)]
    args = bench.parse_args(["--full"])
    assert len(bench.cases_for(args)) == 64 and (4096, 4096) in bench.cases_for(args)
    args = bench.parse_args(["--layers-mixtral", "8", "--models", "mixtral"])
    spec = bench.model_specs(args)["mixtral"]
    assert spec.layers == 8 and spec.label == "Mixtral-8x7B (8 of 32 layers)"
    assert bench.model_specs(bench.parse_args([]))["llama"].label == "Llama-2-7B (32 layers)"
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "gpt2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--batches", "1,x"])


def test_no_gpu_without_smoke_is_a_clear_error(bench, no_cuda):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main([])


def test_check_steps_stops_after_a_token_divergence(bench):
    E = bench
    r = [torch.tensor([[1.0, 0.999, 0.0]]), torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[5.0, 0.0, 0.0]])]
    # identical: all steps compared, no difference
    assert E.check_steps([t.clone() for t in r], r) == (0.0, 3)
    # a near tie swaps the argmax at step 1: step 1 is compared (small difference), later steps not
    g = [torch.tensor([[0.999, 1.0, 0.0]]), torch.tensor([[9.0, -9.0, 9.0]]), torch.tensor([[0.0, 0.0, 7.0]])]
    diff, compared = E.check_steps(g, r)
    assert compared == 1 and diff == pytest.approx(0.001, rel=1e-3)
    # same tokens but a large difference is reported, not hidden
    g = [r[0].clone(), torch.tensor([[0.0, 1.0, 0.5]]), r[2].clone()]
    diff, compared = E.check_steps(g, r)
    assert compared == 3 and diff == pytest.approx(0.5)


def test_default_cases_per_model(bench):
    args = bench.parse_args([])
    assert bench.cases_for(args, "llama") == sorted({(p, 128) for p in (128, 512, 1024, 2048)} |
                                                    {(128, d) for d in (32, 256, 1024)})
    assert (128, 1024) not in bench.cases_for(args, "mixtral") and (128, 256) in bench.cases_for(args, "mixtral")
    given = bench.parse_args(["--decode", "32,1024"])
    assert (128, 1024) in bench.cases_for(given, "mixtral")  # lengths given: the same for every model
