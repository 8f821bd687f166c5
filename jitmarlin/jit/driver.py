"""Loading cubins and launching kernels through the CUDA driver API, via ctypes.

No C++ binding is compiled at all: kernels are plain cubins (no torch headers, seconds to build)
and are launched on torch's current stream with cuLaunchKernel, which CUDA-graph capture records
like any other launch. Each kernel takes one parameter, a POD struct, passed by value.

Each device gets its own module load in its primary context (the context torch uses), so a
tensor on cuda:1 runs a function loaded on cuda:1 even when cuda:0 is current.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from ..errors import LaunchError

_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4
_CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class TensorMap(ctypes.Structure):  # CUtensorMap: 128 opaque bytes (the kernels take it as a
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]  # __grid_constant__ parameter, 128-byte aligned)


# CUtensorMapDataType / CUtensorMapSwizzle / CUtensorMapL2promotion values (cuda.h)
TMAP_F16, TMAP_BF16 = 6, 9
_TMAP_SWIZZLE_128B, _TMAP_L2_256B = 3, 3


def tensor_map_2d(dtype_code: int, ptr: int, inner: int, outer: int, row_bytes: int, box_inner: int,
                  box_outer: int) -> TensorMap:
    """A TMA descriptor of a row-major [outer, inner] matrix of 2-byte elements at `ptr` (rows
    `row_bytes` apart, a multiple of 16; ptr 16-byte aligned), copied in boxes of box_outer rows of
    box_inner elements (box_inner * 2 = 128: the 128-byte swizzle layout the wgmma kernel's
    descriptors read); rows past `outer` arrive as zeros."""
    lib = _cuda()
    if not hasattr(lib, "cuTensorMapEncodeTiled"):
        raise LaunchError("the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver)")
    tmap = TensorMap()
    dims = (ctypes.c_uint64 * 2)(inner, outer)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_inner, box_outer)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    _check(lib, lib.cuTensorMapEncodeTiled(ctypes.byref(tmap), dtype_code, 2, ctypes.c_void_p(ptr), dims, strides, box,
                                           estr, 0, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, 0),
           f"cuTensorMapEncodeTiled([{outer}, {inner}] at 0x{ptr:x}, rows {row_bytes} B, box {box_outer}x{box_inner})")
    return tmap


_lib = None
_lib_lock = threading.Lock()
_PDL_ATTR = None  # pointer to the one CUlaunchAttribute "programmatic stream serialization = 1"


def _cuda():
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as e:
                    raise LaunchError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from e
                vp, i, u, pp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)
                sigs = {
                    "cuInit": [u],
                    "cuDeviceGet": [ctypes.POINTER(i), i],
                    "cuDeviceGetAttribute": [ctypes.POINTER(i), i, i],
                    "cuDevicePrimaryCtxRetain": [pp, i],
                    "cuCtxGetCurrent": [pp],
                    "cuCtxPushCurrent_v2": [vp],
                    "cuCtxPopCurrent_v2": [pp],
                    "cuModuleLoadData": [pp, vp],
                    "cuModuleGetFunction": [pp, vp, ctypes.c_char_p],
                    "cuFuncSetAttribute": [vp, i, i],
                    "cuFuncGetAttribute": [ctypes.POINTER(i), i, vp],
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(i), vp, i, ctypes.c_size_t],
                    "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, pp, pp],
                    "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
                    "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
                }
                for name, args in sigs.items():
                    fn = getattr(lib, name)
                    fn.argtypes = args
                    fn.restype = ctypes.c_int
                if hasattr(lib, "cuLaunchKernelEx"):  # CUDA >= 11.8 drivers
                    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), vp, pp, pp]
                    lib.cuLaunchKernelEx.restype = ctypes.c_int
                if hasattr(lib, "cuTensorMapEncodeTiled"):  # CUDA >= 12 drivers
                    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
                    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.POINTER(TensorMap), i, u, vp, u64p, u64p, u32p, u32p,
                                                           i, i, i, i]
                    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
                if hasattr(lib, "cuOccupancyMaxActiveClusters"):
                    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(i), vp, ctypes.POINTER(_LaunchConfig)]
                    lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
                _check(lib, lib.cuInit(0), "cuInit")
                if hasattr(lib, "cuLaunchKernelEx"):
                    global _PDL_ATTR
                    attr = _LaunchAttribute()
                    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                    attr.value[0] = 1
                    _PDL_ATTR = ctypes.pointer(attr)  # read-only after this, shared by every launch
                _lib = lib
    return _lib


_ATTRS: dict = {}  # (pdl, cluster) -> _launch_attrs result, built once, read-only after


def _cached_launch_attrs(pdl: bool, cluster: int):
    key = (pdl, cluster)
    hit = _ATTRS.get(key)
    if hit is None:
        hit = _ATTRS[key] = _launch_attrs(pdl, cluster)
    return hit


def _launch_attrs(pdl: bool, cluster: int):
    """(pointer to an array of CUlaunchAttribute, count, the array) for cuLaunchKernelEx."""
    attrs = (_LaunchAttribute * 2)()
    count = 0
    if pdl:
        attrs[count].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[count].value[0] = 1
        count += 1
    if cluster > 1:  # CUlaunchAttributeValue.clusterDim = {x, y, z}: three uint32 (little-endian)
        attrs[count].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[count].value[0] = cluster | (1 << 32)
        attrs[count].value[1] = 1
        count += 1
    return ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)), count, attrs


def _check(lib, res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        lib.cuGetErrorName(res, ctypes.byref(name))
        lib.cuGetErrorString(res, ctypes.byref(text))
        raise LaunchError(f"{what} failed: {(name.value or b'?').decode()} ({res}): "
                          f"{(text.value or b'').decode()}")


class _Device:
    """The primary context of one device and the device attributes we need."""

    def __init__(self, index: int):
        lib = _cuda()
        self.index = index
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
        self.ctx = ctypes.c_void_p()
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")

        def attr(a: int) -> int:
            v = ctypes.c_int()
            _check(lib, lib.cuDeviceGetAttribute(ctypes.byref(v), a, dev), "cuDeviceGetAttribute")
            return v.value

        self.sm_count = attr(_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.smem_per_block_optin = attr(_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.smem_per_sm = attr(_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)

    def __enter__(self):
        lib = _cuda()
        cur = ctypes.c_void_p()
        _check(lib, lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        self._pushed = cur.value != self.ctx.value
        if self._pushed:
            _check(lib, lib.cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc):
        if self._pushed:
            lib = _cuda()
            old = ctypes.c_void_p()
            _check(lib, lib.cuCtxPopCurrent_v2(ctypes.byref(old)), "cuCtxPopCurrent")


_devices: dict[int, _Device] = {}
_modules: dict[tuple[str, int], ctypes.c_void_p] = {}
_functions: dict[tuple[str, str, int], "Function"] = {}
_load_lock = threading.Lock()


def device(index: int) -> _Device:
    d = _devices.get(index)
    if d is None:
        with _load_lock:
            d = _devices.get(index)
            if d is None:
                d = _devices[index] = _Device(index)
    return d


class Function:
    """One kernel loaded on one device."""

    def __init__(self, handle: ctypes.c_void_p, dev: _Device, name: str):
        self.handle = handle
        self.dev = dev
        self.name = name
        lib = _cuda()
        v = ctypes.c_int()
        _check(lib, lib.cuFuncGetAttribute(ctypes.byref(v), _CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, handle), "cuFuncGetAttribute")
        self.static_smem = v.value
        # let the kernel use all the shared memory a block may opt into, beside its static part
        self.max_dynamic_smem = dev.smem_per_block_optin - self.static_smem
        _check(lib, lib.cuFuncSetAttribute(handle, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           self.max_dynamic_smem), f"cuFuncSetAttribute({name})")
        _check(lib, lib.cuFuncGetAttribute(ctypes.byref(v), _CU_FUNC_ATTRIBUTE_NUM_REGS, handle), "cuFuncGetAttribute")
        self.num_regs = v.value
        _check(lib, lib.cuFuncGetAttribute(ctypes.byref(v), _CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, handle), "cuFuncGetAttribute")
        self.local_bytes = v.value
        self._occ: dict[tuple[int, int], int] = {}
        self._clusters: dict[tuple[int, int, int], int] = {}

    def occupancy(self, threads: int, smem: int) -> int:
        """Blocks of this kernel that fit on one SM at once."""
        key = (threads, smem)
        n = self._occ.get(key)
        if n is None:
            lib = _cuda()
            v = ctypes.c_int()
            with self.dev:
                _check(lib, lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(v), self.handle, threads, smem), f"occupancy({self.name})")
            n = self._occ[key] = v.value
        return n

    def max_active_clusters(self, threads: int, smem: int, cluster: int) -> int:
        """Clusters of `cluster` CTAs of this kernel that can run on the device at once (0 when the
        driver cannot tell: no cluster launch then)."""
        key = (threads, smem, cluster)
        n = self._clusters.get(key)
        if n is None:
            lib = _cuda()
            n = 0
            if hasattr(lib, "cuOccupancyMaxActiveClusters"):
                ptr, count, keep = _launch_attrs(False, cluster)
                cfg = _LaunchConfig(cluster, 1, 1, threads, 1, 1, smem, None, ptr, count)
                v = ctypes.c_int()
                with self.dev:
                    res = lib.cuOccupancyMaxActiveClusters(ctypes.byref(v), self.handle, ctypes.byref(cfg))
                n = v.value if res == 0 else 0
                del keep
            self._clusters[key] = n
        return n

    def launch(self, grid: int, threads: int, smem: int, stream: int, params: ctypes.Structure,
               pdl: bool = False, cluster: int = 0, extra: ctypes.Structure | None = None) -> None:
        """Launch on `stream`. pdl: allow programmatic dependent launch (sm_90): the kernel may
        start while the previous one in the stream finishes; it must call griddepcontrol.wait
        before reading anything that kernel wrote (ours do). cluster > 1: in thread-block clusters
        of that many CTAs (sm_90; grid a multiple of it). extra: the kernel's second parameter
        (the wgmma kernel's tensor map)."""
        lib = _cuda()
        if extra is None:
            args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        else:
            args = (ctypes.c_void_p * 2)(ctypes.addressof(params), ctypes.addressof(extra))
        # the device's primary context is current already unless another device's is (cuda:1
        # tensors while cuda:0 is current): push it only then
        cur = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(cur))
        pushed = cur.value != self.dev.ctx.value
        if pushed:
            _check(lib, lib.cuCtxPushCurrent_v2(self.dev.ctx), "cuCtxPushCurrent")
        try:
            if cluster > 1:
                ptr, count, _ = _cached_launch_attrs(pdl and _PDL_ATTR is not None, cluster)
                cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, stream, ptr, count)
                res = lib.cuLaunchKernelEx(ctypes.byref(cfg), self.handle, args, None)
            elif pdl and _PDL_ATTR is not None:
                cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, stream, _PDL_ATTR, 1)
                res = lib.cuLaunchKernelEx(ctypes.byref(cfg), self.handle, args, None)
            else:
                res = lib.cuLaunchKernel(self.handle, grid, 1, 1, threads, 1, 1, smem, stream, args, None)
        finally:
            if pushed:
                old = ctypes.c_void_p()
                _check(lib, lib.cuCtxPopCurrent_v2(ctypes.byref(old)), "cuCtxPopCurrent")
        if res != 0:
            _check(lib, res, f"launching {self.name} (grid {grid}, {threads} threads, {smem} B shared memory)")


def get_function(cubin: Path, name: str, device_index: int) -> Function:
    key = (str(cubin), name, device_index)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _load_lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        dev = _devices.get(device_index) or _Device(device_index)
        _devices[device_index] = dev
        lib = _cuda()
        mkey = (str(cubin), device_index)
        mod = _modules.get(mkey)
        if mod is None:
            try:
                image = Path(cubin).read_bytes()
            except OSError as e:
                raise LaunchError(f"cannot read kernel image {cubin}: {e}") from e
            buf = ctypes.create_string_buffer(image)
            mod = ctypes.c_void_p()
            with dev:
                _check(lib, lib.cuModuleLoadData(ctypes.byref(mod), buf),
                       f"loading {cubin} on cuda:{device_index}")
            _modules[mkey] = mod
        h = ctypes.c_void_p()
        with dev:
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(h), mod, name.encode()),
                   f"finding kernel {name} in {cubin}")
            fn = Function(h, dev, name)
        _functions[key] = fn
        return fn
