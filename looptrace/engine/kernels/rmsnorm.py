"""Exact RMSNorm (HF/raven form of `looptrace.engine.layers.RMSNorm`), bit-identical to eager on CUDA.

Eager: `h = x.float(); h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); h.to(x.dtype) * weight`.

Two forms (exactness.md §2, §5):
- three kernels: Triton square -> PyTorch `mean` (the same ATen kernel on the same contiguous fp32 tensor,
  so the same order whatever the version) -> fenced Triton tail. Works for every shape.
- one kernel: replays PyTorch's `mean(-1)` order for the row bucket (lanes per row from the row count,
  4 strided accumulators per lane, shared-memory halving, warp-shuffle tree, `sum * fl32(M / (M*N))`).
  Only shapes whose eager mean splits a row across lanes alone (`ReduceShape.one_kernel_ok`); a shape whose
  mean would split across warps falls back to three kernels.
`residual_rms_norm` chains post-norm, residual add and the next pre-norm of a sandwich block in one
launch (two one-kernel norms around ATen's bf16 add), where eager runs three ops.
Importing this module imports Triton.
"""

from __future__ import annotations

import torch

from looptrace.engine.kernels.device_helpers import (
    EXACT_OPTIONS,
    add_rn,
    await_inputs,
    mul_rn,
    round_bf16,
    rsqrt_approx,
    to_bf16,
    triton,
)
from looptrace.engine.kernels.launch_mode import pdl_args
from looptrace.engine.kernels.reduce_order import VEC, default_shuffle_order, mean_factor, reduce_shape

tl = triton.language

# Shuffle order of the one-kernel mean: None = the torch-version default; calibrate() may set it, or
# disable the one-kernel form (False) when neither order matches on this GPU / torch build.
_ORDER: str | None = None
_ONE_KERNEL_ENABLED = True
# The residual norm's one-pass form for rows of one vector per lane (`_residual_norm_lanes`); False runs
# the step form at every width (the same bits: bench/token_ablation.py measures one against the other).
ONE_PASS_ROWS = True


@triton.jit
def _square_kernel(x_ptr, sq_ptr, stride_xm, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(sq_ptr + row.to(tl.int64) * N + cols, mul_rn(x, x), mask=m)


@triton.jit
def _norm_tail(x_row, w_ptr, out_row, r, N: tl.constexpr, CHUNK: tl.constexpr, OUT_BF16: tl.constexpr):
    """out = rn( rn_bf16(x * r) * w ) over the row at `x_row` into `out_row`, CHUNK columns at a time;
    r: fp32 [1] tensor."""
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        m = cols < N
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        h = round_bf16(mul_rn(x, r))
        o = mul_rn(h, w)
        if OUT_BF16:
            tl.store(out_row + cols, to_bf16(o), mask=m)
        else:
            tl.store(out_row + cols, o, mask=m)


@triton.jit
def _tail_kernel(
    x_ptr,
    mean_ptr,
    w_ptr,
    out_ptr,
    stride_xm,
    stride_om,
    eps,
    N: tl.constexpr,
    CHUNK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    await_inputs(PDL)
    row = tl.program_id(0)
    mean = tl.load(mean_ptr + row + tl.zeros([1], tl.int32))
    r = rsqrt_approx(add_rn(mean, tl.full([1], eps, tl.float32)))
    rows = row.to(tl.int64)
    _norm_tail(x_ptr + rows * stride_xm, w_ptr, out_ptr + rows * stride_om, r, N, CHUNK, OUT_BF16)


@triton.jit
def _halve(s, HALF: tl.constexpr, ADJACENT: tl.constexpr):
    """[1, 2 HALF] -> [1, HALF]: v[x] + v[x + HALF] (halving / descending shuffle) or v[2x] + v[2x + 1]."""
    pairs = tl.reshape(s, [1, HALF, 2]) if ADJACENT else tl.permute(tl.reshape(s, [1, 2, HALF]), (0, 2, 1))
    lo, hi = tl.split(pairs)
    return add_rn(lo, hi)


@triton.jit
def row_mean(base, factor, N: tl.constexpr, LANES: tl.constexpr, K: tl.constexpr, DESC: tl.constexpr):
    """mean(x^2) of the bf16 row at `base`, summed in PyTorch's order for the row bucket; fp32 [1]."""
    return _lane_mean(base, base, base, 1.0, factor, N, LANES, K, DESC, False)


@triton.jit
def residual_value(y, h, wy, r):
    """The residual add of a sandwich block before its bf16 rounding: `h + rn_bf16(rn_bf16(y * r) * wy)`
    (post-norm of y with its rsqrt r, ATen's bf16 add in fp32). Shared with the GEMV's norm prologue."""
    normed = round_bf16(mul_rn(round_bf16(mul_rn(y, r)), wy))  # the bf16 output of the post-norm
    return add_rn(h, normed)


@triton.jit
def residual_row_mean(y_base, h_base, wy_ptr, r, factor, N: tl.constexpr, LANES: tl.constexpr,
                      K: tl.constexpr, DESC: tl.constexpr):  # fmt: skip
    """`row_mean` of the bf16 row `h + post(y)` computed on the fly (the lanes read y, h and wy where
    `row_mean` would read the stored row): the same values in the same order, so the same bits."""
    return _lane_mean(y_base, h_base, wy_ptr, r, factor, N, LANES, K, DESC, True)


@triton.jit
def _lane_mean(base, h_base, wy_ptr, r, factor, N: tl.constexpr, LANES: tl.constexpr, K: tl.constexpr,
               DESC: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    """The row mean of squares in PyTorch's order; the row is the bf16 values at `base`, or (RESIDUAL) the
    residual row `h + post(y)` computed from y at `base`, h at `h_base` and wy (`_stored_residual`)."""
    lanes = tl.arange(0, LANES)[None, :]  # [1, LANES]
    n_vec = N // 4
    acc0 = tl.zeros([1, LANES], tl.float32)
    acc1 = tl.zeros([1, LANES], tl.float32)
    acc2 = tl.zeros([1, LANES], tl.float32)
    acc3 = tl.zeros([1, LANES], tl.float32)
    # lane x reads vectors x, x + LANES, x + 2 LANES, ...; accumulator i takes element i of each vector
    for k in tl.static_range(K):
        vec = k * LANES + lanes
        m = vec < n_vec
        x0 = _lane_value(base, h_base, wy_ptr, r, vec * 4 + 0, m, RESIDUAL)
        x1 = _lane_value(base, h_base, wy_ptr, r, vec * 4 + 1, m, RESIDUAL)
        x2 = _lane_value(base, h_base, wy_ptr, r, vec * 4 + 2, m, RESIDUAL)
        x3 = _lane_value(base, h_base, wy_ptr, r, vec * 4 + 3, m, RESIDUAL)
        acc0 = add_rn(acc0, mul_rn(x0, x0))
        acc1 = add_rn(acc1, mul_rn(x1, x1))
        acc2 = add_rn(acc2, mul_rn(x2, x2))
        acc3 = add_rn(acc3, mul_rn(x3, x3))
    return _lanes_mean(acc0, acc1, acc2, acc3, factor, LANES, DESC)


@triton.jit
def _lane_value(base, h_base, wy_ptr, r, cols, m, RESIDUAL: tl.constexpr):
    """fp32 value of the row at `cols`, 0 where masked: the stored bf16 row, or the residual row."""
    if RESIDUAL:
        return _stored_residual(base, h_base, wy_ptr, r, cols, m)
    return tl.load(base + cols, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _stored_residual(y_base, h_base, wy_ptr, r, cols, m):
    """fp32 value of the stored bf16 residual row at `cols` (0 where masked, as `row_mean` loads it)."""
    y = tl.load(y_base + cols, mask=m, other=0.0).to(tl.float32)
    h = tl.load(h_base + cols, mask=m, other=0.0).to(tl.float32)
    wy = tl.load(wy_ptr + cols, mask=m, other=0.0).to(tl.float32)
    return _residual_lane(y, h, wy, r, m)


@triton.jit
def _lanes_mean(acc0, acc1, acc2, acc3, factor, LANES: tl.constexpr, DESC: tl.constexpr):
    """The lanes' four accumulators -> the row mean, in PyTorch's block reduction order."""
    s = add_rn(add_rn(add_rn(acc0, acc1), acc2), acc3)  # [1, LANES]
    # block_x_reduce: shared-memory halving v[x] += v[x + off] for off = LANES/2 .. 32, then the warp
    # shuffle v[x] += v[x + off] (descending 16..1) or adjacent-first (ascending 1..16)
    if LANES >= 512:
        s = _halve(s, 256, False)
    if LANES >= 256:
        s = _halve(s, 128, False)
    if LANES >= 128:
        s = _halve(s, 64, False)
    if LANES >= 64:
        s = _halve(s, 32, False)
    s = _halve(s, 16, not DESC)
    s = _halve(s, 8, not DESC)
    s = _halve(s, 4, not DESC)
    s = _halve(s, 2, not DESC)
    s = _halve(s, 1, not DESC)
    total = tl.reshape(s, [1])
    return mul_rn(total, tl.full([1], factor, tl.float32))


@triton.jit
def _fused_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    mean_ptr,
    stride_xm,
    stride_om,
    factor,
    eps,
    N: tl.constexpr,
    LANES: tl.constexpr,
    K: tl.constexpr,
    DESC: tl.constexpr,
    CHUNK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    STORE_MEAN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    await_inputs(PDL)
    row = tl.program_id(0)
    mean = row_mean(x_ptr + row.to(tl.int64) * stride_xm, factor, N, LANES, K, DESC)
    if STORE_MEAN:
        tl.store(mean_ptr + row + tl.zeros([1], tl.int32), mean)
    r = rsqrt_approx(add_rn(mean, tl.full([1], eps, tl.float32)))
    rows = row.to(tl.int64)
    _norm_tail(x_ptr + rows * stride_xm, w_ptr, out_ptr + rows * stride_om, r, N, CHUNK, OUT_BF16)


@triton.jit
def _residual_norm_kernel(
    y_ptr,
    wy_ptr,
    h_ptr,
    h_out_ptr,
    wn_ptr,
    out_ptr,
    stride_y,
    stride_h,
    stride_ho,
    stride_o,
    factor,
    eps_y,
    eps_n,
    N: tl.constexpr,
    LANES: tl.constexpr,
    K: tl.constexpr,
    DESC: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
    ONE_PASS: tl.constexpr = True,
):
    """h_out = h + norm(y) * wy (bf16 add), out = norm(h_out) * wn: three eager ops, one program per row."""
    await_inputs(PDL)
    rows = tl.program_id(0).to(tl.int64)
    residual_norm_row(
        y_ptr + rows * stride_y,
        wy_ptr,
        h_ptr + rows * stride_h,
        h_out_ptr + rows * stride_ho,
        wn_ptr,
        out_ptr + rows * stride_o,
        factor,
        eps_y,
        eps_n,
        N,
        LANES,
        K,
        DESC,
        CHUNK,
        ONE_PASS,
    )


@triton.jit
def residual_norm_row(y_row, wy_ptr, h_row, h_out_row, wn_ptr, out_row, factor, eps_y, eps_n,
                      N: tl.constexpr, LANES: tl.constexpr, K: tl.constexpr, DESC: tl.constexpr,
                      CHUNK: tl.constexpr, ONE_PASS: tl.constexpr = True):  # fmt: skip
    """One row of `_residual_norm_kernel` (h_out = h + post(y), out = nxt(h_out)) by the calling program;
    also the epilogue of the GEMV's NORM_OUT form, so both compute the same bits. A row of one vector per
    lane (K == 1: one-row launches up to 2,048 wide) takes `_residual_norm_lanes`, the same values in one
    pass (`ONE_PASS`, off only to measure the step form: `ONE_PASS_ROWS`); wider rows read the row again
    for each step."""
    if K == 1 and ONE_PASS:
        _residual_norm_lanes(y_row, wy_ptr, h_row, h_out_row, wn_ptr, out_row, factor, eps_y, eps_n, N, LANES,
                             DESC)  # fmt: skip
    else:
        _residual_norm_passes(y_row, wy_ptr, h_row, h_out_row, wn_ptr, out_row, factor, eps_y, eps_n, N,
                              LANES, K, DESC, CHUNK)  # fmt: skip


@triton.jit
def _residual_norm_passes(y_row, wy_ptr, h_row, h_out_row, wn_ptr, out_row, factor, eps_y, eps_n,
                          N: tl.constexpr, LANES: tl.constexpr, K: tl.constexpr, DESC: tl.constexpr,
                          CHUNK: tl.constexpr):  # fmt: skip
    """`residual_norm_row` in steps that each read their inputs from memory: the mean of y, h_out stored,
    the mean of h_out read back, out from h_out read back."""
    mean = row_mean(y_row, factor, N, LANES, K, DESC)
    r = rsqrt_approx(add_rn(mean, tl.full([1], eps_y, tl.float32)))
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        m = cols < N
        y = tl.load(y_row + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(wy_ptr + cols, mask=m, other=0.0).to(tl.float32)
        h = tl.load(h_row + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(h_out_row + cols, to_bf16(residual_value(y, h, w, r)), mask=m)
    # The next norm reads the new residual row back in its own lane order: every thread's stores above
    # must be visible to the whole program first.
    tl.debug_barrier()
    mean_n = row_mean(h_out_row, factor, N, LANES, K, DESC)
    r_n = rsqrt_approx(add_rn(mean_n, tl.full([1], eps_n, tl.float32)))
    _norm_tail(h_out_row, wn_ptr, out_row, r_n, N, CHUNK, True)


@triton.jit
def _lane_vec(ptr, vec, m):
    """Each lane's 4-vector (the layout `_lane_mean` reads) as four fp32 `[1, LANES]` components, 0 where
    masked."""
    base = ptr + vec * 4
    return (
        tl.load(base + 0, mask=m, other=0.0).to(tl.float32),
        tl.load(base + 1, mask=m, other=0.0).to(tl.float32),
        tl.load(base + 2, mask=m, other=0.0).to(tl.float32),
        tl.load(base + 3, mask=m, other=0.0).to(tl.float32),
    )


@triton.jit
def _squares_mean(x0, x1, x2, x3, factor, LANES: tl.constexpr, DESC: tl.constexpr):
    """`_lane_mean` of values already in registers (one vector per lane): the same adds in the same order."""
    zero = tl.zeros([1, LANES], tl.float32)
    acc0, acc1 = add_rn(zero, mul_rn(x0, x0)), add_rn(zero, mul_rn(x1, x1))
    acc2, acc3 = add_rn(zero, mul_rn(x2, x2)), add_rn(zero, mul_rn(x3, x3))
    return _lanes_mean(acc0, acc1, acc2, acc3, factor, LANES, DESC)


@triton.jit
def _residual_lane(y, res, wy, r, m):
    """The bf16-rounded residual value (0 where masked, as a stored row reads): of one lane component here,
    of the columns `_stored_residual` loads there."""
    return tl.where(m, round_bf16(residual_value(y, res, wy, r)), 0.0)


@triton.jit
def _store_lanes(out_row, vec, m, x0, x1, x2, x3):
    """The four components back to their columns, rounded to bf16."""
    tl.store(out_row + vec * 4 + 0, to_bf16(x0), mask=m)
    tl.store(out_row + vec * 4 + 1, to_bf16(x1), mask=m)
    tl.store(out_row + vec * 4 + 2, to_bf16(x2), mask=m)
    tl.store(out_row + vec * 4 + 3, to_bf16(x3), mask=m)


@triton.jit
def _normed(h, wn, r):
    """`_norm_tail`'s arithmetic before its store: rn_bf16(h * r) * wn."""
    return mul_rn(round_bf16(mul_rn(h, r)), wn)


@triton.jit
def _residual_norm_lanes(y_row, wy_ptr, h_row, h_out_row, wn_ptr, out_row, factor, eps_y, eps_n,
                         N: tl.constexpr, LANES: tl.constexpr, DESC: tl.constexpr):  # fmt: skip
    """`_residual_norm_passes` for a row of at most one 4-vector per lane, in one pass: y, h, wy and wn
    are loaded once, up front, in the lanes' layout; both means reduce the values held in registers in
    `_lane_mean`'s order (h_out's as its stored bf16 values), so every result has the same bits. The
    multi-step form waits on a memory round trip per step (mean, h_out, mean of h_out, out)."""
    vec = tl.arange(0, LANES)[None, :]
    m = vec < N // 4
    y0, y1, y2, y3 = _lane_vec(y_row, vec, m)
    s0, s1, s2, s3 = _lane_vec(h_row, vec, m)
    a0, a1, a2, a3 = _lane_vec(wy_ptr, vec, m)
    b0, b1, b2, b3 = _lane_vec(wn_ptr, vec, m)
    r = rsqrt_approx(
        add_rn(_squares_mean(y0, y1, y2, y3, factor, LANES, DESC), tl.full([1], eps_y, tl.float32))
    )
    h0, h1 = _residual_lane(y0, s0, a0, r, m), _residual_lane(y1, s1, a1, r, m)
    h2, h3 = _residual_lane(y2, s2, a2, r, m), _residual_lane(y3, s3, a3, r, m)
    _store_lanes(h_out_row, vec, m, h0, h1, h2, h3)
    mean_n = _squares_mean(h0, h1, h2, h3, factor, LANES, DESC)
    r_n = rsqrt_approx(add_rn(mean_n, tl.full([1], eps_n, tl.float32)))
    _store_lanes(out_row, vec, m, _normed(h0, b0, r_n), _normed(h1, b1, r_n), _normed(h2, b2, r_n),
                 _normed(h3, b3, r_n))  # fmt: skip


def _prep(x: torch.Tensor, weight: torch.Tensor):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.result_type(torch.empty(0, dtype=x.dtype), weight)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    return x2, weight.contiguous(), out, out_dtype == torch.bfloat16


def chunk_columns(n: int) -> int:
    """Columns of a row the chunked kernels (three-kernel tail, residual norms) take per step."""
    return min(triton.next_power_of_2(n), 2048)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype in (torch.bfloat16, torch.float32)
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and x.numel() > 0
    )


def rms_norm_three(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton square -> torch mean -> fenced Triton tail. Same result as eager for every shape."""
    x2, w, out, out_bf16 = _prep(x, weight)
    m, n = x2.shape
    sq = torch.empty((m, n), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    _square_kernel[(m, triton.cdiv(n, block))](
        x2, sq, x2.stride(0), n, BLOCK=block, num_warps=4, **pdl_args(), **EXACT_OPTIONS
    )
    mean = sq.mean(-1, keepdim=True)
    _tail_kernel[(m,)](
        x2,
        mean,
        w,
        out,
        x2.stride(0),
        out.stride(0),
        eps,
        n,
        CHUNK=chunk_columns(n),
        OUT_BF16=out_bf16,
        num_warps=4,
        **pdl_args(),
        **EXACT_OPTIONS,
    )
    return out.view(*x.shape[:-1], n)


def one_kernel_warps(lanes: int) -> int:
    """Warps of a one-kernel launch: at most one thread per lane. With more threads than lanes the
    [1, LANES] accumulators are replicated and the kernel ran 7-60x slower on the H200 (8 rows of
    Ouro's width: 22.9 µs with 4 warps, 2.3 µs with 2; bench/results/h200/kernels/); 4 warps
    were the fastest for 128-512 lanes. The bits do not depend on it: every add is spelled out."""
    return max(1, min(lanes // 32, 4))


def one_kernel_ok(rows: int, width: int) -> bool:
    return _ONE_KERNEL_ENABLED and reduce_shape(rows, width).one_kernel_ok


def rms_norm_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    order: str | None = None,
    mean_out: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """One kernel replaying PyTorch's mean order; falls back to `rms_norm_three` where it cannot.
    num_warps: the launch's warps (layout only: every add's order is spelled out, so any count gives the
    same bits); None = the default for the row's lane count."""
    x2, w, out, out_bf16 = _prep(x, weight)
    m, n = x2.shape
    shape = reduce_shape(m, n)
    if not shape.one_kernel_ok or (order is None and not _ONE_KERNEL_ENABLED):
        return rms_norm_three(x, weight, eps)
    order = order or _ORDER or default_shuffle_order()
    lanes = shape.lanes
    _fused_kernel[(m,)](
        x2,
        w,
        out,
        mean_out if mean_out is not None else out,
        x2.stride(0),
        out.stride(0),
        mean_factor(m, n),
        eps,
        n,
        LANES=lanes,
        K=shape.vectors_per_lane,
        DESC=order == "desc",
        CHUNK=chunk_columns(n),
        OUT_BF16=out_bf16,
        STORE_MEAN=mean_out is not None,
        num_warps=num_warps or one_kernel_warps(lanes),
        **pdl_args(),
        **EXACT_OPTIONS,
    )
    return out.view(*x.shape[:-1], n)


def residual_supported(y: torch.Tensor, residual: torch.Tensor, w_post, w_next) -> bool:
    rows, n = y.numel() // max(y.shape[-1], 1), y.shape[-1]
    return (
        _ONE_KERNEL_ENABLED
        and y.shape == residual.shape
        and residual.dtype == torch.bfloat16
        and all(supported(y, w) and w.dtype == torch.bfloat16 for w in (w_post, w_next))
        and reduce_shape(rows, n).one_kernel_ok
    )


def residual_rms_norm(
    y: torch.Tensor,
    w_post: torch.Tensor,
    eps_post: float,
    residual: torch.Tensor,
    w_next: torch.Tensor,
    eps_next: float,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = residual + norm_post(y); return h, norm_next(h)` (the sandwich block's post-norm, residual add
    and the next pre-norm), bit for bit, in one kernel. Both norms are one-kernel RMSNorms with PyTorch's
    mean order of the row bucket; the add is ATen's bf16 add (fp32 sum rounded to nearest even). Shapes the
    one-kernel form cannot replay, other dtypes and CPU tensors take the eager ops."""
    if not residual_supported(y, residual, w_post, w_next):
        h = residual + rms_norm(y, w_post, eps_post)
        return h, rms_norm(h, w_next, eps_next)
    n = y.shape[-1]
    y2, h2 = y.reshape(-1, n), residual.reshape(-1, n)
    y2 = y2 if y2.stride(-1) == 1 else y2.contiguous()
    h2 = h2 if h2.stride(-1) == 1 else h2.contiguous()
    m = y2.shape[0]
    h_out = torch.empty((m, n), dtype=torch.bfloat16, device=y.device)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=y.device)
    shape = reduce_shape(m, n)
    _residual_norm_kernel[(m,)](
        y2,
        w_post.contiguous(),
        h2,
        h_out,
        w_next.contiguous(),
        out,
        y2.stride(0),
        h2.stride(0),
        h_out.stride(0),
        out.stride(0),
        mean_factor(m, n),
        eps_post,
        eps_next,
        n,
        LANES=shape.lanes,
        K=shape.vectors_per_lane,
        DESC=shuffle_order() == "desc",
        CHUNK=chunk_columns(n),
        ONE_PASS=ONE_PASS_ROWS,
        num_warps=num_warps or one_kernel_warps(shape.lanes),
        **pdl_args(),
        **EXACT_OPTIONS,
    )
    return h_out.view(residual.shape), out.view(residual.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str = "auto") -> torch.Tensor:
    """`RMSNorm.forward` of the engine, exact. form: 'auto' (one kernel where replayable), 'one', 'three'."""
    if not supported(x, weight):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return h.to(x.dtype) * weight
    if form == "three":
        return rms_norm_three(x, weight, eps)
    return rms_norm_fused(x, weight, eps)


def shuffle_order() -> str:
    """The warp-shuffle order of the one-kernel mean in use (calibrated, else the torch-version default)."""
    return _ORDER or default_shuffle_order()


def set_order(order: str | None, one_kernel: bool = True) -> None:
    global _ORDER, _ONE_KERNEL_ENABLED
    _ORDER, _ONE_KERNEL_ENABLED = order, one_kernel


__all__ = [
    "VEC",
    "chunk_columns",
    "one_kernel_ok",
    "one_kernel_warps",
    "residual_rms_norm",
    "residual_supported",
    "rms_norm",
    "rms_norm_fused",
    "rms_norm_three",
    "residual_row_mean",
    "residual_value",
    "set_order",
    "shuffle_order",
    "supported",
]
