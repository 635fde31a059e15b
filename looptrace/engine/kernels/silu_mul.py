"""Exact SiLU·mul: `F.silu(gate) * up` in bf16, bit-identical to the two eager kernels on CUDA.

ATen's silu: `x / (1 + expf(-x))` in fp32 (`expf` from the CUDA math library = libdevice `__nv_expf`,
IEEE `div.rn`), rounded to bf16; the product with `up` rounds again. Here: `libdevice.exp` (launched with
`enable_reflect_ftz=False`, as ATen is not built with -ftz), fenced `add.rn` / `div.rn`, `cvt.rn.bf16` of
silu(g), then a fenced `mul.rn` and one more rounding. Importing this module imports Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looptrace.engine.kernels.device_helpers import (
    EXACT_OPTIONS,
    add_rn,
    await_inputs,
    div_rn,
    exp_like_aten,
    mul_rn,
    neg,
    round_bf16,
    to_bf16,
    triton,
)
from looptrace.engine.kernels.launch_mode import pdl_args

tl = triton.language

# Launch options of the SiLU kernel; the bench can try the variants (libdevice's expf is compiled by
# Triton's LLVM, so whether its internals contract like nvcc's build is checked on the GPU).
OPTIONS: dict = dict(EXACT_OPTIONS)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):  # fmt: skip
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    one = tl.full([BLOCK], 1.0, tl.float32)
    silu = round_bf16(div_rn(g, add_rn(one, exp_like_aten(neg(g)))))
    tl.store(out_ptr + row * stride_o + cols, to_bf16(mul_rn(silu, u)), mask=m)


def supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (
        gate.is_cuda
        and gate.dtype == up.dtype == torch.bfloat16
        and gate.shape == up.shape
        and gate.numel() > 0
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, options: dict | None = None) -> torch.Tensor:
    """`F.silu(gate) * up` (bf16, any leading shape; the last dim may be a strided slice such as chunk())."""
    if not supported(gate, up):
        return F.silu(gate) * up
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    rows = g2.shape[0]
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    block = min(triton.next_power_of_2(n), 1024)
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        g2,
        u2,
        out,
        n,
        g2.stride(0),
        u2.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
        **pdl_args(),
        **(OPTIONS if options is None else options),
    )
    return out.view(*gate.shape[:-1], n)


__all__ = ["OPTIONS", "silu_mul", "supported"]
