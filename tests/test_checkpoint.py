"""Checkpoint loading on the CPU: QuantConfig parsing, the safetensors reader/writer, and layers
built from GPTQ/AWQ checkpoint tensors.

The checkpoint tensors are written by the numpy packers of tests/test_formats.py (independent of
jitmarlin's torch code) and the expected dense weights are computed here from the random
integers, so a layer's dequantize() is compared with what the checkpoint means, exactly. The
safetensors reader is checked against files whose bytes this test assembles itself with struct
from the public format description, not only against our own writer.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from jitmarlin.nn import MarlinLinear, MarlinMoE
from jitmarlin.quant import (QuantConfig, SafetensorsError, is_quantized_linear, linear_from_checkpoint,
                             load_safetensors, safetensors_metadata, save_safetensors)

from .test_formats import (read_awq, read_gptq_qweight, read_gptq_qzeros, write_awq, write_gptq_qweight,
                           write_gptq_qzeros)

# ============================================================================ QuantConfig

AUTOGPTQ_V1 = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
               "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
               "quant_method": "gptq", "checkpoint_format": "gptq"}
THEBLOKE_OLD = {"bits": 4, "group_size": 32, "damp_percent": 0.1, "desc_act": False, "sym": True,
                "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model"}
GPTQMODEL_V2 = {"bits": 8, "dynamic": None, "group_size": 64, "desc_act": False, "sym": False, "lm_head": False,
                "quant_method": "gptq", "checkpoint_format": "gptq_v2", "pack_dtype": "int32",
                "meta": {"quantizer": ["gptqmodel:2.2.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                         "damp_percent": 0.01, "damp_auto_increment": 0.0025, "static_groups": False,
                         "true_sequential": True, "mse": 0.0}}
GPTQMODEL_FORMAT_KEY = {"bits": 4, "group_size": -1, "desc_act": True, "sym": True, "quant_method": "gptq",
                        "format": "gptq_v2", "act_group_aware": False}
HF_GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": True, "sym": True,
           "true_sequential": True, "use_exllama": True, "max_input_length": None, "exllama_config": {"version": 1},
           "cache_block_outputs": True, "quant_method": "gptq", "modules_in_block_to_quantize": None}
HF_AWQ = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "gemm",
          "backend": "autoawq", "do_fuse": False, "modules_to_not_convert": ["gate"]}
AUTOAWQ = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
AUTOAWQ_NEW = {"quant_method": "awq", "zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM",
               "modules_to_not_convert": None}


@pytest.mark.parametrize("d,expected", [
    (AUTOGPTQ_V1, ("gptq", 4, 128, True, True, "gptq", False)),
    (THEBLOKE_OLD, ("gptq", 4, 32, False, True, "gptq", False)),
    (GPTQMODEL_V2, ("gptq", 8, 64, False, False, "gptq_v2", True)),
    (GPTQMODEL_FORMAT_KEY, ("gptq", 4, -1, True, True, "gptq_v2", False)),
    (HF_GPTQ, ("gptq", 4, 128, True, True, "gptq", False)),
    (HF_AWQ, ("awq", 4, 128, False, False, "awq", True)),
    (AUTOAWQ, ("awq", 4, 64, False, False, "awq", True)),
    (AUTOAWQ_NEW, ("awq", 4, 128, False, False, "awq", True)),
], ids=["autogptq-v1", "old-no-method", "gptqmodel-v2", "gptqmodel-format-key", "hf-gptq", "hf-awq", "autoawq",
        "autoawq-new"])
def test_config_from_dict(d, expected):
    cfg = QuantConfig.from_dict(d)
    got = (cfg.method, cfg.bits, cfg.group_size, cfg.desc_act, cfg.sym, cfg.checkpoint_format, cfg.zero_point)
    assert got == expected
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg  # to_dict round trip


def test_config_defaults_follow_method_and_frozen():
    g = QuantConfig("gptq", 4, 128)
    assert (g.sym, g.checkpoint_format, g.zero_point, g.desc_act) == (True, "gptq", False, False)
    assert QuantConfig("gptq", 8, -1, sym=False).zero_point
    a = QuantConfig("awq", 4, 128)
    assert (a.sym, a.checkpoint_format, a.zero_point) == (False, "awq", True)
    with pytest.raises(Exception):  # dataclasses.FrozenInstanceError
        g.bits = 8


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="bnb", bits=4, group_size=128), r"method='bnb' is not supported"),
    (dict(method="gptq", bits=3, group_size=128), r"bits=3 is not supported"),
    (dict(method="gptq", bits=True, group_size=128), r"bits=True is not supported"),
    (dict(method="gptq", bits=4, group_size=48), r"group_size=48 is not supported"),
    (dict(method="gptq", bits=4, group_size=0), r"group_size=0 is not supported"),
    (dict(method="gptq", bits=4, group_size=16), r"group_size=16 is not supported"),
    (dict(method="gptq", bits=4, group_size="128"), r"group_size='128' must be an integer"),
    (dict(method="gptq", bits=4, group_size=128, desc_act=1), r"desc_act=1 must be a bool"),
    (dict(method="gptq", bits=4, group_size=128, checkpoint_format="marlin"), r"checkpoint_format='marlin'"),
    (dict(method="gptq", bits=4, group_size=128, checkpoint_format="awq"), r"checkpoint_format='awq'"),
    (dict(method="awq", bits=8, group_size=128), r"bits=8 is not supported for AWQ"),
    (dict(method="awq", bits=4, group_size=128, sym=True), r"sym=True is not valid for AWQ"),
    (dict(method="awq", bits=4, group_size=128, desc_act=True), r"desc_act=True is not valid for AWQ"),
    (dict(method="awq", bits=4, group_size=128, checkpoint_format="gptq"), r"checkpoint_format='gptq' is not valid"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("d,match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors"}, r"quant_method='compressed-tensors' is not supported"),
    ({"quant_method": "marlin", "bits": 4, "group_size": 128}, r"quant_method='marlin' is not supported"),
    ({**HF_AWQ, "version": "gemv"}, r"AWQ version='gemv' is not supported"),
    ({**HF_AWQ, "version": "marlin"}, r"AWQ version='marlin' is not supported"),
    ({**AUTOAWQ, "version": "GEMV_FAST"}, r"AWQ version='GEMV_FAST' is not supported"),
    ({**HF_AWQ, "zero_point": False}, r"AWQ zero_point=False is not supported"),
    ({**HF_AWQ, "bits": 8}, r"bits=8 is not supported for AWQ"),
    ({**HF_AWQ, "backend": "llm-awq"}, r"backend='llm-awq'"),
    ({**AUTOGPTQ_V1, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported for GPTQ"),
    ({**AUTOGPTQ_V1, "checkpoint_format": "bitblas"}, r"checkpoint_format='bitblas'"),
    ({**AUTOGPTQ_V1, "is_marlin_format": True}, r"is_marlin_format=true"),
    ({**GPTQMODEL_V2, "pack_dtype": "int16"}, r"pack_dtype='int16' is not supported"),
    ({**GPTQMODEL_V2, "format": "gptq"}, r"checkpoint_format='gptq_v2' and format='gptq' disagree"),
    ({**AUTOGPTQ_V1, "bits": 2}, r"bits=2 is not supported"),
    ({"quant_method": "gptq", "group_size": 128}, r"no 'bits' entry"),
    ({"quant_method": "gptq", "bits": 4}, r"no 'group_size' entry"),
    ({"zero_point": True, "version": "GEMM", "w_bit": 4}, r"no 'group_size' / 'q_group_size' entry"),
])
def test_config_from_dict_errors(d, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig.from_dict(d)
    with pytest.raises(TypeError, match=r"must be a dict, got list"):
        QuantConfig.from_dict([1, 2])


def test_config_dynamic_overrides_warn():
    with pytest.warns(UserWarning, match=r"'dynamic' overrides"):
        QuantConfig.from_dict({**GPTQMODEL_V2, "dynamic": {"-:.*lm_head": {}}})


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def test_config_from_pretrained(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    _write_json(d / "config.json", {"model_type": "mixtral", "quantization_config": HF_AWQ})
    assert QuantConfig.from_pretrained(d).method == "awq"  # only config.json
    _write_json(d / "quant_config.json", AUTOAWQ)
    assert QuantConfig.from_pretrained(d).group_size == 64  # quant_config.json wins over config.json
    _write_json(d / "quantize_config.json", GPTQMODEL_V2)
    cfg = QuantConfig.from_pretrained(str(d))  # quantize_config.json wins over both
    assert (cfg.method, cfg.bits, cfg.checkpoint_format) == ("gptq", 8, "gptq_v2")
    assert QuantConfig.from_pretrained(d / "config.json").method == "awq"  # a file path: its quantization_config
    assert QuantConfig.from_pretrained(d / "quant_config.json").group_size == 64


def test_config_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds none of quantize_config.json, quant_config.json, config.json"):
        QuantConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        QuantConfig.from_pretrained(tmp_path / "nope")
    _write_json(tmp_path / "config.json", {"model_type": "llama"})
    with pytest.raises(ValueError, match=r"config.json has no 'quantization_config' entry"):
        QuantConfig.from_pretrained(tmp_path)
    (tmp_path / "quantize_config.json").write_text("{bits: 4")
    with pytest.raises(ValueError, match=r"quantize_config.json is not valid JSON"):
        QuantConfig.from_pretrained(tmp_path)


# ============================================================================ safetensors

def _hand_file(entries, metadata=None, header_text=None, extra=b"", align=False):
    """Bytes of a safetensors file assembled here with struct: entries = [(name, dtype, shape, raw)]
    laid out in order, with no padding between them; align=True pads the header with spaces so
    that the data starts at a multiple of 8 (then a 3-byte first tensor misaligns all others)."""
    header, data, pos = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dt, shape, raw in entries:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        data += raw
        pos += len(raw)
    text = (header_text if header_text is not None else json.dumps(header)).encode("utf-8")
    if align:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data + extra


HAND = [
    ("u8", "U8", [3], bytes([1, 2, 255])),  # 3 bytes first: everything after it is unaligned
    ("f32", "F32", [2, 2], struct.pack("<4f", 1.5, -2.0, 3.25, 0.0)),
    ("i32", "I32", [3], struct.pack("<3i", -1, 7, 2**31 - 1)),
    ("f16", "F16", [2], struct.pack("<2e", 0.5, -65504.0)),
    ("bf16", "BF16", [2], struct.pack("<2H", 0x3F80, 0xC000)),  # 1.0, -2.0: the top halves of the fp32 words
    ("bool", "BOOL", [4], bytes([1, 0, 0, 1])),
    ("i64", "I64", [1], struct.pack("<q", -5)),
    ("f64", "F64", [1], struct.pack("<d", 1e300)),
    ("i8", "I8", [2], struct.pack("<2b", -128, 127)),
    ("i16", "I16", [1, 2], struct.pack("<2h", -300, 300)),
    ("scalar", "F32", [], struct.pack("<f", 7.0)),
    ("empty", "F32", [0, 3], b""),
]
HAND_EXPECTED = {
    "u8": torch.tensor([1, 2, 255], dtype=torch.uint8),
    "f32": torch.tensor([[1.5, -2.0], [3.25, 0.0]]),
    "i32": torch.tensor([-1, 7, 2**31 - 1], dtype=torch.int32),
    "f16": torch.tensor([0.5, -65504.0], dtype=torch.float16),
    "bf16": torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
    "bool": torch.tensor([True, False, False, True]),
    "i64": torch.tensor([-5]),
    "f64": torch.tensor([1e300], dtype=torch.float64),
    "i8": torch.tensor([-128, 127], dtype=torch.int8),
    "i16": torch.tensor([[-300, 300]], dtype=torch.int16),
    "scalar": torch.tensor(7.0),
    "empty": torch.zeros(0, 3),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_reader_on_hand_built_bytes(tmp_path):
    f = tmp_path / "hand.safetensors"
    f.write_bytes(_hand_file(HAND, metadata={"format": "pt", "note": "hand"}, align=True))
    out = load_safetensors(f)
    assert out["f32"].data_ptr() % 4 == 0 and out["f64"].data_ptr() % 8 == 0  # unaligned in the file: copied
    assert list(out) == [e[0] for e in HAND]  # header order
    for name, want in HAND_EXPECTED.items():
        assert _same(out[name], want), name
    assert safetensors_metadata(f) == {"format": "pt", "note": "hand"}
    sub = load_safetensors(f, keys=["bf16", "i32"])
    assert list(sub) == ["bf16", "i32"] and _same(sub["i32"], HAND_EXPECTED["i32"])
    with pytest.raises(KeyError, match=r"has no tensor 'nope' \(nor 1 more requested\)"):
        load_safetensors(f, keys=["i8", "nope", "nope2"])


def test_reader_header_with_trailing_spaces(tmp_path):
    raw = struct.pack("<2i", 3, -4)
    text = json.dumps({"a": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}) + "     "
    f = tmp_path / "pad.safetensors"
    f.write_bytes(_hand_file([], header_text=text) + raw)
    assert _same(load_safetensors(f)["a"], torch.tensor([3, -4], dtype=torch.int32))
    assert safetensors_metadata(f) == {}


def _all_dtypes_tensors():
    g = torch.Generator().manual_seed(0)
    t = {
        "f16": torch.randn(3, 5, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f32": torch.randn(4, 4, generator=g),
        "f64": torch.randn(2, 3, 1, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 128, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (2, 3), generator=g, dtype=torch.uint8),
        "i16": torch.randint(-30000, 30000, (5,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int32),
        "i64": torch.randint(-2**62, 2**62, (4,), generator=g, dtype=torch.int64),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4, dtype=torch.int32),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        "sliced": torch.arange(20, dtype=torch.int64)[5:15:2],  # storage offset and stride
    }
    if hasattr(torch, "float8_e4m3fn"):
        t["f8"] = torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn)
    return t


def test_writer_reader_round_trip(tmp_path):
    tensors = _all_dtypes_tensors()
    f = tmp_path / "rt.safetensors"
    save_safetensors(tensors, f, metadata={"format": "pt", "by": "jitmarlin"})
    out = load_safetensors(f)
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        if v.dtype == getattr(torch, "float8_e4m3fn", None):
            assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8))
        else:
            assert _same(out[k], v.contiguous()), k
    assert safetensors_metadata(f) == {"format": "pt", "by": "jitmarlin"}
    assert os.listdir(tmp_path) == ["rt.safetensors"]  # no temporary file left


def test_writer_layout_matches_format(tmp_path):
    """Parse our writer's bytes by hand: header length, space padding to 8 bytes, offsets that tile
    the data, every tensor aligned to its element size, the raw little-endian values."""
    f = tmp_path / "w.safetensors"
    save_safetensors({"b": torch.tensor([1, 2], dtype=torch.int32), "a": torch.tensor([3], dtype=torch.uint8),
                      "c": torch.tensor([-1.0], dtype=torch.float64)}, f, metadata={"k": "v"})
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0
    text = raw[8:8 + n].decode("utf-8")
    assert text.startswith("{") and text == text.rstrip(" ") + " " * (len(text) - len(text.rstrip(" ")))
    header = json.loads(text)
    assert header.pop("__metadata__") == {"k": "v"}
    data = raw[8 + n:]
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    item = {"I32": 4, "U8": 1, "F64": 8}
    for name, v in header.items():
        assert (8 + n + v["data_offsets"][0]) % item[v["dtype"]] == 0, name
    b0, b1 = header["b"]["data_offsets"]
    assert data[b0:b1] == struct.pack("<2i", 1, 2)
    c0, c1 = header["c"]["data_offsets"]
    assert data[c0:c1] == struct.pack("<d", -1.0)
    assert header["a"] == {"dtype": "U8", "shape": [1], "data_offsets": [header["a"]["data_offsets"][0],
                                                                          header["a"]["data_offsets"][0] + 1]}


def test_loaded_tensors_are_private_copies_of_the_file(tmp_path):
    f = tmp_path / "m.safetensors"
    save_safetensors({"w": torch.arange(8, dtype=torch.float32)}, f)
    before = f.read_bytes()
    t = load_safetensors(f)["w"]
    t.mul_(10)  # copy-on-write map: the file must not change
    assert f.read_bytes() == before
    assert torch.equal(load_safetensors(f)["w"], torch.arange(8, dtype=torch.float32))


def test_writer_is_atomic(tmp_path, monkeypatch):
    f = tmp_path / "x.safetensors"
    save_safetensors({"a": torch.ones(4)}, f)
    before = f.read_bytes()

    def boom(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        save_safetensors({"a": torch.zeros(100)}, f)
    monkeypatch.undo()
    assert f.read_bytes() == before and os.listdir(tmp_path) == ["x.safetensors"]
    save_safetensors({"a": torch.zeros(100)}, f)  # overwriting works
    assert torch.equal(load_safetensors(f)["a"], torch.zeros(100))


def test_writer_errors(tmp_path):
    f = tmp_path / "e.safetensors"
    with pytest.raises(TypeError, match=r"tensors\['c'\] has dtype torch.complex64"):
        save_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, f)
    with pytest.raises(TypeError, match=r"tensors\['x'\] must be a torch.Tensor, got list"):
        save_safetensors({"x": [1, 2]}, f)
    with pytest.raises(ValueError, match=r"'__metadata__' is not allowed"):
        save_safetensors({"__metadata__": torch.zeros(1)}, f)
    with pytest.raises(TypeError, match=r"metadata must map strings to strings"):
        save_safetensors({"a": torch.zeros(1)}, f, metadata={"n": 1})
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        save_safetensors({"a": torch.zeros(1)}, tmp_path / "no" / "dir.safetensors")
    assert not f.exists()


def _entry(dt, shape, b, e):
    return {"dtype": dt, "shape": shape, "data_offsets": [b, e]}


@pytest.mark.parametrize("blob,match", [
    (b"\x01\x02\x03", r"3 bytes is too short"),
    (struct.pack("<Q", 10**6) + b"{}", r"header length 1000000 exceeds the 2 bytes"),
    (struct.pack("<Q", 5) + b"{abc}", r"not valid JSON"),
    (struct.pack("<Q", 5) + b"[1,2]", r"must be a JSON object starting with"),
    (struct.pack("<Q", 2) + b"\xff\xfe", r"not UTF-8"),
    (_hand_file([], header_text=json.dumps({"a": _entry("C64", [1], 0, 8)})) + bytes(8), r"dtype 'C64'"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [-1], 0, 4)})) + bytes(4), r"shape \[-1\]"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [2.0], 0, 8)})) + bytes(8), r"shape \[2.0\]"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [4], 0, 100)})) + bytes(16),
     r"data_offsets \[0, 100\] outside the 16 data bytes"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [2], 8, 4)})) + bytes(8), r"outside the 8 data"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [2, 2], 0, 12)})) + bytes(12),
     r"needs 16 bytes but data_offsets \[0, 12\] span 12"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}))
     + bytes(12), r"'a' and 'b' overlap"),
    (_hand_file([], header_text=json.dumps({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 12, 20)}))
     + bytes(20), r"data bytes \[8, 12\) belong to no tensor"),
    (_hand_file([("a", "F32", [2], bytes(8))], extra=bytes(4)), r"data bytes \[8, 12\) belong to no tensor"),
    (_hand_file([], header_text='{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                                '"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}') + bytes(1),
     r"duplicate key 'a'"),
    (_hand_file([("a", "U8", [1], bytes(1))], metadata={"n": 1}), r"__metadata__ must map strings to strings"),
    (_hand_file([], header_text=json.dumps({"a": {**_entry("U8", [1], 0, 1), "x": 1}})) + bytes(1),
     r"exactly the keys dtype, shape and data_offsets"),
    (_hand_file([], header_text=json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})) + bytes(8),
     r"data_offsets \[0\]"),
    (_hand_file([("b", "BOOL", [2], bytes([1, 2]))]), r"BOOL but holds bytes other than 0 and 1"),
], ids=["short", "header-too-long", "bad-json", "not-object", "not-utf8", "dtype", "neg-shape", "float-shape",
        "offset-range", "offset-reversed", "size-mismatch", "overlap", "hole", "trailing", "dup-key", "metadata",
        "extra-key", "one-offset", "bool-bytes"])
def test_reader_rejects_corrupt_files(tmp_path, blob, match):
    f = tmp_path / "bad.safetensors"
    f.write_bytes(blob)
    with pytest.raises(SafetensorsError, match=match):
        load_safetensors(f)


def test_reader_rejects_truncated_file(tmp_path):
    f = tmp_path / "t.safetensors"
    save_safetensors({"a": torch.ones(16), "b": torch.ones(16)}, f)
    raw = f.read_bytes()
    f.write_bytes(raw[:-4])
    with pytest.raises(SafetensorsError, match=r"outside the 124 data bytes"):
        load_safetensors(f)


def _write_sharded(d, shards: dict[str, dict[str, torch.Tensor]], index_name="model.safetensors.index.json"):
    weight_map = {}
    for fname, tensors in shards.items():
        save_safetensors(tensors, d / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    _write_json(d / index_name, {"metadata": {"total_size": 0}, "weight_map": weight_map})


def test_sharded_directory(tmp_path):
    a = {"model.a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "model.b": torch.ones(3, dtype=torch.float16)}
    b = {"model.c": torch.full((4,), 2.5, dtype=torch.bfloat16)}
    _write_sharded(tmp_path, {"model-00001-of-00002.safetensors": a, "model-00002-of-00002.safetensors": b})
    out = load_safetensors(tmp_path)
    assert set(out) == {"model.a", "model.b", "model.c"}
    for k, v in {**a, **b}.items():
        assert _same(out[k], v)
    sub = load_safetensors(tmp_path, keys=["model.c", "model.a"])
    assert list(sub) == ["model.c", "model.a"]
    with pytest.raises(KeyError, match=r"lists no tensor 'model.zz'"):
        load_safetensors(tmp_path, keys=["model.zz"])
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match=r"maps 'model.c' to .*model-00002-of-00002.safetensors, which does not"):
        load_safetensors(tmp_path)
    assert set(load_safetensors(tmp_path, keys=["model.a"])) == {"model.a"}  # the other shard is not needed


def test_sharded_index_errors(tmp_path):
    _write_sharded(tmp_path, {"s1.safetensors": {"x": torch.ones(2)}})
    _write_json(tmp_path / "model.safetensors.index.json", {"weight_map": {"x": "s1.safetensors",
                                                                           "y": "s1.safetensors"}})
    with pytest.raises(SafetensorsError, match=r"maps tensors to s1.safetensors that it does not hold.*'y'"):
        load_safetensors(tmp_path)
    _write_json(tmp_path / "model.safetensors.index.json", {"weight_map": {"x": "../s1.safetensors"}})
    with pytest.raises(SafetensorsError, match=r"shard '../s1.safetensors' of tensor 'x' must be a file name inside"):
        load_safetensors(tmp_path)
    _write_json(tmp_path / "model.safetensors.index.json", {"weights": {}})
    with pytest.raises(SafetensorsError, match=r"must hold a 'weight_map' object"):
        load_safetensors(tmp_path)


def test_directory_resolution(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no .safetensors file"):
        load_safetensors(tmp_path)
    save_safetensors({"only": torch.ones(1)}, tmp_path / "gptq_model-4bit-128g.safetensors")
    assert set(load_safetensors(tmp_path)) == {"only"}  # the directory's only file (AutoGPTQ's naming)
    save_safetensors({"other": torch.ones(1)}, tmp_path / "second.safetensors")
    with pytest.raises(FileNotFoundError, match=r"several safetensors checkpoints"):
        load_safetensors(tmp_path)
    save_safetensors({"main": torch.ones(1)}, tmp_path / "model.safetensors")
    assert set(load_safetensors(tmp_path)) == {"main"}
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        load_safetensors(tmp_path / "missing.safetensors")


def test_cross_check_with_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {k: v.contiguous() for k, v in _all_dtypes_tensors().items() if k != "f8"}
    theirs = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(theirs), metadata={"format": "pt"})
    out = load_safetensors(theirs)
    for k, v in tensors.items():
        assert _same(out[k], v), k
    ours = tmp_path / "ours.safetensors"
    save_safetensors(tensors, ours, metadata={"format": "pt"})
    back = st.load_file(str(ours))
    for k, v in tensors.items():
        assert _same(back[k], v), k


# ============================================================================ checkpoint tensors -> layers

def gptq_layer(k, n, bits, group_size, sym, g_idx, fmt, seed, dtype=torch.float16):
    """Checkpoint tensors of one GPTQ layer (numpy packers) and the dense W [K, N] they mean."""
    rng = np.random.default_rng(seed)
    g = k if group_size == -1 else group_size
    groups = k // g
    q = rng.integers(0, 1 << bits, size=(k, n))
    z = np.full((groups, n), 1 << (bits - 1)) if sym else rng.integers(0, 1 << bits, size=(groups, n))
    s = torch.from_numpy(rng.uniform(1e-3, 2e-2, size=(groups, n)).astype(np.float32)).to(dtype)
    if g_idx is None:
        g_idx = np.arange(k) // g
    gi = torch.from_numpy(g_idx)
    w = s.float()[gi] * (torch.from_numpy(q) - torch.from_numpy(z)[gi]).float()
    t = {"qweight": write_gptq_qweight(q, bits), "scales": s, "qzeros": write_gptq_qzeros(z, bits, fmt),
         "g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    return t, w


def awq_layer(k, n, group_size, seed, dtype=torch.float16, all_eight=False):
    rng = np.random.default_rng(seed)
    g = k if group_size == -1 else group_size
    groups = k // g
    q = rng.integers(0, 16, size=(k, n))
    z = np.full((groups, n), 8) if all_eight else rng.integers(0, 16, size=(groups, n))
    s = torch.from_numpy(rng.uniform(1e-3, 2e-2, size=(groups, n)).astype(np.float32)).to(dtype)
    gi = torch.arange(k) // g
    w = s.float()[gi] * (torch.from_numpy(q) - torch.from_numpy(z)[gi]).float()
    return {"qweight": write_awq(q), "scales": s, "qzeros": write_awq(z)}, w


def act_order_g_idx(k, group_size, seed):
    """Random act-order groups: group j is rows p[j*G:(j+1)*G] of a random permutation p."""
    p = np.random.default_rng(seed).permutation(k)
    g = np.empty(k, dtype=np.int64)
    g[p] = np.arange(k) // group_size
    return g


def renumbered(g_idx, group_size, seed):
    """The same partition of the rows into groups, with the groups numbered differently."""
    groups = len(g_idx) // group_size
    return np.random.default_rng(seed).permutation(groups)[g_idx]


def put(sd, prefix, tensors, drop=()):
    sd.update({prefix + k: v for k, v in tensors.items() if k not in drop})


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_linear_from_gptq_checkpoint(fmt, bits, group_size, sym, act_order):
    k, n = 384, 128
    g_idx = act_order_g_idx(k, k if group_size == -1 else group_size, 5) if act_order else None
    t, w = gptq_layer(k, n, bits, group_size, sym, g_idx, fmt, seed=bits + group_size)
    sd, prefix = {}, "model.layers.3.mlp.down_proj."
    put(sd, prefix, t)
    sd[prefix + "bias"] = torch.linspace(-1, 1, n, dtype=torch.float16)
    sd["model.layers.3.mlp.up_proj.weight"] = torch.ones(1)  # unrelated tensors are ignored
    cfg = QuantConfig("gptq", bits, group_size, desc_act=act_order, sym=sym, checkpoint_format=fmt)
    layer = linear_from_checkpoint(sd, prefix, cfg)
    assert isinstance(layer, MarlinLinear)
    assert (layer.in_features, layer.out_features, layer.bits, layer.group_size) == (k, n, bits, group_size)
    assert layer.act_order == (act_order and group_size != -1)
    assert layer.sym == sym
    assert torch.equal(layer.dequantize(), w.t().half())
    assert torch.equal(layer.bias, sd[prefix + "bias"])


def test_linear_trivial_g_idx_is_ignored_and_renumbered_groups_need_no_perm():
    k, n = 256, 64
    t, w = gptq_layer(k, n, 4, 64, True, None, "gptq", seed=1)
    cfg = QuantConfig("gptq", 4, 64)
    layer = linear_from_checkpoint({"l." + a: b for a, b in t.items()}, "l.", cfg)
    assert layer.perm is None and torch.equal(layer.dequantize(), w.t().half())
    # groups kept contiguous but numbered in another order (as a checkpoint may store them): only
    # the scale rows move, no activation gather
    g = renumbered(np.arange(k) // 64, 64, seed=2)
    assert not np.array_equal(g, np.arange(k) // 64)
    t, w = gptq_layer(k, n, 4, 64, False, g, "gptq_v2", seed=3)
    layer = linear_from_checkpoint({"l." + a: b for a, b in t.items()},
                                   "l.", QuantConfig("gptq", 4, 64, desc_act=True, sym=False,
                                                     checkpoint_format="gptq_v2"))
    assert layer.perm is None and torch.equal(layer.dequantize(), w.t().half())


def test_linear_g_idx_without_desc_act_warns_and_is_followed():
    t, w = gptq_layer(256, 64, 4, 32, True, act_order_g_idx(256, 32, 4), "gptq", seed=4)
    with pytest.warns(UserWarning, match=r"'p.g_idx' is not arange\(K\) // group_size.*desc_act=False"):
        layer = linear_from_checkpoint({"p." + a: b for a, b in t.items()}, "p.", QuantConfig("gptq", 4, 32))
    assert layer.act_order and torch.equal(layer.dequantize(), w.t().half())


def test_linear_without_qzeros_when_symmetric():
    t, w = gptq_layer(128, 64, 8, 64, True, None, "gptq", seed=5)
    sd = {}
    put(sd, "x.", t, drop=("qzeros", "g_idx"))
    layer = linear_from_checkpoint(sd, "x.", QuantConfig("gptq", 8, 64))
    assert layer.sym and layer.bias is None and torch.equal(layer.dequantize(), w.t().half())


@pytest.mark.parametrize("group_size", [-1, 64, 128])
@pytest.mark.parametrize("all_eight", [False, True])
def test_linear_from_awq_checkpoint(group_size, all_eight):
    t, w = awq_layer(512, 192, group_size, seed=group_size + 7, all_eight=all_eight)
    sd = {}
    put(sd, "model.layers.0.self_attn.o_proj.", t)
    cfg = QuantConfig.from_dict({**HF_AWQ, "group_size": group_size})
    layer = linear_from_checkpoint(sd, "model.layers.0.self_attn.o_proj.", cfg)
    assert layer.perm is None and layer.sym == all_eight  # all-8 zero points: the symmetric kernel
    assert torch.equal(layer.dequantize(), w.t().half())


def test_linear_dtype_and_device_arguments():
    t, w = gptq_layer(256, 128, 4, 128, False, act_order_g_idx(256, 128, 1), "gptq", seed=6)
    sd = {}
    put(sd, "q.", t)
    sd["q.bias"] = torch.randn(128, dtype=torch.float16)
    cfg = QuantConfig("gptq", 4, 128, desc_act=True, sym=False)
    layer = linear_from_checkpoint(sd, "q.", cfg, dtype=torch.bfloat16, device="cpu")
    assert layer.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    # the same integers on bf16-rounded scales, in fp32, then cast
    q = torch.from_numpy(read_gptq_qweight(t["qweight"], 4)).float()
    z = torch.from_numpy(read_gptq_qzeros(t["qzeros"], 4, "gptq")).float()
    gi = t["g_idx"].long()
    w_bf = t["scales"].to(torch.bfloat16).float()[gi] * (q - z[gi])
    assert torch.equal(layer.dequantize(), w_bf.t().to(torch.bfloat16))
    assert not torch.equal(layer.dequantize(), w.t().to(torch.bfloat16))  # the scale rounding is visible
    sd["q.scales"] = t["scales"].float()
    with pytest.raises(TypeError, match=r"'q.scales' is torch.float32: pass dtype="):
        linear_from_checkpoint(sd, "q.", cfg)
    assert linear_from_checkpoint(sd, "q.", cfg, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(TypeError, match=r"dtype=torch.float32 is not supported"):
        linear_from_checkpoint(sd, "q.", cfg, dtype=torch.float32)


def test_linear_through_a_safetensors_file(tmp_path):
    t, w = gptq_layer(256, 192, 4, 32, False, act_order_g_idx(256, 32, 9), "gptq", seed=8)
    sd = {}
    put(sd, "model.layers.0.mlp.gate_proj.", t)
    save_safetensors(sd, tmp_path / "model.safetensors")
    _write_json(tmp_path / "quantize_config.json", {**AUTOGPTQ_V1, "group_size": 32, "sym": False})
    loaded = load_safetensors(tmp_path)
    cfg = QuantConfig.from_pretrained(tmp_path)
    assert is_quantized_linear(loaded, "model.layers.0.mlp.gate_proj.")
    assert not is_quantized_linear(loaded, "model.layers.0.mlp.up_proj.")
    layer = linear_from_checkpoint(loaded, "model.layers.0.mlp.gate_proj.", cfg)
    assert torch.equal(layer.dequantize(), w.t().half())


def test_linear_missing_keys_and_bad_tensors():
    t, _ = gptq_layer(256, 64, 4, 128, False, act_order_g_idx(256, 128, 2), "gptq", seed=9)
    cfg = QuantConfig("gptq", 4, 128, desc_act=True, sym=False)
    for missing, what in (("qweight", "packed weights"), ("scales", "group scales"), ("qzeros", "sym=False"),
                          ("g_idx", "desc_act=True")):
        sd = {}
        put(sd, "m.down.", t, drop=(missing,))
        with pytest.raises(KeyError, match=rf"no 'm.down.{missing}' \(.*{what}"):
            linear_from_checkpoint(sd, "m.down.", cfg)
    sd = {}
    put(sd, "m.down.", t)
    with pytest.raises(KeyError, match=r"no 'm.downqweight'.*it has 'm.down.qweight': the prefix must end with '.'"):
        linear_from_checkpoint(sd, "m.down", cfg)
    bad = dict(sd, **{"m.down.qweight": sd["m.down.qweight"].long()})
    with pytest.raises(TypeError, match=r"'m.down.qweight' must be an int32 tensor .*torch.int64"):
        linear_from_checkpoint(bad, "m.down.", cfg)
    bad = dict(sd, **{"m.down.qzeros": sd["m.down.qzeros"][:, :4]})
    with pytest.raises(ValueError, match=r"'m.down.qzeros' must be \[K/group_size, N\*4/32\] = \[2, 8\]"):
        linear_from_checkpoint(bad, "m.down.", cfg)
    bad = dict(sd, **{"m.down.g_idx": torch.zeros(256, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"'m.down.g_idx' is inconsistent with group_size=128.*group 0 has 256"):
        linear_from_checkpoint(bad, "m.down.", cfg)
    bad = dict(sd, **{"m.down.g_idx": sd["m.down.g_idx"][:200]})
    with pytest.raises(ValueError, match=r"'m.down.g_idx' must be 1-D of length K=256"):
        linear_from_checkpoint(bad, "m.down.", cfg)
    bad = dict(sd, **{"m.down.bias": torch.zeros(65, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"'m.down.bias' must have shape \[out_features=64\]"):
        linear_from_checkpoint(bad, "m.down.", cfg)
    with pytest.raises(ValueError, match=r"'m.down.scales': scales must be \[K/group_size, N\] = \[4, 64\]"):
        linear_from_checkpoint(sd, "m.down.", QuantConfig("gptq", 4, 64, desc_act=True, sym=False))
    with pytest.raises(TypeError, match=r"cfg must be a QuantConfig"):
        linear_from_checkpoint(sd, "m.down.", {"bits": 4})
    with pytest.warns(UserWarning, match=r"'m.down.qzeros': sym=True but"):
        linear_from_checkpoint(sd, "m.down.", QuantConfig("gptq", 4, 128, desc_act=True))


# ---------------- MoE

E, H, I = 4, 256, 128


def _moe_checkpoint(method, group_size, gate_g=None, up_g=None, down_g=None, sym=False, fmt="gptq", seed=0,
                    naming="mixtral"):
    """Per-expert checkpoint tensors; returns (sd, gate, up, down prefixes, router, w13 [E, 2I, H],
    w2 [E, H, I]). gate_g/up_g/down_g: per-expert g_idx lists (None entries: trivial)."""
    sd, gp, upp, dp, w13, w2 = {}, [], [], [], [], []
    for e in range(E):
        if naming == "mixtral":
            base = f"model.layers.1.block_sparse_moe.experts.{e}."
            names = (base + "w1.", base + "w3.", base + "w2.")
        else:
            base = f"model.layers.1.mlp.experts.{e}."
            names = (base + "gate_proj.", base + "up_proj.", base + "down_proj.")
        mats = []
        for j, (pre, k, n, gl) in enumerate(zip(names, (H, H, I), (I, I, H), (gate_g, up_g, down_g))):
            s = seed * 100 + e * 3 + j
            if method == "awq":
                t, w = awq_layer(k, n, group_size, s)
            else:
                t, w = gptq_layer(k, n, 4, group_size, sym, gl[e] if gl is not None else None, fmt, s)
            put(sd, pre, t)
            mats.append(w)
        gp.append(names[0])
        upp.append(names[1])
        dp.append(names[2])
        w13.append(torch.cat([mats[0].t(), mats[1].t()], 0))
        w2.append(mats[2].t())
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(seed)) * 0.05
    sd["model.layers.1.block_sparse_moe.gate.weight"] = router
    return sd, gp, upp, dp, router, torch.stack(w13), torch.stack(w2)


def _check_moe(moe, w13, w2, dtype=torch.float16):
    assert isinstance(moe, MarlinMoE)
    assert (moe.num_experts, moe.hidden_size, moe.intermediate_size, moe.top_k) == (E, H, I, 2)
    d13, d2 = moe.dequantize()
    assert d13.shape == (E, 2 * I, H) and d2.shape == (E, H, I)
    assert torch.equal(d13, w13.to(dtype)), "gate/up"
    assert torch.equal(d2, w2.to(dtype)), "down"


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("sym", [True, False])
def test_moe_gptq_no_act_order(group_size, sym):
    sd, gp, upp, dp, router, w13, w2 = _moe_checkpoint("gptq", group_size, sym=sym, naming="qwen")
    cfg = QuantConfig("gptq", 4, group_size, sym=sym)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, cfg)
    _check_moe(moe, w13, w2)
    assert moe.w13_perm is None and moe.w2_perm is None
    assert (moe.w13_qzeros is None) == sym and (moe.w2_qzeros is None) == sym
    assert torch.equal(moe.router.weight, router.half())


@pytest.mark.parametrize("group_size", [32, 64])
def test_moe_gptq_act_order_shared_g_idx(group_size):
    """Mixtral-style: gate (w1) and up (w3) of an expert share their g_idx (same input Hessian);
    every expert and the down projections have their own."""
    gate_g = [act_order_g_idx(H, group_size, 10 + e) for e in range(E)]
    down_g = [act_order_g_idx(I, group_size, 20 + e) for e in range(E)]
    sd, gp, upp, dp, router, w13, w2 = _moe_checkpoint("gptq", group_size, gate_g, gate_g, down_g, sym=True)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, QuantConfig("gptq", 4, group_size, desc_act=True))
    _check_moe(moe, w13, w2)
    assert moe.w13_perm.shape == (E, H) and moe.w2_perm.shape == (E, I) and moe.w13_perm.dtype == torch.int32
    for e in range(E):  # the packed rows are sorted by group
        assert torch.equal(torch.from_numpy(gate_g[e])[moe.w13_perm[e].long()], torch.arange(H) // group_size)
    assert moe.w13_qzeros is None


def test_moe_gptq_act_order_up_groups_numbered_differently():
    """up puts the rows into the same groups as gate but numbers them otherwise: one row order
    serves both, up's scales are reordered."""
    gate_g = [act_order_g_idx(H, 32, 30 + e) for e in range(E)]
    up_g = [renumbered(g, 32, 40 + e) for e, g in enumerate(gate_g)]
    assert not any(np.array_equal(a, b) for a, b in zip(gate_g, up_g))
    sd, gp, upp, dp, router, w13, w2 = _moe_checkpoint("gptq", 32, gate_g, up_g, None, sym=False, fmt="gptq_v2")
    cfg = QuantConfig("gptq", 4, 32, desc_act=True, sym=False, checkpoint_format="gptq_v2")
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, cfg)
    _check_moe(moe, w13, w2)
    assert moe.w13_perm is not None and moe.w2_perm is None and moe.w13_qzeros is not None


def test_moe_gptq_act_order_only_some_experts():
    """Experts 0 and 2 act-order, 1 and 3 not (trivial g_idx): identity rows for those."""
    gate_g = [act_order_g_idx(H, 64, 50 + e) if e % 2 == 0 else None for e in range(E)]
    down_g = [None, act_order_g_idx(I, 64, 60), None, None]
    sd, gp, upp, dp, router, w13, w2 = _moe_checkpoint("gptq", 64, gate_g, gate_g, down_g, sym=True)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, QuantConfig("gptq", 4, 64, desc_act=True))
    _check_moe(moe, w13, w2)
    assert torch.equal(moe.w13_perm[1], torch.arange(H, dtype=torch.int32))
    assert not torch.equal(moe.w13_perm[0], torch.arange(H, dtype=torch.int32))
    assert torch.equal(moe.w2_perm[0], torch.arange(I, dtype=torch.int32))


def test_moe_gptq_act_order_incompatible_gate_up_groups():
    gate_g = [act_order_g_idx(H, 64, 70 + e) for e in range(E)]
    up_g = list(gate_g)
    up_g[2] = act_order_g_idx(H, 64, 99)  # an unrelated partition for expert 2's up projection
    sd, gp, upp, dp, router, *_ = _moe_checkpoint("gptq", 64, gate_g, up_g, None, sym=True)
    with pytest.raises(ValueError, match=r"expert 2: 'model.layers.1.block_sparse_moe.experts.2.w3.g_idx' and "
                                         r"'model.layers.1.block_sparse_moe.experts.2.w1.g_idx' put the input rows "
                                         r"into different groups"):
        MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, QuantConfig("gptq", 4, 64, desc_act=True))


def test_moe_gptq_zero_points_in_some_experts_only():
    """Expert 0 quantized symmetrically (all zeros 8), the others asymmetric: one kernel, so all
    experts carry explicit zero points."""
    sd, gp, upp, dp, router, w13, w2 = _moe_checkpoint("gptq", 64, sym=False, fmt="gptq_v2")
    t, w = gptq_layer(H, I, 4, 64, True, None, "gptq_v2", seed=123)
    put(sd, gp[0], t)
    w13[0, :I] = w.t()
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2,
                                    QuantConfig("gptq", 4, 64, sym=False, checkpoint_format="gptq_v2"))
    _check_moe(moe, w13, w2)
    assert moe.w13_qzeros is not None and moe.w13_qzeros.shape == (E, H // 64, 2 * I * 4 // 32)


@pytest.mark.parametrize("group_size", [64, 128])
def test_moe_awq(group_size):
    sd, gp, upp, dp, router, w13, w2 = _moe_checkpoint("awq", group_size)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, QuantConfig.from_dict(AUTOAWQ_NEW | {
        "q_group_size": group_size}), dtype=torch.bfloat16)
    assert moe.dtype == torch.bfloat16 and moe.w13_perm is None and moe.w13_qzeros is not None
    d13, d2 = moe.dequantize()
    # bf16 scales: compare with the same integers on bf16-rounded scales, in fp32 then cast
    ref13 = torch.stack([torch.cat([_awq_bf16(sd, gp[e], H, I, group_size), _awq_bf16(sd, upp[e], H, I, group_size)])
                         for e in range(E)])
    ref2 = torch.stack([_awq_bf16(sd, dp[e], I, H, group_size) for e in range(E)])
    assert torch.equal(d13, ref13.to(torch.bfloat16)) and torch.equal(d2, ref2.to(torch.bfloat16))
    moe16 = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, QuantConfig("awq", 4, group_size))
    _check_moe(moe16, w13, w2)


def _awq_bf16(sd, prefix, k, n, group_size):
    q = torch.from_numpy(read_awq(sd[prefix + "qweight"])).float()
    z = torch.from_numpy(read_awq(sd[prefix + "qzeros"])).float()
    s = sd[prefix + "scales"].to(torch.bfloat16).float()
    gi = torch.arange(k) // group_size
    return (s[gi] * (q - z[gi])).t()  # [N, K]


def test_moe_from_checkpoint_errors():
    sd, gp, upp, dp, router, *_ = _moe_checkpoint("gptq", 64, sym=True)
    cfg = QuantConfig("gptq", 4, 64)
    with pytest.raises(ValueError, match=r"4 gate, 3 up and 4 down prefixes"):
        MarlinMoE.from_checkpoint(sd, gp, upp[:3], dp, router, 2, cfg)
    with pytest.raises(ValueError, match=r"router_weight must be \[E=4, hidden\], got \(3, 256\)"):
        MarlinMoE.from_checkpoint(sd, gp, upp, dp, router[:3], 2, cfg)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 5, cfg)
    del sd[upp[1] + "scales"]
    with pytest.raises(KeyError, match=r"no 'model.layers.1.block_sparse_moe.experts.1.w3.scales'"):
        MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, cfg)
    sd, gp, upp, dp, router, *_ = _moe_checkpoint("gptq", 64, sym=True)
    with pytest.raises(ValueError, match=r"expert 0: gate \[K, N\] = \[256, 128\], up \[256, 128\] and down "
                                         r"\[256, 128\] do not form an expert"):
        MarlinMoE.from_checkpoint(sd, gp, upp, gp, router, 2, cfg)


def test_moe_constructor_checks_perms():
    sd, gp, upp, dp, router, *_ = _moe_checkpoint("gptq", 64, sym=True)
    moe = MarlinMoE.from_checkpoint(sd, gp, upp, dp, router, 2, QuantConfig("gptq", 4, 64))
    p13 = [moe._packed("w13", e) for e in range(E)]
    p2 = [moe._packed("w2", e) for e in range(E)]
    good = torch.stack([torch.randperm(H) for _ in range(E)])
    m = MarlinMoE(p13, p2, router, 2, w13_perm=good)
    assert m.w13_perm.dtype == torch.int32 and torch.equal(m.w13_perm.long(), good)
    with pytest.raises(ValueError, match=r"w13_perm must be \[E=4, K=256\]"):
        MarlinMoE(p13, p2, router, 2, w13_perm=good[:, :128])
    bad = good.clone()
    bad[3, 0] = bad[3, 1]
    with pytest.raises(ValueError, match=r"w13_perm\[3\] is not a permutation of range\(K=256\)"):
        MarlinMoE(p13, p2, router, 2, w13_perm=bad)
    with pytest.raises(TypeError, match=r"w2_perm must be an integer tensor"):
        MarlinMoE(p13, p2, router, 2, w2_perm=torch.zeros(E, I))
