"""The eager fast path of MarlinLinear (ops.gemm.gemm_fast) makes exactly the launches of the
general path (launch_gemm), on the CPU: the driver, the device queries and the kernels are
replaced by recorders, so every route's grid, block, shared memory, flags and parameter struct are
compared field by field. Also: when it must fall back, and that it never keeps stale pointers."""

import copy
import ctypes
import functools
import pickle

import pytest
import torch

from jitmarlin.jit import driver
from jitmarlin.ops import _kernels as K
from jitmarlin.ops import gemm as G
from jitmarlin.quant import pack_weights, permute_scales
from jitmarlin.quant.layout import pack_zeros


class _Recorder:
    max_dynamic_smem = 232448 - 1024

    def __init__(self, log, name):
        self.log, self.name, self.num_regs = log, name, 100

    def launch(self, grid, threads, smem, stream, params, pdl=False, cluster=0, extra=None):
        p = K.GemmParams.from_buffer_copy(params)
        c = p.c
        p.c = 0  # the output is a fresh tensor on every call
        self.log.append((self.name, grid, threads, smem, stream, bytes(p), bool(pdl), cluster, extra, c))

    def occupancy(self, threads, smem):
        return 2

    def max_active_clusters(self, threads, smem, cluster):
        return 16


class _Dev:
    sm_count = 132
    smem_per_block_optin = 232448


class _WS:
    def __init__(self):
        self.ws = torch.zeros(64)
        self.counters = torch.zeros(64, dtype=torch.int32)
        self.ensured = []

    def ensure(self, floats, slots):
        self.ensured.append((floats, slots))


@pytest.fixture
def recorded(monkeypatch):
    """An sm_90 device of 132 SMs that exists only on paper; every launch is recorded."""
    log = []
    ws = _WS()
    monkeypatch.setattr(G, "_cc", functools.lru_cache(None)(lambda index: (9, 0)))
    monkeypatch.setattr(driver, "device", lambda index: _Dev())
    monkeypatch.setattr(K, "wgmma_module_ready", lambda fam: True)
    monkeypatch.setattr(K, "get_wgmma_kernel", lambda fam, nt, fw, st, index, *form: _Recorder(
        log, K.wgmma_kernel_name(fam, nt, fw, st, *form)))  # form: wide (and later variants)
    monkeypatch.setattr(K, "get_kernel", lambda fam, tile, index, cc: _Recorder(
        log, tile if isinstance(tile, str) else tile.tag()))  # (str: "gather", "gather_smem", "dequant")
    monkeypatch.setattr(K, "get_strip_kernel", lambda fam, w, c, t, smem, index, cc, perm=False: _Recorder(
        log, K.strip_kernel_name(fam, w, c, t, smem, perm)))  # small problems route to it by default (strip_small)
    monkeypatch.setattr(K, "default_workspace", lambda device: ws)
    monkeypatch.setattr(K, "current_stream_handle", lambda device: 1234)
    monkeypatch.setattr(K, "cuda_index", lambda device: 0)
    monkeypatch.setattr(driver, "tensor_map_2d", lambda *args: args)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    G.wgmma_launch.cache_clear()
    G.prepare_launch.cache_clear()
    yield log, ws
    G.wgmma_launch.cache_clear()
    G.prepare_launch.cache_clear()


def _weights(k, n, bits=4, group=128, zp=False, bias=False, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    groups = 1 if group == -1 else k // group
    s = permute_scales((torch.rand(groups, n, generator=g) * 0.01 + 0.001).to(dtype))
    z = pack_zeros(torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32), bits) if zp else None
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return pack_weights(q, bits), s, z, b


@pytest.mark.parametrize("bits,group,zp,bias,dtype", [(4, 128, False, False, torch.float16),
                                                      (4, 64, True, True, torch.bfloat16),
                                                      (8, -1, False, True, torch.float16)])
def test_fast_path_makes_the_general_paths_launches(recorded, bits, group, zp, bias, dtype):
    log, ws = recorded
    kernels = set()
    for k, n in ((4096, 4096), (4096, 28672), (14336, 4096), (4096, 22016)):
        b, s, z, bb = _weights(k, n, bits, group, zp, bias, dtype)
        cache = G.FastGemm()
        # (4096x22016 M = 360: 128-token tiles, wide, by session 48's cost model)
        for m in (1, 7, 9, 16, 17, 32, 33, 64, 100, 128, 256, 360, 600, 850, 1024, 1):
            a = torch.randn(m, k).to(dtype)
            log.clear()
            _, nn_, kk, fam = G.check_args(a, b, s, z, bb)
            out = torch.empty(m, n, dtype=dtype)
            G.launch_gemm(a, b, s, z, bb, out, m, nn_, kk, fam)
            slow = list(log)
            log.clear()
            fast_out = G.gemm_fast(cache, a, b, s, z, bb)
            assert fast_out is not None and fast_out.shape == (m, n) and fast_out.dtype == dtype
            assert len(slow) == 1 and len(log) == 1, (m, slow, log)
            assert log[0][:-1] == slow[0][:-1], (k, n, m, slow[0][0])  # all but the output's address
            assert log[0][-1] == fast_out.data_ptr()
            kernels.add(log[0][0])
    assert ws.ensured  # split launches reserved their workspace
    # every kind of route was compared: mma.sync tiles, the strip kernel, and the wgmma kernel's 16/32/64/128-token,
    # wide and tall-token-tile (two-compute-warpgroup) forms
    assert any(not name.startswith(("jm_wgmma", "jm_strip")) for name in kernels), kernels
    assert any(name.startswith("jm_strip_") for name in kernels), kernels  # 4096^2 at M = 1 / 7 (gemm.strip_small)
    for part in ("_n16_", "_n32_", "_n64_", "_n128_f1", "_wide", "_n256_f1_s4_prod2"):
        assert any(part in name for name in kernels), (part, kernels)


def test_fast_path_falls_back_where_it_must(recorded):
    log, _ = recorded
    k, n = 4096, 4096
    b, s, z, bb = _weights(k, n)
    cache = G.FastGemm()
    assert G.gemm_fast(cache, torch.randn(1025, k).half(), b, s, z, bb) is None  # dequantize + cuBLAS
    assert G.gemm_fast(cache, torch.randn(0, k).half(), b, s, z, bb) is None  # no rows
    assert G.gemm_fast(cache, torch.randn(4, k).bfloat16(), b, s, z, bb) is None  # wrong dtype: the
    assert G.gemm_fast(cache, torch.randn(k, 4).half().t(), b, s, z, bb) is None  # general path raises
    assert G.gemm_fast(cache, torch.randn(4, k + 16).half(), b, s, z, bb) is None
    unaligned = torch.randn(4 * k + 1).half()[1:].view(4, k)
    assert G.gemm_fast(cache, unaligned, b, s, z, bb) is None
    with pytest.raises(TypeError, match="scales must have the activation dtype"):
        G.gemm_fast(G.FastGemm(), torch.randn(4, k).bfloat16(), b, s, z, bb)  # first call: full checks
    assert G.gemm_fast(cache, torch.randn(3, 2, k).half(), b, s, z, bb).shape == (3, 2, n)  # leading dims


def test_fast_path_never_keeps_stale_pointers(recorded):
    log, _ = recorded
    k, n = 4096, 8192
    b, s, z, bb = _weights(k, n)
    cache = G.FastGemm()
    a = torch.randn(16, k).half()
    G.gemm_fast(cache, a, b, s, z, bb)
    first = K.GemmParams.from_buffer(bytearray(log[-1][5]))
    assert (first.b, first.s) == (b.data_ptr(), s.data_ptr())
    b2, s2 = b.clone(), s.clone()  # the layer's weights moved (.to(), a new buffer)
    G.gemm_fast(cache, a, b2, s2, z, bb)
    second = K.GemmParams.from_buffer(bytearray(log[-1][5]))
    assert (second.b, second.s) == (b2.data_ptr(), s2.data_ptr())
    b.copy_(b2)  # in place: same address, new values - the cached launch stays right
    G.gemm_fast(cache, a, b, s, z, bb)
    third = K.GemmParams.from_buffer(bytearray(log[-1][5]))
    assert (third.b, third.s) == (b.data_ptr(), s.data_ptr())
    # copies and pickles of a used cache start empty (its entries hold raw pointers)
    for clone in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert isinstance(clone, G.FastGemm) and clone.key == () and clone.by_m == {}
    assert ctypes.sizeof(K.GemmParams) == len(log[-1][5])


def _launches(log, a, weights, n, perm=None) -> list:
    """The launches (log entries) one launch_gemm call of a [M, K] makes, with or without an act-order permutation."""
    b, s, z, bb = weights
    m = a.shape[0]
    _, nn_, kk, fam = G.check_args(a, b, s, z, bb)
    log.clear()
    G.launch_gemm(a, b, s, z, bb, torch.empty(m, n, dtype=torch.float16), m, nn_, kk, fam, perm=perm)
    out = list(log)
    log.clear()
    return out


def test_act_order_strip_launch_gathers_in_the_kernel(recorded, monkeypatch):
    """With the strip route on, an act-order call at M <= 16 is one launch: the strip kernel's act-order form, reading
    the activations as given and the layer's permutation (no gather kernel before it); without a permutation the
    plain form, and the fast path makes the same launch as the general path."""
    log, _ = recorded
    monkeypatch.setattr(G, "STRIP_ROUTE", True)
    k, n = 4096, 8192
    weights = _weights(k, n)
    perm = torch.randperm(k).to(torch.int32)
    for m in (1, 5, 16):
        a = torch.randn(m, k).half()
        act = _launches(log, a, weights, n, perm)
        assert len(act) == 1 and act[0][0].startswith("jm_strip_") and act[0][0].endswith("_p"), act
        p = K.GemmParams.from_buffer(bytearray(act[0][5]))
        assert (p.a, p.perm, p.m) == (a.data_ptr(), perm.data_ptr(), m)
        slow = _launches(log, a, weights, n)
        assert len(slow) == 1 and not slow[0][0].endswith("_p")
        assert K.GemmParams.from_buffer(bytearray(slow[0][5])).perm is None
        G.gemm_fast(G.FastGemm(), a, *weights)
        assert len(log) == 1 and log[0][:-1] == slow[0][:-1]


def test_act_order_default_strip_route_only_at_one_token(recorded, monkeypatch):
    """By default (gemm.strip_small, STRIP_ROUTE off) a small act-order layer takes the strip kernel's act-order form
    at M = 1 only (STRIP_PERM_MAX_M: the H200 measured its in-kernel gather slower than the gather kernel + the
    usual route at M = 8 on 4096^2); at M = 2-8 the gather kernel runs first, then the usual route, while the same
    M without a permutation still takes the strip kernel."""
    log, _ = recorded
    monkeypatch.setattr(G, "STRIP_ROUTE", False)
    monkeypatch.delenv("JITMARLIN_STRIP", raising=False)
    K.env_flag.cache_clear()
    k, n = 4096, 4096
    weights = _weights(k, n)
    perm = torch.randperm(k).to(torch.int32)
    for m in (1, 2, 8):
        a = torch.randn(m, k).half()
        names = [entry[0] for entry in _launches(log, a, weights, n, perm)]
        if m <= G.STRIP_PERM_MAX_M:
            assert len(names) == 1 and names[0].startswith("jm_strip_") and names[0].endswith("_p"), names
        else:
            assert len(names) == 2 and not any(x.startswith("jm_strip_") for x in names), names
        plain = [entry[0] for entry in _launches(log, a, weights, n)]
        assert len(plain) == 1 and plain[0].startswith("jm_strip_") and not plain[0].endswith("_p"), plain
        if m > G.STRIP_PERM_MAX_M:  # the A/B switch: the gather kernel, then the strip kernel's plain form
            monkeypatch.setattr(G, "STRIP_GATHER_PLAIN", True)
            both = _launches(log, a, weights, n, perm)
            monkeypatch.setattr(G, "STRIP_GATHER_PLAIN", False)
            assert [entry[0] for entry in both] == [names[0], plain[0]], both
            gathered = K.GemmParams.from_buffer(bytearray(both[1][5]))
            assert gathered.perm is None and gathered.a != a.data_ptr() and gathered.m == m


def test_tall_layers_take_the_strip_kernel_and_its_act_order_form(recorded, monkeypatch):
    """Session 55 (gemm.strip_tall): by default a tall layer (K >= N, N <= 8192) takes the strip kernel at M <= 8, and
    at M = 9-16 where K >= 2 N and N <= 4096, on a device whose CTAs fill the SMs (H200-like fit: one CTA of 16 warps
    per SM); a wide one (K < N) the usual route; act-order calls on a tall layer the gather kernel + the usual route
    with STRIP_TALL_PERM off, the strip kernel's act-order form with it on (the default since session 56); the fast path
    makes the general path's launch."""
    log, _ = recorded
    monkeypatch.setattr(G, "STRIP_ROUTE", False)
    monkeypatch.delenv("JITMARLIN_STRIP", raising=False)
    K.env_flag.cache_clear()
    monkeypatch.setattr(_Recorder, "occupancy", lambda self, threads, smem: 512 // threads)
    monkeypatch.setattr(_Recorder, "max_active_clusters", lambda self, threads, smem, cluster: 132 * (512 // threads) // cluster)
    tall, wide = _weights(8192, 4096), _weights(4096, 8192)
    perm = torch.randperm(8192).to(torch.int32)
    for m, want in ((1, "w16_c2_t1"), (8, "w16_c2_t1"), (9, "w16_c2_t2"), (16, "w16_c2_t2"), (17, None)):
        a = torch.randn(m, 8192).half()
        names = [entry[0] for entry in _launches(log, a, tall, 4096)]
        if want:
            assert len(names) == 1 and names[0].startswith("jm_strip_") and names[0].endswith(want), (m, names)
            G.gemm_fast(G.FastGemm(), a, *tall)
            assert [entry[0] for entry in log] == names, (m, log)
            log.clear()
        else:
            assert not any(x.startswith("jm_strip_") for x in names), (m, names)
    for m in (1, 8):
        names = [entry[0] for entry in _launches(log, torch.randn(m, 4096).half(), wide, 8192)]
        assert not any(x.startswith("jm_strip_") for x in names), (m, names)
    a = torch.randn(1, 8192).half()
    assert G.STRIP_TALL_PERM  # (the default)
    names = [entry[0] for entry in _launches(log, a, tall, 4096, perm)]
    assert len(names) == 1 and names[0].endswith("w16_c2_t1_p"), names
    monkeypatch.setattr(G, "STRIP_TALL_PERM", False)
    names = [entry[0] for entry in _launches(log, a, tall, 4096, perm)]
    assert len(names) == 2 and not any(x.startswith("jm_strip_") for x in names), names


def test_eight_bit_tall_layers_build_no_strip_module(recorded, monkeypatch):
    """The tall region takes 4-bit weights only (gemm.STRIP_TALL_BITS): an 8-bit tall layer takes the usual route
    without loading (building) a strip module first."""
    log, _ = recorded
    monkeypatch.setattr(G, "STRIP_ROUTE", False)
    monkeypatch.delenv("JITMARLIN_STRIP", raising=False)
    K.env_flag.cache_clear()
    asked = []
    monkeypatch.setattr(K, "get_strip_kernel", lambda *args, **kw: asked.append(args) or _Recorder(log, "strip"))
    names = [entry[0] for entry in _launches(log, torch.randn(1, 8192).half(), _weights(8192, 4096, bits=8), 4096)]
    assert not asked and not any(x.startswith("jm_strip_") for x in names), (asked, names)
