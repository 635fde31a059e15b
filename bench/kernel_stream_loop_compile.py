"""The one-row TMA-ring loop kernel (`kernels/stream_loop.py`) compiled for Hopper (sm_90a) on any machine, no
GPU needed: registers per thread, spill bytes and shared memory for each ring size and warp count.

    python bench/kernel_stream_loop_compile.py --out DIR [--forms 16:4:ws,10:4:ws,10:4]

A form is SLOTS:WARPS[:ws][:kvN][:ll] (ws: the warp-specialized ring, `loop_streamed`'s default; kvN: the
attention's first N key blocks in shared memory, 2 when not given; ll: values handed over as tagged words
instead of through grid barriers). Ouro-1.4B's shapes
(hidden 2048, intermediate 5632, 16 heads of 128, pages of 16).
Writes DIR/stream_loop_compile.md and .json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from gluon_compile import compile_sm90, tile_descriptor  # noqa: E402

from looptrace.engine.kernels import stream_loop as sl  # noqa: E402

SHAPES = dict(H=2048, INTER=5632, HQ=16, HK=16, D=128, PAGE=16, BK=sl.BLOCK_K, SPLIT=64, XROWS=32)
POINTER_TYPES = {"part_ptr": "*fp32", "ticket_ptr": "*i32", "bar_ptr": "*i32", "times_ptr": "*i64",
                 "went_ptr": "*i64", "woff_ptr": "*i64", "tab_ptr": "*i64", "ctx_ptr": "*i64",
                 "link_ptr": "*i32", "lpart_ptr": "*i64"}  # fmt: skip
DESCRIPTORS = ("d_qkv", "d_o", "d_gu", "d_down")


def compile_form(slots: int, warps: int, ws: bool = False, **options) -> dict:
    """One form's registers, spills and shared memory; `options`: other constexprs of the kernel (KV_BLOCKS,
    TIMED, ...), the rest at their defaults, as `loop_streamed` passes them."""
    fn = sl._stream_kernel
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.name not in SHAPES}
    constexprs = dict(SHAPES, **{k: v for k, v in defaults.items() if v is not inspect.Parameter.empty})
    constexprs.update(SLOTS=slots, WARPS=warps, WS=ws, **options)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in DESCRIPTORS:
            signature[name] = tile_descriptor(sl.BOX_ROWS, sl.BLOCK_K)
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in ("eps", "qk_scale") else "i32"
    flags = [f for f, on in (("ws", ws), ("ll", options.get("LINKED"))) if on]
    form = ":".join([str(slots), str(warps), *flags])
    # pointers and cache strides: multiples of 16 at Ouro's shapes, as the launch specializes them
    aligned = tuple(n for n in signature if n.endswith("_ptr") or n.startswith("stride_"))
    compiled = compile_sm90(fn, signature, constexprs, warps, fp_fusion=False, aligned=aligned)
    return dict(form=form, key_blocks=constexprs["KV_BLOCKS"], **compiled)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--forms", default="16:4:ws,10:4:ws,10:4")
    args = ap.parse_args()
    rows = []
    for item in args.forms.split(","):
        slots, warps, *flags = item.split(":")
        kv = [f for f in flags if f.startswith("kv") and f[2:].isdigit()]
        if set(flags) - {"ws", "ll", *kv} or not (slots.isdigit() and warps.isdigit()):
            print(f"error: --forms entry {item!r}: expected SLOTS:WARPS[:ws][:kvN][:ll], e.g. 16:4:ws",
                  file=sys.stderr)  # fmt: skip
            return 2
        options = dict(KV_BLOCKS=int(kv[-1][2:])) if kv else {}
        if "ll" in flags:
            options["LINKED"] = True
        rows.append(compile_form(int(slots), int(warps), "ws" in flags, **options))
    command = "python bench/kernel_stream_loop_compile.py " + " ".join(sys.argv[1:])
    lines = [f"`{command}` (sm_90a, compiled on the CPU; triton {triton.__version__})", "",
             "| SLOTS:WARPS[:flags] | key blocks in shared memory | registers | spills (B) | shared bytes |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r['form']} | {r['key_blocks']} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} |"
        for r in rows
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(command=command, forms=rows)
    (args.out / "stream_loop_compile.json").write_text(json.dumps(report, indent=1))
    (args.out / "stream_loop_compile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
