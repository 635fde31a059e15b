"""Exact fused kernels (ExactLoop R0): RMSNorm, RoPE, SiLU·mul in Triton with rounding fences.

Each function has the signature and result of the engine's eager op, bit for bit on CUDA (see
`tests/engine/test_gpu_kernels.py`, `bench/results/h200/kernels/`), and falls back to the eager math for
inputs it does not handle (CPU tensors, other dtypes). Triton is imported lazily, on the first call:
importing this package (or `looptrace.engine`) never imports Triton.

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str = "auto") -> torch.Tensor:
    """`layers.RMSNorm.forward`: `(x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight`."""
    from looptrace.engine.kernels import rmsnorm

    return rmsnorm.rms_norm(x, weight, eps, form)


def residual_rms_norm(y, w_post, eps_post: float, residual, w_next, eps_next: float):
    """`h = residual + rms_norm(y, w_post); return h, rms_norm(h, w_next)` in one launch (Ouro's post-norm,
    residual add and next pre-norm), bit for bit (`rmsnorm.residual_rms_norm`)."""
    from looptrace.engine.kernels import rmsnorm

    return rmsnorm.residual_rms_norm(y, w_post, eps_post, residual, w_next, eps_next)


def rope_half_write_kv(q, k, v, cos, sin, k_cache, v_cache, write_entry, write_offset, layer_id: int):
    """`rope_half` of q and k, then `write_kv` of the rotated k and v, one launch; returns the rotated q."""
    from looptrace.engine.kernels import rope

    return rope.rope_half_write_kv(q, k, v, cos, sin, k_cache, v_cache, write_entry, write_offset, layer_id)


def rope_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`layers.RotaryHalf.forward(q, k, cos, sin)` (Ouro, OLMo)."""
    from looptrace.engine.kernels import rope

    return rope.rope_half(q, k, cos, sin)


def rope_interleaved(q, k, cos, sin, qk_bias: torch.Tensor | None = None):
    """`layers.RotaryInterleaved.forward(q + qk_bias[0], k + qk_bias[1], cos, sin)` (Huginn)."""
    from looptrace.engine.kernels import rope

    return rope.rope_interleaved(q, k, cos, sin, qk_bias)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` (named apart from the submodule `silu_mul`, which would shadow it on import)."""
    from looptrace.engine.kernels.silu_mul import silu_mul

    return silu_mul(gate, up)


def silu_mul_fusable(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> bool:
    """`kernels.gemv_silu` applies: one routed bf16 row on CUDA (`gemv.silu_mul_fusable`)."""
    if not (gate.is_cuda and available()):
        return False
    from looptrace.engine.kernels import gemv

    return gemv.silu_mul_fusable(gate, up, weight)


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(gate, up) @ weight.T` as one GEMV launch, bit for bit (`gemv.silu_mul_linear`)."""
    from looptrace.engine.kernels import gemv

    return gemv.silu_mul_linear(gate, up, weight)


def residual_norm_fusable(y, residual, w_post, w_next, weight) -> bool:
    """`kernels.gemv_norm` applies: one routed bf16 row on CUDA (`gemv.residual_norm_fusable`)."""
    if not (y.is_cuda and available()):
        return False
    from looptrace.engine.kernels import gemv

    return gemv.residual_norm_fusable(y, residual, w_post, w_next, weight)


def residual_norm_linear(y, w_post, eps_post: float, residual, w_next, eps_next: float, weight):
    """`h, x = residual_rms_norm(...); return x @ weight.T, h` as one GEMV launch, bit for bit
    (`gemv.residual_norm_linear`)."""
    from looptrace.engine.kernels import gemv

    return gemv.residual_norm_linear(y, w_post, eps_post, residual, w_next, eps_next, weight)


def gate_up_silu_fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`kernels.gemv_silu_out` applies: one routed bf16 row on CUDA (`gemv.gate_up_silu_fusable`)."""
    if not (x.is_cuda and available()):
        return False
    from looptrace.engine.kernels import gemv

    return gemv.gate_up_silu_fusable(x, weight)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(*(x @ weight.T).chunk(2, -1))` as one GEMV launch, bit for bit (`gemv.gate_up_silu`)."""
    from looptrace.engine.kernels import gemv

    return gemv.gate_up_silu(x, weight)


def qkv_rope_fusable(x, weight, cos, sin, k_cache, v_cache, heads: tuple[int, int, int]) -> bool:
    """`kernels.gemv_rope_out` applies: one routed bf16 row on CUDA (`gemv_rope.qkv_rope_fusable`)."""
    if not (x.is_cuda and available()):
        return False
    from looptrace.engine.kernels import gemv_rope

    return gemv_rope.qkv_rope_fusable(x, weight, cos, sin, k_cache, v_cache, heads)


def qkv_rope_write(x, weight, cos, sin, k_cache, v_cache, write_entry, write_offset, layer_id: int, heads):
    """The q/k/v GEMV, then `rope_half_write_kv`, as one launch, bit for bit; returns the rotated q
    (`gemv_rope.qkv_rope_write`)."""
    from looptrace.engine.kernels import gemv_rope

    return gemv_rope.qkv_rope_write(
        x, weight, cos, sin, k_cache, v_cache, write_entry, write_offset, layer_id, heads
    )


def linear_norm_fusable(a, weight, residual, w_post, w_next) -> bool:
    """`kernels.gemv_norm_out` applies: one routed bf16 row on CUDA (`gemv.linear_norm_fusable`)."""
    if not (a.is_cuda and available()):
        return False
    from looptrace.engine.kernels import gemv

    return gemv.linear_norm_fusable(a, weight, residual, w_post, w_next)


def linear_residual_norm(a, weight, w_post, eps_post: float, residual, w_next, eps_next: float):
    """`residual_rms_norm(a @ weight.T, ...)` as one GEMV launch, bit for bit; returns (h, x)
    (`gemv.linear_residual_norm`)."""
    from looptrace.engine.kernels import gemv

    return gemv.linear_residual_norm(a, weight, w_post, eps_post, residual, w_next, eps_next)


def paged_attn(
    q, k_cache, v_cache, tables, ctx_lens, layer_id: int, scale: float, key_slots: bool = False
) -> torch.Tensor:
    """Triton paged attention over each row's own pages, one launch (`paged_attention.paged_attention`;
    `key_slots`: the per-key-slot form of the split, `kernels.attn_slots`).

    Named apart from the submodule `paged_attention`: importing it sets the package attribute of that name.
    """
    from looptrace.engine.kernels import paged_attention as pa

    return pa.paged_attention(q, k_cache, v_cache, tables, ctx_lens, layer_id, scale, key_slots=key_slots)


def packed_attn(q, k_cache, v_cache, tables, ctx_lens, blocks, layer_id: int, scale: float) -> torch.Tensor:
    """Triton packed prefill attention, one launch (`packed_attention.packed_attention`)."""
    from looptrace.engine.kernels import packed_attention as pk

    return pk.packed_attention(q, k_cache, v_cache, tables, ctx_lens, blocks, layer_id, scale)


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


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through the Triton GEMV where it applies and pays (`gemv.linear`: at most a few rows)."""
    from looptrace.engine.kernels import gemv

    return gemv.linear(x, weight, bias)


def apply_l2_prefetch(model: torch.nn.Module, device: torch.device | str) -> bool:
    """`kernels.l2_prefetch`: each projection captured in a CUDA graph first prefetches the next one's
    weight into L2 on a side stream (`l2_prefetch.apply_l2_prefetch`). Off CUDA or without Triton: False,
    the model untouched and Triton not imported."""
    if torch.device(device).type != "cuda" or not available():
        return False
    from looptrace.engine.kernels import l2_prefetch

    l2_prefetch.apply_l2_prefetch(model, device)
    return True


def join_prefetches() -> None:
    """Fold the prefetch side streams back into the capture stream (before a capture ends); a no-op
    unless `kernels.l2_prefetch` is in use (the module is then loaded)."""
    module = sys.modules.get("looptrace.engine.kernels.l2_prefetch")
    if module is not None:
        module.join_all()


def write_kv(k, v, k_cache, v_cache, write_entry, write_offset, layer_id: int) -> None:
    """K and V of every row into the paged cache, one launch (`paged_attention.write_kv`)."""
    from looptrace.engine.kernels import paged_attention as pa

    pa.write_kv(k, v, k_cache, v_cache, write_entry, write_offset, layer_id)


def calibrate(
    device: torch.device | str = "cuda", widths=(2048, 5280), rows=(1, 2, 4, 8, 16, 300), trials: int = 4
) -> dict:
    """Check the one-kernel RMSNorm mean order against this GPU's torch `mean` once (before any capture).

    Tries the torch-version default shuffle order, then the other one; keeps the first that matches on
    every (width, bucket) with random data of wide dynamic range; if none does, disables the one-kernel
    form (RMSNorm then uses the three-kernel form, exact by construction). Returns what it chose.
    """
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
    from looptrace.engine.kernels import reduce_order

    for spec in specs:
        h, d = spec["hidden"], spec["head_dim"]
        for m in spec.get("rows", (1, 2, 4, 8, 16, 512)):
            x = torch.zeros(m, h, dtype=torch.bfloat16, device=device)
            w = torch.ones(h, dtype=torch.bfloat16, device=device)
            rms_norm(x, w, 1e-6)
            residual_rms_norm(x, w, 1e-6, x, w, 1e-6)
            if not reduce_order.reduce_shape(m, h).one_kernel_ok:
                rms_norm(x, w, 1e-6, form="three")
            q = torch.zeros(m, spec["heads"], d, dtype=torch.bfloat16, device=device)
            k = torch.zeros(m, spec["kv_heads"], d, dtype=torch.bfloat16, device=device)
            if spec.get("rope", "half") == "half":
                c = torch.zeros(m, d, dtype=torch.bfloat16, device=device)
                rope_half(q, k, c, c)
            else:
                c = torch.zeros(m, d // 2, dtype=torch.float32, device=device)
                bias = None
                if spec.get("qk_bias"):
                    bias = torch.zeros(2, 1, spec["heads"], d, dtype=torch.bfloat16, device=device)
                rope_interleaved(q, k, c, c, bias)
            g = torch.zeros(m, spec["intermediate"], dtype=torch.bfloat16, device=device)
            silu_and_mul(g, g)
    torch.cuda.synchronize(device)


__all__ = [
    "EAGER_ROWS_THRESHOLD",
    "gemv_linear",
    "apply_l2_prefetch",
    "available",
    "calibrate",
    "gate_up_silu",
    "gate_up_silu_fusable",
    "graph_warmup",
    "is_capturing",
    "join_prefetches",
    "linear_norm_fusable",
    "linear_residual_norm",
    "paged_attn",
    "qkv_rope_fusable",
    "qkv_rope_write",
    "residual_norm_fusable",
    "residual_norm_linear",
    "residual_rms_norm",
    "rms_norm",
    "rope_half",
    "rope_half_write_kv",
    "rope_interleaved",
    "silu_and_mul",
    "silu_mul_fusable",
    "silu_mul_linear",
    "use_exact",
    "warmup",
    "write_kv",
]
