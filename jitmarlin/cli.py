"""The `jitmarlin` command: inspect the toolchain and the kernel cache, prebuild kernels, run the demo.

    jitmarlin info                       versions, GPUs, nvcc, ninja, cache location
    jitmarlin cache list [--all]         cached modules
    jitmarlin cache clear [--all] [--arch 8.0] [--dry-run]
    jitmarlin cache path                 the cache root, alone on a line (for scripts)
    jitmarlin build [--arch 8.0,9.0] [--dtype f16,bf16] [--bits 4,8] [--group-size 128,-1]
                    [--zero-points] [--moe] [--tiles small|all]
    jitmarlin demo                       a small end-to-end run on the GPU
    jitmarlin tune [--quick] [--device N] [--shapes 4096x4096,...] [--m 1,16,...] [--show] [--reset]
                                         measure the tile configs on this GPU, store the best per class

Errors of jitmarlin itself (and bad values) are printed as one `jitmarlin: error: ...` message
on stderr, exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import platform
import sys
import time
import warnings
from pathlib import Path

from ._version import __version__
from .errors import JitMarlinError, ToolchainError, UnsupportedDeviceError

EXIT_ERROR = 2  # jitmarlin error or bad value (argparse's usage errors use 2 as well)
EXIT_NO_GPU = 3  # `demo` without a usable GPU

DTYPE_CHOICES = ("f16", "bf16")
EXAMPLES = {"--arch": "8.0,9.0", "--dtype": "f16,bf16", "--bits": "4,8", "--group-size": "128,64"}
BITS_CHOICES = (4, 8)


# ---------------------------------------------------------------- helpers


def _out(text: str = "") -> None:
    print(text, flush=True)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # not reached


def _indent_rest(text: str, width: int) -> str:
    """Indent every line but the first so a multi-line message lines up under its value column."""
    lines = str(text).splitlines() or [""]
    return "\n".join([lines[0]] + [" " * width + ln for ln in lines[1:]])


def _split_list(option: str, text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if any(not t for t in items):
        raise ValueError(f"{option} {text!r}: expected a comma-separated list without empty items, "
                         f"e.g. {option} {EXAMPLES[option]}")
    return list(dict.fromkeys(items))  # keep order, drop repeats


def _parse_archs(text: str) -> list[tuple[int, int]]:
    from .jit.toolchain import parse_arch

    return list(dict.fromkeys(parse_arch(a) for a in _split_list("--arch", text)))


def _parse_dtypes(text: str) -> list[str]:
    out = []
    for d in _split_list("--dtype", text):
        if d not in DTYPE_CHOICES:
            raise ValueError(f"--dtype {d!r} is not supported: use {' or '.join(DTYPE_CHOICES)} "
                             "(a comma-separated list, e.g. --dtype f16,bf16)")
        out.append(d)
    return out


def _parse_ints(option: str, text: str) -> list[int]:
    out = []
    for t in _split_list(option, text):
        try:
            out.append(int(t))
        except ValueError:
            raise ValueError(f"{option} {t!r} is not an integer") from None
    return out


def _parse_bits(text: str) -> list[int]:
    bits = _parse_ints("--bits", text)
    for b in bits:
        if b not in BITS_CHOICES:
            raise ValueError(f"--bits {b} is not supported: use 4 or 8 (e.g. --bits 4,8)")
    return bits


def _parse_group_sizes(text: str) -> list[int]:
    from .ops._kernels import check_group_size

    groups = _parse_ints("--group-size", text)
    for g in groups:
        try:
            check_group_size(g)
        except ValueError as e:
            raise ValueError(f"--group-size {g}: {e}") from None
    return groups


def _gpus() -> tuple[list[tuple[int, str, tuple[int, int]]], str | None]:
    """([(index, name, capability)], None), or ([], why there is none)."""
    import torch

    try:
        if not torch.cuda.is_available():
            return [], (f"no CUDA device (torch {torch.__version__}, torch.version.cuda="
                        f"{torch.version.cuda}, torch.cuda.is_available() is False)")
        out = []
        for i in range(torch.cuda.device_count()):
            out.append((i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i))))
        if not out:
            return [], "no CUDA device (torch.cuda.device_count() is 0)"
        return out, None
    except Exception as e:  # a broken driver must not crash `info`
        return [], f"no usable CUDA device: querying CUDA failed: {e}"


def _usable_capabilities() -> tuple[list[tuple[int, int]], str | None]:
    """Distinct compute capabilities (>= 8.0) of the visible GPUs, or ([], reason)."""
    from .jit.toolchain import MIN_CAPABILITY

    gpus, why = _gpus()
    if not gpus:
        return [], why
    ccs = [cc for _, _, cc in gpus if cc >= MIN_CAPABILITY]
    if not ccs:
        listing = ", ".join(f"cuda:{i} '{name}' (compute capability {cc[0]}.{cc[1]})" for i, name, cc in gpus)
        return [], (f"no GPU with compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                    f"(Ampere or newer): found {listing}")
    return list(dict.fromkeys(ccs)), None


# ---------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from .jit import build, cache
    from .jit.spec import source_dir
    from .jit.toolchain import MIN_CAPABILITY, check_cuda_matches_torch, find_cuda, find_ninja

    rows: list[tuple[str, str]] = []
    pkg_dir = Path(__file__).resolve().parent
    rows.append(("jitmarlin", f"{__version__} ({pkg_dir})"))
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})"))

    gpus, why = _gpus()
    if gpus:
        for i, name, cc in gpus:
            ok = "" if cc >= MIN_CAPABILITY else (
                f"  UNSUPPORTED: jitmarlin needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
            rows.append((f"cuda:{i}", f"{name}, compute capability {cc[0]}.{cc[1]} (sm_{cc[0]}{cc[1]}){ok}"))
    else:
        rows.append(("GPUs", why or "no CUDA device"))

    try:
        tc = find_cuda()
        text = (f"{tc.nvcc}, CUDA {tc.version_full} (home {tc.home}, found by: {tc.found_by})")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                check_cuda_matches_torch(tc)
            except ToolchainError as e:
                text += f"\nUNUSABLE: {e}"
        for w in caught:
            text += f"\nnote: {w.message}"
        rows.append(("nvcc", text))
    except ToolchainError as e:
        rows.append(("nvcc", f"not found: {e}"))

    try:
        rows.append(("ninja", str(find_ninja())))
    except ToolchainError as e:
        rows.append(("ninja", f"not found: {e}"))

    try:
        rows.append(("sources", str(source_dir())))
    except FileNotFoundError as e:
        rows.append(("sources", f"MISSING: {e}"))

    root, how = cache.cache_root()
    rows.append(("cache", f"{root} (chosen by {how})"))
    try:
        here = len(cache.list_modules(root))
        everywhere = len(cache.list_modules(root, all_versions=True))
        rows.append(("cached modules", f"{here} for jitmarlin {__version__} + {cache.torch_tag()} "
                                       f"({everywhere} for all versions) in {cache.version_dir(root)}"))
    except OSError as e:
        rows.append(("cached modules", f"cannot read the cache: {e}"))

    try:
        rows.append(("build jobs", f"{build.build_jobs()} (JITMARLIN_BUILD_JOBS or MAX_JOBS, else the CPU count)"))
    except ValueError as e:
        rows.append(("build jobs", f"invalid: {e}"))
    flags = [f"{v}={os.environ[v]}" for v in ("JITMARLIN_DISABLE_JIT", "JITMARLIN_QUIET", "CUDA_HOME", "CUDA_PATH")
             if os.environ.get(v)]
    rows.append(("environment", ", ".join(flags) if flags else "(no JITMARLIN_*/CUDA_* variables set)"))

    width = max(len(k) for k, _ in rows) + 2
    for k, v in rows:
        _out(f"{k + ':':<{width}}{_indent_rest(v, width)}")
    return 0


# ---------------------------------------------------------------- cache


def _key_text(key: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in key.items())


def cmd_cache_list(args: argparse.Namespace) -> int:
    from .jit import cache

    root, _ = cache.cache_root()
    mods = cache.list_modules(root, all_versions=args.all)
    if not mods:
        where = root if args.all else cache.version_dir(root)
        _out(f"no cached modules in {where}")
        return 0
    header = ["arch", "family", "key", "size", "built", "path"]
    if args.all:
        header.insert(0, "version")
    rows = []
    for m in mods:
        row = [m.arch, m.family, _key_text(m.key), _human_size(m.size), cache.describe_age(m.built_at), str(m.path)]
        if args.all:
            row.insert(0, f"{m.jitmarlin_version}/{m.torch_tag}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        _out("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths[:-1])) + "  " + r[-1])
    total = sum(m.size for m in mods)
    _out(f"{len(mods)} module(s), {_human_size(total)}")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    from .jit import cache
    from .jit.toolchain import arch_name, parse_arch

    arch = arch_name(parse_arch(args.arch)) if args.arch else None
    root, _ = cache.cache_root()
    victims = cache.clear(root, all_versions=args.all, arch=arch, dry_run=args.dry_run)
    scope = ("all jitmarlin/torch versions" if args.all else
             f"jitmarlin {__version__} + {cache.torch_tag()}") + (f", {arch} only" if arch else "")
    if not victims:
        _out(f"nothing to remove ({scope}) under {root}")
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for v in victims:
        _out(f"{verb} {v}")
    _out(f"{verb} {len(victims)} director{'y' if len(victims) == 1 else 'ies'} ({scope})"
         + ("; nothing was deleted (--dry-run)" if args.dry_run else ""))
    return 0


def cmd_cache_path(args: argparse.Namespace) -> int:
    from .jit import cache

    _out(str(cache.cache_root()[0]))
    return 0


# ---------------------------------------------------------------- build


def cmd_build(args: argparse.Namespace) -> int:
    from .jit import build
    from .jit.toolchain import arch_name
    from .ops import _kernels as K

    # Validate everything before the first (slow) compile.
    dtypes = _parse_dtypes(args.dtype)
    bits = _parse_bits(args.bits)
    groups = _parse_group_sizes(args.group_size)
    if args.arch is not None:
        ccs = _parse_archs(args.arch)
    else:
        ccs, why = _usable_capabilities()
        if not ccs:
            raise UnsupportedDeviceError(
                f"cannot build for this machine's GPU: {why}. To build without a GPU, name the target "
                "architectures, e.g. `jitmarlin build --arch 8.0,9.0`.")
    small = args.tiles == "small"
    if args.act_order and (args.moe or small):
        raise ValueError("--act-order adds the act-order forms of the dense strip kernels (sm_90), which "
                         f"{'--moe' if args.moe else '--tiles small'} does not build: drop one of the two")
    families = [K.Family(d, b, args.zero_points, g, moe=args.moe)
                for d, b, g in itertools.product(dtypes, bits, groups)]

    jobs = [(fam, cc) for cc in ccs for fam in families]
    _out(f"building {len(jobs)} module(s): {len(families)} famil{'y' if len(families) == 1 else 'ies'} x "
         f"{len(ccs)} arch(s) ({', '.join(arch_name(c) for c in ccs)}), "
         f"{'2' if small else ', '.join(str(len(K.tiles_for(c))) for c in ccs)} tile configs each")
    t_all = time.time()
    for n, (fam, cc) in enumerate(jobs, 1):
        t0 = time.time()
        spec = K.build_spec(fam, cc, K.TILES[:2] if small else None)
        mod = build.get_module(spec)
        dt = time.time() - t0
        how = "built" if float(mod.meta.get("built_at", 0.0)) >= t0 else "cached"
        key = " ".join(f"{k}={v}" for k, v in fam.key())
        _out(f"[{n}/{len(jobs)}] {spec.family} {key} {spec.arch}: {how} in {dt:.1f} s  {mod.path}")
    if not small:  # sm_90: the warpgroup-MMA kernels (MoE blocks of 64 and 128, dense M 17-511)
        for fam in families:
            if (9, 0) in ccs:
                mod = build.get_module(K.wgmma_build_spec(fam, (9, 0)))
                _out(f"wgmma {' '.join(f'{k}={v}' for k, v in fam.key())} sm_90a: {mod.path}")
    if not small and not args.moe:  # sm_90+: the strip kernels the dense route takes on small problems (M <= 8),
        for fam in families:        # with --act-order also their act-order forms (the gather inside the kernel)
            for cc in (c for c in ccs if K.strip_built(fam, c)):
                for perm in (False, True) if args.act_order else (False,):
                    mod = build.get_module(K.strip_build_spec(fam, cc, perm))
                    _out(f"strip{' act-order' if perm else ''} {' '.join(f'{k}={v}' for k, v in fam.key())} "
                         f"{arch_name(cc)}: {mod.path}")
    if args.moe:  # the MoE path's helper kernels (align, SiLU-mul), one module per arch
        for cc in ccs:
            mod = build.get_module(K.moe_util_build_spec(cc))
            _out(f"moe helpers {arch_name(cc)}: {mod.path}")
    _out(f"done: {len(jobs)} module(s) in {time.time() - t_all:.1f} s")
    return 0


# ---------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    ccs, why = _usable_capabilities()
    if not ccs:
        cmd_info(args)
        _out()
        _err(f"jitmarlin: demo: cannot run: {why}. The demo runs jitmarlin's kernels, which need a "
             "CUDA GPU with compute capability >= 8.0 (Ampere or newer).")
        return EXIT_NO_GPU
    demo = importlib.import_module("jitmarlin.demo")
    rc = demo.run()
    return rc if isinstance(rc, int) else 0


# ---------------------------------------------------------------- tune


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in _split_list("--shapes", text):
        k, sep, n = item.lower().partition("x")
        if not sep or not k.isdigit() or not n.isdigit():
            raise ValueError(f"--shapes: {item!r} is not KxN (e.g. 4096x11008)")
        out.append((int(k), int(n)))
    return out


def cmd_tune(args: argparse.Namespace) -> int:
    from .ops import tuning

    gpus, why = _gpus()
    usable = [(i, name, cc) for i, name, cc in gpus if cc >= (8, 0)]
    if not any(i == args.device for i, _, _ in usable):
        detail = why or ", ".join(f"cuda:{i} {name} (sm_{cc[0]}{cc[1]})" for i, name, cc in gpus)
        _err(f"jitmarlin: tune: cannot run on cuda:{args.device}: {detail or 'no such GPU'}. Tuning times the "
             "kernels on a CUDA GPU with compute capability >= 8.0.")
        return EXIT_NO_GPU
    shapes = _parse_shapes(args.shapes) if args.shapes else list(
        tuning.QUICK_SHAPES if args.quick else tuning.DEFAULT_SHAPES)
    ms = _parse_ints("--m", args.m) if args.m else list(tuning.QUICK_MS if args.quick else tuning.DEFAULT_MS)
    from .ops.gemm import device_info

    info = device_info(args.device)
    path = tuning.table_path(info)
    if args.reset:
        removed = tuning.remove_table(info)
        _out(f"removed {removed}" if removed else f"no tuning table for {info.name} at {path}")
        return 0
    if args.show:
        table = tuning.read_table(info)
        if table is None:
            _out(f"no tuning table for {info.name} (sm_{info.cc[0]}{info.cc[1]}): built-in choices are used. "
                 "Run `jitmarlin tune` to make one.")
            return 0
        _out(f"{path} ({table.get('created')}, {len(table.get('measurements', []))} measurements)")
        for key, entry in sorted(table["choices"].items()):
            _out(f"  {key:10s} {entry.get('config')}  (mean slowdown {entry.get('mean_slowdown')} over "
                 f"{', '.join(entry.get('problems', []))})")
        return 0
    _out(f"jitmarlin tune on cuda:{args.device} {info.name} (sm_{info.cc[0]}{info.cc[1]}, {info.sms} SMs): "
         f"{len(shapes)} shape(s) x M {ms}, f16 x int4 g128")
    notes: list[str] = []
    table = tuning.tune(info, tuning.gpu_timer(args.device, notes), shapes, ms, progress=_out)
    for note in notes:
        _err(f"jitmarlin: tune: {note}")
    if not table["choices"]:
        _err("jitmarlin: tune: no configuration could be timed; nothing stored")
        return EXIT_ERROR
    _out("")
    _out("class        tuned config                 built-in config")
    for key, entry in sorted(table["choices"].items()):
        k, n, m = (int(v) for v in entry["problems"][0].split("x"))
        builtin = tuning.builtin_choice(info, m, n, k)
        _out(f"  {key:10s} {entry['config']:28s} {builtin}{'  (same)' if builtin == entry['config'] else ''}")
    saved = tuning.save_table(table, info)
    _out(f"stored {saved} ({table['seconds']} s); JITMARLIN_TUNE=0 ignores it, `jitmarlin tune --reset` removes it")
    return 0


# ---------------------------------------------------------------- parser


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jitmarlin",
        description="jitmarlin: fp16/bf16 x int4/int8 GPU GEMM kernels, compiled on first use and "
                    "cached per GPU architecture.")
    p.add_argument("--version", action="version", version=f"jitmarlin {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("info", help="versions, GPUs, nvcc, ninja and the kernel cache")
    s.set_defaults(func=cmd_info)

    c = sub.add_parser("cache", help="list, clear or locate the kernel cache")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    s = csub.add_parser("list", help="table of cached modules (this jitmarlin + torch version)")
    s.add_argument("--all", action="store_true", help="all jitmarlin/torch versions in the cache")
    s.set_defaults(func=cmd_cache_list)
    s = csub.add_parser("clear", help="remove cached modules of this jitmarlin + torch version")
    s.add_argument("--all", action="store_true", help="all jitmarlin/torch versions")
    s.add_argument("--arch", metavar="ARCH", help="only this architecture: sm_80, 80 or 8.0")
    s.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    s.set_defaults(func=cmd_cache_clear)
    s = csub.add_parser("path", help="print the cache root directory")
    s.set_defaults(func=cmd_cache_path)

    s = sub.add_parser(
        "build", help="prebuild kernel families into the cache",
        description="Compile kernel families into the cache, for this machine's GPUs or for the "
                    "architectures given with --arch (no GPU needed then). Lists are comma-separated; "
                    "a list starting with -1 needs '=': --group-size=-1,128.")
    s.add_argument("--arch", metavar="LIST", help="target architectures, e.g. 8.0,9.0 (default: the visible GPUs)")
    s.add_argument("--dtype", metavar="LIST", default="f16", help="activation dtypes: f16, bf16 (default f16)")
    s.add_argument("--bits", metavar="LIST", default="4", help="weight bits: 4, 8 (default 4)")
    s.add_argument("--group-size", metavar="LIST", default="128",
                   help="quantization group sizes: -1 (per channel), 32, 64, multiples of 128 (default 128)")
    s.add_argument("--zero-points", action="store_true", help="asymmetric weights with zero points (default symmetric)")
    s.add_argument("--moe", action="store_true", help="the mixture-of-experts kernels")
    s.add_argument("--act-order", action="store_true",
                   help="also the act-order forms of the sm_90 strip kernels (GPTQ desc_act layers; dense only)")
    s.add_argument("--tiles", choices=("all", "small"), default="all",
                   help="'small': only the first 2 tile configs (quick CI builds); default all")
    s.set_defaults(func=cmd_build)

    s = sub.add_parser("demo", help="a small end-to-end run on the GPU")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser(
        "tune", help="time the GEMM tile configs on this GPU and store the best per problem class",
        description="Time every compiled tile config x CTA width of the fp16 x int4 GEMM on a few shapes "
                    "per problem class (M <= 8, <= 16, <= 32, <= 48, larger; K*N below or above 2^26) and "
                    "store the winner of each class in the kernel cache, where the GEMM then tries it first "
                    "on GPUs of this name (about 600 timings on an sm_90 GPU with the defaults, 120 with --quick).")
    s.add_argument("--device", type=int, default=0, metavar="N", help="CUDA device index (default 0)")
    s.add_argument("--quick", action="store_true", help="2 shapes x M 1,16,64 instead of 6 shapes x M 1,8,16,32,48,64")
    s.add_argument("--shapes", metavar="LIST", help="KxN shapes to time, e.g. 4096x4096,4096x11008")
    s.add_argument("--m", metavar="LIST", help="M values to time, e.g. 1,16,64")
    s.add_argument("--show", action="store_true", help="print this GPU's stored table and exit")
    s.add_argument("--reset", action="store_true", help="remove this GPU's stored table and exit")
    s.set_defaults(func=cmd_tune)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (JitMarlinError, ValueError, OSError) as e:
        _err(f"jitmarlin: error: {e}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        _err("jitmarlin: interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover - `python -m jitmarlin` goes through __main__.py
    sys.exit(main())
