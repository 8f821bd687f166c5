"""Adapters for peer W4A16 GEMM kernels, measured side by side with jitmarlin.

Common input (the same plain quantized form jitmarlin starts from):

    q       integer tensor [K, N], values in [0, 16)
    scales  fp16 [K/G, N]
    G       group size (128 in the benchmarks); symmetric, zero point 8:
            W[k, n] = scales[k // G, n] * (q[k, n] - 8),   out = a @ W,   a: [M, K]

``make_peer(name, q, scales, group_size, device)`` returns a :class:`Peer` (callable ``peer(a) -> [M, N]``)
or ``None``; when it returns ``None`` the reason is in ``unavailable[name]`` (full traceback in
``tracebacks[name]``). Nothing here raises on a missing package, an unsupported shape or a failing build.

Each peer takes activations in ``peer.dtype`` (create the timing inputs in that dtype: the conversion is
not part of the peer's work) and returns ``peer.out_dtype``. ``peer.note`` says exactly which API and
configuration was used. ``peer.warmup(ms)`` runs every M once so that JIT builds (humming) and Triton
autotuning (gemlite) happen before timing. ``check_peer`` compares a peer against the fp64 product with the
dequantized weight; the benchmark must time only peers whose check passed.

Peers:
    torch_int4  torch.ops.aten._weight_int4pack_mm (PyTorch's tinygemm int4 kernel; bf16 in/out on CUDA)
    humming     humming-kernels HummingLayer, uint4 symmetric, group G, default per-M heuristics
    gemlite     gemlite GemLiteLinear A16W4, group G, scalar zero point 8 ((q - 8) * s), default autotune
    gemlite_hqq gemlite's helper A16W4_HQQ_INT.from_weights (per-group zero tensor, fma dequant); optional

Install on the GPU machine (wheels carried in .whl/, ignored by git; every dependency is already there):
    python3 -m pip install --no-deps --no-index .whl/*.whl

Self-test (builds each peer on a random layer and checks it; prints JSON; exit status 1 if a check fails):
    python3 benchmarks/peers.py --k 4096 --n 4096 --m 1 16 128 [--peers torch_int4 humming gemlite gemlite_hqq]

MoE peer (used by bench_moe.py): ``make_humming_moe(w13, w13_scale, w2, w2_scale, group_size, device)`` builds
:class:`HummingMoE`, Humming's two expert GEMMs (gate/up w13 [E, 2I, H], down w2 [E, H, I]) in its "indexed" MoE
mode, or returns ``None`` with the reason in ``unavailable["humming_moe"]``. ``indexed_tables`` turns a routing
[T, k] into the tables that mode reads (the vLLM moe_align_block_size contract); ``check_humming_moe`` compares
sampled output rows with the dequantized experts.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

PEER_NAMES = ("torch_int4", "humming", "gemlite")
OPTIONAL_PEER_NAMES = ("gemlite_hqq",)

unavailable: dict[str, str] = {}  # name -> one-line reason the peer could not be made
tracebacks: dict[str, str] = {}  # name -> full traceback of that failure (when there was one)

DEFAULT_TOL = 1e-2  # relative Frobenius error; a wrong layout/convention gives ~0.3 .. 1.5


@dataclass
class Peer:
    name: str
    dtype: torch.dtype  # activation dtype the kernel takes
    out_dtype: torch.dtype
    note: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    k: int
    n: int
    group_size: int
    device: torch.device
    version: str = ""
    check: dict | None = None  # last check_peer result
    keep: list = field(default_factory=list, repr=False)  # objects that must outlive the callable

    def __call__(self, a: torch.Tensor) -> torch.Tensor:
        return self.fn(a)

    def warmup(self, ms, iters: int = 2) -> dict[int, str]:
        """Run the peer on zeros [m, K] for every m (JIT builds, autotuning). Returns {m: error} for failures."""
        errors: dict[int, str] = {}
        for m in ms:
            try:
                x = torch.zeros(int(m), self.k, dtype=self.dtype, device=self.device)
                for _ in range(iters):
                    self.fn(x)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            except Exception as e:  # noqa: BLE001 - reported, never raised
                errors[int(m)] = _reason(e)
        return errors


# ----------------------------------------------------------------------------------------------------------
# helpers


def _reason(e: BaseException, limit: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(name: str, reason: str, exc: BaseException | None = None) -> None:
    unavailable[name] = reason
    if exc is not None:
        tracebacks[name] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _pkg_version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


def _validate(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    if q.dim() != 2:
        raise ValueError(f"q must be [K, N], got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"q must be an integer tensor, got {q.dtype}")
    k, n = q.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"K={k} must be a positive multiple of group_size={group_size}")
    if tuple(scales.shape) != (k // group_size, n):
        raise ValueError(f"scales must be [K/G, N] = {(k // group_size, n)}, got {tuple(scales.shape)}")
    qmin, qmax = int(q.min()), int(q.max())
    if qmin < 0 or qmax > 15:
        raise ValueError(f"q values must lie in [0, 15], found [{qmin}, {qmax}]")
    return k, n


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int, dtype=torch.float32) -> torch.Tensor:
    """W [K, N] = scales[k // G, n] * (q[k, n] - 8), computed in `dtype` on q's device."""
    s = scales.to(device=q.device, dtype=dtype).repeat_interleave(group_size, dim=0)
    return (q.to(dtype) - 8) * s


def pack_k_lsb_first(q_nk: torch.Tensor) -> torch.Tensor:
    """[N, K] ints in [0, 16) -> int32 [N, K/8], value k at bits 4*(k % 8) of word k // 8 (little-endian nibbles)."""
    n, k = q_nk.shape
    if k % 8:
        raise ValueError(f"K={k} must be a multiple of 8")
    v = q_nk.to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.arange(8, device=q_nk.device, dtype=torch.int64) * 4
    words = (v << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # wrap into signed int32


# ----------------------------------------------------------------------------------------------------------
# torch_int4: torch.ops.aten._weight_int4pack_mm (tinygemm)


def _make_torch_int4(q, scales, group_size, device, inner_k_tiles=None, **_):
    k, n = q.shape
    if group_size not in (32, 64, 128, 256):
        raise NotImplementedError(f"tinygemm supports group sizes 32/64/128/256, not {group_size}")
    if inner_k_tiles is None:
        inner_k_tiles = next((t for t in (8, 4, 2) if k % (t * 16) == 0), None)
        if inner_k_tiles is None:
            raise NotImplementedError(f"K={k} must be a multiple of 32 for _convert_weight_to_int4pack")
    if k % (inner_k_tiles * 16):
        raise NotImplementedError(f"K={k} must be a multiple of innerKTiles*16={inner_k_tiles * 16}")
    if n % 8:
        raise NotImplementedError(f"N={n} must be a multiple of 8")

    q_nk = q.to(device=device, dtype=torch.int32).t().contiguous()  # [N, K]
    # tinygemm dequantizes w = (q - 8) * scale + zero; our symmetric form is zero = 0. qScaleAndZeros must be
    # bf16 like the activations: torch 2.11 accepts fp16 ones without complaint (and reads them wrongly).
    s_bf = scales.to(device=device).to(torch.bfloat16)  # [K/G, N]
    scale_and_zeros = torch.stack([s_bf, torch.zeros_like(s_bf)], dim=-1).contiguous()  # [K/G, N, 2]

    if device.type == "cuda":
        cap = _cuda_capability(device)
        if cap < (8, 0):
            raise NotImplementedError(f"tinygemm needs sm_80+, device is sm_{cap[0]}{cap[1]}")
        # torch >= 2.5: uint8 [N, K/2], even k in the high nibble (torch/testing/_internal/common_quantization.py)
        w_u8 = ((q_nk[:, ::2] << 4) | q_nk[:, 1::2]).to(torch.uint8).contiguous()
        w_packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, inner_k_tiles)
        op, op_name = torch.ops.aten._weight_int4pack_mm, "_weight_int4pack_mm"
        where = f"_convert_weight_to_int4pack(uint8 [N,K/2], innerKTiles={inner_k_tiles}) -> int32 {tuple(w_packed.shape)}"
    else:
        w_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_nk, inner_k_tiles)
        op, op_name = torch.ops.aten._weight_int4pack_mm_for_cpu, "_weight_int4pack_mm_for_cpu"
        where = f"_convert_weight_to_int4pack_for_cpu(int32 [N,K], innerKTiles={inner_k_tiles}) (CPU path)"

    def fn(a: torch.Tensor) -> torch.Tensor:
        return op(a, w_packed, group_size, scale_and_zeros)

    note = (
        f"torch {torch.__version__}: torch.ops.aten.{op_name}(a bf16 [M,K], w, {group_size}, qScaleAndZeros) "
        f"(tinygemm); {where}; qScaleAndZeros bf16 [K/G,N,2] = (scale, zero=0), dequant (q-8)*scale+zero; "
        f"bf16 activations and output (the CUDA kernel rejects fp16 activations); fp16 scales rounded to bf16"
    )
    return Peer("torch_int4", torch.bfloat16, torch.bfloat16, note, fn, k, n, group_size, device,
                version=torch.__version__, keep=[w_packed, scale_and_zeros])


# ----------------------------------------------------------------------------------------------------------
# humming: humming-kernels HummingLayer


def _make_humming(q, scales, group_size, device, dtype=torch.float16, tuning_config=None, **_):
    if device.type != "cuda":
        raise NotImplementedError("humming needs a CUDA device")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"humming activations must be fp16/bf16, got {dtype}")
    from humming.layer import HummingLayer  # noqa: PLC0415 - optional dependency

    k, n = q.shape
    with torch.cuda.device(device):
        layer = HummingLayer(
            shape_n=n,
            shape_k=k,
            # uint4 without zero point: humming dequantizes (q - 8) * scale (humming/utils/weight.py)
            weight_config={"quant_method": "humming", "dtype": "uint4", "group_size": group_size},
            torch_dtype=dtype,
        ).to(device)
        tensors = {
            # int32 [N, K/8], little-endian nibbles along K (humming/include/humming/kernel/pack_weight.cuh)
            "weight": pack_k_lsb_first(q.to(device=device).t()),
            "weight_scale": scales.to(device=device, dtype=dtype).t().contiguous(),  # [N, K/G]
        }
        layer.load_from_tensors(tensors)
        layer.transform()

    if tuning_config is None:
        def fn(a: torch.Tensor) -> torch.Tensor:
            return layer(a)
    else:
        def fn(a: torch.Tensor) -> torch.Tensor:
            return layer(a, tuning_config=tuning_config)

    version = _pkg_version("humming-kernels")
    note = (
        f"humming-kernels {version}: humming.layer.HummingLayer(shape_n=N, shape_k=K, "
        f"weight_config={{'dtype': 'uint4', 'group_size': {group_size}}}, torch_dtype={dtype}); "
        f"load_from_tensors(weight int32 [N,K/8], weight_scale [N,K/G]); transform(); layer(a). "
        + ("Default tuning (tuning_config=None): humming's own heuristic table of (M interval -> kernel config) "
           "for this device and layer, chosen per call by M; M is not needed at construction, but every kernel of "
           "the table is NVRTC-compiled on the first call (cached under humming's cache dir)"
           if tuning_config is None else f"fixed tuning_config={tuning_config!r}")
    )
    out_dtype = dtype
    return Peer("humming", dtype, out_dtype, note, fn, k, n, group_size, device, version=version, keep=[layer])


# ----------------------------------------------------------------------------------------------------------
# gemlite: GemLiteLinear A16W4


def _gemlite_dtype(dtype):
    from gemlite import DType  # noqa: PLC0415

    if dtype == torch.float16:
        return DType.FP16
    if dtype == torch.bfloat16:
        return DType.BF16
    raise ValueError(f"gemlite A16W4 activations must be fp16/bf16, got {dtype}")


def _make_gemlite(q, scales, group_size, device, dtype=torch.float16, **_):
    if device.type != "cuda":
        raise NotImplementedError("gemlite needs a CUDA device")
    with torch.cuda.device(device):
        import gemlite  # noqa: PLC0415 - optional; its import needs a GPU (queries device properties)
        from gemlite import GemLiteLinear  # noqa: PLC0415

        k, n = q.shape
        gdt = _gemlite_dtype(dtype)
        layer = GemLiteLinear(
            4,
            group_size=group_size,
            in_features=k,
            out_features=n,
            input_dtype=gdt,
            output_dtype=gdt,
            scaled_activations=False,
        )
        # W_q uint8 [N, K] (gemlite packs it over K itself), scales [N, K/G], integer zero 8:
        # W_group_mode 3 with a scalar zero -> (q - 8) * scale in the kernel (gemlite/triton_kernels/utils.py)
        layer.pack(
            q.to(device=device).t().contiguous().to(torch.uint8),
            scales.to(device=device, dtype=dtype).t().contiguous(),
            8,
            bias=None,
        )
    version = getattr(gemlite, "__version__", _pkg_version("gemlite"))
    note = (
        f"gemlite {version}: GemLiteLinear(4, group_size={group_size}, in_features=K, out_features=N, "
        f"input_dtype={gdt.name}, output_dtype={gdt.name}).pack(W_q uint8 [N,K], scales [N,K/G], zeros=8) "
        f"-> W_group_mode={layer.W_group_mode} (scalar zero), packing {layer.W_q.dtype} x{layer.elements_per_sample}; "
        f"layer(a) = forward_auto_no_warmup: kernel by M (GEMV_REVSPLITK M<=4, GEMM_SPLITK M<64, GEMM otherwise), "
        f"Triton autotune 'fast' on first call per M bucket (no shipped config for this GPU unless its name "
        f"matches one in gemlite/configs)"
    )
    return Peer("gemlite", dtype, dtype, note, layer, k, n, group_size, device, version=version, keep=[layer])


def _make_gemlite_hqq(q, scales, group_size, device, dtype=torch.float16, **_):
    if device.type != "cuda":
        raise NotImplementedError("gemlite needs a CUDA device")
    with torch.cuda.device(device):
        import gemlite  # noqa: PLC0415
        from gemlite.helper import A16W4_HQQ_INT  # noqa: PLC0415

        k, n = q.shape
        s_nk = scales.to(device=device, dtype=dtype).t().contiguous()  # [N, K/G]
        layer = A16W4_HQQ_INT(device=str(device), dtype=dtype).from_weights(
            q.to(device=device).t().contiguous().to(torch.uint8),  # [N, K]
            s_nk,
            torch.full_like(s_nk, 8),  # HQQ form (W_q - zeros) * scales
        )
    version = getattr(gemlite, "__version__", _pkg_version("gemlite"))
    note = (
        f"gemlite {version}: gemlite.helper.A16W4_HQQ_INT(dtype={dtype}).from_weights(W_q uint8 [N,K], "
        f"scales [N,K/G], zeros [N,K/G]=8) -> W_group_mode={layer.W_group_mode} (fma with per-group -zero*scale); "
        f"kernel by M and Triton autotune as for 'gemlite'"
    )
    return Peer("gemlite_hqq", dtype, dtype, note, layer, k, n, group_size, device, version=version, keep=[layer])


_MAKERS = {
    "torch_int4": _make_torch_int4,
    "humming": _make_humming,
    "gemlite": _make_gemlite,
    "gemlite_hqq": _make_gemlite_hqq,
}


# ----------------------------------------------------------------------------------------------------------
# public API


def make_peer(name: str, q: torch.Tensor, scales: torch.Tensor, group_size: int, device="cuda", **options):
    """Build peer `name` for the layer (q [K, N], scales [K/G, N], group_size) on `device`.

    Returns a Peer, or None with the reason in unavailable[name]. Options: dtype= (humming, gemlite: fp16
    default, bf16 allowed), inner_k_tiles= (torch_int4), tuning_config= (humming; default: its heuristics).
    """
    unavailable.pop(name, None)
    tracebacks.pop(name, None)
    maker = _MAKERS.get(name)
    if maker is None:
        _fail(name, f"unknown peer {name!r}; known: {sorted(_MAKERS)}")
        return None
    try:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _validate(q, scales, group_size)
        peer = maker(q, scales, group_size, device, **options)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return peer
    except ImportError as e:
        _fail(name, f"not installed: {_reason(e)}", e)
    except NotImplementedError as e:
        _fail(name, f"unsupported: {_reason(e)}", e)
    except Exception as e:  # noqa: BLE001 - any failure is recorded, never raised
        _fail(name, f"failed to build: {_reason(e)}", e)
    return None


def make_peers(q, scales, group_size, device="cuda", names=PEER_NAMES, **options) -> dict[str, Peer]:
    """All peers in `names` that could be built ({name: Peer}); the others are in `unavailable`."""
    out = {}
    for name in names:
        peer = make_peer(name, q, scales, group_size, device, **options)
        if peer is not None:
            out[name] = peer
    return out


def check_peer(peer: Peer, q: torch.Tensor, scales: torch.Tensor, group_size: int, a: torch.Tensor,
               tol: float = DEFAULT_TOL) -> dict:
    """Run `peer` on `a` (cast to peer.dtype) and compare with a_cast @ W in fp64, W dequantized from (q, scales).

    Returns {"ok", "rel_err", "max_abs_err", "ref_max_abs", "tol", "m", "error"}; never raises. The result is
    also stored in peer.check. ok is False on any exception, wrong shape, non-finite output or rel_err > tol.
    """
    result = {"name": getattr(peer, "name", "?"), "ok": False, "rel_err": None, "max_abs_err": None,
              "ref_max_abs": None, "tol": tol, "m": None, "error": None}
    try:
        dev = peer.device
        x = a.to(device=dev, dtype=peer.dtype).contiguous()
        result["m"] = int(x.shape[0])
        out = peer(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        expected_shape = (x.shape[0], peer.n)
        if tuple(out.shape) != expected_shape:
            raise RuntimeError(f"output shape {tuple(out.shape)} != expected {expected_shape}")
        if out.dtype != peer.out_dtype:
            raise RuntimeError(f"output dtype {out.dtype} != declared out_dtype {peer.out_dtype}")
        w = dequantize(q.to(dev), scales.to(dev), group_size, dtype=torch.float64)
        ref = x.to(torch.float64) @ w
        diff = out.to(torch.float64) - ref
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError("output has non-finite values")
        ref_norm = float(ref.norm())
        result["rel_err"] = float(diff.norm()) / max(ref_norm, 1e-30)
        result["max_abs_err"] = float(diff.abs().max())
        result["ref_max_abs"] = float(ref.abs().max())
        result["ok"] = result["rel_err"] <= tol
        if not result["ok"]:
            result["error"] = f"relative error {result['rel_err']:.3g} > tol {tol:g}: adapter or kernel is wrong"
    except Exception as e:  # noqa: BLE001
        result["error"] = _reason(e)
        result["traceback"] = traceback.format_exc()
    try:
        peer.check = result
    except Exception:  # noqa: BLE001
        pass
    return result


def random_layer(k: int, n: int, group_size: int = 128, device="cpu", seed: int = 0):
    """A random (q, scales) pair in the common form, scales sized so that outputs are O(1) for unit activations."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.5 + 0.75) / (4.6 * math.sqrt(k))
    return q.to(device), scales.to(torch.float16).to(device)


# ----------------------------------------------------------------------------------------------------------
# humming MoE: the two expert GEMMs of an MoE layer in Humming's "indexed" mode (bench_moe.py's peer)
#
# Humming's indexed GEMM (humming/ops/gemm.py humming_gemm, launcher csrc/launcher/launcher.cpp) takes
# sorted_ids / expert_ids / num_tokens_padded (int32, on the device) and top_k: block b of BlockShape::M rows
# uses expert expert_ids[b]; row r of the block reads activation row sorted_ids[b*M + r] // top_k and writes
# output row sorted_ids[b*M + r] of an output [rows(inputs) * top_k, N] (include/humming/scheduler.cuh
# fetch_moe_index_block, calc_m_blocks reads num_tokens_padded[0]). The block size M must be the kernel's
# block_shape[0], which Humming's heuristics choose per M = tokens * top_k, so the peer resolves the tuning
# config itself (one config dict per GEMM, passed as tuning_config) and builds the tables for its block_shape[0].

HUMMING_MOE = "humming_moe"
# ComputeConfig(gemm_type="indexed"), as the JSON string humming_forward accepts
_INDEXED_COMPUTE = json.dumps({"gemm_type": "indexed"})


def humming_expert_tensors(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert in the common form (q [K, N] in [0, 16), scales [K/G, N]) -> Humming's 'humming' checkpoint form
    as _make_humming loads it: weight int32 [N, K/8] (little-endian nibbles along K), weight_scale [N, K/G]."""
    return pack_k_lsb_first(q.t()), scales.t().contiguous()


def indexed_tables(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Routing [T, k] -> the tables of Humming's indexed MoE GEMM (the vLLM moe_align_block_size contract).

    Slot s = t*k + j is token t's j-th expert. Returns, on topk_ids' device:
      sorted_ids  int32 [T*k + E*(block_m-1)]: the slots grouped by expert (ascending expert, ascending slot within
                  an expert), each expert's run padded to a multiple of block_m with the sentinel T*k; entries past
                  num_padded hold the sentinel too
      expert_ids  int32 [ceil(len(sorted_ids) / block_m)]: the expert of each block (blocks past num_padded: E-1;
                  the kernel never reads them)
      num_padded  int32 [1]: sum over experts of ceil(count / block_m) * block_m
    Synchronises with the host (a benchmark computes it once, outside the timed region). Written here rather
    than taken from jitmarlin.moe_align_block_size so that the peer's inputs do not depend on the package under
    test (tests/test_bench_moe_peer.py checks the two agree).
    """
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer tensor [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts <= 0 or block_m <= 0:
        raise ValueError(f"num_experts={num_experts} and block_m={block_m} must be positive")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    if numel and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}), found [{int(flat.min())}, {int(flat.max())}]")
    counts = torch.bincount(flat, minlength=num_experts)  # tokens per expert
    blocks = (counts + block_m - 1) // block_m  # blocks per expert
    run_start = torch.cumsum(blocks * block_m, 0) - blocks * block_m  # where each expert's padded run begins
    order = torch.argsort(flat, stable=True)  # slots by expert, ascending slot within one expert
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # position of each expert's first slot in `order`
    place = run_start[expert_of] + torch.arange(numel, device=dev) - first[expert_of]
    length = numel + num_experts * (block_m - 1)
    sorted_ids = torch.full((length,), numel, dtype=torch.int32, device=dev)
    sorted_ids[place] = order.to(torch.int32)
    num_blocks = -(-length // block_m)
    expert_ids = torch.full((num_blocks,), num_experts - 1, dtype=torch.int32, device=dev)
    used = torch.repeat_interleave(torch.arange(num_experts, device=dev), blocks)
    expert_ids[: used.numel()] = used.to(torch.int32)
    num_padded = (blocks.sum() * block_m).reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, num_padded


@dataclass
class HummingMoEPlan:
    """What one token count needs: a tuning config per GEMM (for M = T*k), the tables for each block size, and
    the output buffers (given to humming as outputs=, so its launcher checks their shapes)."""
    tokens: int
    top_k: int
    tuning13: dict
    tuning2: dict
    tables: dict  # block_m -> (sorted_ids, expert_ids, num_padded)
    out13: torch.Tensor  # [T*k, 2I]
    out2: torch.Tensor  # [T*k, H]
    tuning13_json: str = ""
    tuning2_json: str = ""

    def __post_init__(self):
        self.tuning13_json = json.dumps(self.tuning13)
        self.tuning2_json = json.dumps(self.tuning2)

    @property
    def block_m13(self) -> int:
        return int(self.tuning13["block_shape"][0])

    @property
    def block_m2(self) -> int:
        return int(self.tuning2["block_shape"][0])

    def summary(self) -> dict:
        return {"tokens": self.tokens, "top_k": self.top_k, "block_m13": self.block_m13, "block_m2": self.block_m2,
                "num_padded13": int(self.tables[self.block_m13][2][0]),
                "num_padded2": int(self.tables[self.block_m2][2][0]),
                "tuning13": self.tuning13, "tuning2": self.tuning2}


class HummingMoE:
    """Humming's two expert GEMMs: up/gate x [T, H] -> [T*k, 2I] (top_k=k: row = slot, A row = slot // k) and
    down act [T*k, I] -> [T*k, H] (top_k=1), both W4 (uint4, zero point 8) group G, fp16, indexed mode."""

    name = HUMMING_MOE

    def __init__(self, layer13, layer2, num_experts: int, hidden: int, inter: int, group_size: int,
                 device: torch.device, dtype: torch.dtype, version: str):
        self.layer13, self.layer2 = layer13, layer2
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.group_size, self.device, self.dtype, self.version = group_size, device, dtype, version

    @property
    def note(self) -> str:
        return (
            f"humming-kernels {self.version}: two humming.layer.HummingLayer(shape_n=N, shape_k=K, "
            f"num_experts={self.num_experts}, weight_config={{'dtype': 'uint4', 'group_size': {self.group_size}}}, "
            f"torch_dtype={self.dtype}) (w13 N=2I={2 * self.inter} K=H={self.hidden}; w2 N=H K=I={self.inter}); "
            f"load_from_tensors(weight int32 [E,N,K/8], weight_scale [E,N,K/G]); transform(); "
            f"layer(a, outputs=, sorted_ids=, expert_ids=, num_tokens_padded=, top_k=k (w13) / 1 (w2), "
            f"compute_config={_INDEXED_COMPUTE}, tuning_config=humming.tune.get_heuristics_config("
            f"layer.humming_config, shape_m=T*k, gemm_type='indexed')) - humming's own heuristic config for that M, "
            f"one per GEMM; tables: vLLM moe_align contract padded to that config's block_shape[0], built once "
            f"outside the timing; "
            f"the activation between the GEMMs is a precomputed tensor (no SiLU, routing weights or top-k sum timed)"
        )

    def tuning(self, which: str, m: int) -> dict:
        from humming.tune import get_heuristics_config  # noqa: PLC0415 - optional dependency

        layer = self.layer13 if which == "w13" else self.layer2
        cfg = get_heuristics_config(layer.humming_config, shape_m=int(m), gemm_type="indexed", device=self.device)
        if not isinstance(cfg, dict) or len(cfg.get("block_shape") or ()) != 3:
            raise RuntimeError(f"humming's heuristics for the indexed {which} GEMM at M={m} returned {cfg!r}; "
                               f"expected one config dict with a 3-element block_shape")
        return dict(cfg)

    def plan(self, topk_ids: torch.Tensor) -> HummingMoEPlan:
        t, k = topk_ids.shape
        tuning13, tuning2 = self.tuning("w13", t * k), self.tuning("w2", t * k)
        tables = {}
        for cfg in (tuning13, tuning2):
            bm = int(cfg["block_shape"][0])
            if bm not in tables:
                tables[bm] = indexed_tables(topk_ids.to(self.device), self.num_experts, bm)
        out13 = torch.empty(t * k, 2 * self.inter, dtype=self.dtype, device=self.device)
        out2 = torch.empty(t * k, self.hidden, dtype=self.dtype, device=self.device)
        return HummingMoEPlan(t, k, tuning13, tuning2, tables, out13, out2)

    def precompile(self, topk_shapes) -> None:
        """Compile the kernels of every (T, k) in topk_shapes at once (humming builds a list of configs in
        parallel: HummingKernel.prepare_kernels -> compile_many); later calls with the same configs reuse them."""
        from humming.kernel.humming import HummingKernel  # noqa: PLC0415

        for which, layer in (("w13", self.layer13), ("w2", self.layer2)):
            cfgs = []
            for t, k in topk_shapes:
                cfg = self.tuning(which, t * k)
                if cfg not in cfgs:
                    cfgs.append(cfg)
            HummingKernel.prepare_kernels(layer.humming_config.to_str(), _INDEXED_COMPUTE,
                                          json.dumps([[0, 1 << 30, c] for c in cfgs]), device=self.device)

    def up(self, plan: HummingMoEPlan, x: torch.Tensor) -> torch.Tensor:
        sorted_ids, expert_ids, num_padded = plan.tables[plan.block_m13]
        return self.layer13(x, outputs=plan.out13, sorted_ids=sorted_ids, expert_ids=expert_ids,
                            num_tokens_padded=num_padded, top_k=plan.top_k, compute_config=_INDEXED_COMPUTE,
                            tuning_config=plan.tuning13_json)

    def down(self, plan: HummingMoEPlan, act: torch.Tensor) -> torch.Tensor:
        sorted_ids, expert_ids, num_padded = plan.tables[plan.block_m2]
        return self.layer2(act, outputs=plan.out2, sorted_ids=sorted_ids, expert_ids=expert_ids,
                           num_tokens_padded=num_padded, top_k=1, compute_config=_INDEXED_COMPUTE,
                           tuning_config=plan.tuning2_json)

    def run(self, plan: HummingMoEPlan, x: torch.Tensor, act: torch.Tensor):
        """Both GEMMs (what bench_moe times): (out13 [T*k, 2I], out2 [T*k, H])."""
        return self.up(plan, x), self.down(plan, act)


def _humming_moe_layer(weight: torch.Tensor, scale: torch.Tensor, group_size: int, device, dtype):
    from humming.layer import HummingLayer  # noqa: PLC0415 - optional dependency

    e, n, k8 = weight.shape
    layer = HummingLayer(
        shape_n=n,
        shape_k=k8 * 8,
        # uint4 without zero point: humming dequantizes (q - 8) * scale, as for the dense peer
        weight_config={"quant_method": "humming", "dtype": "uint4", "group_size": group_size},
        num_experts=e,
        torch_dtype=dtype,
    ).to(device)
    tensors = {"weight": weight.to(device), "weight_scale": scale.to(device=device, dtype=dtype)}
    for name, t in tensors.items():  # load_from_tensors is load_state_dict(strict=False): a wrong name is silent
        p = getattr(layer, name, None)
        if p is None or tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
            have = None if p is None else (tuple(p.shape), p.dtype)
            raise RuntimeError(f"HummingLayer(num_experts={e}) expects {name} {have}, "
                               f"we have {(tuple(t.shape), t.dtype)}")
    layer.load_from_tensors(tensors)
    layer.transform()
    return layer


def make_humming_moe(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                     group_size: int, device="cuda", dtype=torch.float16):
    """HummingMoE from the experts in Humming's checkpoint form (humming_expert_tensors, stacked): w13 int32
    [E, 2I, H/8], w13_scale [E, 2I, H/G], w2 int32 [E, H, I/8], w2_scale [E, H, I/G]. None (reason in
    unavailable["humming_moe"]) when humming is missing or the layers cannot be built."""
    name = HUMMING_MOE
    unavailable.pop(name, None)
    tracebacks.pop(name, None)
    try:
        device = torch.device(device)
        if device.type != "cuda":
            raise NotImplementedError("humming needs a CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        e, i2, h8 = w13.shape
        if i2 % 2 or tuple(w2.shape) != (e, h8 * 8, i2 // 2 // 8):
            raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H/8] and [E, H, I/8]")
        if tuple(w13_scale.shape) != (e, i2, h8 * 8 // group_size) or \
                tuple(w2_scale.shape) != (e, h8 * 8, i2 // 2 // group_size):
            raise ValueError(f"scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} do not match "
                             f"group {group_size}")
        with torch.cuda.device(device):
            layer13 = _humming_moe_layer(w13, w13_scale, group_size, device, dtype)
            layer2 = _humming_moe_layer(w2, w2_scale, group_size, device, dtype)
            torch.cuda.synchronize(device)
        return HummingMoE(layer13, layer2, e, h8 * 8, i2 // 2, group_size, device, dtype,
                          _pkg_version("humming-kernels"))
    except ImportError as ex:
        _fail(name, f"not installed: {_reason(ex)}", ex)
    except NotImplementedError as ex:
        _fail(name, f"unsupported: {_reason(ex)}", ex)
    except Exception as ex:  # noqa: BLE001 - recorded, never raised
        _fail(name, f"failed to build: {_reason(ex)}", ex)
    return None


def check_humming_moe(out13: torch.Tensor, out2: torch.Tensor, x: torch.Tensor, act: torch.Tensor,
                      topk_ids: torch.Tensor, w13_ref: torch.Tensor, w2_ref: torch.Tensor, max_slots: int = 64,
                      tol: float = 2e-2) -> dict:
    """Compare sampled output rows of both GEMMs with the plain product: out13[s] vs x[s // k] @ w13_ref[e]^T and
    out2[s] vs act[s] @ w2_ref[e]^T (fp32), e = topk_ids.flatten()[s]; w13_ref [E, 2I, H] / w2_ref [E, H, I] are the
    dequantized experts (the same integers and scales). All slots when T*k <= max_slots, else max_slots spread
    over [0, T*k). Returns {"ok", "rel_err13", "rel_err2", "slots", "error"}; never raises."""
    res = {"ok": False, "rel_err13": None, "rel_err2": None, "slots": 0, "tol": tol, "error": None}
    try:
        t, k = topk_ids.shape
        n = t * k
        if tuple(out13.shape) != (n, w13_ref.shape[1]) or tuple(out2.shape) != (n, w2_ref.shape[1]):
            raise RuntimeError(f"outputs {tuple(out13.shape)} / {tuple(out2.shape)}, expected "
                               f"{(n, w13_ref.shape[1])} / {(n, w2_ref.shape[1])}")
        dev = out13.device
        slots = torch.arange(n, device=dev) if n <= max_slots else \
            torch.linspace(0, n - 1, max_slots, device=dev).round().long().unique()
        res["slots"] = int(slots.numel())
        experts = topk_ids.reshape(-1).to(dev)[slots]
        ref13 = torch.empty(slots.numel(), w13_ref.shape[1], dtype=torch.float32, device=dev)
        ref2 = torch.empty(slots.numel(), w2_ref.shape[1], dtype=torch.float32, device=dev)
        for ex in experts.unique().tolist():
            sel = (experts == ex).nonzero().flatten()
            s = slots[sel]
            ref13[sel] = x[s // k].float() @ w13_ref[ex].float().t()
            ref2[sel] = act[s].float() @ w2_ref[ex].float().t()
        got13, got2 = out13[slots].float(), out2[slots].float()
        if not (torch.isfinite(got13).all() and torch.isfinite(got2).all()):
            raise RuntimeError("non-finite outputs")
        res["rel_err13"] = float((got13 - ref13).norm() / ref13.norm().clamp_min(1e-30))
        res["rel_err2"] = float((got2 - ref2).norm() / ref2.norm().clamp_min(1e-30))
        res["ok"] = res["rel_err13"] <= tol and res["rel_err2"] <= tol
        if not res["ok"]:
            res["error"] = (f"relative error w13 {res['rel_err13']:.3g}, w2 {res['rel_err2']:.3g} > tol {tol:g}: "
                            f"the adapter (layout, tables or top_k convention) or the kernel is wrong")
    except Exception as ex:  # noqa: BLE001
        res["error"] = _reason(ex)
    return res


# ----------------------------------------------------------------------------------------------------------
# self-test


def _selftest(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="build and check the peer adapters on a random layer")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--g", type=int, default=128)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--peers", nargs="+", default=list(PEER_NAMES))
    p.add_argument("--traceback", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)

    import time

    q, scales = random_layer(args.k, args.n, args.g, device=args.device)
    report = {"torch": torch.__version__, "device": args.device, "k": args.k, "n": args.n, "g": args.g,
              "peers": {}, "unavailable": {}}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    for name in args.peers:
        t0 = time.perf_counter()
        peer = make_peer(name, q, scales, args.g, args.device)
        build_s = time.perf_counter() - t0
        if peer is None:
            report["unavailable"][name] = unavailable.get(name)
            if args.traceback and name in tracebacks:
                print(tracebacks[name], file=sys.stderr)
            continue
        entry = {"dtype": str(peer.dtype), "out_dtype": str(peer.out_dtype), "version": peer.version,
                 "note": peer.note, "build_s": round(build_s, 2), "checks": []}
        t0 = time.perf_counter()
        entry["warmup_errors"] = peer.warmup(args.m, iters=1)
        entry["warmup_s"] = round(time.perf_counter() - t0, 2)
        for m in args.m:
            gen = torch.Generator(device="cpu").manual_seed(1000 + m)
            a = torch.randn(m, args.k, generator=gen).to(args.device)
            res = check_peer(peer, q, scales, args.g, a)
            tb = res.pop("traceback", None)
            if args.traceback and tb:
                print(tb, file=sys.stderr)
            entry["checks"].append(res)
        report["peers"][name] = entry
    print(json.dumps(report, indent=1))
    ok = all(c["ok"] for e in report["peers"].values() for c in e["checks"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_selftest())
