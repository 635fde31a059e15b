"""The device helpers every engine Triton kernel shares (imports Triton; load lazily): rounding fences,
the PDL preamble and ATen's `expf`.

Rounding fences: single IEEE operations pinned with inline PTX.

Every fp32 operation the eager code rounds separately is written as one PTX instruction with an explicit
rounding mode (`mul.rn`, `add.rn`, `sub.rn`, `div.rn`, `cvt.rn.bf16`). LLVM cannot contract through inline
asm and ptxas never fuses `.rn` instructions, so the products are never turned into FMAs whatever
`enable_fp_fusion` says. `rsqrt.approx.f32` is the instruction CUDA's `rsqrtf` (ATen's `torch.rsqrt`) emits.

Under `TRITON_INTERPRET=1` inline PTX cannot run: the fences become plain numpy ops (IEEE, no FMA) so the
reduction-order logic can be checked on a CPU; bf16 casts there round toward zero (exactness.md §4; subnormal
values are not even truncated), so only the fp32 parts of an interpreted run are meaningful.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FENCE = tl.constexpr(not INTERPRET)

# Launch options for every exact kernel: no FMA contraction below the TTGIR, libdevice without
# flush-to-zero (ATen is not built with -ftz). Interpreted launches take no backend options.
EXACT_OPTIONS: dict = {} if INTERPRET else {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def mul_rn(a, b):
    if FENCE:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def add_rn(a, b):
    if FENCE:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a + b


@triton.jit
def sub_rn(a, b):
    if FENCE:
        return tl.inline_asm_elementwise(
            "sub.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a - b


@triton.jit
def div_rn(a, b):
    if FENCE:
        return tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a / b


@triton.jit
def neg(a):
    """Sign flip (`neg.f32`); Triton's unary minus is `0 - x`, which turns -(+0) into +0, not -0. Interpreted,
    this is that unary minus, so there -(+0) is +0."""
    if FENCE:
        return tl.inline_asm_elementwise(
            "neg.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return -a


@triton.jit
def rsqrt_approx(a):
    """CUDA `rsqrtf` without -ftz: `rsqrt.approx.f32` (what ATen's rsqrt kernel executes)."""
    if FENCE:
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / tl.sqrt(a)


@triton.jit
def to_bf16(a):
    """fp32 -> bf16, round to nearest even (`cvt.rn.bf16.f32`, the instruction of c10::BFloat16 on sm_80+)."""
    if FENCE:
        return tl.inline_asm_elementwise(
            "cvt.rn.bf16.f32 $0, $1;", "=h,f", [a], dtype=tl.bfloat16, is_pure=True, pack=1
        )
    else:
        return a.to(tl.bfloat16)


@triton.jit
def round_bf16(a):
    """Round an fp32 value to bf16 and widen it back (exact); the compiler cannot fold the pair."""
    return to_bf16(a).to(tl.float32)


@triton.jit
def rotate_half(x1, x2, c1, c2, s1, s2):
    """RoPE's rotate-half pair as the eager bf16 ops round it, in fp32: first half x1*c1 + (-x2)*s1,
    second half x2*c2 + x1*s2, each product rounded to bf16, then the sum (not yet rounded)."""
    o1 = add_rn(round_bf16(mul_rn(x1, c1)), round_bf16(mul_rn(neg(x2), s1)))
    o2 = add_rn(round_bf16(mul_rn(x2, c2)), round_bf16(mul_rn(x1, s2)))
    return o1, o2


# ------------------------------------------------------------------------------------ PDL preamble
# The device side of `kernels.pdl` (see `launch_mode`): the preamble of every engine Triton kernel.
#
# `await_inputs(PDL)` is the first statement of each kernel body. With `PDL` false (the default, and always
# under the interpreter, which runs no inline PTX) it compiles to nothing. With `PDL` true it first lets
# the next kernel launch (`griddepcontrol.launch_dependents`: a hint, effective once every program of this
# kernel has executed it) and then waits for the kernel before to complete with its writes visible
# (`griddepcontrol.wait`). It sits before every loop: Triton's software pipeliner may hoist loads of a loop
# above a wait inside it (triton-lang/triton#11905). Imports Triton.


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Nothing another kernel writes may be read, and nothing another kernel reads may be written, before
    this returns."""
    if PDL:
        gdc_wait()


@triton.jit
def await_inputs(PDL: tl.constexpr):
    let_dependents_launch(PDL)
    wait_for_inputs(PDL)


# ---------------------------------------------------------------------------------------- ATen's expf
# ATen's `expf` is libdevice `__nv_expf` (launched with `enable_reflect_ftz=False`, as ATen is not built
# with -ftz); the interpreter runs no libdevice, so it takes `tl.exp`.
if FENCE:
    from triton.language.extra import libdevice

    @triton.jit
    def exp_like_aten(x):
        return libdevice.exp(x)

else:

    @triton.jit
    def exp_like_aten(x):
        return tl.exp(x)


__all__ = [
    "EXACT_OPTIONS",
    "FENCE",
    "INTERPRET",
    "add_rn",
    "await_inputs",
    "div_rn",
    "exp_like_aten",
    "let_dependents_launch",
    "mul_rn",
    "neg",
    "round_bf16",
    "rsqrt_approx",
    "sub_rn",
    "to_bf16",
    "triton",
    "wait_for_inputs",
]
