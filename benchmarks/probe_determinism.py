"""Are repeated forwards of a small Llama bit-identical? fp16, then W4 (quantize_model), then W4
with fuse_projections; five forwards each at 1, 24 and 200 tokens. (Session 19: a test saw the
logits of a fused W4 Llama differ between two forwards; this says whether the model is
nondeterministic without any of jitmarlin's options.)"""

from __future__ import annotations

import torch
import transformers

import jitmarlin


def runs(model, ids, n=5):
    with torch.no_grad():
        outs = [model(input_ids=ids).logits for _ in range(n)]
    return all(torch.equal(outs[0], o) for o in outs[1:]), max((outs[0] - o).abs().max().item() for o in outs[1:])


def main() -> None:
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=1000)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    ids = {t: torch.randint(0, 1000, (1, t), device="cuda") for t in (1, 24, 200)}
    for label, step in (("fp16", None), ("W4", lambda m: jitmarlin.quantize_model(m, bits=4, group_size=128)),
                        ("W4 fused", jitmarlin.fuse_projections)):
        if step is not None:
            step(model)
        for t, x in ids.items():
            same, diff = runs(model, x)
            print(f"determinism {label} tokens={t}: five forwards bit-identical={same} max |diff|={diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
