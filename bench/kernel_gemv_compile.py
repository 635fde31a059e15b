"""The decode GEMV's many-row tiles compiled for Hopper (sm_90a) on any machine, no GPU: what each launch
form of `_gemv_kernel` asks of an SM, before a device times them (`bench/gemv_batch.py`).

    python bench/kernel_gemv_compile.py --out DIR [--rows 8]

For Ouro-1.4B's four projections (q/k/v 6144 x 2048, o 2048 x 2048, gate/up 11264 x 2048, down 2048 x 5632)
at M rows, and every config of the tile table's many-row entry and `tiles.MANY_ROW_CANDIDATES`: the grid
(column blocks x K splits), K tiles per program, registers per thread and spills (Triton's ptxas), shared
memory, the MMA the products compile to (`wgmma` with the weight tile on the left, `mma.sync` m16 with x
first), and from those the programs one SM can hold (the least of shared memory, registers and the 32
block limit) and the weight bytes those programs have in flight at once (each program's pipeline depth of
weight tiles, at most its K tiles). Static facts only: speed is measured by `bench/gemv_batch.py` on a GPU.
Writes DIR/gemv_compile.md and .json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from gluon_compile import ptxas_report  # noqa: E402

from looptrace.engine.kernels.gemv import kernel as gemv_kernel  # noqa: E402
from looptrace.engine.kernels.gemv import tiles  # noqa: E402

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
SM_SHARED = 227 * 1024  # H100/H200: shared memory one SM gives its blocks
SM_REGISTERS = 65536
SM_BLOCKS = 32
SMS = 132
POINTERS = {"part_ptr": "*fp32", "ticket_ptr": "*i32"}


def compile_form(n: int, k: int, m: int, cfg: tiles.TileConfig) -> dict:
    """One launch form's static facts (see the module docstring)."""
    fn = gemv_kernel._gemv_kernel
    split, per_split = tiles.split_for(n, k, cfg)
    consts = dict(K=k, M=m, M_PAD=16 if cfg.dot else triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, K_TILES=per_split, SPLIT_K=split,
                  EVEN_K=k % cfg.block_k == 0 and split * per_split == triton.cdiv(k, cfg.block_k),
                  DOT=cfg.dot, PRECISION="tf32", PDL=False, PREFETCH=0, X_FORM=0, LANES=1, VECS=1, DESC=True,
                  CHUNK=1, PRELOAD=0, Y_FORM=0, NORM_N=1, X_FIRST=cfg.dot and cfg.x_first)  # fmt: skip
    signature = {}
    for p in fn.params:
        if p.name in consts:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = POINTERS.get(p.name, "*bf16")
        else:
            signature[p.name] = "fp32" if p.name in ("factor", "eps_y", "eps_n") else "i32"
    names = [p.name for p in fn.params]
    aligned = [a for a in names if a.endswith("_ptr") or a == "stride_wn"]  # as real launches specialize
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))  # fmt: skip
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    shared = compiled.metadata.shared
    threads = 32 * cfg.num_warps
    per_sm = min(SM_BLOCKS, SM_SHARED // max(shared, 1), SM_REGISTERS // (report["registers"] * threads))
    programs = triton.cdiv(n, cfg.block_n) * split
    tile_bytes = cfg.block_n * cfg.block_k * 2
    in_flight = min(per_sm, triton.cdiv(programs, SMS)) * min(cfg.num_stages, per_split) * tile_bytes
    mma = (
        "wgmma"
        if re.search(r"wgmma\.mma_async", ptx)
        else "mma.sync"
        if re.search(r"\bmma\.sync", ptx)
        else "fma"
    )
    return dict(config=asdict(cfg), split_k=split, k_tiles=per_split, programs=programs,
                shared_bytes=shared, programs_per_sm=per_sm, weight_bytes_in_flight_per_sm=in_flight, mma=mma,
                **report)  # fmt: skip


def form_text(cfg: dict) -> str:
    order = "x first" if cfg["x_first"] else "W first"
    return f"{cfg['block_n']}x{cfg['block_k']} w{cfg['num_warps']} st{cfg['num_stages']} {order}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    if not 2 <= args.rows <= tiles.MAX_ROWS:
        print(f"error: --rows {args.rows}: expected 2-{tiles.MAX_ROWS} (the many-row tiles)", file=sys.stderr)
        return 2
    rows = []
    for name, (n, k) in SHAPES.items():
        table = tiles.pick_config(args.rows, n, k)
        for cfg in (table, *(c for c in tiles.MANY_ROW_CANDIDATES if c != table)):
            rows.append(
                dict(
                    shape=name,
                    N=n,
                    K=k,
                    M=args.rows,
                    table=cfg is table,
                    **compile_form(n, k, args.rows, cfg),
                )
            )
            print(json.dumps({key: v for key, v in rows[-1].items() if key != "config"}), flush=True)
    command = "python bench/kernel_gemv_compile.py " + " ".join(sys.argv[1:])
    lines = [
        "# The GEMV's many-row tiles compiled for sm_90a (`bench/kernel_gemv_compile.py`)",
        "",
        f"`{command}`; triton {triton.__version__}, no GPU. M = {args.rows}. Per SM: programs it can hold "
        f"(shared memory {SM_SHARED // 1024} KB, {SM_REGISTERS} registers, {SM_BLOCKS} blocks) and the "
        f"weight bytes they have in flight (pipeline stages x tile, at most the K tiles; {SMS} SMs).",
        "",
        "| shape | form | split | K tiles | programs | regs | spill B | shared KB | per SM "
        "| KB in flight / SM | MMA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        form = form_text(r["config"]) + (" (table)" if r["table"] else "")
        lines.append(
            f"| {r['shape']} | {form} | {r['split_k']} | {r['k_tiles']} | {r['programs']} | "
            f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.0f} | "
            f"{r['programs_per_sm']} | "
            f"{r['weight_bytes_in_flight_per_sm'] / 1024:.0f} | {r['mma']} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_compile.md").write_text("\n".join(lines) + "\n")
    (args.out / "gemv_compile.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
