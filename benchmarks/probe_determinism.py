"""Are repeated GEMMs and forwards bit-identical? (Session 19: it found the wgmma stream-K bug —
five forwards of a small W4 Llama differed, NaN at 24 tokens, only with the wgmma kernel on;
benchmarks/NOTES.md. tests/gpu/test_model_gpu.py::test_repeated_forwards_are_bit_identical keeps
the model check.)

    python benchmarks/probe_determinism.py            # every switch setting in a subprocess each
    python benchmarks/probe_determinism.py --one      # this process's settings only

Per setting: (1) op level: each layer shape of the small Llama (K x N: 512x512, 512x1408, 1408x512,
fused 512x1536 and 512x2816) at M = 1, 24, 200, called 30 times back to back and 30 times
interleaved with the other shapes, against its first result; (2) the model: fp16, W4
(quantize_model), W4 + fuse_projections, five forwards at 1 and 24 tokens."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

SETTINGS = (("default", {}), ("PDL=0", {"JITMARLIN_PDL": "0"}), ("WGMMA=0", {"JITMARLIN_WGMMA": "0"}),
            ("CLUSTER=0", {"JITMARLIN_CLUSTER": "0"}), ("PDL=0 WGMMA=0", {"JITMARLIN_PDL": "0", "JITMARLIN_WGMMA": "0"}))
SHAPES = ((512, 512), (512, 1408), (1408, 512), (512, 1536), (512, 2816))


def ops(label: str) -> None:
    import jitmarlin

    layers = {}
    for k, n in SHAPES:
        torch.manual_seed(k + n)
        lin = torch.nn.Linear(k, n, bias=False, dtype=torch.float16, device="cuda")
        layers[(k, n)] = jitmarlin.MarlinLinear.from_linear(lin, bits=4, group_size=128)
    for m in (1, 24, 200):
        xs = {s: torch.randn(m, s[0], device="cuda", dtype=torch.float16) for s in SHAPES}
        refs = {s: layers[s](xs[s]) for s in SHAPES}
        torch.cuda.synchronize()
        bad = {s: [0, 0, 0] for s in SHAPES}  # back-to-back mismatches, interleaved mismatches, NaN outputs
        for s in SHAPES:
            outs = [layers[s](xs[s]) for _ in range(30)]
            for y in outs:
                bad[s][0] += not torch.equal(y, refs[s])
                bad[s][2] += bool(torch.isnan(y).any())
        for _ in range(30):
            outs = [(s, layers[s](xs[s])) for s in SHAPES]
            for s, y in outs:
                bad[s][1] += not torch.equal(y, refs[s])
                bad[s][2] += bool(torch.isnan(y).any())
        # the general path (the custom op) too
        gen = {s: [jitmarlin.marlin_gemm(xs[s], layers[s].qweight, layers[s].scales) for _ in range(10)] for s in SHAPES}
        for s in SHAPES:
            refnan = bool(torch.isnan(refs[s]).any())
            g = sum(not torch.equal(y, refs[s]) for y in gen[s])
            print(f"determinism [{label}] op K={s[0]} N={s[1]} M={m}: back-to-back {bad[s][0]}/30 differ, "
                  f"interleaved {bad[s][1]}/30, general path {g}/10, NaN outputs {bad[s][2]}, ref NaN {refnan}",
                  flush=True)


def model(label: str) -> None:
    import transformers

    import jitmarlin

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=1000)
    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    ids = {t: torch.randint(0, 1000, (1, t), device="cuda") for t in (1, 24)}
    for name, step in (("fp16", None), ("W4", lambda m: jitmarlin.quantize_model(m, bits=4, group_size=128)),
                       ("W4 fused", jitmarlin.fuse_projections)):
        if step is not None:
            step(net)
        for t, x in ids.items():
            with torch.no_grad():
                outs = [net(input_ids=x).logits for _ in range(5)]
            same = sum(torch.equal(outs[0], o) for o in outs[1:])
            nans = sum(bool(torch.isnan(o).any()) for o in outs)
            print(f"determinism [{label}] model {name} tokens={t}: {same}/4 forwards equal the first, "
                  f"{nans}/5 with NaN", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", default=None, help="run in this process with this label")
    args = ap.parse_args()
    if args.one is not None:
        ops(args.one)
        model(args.one)
        return
    for label, env in SETTINGS:
        subprocess.run([sys.executable, __file__, "--one", label], env={**os.environ, **env}, timeout=150)


if __name__ == "__main__":
    main()
