"""The README's quick start, run as written: its first code block after "Quick start: a whole
model", with `name` a tiny random Llama saved to a local directory (nothing is downloaded).

On a machine with a CUDA GPU it runs unchanged (kernels included). Without one, the block still
runs line by line with two stand-ins: the kernels are replaced by plain-PyTorch references (the
`cpu_kernels` fixture of test_model_cpu) and "cuda" means the CPU (quantize_model's default
device and the prompt's device) — everything else, every name and argument, is the README's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from .test_model_cpu import cpu_kernels  # noqa: F401 - the fixture, used by name below

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_block() -> str:
    text = README.read_text()
    start = text.index("## Quick start: a whole model")
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, "the quick start has no python block"
    return m.group(1)


def _tiny_llama_dir(tmp_path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version

    if Version(transformers.__version__) < Version("4.56"):
        pytest.skip(f"the quick start uses from_pretrained(dtype=...), transformers {transformers.__version__} "
                    "spells it torch_dtype")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=None, pad_token_id=0)  # no EOS: 8 new tokens always
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    return path


def test_quick_start_block_is_complete():
    code = quick_start_block()
    compile(code, "README quick start", "exec")
    for needed in ("import torch, jitmarlin", "from transformers import AutoModelForCausalLM",
                   "jitmarlin.quantize_model(model)", "model.generate("):
        assert needed in code


def test_quick_start_runs_as_written(tmp_path, monkeypatch, request, capsys):
    path = _tiny_llama_dir(tmp_path)
    code = quick_start_block()
    if not torch.cuda.is_available():
        import functools

        import jitmarlin

        request.getfixturevalue("cpu_kernels")
        monkeypatch.setattr(jitmarlin, "quantize_model", functools.partial(jitmarlin.quantize_model, device="cpu"))
        code = code.replace('device="cuda"', 'device="cpu"')
    scope = {"name": str(path)}
    exec(compile(code, "README quick start", "exec"), scope)
    report, model, out = scope["report"], scope["model"], scope["out"]
    assert len(report.replaced) >= 7 * 2  # q, k, v, o, gate, up, down in each of the 2 layers
    assert out.shape == (1, 3 + 8) and torch.equal(out[0, :3].cpu(), torch.tensor([1, 2, 3]))
    assert "MarlinLinear" in type(model.model.layers[0].mlp.down_proj).__name__
    assert "replaced" in capsys.readouterr().out.lower()
