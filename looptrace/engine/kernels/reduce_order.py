"""PyTorch's CUDA reduction order for `mean(-1)` over a contiguous fp32 [M, N] tensor (no Triton import).

Replica of `setReduceConfig` / `input_vectorized_thread_reduce_impl` / `block_x_reduce` in
`ATen/native/cuda/Reduce.cuh` and `mean_kernel_impl` (factor = float(M) / numel, result `sum * factor`),
for the case the engine hits (reduced dim contiguous and innermost, fp32 input, one reduce dim). See
docs in /shared/reference/exactness.md §2. `emulate_mean` computes the same sum with elementwise fp32 adds
(portable: any device, no FMA) so the Triton replica can be checked against it on a CPU.

Version drift: the lane-combine order inside a warp was ascending (offsets 1, 2, ..., 16) before
pytorch/pytorch PR #164790 (2025-10, torch >= 2.10) and descending (16, 8, ..., 1) after it on CUDA.
`default_shuffle_order()` picks by version; `looptrace.engine.kernels.calibrate()` verifies it on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MAX_THREADS = 512  # mnt_wrapper<float>::MAX_NUM_THREADS
WARP = 32
VEC = 4  # input_vec_size = vt0 = 4 for the float mean instantiation
MAX_VALUES_PER_THREAD = 256


def _last_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


@dataclass(frozen=True)
class ReduceShape:
    rows: int
    width: int
    vectorized: bool
    lanes: int  # block_width: threads that split one row
    warps_rows: int  # block_height
    values_per_thread: int
    warp_split: bool  # block_y_reduce across warps (not replayed by the one-kernel form)
    cta_split: bool

    @property
    def one_kernel_ok(self) -> bool:
        """Shapes the one-kernel RMSNorm replays: vectorized, lanes-only split, no head/tail elements."""
        return self.vectorized and not self.warp_split and not self.cta_split and self.width % VEC == 0

    @property
    def vectors_per_lane(self) -> int:
        return math.ceil((self.width // VEC) / self.lanes)


def reduce_shape(rows: int, width: int, num_sms: int = 132, max_threads_per_sm: int = 2048) -> ReduceShape:
    """`setReduceConfig` for `mean(-1)` of a contiguous fp32 [rows, width] tensor."""
    dim0, dim1 = width, rows
    vectorized = dim0 >= 128
    if vectorized:
        dim0 //= VEC
    d0 = _last_pow2(dim0) if dim0 < MAX_THREADS else MAX_THREADS
    d1 = _last_pow2(dim1) if dim1 < MAX_THREADS else MAX_THREADS
    bw = min(d0, WARP)
    bh = min(d1, MAX_THREADS // bw)
    bw = min(d0, MAX_THREADS // bh)
    step = bw  # split_input(block_width)
    vpt = math.ceil(width / step)
    warp_split = vpt >= min(bh * 16, MAX_VALUES_PER_THREAD)
    cta_split = False
    if warp_split:
        step *= bh
        vpt = math.ceil(width / step)
        grid = math.ceil(rows / 1)  # outputs per block in y are 1 when warps split
        target = num_sms * (max_threads_per_sm // (bw * bh))
        if vpt >= MAX_VALUES_PER_THREAD and grid <= target:
            c1 = math.ceil(target / grid)
            c2 = math.ceil(vpt / 16)
            c3 = math.ceil(vpt / MAX_VALUES_PER_THREAD)
            cta_split = max(min(c1, c2), c3) > 1
    return ReduceShape(rows, width, vectorized, bw, bh, vpt, warp_split, cta_split)


def mean_factor(rows: int, width: int) -> float:
    """`static_cast<float>(num_outputs) / numel` evaluated in float, as `mean_kernel_impl` does."""
    return float(np.float32(rows) / np.float32(rows * width))


def default_shuffle_order() -> str:
    """'desc' (offsets 16..1) for torch >= 2.10 on CUDA, 'asc' (1..16) before pytorch PR #164790."""
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if torch.version.hip is not None:
        return "asc"
    return "desc" if (major, minor) >= (2, 10) else "asc"


def tree_sum(lane_sums: torch.Tensor, order: str) -> torch.Tensor:
    """Shared-memory halving (x += x + off for off = W/2 .. 32) then the warp shuffle; [M, W] -> [M]."""
    s = lane_sums
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        # x += x + half (shared-memory halving, descending shuffle); ascending: adjacent pairs first
        halving = order == "desc" or half >= WARP
        s = s[:, :half] + s[:, half:] if halving else s[:, 0::2] + s[:, 1::2]
    return s[:, 0]


def emulate_mean(squares: torch.Tensor, order: str | None = None) -> torch.Tensor:
    """The CUDA `mean(-1)` of a contiguous fp32 [M, N] tensor, with elementwise fp32 adds; returns [M]."""
    order = order or default_shuffle_order()
    m, n = squares.shape
    shape = reduce_shape(m, n)
    if not shape.one_kernel_ok:
        raise ValueError(f"no lane-only emulation for {shape}")
    w, k = shape.lanes, shape.vectors_per_lane
    padded = torch.zeros(m, k * w * VEC, dtype=torch.float32, device=squares.device)
    padded[:, :n] = squares
    vecs = padded.view(m, k, w, VEC)
    acc = torch.zeros(m, w, VEC, dtype=torch.float32, device=squares.device)
    for i in range(k):
        acc = acc + vecs[:, i]
    lane = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    total = tree_sum(lane, order)
    return total * torch.tensor(mean_factor(m, n), dtype=torch.float32, device=squares.device)
