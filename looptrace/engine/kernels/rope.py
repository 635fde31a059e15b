"""Exact RoPE: rotate-half (Ouro, OLMo) and interleaved fp32 (Huginn, with its additive qk_bias).

Eager references (`looptrace.engine.layers`):
- `RotaryHalf.forward`: `q * cos + rotate_half(q) * sin` in the model dtype, three rounding points:
  `out = rn_bf16( rn_bf16(q*c) + rn_bf16(rot(q)*s) )` with `rot(q) = cat(-q[D/2:], q[:D/2])`.
- `RotaryInterleaved.forward`: pairs (2i, 2i+1) in fp32, `o0 = rn32(rn32(x0 c) - rn32(x1 s))`,
  `o1 = rn32(rn32(x1 c) + rn32(x0 s))`, one cast to bf16; q and k share one [R, Hq + Hk, D] output buffer.
  Huginn's `q + qk_bias[0]` / `k + qk_bias[1]` (bf16 adds, `rn_bf16(q + b)`) are fused in front.
- `rope_half_write_kv`: rotate-half of q and k in one launch, with the K/V cache write of the paged
  attention path fused in (the rotated k is stored only in the cache).
Each product is fenced (`mul.rn`), so no FMA contraction can merge it into the add.
Importing this module imports Triton.
"""

from __future__ import annotations

import torch

from looptrace.engine.kernels.device_helpers import (
    EXACT_OPTIONS,
    add_rn,
    await_inputs,
    mul_rn,
    rotate_half,
    round_bf16,
    sub_rn,
    to_bf16,
    triton,
)
from looptrace.engine.kernels.launch_mode import pdl_args

tl = triton.language


@triton.jit
def _rope_half_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    H,
    stride_xr,
    stride_xh,
    stride_cr,
    stride_sr,
    stride_or,
    stride_oh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    await_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BD]
    md = d < HALF
    m = (heads < H) & md
    xp = x_ptr + r * stride_xr + heads * stride_xh + d
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + r * stride_cr + d, mask=md, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + r * stride_cr + HALF + d, mask=md, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + r * stride_sr + d, mask=md, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + r * stride_sr + HALF + d, mask=md, other=0.0).to(tl.float32)
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)
    op = out_ptr + r * stride_or + heads * stride_oh + d
    tl.store(op, to_bf16(o1), mask=m)
    tl.store(op + HALF, to_bf16(o2), mask=m)


@triton.jit
def _rope_interleaved_kernel(
    x_ptr,
    bias_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    H,
    stride_xr,
    stride_xh,
    stride_bh,
    stride_cr,
    stride_cd,
    stride_sr,
    stride_sd,
    stride_or,
    stride_oh,
    HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    await_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_D)[None, :]
    mi = i < HALF
    m = (heads < H) & mi
    xp = x_ptr + r * stride_xr + heads * stride_xh + 2 * i
    x0 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(xp + 1, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bp = bias_ptr + heads * stride_bh + 2 * i
        x0 = round_bf16(add_rn(x0, tl.load(bp, mask=m, other=0.0).to(tl.float32)))
        x1 = round_bf16(add_rn(x1, tl.load(bp + 1, mask=m, other=0.0).to(tl.float32)))
    c = tl.load(cos_ptr + r * stride_cr + i * stride_cd, mask=mi, other=0.0)
    s = tl.load(sin_ptr + r * stride_sr + i * stride_sd, mask=mi, other=0.0)
    o0 = sub_rn(mul_rn(x0, c), mul_rn(x1, s))
    o1 = add_rn(mul_rn(x1, c), mul_rn(x0, s))
    op = out_ptr + r * stride_or + heads * stride_oh + 2 * i
    tl.store(op, to_bf16(o0), mask=m)
    tl.store(op + 1, to_bf16(o1), mask=m)


@triton.jit(do_not_specialize=["layer_id", "stride_w", "stride_o"])
def _rope_half_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    kc_ptr,
    vc_ptr,
    went_ptr,
    woff_ptr,
    layer_id,
    HQ,
    HK,
    stride_qr,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_cr,
    stride_sr,
    stride_or,
    stride_oh,
    stride_e,
    stride_s,
    stride_ch,
    stride_w,
    stride_o,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Head slots 0 .. HQ-1 are q heads (rotated into q_out), HQ .. HQ+HK-1 the k heads: rotated k and
    the row's v go straight into the paged cache at (write_entry + layer_id, write_offset); rows with
    write_entry < 0 (padding) write nothing to the cache. The rotation is `_rope_half_kernel`'s."""
    await_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BD]
    md = d < HALF
    is_q = slot < HQ
    hk = (slot - HQ).to(tl.int64)
    entry = tl.load(went_ptr + r * stride_w).to(tl.int64)
    off = tl.load(woff_ptr + r * stride_o).to(tl.int64)
    mq = is_q & md
    mk = (slot >= HQ) & (slot < HQ + HK) & md & (entry >= 0)
    src = tl.where(is_q, q_ptr + r * stride_qr + slot * stride_qh, k_ptr + r * stride_kr + hk * stride_kh)
    x1 = tl.load(src + d, mask=mq | mk, other=0.0).to(tl.float32)
    x2 = tl.load(src + d + HALF, mask=mq | mk, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + r * stride_cr + d, mask=md, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + r * stride_cr + HALF + d, mask=md, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + r * stride_sr + d, mask=md, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + r * stride_sr + HALF + d, mask=md, other=0.0).to(tl.float32)
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)
    o1, o2 = to_bf16(o1), to_bf16(o2)
    qp = q_out_ptr + r * stride_or + slot * stride_oh + d
    tl.store(qp, o1, mask=mq)
    tl.store(qp + HALF, o2, mask=mq)
    dst = (entry + layer_id) * stride_e + off * stride_s + hk * stride_ch + d
    tl.store(kc_ptr + dst, o1.to(kc_ptr.dtype.element_ty), mask=mk)
    tl.store(kc_ptr + dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mk)
    vp = v_ptr + r * stride_vr + hk * stride_vh + d
    tl.store(vc_ptr + dst, tl.load(vp, mask=mk).to(vc_ptr.dtype.element_ty), mask=mk)
    tl.store(vc_ptr + dst + HALF, tl.load(vp + HALF, mask=mk).to(vc_ptr.dtype.element_ty), mask=mk)


# Elements (head x pair) per program. 4096 made Huginn's [64 heads, 64 pairs] tile one program of 4 warps,
# 20 µs per call on the H200, no faster than eager (bench/results/h200/kernels/); elementwise
# work, so the tile only changes which program computes an element, never its bits.
TILE_ELEMENTS = 1024


def _blocks(heads: int, block_d: int) -> tuple[int, int]:
    block_h = max(1, min(triton.next_power_of_2(heads), TILE_ELEMENTS // block_d))
    return block_h, triton.cdiv(heads, block_h)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def supported_half(q, k, cos, sin) -> bool:
    return (
        q.is_cuda
        and q.dim() == 3
        and k.dim() == 3
        and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and q.shape[-1] % 2 == 0
        and q.shape[0] > 0
    )


def rope_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`RotaryHalf.forward(q, k, cos, sin)`: q [R, Hq, D], k [R, Hk, D], cos/sin [R, D] (bf16)."""
    if not supported_half(q, k, cos, sin):
        c, s = cos[:, None, :], sin[:, None, :]

        def rot(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        return q * c + rot(q) * s, k * c + rot(k) * s
    cos, sin = _inner_contiguous(cos), _inner_contiguous(sin)
    outs = []
    for x in (q, k):
        x = _inner_contiguous(x)
        r, h, d = x.shape
        out = torch.empty((r, h, d), dtype=x.dtype, device=x.device)
        block_d = triton.next_power_of_2(d // 2)
        block_h, grid_h = _blocks(h, block_d)
        _rope_half_kernel[(r, grid_h)](
            x,
            cos,
            sin,
            out,
            h,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin.stride(0),
            out.stride(0),
            out.stride(1),
            HALF=d // 2,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=4,
            **pdl_args(),
            **EXACT_OPTIONS,
        )
        outs.append(out)
    return outs[0], outs[1]


def rope_half_write_kv(q, k, v, cos, sin, k_cache, v_cache, write_entry, write_offset, layer_id: int):
    """`RotaryHalf.forward(q, k, cos, sin)` then `paged_attention.write_kv` of the rotated k and of v, one
    launch; returns the rotated q. k_cache/v_cache: the entry view `[E, block_size, KVH, D]`; write_entry
    and write_offset `[R]` int64 (may be strided). The rotated k exists only in the cache."""
    r, hq, d = q.shape
    hk = k.shape[1]
    if not supported_half(q, k, cos, sin) or v.shape != k.shape or k_cache.shape[2:] != (hk, d):
        raise ValueError(f"rope_half_write_kv: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    q, k, v = _inner_contiguous(q), _inner_contiguous(k), _inner_contiguous(v)
    cos, sin = _inner_contiguous(cos), _inner_contiguous(sin)
    out = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    block_d = triton.next_power_of_2(d // 2)
    block_h, grid_h = _blocks(hq + hk, block_d)
    _rope_half_write_kernel[(r, grid_h)](
        q,
        k,
        v,
        cos,
        sin,
        out,
        k_cache,
        v_cache,
        write_entry,
        write_offset,
        layer_id,
        hq,
        hk,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        write_entry.stride(0),
        write_offset.stride(0),
        HALF=d // 2,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
        **pdl_args(),
        **EXACT_OPTIONS,
    )
    return out


def supported_interleaved(q, k, cos, sin, qk_bias) -> bool:
    return (
        q.is_cuda
        and q.dim() == 3
        and k.dim() == 3
        and q.dtype == k.dtype == torch.bfloat16
        and cos.dtype == sin.dtype == torch.float32
        and q.shape[-1] % 2 == 0
        and q.shape[0] > 0
        and (qk_bias is None or qk_bias.dtype == q.dtype)
    )


def rope_interleaved_eager(q, k, cos, sin, qk_bias=None):
    if qk_bias is not None:
        q = q + qk_bias[0]
        k = k + qk_bias[1]
    heads_q = q.shape[1]
    qk = torch.cat([q, k], dim=1).unflatten(-1, (-1, 2)).float()
    c, s = cos[:, None, :], sin[:, None, :]
    x0, x1 = qk[..., 0], qk[..., 1]
    rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
    rotated = rotated.type_as(q)
    return rotated[:, :heads_q], rotated[:, heads_q:]


def rope_interleaved(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_bias: torch.Tensor | None = None,
):
    """`RotaryInterleaved.forward` (after `q + qk_bias[0]`, `k + qk_bias[1]` when qk_bias is given).

    q [R, Hq, D], k [R, Hk, D] bf16; cos/sin [R, D/2] fp32 (any strides); qk_bias [2, 1, H, D] bf16.
    Returns views of one [R, Hq + Hk, D] buffer, like the eager code.
    """
    if not supported_interleaved(q, k, cos, sin, qk_bias):
        return rope_interleaved_eager(q, k, cos, sin, qk_bias)
    r, hq, d = q.shape
    hk = k.shape[1]
    out = torch.empty((r, hq + hk, d), dtype=q.dtype, device=q.device)
    block_d = triton.next_power_of_2(d // 2)
    for idx, (x, h0) in enumerate(((q, 0), (k, hq))):
        x = _inner_contiguous(x)
        h = x.shape[1]
        dst = out[:, h0 : h0 + h]
        if qk_bias is not None:
            b = _inner_contiguous(qk_bias[idx].reshape(h, d))
            bias, stride_bh = b, b.stride(0)
        else:
            bias, stride_bh = x, 0
        block_h, grid_h = _blocks(h, block_d)
        _rope_interleaved_kernel[(r, grid_h)](
            x,
            bias,
            cos,
            sin,
            dst,
            h,
            x.stride(0),
            x.stride(1),
            stride_bh,
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            dst.stride(0),
            dst.stride(1),
            HALF=d // 2,
            HAS_BIAS=qk_bias is not None,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=4,
            **pdl_args(),
            **EXACT_OPTIONS,
        )
    return out[:, :hq], out[:, hq:]


__all__ = [
    "rope_half",
    "rope_half_write_kv",
    "rope_interleaved",
    "rope_interleaved_eager",
    "supported_half",
    "supported_interleaved",
]
