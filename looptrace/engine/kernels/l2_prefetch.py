"""Pull a weight into the GPU's L2 ahead of the kernel that reads it (Hopper `cp.async.bulk.prefetch.L2`).

Why: at decode batch 1 the token is a chain of dependent kernels. The projections stream their weights
from DRAM at 30-75 % of copy bandwidth (a few µs of ramp-up per launch), while the kernels between them
(norms, RoPE, attention) leave DRAM almost idle. A prefetch launched on a side stream while kernel i runs
brings projection i+1's weight into L2 (50 MB on the H200), so that GEMM reads it from L2 instead.

It moves bytes, never values: the GEMM that follows reads the same weight and computes the same thing
(no arithmetic changes, R0). The kernel writes nothing: every lane issues one bulk prefetch of `CHUNK`
bytes (`BULK`), or one `prefetch.global.L2::evict_last` of a 128-byte line; both are hints the memory
system may drop. Importing this module imports Triton.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from looptrace.engine.kernels.device_helpers import triton

tl = triton.language

BULK_ASM = tl.constexpr("""{
 .reg .pred p;
 setp.ne.b32 p, $3, 0;
 @p cp.async.bulk.prefetch.L2.global [$1], $2;
 mov.u32 $0, 0;
}""")
_LINE_ASM = tl.constexpr("""{
 .reg .pred p;
 setp.ne.b32 p, $3, 0;
 @p prefetch.global.L2::evict_last [$1];
 mov.u32 $0, $2;
}""")


@triton.jit(do_not_specialize=["base", "nbytes", "chunks"])
def _prefetch_kernel(base, nbytes, chunks, CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr):
    """Bytes `base .. base + nbytes - 1` as `chunks` chunks of CHUNK bytes, dealt to the programs in turn."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    for first in range(0, chunks, tl.num_programs(0) * LANES):
        chunk = first + lane
        offset = chunk.to(tl.int64) * CHUNK
        live = (chunk < chunks).to(tl.int32)
        size = tl.minimum(nbytes - offset, CHUNK).to(tl.int32)  # the tail: a multiple of 16 as well
        if BULK:
            tl.inline_asm_elementwise(BULK_ASM, "=r,l,r,r", [base + offset, size, live], dtype=tl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
        else:
            tl.inline_asm_elementwise(_LINE_ASM, "=r,l,r,r", [base + offset, size, live], dtype=tl.int32,
                                      is_pure=False, pack=1)  # fmt: skip


def prefetch_l2(t: torch.Tensor, programs: int = 8, chunk: int = 32768, lanes: int = 32, bulk: bool = True):
    """Ask for `t`'s bytes in L2 on the current stream (returns at once; the kernel only issues hints).

    `t` must be contiguous and a whole number of 16-byte units (every bf16 weight with a dimension that
    is a multiple of 8). `bulk=False`: one 128-byte line per lane (`chunk` is then 128)."""
    nbytes = t.numel() * t.element_size()
    if not t.is_cuda or not t.is_contiguous() or nbytes % 16 or t.data_ptr() % 16:
        raise ValueError(f"prefetch_l2: a contiguous CUDA tensor of 16-byte units, got {tuple(t.shape)}")
    chunk = chunk if bulk else 128
    chunks = -(-nbytes // chunk)
    _prefetch_kernel[(programs,)](t.data_ptr(), nbytes, chunks, CHUNK=chunk, LANES=lanes, BULK=bulk,
                                  num_warps=max(1, lanes // 32))  # fmt: skip


# ------------------------------------------------------------------------------------------ the model

MIN_BYTES = 1 << 20  # smaller weights (Ouro's exit gate) stay in L2 anyway: not worth a launch
MAX_ROWS = 256  # decode: up to here a projection is bound by its weight bytes, not by its arithmetic
_ACTIVE: weakref.WeakSet[WeightPrefetcher] = weakref.WeakSet()


class WeightPrefetcher:
    """Before projection i, prefetch the weight of the projection that came after it last time.

    The successor of each weight is learnt from the calls themselves (the eager warm-ups before a capture
    run the same sequence), so no model code names an order. Prefetches are issued only while a CUDA graph
    is being captured, for at most MAX_ROWS rows: on a forked side stream, which `join` folds back into the
    capture before it ends (`cuda_graphs.GraphCache` calls `join_all`). Eager calls only record."""

    def __init__(self, device: torch.device, issue: Callable[[torch.Tensor], None] | None = None,
                 capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing):  # fmt: skip
        self.device, self.capturing = device, capturing
        self.issue = issue or self._on_side_stream
        self.next_of: dict[int, torch.Tensor] = {}
        self.previous: int | None = None
        self.side: torch.cuda.Stream | None = None
        self.pending = False
        self.issued = 0

    def before(self, weight: torch.Tensor, x: torch.Tensor) -> None:
        if weight.numel() * weight.element_size() < MIN_BYTES:
            return
        key = weight.data_ptr()
        if self.previous is not None and self.previous != key:
            self.next_of[self.previous] = weight
        self.previous = key
        upcoming = self.next_of.get(key)
        if upcoming is None or x.numel() > MAX_ROWS * x.shape[-1] or not self.capturing():
            return
        self.issue(upcoming)
        self.issued += 1

    def _on_side_stream(self, weight: torch.Tensor) -> None:
        """Fork a side stream from the current one (inside a capture: a parallel branch of the graph)."""
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            prefetch_l2(weight)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.side)
            self.pending = False


def join_all() -> None:
    """Fold every side stream with prefetches back into the current stream (the end of a capture)."""
    for prefetcher in list(_ACTIVE):
        prefetcher.join()


def _wrap_linear(module: nn.Linear, prefetcher: WeightPrefetcher) -> None:
    inner = module.forward  # the class's forward, or the GEMV's instance forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        prefetcher.before(module.weight, x)
        return inner(x)

    module.forward = forward


def _wrap_fused(module: nn.Module, prefetcher: WeightPrefetcher) -> None:
    inner = module.fused_linear

    def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        prefetcher.before(weight, x)
        return inner(x, weight, bias)

    module.fused_linear = fused_linear


def apply_l2_prefetch(model: nn.Module, device: torch.device | str) -> WeightPrefetcher:
    """Wrap every bias-free projection of `model` (nn.Linear forwards, whatever they are now, e.g. the
    GEMV's, and the modules' `fused_linear`) so that each call first prefetches its successor's weight.
    The wrapped call computes exactly what it did (R0). Call once, after the fused and GEMV variants are
    installed (`engine/assemble.py`)."""
    prefetcher = WeightPrefetcher(torch.device(device))
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is None:
            _wrap_linear(module, prefetcher)
        if hasattr(module, "fused_linear"):
            _wrap_fused(module, prefetcher)
    _ACTIVE.add(prefetcher)  # weak: the model's wrappers keep it alive, and it dies with them
    return prefetcher


__all__ = ["MAX_ROWS", "WeightPrefetcher", "apply_l2_prefetch", "join_all", "prefetch_l2"]
