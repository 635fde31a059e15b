"""`kernels.rmsnorm` (ExactLoop R0): the exact RMSNorm, its strided OLMo q/k form, the residual norm and
the one-kernel mean order, bitwise equal to the engine's eager ops on a GPU (every row bucket x model width x
input kind, eager and replayed in a CUDA graph); on CPU the functions fall back to the eager math, and the
residual norm (`residual_rms_norm`: post-norm, residual add and next pre-norm in one launch) runs in the
Triton interpreter against the eager ops (its bf16 casts round toward zero, so only approximately)."""

from __future__ import annotations

import sys

import pytest
import torch

from looptrace.engine.kernels import reduce_order
from tests.engine.kernels.conftest import MODELS, ROWS, kernel_case_failures
from tests.helpers import interpreted_results_fixture

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


# ------------------------------------------------------------------------------ CPU (Triton interpreter)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest magnitude of b."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, detail]}."""
    from looptrace.engine.kernels import rmsnorm

    # The wrapper takes CUDA tensors only; the interpreter runs the same kernel on CPU tensors.
    rmsnorm.supported = lambda x, w: x.dtype == torch.bfloat16 and w.shape[0] == x.shape[-1]
    gen = torch.Generator().manual_seed(7)
    res = {}
    for rows, n in ((1, 2048), (5, 2048), (3, 512)):
        y = (torch.randn(rows, n, generator=gen) * 3).bfloat16()
        h = (torch.randn(rows, n, generator=gen) * 2).bfloat16()
        w1 = (1 + 0.5 * torch.randn(n, generator=gen)).bfloat16()
        w2 = (1 + 0.5 * torch.randn(n, generator=gen)).bfloat16()

        def norm(x, w):
            f = x.float()
            return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w

        ref_h = h + norm(y, w1)
        ref_out = norm(ref_h, w2)
        got_h, got_out = rmsnorm.residual_rms_norm(y, w1, 1e-6, h, w2, 1e-6)
        # Three bf16 roundings toward zero in a row: compare at the scale of the row (a wrong weight, a
        # missing add or a norm of the wrong tensor is off by O(1) of it).
        errs = [_rel(got_h, ref_h), _rel(got_out, ref_out), _rel(got_out, norm(got_h, w2))]
        res[f"residual_{rows}x{n}"] = [max(errs) < 0.02, errs]
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_rmsnorm")


@pytest.mark.parametrize("case", ["residual_1x2048", "residual_5x2048", "residual_3x512"])
def test_interpreted_residual_norm_matches_eager(cpu_results, case):
    ok, detail = cpu_results[case]
    assert ok, detail
