"""The persistent Ouro loop kernel (`kernels/persistent_loop.py`) compiled for Hopper (sm_90a) on any
machine, no GPU needed: what `ptxas` gives each launch form (registers per thread, spill bytes) and what
the SASS holds (instructions, CTA barriers, warp shuffles, shared-memory stores). A register count at the
255 cap with spills, or a barrier count that grows with the rows, shows where a launch shape costs before
any device time is spent on timing it.

    python bench/kernel_persistent_loop_compile.py --out DIR [--rows 1,4,8] [--lookahead 1,2,3]
        [--warps 8] [--staged-rows 1,8] [--joint 0,1] [--dump DIR]

Forms: the persistent launch (`STAGE = -1`) at each rows x lookahead x warps, and each stage of the staged
twin (q/k/v, attention, o, gate/up, down, final norm) at `--staged-rows` with lookahead 2. Ouro-1.4B's
shapes (hidden 2048, intermediate 5632, 16 heads of 128, pages of 16), K tiles of 2048, 64 keys per split.
Writes DIR/persistent_loop_compile.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from looptrace.engine.kernels import persistent_loop as pl  # noqa: E402

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHAPES = dict(H=2048, BH=2048, INTER=5632, HQ=16, HK=16, D=128, PAGE=16, BK=2048, SPLIT=64)
# pointer arguments that are not bf16 (every other `*_ptr` is)
POINTER_TYPES = {"part_ptr": "*fp32", "ticket_ptr": "*i32", "bar_ptr": "*i32", "went_ptr": "*i64",
                 "woff_ptr": "*i64", "tab_ptr": "*i64", "ctx_ptr": "*i64"}  # fmt: skip
STAGE_NAMES = {0: "q/k/v", 1: "attention", 2: "o", 3: "gate/up", 4: "down", 5: "final norm"}
SASS_COUNTS = {"BAR.SYNC": r"\bBAR\.SYNC\b", "SHFL": r"\bSHFL\.", "STS": r"\bSTS\b", "LDG": r"\bLDG\."}


def compile_form(
    stage: int, rows_pad: int, lookahead: int, warps: int, joint: bool = False, dump: Path | None = None
) -> dict:
    """Compile one launch form to PTX with Triton, then to a cubin with Triton's own ptxas."""
    fn = pl._loop_kernel
    constexprs = dict(SHAPES, RP=rows_pad, STAGE=stage, LOOK=lookahead, JOINT=joint, PDL=True)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in ("eps", "qk_scale") else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    start = time.time()
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1)
    )
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([NVIDIA_BIN / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin],
                                capture_output=True, text=True, check=True)  # fmt: skip
        sass = subprocess.run([NVIDIA_BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    if dump is not None:  # the code itself, to read (which registers a loop waits on, where)
        stem = f"stage{stage}_rows{rows_pad}_look{lookahead}_warps{warps}" + ("_joint" if joint else "")
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{stem}.ttgir").write_text(kernel.asm["ttgir"])
        (dump / f"{stem}.sass").write_text(sass)
    text = report.stdout + report.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    instructions = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    return {
        "registers": registers,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "spill_load_bytes": int(spills.group(2)) if spills else 0,
        "sass_instructions": len(instructions),
        **{
            name: sum(bool(re.search(pat, line)) for line in instructions)
            for name, pat in SASS_COUNTS.items()
        },
        "tile_load_overlap": tile_load_overlap(sass),
        "compile_s": round(time.time() - start, 1),
    }


def tile_load_overlap(sass: str) -> int | None:
    """Median, over the weight-tile loads (`LDG.E.EF.128`: evict-first), of the floating-point instructions
    between a load and the first instruction that reads its registers, following the code as laid out and
    its unconditional branches. A load is in flight until something reads it, so ~0 means the load is
    waited on at once (nothing overlaps it) and a tile's worth of FMAs means it overlaps a compute step.
    A static reading, not a timing."""
    code: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending_label = None
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending_label = label.group(1)
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if ins:
            if pending_label:
                labels[pending_label] = len(code)
                pending_label = None
            code.append((int(ins.group(1), 16), ins.group(2)))

    def registers(text: str) -> set[int]:
        found = set()
        for m in re.finditer(r"\bR(\d+)(\.64)?\b", text):
            found |= {int(m.group(1)), int(m.group(1)) + 1} if m.group(2) else {int(m.group(1))}
        return found

    overlaps = []
    for i, (_addr, text) in enumerate(code):
        load = re.match(r"(@!?P\d\s+)?LDG\.E\.EF\.128\s+R(\d+),", text)
        if not load:
            continue
        dst = set(range(int(load.group(2)), int(load.group(2)) + 4))
        j, fp, steps = i + 1, 0, 0
        while j < len(code) and steps < 5000:
            body = re.sub(r"^@!?P\d\s+", "", code[j][1])
            op, _, operands = body.partition(" ")
            first, _, rest = operands.partition(",")
            if dst & registers(rest) or (op.startswith(("ST", "RED", "ATOM")) and dst & registers(operands)):
                break
            if dst & registers(first):  # overwritten unread
                break
            fp += op.split(".")[0] in ("FFMA", "FMUL", "FADD")
            branch = re.match(r"BRA\s+`?\(?(\.L_x_\d+)", code[j][1])  # unconditional only
            j = labels[branch.group(1)] if branch and branch.group(1) in labels else j + 1
            steps += 1
        overlaps.append(fp)
    return sorted(overlaps)[len(overlaps) // 2] if overlaps else None


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--rows", type=ints, default=[1, 4, 8])
    ap.add_argument("--lookahead", type=ints, default=[1, 2, 3])
    ap.add_argument("--warps", type=ints, default=[8])
    ap.add_argument("--staged-rows", type=ints, default=[1, 8])
    ap.add_argument(
        "--joint", type=ints, default=[0], help="joint_rows: 0 (one reduction per row), 1, or 0,1"
    )
    ap.add_argument("--dump", type=Path, default=None, help="also write each form's TTGIR and SASS here")
    args = ap.parse_args()
    if any(r not in (1, 2, 4, 8) for r in args.rows + args.staged_rows):
        print(
            "bench/kernel_persistent_loop_compile.py: --rows/--staged-rows take 1, 2, 4 or 8", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    forms = [
        ("persistent", -1, r, look, w, bool(j))
        for r in args.rows
        for look in args.lookahead
        for w in args.warps
        for j in args.joint
    ]
    forms += [(f"staged {STAGE_NAMES[s]}", s, r, 2, 8, False) for r in args.staged_rows for s in STAGE_NAMES]
    results = []
    for name, stage, rows, look, warps, joint in forms:
        res = {"form": name + (" joint rows" if joint else ""), "stage": stage, "rows": rows,
               "lookahead": look, "warps": warps, "joint_rows": joint,
               **compile_form(stage, rows, look, warps, joint, args.dump)}  # fmt: skip
        print(json.dumps(res), flush=True)
        results.append(res)
    lines = [
        "# The persistent Ouro loop kernel compiled for sm_90a (no GPU: Triton to PTX, Triton's ptxas)",
        "",
        f"Triton {triton.__version__}; Ouro-1.4B shapes {SHAPES}; PDL on. Registers per thread (255 is the "
        "cap at 8 warps, one program per SM), spill bytes, and SASS counts of the whole kernel. Tile-load "
        "overlap: the median count of floating-point instructions between a weight-tile load and the first "
        "instruction that reads it (0: waited on at once; `tile_load_overlap`).",
        "",
        "| form | rows | lookahead | warps | registers | spill st/ld B | SASS | BAR.SYNC | SHFL | STS | LDG "
        "| tile-load overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['form']} | {r['rows']} | {r['lookahead']} | {r['warps']} | {r['registers']} | "
            f"{r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['sass_instructions']} | "
            f"{r['BAR.SYNC']} | {r['SHFL']} | {r['STS']} | {r['LDG']} | {r['tile_load_overlap']} |"
        )
    (args.out / "persistent_loop_compile.md").write_text("\n".join(lines) + "\n")
    (args.out / "persistent_loop_compile.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
