"""Build and launch our CUDA kernel sources on the CPU through the SIMT emulator (tests/simt/simt.h).

The kernel text is cuda_src's, copied next to the emulator's headers with mechanical rewrites of the
shared-memory declarations (`extern __shared__ ... name[];` becomes a pointer to the CTA's dynamic shared memory,
`__shared__ T a[..], b;` a C++ static per name that registers itself with the emulator, which keeps a copy per
CTA) and of function-scope `constexpr` constants (made `static constexpr`, see rewrite()), and with
tests/simt/jm_ptx.cuh in place of the PTX wrappers. The kernel sources must hold no inline asm of their own (the wrappers are where PTX lives): the host
assembler rejects PTX text.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

SIMT_DIR = Path(__file__).resolve().parent
CUDA_SRC = SIMT_DIR.parents[1] / "cuda_src"
EMULATOR_FILES = ("simt.h", "jm_ptx.cuh", "jm_wgmma_ptx.cuh", "runner.h", "cuda_fp16.h", "cuda_bf16.h")

_DYN = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];")
_LOCAL_CONSTEXPR = re.compile(r"^([ \t]+)constexpr ", re.M)
_STATIC = re.compile(r"__shared__ ((?:__align__\(\d+\) )?\w+ )([^;]+);")


class SimtError(RuntimeError):
    """The emulator stopped a launch (out-of-bounds load, deadlock, divergent collective, ...)."""


def rewrite(text: str) -> str:
    """A cuda_src header as the emulator compiles it (see the module docstring)."""
    text = _DYN.sub(r"\1* const \2 = reinterpret_cast<\1*>(::jm_simt::dyn_smem());", text)

    def static(m: re.Match) -> str:
        names, depth, start = [], 0, 0
        decls = m.group(2)
        for i, ch in enumerate(decls + ","):  # the declarators, split at the commas outside brackets
            depth += ch in "[(" and 1 or ch in "])" and -1 or 0
            if ch == "," and depth == 0:
                names.append(re.match(r"\s*(\w+)", decls[start:i]).group(1))
                start = i + 1
        return f"static {m.group(1)}{decls};" + "".join(f" JM_SIMT_SHARED({n});" for n in names)

    text = _STATIC.sub(static, text)
    # Function-scope constants as static constexpr (same values, no storage the kernel could write): GCC 12 stops
    # with an internal compiler error on a lambda's array bound that names a plain constexpr local of the
    # enclosing function template (jm_gemm.cuh's `float sa[kRaw ? M_BLOCKS : 1][4]`).
    text = _LOCAL_CONSTEXPR.sub(r"\1static constexpr ", text)
    if "__shared__" in text:
        raise ValueError("a __shared__ declaration the emulator's rewrite does not know")
    return text


def has_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def prepare(dst: Path, headers: dict[str, str] | None = None) -> None:
    """Copy the emulator and the rewritten cuda_src headers into dst (headers: name -> replacement text, for
    mutation tests)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in EMULATOR_FILES:
        shutil.copy(SIMT_DIR / name, dst / name)
    for src in CUDA_SRC.iterdir():
        if src.suffix not in (".cuh", ".h") or src.name in EMULATOR_FILES:
            continue
        text = (headers or {}).get(src.name, src.read_text())
        (dst / src.name).write_text(rewrite(text))


def two_params(source: str) -> bool:
    """Whether the kernel takes a second parameter (the wgmma kernels' TMA descriptor)."""
    return "JM_WGMMA_KERNEL" in source


def param_type(source: str) -> str:
    """The kernel's parameter struct: the MoE helper kernels' JmMoeParams, else JmGemmParams."""
    return "JmMoeParams" if "jm_moe_util.cuh" in source else "JmGemmParams"


def kernel_table(sources: list[tuple[str, str]]) -> str:
    tramps = []
    for n, src in sources:
        if two_params(src):  # (copied into an aligned descriptor: ctypes gives 8-byte alignment only)
            tramps.append(f"static void simt_tramp_{n}(const void* p, const void* x) {{\n"
                          f"  jm::JmTensorMap m;\n  memcpy(&m, x, sizeof m);\n"
                          f"  {n}(*static_cast<const JmGemmParams*>(p), m);\n}}\n")
        else:
            tramps.append(f"static void simt_tramp_{n}(const void* p, const void*) {{ "
                          f"{n}(*static_cast<const {param_type(src)}*>(p)); }}\n")
    rows = "".join(f'    {{"{n}", &simt_tramp_{n}}},\n' for n, _ in sources)
    return ("".join(tramps) + "struct SimtKernel {\n  const char* name;\n  void (*fn)(const void*, const void*);\n};\n"
            f"static const SimtKernel kSimtKernels[] = {{\n{rows}}};\n" + '#include "runner.h"\n')


class Library:
    """A built emulator library: launch(name, ...) runs one kernel; guarded(t) copies a tensor into memory that
    ends at an inaccessible page."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.simt_run.restype = ctypes.c_int
        self.lib.simt_run.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int, ctypes.c_ulonglong,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong),
                                      ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int, ctypes.c_uint,
                                      ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self.lib.simt_alloc.restype = ctypes.c_void_p
        self.lib.simt_alloc.argtypes = [ctypes.c_ulonglong]
        self.lib.simt_free.argtypes = [ctypes.c_void_p]
        self._live: list[tuple[int, int]] = []  # (address, bytes) of the guarded buffers

    def guarded(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        ptr = self.lib.simt_alloc(max(nbytes, 1))
        if not ptr:
            raise MemoryError("simt_alloc")
        self._live.append((ptr, nbytes))
        raw = torch.frombuffer((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr), dtype=torch.uint8)[:nbytes]
        out = raw.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def free_all(self) -> None:
        for ptr, _ in self._live:
            self.lib.simt_free(ptr)
        self._live.clear()

    def span_of(self, ptr: int) -> tuple[int, int] | None:
        """The guarded buffer (address, bytes) that holds address ptr, or None."""
        for base, n in self._live:
            if base <= ptr < base + max(n, 1):
                return base, n
        return None

    def launch(self, name: str, grid: int, threads: int, cluster: int, dyn: int, params: ctypes.Structure,
               buffers: list[torch.Tensor] | None = None, seed: int = 0, extra: ctypes.Structure | None = None,
               dependent: list[tuple[int, int]] = ()) -> tuple[bool, bool]:
        """buffers: the global memory the kernel may load through the checked wrappers (None: every guarded
        buffer alive); extra: the kernel's second parameter (the wgmma kernels' descriptor, tensor_map());
        dependent: guarded buffers (address, bytes) of the kernel before, for a launch with programmatic dependent
        launch: the kernel may touch them only after griddepcontrol.wait (tests/simt/simt.h). Returns (early,
        nowait): whether the kernel after it could start before it waited for the one before (every CTA triggered
        its dependents, or exited, before waiting), and whether no thread waited at all."""
        spans = self._live if buffers is None else [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers]
        regs = [x for span in spans for x in span]
        arr = (ctypes.c_ulonglong * max(len(regs), 1))(*regs)
        deps = [x for span in dependent for x in span]
        darr = (ctypes.c_ulonglong * max(len(deps), 1))(*deps)
        err = ctypes.create_string_buffer(2048)
        flags = (ctypes.c_int * 2)()
        rc = self.lib.simt_run(name.encode(), grid, threads, cluster, dyn, ctypes.byref(params),
                               ctypes.byref(extra) if extra is not None else None, arr, len(spans), darr,
                               len(dependent), seed, err, len(err), flags)
        if rc:
            raise SimtError(err.value.decode())
        return bool(flags[0]), bool(flags[1])


def build(sources: list[tuple[str, str]], out_dir: Path, headers: dict[str, str] | None = None,
          jobs: int = 2, sm: int = 90) -> Library:
    """Compile kernel sources [(name, generated .cu text)] with the emulator into out_dir/libsimt-<hash>.so (jobs
    translation units in parallel) and load it. sm: the emulated architecture (80: no sm_90 features, as a
    kernel compiled for sm_80 sees them: JM_HAS_BULK 0)."""
    prepare(out_dir, headers)
    key = hashlib.sha256(repr((sources, headers, sm)).encode()).hexdigest()[:16]
    lib_path = out_dir / f"libsimt-{key}.so"
    if not lib_path.exists():
        cxx = os.environ.get("CXX", "g++")
        flags = ["-std=c++17", "-O1", "-fPIC", "-fno-strict-aliasing", "-Wno-unknown-pragmas", f"-DJM_SIMT_SM={sm}",
                 f"-I{out_dir}"]
        parts = [sources[i::jobs] for i in range(jobs) if sources[i::jobs]]
        procs, objs = [], []
        for i, part in enumerate(parts):
            cpp = out_dir / f"part{key}_{i}.cpp"
            body = '#include "simt.h"\n' + "".join(src for _, src in part)
            if i == 0:  # the table and the entry points, with the other units' kernels declared
                body += _decls(sources, part) + kernel_table(sources)
            cpp.write_text(body)
            obj = cpp.with_suffix(".o")
            objs.append(obj)
            procs.append(subprocess.Popen([cxx, *flags, "-c", str(cpp), "-o", str(obj)], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise RuntimeError(f"the emulator build failed:\n{out[-6000:]}")
        tmp = out_dir / f"{lib_path.name}.tmp{os.getpid()}"
        subprocess.run([cxx, "-shared", "-o", str(tmp), *map(str, objs)], check=True)
        os.replace(tmp, lib_path)
    return Library(lib_path)


def _decls(sources: list[tuple[str, str]], here: list[tuple[str, str]]) -> str:
    """Declarations of the kernels compiled in other translation units (the first unit has the table)."""
    local = {n for n, src in here if src}  # (an empty source: defined by another entry's source, wherever it is)
    moe = any(param_type(src) == "JmMoeParams" for _, src in sources)
    return '#include "jm_gemm_params.h"\n' + ('#include "jm_moe_util.cuh"\n' if moe else "") + "".join(
        f'extern "C" void {n}(const {param_type(src)} p{", jm::JmTensorMap m" if two_params(src) else ""});\n'
        for n, src in sources if n not in local)


# The emulator's TMA descriptor (tests/simt/simt.h, TensorMapWord): what a test's stand-in for
# driver.tensor_map_2d returns.
TENSOR_MAP_MAGIC = 0x53494D54544D4150


def tensor_map(dtype_code: int, ptr: int, inner: int, outer: int, row_bytes: int, box_inner: int, box_outer: int):
    from jitmarlin.jit import driver

    m = driver.TensorMap()
    for i, v in enumerate((TENSOR_MAP_MAGIC, ptr, inner, outer, row_bytes, box_inner, box_outer)):
        m.opaque[i] = v
    return m


# ---- an emulated device for the launch path (the tests' stand-ins for the driver, device queries, workspace) ----

SMEM_OPTIN = {(8, 0): 166912, (9, 0): 232448}  # shared memory a CTA may opt into: A100; H100 / H200


class EmuKernel:
    """What the launch path reads of a driver kernel handle (jitmarlin.jit.driver.Function); launch() runs the
    kernel on the emulator (and appends its name to `log`)."""

    num_regs = 128

    def __init__(self, lib: Library, name: str, cc: tuple[int, int], log: list | None = None,
                 stream: "Stream | None" = None):
        self.lib, self.name, self.cc, self.log, self.stream = lib, name, cc, log, stream
        self.max_dynamic_smem = SMEM_OPTIN[cc] - 1024

    def occupancy(self, threads, smem):
        return max(0, min(2, SMEM_OPTIN[self.cc] // max(smem, 1)))

    def max_active_clusters(self, threads, smem, cluster):  # (an H200 fits 16 clusters of 8 of the cluster tiles)
        return 132 // cluster

    def launch(self, grid, threads, smem, stream, params, pdl=False, cluster=0, extra=None):
        assert not (pdl and self.cc < (9, 0)), "sm_8x launches have no programmatic dependent launch"
        if self.log is not None:
            self.log.append(self.name)
        deps = dependent_buffers(self.lib, params) if pdl else []
        before = self.stream.overlapping(pdl) if self.stream is not None else []
        for rec in before:  # what the kernels still running beside this one's start write
            deps += [span for span in rec.writes if span not in deps]
        try:
            early, nowait = self.lib.launch(self.name, grid, threads, max(cluster, 1), smem, params, extra=extra,
                                            dependent=deps)
        except SimtError as e:
            raise SimtError(f"{self.name}: {name_dependent(self.lib, params, str(e), before)}") from None
        if self.stream is not None:
            self.stream.record(self.lib, self.name, params, early, nowait, before)


class Launched:
    """One kernel of an emulated stream: the buffers it writes, whether the kernel after it could start before it
    waited (early) or it never waited (nowait), and the kernels that could still run when it started."""

    def __init__(self, name, writes, early, nowait, overlapping):
        self.name, self.writes = name, writes
        self.early, self.nowait, self.overlapping = early, nowait, overlapping


class Stream:
    """The launches of one emulated stream, for the chain rule of programmatic dependent launch: a kernel launched
    with it may start once every CTA of the kernel before has triggered (launch_dependents) or exited, so before
    its own griddepcontrol.wait it may run beside that kernel — and beside the ones that kernel could run beside,
    if it triggered before its own wait. Without it, a kernel starts once the one before has completed, which
    implies the completion of the ones before that unless that kernel never waited. EmuKernel.launch adds what
    those kernels write to the launch's dependent buffers: this checks the launch path's promises that tables are
    complete before the kernel just before started (GemmParams.tables_ready) against the kernels actually
    launched. (Torch kernels between two of ours, which serialize, are not seen: the rule assumes none.)"""

    def __init__(self):
        self.launched: list[Launched] = []

    def overlapping(self, pdl: bool) -> list[Launched]:
        if not self.launched:
            return []
        last = self.launched[-1]
        if pdl:
            return [last] + (last.overlapping if last.early else [])
        return last.overlapping if last.nowait else []

    def record(self, lib, name, params, early, nowait, overlapping) -> None:
        writes = [lib.span_of(getattr(params, f)) for f in written_fields(name, params) if getattr(params, f)]
        if None in writes:
            raise AssertionError(f"{name} writes a buffer outside guarded memory")
        self.launched.append(Launched(name, writes, early, nowait, overlapping))


def written_fields(name: str, params: ctypes.Structure) -> tuple[str, ...]:
    """The parameters whose buffers a launch writes. (What it reads needs no record: a launch's own outputs are
    dependent buffers already, so a kernel before it that still reads them is covered.)"""
    if hasattr(params, "tables_ready"):  # GemmParams: the GEMMs, the act-order gather
        return "c", "ws", "counters"
    if "align" in name:
        return "sorted_ids", "expert_ids", "num_padded"
    return "y", "route_ids"


# The GEMM parameters (jitmarlin.ops._kernels.GemmParams) that point at memory the kernel before may still use
# when a launch overlaps it (programmatic dependent launch): the activations, the outputs and the workspace, and
# the routing tables unless the launch says they were complete before that kernel started (tables_ready). The
# weights, scales, zero points, bias and act-order permutation are layer constants.
DEPENDENT_FIELDS = ("a", "c", "ws", "counters")
TABLE_FIELDS = ("sorted_ids", "expert_ids", "num_padded", "topk_weights")
# The MoE helper kernels' parameters (K.MoeParams): every buffer but the act-order column orders (perm).
MOE_DEPENDENT_FIELDS = ("ids", "sorted_ids", "expert_ids", "num_padded", "x", "y", "route_ids")


def name_dependent(lib: Library, params: ctypes.Structure, msg: str, before: list | None = None) -> str:
    """An emulator error about an access before griddepcontrol.wait, with the parameter whose buffer it touched
    (and the kernel still running beside it that writes it, if it is one of an emulated stream's)."""
    m = re.search(r"at (0x[0-9a-f]+)", msg)
    if "griddepcontrol.wait" not in msg or m is None:
        return msg
    span = lib.span_of(int(m.group(1), 16))
    fields = DEPENDENT_FIELDS + TABLE_FIELDS if hasattr(params, "tables_ready") else MOE_DEPENDENT_FIELDS
    names = [f for f in fields if getattr(params, f) and lib.span_of(getattr(params, f)) == span]
    writers = [rec.name for rec in before or [] if span in rec.writes]
    return msg + (f" [the launch's `{'` / `'.join(names)}`]" if names and span is not None else "") + \
        (f" [written by {', '.join(writers)}, which may still run]" if writers else "")


def dependent_buffers(lib: Library, params: ctypes.Structure) -> list[tuple[int, int]]:
    """The guarded buffers behind a launch's dependent parameters; a dependent parameter outside guarded memory
    is an error (its plain accesses could not be checked)."""
    if hasattr(params, "tables_ready"):
        fields = DEPENDENT_FIELDS + (() if params.tables_ready else TABLE_FIELDS)
    else:
        fields = MOE_DEPENDENT_FIELDS
    out = []
    for f in fields:
        ptr = getattr(params, f)
        if not ptr:
            continue
        span = lib.span_of(ptr)
        if span is None:
            raise AssertionError(f"the launch's `{f}` ({ptr:#x}) is not in guarded memory (emu.Library.guarded)")
        if span not in out:
            out.append(span)
    return out


class GuardedWorkspace:
    """The GEMM workspace in guarded memory: partial sums poisoned with NaN, counters zero."""

    def __init__(self, lib: Library):
        self.ws = lib.guarded(torch.full((1 << 20,), float("nan")))
        self.counters = lib.guarded(torch.zeros(4096, dtype=torch.int32))

    def ensure(self, floats, slots):
        assert floats <= self.ws.numel() and slots <= self.counters.numel(), (floats, slots)


def clear_launch_caches() -> None:
    from jitmarlin.ops import gemm as G

    for fn in (G.prepare_launch, G.wgmma_launch, G.device_info):
        fn.cache_clear()
    G._ACT_MAPS.clear()


class GuardedTorch:
    """`torch` as a launch module sees it under emulation: torch.empty on the CPU returns guarded memory (so
    the outputs and tables the launch path allocates can be the dependent buffers of a launch, whose plain
    accesses the emulator checks); everything else is torch's."""

    def __init__(self, lib: Library):
        self._lib = lib

    def __getattr__(self, name):
        return getattr(torch, name)

    def _guard(self, t):
        return self._lib.guarded(t) if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() else t

    def empty(self, *size, **kw):
        return self._guard(torch.empty(*size, **kw))

    def full(self, *a, **kw):
        return self._guard(torch.full(*a, **kw))

    def tensor(self, *a, **kw):
        return self._guard(torch.tensor(*a, **kw))

    @property
    def ops(self):
        return _EmulatedOps()


class _EmulatedOps:
    """torch.ops as the launch modules see it under emulation: jitmarlin's custom ops call their CUDA
    implementations (jitmarlin.ops.moe._<op>_cuda / gemm's), which launch on the emulator, whatever the tensors'
    device; other namespaces are torch's."""

    def __getattr__(self, ns):
        if ns != "jitmarlin":
            return getattr(torch.ops, ns)
        from jitmarlin.ops import gemm as G
        from jitmarlin.ops import moe as MOE

        class Jitmarlin:
            def __getattr__(self, op):
                for mod in (MOE, G):
                    fn = getattr(mod, f"_{op}_cuda", None)
                    if fn is not None:
                        return fn
                raise AttributeError(f"no CUDA implementation of jitmarlin::{op} to emulate")

        return Jitmarlin()


def gemm_module_kernel(fam, tile) -> str:
    """The name K.get_kernel looks up in a family's module: a tile's GEMM, the dequantize kernel (None), the
    act-order gather ("gather") or its shared-memory form ("gather_smem")."""
    from jitmarlin.ops import _kernels as K

    if tile is None:
        return K.dequant_kernel_name(fam)
    if tile in ("gather", "gather_smem"):
        return K.gather_kernel_name(fam) + ("_smem" if tile == "gather_smem" else "")
    return K.kernel_name(fam, tile)


def gather_sources(fam) -> list[tuple[str, str]]:
    """The act-order gather kernels of a family for build(): one source defines both (the second entry names the
    shared-memory form, defined by the first)."""
    from jitmarlin.ops import _kernels as K

    return [(K.gather_kernel_name(fam), K.gather_kernel_source(fam)), (K.gather_kernel_name(fam) + "_smem", "")]


def emulated_device(monkeypatch, lib: Library, cc: tuple[int, int], sms: int = 4, log: list | None = None):
    """Make the launch path see a device of compute capability cc whose kernels (mma.sync, wgmma, strip, the MoE
    helpers) run on `lib`, one emulated stream (Stream) for all of them: returns (workspace, state); state["sms"]
    sets the SM count (clear_launch_caches() after changing it), state["stream"] is the stream."""
    from jitmarlin.jit import driver
    from jitmarlin.ops import _kernels as K
    from jitmarlin.ops import gemm as G
    from jitmarlin.ops import moe as MOE

    ws = GuardedWorkspace(lib)
    stream = Stream()
    for mod in (G, MOE):  # outputs allocated by the launch path in guarded memory (see GuardedTorch)
        monkeypatch.setattr(mod, "torch", GuardedTorch(lib))
    monkeypatch.setattr(MOE, "_ONE_TOKEN_TABLES", {})  # (device tables cached per process: this library's own)
    state = {"sms": sms, "stream": stream}
    monkeypatch.setattr(G, "_cc", functools.lru_cache(None)(lambda index: cc))
    monkeypatch.setattr(driver, "device", lambda index: type("Dev", (), {"sm_count": state["sms"],
                                                                        "smem_per_block_optin": SMEM_OPTIN[cc]})())
    monkeypatch.setattr(K, "get_kernel", lambda fam, tile, index, c: EmuKernel(
        lib, gemm_module_kernel(fam, tile), cc, log, stream))
    monkeypatch.setattr(K, "get_wgmma_kernel", lambda fam, nt, fw, st, index, wide=False, prod=0: EmuKernel(
        lib, K.wgmma_kernel_name(fam, nt, fw, st, wide, prod), cc, log, stream))
    monkeypatch.setattr(K, "get_strip_kernel", lambda fam, w, c, t, smem, index, cc_, perm=False: EmuKernel(
        lib, K.strip_kernel_name(fam, w, c, t, smem, perm), cc, log, stream))
    monkeypatch.setattr(K, "get_moe_util_kernel", lambda name, index, cc_: EmuKernel(lib, name, cc, log, stream))
    monkeypatch.setattr(K, "wgmma_module_ready", lambda fam: True)
    monkeypatch.setattr(K, "default_workspace", lambda device: ws)
    monkeypatch.setattr(K, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(K, "cuda_index", lambda device: 0)
    monkeypatch.setattr(driver, "tensor_map_2d", tensor_map)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "emulated")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    clear_launch_caches()
    return ws, state
