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
