"""The GEMV's tile routing (`kernels/gemv/tiles.py`): how K is split so the grid fills the GPU."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_split_for_fills_the_gpu_without_empty_splits():
    if not HAS_TRITON:
        pytest.skip("triton not importable")
    from looptrace.engine.kernels.gemv import tiles as gemv_tiles

    for n, k in [(2048, 2048), (2048, 5632), (6144, 2048), (11264, 2048), (49152, 2048), (5280, 17920)]:
        for m in (1, 8):
            cfg = gemv_tiles.pick_config(m, n, k)
            split, per_split = gemv_tiles.split_for(n, k, cfg)
            tiles = -(-k // cfg.block_k)
            assert (split - 1) * per_split < tiles <= split * per_split  # every split holds a tile
            most = max(1, tiles // gemv_tiles.MIN_TILES_PER_SPLIT)
            assert (
                -(-n // cfg.block_n) * split >= gemv_tiles.SMS or split >= most
            )  # all SMs busy, or K is split out
