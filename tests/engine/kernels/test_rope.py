"""`kernels.rope` (ExactLoop R0): the exact RoPE and the RoPE + K/V cache write, bitwise equal to the engine's
eager ops on a GPU (every row bucket x model width x input kind, eager and replayed in a CUDA graph)."""

from __future__ import annotations

import pytest

from tests.engine.kernels.conftest import MODELS, ROWS, kernel_case_failures

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_rope_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.rope_case(checks.spec(model), rows, kind, gen, "cuda")

    assert kernel_case_failures(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", ["ouro-1.4b", "olmo-retrofit-1b"])
def test_rope_kv_write_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.rope_write_case(checks.spec(model), rows, kind, gen, "cuda")

    assert kernel_case_failures(make) == []
