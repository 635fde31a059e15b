"""Decode attention against its byte floor: the split-KV kernel, optionally beside an older copy of it.

    python bench/kernel_decode_attention.py [--old FILE] [--out DIR] [--copy-tbps 4.28]

Times `kernels/paged_attention.py` (split-KV) and, with `--old`, a saved copy of the one-program-per-(row,
head) kernel it replaced (e.g. `git show 45c1321:looptrace/engine/kernels/paged_attention.py > old.py`),
interleaved shape by shape in the same process, at the Ouro-1.4B (16 x 128) and Huginn-0125 (55 x 96) head
shapes, bf16, rows {1, 8, 32, 64} x contexts {128, 640, 2112}. Median µs per launch from
`checks.graph_time_us` (a CUDA graph of 20 launches: no host launch cost). The byte floor is the K and V
bytes one launch must read (rows x ctx x kv_heads x head_dim x 2 tensors x 2 bytes) at the copy bandwidth
measured on the GPU (4.28 TB/s on the H200, bench/results/README.md); `bw %` = floor / time.
The max |new - old| of the outputs is reported too (another reduction order: not bitwise, both within
the float64 tests' bound).

Writes `decode_attention.json` and `.md` under --out (default: $OUT or .).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

BS = 16
SHAPES = {"ouro-1.4b": (16, 16, 128), "huginn-0125": (55, 55, 96)}
ROWS = (1, 8, 32, 64)
CONTEXTS = (128, 640, 2112)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("paged_attention_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses under `from __future__ import annotations` look it up
    spec.loader.exec_module(module)
    return module


def case_inputs(model: str, rows: int, ctx_len: int, gen: torch.Generator):
    heads, kv_heads, dim = SHAPES[model]
    pages = math.ceil(ctx_len / BS)
    blocks = rows * pages + 4
    shape = (blocks * 2, BS, kv_heads, dim)  # two layers per block: entries are base + layer
    k = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    perm = torch.randperm(blocks, generator=gen, device="cuda")[: rows * pages] * 2
    tables = perm.view(rows, pages).to(torch.int64)
    ctx = torch.full((rows,), ctx_len, dtype=torch.int64, device="cuda")
    q = torch.randn(rows, heads, dim, generator=gen, device="cuda").to(torch.bfloat16)
    return q, k, v, tables, ctx, dim**-0.5


def floor_us(model: str, rows: int, ctx_len: int, copy_tbps: float) -> float:
    _, kv_heads, dim = SHAPES[model]
    return rows * ctx_len * kv_heads * dim * 2 * 2 / (copy_tbps * 1e12) * 1e6


def time_case(arms: dict, model: str, rows: int, ctx_len: int, gen, copy_tbps: float) -> dict:
    from looptrace.engine.kernel_checks import graph_time_us

    q, k, v, tables, ctx, scale = case_inputs(model, rows, ctx_len, gen)
    row = {
        "model": model,
        "rows": rows,
        "ctx": ctx_len,
        "floor_us": floor_us(model, rows, ctx_len, copy_tbps),
    }
    outs = {}
    for _ in range(2):  # interleaved: new, old, new, old; the second round is kept
        for name, mod in arms.items():
            outs[name] = mod.paged_attention(q, k, v, tables, ctx, 1, scale)
            row[f"{name}_us"] = graph_time_us(
                lambda mod=mod: mod.paged_attention(q, k, v, tables, ctx, 1, scale)
            )
    row["segments"] = arms["new"].segment_count(ctx_len, arms["new"].split_for_head(SHAPES[model][2]))
    for name in arms:
        row[f"{name}_bw_pct"] = 100 * row["floor_us"] / row[f"{name}_us"]
    if "old" in arms:
        row["max_abs_new_old"] = float((outs["new"].float() - outs["old"].float()).abs().max())
    return row


def run(old, copy_tbps: float) -> list[dict]:
    from looptrace.engine.kernels import paged_attention as new

    gen = torch.Generator(device="cuda").manual_seed(5)
    arms = {"new": new} | ({"old": old} if old else {})
    results = []
    for model in SHAPES:
        for rows in ROWS:
            for ctx_len in CONTEXTS:
                results.append(time_case(arms, model, rows, ctx_len, gen, copy_tbps))
                print(json.dumps(results[-1]), flush=True)
    return results


SWEEP_SHAPES = (  # most telling first: a budget cut drops the tail
    ("ouro-1.4b", 1, 640),
    ("ouro-1.4b", 32, 640),
    ("huginn-0125", 64, 2112),
    ("ouro-1.4b", 64, 640),
    ("ouro-1.4b", 8, 640),
    ("ouro-1.4b", 1, 2112),
    ("huginn-0125", 1, 640),
    ("ouro-1.4b", 32, 2112),
    ("huginn-0125", 32, 2112),
    ("huginn-0125", 32, 640),
    ("ouro-1.4b", 1, 128),
)


def sweep_configs(kind: str = "splits"):
    """Tiles x warps x the shortest segment; num_stages stays 1 (the key loop's loads are gathers through
    the page table, which Triton's pipeliner leaves alone: stages 2 compiles to the same loads).
    kind "slots": the per-key-slot softmax (`key_slots`) at several tiles, warps and segment
    bounds, beside the plain form of the same split and Huginn's config."""
    from looptrace.engine.kernels.paged_attention import SPLIT_BY_HEAD_DIM, SplitConfig

    if kind == "slots":  # the plain form of the sweep's choice beside key-slot forms
        out = [SplitConfig(key_slots=False), SPLIT_BY_HEAD_DIM[96]]
        for block, warps, min_tiles, max_segs in ((32, 2, 2, 16), (32, 4, 2, 16), (16, 2, 2, 16),
                                                  (64, 4, 1, 16), (32, 4, 1, 16)):  # fmt: skip
            out.append(SplitConfig(block, max_segs, min_tiles, warps, key_slots=True))
        return out
    out = []
    for block, warps in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8), (256, 8)):
        for min_tiles in (1, 2, 4):
            if block * min_tiles <= 512:
                out.append(SplitConfig(block_n=block, num_warps=warps, min_tiles=min_tiles))
    out += [SplitConfig(block_n=64, max_segments=8), SplitConfig(block_n=128, max_segments=8)]
    return out


def sweep(copy_tbps: float, budget_s: float, kind: str = "splits") -> list[dict]:
    """Every split config at each SWEEP_SHAPES case, configs interleaved within a case; a config that
    fails to compile is recorded as such."""
    from looptrace.engine.kernel_checks import graph_time_us
    from looptrace.engine.kernels import paged_attention as pa

    gen = torch.Generator(device="cuda").manual_seed(5)
    t0, rows_out = time.time(), []
    configs = sweep_configs(kind)
    for model, rows, ctx_len in SWEEP_SHAPES:
        q, k, v, tables, ctx, scale = case_inputs(model, rows, ctx_len, gen)
        ref = pa.paged_attention(q, k, v, tables, ctx, 1, scale).float()
        for cfg in configs:
            if time.time() - t0 > budget_s:
                break
            row = {
                "model": model,
                "rows": rows,
                "ctx": ctx_len,
                "cfg": cfg.__dict__,
                "floor_us": floor_us(model, rows, ctx_len, copy_tbps),
            }
            try:
                out = pa.paged_attention(q, k, v, tables, ctx, 1, scale, cfg)
                row["max_abs_vs_default"] = float((out.float() - ref).abs().max())
                args = (q, k, v, tables, ctx, 1, scale, cfg)
                row["us"] = graph_time_us(lambda args=args: pa.paged_attention(*args))
            except Exception as exc:  # noqa: BLE001 - a config Triton cannot build is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows_out.append(row)
        print(f"swept {model} {rows}x{ctx_len} ({time.time() - t0:.0f} s)", flush=True)
    return rows_out


def render_sweep(rows: list[dict], header: str) -> str:
    """Per config: µs at each shape and the mean of time/floor over the shapes (lower is better)."""
    shapes = list(dict.fromkeys((r["model"], r["rows"], r["ctx"]) for r in rows))
    by_cfg: dict[str, dict] = {}
    for r in rows:
        c = r["cfg"]
        key = f"b{c['block_n']} w{c['num_warps']} min{c['min_tiles']} max{c['max_segments']}"
        key += " slots" if c.get("key_slots") else ""
        by_cfg.setdefault(key, {})[(r["model"], r["rows"], r["ctx"])] = r
    names = [f"{m.split('-')[0]} {n}x{c}" for m, n, c in shapes]
    lines = [
        header,
        "",
        "| config | " + " | ".join(names) + " | mean x floor |",
        "|---" * (len(names) + 2) + "|",
    ]
    scored = []
    for key, cells in by_cfg.items():
        ok = [cells[s] for s in shapes if s in cells and "us" in cells[s]]
        score = sum(c["us"] / c["floor_us"] for c in ok) / len(ok) if len(ok) == len(shapes) else float("inf")
        scored.append((score, key, cells))
    for score, key, cells in sorted(scored, key=lambda t: t[0]):
        vals = [f"{cells[s]['us']:.1f}" if s in cells and "us" in cells[s] else "err" for s in shapes]
        lines.append(f"| {key} | " + " | ".join(vals) + f" | {score:.2f} |")
    floors = [
        f"{next(r['floor_us'] for r in rows if (r['model'], r['rows'], r['ctx']) == s):.1f}" for s in shapes
    ]
    lines.append("| floor µs | " + " | ".join(floors) + " | 1 |")
    return "\n".join(lines) + "\n"


def render(results: list[dict], header: str) -> str:
    old = "old_us" in results[0]
    lines = [header, "", "| model | rows | ctx | segments | floor µs | split-KV µs | bw % |"
             + (" one-pass µs | bw % | max abs diff |" if old else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|---|" if old else "")]  # fmt: skip
    for r in results:
        cells = [r["model"], r["rows"], r["ctx"], r["segments"], f"{r['floor_us']:.2f}", f"{r['new_us']:.1f}",
                 f"{r['new_bw_pct']:.0f}"]  # fmt: skip
        if old:
            cells += [f"{r['old_us']:.1f}", f"{r['old_bw_pct']:.0f}", f"{r['max_abs_new_old']:.1e}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="a saved copy of the previous paged_attention.py to time beside")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--copy-tbps", type=float, default=4.28)
    parser.add_argument("--sweep", action="store_true", help="time every split config (SplitConfig) instead")
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--sweep-set", choices=("splits", "slots"), default="splits")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernel_decode_attention.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    import triton

    t0 = time.time()
    if args.sweep:
        rows = sweep(args.copy_tbps, args.budget_s, args.sweep_set)
        header = (
            f"# Decode attention split configs\n\nDevice: {torch.cuda.get_device_name()}; "
            f"torch {torch.__version__}, Triton {triton.__version__}. Command: "
            f"`python bench/kernel_decode_attention.py --sweep --sweep-set {args.sweep_set}` "
            f"({time.time() - t0:.0f} s). Median µs per "
            f"launch (CUDA graph of 20); floor = K+V bytes at {args.copy_tbps} TB/s."
        )
        stem = "attention_sweep" if args.sweep_set == "splits" else "attention_sweep_slots"
        (Path(args.out) / f"{stem}.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / f"{stem}.md").write_text(render_sweep(rows, header))
        return 0
    old = load_module(args.old) if args.old else None
    results = run(old, args.copy_tbps)
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    command = "python bench/kernel_decode_attention.py" + (" --old OLD.py" if old else "")
    header = (
        f"# Decode attention vs byte floor\n\nDevice: {device}; {versions}. Command: `{command}` "
        f"({time.time() - t0:.0f} s). Median µs per launch from a CUDA graph of 20 launches; "
        f"floor = K+V bytes at {args.copy_tbps} TB/s copy bandwidth."
    )
    out = Path(args.out)
    payload = {"device": device, "versions": versions, "command": command, "results": results}
    (out / "decode_attention.json").write_text(json.dumps(payload, indent=1))
    (out / "decode_attention.md").write_text(render(results, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
