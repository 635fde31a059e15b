"""`kernels.rmsnorm` (ExactLoop R0): the exact RMSNorm, its strided OLMo q/k form, the residual norm and
the one-kernel mean order, bitwise equal to the engine's eager ops on a GPU (every row bucket x model width x
input kind, eager and replayed in a CUDA graph); on CPU the functions fall back to the eager math."""

from __future__ import annotations

import sys

import pytest
import torch

from looptrace.engine.kernels import reduce_order
from tests.engine.kernels.conftest import MODELS, ROWS, kernel_case_failures

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("form", ["auto", "three"])
def test_rmsnorm_bitwise(model, rows, form):
    def make(checks, kind, gen):
        return checks.rmsnorm_case(checks.spec(model), rows, kind, gen, "cuda", form=form)

    assert kernel_case_failures(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
def test_olmo_qk_norm_strided_bitwise(rows):
    def make(checks, kind, gen):
        return checks.rmsnorm_case(checks.spec("olmo-retrofit-1b"), rows, kind, gen, "cuda", qk=True)

    assert kernel_case_failures(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_residual_norm_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.residual_norm_case(checks.spec(model), rows, kind, gen, "cuda")

    assert kernel_case_failures(make) == []


@gpu
def test_one_kernel_mean_order_matches_torch_mean():
    """The replayed mean (before eps/rsqrt) equals torch's CUDA mean for every bucket of both widths."""
    from looptrace.engine.kernels import rmsnorm

    gen = torch.Generator(device="cuda").manual_seed(7)
    order = reduce_order.default_shuffle_order()
    for n in (2048, 5280):
        for rows in (1, 2, 3, 4, 7, 8, 15, 16, 17, 300):
            for _ in range(4):
                x = torch.randn(rows, n, generator=gen, device="cuda") * torch.exp2(
                    torch.randint(-20, 20, (rows, n), generator=gen, device="cuda").float()
                )
                x = x.bfloat16()
                mean = torch.empty(rows, dtype=torch.float32, device="cuda")
                rmsnorm.rms_norm_fused(
                    x, torch.ones(n, dtype=torch.bfloat16, device="cuda"), 1e-6, order, mean
                )
                assert torch.equal(mean, x.float().pow(2).mean(-1)), (n, rows, order)


@pytest.mark.skipif(CUDA, reason="CPU-only behaviour")
def test_functions_fall_back_to_eager_on_cpu():
    from looptrace.engine.layers import RMSNorm

    x = torch.randn(3, 64)
    norm = RMSNorm(64, 1e-6)
    if "triton" not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            pytest.skip("triton not installed: the kernel modules cannot be imported")
    from looptrace.engine.kernels import rmsnorm

    assert torch.equal(rmsnorm.rms_norm(x, norm.weight.detach(), 1e-6), norm(x).detach())
