#!/usr/bin/env python
"""Quantize a Hugging Face causal LM with jitmarlin and generate with it.

Without --model a random-weight model is built from a config (nothing is downloaded): Llama,
Mixtral, Qwen2-MoE or Qwen3-MoE, small by default. With --model NAME_OR_DIR the float model is
loaded from the Hugging Face hub or a local directory onto the CPU and quantized onto the GPU
layer by layer, so it only has to fit the GPU once quantized.

    python examples/quantize_hf_model.py                        # random tiny Llama
    python examples/quantize_hf_model.py --arch mixtral --layers 4
    python examples/quantize_hf_model.py --model Qwen/Qwen2.5-0.5B-Instruct --prompt "Hello"
    python examples/quantize_hf_model.py --save out/quantized   # then: load_quantized(model, "out/quantized")
    python examples/quantize_hf_model.py --fuse                 # + fuse_projections (serving)

Needs transformers (pip install transformers) and a CUDA GPU of compute capability >= 8.0.
"""

from __future__ import annotations

import argparse
import sys
import time

ARCHS = ("llama", "mixtral", "qwen2_moe", "qwen3_moe")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Quantize a transformers causal LM with jitmarlin.quantize_model and "
                                            "generate with it.")
    p.add_argument("--model", help="hub name or local directory of a float model (default: a random model from "
                                   "a config, see --arch)")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="architecture of the random model (default llama)")
    p.add_argument("--layers", type=int, default=2, help="layers of the random model (default 2)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of the random model (default 1024)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=128, help="-1 (per channel), 32, 64 or a multiple of 128")
    p.add_argument("--act-order", action="store_true", help="store the act-order layout (exercises that path)")
    p.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    p.add_argument("--prompt", default="The capital of France is", help="prompt (needs a tokenizer: --model)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--save", metavar="DIR", help="also write the quantized model with jitmarlin.save_quantized")
    p.add_argument("--fuse", action="store_true", help="run jitmarlin.fuse_projections after quantizing (q/k/v and "
                                                       "gate/up as one GEMM each: faster decode; saved before fusing)")
    return p.parse_args(argv)


def random_model(transformers, arch: str, layers: int, hidden: int):
    common = dict(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
                  num_key_value_heads=max(1, hidden // 512), max_position_embeddings=4096)
    if arch == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=hidden * 11 // 4 // 128 * 128, **common)
        return transformers.LlamaForCausalLM(cfg)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=hidden * 7 // 2, num_local_experts=8, num_experts_per_tok=2,
                                         **common)
        return transformers.MixtralForCausalLM(cfg)
    if arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=hidden * 11 // 4 // 128 * 128,
                                          moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden * 2,
                                          num_experts=16, num_experts_per_tok=4, **common)
        return transformers.Qwen2MoeForCausalLM(cfg)
    if not hasattr(transformers, "Qwen3MoeConfig"):
        sys.exit(f"transformers {transformers.__version__} has no Qwen3-MoE: upgrade it or pick another --arch")
    cfg = transformers.Qwen3MoeConfig(intermediate_size=hidden * 3, moe_intermediate_size=hidden // 2, num_experts=16,
                                      num_experts_per_tok=4, head_dim=128, **common)
    return transformers.Qwen3MoeForCausalLM(cfg)


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
    tokenizer = None
    t0 = time.time()
    if args.model:
        # transformers 5 names the argument dtype, 4.x torch_dtype; the float model stays on the CPU
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, **{key: dtype}, low_cpu_mem_usage=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    else:
        torch.manual_seed(0)
        model = random_model(transformers, args.arch, args.layers, args.hidden).to(dtype)
    model.eval()
    print(f"float model ready in {time.time() - t0:.1f} s: {type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters", flush=True)

    t0 = time.time()
    report = jitmarlin.quantize_model(model, bits=args.bits, group_size=args.group_size, act_order=args.act_order,
                                      device=args.device, dtype=dtype)
    print(f"quantized in {time.time() - t0:.1f} s: {report.summary()}")
    for kept in report.kept:
        print(f"  kept in float: {kept.name} ({kept.reason})")
    if args.save:
        path = jitmarlin.save_quantized(model, args.save)
        print(f"saved to {path} (load with jitmarlin.load_quantized(model, {str(path)!r}))")
    if args.fuse:
        print(f"fuse_projections: {jitmarlin.fuse_projections(model)}")

    if tokenizer is not None:
        inputs = tokenizer(args.prompt, return_tensors="pt").to(args.device)
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, 8), device=args.device)
        mask = torch.ones_like(ids)
    pad = getattr(tokenizer, "eos_token_id", None) or 0
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=pad)  # builds kernels
        torch.cuda.synchronize()
        t0 = time.time()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=pad)
        torch.cuda.synchronize()
    dt = time.time() - t0
    new = out.shape[1] - ids.shape[1]
    print(f"generated {new} tokens in {dt:.2f} s ({new / dt:.1f} tokens/s, eager)")
    if tokenizer is not None:
        print(tokenizer.decode(out[0], skip_special_tokens=True))
    else:
        print(f"token ids: {out[0].tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
