"""Where the decode attention's time goes (issue #22): launch floors beside the kernel, and a target for ncu.

    python bench/attention_diag_h200.py floors [--out DIR]
    ncu --clock-control none --kernel-name _attn_kernel ... python bench/attention_diag_h200.py ncu

`floors` times, each as the median µs per launch from one CUDA graph of 20 launches
(`kernel_checks.graph_time_us`, as `decode_attention_h200.py` does):
- an empty Triton kernel with 1 and with 160 programs (what one graph node costs with no work),
- a kernel whose programs each load one int64 and store it (one dependent memory round trip),
- a kernel that chains N dependent loads (the page-table walk's shape: load, then load at that address),
- the split-KV attention at the issue's shapes, and the same with one segment per row (no partials, no
  ticket, no combine: `SplitConfig(max_segments=1)`), so the split's own cost is the difference.
Writes `attention_floors_h200.md` under --out (default: $OUT or .).

`ncu` runs the attention at each shape of `NCU_SHAPES` three times (the third launch of each shape is the
one to read: the first compiles), for ncu's SpeedOfLight / Occupancy / LaunchStats / WarpStateStats.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention_h200 import case_inputs, floor_us  # noqa: E402

from looptrace.engine.kernels._fences import triton  # noqa: E402

tl = triton.language

NCU_SHAPES = (
    ("ouro-1.4b", 1, 640),
    ("ouro-1.4b", 32, 640),
    ("huginn-0125", 32, 640),
    ("huginn-0125", 64, 2112),
)


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _one_load_kernel(x_ptr, y_ptr):
    pid = tl.program_id(0)
    tl.store(y_ptr + pid, tl.load(x_ptr + pid))


@triton.jit
def _chain_kernel(x_ptr, y_ptr, DEPTH: tl.constexpr):
    """DEPTH dependent loads: each address is the value the last load returned (x[i] = i: stays put)."""
    idx = tl.program_id(0).to(tl.int64)
    for _ in tl.static_range(DEPTH):
        idx = tl.load(x_ptr + idx)
    tl.store(y_ptr + tl.program_id(0), idx)


def floors(out_dir: Path) -> None:
    from looptrace.engine.kernel_checks import graph_time_us
    from looptrace.engine.kernels import paged_attention as pa

    x = torch.arange(4096, dtype=torch.int64, device="cuda")
    y = torch.empty_like(x)
    lines = ["| what | µs per launch |", "|---|---|"]

    def row(name: str, fn) -> None:
        fn()
        us = graph_time_us(fn)
        lines.append(f"| {name} | {us:.2f} |")
        print(lines[-1], flush=True)

    row("empty kernel, 1 program", lambda: _empty_kernel[(1,)](x))
    row("empty kernel, 160 programs", lambda: _empty_kernel[(160,)](x))
    row("one load + store, 160 programs", lambda: _one_load_kernel[(160,)](x, y))
    for depth in (2, 4, 8):
        row(f"{depth} dependent loads, 160 programs", lambda d=depth: _chain_kernel[(160,)](x, y, DEPTH=d))
    gen = torch.Generator(device="cuda").manual_seed(5)
    for model, rows, ctx in NCU_SHAPES:
        inputs = case_inputs(model, rows, ctx, gen)
        q, scale = inputs[0], inputs[-1]
        cfg = pa.split_for_head(q.shape[-1])
        one = pa.SplitConfig(block_n=cfg.block_n, max_segments=1, min_tiles=1, num_warps=cfg.num_warps)
        tag = f"{model} {rows}x{ctx} (floor {floor_us(model, rows, ctx, 4.28):.1f})"
        for name, c in (("split-KV", cfg), ("one segment", one)):
            row(f"{tag}: {name}", partial(pa.paged_attention, *inputs[:5], 1, scale, c))
    (out_dir / "attention_floors_h200.md").write_text(
        f"# Decode attention launch floors ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Triton {triton.__version__})\n\nCommand: `python bench/attention_diag_h200.py floors`. Median µs "
        "per launch, CUDA graph of 20 launches.\n\n" + "\n".join(lines) + "\n"
    )


def ncu_target() -> None:
    from looptrace.engine.kernels import paged_attention as pa

    gen = torch.Generator(device="cuda").manual_seed(5)
    for model, rows, ctx in NCU_SHAPES:
        q, k, v, tables, ctx_t, scale = case_inputs(model, rows, ctx, gen)
        for _ in range(3):
            pa.paged_attention(q, k, v, tables, ctx_t, 1, scale)
        torch.cuda.synchronize()
        print(model, rows, ctx, "segments", pa.segment_count(ctx, pa.split_for_head(q.shape[-1])), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("floors", "ncu"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    floors(args.out) if args.mode == "floors" else ncu_target()


if __name__ == "__main__":
    main()
