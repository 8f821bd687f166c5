"""Where a kernel's warps wait for their own loads, read from the machine code (no GPU).

Each Volta-and-later SASS instruction carries scheduling control bits next to its opcode: a variable-latency
instruction (a global or shared load, a shuffle, S2R, ...) names a dependency barrier (scoreboard, 0-5) it signals
when done, and a later instruction names a mask of barriers to wait for before it issues. Those bits are in the
second 64-bit word that `cuobjdump -sass` prints for every instruction (bits 41-63: stall 4, yield 1, write barrier
3, read barrier 3, wait mask 6, reuse 4; the layout published by the Volta/Turing microbenchmark papers, Jia et al.
2018/2019, and used by the open SASS assemblers). This tool replays the barriers over the code in program order and
lists every wait with the instruction that set its barrier and how many instructions lie between them. A global
load waited for a few dozen instructions after it was issued stalls the warp for most of a memory round trip; in a
loop, that is a stall per iteration (session 53 found two such in the strip kernel this way, by eye).

Loops: at a backward branch the body is replayed once more with the barriers still pending, so a load issued late
in an iteration and waited for early in the next one shows up (flagged "wrap", distance counted around the loop).

`--loop` reports the main loop only (the natural loop with the most global loads among those holding MMAs): the
waits per iteration that let global loads complete, how many loads each lets through and how long ago the youngest
was issued. Session 54 found with it that every strip-kernel form waited once per k16 row (jm_strip.cuh).

Usage:
    python3 benchmarks/sass_waits.py KERNEL.cubin [--max-dist 64] [--ops LDG] [--function NAME_SUBSTRING]
    python3 benchmarks/sass_waits.py KERNEL.cubin --loop
    python3 benchmarks/sass_waits.py SOURCE.cu --nvcc-args "-arch=sm_90a -O3 -std=c++17 -I cuda_src ..."
cuobjdump: $CUOBJDUMP, PATH, /usr/local/cuda/bin, or the copy in triton's CUDA backend.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

# the first line of an instruction: /*addr*/ [@pred] OPCODE operands ; /* lo word */, the next line: /* hi word */
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_HI = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
# BRA [predicate or uniform-register operand,] [`(label)] target: "@P1 BRA P2, 0x1770", "BRA.DIV UR4, 0xa680"
_BRA = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\S+)*\s+(!?U?P\w+\s*,\s*|U?R\w+\s*,\s*)?(?:`\(([^)]*)\)\s*)?"
                  r"(0x[0-9a-f]+)")
_DEPBAR = re.compile(r"DEPBAR\.LE\s+SB(\d)\s*,\s*(0x[0-9a-f]+|\d+)")


@dataclass
class Insn:
    pc: int
    text: str
    stall: int
    wbar: int  # 7: none
    rbar: int  # 7: none
    wait: int  # mask of barriers 0-5

    @property
    def opcode(self) -> str:
        t = self.text
        if t.startswith("@"):
            t = t.split(None, 1)[1]
        return t.split()[0]


@dataclass
class Wait:
    waiter: int  # index of the waiting instruction
    setter: int  # index of the youngest instruction the wait depends on
    barrier: int
    dist: int  # instructions from setter to waiter (around the loop for wrap)
    wrap: bool
    read: bool  # a read barrier (a store's source registers), not a result


@dataclass
class Function:
    name: str
    insns: list[Insn] = field(default_factory=list)


def control(hi: int) -> tuple[int, int, int, int]:
    c = hi >> 41
    return c & 0xF, (c >> 5) & 7, (c >> 8) & 7, (c >> 11) & 0x3F


def parse(sass: str) -> list[Function]:
    funcs: list[Function] = []
    lines = sass.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _FUNC.match(line)
        if m:
            funcs.append(Function(m.group(1)))
            i += 1
            continue
        m = _INSN.match(line)
        if m and funcs and i + 1 < len(lines):
            h = _HI.match(lines[i + 1])
            if h:
                stall, wb, rb, wait = control(int(h.group(1), 16))
                funcs[-1].insns.append(Insn(int(m.group(1), 16), m.group(2), stall, wb, rb, wait))
                i += 2
                continue
        i += 1
    return funcs


def replay(f: Function) -> list[Wait]:
    """Every wait on a barrier, with its youngest binding setter (program order, each backward branch's body
    replayed once more with the barriers left pending)."""
    insns = f.insns
    index = {x.pc: n for n, x in enumerate(insns)}
    waits: list[Wait] = []
    # pending[b]: list of (setter index, is_read, loop offset) outstanding on barrier b
    pending: dict[int, list[tuple[int, bool, int]]] = {b: [] for b in range(6)}
    done_loops: set[int] = set()

    def step(n: int, offset: int) -> None:
        x = insns[n]
        here = n + offset
        # an explicit count wait: DEPBAR.LE SBb, k -> the oldest len - k done
        m = _DEPBAR.search(x.text)
        if m:
            b, k = int(m.group(1)), int(m.group(2), 0)
            lst = pending[b]
            if len(lst) > k:
                binding = lst[len(lst) - k - 1]
                waits.append(Wait(n, binding[0], b, here - (binding[0] + binding[2]), binding[2] < offset,
                                  binding[1]))
                pending[b] = lst[len(lst) - k:]
        for b in range(6):
            if x.wait >> b & 1 and pending[b]:
                s, rd, off = pending[b][-1]
                waits.append(Wait(n, s, b, here - (s + off), off < offset, rd))
                pending[b] = []
        if x.wbar < 6:
            pending[x.wbar].append((n, False, offset))
        if x.rbar < 6:
            pending[x.rbar].append((n, True, offset))

    n = 0
    while n < len(insns):
        step(n, 0)
        m = _BRA.match(insns[n].text)
        if m:
            tgt = index.get(int(m.group(3), 16))
            if tgt is not None and tgt <= n and n not in done_loops:
                done_loops.add(n)
                body = n - tgt + 1
                for j in range(tgt, n + 1):  # the next iteration, its indices shifted by one body length
                    step(j, body)
                # back to the state after the loop's last iteration (what is still pending stays)
        n += 1
    return waits


@dataclass
class Drain:
    waiter: int  # index of the instruction that waits
    barrier: int
    loads: int  # global loads (LDG) pending on the barrier, all of which the wait lets complete
    dist: int  # instructions since the youngest of them (around the loop where it was issued before the top)


def successors(f: Function) -> list[list[int]]:
    """Control-flow successors of each instruction (BRA: its target, and the next one when predicated or
    conditional on a predicate operand; EXIT / RET: none unless predicated)."""
    index = {x.pc: n for n, x in enumerate(f.insns)}
    out: list[list[int]] = []
    for n, x in enumerate(f.insns):
        op = x.opcode
        nxt = [n + 1] if n + 1 < len(f.insns) else []
        predicated = x.text.startswith("@")
        m = _BRA.match(x.text)
        if m:
            tgt = index.get(int(m.group(3), 16))
            conditional = predicated or m.group(1) is not None
            out.append(([tgt] if tgt is not None else []) + (nxt if conditional else []))
        elif op.startswith(("EXIT", "RET")):
            out.append(nxt if predicated else [])
        else:
            out.append(nxt)
    return out


def is_global_load(x: Insn) -> bool:
    """A global load into registers (LDG), not a cp.async (LDGSTS) or its commit (LDGDEPBAR)."""
    return x.opcode.startswith("LDG") and not x.opcode.startswith(("LDGSTS", "LDGDEPBAR"))


def loops(f: Function) -> list[tuple[int, int]]:
    """(first, last) instruction indices of every natural loop: a branch back to an instruction that dominates it.
    (A block laid out after the code it returns to, reached by a forward branch, jumps backward too without being
    a loop.)"""
    succ = successors(f)
    nn = len(succ)
    if nn == 0:
        return []
    preds: list[list[int]] = [[] for _ in range(nn)]
    for n, ss in enumerate(succ):
        for q in ss:
            preds[q].append(n)
    full = (1 << nn) - 1
    dom = [full] * nn
    dom[0] = 1
    changed = True
    while changed:  # iterative dominators over instructions (bitsets)
        changed = False
        for n in range(1, nn):
            d = full
            for q in preds[n]:
                d &= dom[q]
            if not preds[n]:
                d = 0
            d |= 1 << n
            if d != dom[n]:
                dom[n], changed = d, True
    out = []
    for n, ss in enumerate(succ):
        for t in ss:
            if t <= n and dom[n] >> t & 1:
                out.append((t, n))
    return out


def main_loop(f: Function) -> tuple[int, int] | None:
    """The loop with the most global loads (LDG, LDGSTS) among those holding matrix instructions."""
    best, key = None, (-1, 0)
    for a, b in loops(f):
        body = f.insns[a:b + 1]
        if not any(x.opcode.startswith(("HMMA", "HGMMA", "IMMA")) for x in body):
            continue
        k = (sum(x.opcode.startswith("LDG") and not x.opcode.startswith("LDGDEPBAR") for x in body), -(b - a))
        if k > key:
            best, key = (a, b), k
    return best


def loop_drains(f: Function, loop: tuple[int, int]) -> list[Drain]:
    """The waits of one iteration of `loop` (in the steady state: the body walked twice, the second walk reported,
    straight through, every conditional block taken) that let pending global loads complete. A register ring that
    keeps loads in flight across its rows shows one such wait per ring; one per row means the warp waits for the
    loads the row before it issued."""
    a, b = loop
    pend: dict[int, list[int]] = {q: [] for q in range(6)}
    out: list[Drain] = []
    for rep in range(2):
        for j in range(a, b + 1):
            x = f.insns[j]
            for q in range(6):
                if x.wait >> q & 1 and pend[q]:
                    nl = sum(is_global_load(f.insns[s]) for s in pend[q])
                    if rep == 1 and nl:
                        y = pend[q][-1]
                        out.append(Drain(j, q, nl, j - y if y <= j else (b - y) + (j - a) + 1))
                    pend[q] = []
            if x.wbar < 6:
                pend[x.wbar].append(j)
    return out


def find_cuobjdump() -> str | None:
    """$CUOBJDUMP, cuobjdump on PATH, the CUDA toolkit's, or the one triton's CUDA backend ships."""
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if cand and os.path.exists(cand):
            return cand
    try:
        import triton
        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(cand):
            return cand
    except ImportError:
        pass
    return None


def sass_of(path: str, nvcc_args: str = "") -> str:
    if path.endswith(".cu"):
        out = os.path.join(tempfile.mkdtemp(), "k.cubin")
        subprocess.run(["nvcc", "-cubin", *nvcc_args.split(), "-o", out, path], check=True)
        path = out
    tool = find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found: set CUOBJDUMP")
    return subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a .cubin, or a .cu compiled with --nvcc-args")
    ap.add_argument("--nvcc-args", default="-arch=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I cuda_src")
    ap.add_argument("--function", default="", help="only functions whose name contains this")
    ap.add_argument("--ops", default="LDG", help="setter opcodes to report (prefixes, comma separated; 'all')")
    ap.add_argument("--max-dist", type=int, default=64, help="report waits at most this many instructions after")
    ap.add_argument("--context", type=int, default=0, help="print this many instructions around each waiter")
    ap.add_argument("--loop", action="store_true",
                    help="only the main loop's waits for global loads, per iteration (how many rows share one wait)")
    args = ap.parse_args(argv)
    ops = None if args.ops == "all" else tuple(args.ops.split(","))
    for f in parse(sass_of(args.path, args.nvcc_args)):
        if args.function not in f.name:
            continue
        if args.loop:
            lp = main_loop(f)
            if lp is None:
                print(f"== {f.name}: no loop with matrix instructions")
                continue
            ds = loop_drains(f, lp)
            body = f.insns[lp[0]:lp[1] + 1]
            print(f"== {f.name}: main loop {f.insns[lp[0]].pc:05x}-{f.insns[lp[1]].pc:05x}, {len(body)} instructions, "
                  f"{sum(is_global_load(x) for x in body)} global loads, "
                  f"{sum(x.opcode.startswith('LDGSTS') for x in body)} cp.async, "
                  f"{sum(x.opcode.startswith(('HMMA', 'HGMMA')) for x in body)} MMAs: {len(ds)} waits for global "
                  "loads per iteration")
            for d in ds:
                x = f.insns[d.waiter]
                print(f"  {x.pc:05x} SB{d.barrier}: {d.loads} loads, the youngest {d.dist} instructions before  "
                      f"{x.text:.60}")
            continue
        waits = [w for w in replay(f) if not w.read and w.dist <= args.max_dist
                 and (ops is None or f.insns[w.setter].opcode.startswith(ops))]
        print(f"== {f.name}: {len(f.insns)} instructions, {len(waits)} waits within {args.max_dist} of a "
              f"{'/'.join(ops) if ops else 'any'} setter")
        seen = set()
        for w in sorted(waits, key=lambda w: (w.dist, w.waiter)):
            key = (w.setter, w.waiter)
            if key in seen:
                continue
            seen.add(key)
            s, x = f.insns[w.setter], f.insns[w.waiter]
            print(f"  {w.dist:4d}{' wrap' if w.wrap else '     '} SB{w.barrier}  {s.pc:05x} {s.text:<60.60} -> "
                  f"{x.pc:05x} {x.text:.60}")
            if args.context:
                for j in range(max(0, w.waiter - args.context), min(len(f.insns), w.waiter + args.context + 1)):
                    print(f"        {f.insns[j].pc:05x} {f.insns[j].text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
