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

import torch

from looptrace.engine.kernels._fences import triton

tl = triton.language

_BULK_ASM = tl.constexpr("""{
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
            tl.inline_asm_elementwise(_BULK_ASM, "=r,l,r,r", [base + offset, size, live], dtype=tl.int32,
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


__all__ = ["prefetch_l2"]
