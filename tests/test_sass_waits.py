"""benchmarks/sass_waits.py reads the scheduling bits of SASS listings (no GPU, no cuobjdump here: a listing written
in cuobjdump's format with known control words)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("sass_waits", ROOT / "benchmarks" / "sass_waits.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sass_waits", mod)
    spec.loader.exec_module(mod)
    return mod


def _line(pc: int, text: str, wbar: int = 7, wait: int = 0, stall: int = 1) -> str:
    ctrl = stall | (wbar << 5) | (7 << 8) | (wait << 11)
    return (f"        /*{pc:04x}*/                   {text} ;   /* 0x0000000000000000 */\n"
            f"                                                         /* 0x{ctrl << 41:016x} */\n")


def _listing(rows: list[tuple]) -> str:
    body = "".join(_line(16 * n, *r) for n, r in enumerate(rows))
    return "\tcode for sm_90a\n\t\tFunction : k\n" + body


def test_control_bits_decode():
    sw = _tool()
    # the words of an S2R that sets barrier 0 and of the SHF that waits for it (cuobjdump of an sm_90a kernel)
    assert sw.control(0x000E220000002100)[1] == 0 and sw.control(0x000E220000002100)[3] == 0
    assert sw.control(0x001FCA0000011600)[1] == 7 and sw.control(0x001FCA0000011600)[3] == 1


def test_a_loop_that_waits_per_row_and_one_that_waits_per_batch():
    sw = _tool()
    per_row = _listing([
        ("MOV R1, RZ",),
        ("LDG.E.128 R4, desc[UR4][R2.64]", 5),           # row 0's next load
        ("HMMA.16816.F32 R8, R12, R4, R8", 7, 1 << 5),  # the next row reads a ring register: waits for barrier 5
        ("LDG.E.128 R16, desc[UR4][R2.64+0x10]", 5),
        ("HMMA.16816.F32 R8, R12, R16, R8", 7, 1 << 5),
        ("@P0 BRA 0x10",),
        ("EXIT",),
    ])
    (f,) = sw.parse(per_row)
    assert [x.opcode for x in f.insns][:3] == ["MOV", "LDG.E.128", "HMMA.16816.F32"]
    loop = sw.main_loop(f)
    assert loop == (1, 5)
    drains = sw.loop_drains(f, loop)
    assert [(d.waiter, d.loads, d.dist) for d in drains] == [(2, 1, 1), (4, 1, 1)]
    per_batch = _listing([
        ("MOV R1, RZ",),
        ("HMMA.16816.F32 R8, R12, R4, R8", 7, 1 << 5),  # the batch's first read: one wait for both loads
        ("HMMA.16816.F32 R8, R12, R16, R8",),
        ("LDG.E.128 R4, desc[UR4][R2.64]", 5),
        ("LDG.E.128 R16, desc[UR4][R2.64+0x10]", 5),
        ("@P0 BRA 0x10",),
        ("EXIT",),
    ])
    (f,) = sw.parse(per_batch)
    drains = sw.loop_drains(f, sw.main_loop(f))
    assert [(d.waiter, d.loads, d.dist) for d in drains] == [(1, 2, 2)]  # around the loop: 4 -> 5 -> 1


def test_a_block_laid_out_after_its_join_is_not_a_loop():
    sw = _tool()
    lst = _listing([
        ("MOV R1, RZ",),
        ("HMMA.16816.F32 R8, R12, R4, R8",),
        ("@P1 BRA 0x60",),            # to the out-of-line block
        ("LDG.E.128 R4, desc[UR4][R2.64]", 5),
        ("@P0 BRA 0x10",),            # the loop's back edge
        ("EXIT",),
        ("BRA.DIV UR4, 0x70",),       # (a uniform-register operand: conditional)
        ("BRA 0x30",),                # back into the loop from the out-of-line block: no loop of its own
    ])
    (f,) = sw.parse(lst)
    assert sorted(sw.loops(f)) == [(1, 4)]
    assert f.insns[2].text.startswith("@P1 BRA") and sw.successors(f)[2] == [6, 3]
    assert sw.successors(f)[6] == [7, 7] and sw.successors(f)[7] == [3]


def test_cp_async_and_its_commit_are_not_register_loads():
    sw = _tool()
    lst = _listing([
        ("MOV R1, RZ",),
        ("HMMA.16816.F32 R8, R12, R4, R8", 7, 1 << 1),
        ("LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64]",),
        ("LDGDEPBAR", 1),
        ("DEPBAR.LE SB1, 0x1",),
        ("LDG.E.128 R4, desc[UR4][R2.64]", 5),
        ("@P0 BRA 0x10",),
        ("EXIT",),
    ])
    (f,) = sw.parse(lst)
    assert [sw.is_global_load(x) for x in f.insns[2:6]] == [False, False, False, True]
    assert sw.loop_drains(f, sw.main_loop(f)) == []  # the cp.async count wait lets no register load through
