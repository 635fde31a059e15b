"""The engine's Triton kernels, one file per kernel; this package's own module holds only what decides
*whether* a kernel runs and what readies them all, never a kernel or a forwarder to one.

Kernel modules (each imports Triton: a caller imports the one it uses inside the function that launches
it, so importing this package, or `looptrace.engine`, never imports Triton): `rmsnorm`, `rope`,
`silu_mul` (exact single ops and fused tails, ExactLoop R0), `paged_attention`, `packed_attention`,
`gemv` (kernel, tiles and forms), `gemv_rope`, `l2_prefetch`. Shared device code lives in
`device_helpers` (rounding fences, PDL preamble); host-side leaves: `constants`, `scratch`,
`reduce_order`, `launch_mode`, `registry` (which setting installs which kernel, needing what).

Each exact kernel has the signature and result of the engine's eager op, bit for bit on CUDA (see
`tests/engine/kernels/`, `bench/results/h200/kernels/`), and falls back to the eager math for
inputs it does not handle (CPU tensors, other dtypes).

Policy (exactness.md §5): use the kernels only while a CUDA graph is being captured or for eager calls over
256 rows; `use_exact(rows, capturing)` says which. Eager launches of Triton kernels cost more host time
than the eager kernels they replace at small row counts.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch

from looptrace.engine.kernels.constants import EAGER_ROWS_THRESHOLD, PACKED_BLOCK_ROWS

_graph_warmup = False  # set while a CUDA graph's eager warm-up runs (see graph_warmup)


def use_exact(rows: int, capturing: bool) -> bool:
    """True inside CUDA-graph capture (and its warm-ups), or for an eager call over 256 rows."""
    return capturing or _graph_warmup or rows > EAGER_ROWS_THRESHOLD


@contextmanager
def graph_warmup() -> Iterator[None]:
    """The eager warm-ups before a capture take the capture's code path, so every Triton kernel the graph
    will hold is compiled and loaded there, with the graph's own shapes, strides and alignments. A kernel
    first compiled inside the capture fails it ("operation not permitted when stream is capturing")."""
    global _graph_warmup
    previous, _graph_warmup = _graph_warmup, True
    try:
        yield
    finally:
        _graph_warmup = previous


def is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@lru_cache(maxsize=1)
def available() -> bool:
    """CUDA present and Triton importable (checked without importing it)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def packed_block_count(rows: int, max_spans: int, block_rows: int = PACKED_BLOCK_ROWS) -> int:
    """Blocks the packed kernel's grid holds for `rows` prefill rows split into at most `max_spans`
    requests (a fixed count per row count, so a CUDA graph keyed by rows fits every split)."""
    return min(rows, -(-rows // block_rows) + max(max_spans, 1) - 1)


def packed_blocks(lengths: list[int], count: int, block_rows: int = PACKED_BLOCK_ROWS) -> np.ndarray:
    """[count, 2] int64 (first row, rows): each request's consecutive rows cut into blocks of at most
    `block_rows`, in row order, then (0, 0) padding blocks up to `count`."""
    out = np.zeros((count, 2), dtype=np.int64)
    b, first = 0, 0
    for length in lengths:
        for start in range(0, length, block_rows):
            if b >= count:
                raise ValueError(f"{len(lengths)} spans of {sum(lengths)} rows need more than {count} blocks")
            out[b] = (first + start, min(block_rows, length - start))
            b += 1
        first += length
    return out


def join_prefetches() -> None:
    """Fold the prefetch side streams back into the capture stream (before a capture ends); a no-op
    unless `kernels.l2_prefetch` is in use (the module is then loaded)."""
    module = sys.modules.get("looptrace.engine.kernels.l2_prefetch")
    if module is not None:
        module.join_all()


def calibrate(
    device: torch.device | str = "cuda", widths=(2048, 5280), rows=(1, 2, 4, 8, 16, 300), trials: int = 4
) -> dict:
    """Check the one-kernel RMSNorm mean order against this GPU's torch `mean` once (before any capture).

    Tries the torch-version default shuffle order, then the other one; keeps the first that matches on
    every (width, bucket) with random data of wide dynamic range; if none does, disables the one-kernel
    form (RMSNorm then uses the three-kernel form, exact by construction). Returns what it chose.
    """
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels import reduce_order, rmsnorm

    gen = torch.Generator(device=device).manual_seed(1234)
    first = reduce_order.default_shuffle_order()
    for order in (first, "asc" if first == "desc" else "desc"):
        ok = True
        for n in widths:
            for m in rows:
                if not reduce_order.reduce_shape(m, n).one_kernel_ok:
                    continue
                for _ in range(trials):
                    x = torch.randn(m, n, generator=gen, device=device) * torch.exp2(
                        torch.randint(-12, 12, (m, n), generator=gen, device=device).float()
                    )
                    x = x.bfloat16()
                    w = torch.ones(n, dtype=torch.bfloat16, device=device)
                    mean = torch.empty(m, dtype=torch.float32, device=device)
                    rmsnorm.rms_norm_fused(x, w, 1e-6, order=order, mean_out=mean)
                    ok = ok and torch.equal(mean, x.float().pow(2).mean(-1))
                if not ok:
                    break
            if not ok:
                break
        if ok:
            rmsnorm.set_order(order, one_kernel=True)
            return {"order": order, "one_kernel": True}
    rmsnorm.set_order(None, one_kernel=False)
    return {"order": None, "one_kernel": False}


def warmup(device: torch.device | str = "cuda", specs=()) -> None:
    """Compile every kernel variant the given shapes need, outside graph capture.

    specs: iterable of dicts with keys `hidden`, `heads`, `kv_heads`, `head_dim`, `intermediate`,
    `rope` ('half' | 'interleaved'), `qk_bias` (bool), `rows` (iterable of row counts to cover).
    """
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels import reduce_order, rmsnorm, rope, silu_mul

    for spec in specs:
        h, d = spec["hidden"], spec["head_dim"]
        for m in spec.get("rows", (1, 2, 4, 8, 16, 512)):
            x = torch.zeros(m, h, dtype=torch.bfloat16, device=device)
            w = torch.ones(h, dtype=torch.bfloat16, device=device)
            rmsnorm.rms_norm(x, w, 1e-6)
            rmsnorm.residual_rms_norm(x, w, 1e-6, x, w, 1e-6)
            if not reduce_order.reduce_shape(m, h).one_kernel_ok:
                rmsnorm.rms_norm(x, w, 1e-6, form="three")
            q = torch.zeros(m, spec["heads"], d, dtype=torch.bfloat16, device=device)
            k = torch.zeros(m, spec["kv_heads"], d, dtype=torch.bfloat16, device=device)
            if spec.get("rope", "half") == "half":
                c = torch.zeros(m, d, dtype=torch.bfloat16, device=device)
                rope.rope_half(q, k, c, c)
            else:
                c = torch.zeros(m, d // 2, dtype=torch.float32, device=device)
                bias = None
                if spec.get("qk_bias"):
                    bias = torch.zeros(2, 1, spec["heads"], d, dtype=torch.bfloat16, device=device)
                rope.rope_interleaved(q, k, c, c, bias)
            g = torch.zeros(m, spec["intermediate"], dtype=torch.bfloat16, device=device)
            silu_mul.silu_mul(g, g)
    torch.cuda.synchronize(device)


__all__ = [
    "available",
    "calibrate",
    "EAGER_ROWS_THRESHOLD",
    "graph_warmup",
    "is_capturing",
    "join_prefetches",
    "packed_block_count",
    "PACKED_BLOCK_ROWS",
    "packed_blocks",
    "use_exact",
    "warmup",
]
