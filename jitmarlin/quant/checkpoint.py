"""Quantized checkpoints: their configuration, safetensors files, and layers built from their tensors.

- ``QuantConfig``: what a GPTQ or AWQ checkpoint says about itself (``quantize_config.json`` of
  AutoGPTQ/GPTQModel, ``quant_config.json`` of AutoAWQ, or ``config.json["quantization_config"]``
  of transformers), validated against what the jitmarlin kernels take.
- ``load_safetensors`` / ``save_safetensors``: a reader (memory-mapped, every header field checked
  before use) and an atomic writer of the public safetensors format: an 8-byte little-endian
  header length, a UTF-8 JSON header (``{"name": {"dtype", "shape", "data_offsets"}, ...}`` plus
  an optional ``"__metadata__"`` of strings), then the raw little-endian tensor bytes; the data
  offsets are relative to the end of the header and the tensors tile the data without gaps.
- ``linear_from_checkpoint``: one quantized linear layer (``<prefix>qweight`` / ``scales`` /
  ``qzeros`` / ``g_idx`` / ``bias``) -> ``MarlinLinear``. ``MarlinMoE.from_checkpoint`` builds a
  mixture-of-experts layer from the same per-expert tensors with the helpers below.

Act-order (g_idx): group g of the packed weight covers packed rows [g*G, (g+1)*G). A row order
that makes every block of G rows come from one checkpoint group is what the kernel needs; the
scales of block j are then those of that group. When g_idx is already constant on every
contiguous block of G rows (trivial, or groups merely renumbered) no rows move and only the
scale rows are reordered: no activation gather at run time. Otherwise the rows are sorted by
group (stable) and the layer gathers its activation columns with the resulting perm.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from ..ops._kernels import check_group_size
from .awq import unpack_awq
from .gptq import _check_bits, check_kernel_shape, check_scales, unpack_gptq_qweight, unpack_gptq_qzeros
from .layout import pack_zeros
from .packed import Packed, pack
from .rtn import Quantized, check_group

__all__ = ["QuantConfig", "SafetensorsError", "load_safetensors", "save_safetensors", "safetensors_metadata",
           "linear_from_checkpoint", "is_quantized_linear"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16)

# ============================================================================ QuantConfig

_METHODS = ("gptq", "awq")
_GPTQ_FORMATS = ("gptq", "gptq_v2")
_CONFIG_FILES = ("quantize_config.json", "quant_config.json", "config.json")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class QuantConfig:
    """How the quantized layers of a checkpoint are stored.

    method: "gptq" or "awq". bits: 4 or 8 (AWQ: 4). group_size: -1 (one group over all input
    features), 32, 64 or a multiple of 128 (the group sizes the kernel takes). desc_act: GPTQ
    act-order (each layer's g_idx is then required). sym: GPTQ symmetric quantization (defaults to
    True for GPTQ; AWQ is always asymmetric, so it defaults to -- and must be -- False there).
    checkpoint_format: "gptq" (AutoGPTQ v1: qzeros hold zero - 1) or "gptq_v2" (GPTQModel: the
    zeros themselves) for GPTQ, "awq" for AWQ (the default follows the method).
    ``zero_point`` (derived): whether the layers carry zero points that matter (AWQ, or GPTQ with
    sym=False).
    """

    method: str
    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool | None = None
    checkpoint_format: str | None = None

    def __post_init__(self):
        if self.method not in _METHODS:
            raise ValueError(f"method={self.method!r} is not supported: jitmarlin loads 'gptq' and 'awq' checkpoints")
        awq = self.method == "awq"
        if self.sym is None:
            object.__setattr__(self, "sym", not awq)
        if self.checkpoint_format is None:
            object.__setattr__(self, "checkpoint_format", "awq" if awq else "gptq")
        if not _is_int(self.bits) or self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits!r} is not supported: the jitmarlin kernels take 4- or 8-bit weights")
        if not _is_int(self.group_size):
            raise ValueError(f"group_size={self.group_size!r} must be an integer")
        check_group_size(self.group_size)
        for name in ("desc_act", "sym"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if awq:
            if self.bits != 4:
                raise ValueError(f"bits={self.bits} is not supported for AWQ: the AutoAWQ GEMM packing is 4-bit only")
            if self.sym:
                raise ValueError("sym=True is not valid for AWQ: AWQ checkpoints are asymmetric (they store zero "
                                 "points)")
            if self.desc_act:
                raise ValueError("desc_act=True is not valid for AWQ: AWQ has no act-order")
            if self.checkpoint_format != "awq":
                raise ValueError(f"checkpoint_format={self.checkpoint_format!r} is not valid for AWQ: use 'awq'")
        elif self.checkpoint_format not in _GPTQ_FORMATS:
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r} is not supported for GPTQ: use one of "
                             f"{_GPTQ_FORMATS} ('gptq' = AutoGPTQ v1, qzeros hold zero - 1; 'gptq_v2' = the zeros "
                             "themselves); Marlin/BitBLAS/QQQ-packed checkpoints need the original GPTQ tensors")

    @property
    def zero_point(self) -> bool:
        return self.method == "awq" or not self.sym

    # ---- parsing ----

    @classmethod
    def from_dict(cls, d: Mapping) -> "QuantConfig":
        """From a quantize_config.json (AutoGPTQ / GPTQModel), an AutoAWQ quant_config.json, or the
        "quantization_config" of a transformers config.json. Keys that do not change how the tensors
        are stored (damp_percent, true_sequential, static_groups, modules_to_not_convert, meta, ...)
        are ignored."""
        if not isinstance(d, Mapping):
            raise TypeError(f"a quantization config must be a dict, got {type(d).__name__}")
        method = d.get("quant_method")
        if method is None:  # old AutoGPTQ / AutoAWQ files do not name the method
            method = "awq" if any(k in d for k in ("w_bit", "q_group_size", "zero_point", "version")) else "gptq"
        if not isinstance(method, str):
            raise ValueError(f"quant_method={method!r} must be a string")
        method = method.lower()
        if method not in _METHODS:
            raise ValueError(f"quant_method={method!r} is not supported: jitmarlin loads 'gptq' and 'awq' checkpoints")
        if method == "gptq":
            return cls._from_gptq_dict(d)
        return cls._from_awq_dict(d)

    @staticmethod
    def _required(d: Mapping, *names: str):
        for n in names:
            if d.get(n) is not None:
                return d[n]
        raise ValueError(f"the quantization config has no {' / '.join(map(repr, names))} entry")

    @classmethod
    def _from_gptq_dict(cls, d: Mapping) -> "QuantConfig":
        if d.get("is_marlin_format"):
            raise ValueError("is_marlin_format=true: this GPTQ checkpoint is stored in the Marlin layout of another "
                             "library, which jitmarlin does not read; use the original GPTQ checkpoint")
        fmt = d.get("checkpoint_format")
        alt = d.get("format")  # GPTQModel writes both keys
        if fmt is None:
            fmt = alt
        elif alt is not None and str(alt).lower() != str(fmt).lower():
            raise ValueError(f"checkpoint_format={fmt!r} and format={alt!r} disagree")
        fmt = "gptq" if fmt is None else fmt
        if not isinstance(fmt, str):
            raise ValueError(f"checkpoint_format={fmt!r} must be a string")
        pack_dtype = d.get("pack_dtype")
        if pack_dtype is not None and str(pack_dtype).lower().replace("torch.", "") != "int32":
            raise ValueError(f"pack_dtype={pack_dtype!r} is not supported: jitmarlin reads GPTQ weights packed in "
                             "int32")
        if d.get("dynamic"):
            warnings.warn("the GPTQ config has per-module 'dynamic' overrides; jitmarlin applies the top-level "
                          "bits/group_size to every quantized layer (a layer stored otherwise fails its shape checks)",
                          stacklevel=3)
        desc_act, sym = d.get("desc_act"), d.get("sym")
        return cls(method="gptq", bits=cls._required(d, "bits"), group_size=cls._required(d, "group_size"),
                   desc_act=False if desc_act is None else desc_act, sym=True if sym is None else sym,
                   checkpoint_format=fmt.lower())

    @classmethod
    def _from_awq_dict(cls, d: Mapping) -> "QuantConfig":
        backend = d.get("backend")
        if isinstance(backend, str) and backend.lower() == "llm-awq":
            raise ValueError("backend='llm-awq': checkpoints of the original llm-awq use another packing; jitmarlin "
                             "reads the AutoAWQ GEMM packing")
        version = d.get("version") or d.get("format") or "gemm"
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ValueError(f"AWQ version={version!r} is not supported: jitmarlin reads the AutoAWQ 'gemm' packing "
                             "(the GEMV, GEMV-fast, Marlin and other AWQ packings differ)")
        zero_point = True if d.get("zero_point") is None else d["zero_point"]
        if zero_point is not True:
            raise ValueError(f"AWQ zero_point={zero_point!r} is not supported: jitmarlin reads AWQ checkpoints with "
                             "zero points (zero_point=true)")
        if d.get("desc_act"):
            raise ValueError("desc_act=true is not valid for AWQ: AWQ has no act-order")
        return cls(method="awq", bits=cls._required(d, "bits", "w_bit"),
                   group_size=cls._required(d, "group_size", "q_group_size"), sym=False, checkpoint_format="awq")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "QuantConfig":
        """From a checkpoint directory: quantize_config.json, else quant_config.json, else
        config.json["quantization_config"]. A path to one JSON file is read the same way (its
        "quantization_config" entry if it has one, else the whole file)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            for name in _CONFIG_FILES:
                f = os.path.join(path, name)
                if os.path.isfile(f):
                    break
            else:
                raise FileNotFoundError(f"{path} holds none of {', '.join(_CONFIG_FILES)}: not a quantized checkpoint "
                                        "directory (or its configuration is missing)")
        elif os.path.isfile(path):
            f, name = path, os.path.basename(path)
        else:
            raise FileNotFoundError(f"{path} does not exist")
        try:
            with open(f, encoding="utf-8") as fh:
                d = json.load(fh)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{f} must hold a JSON object, got {type(d).__name__}")
        if "quantization_config" in d:
            d = d["quantization_config"]
        elif name == "config.json":
            raise ValueError(f"{f} has no 'quantization_config' entry: the model is not quantized (or its "
                             "quantize_config.json is missing)")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """A quantize_config.json (GPTQ) or quant_config.json (AWQ) style dict; from_dict reads it back."""
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm"}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format}


# ============================================================================ safetensors

class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file (the message names the file and the problem)."""


def _st_dtypes() -> dict[str, torch.dtype]:
    table = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F16": torch.float16,
             "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "I64": torch.int64,
             "F64": torch.float64}
    for name, attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                       ("F8_E5M2", "float8_e5m2")):
        if hasattr(torch, attr):
            table[name] = getattr(torch, attr)
    return table


_ST_DTYPE = _st_dtypes()
_ST_NAME = {v: k for k, v in _ST_DTYPE.items()}
_MAX_HEADER = 100 << 20  # bytes; real headers are a few MB at most
_INDEX_SUFFIX = ".safetensors.index.json"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this big-endian host is not supported")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


@dataclass
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # relative to the start of the data
    end: int


def _read_header(path: str) -> tuple[dict[str, _Entry], dict[str, str], int, int]:
    """(entries in header order, metadata, data start, data length) of one safetensors file."""
    size = os.path.getsize(path)
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (it starts with an 8-byte "
                               "header length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the {size - 8} bytes after it (truncated or "
                                   "not a safetensors file)")
        if n > _MAX_HEADER:
            raise SafetensorsError(f"{path}: header length {n} is above the {_MAX_HEADER}-byte limit")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"{path}: the header is not UTF-8 ({e})") from e
    if not text.startswith("{"):
        raise SafetensorsError(f"{path}: the header must be a JSON object starting with '{{', got {text[:20]!r}")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise SafetensorsError(f"{path}: the header is not valid JSON: {e}") from e
    data_len = size - 8 - n
    metadata: dict[str, str] = {}
    entries: dict[str, _Entry] = {}
    for name, info in obj.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise SafetensorsError(f"{path}: __metadata__ must map strings to strings, got {info!r}"[:300])
            metadata = dict(info)
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            got = sorted(info) if isinstance(info, dict) else type(info).__name__
            raise SafetensorsError(f"{where} must have exactly the keys dtype, shape and data_offsets, got {got}")
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dt not in _ST_DTYPE:
            raise SafetensorsError(f"{where} has dtype {dt!r}, not one this reader knows ({', '.join(_ST_DTYPE)})")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise SafetensorsError(f"{where} has shape {shape!r}: it must be a list of non-negative integers")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
            raise SafetensorsError(f"{where} has data_offsets {offs!r}: they must be two integers [begin, end]")
        begin, end = offs
        if not 0 <= begin <= end <= data_len:
            raise SafetensorsError(f"{where} has data_offsets [{begin}, {end}] outside the {data_len} data bytes "
                                   "(need 0 <= begin <= end <= data length)")
        numel = 1
        for s in shape:
            numel *= s
        dtype = _ST_DTYPE[dt]
        if end - begin != numel * _itemsize(dtype):
            raise SafetensorsError(f"{where}: {dt} {shape} needs {numel * _itemsize(dtype)} bytes but data_offsets "
                                   f"[{begin}, {end}] span {end - begin}")
        entries[name] = _Entry(dtype, tuple(shape), begin, end)
    pos, prev = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin < pos:
            raise SafetensorsError(f"{path}: tensors {prev!r} and {name!r} overlap (bytes from {e.begin} to {pos})")
        if e.begin > pos:
            raise SafetensorsError(f"{path}: data bytes [{pos}, {e.begin}) belong to no tensor (the format allows "
                                   "no holes)")
        pos, prev = e.end, name
    if pos != data_len:
        raise SafetensorsError(f"{path}: data bytes [{pos}, {data_len}) belong to no tensor (the format allows no "
                               "holes; truncated header or trailing garbage)")
    return entries, metadata, 8 + n, data_len


def _load_file(path: str, names: Iterable[str] | None, device) -> dict[str, torch.Tensor]:
    entries, _, start, _ = _read_header(path)
    if names is None:
        names = list(entries)
    else:
        names = list(names)
        missing = [k for k in names if k not in entries]
        if missing:
            raise KeyError(f"{path} has no tensor {missing[0]!r}" + (f" (nor {len(missing) - 1} more requested)"
                                                                      if len(missing) > 1 else ""))
    out: dict[str, torch.Tensor] = {}
    mm = None
    for name in names:
        e = entries[name]
        numel = 1
        for s in e.shape:
            numel *= s
        if numel == 0:
            t = torch.empty(e.shape, dtype=e.dtype)
        else:
            if mm is None:
                with open(path, "rb") as f:  # private copy-on-write map: tensors are writable, the file never changes
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            offset, item = start + e.begin, _itemsize(e.dtype)
            if offset % item == 0:
                t = torch.frombuffer(mm, dtype=e.dtype, count=numel, offset=offset)
            else:  # unaligned (a writer that did not pad): copy into aligned memory
                t = torch.frombuffer(mm, dtype=torch.uint8, count=numel * item, offset=offset).clone().view(e.dtype)
            t = t.reshape(e.shape)
            if e.dtype == torch.bool and int(t.view(torch.uint8).max()) > 1:
                raise SafetensorsError(f"{path}: tensor {name!r} is BOOL but holds bytes other than 0 and 1")
        if device is not None and torch.device(device).type != "cpu":
            t = t.to(device)
        out[name] = t
    return out


def _resolve(path: str) -> tuple[str, str | None]:
    """("file", path) or ("index", index path) for a file or checkpoint directory."""
    if os.path.isfile(path):
        return ("index" if path.endswith(".json") else "file"), path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist")
    names = sorted(os.listdir(path))
    if "model.safetensors.index.json" in names:
        return "index", os.path.join(path, "model.safetensors.index.json")
    if "model.safetensors" in names:
        return "file", os.path.join(path, "model.safetensors")
    indexes = [n for n in names if n.endswith(_INDEX_SUFFIX)]
    if len(indexes) == 1:
        return "index", os.path.join(path, indexes[0])
    files = [n for n in names if n.endswith(".safetensors")]
    if len(indexes) == 0 and len(files) == 1:
        return "file", os.path.join(path, files[0])
    if indexes or files:
        raise FileNotFoundError(f"{path} holds several safetensors checkpoints ({', '.join(indexes or files)}) and no "
                                "model.safetensors[.index.json]: pass the file to load")
    raise FileNotFoundError(f"{path} holds no .safetensors file (looked for model.safetensors, "
                            "model.safetensors.index.json and *.safetensors)")


def _read_index(index: str) -> dict[str, str]:
    try:
        with open(index, encoding="utf-8") as f:
            d = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{index} is not valid JSON: {e}") from e
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise SafetensorsError(f"{index} must hold a 'weight_map' object mapping tensor names to shard file names")
    root = os.path.dirname(index)
    out = {}
    for k, v in wm.items():
        if os.path.isabs(v) or ".." in v.replace("\\", "/").split("/"):
            raise SafetensorsError(f"{index}: shard {v!r} of tensor {k!r} must be a file name inside {root}")
        out[k] = os.path.join(root, v)
    return out


def load_safetensors(path: str | os.PathLike, device: torch.device | str | None = "cpu",
                     keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or of a checkpoint directory (model.safetensors, a sharded
    model.safetensors.index.json with its shards, or its only *.safetensors file).

    On the CPU the tensors are views of a private memory map of the file (nothing is read until
    used; writing to them never changes the file); with another ``device`` they are copied there.
    ``keys`` loads only those tensors (a missing one is a KeyError). Every header field is checked
    before use: a damaged file raises SafetensorsError naming the problem."""
    _check_little_endian()
    kind, f = _resolve(os.fspath(path))
    if kind == "file":
        return _load_file(f, keys, device)
    wm = _read_index(f)
    wanted = list(wm) if keys is None else list(keys)
    missing = [k for k in wanted if k not in wm]
    if missing:
        raise KeyError(f"{f} lists no tensor {missing[0]!r}" + (f" (nor {len(missing) - 1} more requested)"
                                                                 if len(missing) > 1 else ""))
    by_shard: dict[str, list[str]] = {}
    for k in wanted:
        by_shard.setdefault(wm[k], []).append(k)
    loaded: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"{f} maps {names[0]!r} to {shard}, which does not exist")
        try:
            loaded.update(_load_file(shard, names, device))
        except KeyError as e:
            raise SafetensorsError(f"{f} maps tensors to {os.path.basename(shard)} that it does not hold: "
                                   f"{e.args[0]}") from e
    return {k: loaded[k] for k in wanted}


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The "__metadata__" strings of a safetensors file (empty if it has none)."""
    kind, f = _resolve(os.fspath(path))
    if kind != "file":
        raise ValueError(f"{f} is a sharded index: read the metadata of one shard")
    return _read_header(f)[1]


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (any device; written as contiguous CPU data) to a safetensors file, atomically:
    a temporary file in the same directory, renamed over ``path`` once complete. The header is
    padded with spaces to a multiple of 8 bytes and the tensors are laid out by decreasing element
    size, so every tensor of the file is aligned to its element size."""
    _check_little_endian()
    path = os.fspath(path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> torch.Tensor, got {type(tensors).__name__}")
    header: dict[str, object] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in metadata.items()):
            raise TypeError("metadata must map strings to strings (the safetensors format stores nothing else)")
        header["__metadata__"] = dict(metadata)
    prepared = []
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is not allowed: names are strings other than '__metadata__'")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"tensors[{name!r}] has layout {t.layout}: only dense tensors can be saved")
        if t.dtype not in _ST_NAME:
            raise TypeError(f"tensors[{name!r}] has dtype {t.dtype}, which safetensors cannot store "
                            f"(supported: {', '.join(str(d) for d in _ST_NAME)})")
        prepared.append((name, t.detach().to("cpu").contiguous()))
    prepared.sort(key=lambda nt: (-nt[1].element_size(), nt[0]))
    pos = 0
    for name, t in prepared:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAME[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    hdr = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hdr += b" " * (-len(hdr) % 8)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(hdr).to_bytes(8, "little"))
            f.write(hdr)
            for _, t in prepared:
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    f.write((ctypes.c_ubyte * nbytes).from_address(t.data_ptr()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ============================================================================ checkpoint tensors -> layers

class CheckpointKeyError(KeyError):
    """A tensor a layer needs is missing from the state dict (the message names it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class Decoded:
    """One quantized layer of a checkpoint in plain form (original row order), before packing."""

    q: torch.Tensor  # int32 [K, N]
    scales: torch.Tensor  # [groups, N], fp16/bf16
    zeros: torch.Tensor | None  # int32 [groups, N] (the zero points themselves) or None: all 2**(bits-1)
    g_idx: torch.Tensor | None  # int64 [K], None when trivial (arange(K) // G)
    bits: int
    group_size: int
    name: str  # the prefix, for messages

    @property
    def k(self) -> int:
        return self.q.shape[0]

    @property
    def n(self) -> int:
        return self.q.shape[1]

    @property
    def groups(self) -> int:
        return self.scales.shape[0]

    def full_zeros(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full(tuple(self.scales.shape), 1 << (self.bits - 1), dtype=torch.int32, device=self.q.device)


def is_quantized_linear(sd: Mapping[str, torch.Tensor], prefix: str) -> bool:
    """Whether the state dict holds a quantized linear layer at prefix (``prefix + "qweight"``)."""
    return prefix + "qweight" in sd


def _get(sd: Mapping, prefix: str, name: str, why: str, required: bool = True):
    key = prefix + name
    t = sd.get(key)
    if t is None:
        if not required:
            return None
        hint = ""
        if prefix and not prefix.endswith(".") and prefix + "." + name in sd:
            hint = f" (it has '{prefix}.{name}': the prefix must end with '.')"
        raise CheckpointKeyError(f"the checkpoint has no '{key}' ({why}){hint}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"'{key}' must be a torch.Tensor, got {type(t).__name__}")
    return t


def _int32(t: torch.Tensor, key: str, what: str) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"'{key}' must be an int32 tensor ({what}), got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"'{key}' must be 2-D, got shape {tuple(t.shape)}")


def _scales(t: torch.Tensor, key: str, dtype: torch.dtype | None, k: int, n: int, group_size: int) -> torch.Tensor:
    if dtype is not None:
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype={dtype} is not supported: use torch.float16 or torch.bfloat16")
        t = t.to(dtype)
    elif t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"'{key}' is {t.dtype}: pass dtype=torch.float16 or torch.bfloat16 to convert the scales")
    try:
        check_scales(t, k, n, group_size)
    except ValueError as e:
        raise ValueError(f"'{key}': {e}") from e
    return t


def _check_g_idx(g_idx: torch.Tensor, key: str, k: int, groups: int) -> torch.Tensor | None:
    """Validated int64 g_idx, or None when it is arange(K) // G."""
    if g_idx.dtype.is_floating_point or g_idx.dtype.is_complex or g_idx.dtype == torch.bool:
        raise TypeError(f"'{key}' must be an integer tensor, got {g_idx.dtype}")
    if g_idx.dim() != 1 or g_idx.shape[0] != k:
        raise ValueError(f"'{key}' must be 1-D of length K={k} (one group index per input row), got shape "
                         f"{tuple(g_idx.shape)}")
    g = g_idx.to(torch.int64)
    lo, hi = int(g.min()), int(g.max())
    if lo < 0 or hi >= groups:
        raise ValueError(f"'{key}' values must lie in [0, {groups - 1}] ({groups} groups), found [{lo}, {hi}]")
    size = k // groups
    counts = torch.bincount(g, minlength=groups)
    if bool((counts != size).any()):
        bad = int(torch.nonzero(counts != size)[0, 0])
        raise ValueError(f"'{key}' is inconsistent with group_size={size if groups > 1 else -1}: every group must hold "
                         f"exactly {size} input rows, group {bad} has {int(counts[bad])}")
    if torch.equal(g, torch.arange(k, device=g.device) // size):
        return None
    return g


def decode_layer(sd: Mapping[str, torch.Tensor], prefix: str, cfg: QuantConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> Decoded:
    """Read and check one quantized layer's checkpoint tensors (GPTQ or AWQ GEMM layout; see
    jitmarlin.quant.gptq / jitmarlin.quant.awq) into plain integers, scales and zero points.
    Moved to ``device`` first, so the unpacking runs there."""
    if not isinstance(cfg, QuantConfig):
        raise TypeError(f"cfg must be a QuantConfig, got {type(cfg).__name__}")
    bits, gs = cfg.bits, cfg.group_size
    _check_bits(bits)

    def mv(t):
        return t.to(device) if t is not None and device is not None else t

    qweight = mv(_get(sd, prefix, "qweight", "the packed weights"))
    scales = mv(_get(sd, prefix, "scales", "the group scales"))
    kq, kw = prefix + "qweight", prefix + "qzeros"
    if cfg.method == "awq":
        qzeros = mv(_get(sd, prefix, "qzeros", "AWQ zero points"))
        _int32(qweight, kq, "AWQ packs 8 4-bit values per int32 along the output features")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        _int32(qzeros, kw, "AWQ zero points, packed like qweight")
        groups = _groups(k, gs, kq)
        _kernel_shape(k, n, kq)
        scales = _scales(scales, prefix + "scales", dtype, k, n, gs)
        if tuple(qzeros.shape) != (groups, n // 8):
            raise ValueError(f"'{kw}' must be [K/group_size, N/8] = [{groups}, {n // 8}], got {tuple(qzeros.shape)}")
        q = unpack_awq(qweight)
        z = unpack_awq(qzeros)
        zeros = None if bool((z == 8).all()) else z
        return Decoded(q, scales, zeros, None, 4, gs, prefix)
    qzeros = mv(_get(sd, prefix, "qzeros", "zero points of an asymmetric (sym=False) GPTQ checkpoint",
                     required=not cfg.sym))
    g_idx = mv(_get(sd, prefix, "g_idx", "the input rows' groups of an act-order (desc_act=True) checkpoint",
                    required=cfg.desc_act))
    _int32(qweight, kq, f"GPTQ packs {32 // bits} {bits}-bit values per int32 along the input features")
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    groups = _groups(k, gs, kq)
    _kernel_shape(k, n, kq)
    scales = _scales(scales, prefix + "scales", dtype, k, n, gs)
    mid = 1 << (bits - 1)
    zeros = None
    if qzeros is not None:
        _int32(qzeros, kw, f"GPTQ zero points, {32 // bits} per int32 along the output features")
        if tuple(qzeros.shape) != (groups, n * bits // 32):
            raise ValueError(f"'{kw}' must be [K/group_size, N*{bits}/32] = [{groups}, {n * bits // 32}], got "
                             f"{tuple(qzeros.shape)}")
        z = unpack_gptq_qzeros(qzeros, bits)
        if cfg.checkpoint_format == "gptq":
            z = (z + 1) & ((1 << bits) - 1)  # v1 stores zero - 1 (a zero of 0 as the field's -1)
        if not bool((z == mid).all()):
            if cfg.sym:
                warnings.warn(f"'{kw}': sym=True but the {cfg.checkpoint_format} zero points are not all {mid} (found "
                              f"[{int(z.min())}, {int(z.max())}]); keeping them. Check checkpoint_format ('gptq' "
                              "stores zero - 1, 'gptq_v2' the zero itself).", stacklevel=3)
            zeros = z
    g = None
    if g_idx is not None:
        g = _check_g_idx(g_idx, prefix + "g_idx", k, groups)
        if g is not None and not cfg.desc_act:
            warnings.warn(f"'{prefix}g_idx' is not arange(K) // group_size although the config says desc_act=False; "
                          "following g_idx", stacklevel=3)
    return Decoded(unpack_gptq_qweight(qweight, bits), scales, zeros, g, bits, gs, prefix)


def _groups(k: int, group_size: int, key: str) -> int:
    try:
        return check_group(k, group_size)
    except ValueError as e:
        raise ValueError(f"'{key}' holds K={k} input rows: {e}") from e


def _kernel_shape(k: int, n: int, key: str) -> None:
    try:
        check_kernel_shape(k, n)
    except ValueError as e:
        raise ValueError(f"'{key}': {e}") from e


def shared_row_order(layers: list[Decoded]) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """One row order for layers that share their input (K) and are packed side by side along N.

    Returns (order, maps): packed row i is input row order[i] (order None: rows stay), and block j
    of G packed rows uses group maps[l][j] of layer l (None: group j). The order sorts the first
    layer's rows by group; the other layers must then be constant on each block too, i.e. put
    the rows into the same groups (numbering aside), else no single row order serves all of them."""
    first = layers[0]
    k, groups = first.k, first.groups
    size = k // groups
    dev = first.q.device
    trivial = torch.arange(k, device=dev) // size
    gs = [lay.g_idx if lay.g_idx is not None else trivial for lay in layers]
    if all(lay.g_idx is None for lay in layers):
        return None, [None] * len(layers)

    def block_groups(g: torch.Tensor):
        b = g.reshape(groups, size)
        return b[:, 0] if bool((b == b[:, :1]).all()) else None

    maps = [block_groups(g) for g in gs]
    order = None
    if any(m is None for m in maps):  # some layer mixes groups inside a contiguous block: sort the rows
        order = torch.argsort(gs[0], stable=True)
        maps = [block_groups(g[order]) for g in gs]
        for lay, m in zip(layers[1:], maps[1:]):
            if m is None:
                raise ValueError(f"'{lay.name}g_idx' and '{first.name}g_idx' put the input rows into different groups: "
                                 "their weights share one input and are packed side by side, which needs one row "
                                 "order making every block of group_size rows a single group of both")
        if torch.equal(order, torch.arange(k, device=dev)):
            order = None
    ident = torch.arange(groups, device=dev)
    return order, [None if m is None or torch.equal(m, ident) else m for m in maps]


def pack_decoded(layers: list[Decoded]) -> tuple[Packed, torch.Tensor | None]:
    """Pack layers sharing one input side by side along N (one layer: just that layer) in a
    shared row order. Returns (Packed, perm int32 [K] or None); perm means the packed rows are
    input rows perm[i], so the activations must be gathered as x[..., perm]."""
    first = layers[0]
    for lay in layers[1:]:
        if (lay.k, lay.bits, lay.group_size, lay.scales.dtype) != (first.k, first.bits, first.group_size,
                                                                     first.scales.dtype):
            raise ValueError(f"'{lay.name}' ({lay.k} input rows, {lay.bits}-bit, group {lay.group_size}, "
                             f"{lay.scales.dtype}) cannot be packed with '{first.name}' ({first.k}, {first.bits}-bit, "
                             f"group {first.group_size}, {first.scales.dtype})")
    order, maps = shared_row_order(layers)
    with_zeros = any(lay.zeros is not None for lay in layers)
    qs, ss, zs = [], [], []
    for lay, m in zip(layers, maps):
        s, z = lay.scales, (lay.full_zeros() if with_zeros else None)
        if m is not None:
            s = s.index_select(0, m)
            z = z.index_select(0, m) if z is not None else None
        qs.append(lay.q)
        ss.append(s)
        zs.append(z)
    q = qs[0] if len(qs) == 1 else torch.cat(qs, 1)
    if order is not None:
        q = q.index_select(0, order)
    s = ss[0] if len(ss) == 1 else torch.cat(ss, 1)
    z = None if not with_zeros else (zs[0] if len(zs) == 1 else torch.cat(zs, 1))
    packed = pack(Quantized(q=q, scales=s, zeros=z, bits=first.bits, group_size=first.group_size))
    return packed, (order.to(torch.int32) if order is not None else None)


def with_zero_points(p: Packed) -> Packed:
    """The same weights with explicit zero points (2**(bits-1) everywhere if p is symmetric)."""
    if p.zeros is not None:
        return p
    mid = torch.full(tuple(p.scales.shape), 1 << (p.bits - 1), dtype=torch.int32, device=p.b.device)
    return Packed(b=p.b, scales=p.scales, zeros=pack_zeros(mid, p.bits), bits=p.bits, group_size=p.group_size)


def _bias(sd: Mapping, prefix: str, n: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    b = _get(sd, prefix, "bias", "", required=False)
    if b is None:
        return None
    if tuple(b.shape) != (n,):
        raise ValueError(f"'{prefix}bias' must have shape [out_features={n}], got {tuple(b.shape)}")
    return b.to(device=device, dtype=dtype)


def linear_from_checkpoint(sd: Mapping[str, torch.Tensor], prefix: str, cfg: QuantConfig, *,
                           dtype: torch.dtype | None = None, device: torch.device | str | None = None):
    """A MarlinLinear from the checkpoint tensors ``prefix + "qweight" / "scales" / "qzeros" /
    "g_idx" / "bias"`` (prefix ends with '.', e.g. "model.layers.0.mlp.down_proj.").

    Tensors are moved to ``device`` first (repacked there; on a GPU that is fast). ``dtype``
    (float16/bfloat16) converts the scales and bias; default: the checkpoint's scales dtype.
    qzeros is required for asymmetric GPTQ and AWQ, g_idx for desc_act=True; a g_idx that is
    arange(K) // group_size is ignored. Missing tensors raise a KeyError naming them."""
    from ..nn.linear import MarlinLinear  # jitmarlin.nn imports this package

    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string, got {type(prefix).__name__}")
    dec = decode_layer(sd, prefix, cfg, dtype=dtype, device=device)
    packed, perm = pack_decoded([dec])
    bias = _bias(sd, prefix, dec.n, packed.scales.dtype, packed.b.device)
    return MarlinLinear.from_packed(packed, bias=bias, perm=perm)
