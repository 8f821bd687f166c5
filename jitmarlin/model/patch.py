"""quantize_model: replace the nn.Linear layers and MoE blocks of a float model by jitmarlin modules.

The model is walked once, depth first. Every module is finished before the next one starts:
its weights are copied to the target device (in the target dtype), quantized there, and the
float module is dropped from the model, so a model that lives on the CPU can be quantized onto
a GPU that could not hold it in fp16. Modules that stay in float (skipped, or of a shape the
kernel cannot take) are moved to the device as they are, and so are all other parameters and
buffers: at the end the whole model is on the device.
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from ..nn.linear import MarlinLinear
from ..nn.moe import MarlinMoE
from ..ops._kernels import check_group_size
from ..quant.gptq import check_kernel_shape
from ..quant.rtn import check_group
from .blocks import MarlinMoEBlock
from .registry import MoESpec, find_adapter

_DTYPES = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- report


@dataclass
class ReplacedModule:
    name: str
    kind: str  # "MarlinLinear" or "MarlinMoE"
    source: str  # the class it replaced
    detail: str  # shapes and format
    bytes_before: int
    bytes_after: int


@dataclass
class KeptModule:
    name: str
    kind: str  # the class that stayed in float
    reason: str


@dataclass
class QuantReport:
    """What quantize_model / load_quantized did: the modules replaced (with their sizes before and
    after), the nn.Linear layers and MoE blocks kept in float with the reason, and the size of
    the whole model's parameters and buffers before and after. ``str(report)`` is a table."""

    dtype: torch.dtype
    device: torch.device
    replaced: list[ReplacedModule] = field(default_factory=list)
    kept: list[KeptModule] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    missing_keys: list[str] = field(default_factory=list)  # load_quantized: model tensors the checkpoint lacked
    unexpected_keys: list[str] = field(default_factory=list)  # load_quantized: checkpoint tensors nothing used

    @property
    def num_linear(self) -> int:
        return sum(r.kind == "MarlinLinear" for r in self.replaced)

    @property
    def num_moe(self) -> int:
        return sum(r.kind == "MarlinMoE" for r in self.replaced)

    def summary(self) -> str:
        ratio = f" ({self.bytes_after / self.bytes_before:.2f}x)" if self.bytes_before else ""
        return (f"{self.num_linear} nn.Linear -> MarlinLinear, {self.num_moe} MoE block(s) -> MarlinMoE, "
                f"{len(self.kept)} kept in float; model {_mib(self.bytes_before)} -> {_mib(self.bytes_after)}{ratio} "
                f"({self.dtype}, {self.device})")

    def __str__(self) -> str:
        lines = [self.summary()]
        for r in self.replaced:
            lines.append(f"  replaced {r.name}: {r.source} -> {r.kind} {r.detail}, "
                         f"{_mib(r.bytes_before)} -> {_mib(r.bytes_after)}")
        for k in self.kept:
            lines.append(f"  kept     {k.name} ({k.kind}): {k.reason}")
        if self.missing_keys:
            lines.append(f"  not in the checkpoint (values kept): {', '.join(self.missing_keys)}")
        if self.unexpected_keys:
            lines.append(f"  unused checkpoint tensors: {', '.join(self.unexpected_keys)}")
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def module_bytes(module: nn.Module) -> int:
    return tensor_bytes(list(module.parameters()) + list(module.buffers()))


# ---------------------------------------------------------------- options


def check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a torch device: {err}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but torch.cuda.is_available() is False: pass device='cpu' to "
                             "build the quantized modules on the CPU (running them needs a CUDA GPU)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={str(device)!r} is not supported: use a CUDA device (or 'cpu' to build without one)")
    return dev


def model_dtype(model: nn.Module, dtype: torch.dtype | None) -> torch.dtype:
    """dtype, or the model's float dtype when it is float16/bfloat16, else float16."""
    if dtype is not None:
        if dtype not in _DTYPES:
            raise TypeError(f"dtype={dtype} is not supported: jitmarlin runs float16 or bfloat16 activations")
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype if p.dtype in _DTYPES else torch.float16
    return torch.float16


def normalize_skip(skip) -> tuple[str, ...]:
    if skip is None:
        return ()
    if isinstance(skip, str):
        return (skip,)
    skip = tuple(skip)
    for p in skip:
        if not isinstance(p, str):
            raise TypeError(f"skip must be module-name patterns (strings), got {type(p).__name__} {p!r}")
    return skip


def skip_match(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that matches the module name: a glob over the full dotted name, or a
    suffix of whole name components ("lm_head" matches "lm_head" and "model.lm_head";
    "layers.0.mlp" matches "model.layers.0.mlp" but not "model.layers.10.mlp")."""
    for p in patterns:
        if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p):
            return p
    return None


def is_plain_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


# ---------------------------------------------------------------- moving tensors


class Mover:
    """Moves a module's own parameters and buffers to the device; floating parameters and
    persistent floating buffers also to the dtype (non-persistent buffers, such as rotary
    frequency tables, keep their dtype as transformers does). A parameter shared by several
    modules (tied embeddings) stays shared."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        counts: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        self._shared = {i for i, c in counts.items() if c > 1}
        self._memo: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # the old one is kept alive: ids stay unique

    def _convert(self, t: torch.Tensor, to_dtype: bool) -> torch.Tensor:
        if t.device.type == "meta":
            raise ValueError("tensor on the meta device")
        return t.detach().to(device=self.device, dtype=self.dtype if to_dtype and t.is_floating_point() else None)

    def param(self, p: nn.Parameter, name: str) -> nn.Parameter:
        hit = self._memo.get(id(p))
        if hit is not None:
            return hit[1]
        if p.device.type == "meta":
            raise ValueError(f"parameter '{name}' is on the meta device: load real weights into the model first (for "
                             "a checkpoint, use jitmarlin.load_quantized)")
        new = p if (p.device == self.device and (not p.is_floating_point() or p.dtype == self.dtype)) else \
            nn.Parameter(self._convert(p, True), requires_grad=p.requires_grad)
        if id(p) in self._shared:
            self._memo[id(p)] = (p, new)
        return new

    def own(self, module: nn.Module, prefix: str) -> None:
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = self.param(p, prefix + name)
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            if b.device.type == "meta":
                raise ValueError(f"buffer '{prefix}{name}' is on the meta device: it holds no values (build the model "
                                 "with jitmarlin.init_empty_weights(), which keeps buffers real, or on the CPU)")
            module._buffers[name] = self._convert(b, name not in module._non_persistent_buffers_set)

    def tree(self, module: nn.Module, prefix: str) -> None:
        for name, m in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            self.own(m, f"{name}." if name else "")


@contextlib.contextmanager
def init_empty_weights():
    """Build models with their parameters on the meta device (no memory, no init cost) while
    buffers stay real, e.g. for load_quantized::

        with jitmarlin.init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)

    (Under ``torch.device("meta")`` the non-persistent buffers -- rotary tables -- would be
    empty too, and no checkpoint holds them.) Not thread-safe: it patches
    nn.Module.register_parameter for the duration."""
    original = nn.Module.register_parameter

    def register_on_meta(self, name, param):
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


# ---------------------------------------------------------------- building blocks


def quantize_weight(w: torch.Tensor, *, bits: int, group_size: int, act_order: bool, sym: bool):
    """RTN-quantize one float weight [N, K] (nn.Linear layout) where it lives -> (Packed, perm or None)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    q = MarlinLinear.from_linear(lin, bits=bits, group_size=group_size, act_order=act_order, sym=sym)
    return q.packed(), q.perm


def check_moe_shapes(spec: MoESpec, group_size: int) -> None:
    """The expert GEMMs are [K=H, N=2I] and [K=I, N=H]: raise ValueError if the kernel cannot take them."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if not 1 <= spec.top_k <= e:
        raise ValueError(f"top_k={spec.top_k} must be in [1, num_experts={e}]")
    try:
        check_kernel_shape(h, 2 * i)
        check_kernel_shape(i, h)
        check_group(h, group_size)
        check_group(i, group_size)
    except ValueError as err:
        raise ValueError(f"experts with hidden={h}, intermediate={i}: {err}") from None


def moe_block_bytes(block: nn.Module, spec: MoESpec) -> int:
    """Bytes of a MoE block's own parameters: router and experts, not the shared expert (whose
    linear layers are reported on their own)."""
    extras = {id(p) for m in (spec.shared_expert, spec.shared_expert_gate) if m is not None for p in m.parameters()}
    return tensor_bytes([p for p in block.parameters() if id(p) not in extras])


def moe_detail(moe: MarlinMoE) -> str:
    return (f"[{moe.num_experts} experts, top-{moe.top_k}, H={moe.hidden_size}, I={moe.intermediate_size}, "
            f"{moe.bits}-bit, group {moe.group_size}{', zero points' if moe.w13_qzeros is not None else ''}"
            f"{', act-order' if moe.w13_perm is not None else ''}]")


def linear_detail(m: MarlinLinear) -> str:
    return (f"[{m.in_features}->{m.out_features}, {m.bits}-bit, group {m.group_size}"
            f"{', zero points' if not m.sym else ''}{', act-order' if m.act_order else ''}]")


def make_block(moe: MarlinMoE, spec: MoESpec, source: str) -> MarlinMoEBlock:
    return MarlinMoEBlock(moe, shared_expert=spec.shared_expert, shared_expert_gate=spec.shared_expert_gate,
                          returns_router_logits=spec.returns_router_logits, source=source)


def expert_skip(block: nn.Module, name: str, spec: MoESpec, skip: tuple[str, ...]) -> str | None:
    """A reason to keep a MoE block in float when a skip pattern names one of its experts."""
    for sub, _ in block.named_modules(prefix=name):
        rel = sub[len(name) + 1:]
        if rel and any(rel == m or rel.startswith(m + ".") for m in spec.expert_modules):
            p = skip_match(sub, skip)
            if p is not None:
                return (f"skip pattern {p!r} matches its expert module '{sub}' (the experts of a MoE block are "
                        "quantized together)")
    return None


# ---------------------------------------------------------------- quantize_model


class _Quantizer:
    def __init__(self, model, bits, group_size, act_order, sym, skip, device, dtype):
        self.opts = dict(bits=bits, group_size=group_size, act_order=act_order, sym=sym)
        self.skip = skip
        self.device, self.dtype = device, dtype
        self.mover = Mover(model, device, dtype)
        self.report = QuantReport(dtype=dtype, device=device, bytes_before=module_bytes(model))

    def visit(self, module: nn.Module, prefix: str) -> None:
        for name, child in list(module._modules.items()):
            if child is not None:
                module._modules[name] = self.convert(child, prefix + name)
        self.mover.own(module, prefix)

    def keep_tree(self, module: nn.Module, name: str, reason: str) -> None:
        for sub, m in module.named_modules(prefix=name):
            if isinstance(m, nn.Linear) or find_adapter(m) is not None:
                self.report.kept.append(KeptModule(sub, type(m).__name__, reason))
        self.mover.tree(module, name)

    def convert(self, child: nn.Module, name: str) -> nn.Module:
        if isinstance(child, (MarlinLinear, MarlinMoE)):  # already quantized
            return child.to(self.device)
        pattern = skip_match(name, self.skip)
        if pattern is not None:
            self.keep_tree(child, name, f"skipped: matches {pattern!r}")
            return child
        adapter = find_adapter(child)
        if adapter is not None:
            try:
                spec = adapter(child)
                check_moe_shapes(spec, self.opts["group_size"])
                why = expert_skip(child, name, spec, self.skip)
            except ValueError as err:
                spec, why = None, str(err)
            if why is None:
                block = self.moe(child, spec, name)
                self.visit(block, name + ".")  # the shared expert's linears, if any
                return block
            self.report.kept.append(KeptModule(name, type(child).__name__, why))
            self.visit(child, name + ".")  # its linears may still be quantized one by one
            return child
        if isinstance(child, nn.Linear):
            return self.linear(child, name)
        self.visit(child, name + ".")
        return child

    def linear(self, lin: nn.Linear, name: str) -> nn.Module:
        reason = None
        if not is_plain_linear(lin):
            reason = f"{type(lin).__name__} is a subclass of nn.Linear with its own forward"
        else:
            try:
                check_kernel_shape(lin.in_features, lin.out_features)
                check_group(lin.in_features, self.opts["group_size"])
            except ValueError as err:
                reason = str(err)
        if reason is not None:
            self.report.kept.append(KeptModule(name, type(lin).__name__, reason))
            self.mover.tree(lin, name)
            return lin
        if lin.weight.device.type == "meta":
            raise ValueError(f"parameter '{name}.weight' is on the meta device: load real weights into the model "
                             "first (for a checkpoint, use jitmarlin.load_quantized)")
        tmp = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        tmp.weight = nn.Parameter(lin.weight.detach().to(self.device, self.dtype), requires_grad=False)
        if lin.bias is not None:
            tmp.bias = nn.Parameter(lin.bias.detach().to(self.device, self.dtype), requires_grad=False)
        q = MarlinLinear.from_linear(tmp, **self.opts)
        self.report.replaced.append(ReplacedModule(name, "MarlinLinear", type(lin).__name__, linear_detail(q),
                                                   module_bytes(lin), module_bytes(q)))
        return q

    def moe(self, block: nn.Module, spec: MoESpec, name: str) -> MarlinMoEBlock:
        if spec.router_weight.device.type == "meta":
            raise ValueError(f"the router of '{name}' is on the meta device: load real weights into the model first")
        p13, p2, perm13, perm2 = [], [], [], []
        for e in range(spec.num_experts):
            for w, packs, perms in ((spec.gate_up(e), p13, perm13), (spec.down(e), p2, perm2)):
                if w.device.type == "meta":
                    raise ValueError(f"expert {e} of '{name}' is on the meta device: load real weights first")
                packed, perm = quantize_weight(w.detach().to(self.device, self.dtype), **self.opts)
                packs.append(packed)
                perms.append(perm)
        router = spec.router_weight.detach().to(self.device, self.dtype)
        moe = MarlinMoE(p13, p2, router, spec.top_k, renormalize=spec.renormalize,
                        w13_perm=torch.stack(perm13) if perm13[0] is not None else None,
                        w2_perm=torch.stack(perm2) if perm2[0] is not None else None)
        self.report.replaced.append(ReplacedModule(name, "MarlinMoE", type(block).__name__, moe_detail(moe),
                                                   moe_block_bytes(block, spec), module_bytes(moe)))
        return make_block(moe, spec, type(block).__name__)


def quantize_model(model: nn.Module, *, bits: int = 4, group_size: int = 128, act_order: bool = False,
                   skip=("lm_head",), device="cuda", dtype: torch.dtype | None = None,
                   sym: bool = True) -> QuantReport:
    """Replace, in place, every eligible nn.Linear of ``model`` by a MarlinLinear and every
    recognised mixture-of-experts block (Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE, or a type
    added with jitmarlin.register_moe) by a MarlinMoEBlock; RTN quantization.

    bits: 4 or 8. group_size: -1 (per channel), 32, 64 or a multiple of 128. act_order: store the
    act-order layout (a fixed random row permutation, as GPTQ desc_act checkpoints have; with RTN
    it changes nothing in accuracy -- it exercises that path). sym: symmetric (default) or with
    zero points. skip: module-name patterns kept in float -- globs over the dotted name or
    name-component suffixes ("lm_head", "*.down_proj", "model.layers.0"); everything inside a
    matching module is kept too. device: where the quantized model ends up, layer by layer
    (a CPU model larger than the GPU's fp16 footprint fits; 'cpu' builds without a GPU, but
    running the layers needs one). dtype: activation dtype, float16 or bfloat16 (default: the
    model's if it is one of them, else float16); the float parts are converted to it.

    nn.Linear layers whose shape the kernel cannot take (in/out features not multiples of 64,
    in_features not a multiple of group_size) and subclasses of nn.Linear with their own forward
    stay in float, listed with the reason in the returned QuantReport.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported: use 4 or 8")
    check_group_size(group_size)
    if isinstance(model, nn.Linear) or find_adapter(model) is not None:
        raise TypeError(f"quantize_model replaces the submodules of a model, and the model itself is a "
                        f"{type(model).__name__}: use MarlinLinear.from_linear / MarlinMoE.from_float, or wrap it "
                        "in a module")
    skip = normalize_skip(skip)
    dev = check_device(device)
    dt = model_dtype(model, dtype)
    q = _Quantizer(model, bits, group_size, act_order, sym, skip, dev, dt)
    with torch.no_grad():
        q.visit(model, "")
    q.report.bytes_after = module_bytes(model)
    return q.report
