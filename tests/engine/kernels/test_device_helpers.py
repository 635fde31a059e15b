"""The device helpers every engine Triton kernel shares (`looptrace.engine.kernels.device_helpers`): the
rounding fences and the PDL preamble.

CPU: one kernel calling every fence runs in the Triton interpreter (in a child process: TRITON_INTERPRET=1
must be set before Triton decorates the kernels) and gives numpy's IEEE fp32 results bit for bit, on inputs
chosen where an FMA, an approximate division, a flush to zero or a bf16 rounding mode would show (the
interpreter's bf16 casts round toward zero, exactness.md §4: its `round_bf16` is checked against that
truncation on normal inputs only, as it is not one for subnormal ones). Compiled for sm_90 on the CPU with FMA
contraction on: the fenced product and sum stay an FMUL and an FADD in the SASS where the plain expression
becomes one FFMA, the fenced division is IEEE `div.rn` where `/` is `div.full`, and the preamble orders
`launch_dependents` before `wait` before the first store, and is absent without PDL.
GPU (`gpu` marker): the same kernel on CUDA gives numpy's results bit for bit (bf16 rounded to nearest
even), so the fenced mul + add is not the once-rounded FMA on the inputs where the two differ.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from looptrace.engine.kernels.device_helpers import (  # noqa: E402
    add_rn,
    await_inputs,
    div_rn,
    mul_rn,
    neg,
    round_bf16,
    sub_rn,
)
from tests.engine.kernels.test_launch_mode import _compile_sm90, _first  # noqa: E402
from tests.helpers import interpreted_results_fixture  # noqa: E402

gpu = pytest.mark.gpu

# (a, b, c) per element; b is never zero (it divides)
INPUTS = [
    # an FMA rounds a*b+c once: here mul then add gives 0 and the FMA does not
    (1 + 2**-12, 1 + 2**-12, -(1 + 2**-11)),  # FMA: 2^-24
    (1 + 2**-23, 1 - 2**-23, -1.0),  # FMA: -2^-46
    (3.0, 1 / 3, -1.0),
    (0.1, 10.0, -1.0),
    # bf16 rounding: above half an ulp, a tie rounding up to even, a tie staying even, negative
    (1 + 2**-7 + 2**-8 + 2**-20, 3.0, 0.5),
    (1 + 3 * 2**-8, 7.0, -2.0),
    (1 + 2**-8, 0.1, 1e-3),
    (-(1 + 2**-7 + 2**-8 + 2**-20), 1.5, 2.0),
    # inexact quotients; subnormal results (kept: no flush to zero)
    (1.0, 3.0, 0.0),
    (2.0, 7.0, -0.25),
    (1e-20, 1e-20, 0.0),
    (1e-38, 0.5, -1e-39),
    # signed zeros
    (-0.0, 5.0, 0.0),
    (0.0, -5.0, -0.0),
    (1e30, 1e-8, -1.0),
    (123.456, -0.001, 0.1234),
]
FMA_ROWS = slice(0, 4)  # the inputs above where the FMA differs from mul then add
OPS = ("mul", "add", "sub", "div", "neg", "round_bf16", "mul_add")


@triton.jit
def _fences_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i)
    b = tl.load(b_ptr + i)
    c = tl.load(c_ptr + i)
    tl.store(out_ptr + 0 * N + i, mul_rn(a, b))  # rows in OPS order
    tl.store(out_ptr + 1 * N + i, add_rn(a, b))
    tl.store(out_ptr + 2 * N + i, sub_rn(a, b))
    tl.store(out_ptr + 3 * N + i, div_rn(a, b))
    tl.store(out_ptr + 4 * N + i, neg(a))
    tl.store(out_ptr + 5 * N + i, round_bf16(a))
    tl.store(out_ptr + 6 * N + i, add_rn(mul_rn(a, b), c))


def _columns() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b, c = (np.array(column, dtype=np.float32) for column in zip(*INPUTS))
    return a, b, c


def _run_fences(device: str) -> dict[str, np.ndarray]:
    """Every fence of `_fences_kernel` on INPUTS, as fp32 arrays by op name."""
    a, b, c = (torch.from_numpy(x).to(device) for x in _columns())
    out = torch.empty(len(OPS), len(INPUTS), dtype=torch.float32, device=device)
    _fences_kernel[(1,)](a, b, c, out, N=len(INPUTS))
    return dict(zip(OPS, out.cpu().numpy()))


def _expected(bf16_toward_zero: bool) -> dict[str, np.ndarray]:
    """numpy's IEEE fp32 results: each operation rounded once, to nearest even."""
    a, b, c = _columns()
    if bf16_toward_zero:
        bf16 = (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    else:
        bf16 = torch.from_numpy(a).bfloat16().float().numpy()
    return {
        "mul": a * b,
        "add": a + b,
        "sub": a - b,
        "div": a / b,
        "neg": -a,
        "round_bf16": bf16,
        "mul_add": (a * b) + c,
    }


def _differing(got: np.ndarray, want: np.ndarray) -> list[int]:
    """Indices whose fp32 bit patterns differ (so -0 != +0)."""
    return np.flatnonzero(got.view(np.uint32) != want.view(np.uint32)).tolist()


# ------------------------------------------------------------------------------ CPU (Triton interpreter)


def _cpu_checks() -> dict:
    """Runs in the child (TRITON_INTERPRET=1); returns {check: [ok, differing indices]}."""
    got, want = _run_fences("cpu"), _expected(bf16_toward_zero=True)
    a = _columns()[0]
    res = {}
    for op in OPS:
        bad = _differing(got[op], want[op])
        if op == "neg":  # the sign of -(+0) is checked on its own (test_interpreted_neg_of_plus_zero)
            plus_zero = [i for i in bad if a[i] == 0 and not np.signbit(a[i])]
            bad = [i for i in bad if i not in plus_zero]
            res["neg_of_plus_zero"] = [plus_zero == [], plus_zero]
        if op == "round_bf16":  # the interpreter's cast is not a truncation for subnormal fp32 inputs
            bad = [i for i in bad if abs(a[i]) >= np.finfo(np.float32).tiny]
        res[op] = [bad == [], bad]
    return res


cpu_results = interpreted_results_fixture("tests.engine.kernels.test_device_helpers")


@pytest.mark.parametrize("op", OPS)
def test_interpreted_fences_give_numpys_ieee_bits(cpu_results, op):
    ok, differing = cpu_results[op]
    assert ok, differing


@pytest.mark.xfail(
    strict=True,
    reason="the interpreted `neg` is Triton's unary minus, 0 - x: -(+0) is +0 there, -0 on a GPU (neg.f32)",
)
def test_interpreted_neg_of_plus_zero(cpu_results):
    ok, differing = cpu_results["neg_of_plus_zero"]
    assert ok, differing


# --------------------------------------------------------------------- CPU (compiled for sm_90, not run)


@triton.jit
def _fenced_mul_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, add_rn(mul_rn(tl.load(a_ptr + i), tl.load(b_ptr + i)), tl.load(c_ptr + i)))


@triton.jit
def _plain_mul_add_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(a_ptr + i) * tl.load(b_ptr + i) + tl.load(c_ptr + i))


@triton.jit
def _fenced_div_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, div_rn(tl.load(a_ptr + i), tl.load(b_ptr + i)))


@triton.jit
def _plain_div_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(a_ptr + i) / tl.load(b_ptr + i))


@triton.jit
def _preamble_kernel(out_ptr, PDL: tl.constexpr):
    await_inputs(PDL)
    tl.store(out_ptr, 1.0)


ELEMENTWISE_SIGNATURE = {name: "*fp32" for name in ("a_ptr", "b_ptr", "c_ptr", "out_ptr")}


def _sm90_asm(kernel, kind: str) -> list[str]:
    """`kind` ("ptx" or "sass") of `kernel` compiled for sm_90 with Triton's default options (FMA
    contraction on, unlike the engine's EXACT_OPTIONS: the fences must hold without them)."""
    compiled = _compile_sm90(kernel, ELEMENTWISE_SIGNATURE, {"N": 128}, num_warps=4)
    return compiled.asm[kind].splitlines()


def _count(lines: list[str], instruction: str) -> int:
    return sum(1 for line in lines if re.search(rf"\b{instruction}\b", line))


def test_sm90_fenced_mul_add_is_not_contracted_into_an_fma():
    fenced = _sm90_asm(_fenced_mul_add_kernel, "sass")
    plain = _sm90_asm(_plain_mul_add_kernel, "sass")
    assert (_count(fenced, "FFMA"), _count(fenced, "FMUL"), _count(fenced, "FADD")) == (0, 1, 1)
    assert (_count(plain, "FFMA"), _count(plain, "FMUL"), _count(plain, "FADD")) == (1, 0, 0)


def test_sm90_fenced_division_is_ieee_where_the_slash_is_approximate():
    fenced = _sm90_asm(_fenced_div_kernel, "ptx")
    plain = _sm90_asm(_plain_div_kernel, "ptx")
    assert (_count(fenced, r"div\.rn\.f32"), _count(fenced, r"div\.full\.f32")) == (1, 0)
    assert (_count(plain, r"div\.rn\.f32"), _count(plain, r"div\.full\.f32")) == (0, 1)


@pytest.mark.parametrize("pdl", [False, True])
def test_sm90_pdl_preamble_lets_dependents_launch_then_waits_before_the_first_store(pdl):
    compiled = _compile_sm90(_preamble_kernel, {"out_ptr": "*fp32"}, {"PDL": pdl}, launch_pdl=pdl)
    ptx = compiled.asm["ptx"].splitlines()
    hint, wait = _first(ptx, "griddepcontrol.launch_dependents"), _first(ptx, "griddepcontrol.wait")
    store = _first(ptx, r"\bst\.global")
    if pdl:
        assert 0 <= hint < wait < store, (hint, wait, store)
    else:
        assert (hint, wait) == (-1, -1) and store >= 0


# ------------------------------------------------------------------------------------------------- GPU


@gpu
def test_fences_on_cuda_give_numpys_ieee_bits():
    got, want = _run_fences("cuda"), _expected(bf16_toward_zero=False)
    assert {op: _differing(got[op], want[op]) for op in OPS} == {op: [] for op in OPS}


@gpu
def test_fenced_mul_add_on_cuda_is_not_the_fma():
    """Where an FMA (one rounding of a*b+c) and mul then add (two roundings) differ, the fenced pair gives
    the two roundings. The FMA's value is exact in float64 on these inputs (a*b is, and c cancels it)."""
    a, b, c = (x.astype(np.float64) for x in _columns())
    fma = (a * b + c).astype(np.float32)[FMA_ROWS]
    fenced = _run_fences("cuda")["mul_add"][FMA_ROWS]
    assert fenced.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert fma.tolist() == [2**-24, -(2**-46), 2**-25, 2**-26]
    assert _differing(fenced, fma) == [0, 1, 2, 3]
