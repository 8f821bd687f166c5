"""MarlinLinear: a drop-in quantized nn.Linear running jitmarlin's GEMM.

Everything the layer needs is a buffer -- ``qweight`` (packed int32 [N/64, K/16, 32*bits]),
``scales`` ([K/G, N] permuted, or [1, N]), ``qzeros`` (packed int32 [K/G, N*bits/32] or None),
``perm`` (int32 [K] or None) and ``bias`` ([N] or None) -- so ``state_dict()``,
``load_state_dict()``, ``.to()`` and ``.cuda()`` behave as for any module. To load a saved state
dict, build the skeleton with the same configuration first::

    layer = MarlinLinear(in_features, out_features, bits=4, group_size=128, dtype=torch.float16,
                         zero_points=False, act_order=True, bias=True)
    layer.load_state_dict(saved)

Act-order: the packed weight holds the input rows sorted by group, W[perm]; forward gathers the
activation columns x[..., perm] with a small kernel of ours before the GEMM, since
A[:, perm] @ W[perm] = A @ W. dequantize() undoes the sort and returns the weight in the original
input order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import marlin_gemm
from ..ops import gemm as _gemm
from ..ops.gemm import FastGemm, _gemm_cuda
from ..quant.awq import repack_awq
from ..quant.gptq import _check_bits, check_kernel_shape, pack_grouped, repack_gptq
from ..quant.packed import Packed, pack
from ..quant.rtn import check_group, quantize

_DTYPES = (torch.float16, torch.bfloat16)
_OPTIONAL = {"qzeros": "zero_points=True", "perm": "act_order=True", "bias": "bias=True"}


class MarlinLinear(nn.Module):
    """y = x @ W.T + bias with W [out_features, in_features] stored as 4- or 8-bit integers.

    The constructor builds a zero-filled skeleton (for load_state_dict); the from_* classmethods
    build a layer from checkpoint tensors, a float nn.Linear or a Packed. Input: [..., in_features]
    CUDA tensor of the layer's dtype; output [..., out_features] of the same dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4, group_size: int = 128,
                 dtype: torch.dtype = torch.float16, zero_points: bool = False, act_order: bool = False,
                 bias: bool = False, device: torch.device | str | None = None):
        super().__init__()
        _check_bits(bits)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype={dtype} is not supported: use torch.float16 or torch.bfloat16")
        check_kernel_shape(in_features, out_features)
        groups = check_group(in_features, group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        k, n = in_features, out_features
        self.register_buffer("qweight", torch.zeros(n // 64, k // 16, 32 * bits, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, n, dtype=dtype, device=device))
        self.register_buffer("qzeros", torch.zeros(groups, n * bits // 32, dtype=torch.int32, device=device)
                             if zero_points else None)
        self.register_buffer("perm", torch.arange(k, dtype=torch.int32, device=device) if act_order else None)
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)

    # ---- properties derived from the buffers (they follow .to(dtype)) ----

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def sym(self) -> bool:
        return self.qzeros is None

    @property
    def act_order(self) -> bool:
        return self.perm is not None

    def packed(self) -> Packed:
        """The layer's weights as a Packed (rows in sorted order when act_order)."""
        return Packed(b=self.qweight, scales=self.scales, zeros=self.qzeros, bits=self.bits,
                      group_size=self.group_size)

    # ---- constructors ----

    @classmethod
    def from_packed(cls, packed: Packed, bias: torch.Tensor | None = None,
                    perm: torch.Tensor | None = None) -> "MarlinLinear":
        """Wrap kernel-ready weights. perm (int [K], a permutation) means packed holds W[perm] and
        the activations are gathered as x[..., perm]. bias [N] is cast to the scales' dtype."""
        b = packed.b
        if b.dtype != torch.int32 or b.dim() != 3 or b.shape[2] != 32 * packed.bits:
            raise ValueError(f"packed.b must be int32 [N/64, K/16, {32 * packed.bits}] for {packed.bits}-bit weights, "
                             f"got {b.dtype} {tuple(b.shape)}")
        k, n = packed.k, packed.n
        s = packed.scales
        if s.dtype not in _DTYPES:
            raise TypeError(f"packed.scales must be float16 or bfloat16, got {s.dtype}")
        groups = check_group(k, packed.group_size)
        if tuple(s.shape) != (groups, n):
            raise ValueError(f"packed.scales must be [{groups}, {n}] for K={k}, group_size={packed.group_size}, "
                             f"got {tuple(s.shape)}")
        if packed.zeros is not None and tuple(packed.zeros.shape) != (groups, n * packed.bits // 32):
            raise ValueError(f"packed.zeros must be [{groups}, {n * packed.bits // 32}], got {tuple(packed.zeros.shape)}")
        dev = packed.b.device
        if perm is not None:
            if perm.dtype.is_floating_point or perm.dtype == torch.bool or perm.dim() != 1 or perm.shape[0] != k:
                raise ValueError(f"perm must be an integer tensor of shape [K={k}], got {perm.dtype} {tuple(perm.shape)}")
            perm = perm.to(device=dev, dtype=torch.int32)
            if not torch.equal(torch.sort(perm.long()).values, torch.arange(k, device=dev)):
                raise ValueError(f"perm must be a permutation of range(K={k})")
        if bias is not None:
            if tuple(bias.shape) != (n,):
                raise ValueError(f"bias must have shape [out_features={n}], got {tuple(bias.shape)}")
            bias = bias.detach().to(device=dev, dtype=s.dtype).contiguous()
        m = cls(k, n, bits=packed.bits, group_size=packed.group_size, dtype=s.dtype,
                zero_points=packed.zeros is not None, act_order=perm is not None, bias=bias is not None, device="meta")
        m.qweight = packed.b.contiguous()
        m.scales = s.to(dev).contiguous()
        m.qzeros = packed.zeros.to(dev).contiguous() if packed.zeros is not None else None
        m.perm = perm
        m.bias = bias
        return m

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None = None,
                  g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None, *, bits: int = 4,
                  group_size: int = 128, sym: bool = True, checkpoint_format: str = "gptq") -> "MarlinLinear":
        """From AutoGPTQ/GPTQModel tensors (see jitmarlin.quant.gptq.repack_gptq)."""
        packed, perm = repack_gptq(qweight, scales, qzeros, g_idx, bits=bits, group_size=group_size, sym=sym,
                                   checkpoint_format=checkpoint_format)
        return cls.from_packed(packed, bias=bias, perm=perm)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                 bias: torch.Tensor | None = None, *, group_size: int = 128) -> "MarlinLinear":
        """From AutoAWQ GEMM tensors (see jitmarlin.quant.awq.repack_awq)."""
        return cls.from_packed(repack_awq(qweight, scales, qzeros, group_size=group_size), bias=bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, bits: int = 4, group_size: int = 128, act_order: bool = False,
                    sym: bool = True, generator: torch.Generator | int | None = None) -> "MarlinLinear":
        """RTN-quantize a float16/bfloat16 nn.Linear (B = weight.T), where its weight lives.

        act_order=True emulates a desc_act checkpoint, mainly to test the act-order path end to
        end: a random permutation P of the input rows (from ``generator``, a torch.Generator or an
        int seed; seed 0 by default, so the result is deterministic) defines the groups -- group g
        is rows P[g*G:(g+1)*G] -- i.e. g_idx[P[i]] = i // G. The rows are quantized in those groups
        and packed through the same g_idx -> perm path as GPTQ checkpoints. With group_size=-1
        there is a single group, g_idx is trivial and no perm is stored.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.dtype not in _DTYPES:
            raise TypeError(f"linear.weight must be float16 or bfloat16 (convert the layer first), got {w.dtype}")
        _check_bits(bits)
        n, k = w.shape
        check_kernel_shape(k, n)
        groups = check_group(k, group_size)
        w_kn = w.t()
        bias = linear.bias.detach() if linear.bias is not None else None
        if not act_order:
            return cls.from_packed(pack(quantize(w_kn, bits=bits, group_size=group_size, sym=sym)), bias=bias)
        if isinstance(generator, int) or generator is None:
            generator = torch.Generator().manual_seed(0 if generator is None else generator)
        p = torch.randperm(k, generator=generator, device=generator.device).to(w.device)
        g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
        g_idx[p] = (torch.arange(k, device=w.device) // (k // groups)).to(torch.int32)
        qz = quantize(w_kn.index_select(0, p), bits=bits, group_size=group_size, sym=sym)
        q = torch.empty_like(qz.q)
        q[p] = qz.q  # back to the original row order, as a checkpoint would store it
        packed, perm = pack_grouped(q, qz.scales, qz.zeros, g_idx, bits=bits, group_size=group_size)
        return cls.from_packed(packed, bias=bias, perm=perm)

    # ---- compute ----

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"input dtype {x.dtype} does not match the layer dtype {self.dtype}: "
                            f"cast the input (x.to({self.dtype})) or the layer (.to({x.dtype}))")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1] if x.dim() else 0} features but the layer expects "
                             f"in_features={self.in_features}")
        x = x.contiguous()
        if type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
            # plain eager: call the op's CUDA implementation directly (the same code, minus the
            # dispatcher's few microseconds per call, which add up in eager prefill loops), through
            # this layer's cache of checked launches where it applies (ops.gemm.gemm_fast)
            if self.perm is None:
                fast = self.__dict__.get("_jm_fast")
                if fast is None:
                    fast = self.__dict__["_jm_fast"] = FastGemm()
                out = _gemm.gemm_fast(fast, x, self.qweight, self.scales, self.qzeros, self.bias)
                if out is not None:
                    return out
            return _gemm_cuda(x, self.qweight, self.scales, self.qzeros, self.bias, self.perm)
        return marlin_gemm(x, self.qweight, self.scales, self.qzeros, self.bias, perm=self.perm)

    def dequantize(self) -> torch.Tensor:
        """The float weight [out_features, in_features] this layer represents, in the original
        input order (act-order undone), as self.dtype. Reference math; for checks, not speed."""
        w = self.packed().dequantize(torch.float32)  # [K, N], rows sorted when act_order
        if self.perm is not None:
            unsorted = torch.empty_like(w)
            unsorted[self.perm.long()] = w
            w = unsorted
        return w.t().contiguous().to(self.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, {'sym=True' if self.sym else 'sym=False (zero points)'}, "
                f"act_order={self.act_order}, bias={self.bias is not None}, dtype={self.dtype}")

    # ---- state dict: structure and dtype must match the skeleton ----

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, flag in _OPTIONAL.items():
            if getattr(self, name) is None and prefix + name in state_dict:
                error_msgs.append(f"state_dict holds '{prefix}{name}' but this MarlinLinear was built without it: "
                                  f"construct it with {flag}")
        for name in ("scales", "bias"):
            mine, theirs = getattr(self, name), state_dict.get(prefix + name)
            if mine is not None and isinstance(theirs, torch.Tensor) and theirs.dtype != mine.dtype:
                error_msgs.append(f"'{prefix}{name}' in state_dict is {theirs.dtype} but this MarlinLinear is "
                                  f"{mine.dtype}: construct it with dtype={theirs.dtype}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
