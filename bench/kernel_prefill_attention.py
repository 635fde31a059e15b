"""Attention kernel timings: the packed prefill kernel's query-block sizes, and decode beside SDPA.

    python bench/kernel_prefill_attention.py [--out DIR] [--budget-s SECONDS]

Times, with `triton.testing.do_bench` (median µs per launch, CUDA graph of 20 launches to leave out the
host), at the Ouro-1.4B (16 x 128) and Huginn-0125 (55 x 96) head shapes in bf16:

- decode: the per-row paged kernel (`kernels/paged_attention.py`) for R in {1, 8, 32, 64} rows at
  contexts {128, 640, 2112}; the torch path's SDPA on the gathered pages is timed beside it;
- prefill: one chunk of one request (128 rows whose first position is 0, 384 or 1920; 512 rows from 0, a
  Table 2 prompt), per-row kernel vs the packed kernel (`kernels/packed_attention.py`) with query blocks
  of 16, 32, 64 and 128 rows.

Writes `attention.json` and `attention.md` under --out (default: $OUT or .). Each shape is
timed once; the script stops starting new shapes after --budget-s seconds and says which it skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from looptrace.engine.kernel_checks import graph_time_us

BS = 16
SHAPES = {"ouro-1.4b": (16, 16, 128), "huginn-0125": (55, 55, 96)}
DECODE_ROWS = (1, 8, 32, 64)
DECODE_CTX = (128, 640, 2112)
PREFILL_CHUNKS = ((0, 128), (384, 128), (1920, 128), (0, 512))  # (first position, rows)
PACKED_BLOCKS = (16, 32, 64, 128)
DEVICE = "cuda"  # a smoke test may point it at the CPU (Triton interpreter)


def pool_and_tables(ctx_per_row: list[int], kv_heads: int, dim: int, gen: torch.Generator):
    """Two-layer pools with every row's pages scattered over distinct blocks; tables as entry bases."""
    pages = [math.ceil(c / BS) for c in ctx_per_row]
    blocks = sum(pages) + 4
    shape = (blocks * 2, BS, kv_heads, dim)
    k = torch.randn(shape, generator=gen, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen, device=DEVICE).to(torch.bfloat16)
    perm = torch.randperm(blocks, generator=gen, device=DEVICE) * 2
    width = max(pages)
    tables = torch.full((len(ctx_per_row), width), -1, dtype=torch.int64, device=DEVICE)
    used = 0
    for r, n in enumerate(pages):
        tables[r, :n] = perm[used : used + n]
        used += n
    return k, v, tables


def sdpa_gathered(q, k, v, tables, ctx, layer_id, scale):
    """The torch path's shape of work: gather every row's pages, SDPA with a length mask."""
    rows, heads, dim = q.shape
    entries = tables.clamp_min(0) + layer_id
    keys = k.index_select(0, entries.reshape(-1)).view(rows, -1, k.shape[2], dim)
    vals = v.index_select(0, entries.reshape(-1)).view(rows, -1, v.shape[2], dim)
    pos = torch.arange(keys.shape[1], device=q.device)
    mask = (pos[None, :] < ctx[:, None]).view(rows, 1, 1, -1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys.transpose(1, 2),
        vals.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != k.shape[2],
    )


def decode_case(model: str, rows: int, ctx_len: int, gen) -> dict:
    from looptrace.engine.kernels import paged_attention as pa

    heads, kv_heads, dim = SHAPES[model]
    k, v, tables = pool_and_tables([ctx_len] * rows, kv_heads, dim, gen)
    ctx = torch.full((rows,), ctx_len, dtype=torch.int64, device=DEVICE)
    q = torch.randn(rows, heads, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    scale = dim**-0.5
    return {
        "triton_per_row_us": graph_time_us(lambda: pa.paged_attention(q, k, v, tables, ctx, 1, scale)),
        "torch_sdpa_us": graph_time_us(lambda: sdpa_gathered(q, k, v, tables, ctx, 1, scale)),
    }


def prefill_case(model: str, start: int, chunk: int, gen) -> dict:
    from looptrace.engine import kernels as K
    from looptrace.engine.kernels import packed_attention as pk
    from looptrace.engine.kernels import paged_attention as pa

    heads, kv_heads, dim = SHAPES[model]
    last = start + chunk
    k, v, request_table = pool_and_tables([last], kv_heads, dim, gen)
    own = [math.ceil((p + 1) / BS) for p in range(start, last)]
    tables = request_table.expand(chunk, -1).clone()
    for r, n in enumerate(own):  # each row's table: the request's pages up to its own position
        tables[r, n:] = -1
    ctx = torch.arange(start + 1, last + 1, device=DEVICE)
    q = torch.randn(chunk, heads, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    scale = dim**-0.5
    per_row = pa.paged_attention(q, k, v, tables, ctx, 1, scale)
    out = {"triton_per_row_us": graph_time_us(lambda: pa.paged_attention(q, k, v, tables, ctx, 1, scale))}
    for bm in PACKED_BLOCKS:
        blocks = torch.from_numpy(K.packed_blocks([chunk], K.packed_block_count(chunk, 8, bm), bm)).to(DEVICE)
        packed = pk.packed_attention(q, k, v, tables, ctx, blocks, 1, scale, bm)
        out[f"packed{bm}_us"] = graph_time_us(
            lambda blocks=blocks, bm=bm: pk.packed_attention(q, k, v, tables, ctx, blocks, 1, scale, bm)
        )
        out[f"packed{bm}_max_abs"] = float((packed.float() - per_row.float()).abs().max())
    return out


def render(results: dict, device: str, versions: str, elapsed: float) -> str:
    lines = [
        "# Attention kernel timings",
        "",
        f"Device: {device}; {versions}. Command: `python bench/kernel_prefill_attention.py` "
        f"({elapsed:.0f} s). Median µs per launch, replayed from a CUDA graph of 20 launches "
        "(no host launch cost).",
        "",
        "## Decode (one query row per request)",
        "",
        "| model | rows | context | Triton per-row | torch gather + SDPA |",
        "|---|---|---|---|---|",
    ]
    for key, r in results["decode"].items():
        model, rows, ctx_len = key.split("|")
        cells = [_us(r, "triton_per_row_us"), _us(r, "torch_sdpa_us")]
        lines.append(f"| {model} | {rows} | {ctx_len} | " + " | ".join(cells) + " |")
    blocks = " | ".join(f"packed {bm} rows" for bm in PACKED_BLOCKS)
    lines += [
        "",
        "## Prefill (one chunk of one request; max abs difference from the per-row kernel in brackets)",
        "",
        f"| model | first position | rows | Triton per-row | {blocks} |",
        "|---|---|---|---|" + "---|" * len(PACKED_BLOCKS),
    ]
    for key, r in results["prefill"].items():
        model, start, chunk = key.split("|")
        cells = [_us(r, "triton_per_row_us")]
        cells += [
            f"{_us(r, f'packed{bm}_us')} [{r.get(f'packed{bm}_max_abs', 0):.1e}]" for bm in PACKED_BLOCKS
        ]
        lines.append(f"| {model} | {start} | {chunk} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _us(r: dict, key: str) -> str:
    return f"{r[key]:.1f}" if key in r else r.get("error", "-")


def run(budget_s: float) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    deadline = time.time() + budget_s
    results: dict = {"decode": {}, "prefill": {}}
    plan = [
        ("decode", f"{m}|{r}|{c}", lambda m=m, r=r, c=c: decode_case(m, r, c, gen))
        for m in SHAPES
        for r in DECODE_ROWS
        for c in DECODE_CTX
    ]
    plan += [
        ("prefill", f"{m}|{s}|{n}", lambda m=m, s=s, n=n: prefill_case(m, s, n, gen))
        for m in SHAPES
        for s, n in PREFILL_CHUNKS
    ]
    for section, key, case in plan:
        if time.time() > deadline:
            results[section][key] = {"error": "skipped: time budget"}
            continue
        try:
            results[section][key] = case()
        except Exception as e:  # record and keep going: one device call times everything it can
            results[section][key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        print(section, key, results[section][key], flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernel_prefill_attention.py: needs CUDA (no GPU found)", file=sys.stderr)
        return 2
    import triton

    t0 = time.time()
    results = run(args.budget_s)
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    out = Path(args.out)
    (out / "attention.json").write_text(
        json.dumps({"device": device, "versions": versions, **results}, indent=1)
    )
    (out / "attention.md").write_text(render(results, device, versions, time.time() - t0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
