"""`kernels.reduce_order`: the reduction shapes of PyTorch's CUDA `mean(-1)` per row count and model width,
and its CPU emulation (CPU tests)."""

from __future__ import annotations

import torch

from looptrace.engine.kernels import reduce_order


def test_reduce_shapes_of_model_widths():
    """exactness.md §2 table: lanes per row by row count; no model width splits a row across warps."""
    expected_lanes = {1: 512, 2: 256, 3: 256, 4: 128, 7: 128, 8: 64, 15: 64, 16: 32, 300: 32, 8192: 32}
    for n in (2048, 5280):
        for rows, lanes in expected_lanes.items():
            shape = reduce_order.reduce_shape(rows, n)
            assert shape.lanes == lanes and shape.one_kernel_ok, (n, rows, shape)
    assert reduce_order.reduce_shape(1, 5280).vectors_per_lane == 3
    assert reduce_order.reduce_shape(16, 5280).vectors_per_lane == 42
    assert not reduce_order.reduce_shape(1, 64).vectorized
    assert reduce_order.mean_factor(1, 2048) == 2.0**-11


def test_emulated_mean_is_a_sum_in_the_cuda_order():
    """The emulation sums every element once (permutation check with exactly representable values)."""
    x = torch.arange(16 * 5280, dtype=torch.float32).reshape(16, 5280) % 7
    for order in ("asc", "desc"):
        got = reduce_order.emulate_mean(x, order)
        want = x.sum(-1) * reduce_order.mean_factor(16, 5280)
        assert torch.equal(got, want)
