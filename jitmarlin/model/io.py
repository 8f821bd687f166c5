"""save_quantized / load_quantized: jitmarlin's own saved format, and GPTQ / AWQ checkpoints.

Own format: a directory with ``model.safetensors`` (the quantized model's whole state dict, the
Marlin-packed buffers as they are, tied tensors stored once) and ``jitmarlin_quant.json``, which
names every MarlinLinear / MarlinMoE / MarlinMoEBlock module and its format, so that loading
rebuilds them around the saved buffers without repacking.

GPTQ / AWQ checkpoints (safetensors, sharded or not, with quantize_config.json or a
quantization_config in config.json, or an explicit QuantConfig / dict) go through
jitmarlin.quant.checkpoint: every nn.Linear with a ``qweight`` under its name becomes a
MarlinLinear, every recognised MoE block whose experts are quantized a MarlinMoEBlock (expert
names as the block's adapter gives them, e.g. Mixtral ``experts.{e}.w1/w3/w2``), and the other
tensors are loaded into the model as float.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from .._version import __version__
from ..nn.linear import MarlinLinear
from ..nn.moe import MarlinMoE
from ..quant.packed import Packed
from .blocks import MarlinMoEBlock
from .patch import (_DTYPES, KeptModule, Mover, QuantReport, ReplacedModule, check_device, is_plain_linear,
                    linear_detail, make_block, module_bytes, moe_block_bytes, moe_detail)
from .registry import find_adapter

MANIFEST = "jitmarlin_quant.json"
WEIGHTS = "model.safetensors"
FORMAT = "jitmarlin-marlin-packed"
FORMAT_VERSION = 1
_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _checkpoint():
    """jitmarlin.quant.checkpoint, imported on first use (safetensors I/O and the GPTQ/AWQ builders)."""
    from ..quant import checkpoint

    return checkpoint


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    if not name:
        raise ValueError("the model itself cannot be replaced: quantized modules must be submodules of the model")
    parent, _, attr = name.rpartition(".")
    try:
        return (model.get_submodule(parent) if parent else model), attr
    except AttributeError:
        raise ValueError(f"module '{name}' not found in the model: load into the architecture the checkpoint was made "
                         "for") from None


def _get(model: nn.Module, name: str) -> nn.Module:
    parent, attr = _parent(model, name)
    m = parent._modules.get(attr)
    if m is None:
        raise ValueError(f"module '{name}' not found in the model: load into the architecture the checkpoint was made "
                         "for")
    return m


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, attr = _parent(model, name)
    parent._modules[attr] = module


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# ---------------------------------------------------------------- save


def _linear_entry(m: MarlinLinear) -> dict:
    return {"class": "MarlinLinear", "in_features": m.in_features, "out_features": m.out_features, "bits": m.bits,
            "group_size": m.group_size, "zero_points": not m.sym, "act_order": m.act_order,
            "bias": m.bias is not None, "dtype": _DTYPE_NAMES[m.dtype]}


def _moe_entry(m: MarlinMoE) -> dict:
    return {"num_experts": m.num_experts, "top_k": m.top_k, "renormalize": m.renormalize,
            "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size, "bits": m.bits,
            "group_size": m.group_size, "zero_points": m.w13_qzeros is not None, "act_order": m.w13_perm is not None,
            "dtype": _DTYPE_NAMES[m.dtype]}


def save_quantized(model: nn.Module, path) -> Path:
    """Write a model with jitmarlin modules (from quantize_model or load_quantized) to the
    directory ``path`` (created if needed): model.safetensors + jitmarlin_quant.json. Returns the
    directory. Load it back with load_quantized(fresh_float_model, path)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"path={str(path)!r} exists and is not a directory: save_quantized writes a directory")
    from .fuse import FusedSlice

    fused = [name for name, m in model.named_modules() if isinstance(m, FusedSlice)]
    if fused:
        raise ValueError(f"the model has fused projections ({fused[0]}{' and more' if len(fused) > 1 else ''}): "
                         "save_quantized writes the layers as quantize_model / load_quantized made them; save "
                         "before jitmarlin.fuse_projections, and fuse again after loading")
    modules: dict[str, dict] = {}
    for name, m in model.named_modules():
        if isinstance(m, MarlinMoEBlock):
            modules[name] = {"class": "MarlinMoEBlock", "source": m.source, **_moe_entry(m.moe),
                             "shared_expert": m.shared_expert is not None,
                             "shared_expert_gate": m.shared_expert_gate is not None,
                             "returns_router_logits": m.returns_router_logits}
        elif isinstance(m, MarlinMoE):
            parent = name.rpartition(".")[0]
            if not (isinstance(modules.get(parent), dict) and modules[parent]["class"] == "MarlinMoEBlock"
                    and name == (parent + ".moe" if parent else "moe")):
                modules[name] = {"class": "MarlinMoE", **_moe_entry(m)}
        elif isinstance(m, MarlinLinear):
            modules[name] = _linear_entry(m)
    if not modules:
        raise ValueError("the model has no MarlinLinear / MarlinMoE modules: quantize it first "
                         "(jitmarlin.quantize_model)")
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for key, t in model.state_dict().items():
        if t is None:
            continue
        ident = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and ident in seen:
            tied[key] = seen[ident]
            continue
        seen[ident] = key
        store = (t.device, t.untyped_storage().data_ptr())
        t = t.detach().to("cpu")
        if store in storages or not t.is_contiguous():
            t = t.contiguous().clone()
        storages.add(store)
        tensors[key] = t
    path.mkdir(parents=True, exist_ok=True)
    _checkpoint().save_safetensors(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "jitmarlin": __version__,
                "modules": modules, "tied": tied}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / MANIFEST)
    return path


# ---------------------------------------------------------------- load: shared steps


def _resolve_dtype(model: nn.Module, dtype, sd: dict) -> torch.dtype:
    if dtype is not None:
        if dtype not in _DTYPES:
            raise TypeError(f"dtype={dtype} is not supported: jitmarlin runs float16 or bfloat16 activations")
        return dtype
    for p in model.parameters():
        if p.is_floating_point() and p.dtype in _DTYPES:
            return p.dtype
        if p.is_floating_point():
            break
    for key, t in sd.items():
        if key.endswith(".scales") and t.dtype in _DTYPES:
            return t.dtype
    return torch.float16


def _load_floats(model: nn.Module, tensors: dict, consumed: set, mover: Mover, report: QuantReport) -> None:
    """Put the unconsumed tensors into the model's parameters and persistent buffers (assigned,
    so a meta model works), converted to the device and dtype; tied parameters stay tied."""
    built = set()
    for m in model.modules():
        if isinstance(m, (MarlinLinear, MarlinMoE)):
            built.update(id(s) for s in m.modules())
    targets: dict[str, tuple[nn.Module, str, int | None]] = {}  # name -> (module, attribute, id of the parameter)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in built:
            continue
        pre = f"{mname}." if mname else ""
        for pname, p in mod._parameters.items():
            if p is not None:
                targets[pre + pname] = (mod, pname, id(p))
                holders.setdefault(id(p), []).append((mod, pname))
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                targets[pre + bname] = (mod, bname, None)
    installed: set[int] = set()
    for key, t in tensors.items():
        if key in consumed:
            continue
        target = targets.get(key)
        if target is None:
            report.unexpected_keys.append(key)
            continue
        mod, attr, pid = target
        old = getattr(mod, attr)
        if tuple(t.shape) != tuple(old.shape):
            raise ValueError(f"checkpoint tensor '{key}' has shape {tuple(t.shape)} but the model's is "
                             f"{tuple(old.shape)}: load into the architecture the checkpoint was made for")
        if pid is not None:
            val = t.detach().to(mover.device, mover.dtype if t.is_floating_point() else old.dtype)
            new = nn.Parameter(val, requires_grad=old.requires_grad and val.is_floating_point())
            for m2, a2 in holders[pid]:  # every module sharing the parameter (tied weights)
                m2._parameters[a2] = new
        else:
            new = t.detach().to(mover.device, mover.dtype if t.is_floating_point() else old.dtype)
            mod._buffers[attr] = new
        installed.add(id(new))
    for key, (mod, attr, _) in targets.items():
        cur = getattr(mod, attr)
        if id(cur) in installed:
            continue
        if cur.device.type == "meta":
            raise ValueError(f"'{key}' is on the meta device and the checkpoint has no tensor for it: it would hold no "
                             "values (check that the checkpoint matches the model)")
        report.missing_keys.append(key)
    for name, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and b.device.type == "meta":
                raise ValueError(f"buffer '{name + '.' if name else ''}{bname}' is on the meta device and no checkpoint "
                                 "holds it (a non-persistent buffer such as a rotary table): build the model under "
                                 "jitmarlin.init_empty_weights(), which keeps buffers real, or on the CPU")
    mover.tree(model, "")


def _finish(model: nn.Module, report: QuantReport) -> QuantReport:
    report.bytes_after = module_bytes(model)
    if report.unexpected_keys:
        warnings.warn(f"load_quantized: {len(report.unexpected_keys)} checkpoint tensor(s) match nothing in the "
                      f"model and were ignored: {', '.join(report.unexpected_keys[:8])}"
                      f"{' ...' if len(report.unexpected_keys) > 8 else ''}", stacklevel=3)
    if report.missing_keys:
        warnings.warn(f"load_quantized: {len(report.missing_keys)} model tensor(s) are not in the checkpoint and keep "
                      f"their values: {', '.join(report.missing_keys[:8])}"
                      f"{' ...' if len(report.missing_keys) > 8 else ''}", stacklevel=3)
    return report


# ---------------------------------------------------------------- load: own format


def _packs(t: dict, pre: str, which: str, e: int, bits: int, group: int) -> list[Packed]:
    b, s = t[f"{pre}{which}_qweight"], t[f"{pre}{which}_scales"]
    z = t.get(f"{pre}{which}_qzeros")
    return [Packed(b[i], s[i], z[i] if z is not None else None, bits, group) for i in range(e)]


def _rebuild_moe(t: dict, pre: str, entry: dict) -> MarlinMoE:
    e, bits, group = entry["num_experts"], entry["bits"], entry["group_size"]
    return MarlinMoE(_packs(t, pre, "w13", e, bits, group), _packs(t, pre, "w2", e, bits, group),
                     t[pre + "router.weight"], entry["top_k"], renormalize=entry["renormalize"],
                     w13_perm=t.get(pre + "w13_perm"), w2_perm=t.get(pre + "w2_perm"))


def _load_own(model: nn.Module, root: Path, manifest: dict, device: torch.device, dtype) -> QuantReport:
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{root / MANIFEST} is format {manifest.get('format')!r} version "
                         f"{manifest.get('format_version')!r}; this jitmarlin reads {FORMAT!r} version {FORMAT_VERSION}")
    modules: dict = manifest["modules"]
    saved_dtypes = {entry["dtype"] for entry in modules.values()}
    if dtype is not None and {_DTYPE_NAMES.get(dtype, str(dtype))} != saved_dtypes:
        raise ValueError(f"dtype={dtype} but the saved model is {', '.join(sorted(saved_dtypes))}: load it without "
                         "dtype")
    dt = getattr(torch, sorted(saved_dtypes)[0])
    report = QuantReport(dtype=dt, device=device, bytes_before=module_bytes(model))
    tensors = _checkpoint().load_safetensors(str(root / WEIGHTS))
    for alias, target in manifest.get("tied", {}).items():
        tensors[alias] = tensors[target]
    mover = Mover(model, device, dt)
    consumed: set[str] = set()

    def take(pre: str) -> dict:
        out = {}
        for key in [k for k in tensors if k.startswith(pre)]:
            out[key] = tensors[key].to(device)
            consumed.add(key)
        return out

    # check every entry against the model before changing anything
    specs = {}
    for name, entry in sorted(modules.items()):
        old = _get(model, name)
        cls = entry["class"]
        if cls == "MarlinLinear":
            if not isinstance(old, (nn.Linear, MarlinLinear)) or (old.in_features, old.out_features) != (
                    entry["in_features"], entry["out_features"]):
                got = (f"{type(old).__name__}({old.in_features}, {old.out_features})"
                       if isinstance(old, (nn.Linear, MarlinLinear)) else type(old).__name__)
                raise ValueError(f"'{name}' was saved as a MarlinLinear({entry['in_features']}, "
                                 f"{entry['out_features']}) but the model has {got} there")
        elif cls == "MarlinMoEBlock":
            adapter = find_adapter(old)
            if adapter is None:
                raise ValueError(f"'{name}' was saved as a MarlinMoEBlock (from {entry.get('source') or '?'}) but the "
                                 f"model's {type(old).__name__} there is no known MoE block: register it with "
                                 "jitmarlin.register_moe before load_quantized")
            spec = specs[name] = adapter(old)
            for part in ("shared_expert", "shared_expert_gate"):
                if entry[part] != (getattr(spec, part) is not None):
                    raise ValueError(f"'{name}': the saved block {'has' if entry[part] else 'has no'} {part} but the "
                                     f"model's {type(old).__name__} {'has none' if entry[part] else 'has one'}")
        elif cls != "MarlinMoE":
            raise ValueError(f"{root / MANIFEST}: module '{name}' has an unknown class {cls!r}")

    # MoE blocks first (their shared experts' linears are entries of their own, replaced next)
    for name, entry in sorted(modules.items()):
        cls = entry["class"]
        if cls not in ("MarlinMoEBlock", "MarlinMoE"):
            continue
        old = _get(model, name)
        pre = f"{name}.moe." if cls == "MarlinMoEBlock" else f"{name}."
        moe = _rebuild_moe(take(pre), pre, entry)
        if cls == "MarlinMoEBlock":
            new, before = make_block(moe, specs[name], type(old).__name__), moe_block_bytes(old, specs[name])
        else:
            new, before = moe, module_bytes(old)
        _set(model, name, new)
        report.replaced.append(ReplacedModule(name, "MarlinMoE", type(old).__name__, moe_detail(moe), before,
                                              module_bytes(moe)))
    for name, entry in sorted(modules.items()):
        if entry["class"] != "MarlinLinear":
            continue
        old = _get(model, name)
        t = take(name + ".")
        packed = Packed(t[f"{name}.qweight"], t[f"{name}.scales"], t.get(f"{name}.qzeros"), entry["bits"],
                        entry["group_size"])
        new = MarlinLinear.from_packed(packed, bias=t.get(f"{name}.bias"), perm=t.get(f"{name}.perm"))
        _set(model, name, new)
        report.replaced.append(ReplacedModule(name, "MarlinLinear", type(old).__name__, linear_detail(new),
                                              module_bytes(old), module_bytes(new)))
    with torch.no_grad():
        _load_floats(model, tensors, consumed, mover, report)
    return report


# ---------------------------------------------------------------- load: GPTQ / AWQ


def _load_checkpoint(model: nn.Module, sd: dict, cfg, device: torch.device, dtype) -> QuantReport:
    ck = _checkpoint()
    dt = _resolve_dtype(model, dtype, sd)
    report = QuantReport(dtype=dt, device=device, bytes_before=module_bytes(model))
    mover = Mover(model, device, dt)
    consumed: set[str] = set()

    def consume(prefix: str) -> None:
        consumed.update(prefix + s for s in _QUANT_SUFFIXES if prefix + s in sd)

    # MoE blocks whose experts are quantized
    replaced: list[str] = []
    for name, mod in list(model.named_modules()):
        if _under(name, replaced) or not name:
            continue
        adapter = find_adapter(mod)
        if adapter is None:
            continue
        spec = adapter(mod)
        if spec.checkpoint_experts is None or spec.checkpoint_router is None:
            continue
        e = spec.num_experts
        lists = [[f"{name}.{fmt.format(e=i)}." for i in range(e)] for fmt in spec.checkpoint_experts]
        flags = [ck.is_quantized_linear(sd, p) for lst in lists for p in lst]
        if not any(flags):
            continue
        if not all(flags):
            missing = [p for lst in lists for p in lst if not ck.is_quantized_linear(sd, p)]
            raise ValueError(f"MoE block '{name}': the checkpoint quantizes some experts but not "
                             f"{', '.join(m + 'qweight' for m in missing[:4])}{' ...' if len(missing) > 4 else ''}: "
                             "the experts of a block must all be quantized")
        router_key = f"{name}.{spec.checkpoint_router}"
        if router_key not in sd:
            raise ValueError(f"MoE block '{name}': the checkpoint has quantized experts but no router weight "
                             f"'{router_key}'")
        # MarlinMoE.from_checkpoint comes with jitmarlin.quant.checkpoint (imported above)
        moe = MarlinMoE.from_checkpoint(sd, lists[0], lists[1], lists[2], sd[router_key], spec.top_k, cfg,
                                        renormalize=spec.renormalize, dtype=dt, device=device)
        if (moe.hidden_size, moe.intermediate_size, moe.num_experts) != (spec.hidden_size, spec.intermediate_size, e):
            raise ValueError(f"MoE block '{name}': the checkpoint's experts are {moe.num_experts} x "
                             f"H={moe.hidden_size}, "
                             f"I={moe.intermediate_size} but the model's are {e} x H={spec.hidden_size}, "
                             f"I={spec.intermediate_size}")
        for lst in lists:
            for p in lst:
                consume(p)
        consumed.add(router_key)
        before = moe_block_bytes(mod, spec)
        _set(model, name, make_block(moe, spec, type(mod).__name__))
        replaced.append(name)
        report.replaced.append(ReplacedModule(name, "MarlinMoE", type(mod).__name__, moe_detail(moe), before,
                                              module_bytes(moe)))
    # nn.Linear layers with a qweight
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or not ck.is_quantized_linear(sd, name + "."):
            continue
        if not is_plain_linear(mod):
            report.kept.append(KeptModule(name, type(mod).__name__, f"{type(mod).__name__} is a subclass of nn.Linear "
                                          "with its own forward; its quantized checkpoint tensors are not used"))
            continue
        try:
            new = ck.linear_from_checkpoint(sd, name + ".", cfg, dtype=dt, device=device)
        except (ValueError, TypeError) as err:
            raise type(err)(f"'{name}': {err}") from err
        if (new.in_features, new.out_features) != (mod.in_features, mod.out_features):
            raise ValueError(f"'{name}': the checkpoint's layer is {new.in_features} -> {new.out_features} but the "
                             f"model's nn.Linear is {mod.in_features} -> {mod.out_features}")
        consume(name + ".")
        _set(model, name, new)
        report.replaced.append(ReplacedModule(name, "MarlinLinear", type(mod).__name__, linear_detail(new),
                                              module_bytes(mod), module_bytes(new)))
    orphans = sorted({k.rpartition(".")[0] for k in sd if k.endswith(".qweight") and k not in consumed})
    if orphans:
        raise ValueError(f"the checkpoint has quantized layers the model has no nn.Linear or MoE block for: "
                         f"{', '.join(orphans[:6])}{' ...' if len(orphans) > 6 else ''}")
    with torch.no_grad():
        _load_floats(model, sd, consumed, mover, report)
    return report


# ---------------------------------------------------------------- load_quantized


def load_quantized(model: nn.Module, path_or_state_dict, quant_config=None, *, device="cuda",
                   dtype: torch.dtype | None = None) -> QuantReport:
    """Load quantized weights into ``model`` (in place) and return a QuantReport.

    path_or_state_dict:
      - a directory written by save_quantized: the jitmarlin modules are rebuilt around the
        saved packed buffers (no repacking); the model must be the float architecture it was
        saved from (MoE block types must be recognised, e.g. registered again).
      - a GPTQ or AWQ checkpoint: a directory (safetensors, sharded or not, plus
        quantize_config.json or config.json's quantization_config), a .safetensors file, or a
        dict of tensors -- with quant_config (a jitmarlin.quant.checkpoint.QuantConfig or the
        quantization-config dict) when the files do not say or for a dict.
    model may be on the CPU or have its parameters on the meta device (build it under
    jitmarlin.init_empty_weights(): buffers that no checkpoint holds, such as rotary tables,
    must be real). Everything ends up on ``device`` in ``dtype`` (default: the saved dtype; for
    GPTQ/AWQ the model's float16/bfloat16 dtype, else the checkpoint scales' dtype). Checkpoint
    tensors that match nothing, and model tensors the checkpoint lacks, are listed in the report
    (and warned about); a parameter left on the meta device is an error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    dev = check_device(device)
    if isinstance(path_or_state_dict, dict):
        if quant_config is None:
            raise ValueError("a state dict needs quant_config (a QuantConfig or the quantization-config dict: method, "
                             "bits, group_size, ...)")
        return _finish(model, _load_checkpoint(model, path_or_state_dict, _as_config(quant_config), dev, dtype))
    if not isinstance(path_or_state_dict, (str, os.PathLike)):
        raise TypeError(f"path_or_state_dict must be a path or a dict of tensors, got "
                        f"{type(path_or_state_dict).__name__}")
    path = Path(path_or_state_dict)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    root = path if path.is_dir() else path.parent
    if (root / MANIFEST).is_file() and (path.is_dir() or path.name == WEIGHTS):
        if quant_config is not None:
            raise ValueError(f"{root} holds a model saved by jitmarlin.save_quantized: quant_config is not used, "
                             "leave it out")
        manifest = json.loads((root / MANIFEST).read_text())
        return _finish(model, _load_own(model, root, manifest, dev, dtype))
    ck = _checkpoint()
    cfg = _as_config(quant_config) if quant_config is not None else ck.QuantConfig.from_pretrained(str(root))
    sd = ck.load_safetensors(str(path))
    return _finish(model, _load_checkpoint(model, sd, cfg, dev, dtype))


def _as_config(quant_config):
    ck = _checkpoint()
    if isinstance(quant_config, ck.QuantConfig):
        return quant_config
    if isinstance(quant_config, dict):
        return ck.QuantConfig.from_dict(quant_config)
    raise TypeError(f"quant_config must be a QuantConfig or a dict, got {type(quant_config).__name__}")
