#!/usr/bin/env python
"""Load a GPTQ or AWQ checkpoint into a transformers model with jitmarlin and generate with it.

The model skeleton is built from the checkpoint's config.json with its parameters on the meta
device (jitmarlin.init_empty_weights: no memory, no initialisation), then
jitmarlin.load_quantized repacks every quantized layer (qweight/scales/qzeros/g_idx) into
MarlinLinear / MarlinMoE modules on the GPU and loads the float tensors (embeddings, norms,
lm_head). The quantization settings come from quantize_config.json / quant_config.json or
config.json's quantization_config.

    python examples/load_gptq_checkpoint.py /models/Llama-2-7B-GPTQ --prompt "Hello"
    python examples/load_gptq_checkpoint.py --synthetic          # writes a small random GPTQ checkpoint first

--synthetic needs no download: it builds a random Llama from a config, quantizes its linear
layers with round-to-nearest into the public GPTQ tensor layout (qweight packed along the
input features, v1 qzeros holding zero - 1), writes model.safetensors + config.json +
quantize_config.json into a temporary directory and loads that.

Needs transformers (pip install transformers) and a CUDA GPU of compute capability >= 8.0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Load a GPTQ/AWQ checkpoint with jitmarlin.load_quantized and generate.")
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory (safetensors + config.json + "
                                                 "quantize_config.json); omit with --synthetic")
    p.add_argument("--synthetic", action="store_true", help="write a small random GPTQ checkpoint and load it")
    p.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    p.add_argument("--prompt", default="The capital of France is", help="prompt (when the checkpoint has a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if bool(args.checkpoint) == args.synthetic:
        p.error("give a checkpoint directory or --synthetic (one of the two)")
    return args


def to_gptq(weight, bits: int = 4, group_size: int = 128):
    """RTN-quantize an nn.Linear weight [N, K] into AutoGPTQ (v1, symmetric) tensors."""
    import torch

    import jitmarlin

    qz = jitmarlin.quantize(weight.t().contiguous(), bits=bits, group_size=group_size, sym=True)  # q [K, N]
    k, n = qz.q.shape
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (qz.q.to(torch.int64).reshape(k // per, per, n) << shifts[None, :, None]).sum(1)  # along K
    zeros = torch.full((qz.scales.shape[0], n // per, per), (1 << (bits - 1)) - 1, dtype=torch.int64)  # v1: zero - 1
    zwords = (zeros << shifts).sum(-1)  # along N

    def int32(t):  # the unsigned 32-bit words, stored as int32
        return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)

    return {"qweight": int32(words), "qzeros": int32(zwords), "scales": qz.scales,
            "g_idx": (torch.arange(k) // group_size).to(torch.int32)}


def write_synthetic(directory: Path, transformers) -> None:
    import torch

    from jitmarlin.quant.checkpoint import save_safetensors

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).half()
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            tensors.update({f"{name}.{k}": v for k, v in to_gptq(module.weight.detach()).items()})
    quantized = {k.rpartition(".")[0] for k in tensors}
    for key, value in model.state_dict().items():
        if key.rpartition(".")[0] not in quantized:
            tensors[key] = value
    save_safetensors(tensors, directory / "model.safetensors")
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}
    cfg.quantization_config = qcfg
    cfg.save_pretrained(directory)
    (directory / "quantize_config.json").write_text(json.dumps(qcfg, indent=1))
    print(f"wrote a random 4-bit GPTQ Llama ({len(quantized)} quantized layers) to {directory}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    try:
        import transformers
    except ImportError:
        print("this example needs transformers: pip install transformers", file=sys.stderr)
        return 1
    import jitmarlin

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU: jitmarlin's kernels need one (compute capability >= 8.0); see `jitmarlin info`",
              file=sys.stderr)
        return 1
    dtype = torch.float16 if args.dtype == "f16" else torch.bfloat16
    tmp = None
    if args.synthetic:
        tmp = tempfile.TemporaryDirectory(prefix="jitmarlin-gptq-")
        path = Path(tmp.name)
        write_synthetic(path, transformers)
    else:
        path = Path(args.checkpoint)

    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        # from_config ignores it anyway; dropped so that the model's config does not claim to be a
        # transformers-quantized model (jitmarlin's modules are not that)
        del config.quantization_config
    t0 = time.time()
    with jitmarlin.init_empty_weights():  # parameters on the meta device, buffers (rotary tables) real
        model = transformers.AutoModelForCausalLM.from_config(config)
    report = jitmarlin.load_quantized(model, path, device=args.device, dtype=dtype)
    model.eval()
    print(f"loaded in {time.time() - t0:.1f} s: {report.summary()}", flush=True)

    tokenizer = None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception:  # no tokenizer files next to the weights: random prompt ids
        pass
    if tokenizer is not None:
        inputs = tokenizer(args.prompt, return_tensors="pt").to(args.device)
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    else:
        ids = torch.randint(0, config.vocab_size, (1, 8), device=args.device)
        mask = torch.ones_like(ids)
    with torch.no_grad():
        t0 = time.time()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=getattr(tokenizer, "eos_token_id", None) or 0)
        torch.cuda.synchronize()
    dt = time.time() - t0
    print(f"generated {out.shape[1] - ids.shape[1]} tokens in {dt:.2f} s (first call includes kernel builds)")
    print(tokenizer.decode(out[0], skip_special_tokens=True) if tokenizer is not None else out[0].tolist())
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
