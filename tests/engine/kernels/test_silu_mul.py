"""`kernels.silu_mul` (ExactLoop R0): `F.silu(g) * up` in one kernel, bitwise equal to eager on a GPU (every
row bucket x model width x input kind, eager and replayed in a CUDA graph)."""

from __future__ import annotations

import pytest

from tests.engine.kernels.conftest import MODELS, ROWS, kernel_case_failures

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_silu_mul_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.silu_case(checks.spec(model), rows, kind, gen, "cuda")

    assert kernel_case_failures(make) == []
