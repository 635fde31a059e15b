"""The device side of `kernels.pdl` (see `launch_mode`): the preamble of every engine Triton kernel.

`await_inputs(PDL)` is the first statement of each kernel body. With `PDL` false (the default, and always
under the interpreter, which runs no inline PTX) it compiles to nothing. With `PDL` true it first lets
the next kernel launch (`griddepcontrol.launch_dependents`: a hint, effective once every program of this
kernel has executed it) and then waits for the kernel before to complete with its writes visible
(`griddepcontrol.wait`). It sits before every loop: Triton's software pipeliner may hoist loads of a loop
above a wait inside it (triton-lang/triton#11905). Imports Triton.
"""

from __future__ import annotations

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from looptrace.engine.kernels._fences import triton

tl = triton.language


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


__all__ = ["await_inputs", "let_dependents_launch", "wait_for_inputs"]
