"""The many-row decode GEMV inside the engine: a tile sweep at 8 rows, then `fast` against `fast` with
`kernels.gemv_batch` (2-8 row projections through the GEMV), paired in one process.

    python bench/gemv_batch.py [--out DIR] [--cell ouro:512/128@8] [--runs 3] [--shapes ouro_qkv,...]
                               [--cublas-shapes ouro_o,...] [--splits 1,2,4,8] [--a fast]
                               [--sweep-from gemv_batch_sweep.json]

Why both in one script: the tile table's many-row entry has never beaten cuBLAS alone
(bench/results/h200/kernels/*gemv_h200.md: 36-51 % of copy bandwidth at 8 rows), but a kernel alone is not a
kernel in the chain (under PDL the one-row GEMV lost alone and won in the token). So:

1. For Ouro-1.4B's four projection shapes at M = 8, time cuBLAS and every `tiles.MANY_ROW_CANDIDATES`
   config (`kernel_gemv.bench_shape`: a CUDA graph of 20 calls over weight copies beyond L2).
2. Put each shape's fastest config at the top of `tiles.TILE_TABLE` for 2-8 rows, in this process only
   (the committed table changes only after a measurement says so). On q/k/v and gate/up, the fastest of
   one K split: only then do the fused output forms (RoPE + K/V write, SiLU·mul) take the rows, each
   removing a launch that a faster split alone would still pay.
3. `looptrace bench --a fast --b fast --b-set kernels.gemv_batch=true` on the cell, in this process: arm A
   routes 2-8 rows to cuBLAS as `fast` does, arm B to the GEMV with the swept tiles, except the
   `--cublas-shapes` (`tiles.CUBLAS_MANY_ROWS`, this process only), which stay on cuBLAS in both arms.
   `--a exactloop --cell ouro:512/128@1,8,32` pairs arm B against exactloop instead: the figure `fast`
   would show with the setting on, before the table is committed.

`--sweep-from` reads an earlier sweep's gemv_batch_sweep.json instead of sweeping (a second call spends
its time on the bench; the report names the device the sweep ran on).

Writes DIR/gemv_batch.md (the sweep's winners against cuBLAS, then the paired bench's table),
DIR/gemv_batch_sweep.json and DIR/gemv_batch_bench.json. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_gemv import bench_shape, cfg_text  # noqa: E402

from looptrace.engine.kernels.gemv import tiles  # noqa: E402
from tests.engine.kernels.gemv.test_kernel import GPU_SHAPES  # noqa: E402

OURO_SHAPES = ("ouro_qkv", "ouro_o", "ouro_gate_up", "ouro_down")
# Shapes whose GEMV carries a fused output form at 2-8 rows, which runs only without a K split
FUSED_FORM_SHAPES = frozenset({"ouro_qkv", "ouro_gate_up"})


def sweep(shapes: list[str], rows: int, copy_tbps: float) -> list[dict]:
    """bench_shape's rows at M = rows over the many-row candidates (no budget cap)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name in shapes:
        n, k = GPU_SHAPES[name]
        out += bench_shape(name, n, k, (rows,), copy_tbps, float("inf"), gen, many_rows=True)
    return out


def engine_pick(row: dict) -> dict:
    """The candidate arm B runs for a swept shape: the fastest, or on a fused-form shape the fastest of one
    K split (the fastest overall where none has one split)."""
    candidates = row["candidates"]
    if row["shape"] in FUSED_FORM_SHAPES:
        candidates = [c for c in candidates if c["split_k"] == 1] or candidates
    return min(candidates, key=lambda c: c["us"])


def winners_first(results: list[dict]) -> list[tuple]:
    """Table entries `((N, N), (K, K), (2, MAX_ROWS), engine_pick's config)` for each swept shape."""
    entries = []
    for r in results:
        best = engine_pick(r)
        cfg = tiles.TileConfig(**best["config"])
        entries.append(((r["N"], r["N"]), (r["K"], r["K"]), (2, tiles.MAX_ROWS), cfg))
    return entries


# The settings arm A may run: `fast` as it is (does the setting pay?) or exactloop (what `fast` is judged by)
ARM_A_CHOICES = ("fast", "exactloop")


def paired_bench(cell: str, runs: int, out_json: Path, arm_a: str = "fast") -> int:
    """The CLI's paired bench, run in this process so it sees the swept table."""
    from looptrace.cli.main import app

    argv = ["bench", "--a", arm_a, "--b", "fast", "--b-set", "kernels.gemv_batch=true", "--cell", cell,
            "--runs", str(runs), "--set", "cuda_graphs.max_graphs=64", "-o", str(out_json)]  # fmt: skip
    try:
        app(argv, standalone_mode=False)
    except SystemExit as exc:  # Typer's exit codes (2: bad input, 130: interrupted)
        return int(exc.code or 0)
    return 0


def sweep_markdown(results: list[dict], copy_tbps: float) -> list[str]:
    lines = [
        f"Sweep at M = {results[0]['M']}: median µs per call (CUDA graph of 20, weights beyond L2); floor = "
        f"N*K*2 bytes at {copy_tbps} TB/s.",
        "",
        "| shape | floor µs | cuBLAS µs | table µs | best µs | best config | best / cuBLAS | arm B µs | "
        "arm B config |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        pick = engine_pick(r)
        lines.append(
            f"| {r['shape']} | {r['floor_us']:.2f} | {r['cublas_us']:.2f} | {r['table_us']:.2f} | "
            f"{r['best_us']:.2f} | {cfg_text(r['best'], r['best_split_k'])} | "
            f"{r['best_us'] / r['cublas_us']:.2f} | {pick['us']:.2f} | "
            f"{cfg_text(pick['config'], pick['split_k'])} |"
        )
    return lines


def choices(args: argparse.Namespace) -> tuple[list[str], list[str], tuple]:
    """(swept shapes, shapes left on cuBLAS, the candidates of the chosen splits); ValueError naming the
    flag and value where one is not known."""
    shapes = [s for s in args.shapes.split(",") if s]
    kept = [s for s in args.cublas_shapes.split(",") if s]
    for flag, names in (("--shapes", shapes), ("--cublas-shapes", kept)):
        unknown = [s for s in names if s not in GPU_SHAPES]
        if unknown:
            known = ", ".join(sorted(GPU_SHAPES))
            raise ValueError(f"{flag} {','.join(unknown)}: expected names from {known}")
    if not 2 <= args.rows <= tiles.MAX_ROWS:
        raise ValueError(f"--rows {args.rows}: expected 2-{tiles.MAX_ROWS}")
    known = sorted({c.split_k for c in tiles.MANY_ROW_CANDIDATES})
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    if not splits or any(not s.isdigit() or int(s) not in known for s in splits):
        raise ValueError(f"--splits {args.splits!r}: expected a comma list of {', '.join(map(str, known))}")
    candidates = tuple(c for c in tiles.MANY_ROW_CANDIDATES if str(c.split_k) in splits)
    if args.a not in ARM_A_CHOICES:
        raise ValueError(f"--a {args.a!r}: expected one of {', '.join(ARM_A_CHOICES)}")
    return shapes, kept, candidates


def read_sweep(path: Path, shapes: list[str]) -> tuple[str, list[dict]]:
    """(the device it ran on, its rows of `shapes`) from an earlier gemv_batch_sweep.json; ValueError naming
    the file where it cannot be read or lacks a shape."""
    try:
        data = json.loads(path.read_text())
        device, rows = data["device"], {r["shape"]: r for r in data["results"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--sweep-from {path}: expected a gemv_batch_sweep.json ({exc})") from None
    missing = [s for s in shapes if s not in rows]
    if missing:
        raise ValueError(f"--sweep-from {path}: no sweep of {', '.join(missing)} in it")
    return device, [rows[s] for s in shapes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--cell", default="ouro:512/128@8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="rows of the tile sweep (2-8)")
    parser.add_argument("--copy-tbps", type=float, default=4.28)
    parser.add_argument("--shapes", default=",".join(OURO_SHAPES))
    parser.add_argument("--cublas-shapes", default="", help="shapes whose 2-8 rows arm B leaves on cuBLAS")
    parser.add_argument("--splits", default="1,2,4,8", help="the candidates' K splits to sweep")
    parser.add_argument("--a", default="fast", help=f"arm A's settings ({', '.join(ARM_A_CHOICES)})")
    parser.add_argument("--sweep-from", type=Path, help="an earlier gemv_batch_sweep.json, not sweeping")
    args = parser.parse_args()
    try:
        shapes, kept, candidates = choices(args)
        earlier = read_sweep(args.sweep_from, shapes) if args.sweep_from else None
    except ValueError as exc:
        print(f"bench/gemv_batch.py: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/gemv_batch.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    tiles.MANY_ROW_CANDIDATES = candidates  # this process only: the sweep reads it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if earlier:
        sweep_device, results = earlier
    else:
        sweep_device, results = torch.cuda.get_device_name(), sweep(shapes, args.rows, args.copy_tbps)
        record = {"device": sweep_device, "torch": torch.__version__, "results": results}
        (out / "gemv_batch_sweep.json").write_text(json.dumps(record, indent=1))
    entries = winners_first(results)
    tiles.TILE_TABLE = (*entries, *tiles.TILE_TABLE)  # this process only: the bench's arm B reads it
    tiles.CUBLAS_MANY_ROWS = frozenset(GPU_SHAPES[s] for s in kept)
    print("swept table entries:", [(e[0][0], e[1][0], asdict(e[3])) for e in entries], flush=True)
    rc = paired_bench(args.cell, args.runs, out / "gemv_batch_bench.json", args.a)
    lines = [
        "# The many-row GEMV in the engine (`bench/gemv_batch.py`)",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}. "
        f"Wall {time.monotonic() - start:.0f} s.",
        "",
        f"Sweep: {f'read from {args.sweep_from} (run on {sweep_device})' if earlier else 'run here'}.",
        "",
        *sweep_markdown(results, args.copy_tbps),
        "",
        "The winners as `tiles.TILE_TABLE` entries (what arm B ran):",
        "",
        "```python",
        *(f"    (({e[0][0]}, {e[0][1]}), ({e[1][0]}, {e[1][1]}), (2, MAX_ROWS), {e[3]!r})," for e in entries),
        "```",
        "",
        f"Shapes arm B left on cuBLAS at 2-8 rows (`tiles.CUBLAS_MANY_ROWS`): {', '.join(kept) or 'none'}.",
        "",
        f"Paired bench (exit code {rc}): `looptrace bench --a {args.a} --b fast "
        "--b-set kernels.gemv_batch=true "
        f"--cell {args.cell} --runs {args.runs} --set cuda_graphs.max_graphs=64`, arm B with the winners "
        "above; "
        "its table: `looptrace bench --from gemv_batch_bench.json`.",
    ]
    (out / "gemv_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
