"""Exact fused kernels (ExactLoop R0): bitwise equal to the engine's eager ops on a GPU.

Every (row bucket x model width x input kind), eager call and captured-and-replayed CUDA graph, compared
with `torch.equal` (and bit patterns) against `looptrace.engine.layers` / `F.silu(g) * up` run eagerly.
The CPU tests at the end check the package's import hygiene and policy helpers.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from looptrace.engine.kernels import reduce_order, use_exact

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
ROWS = (1, 3, 5, 13, 64, 300)  # buckets 1, 2-3, 4-7, 8-15, >= 16, > 256
MODELS = ("ouro-1.4b", "huginn-0125", "olmo-retrofit-1b")
KINDS = ("random", "wide", "tiny", "large", "ties", "exp-edge")


def _run(make_case):
    """All input kinds x {eager, graph} for one (kernel, model, rows); returns the failures."""
    from looptrace.engine import kernel_checks as checks

    gen = torch.Generator(device="cuda").manual_seed(20260)
    failures = []
    for kind in KINDS:
        case = make_case(checks, kind, gen)
        assert case.uses_kernel, f"{case.kernel} fell back to eager for {case.model} rows={case.rows}"
        for mode in ("eager", "graph"):
            ok, diff = checks.compare(case, mode)
            if not ok:
                failures.append(
                    f"{case.kernel} {case.model} rows={case.rows} {kind} {mode}: {diff} elements differ"
                )
    return failures


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("form", ["auto", "three"])
def test_rmsnorm_bitwise(model, rows, form):
    def make(checks, kind, gen):
        return checks.rmsnorm_case(checks.spec(model), rows, kind, gen, "cuda", form=form)

    assert _run(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
def test_olmo_qk_norm_strided_bitwise(rows):
    def make(checks, kind, gen):
        return checks.rmsnorm_case(checks.spec("olmo-retrofit-1b"), rows, kind, gen, "cuda", qk=True)

    assert _run(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_rope_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.rope_case(checks.spec(model), rows, kind, gen, "cuda")

    assert _run(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_residual_norm_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.residual_norm_case(checks.spec(model), rows, kind, gen, "cuda")

    assert _run(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", ["ouro-1.4b", "olmo-retrofit-1b"])
def test_rope_kv_write_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.rope_write_case(checks.spec(model), rows, kind, gen, "cuda")

    assert _run(make) == []


@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("model", MODELS)
def test_silu_mul_bitwise(model, rows):
    def make(checks, kind, gen):
        return checks.silu_case(checks.spec(model), rows, kind, gen, "cuda")

    assert _run(make) == []


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


@gpu
def test_calibrate_keeps_one_kernel_form():
    from looptrace.engine import kernels

    assert kernels.calibrate("cuda") == {"order": reduce_order.default_shuffle_order(), "one_kernel": True}


# --- CPU: import hygiene and policy -------------------------------------------------------------------------


def test_importing_engine_and_kernels_does_not_import_triton():
    code = (
        "import sys, looptrace.engine, looptrace.engine.layers, looptrace.engine.kernels as k;"
        "from looptrace.engine.kernels import reduce_order; from looptrace.engine import kernel_checks;"
        "k.use_exact(1, False); assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_use_exact_policy():
    assert use_exact(1, capturing=True)
    assert use_exact(300, capturing=False)
    assert not use_exact(256, capturing=False)
    assert not use_exact(8, capturing=False)


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
