"""The GEMV's entry points (`kernels.gemv` and its fused forms; design in the package docstring): `linear`,
the drop-in for `F.linear`, and the one-row GEMVs that compute their input row (`X_FORM`) or finish the
exact kernel after them (`Y_FORM`), each with the `*_fusable` check its variant asks first. Imports Triton."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looptrace.engine.kernels import rmsnorm
from looptrace.engine.kernels.gemv import tiles
from looptrace.engine.kernels.gemv.kernel import (
    NORM_OUT,
    PLAIN,
    RESIDUAL_NORM,
    SILU_MUL,
    SILU_OUT,
    check_weight,
    gemv,
    launch,
    unused_inputs,
)
from looptrace.engine.kernels.gemv.tiles import one_row_config, routes, split_for
from looptrace.engine.kernels.reduce_order import mean_factor, reduce_shape


def silu_mul_fusable(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> bool:
    """`silu_mul_linear` runs as one fused GEMV: one routed bf16 row, gate and up of one shape with unit
    inner stride, and a weight `[N, K]` with K contiguous."""
    return (
        routes(gate, weight)
        and up.shape == gate.shape
        and up.dtype == gate.dtype
        and gate.stride(-1) == up.stride(-1) == 1
        and weight.shape[1] == gate.shape[-1]
        and one_row_config(weight.shape[0], gate.shape[-1]) is not None
    )


def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`gemv(silu_mul(gate, up), weight)` in one launch (`kernels.gemv_silu`): each program computes
    SiLU·mul of its own K slice with `silu_mul.py`'s fenced arithmetic, so the result is bitwise the two
    launches'. Call only where `silu_mul_fusable`."""
    k = gate.shape[-1]
    check_weight(weight, k)
    x2 = gate.reshape(1, k)
    form = {**unused_inputs(x2), "u_ptr": up.reshape(1, k)}
    y = launch(x2, weight, one_row_config(weight.shape[0], k), form, dict(X_FORM=SILU_MUL))
    return y.reshape(*gate.shape[:-1], weight.shape[0])


def residual_norm_fusable(y: torch.Tensor, residual: torch.Tensor, w_post, w_next, weight) -> bool:
    """`residual_norm_linear` runs as one fused GEMV: where `rmsnorm.residual_rms_norm` takes its one-kernel
    form and the projection is one routed row through the CUDA-core GEMV."""
    return (
        routes(y, weight)
        and y.stride(-1) == residual.stride(-1) == 1
        and weight.shape[1] == y.shape[-1]
        and rmsnorm.residual_supported(y, residual, w_post, w_next)
        and one_row_config(weight.shape[0], y.shape[-1]) is not None
    )


def residual_norm_linear(y, w_post, eps_post: float, residual, w_next, eps_next: float, weight):
    """`h, x = residual_rms_norm(y, w_post, eps_post, residual, w_next, eps_next); return gemv(x, weight), h`
    in one launch (`kernels.gemv_norm`): every program computes both row norms itself (PyTorch's mean
    order, rmsnorm's helpers) and its K slice of x; program (0, 0) stores h. Bitwise the two launches'.
    Call only where `residual_norm_fusable`."""
    k = y.shape[-1]
    check_weight(weight, k)
    shape = reduce_shape(1, k)
    h = torch.empty_like(residual)
    form = dict(
        u_ptr=y, res_ptr=residual.reshape(1, k), wy_ptr=w_post.contiguous(), wn_ptr=w_next.contiguous(),
        h_ptr=h, x_out_ptr=y, factor=mean_factor(1, k), eps_y=eps_post, eps_n=eps_next,
    )  # fmt: skip
    order = rmsnorm.shuffle_order()
    consts = dict(LANES=shape.lanes, VECS=shape.vectors_per_lane, DESC=order == "desc", CHUNK=min(k, 2048))
    out = launch(y.reshape(1, k), weight, one_row_config(weight.shape[0], k), form,
                  dict(X_FORM=RESIDUAL_NORM, **consts))  # fmt: skip
    return out.reshape(*y.shape[:-1], weight.shape[0]), h


# ------------------------------------------------------------------------ GEMVs with a fused output form


def gate_up_silu_fusable(x: torch.Tensor, weight: torch.Tensor, route_rows: int = tiles.ROUTE_ROWS) -> bool:
    """`gate_up_silu` runs as one fused GEMV: routed bf16 rows (one, through the CUDA-core GEMV; up to
    `route_rows` under `kernels.gemv_batch`, through the table's many-row config) and a stacked `[gate; up]`
    weight (an even number of rows, a column block of at least one gate and one up row), where the plain
    GEMV would not split K (the form runs one split: with a split, its sums would differ)."""
    n, k = weight.shape
    rows = x.numel() // max(1, x.shape[-1])
    cfg = one_row_config(n, k) if rows == 1 else tiles.pick_config(rows, n, k)
    return (
        tiles.takes_rows(rows, weight, route_rows)
        and tiles.supported(x, weight, None)
        and x.stride(-1) == 1
        and k == x.shape[-1]
        and n % 2 == 0
        and cfg is not None
        and cfg.block_n >= 2
        and split_for(n, k, cfg)[0] == 1
    )


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_mul(*gemv(x, weight).chunk(2, -1))` in one launch (`kernels.gemv_silu_out`): each program
    computes a block of gate columns and the same block of up columns (the plain GEMV's products, in its
    order) and stores SiLU·mul of them with `silu_mul.py`'s fenced arithmetic, so the result is bitwise the
    two launches'. `weight` is `[gate; up]` (`[2 I, K]`); returns `[..., I]`. More than one row
    (`kernels.gemv_batch`): the table's many-row config, each row's gate and up in the same program. Call
    only where `gate_up_silu_fusable`."""
    k = x.shape[-1]
    check_weight(weight, k)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    cfg = one_row_config(weight.shape[0], k) if m == 1 else tiles.pick_config(m, weight.shape[0], k)
    y = launch(x2, weight, cfg, consts=dict(X_FORM=PLAIN), y_form=SILU_OUT)
    return y.reshape(*x.shape[:-1], weight.shape[0] // 2)


def linear_norm_fusable(
    a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, w_post, w_next
) -> bool:
    """`linear_residual_norm` runs as one fused GEMV: one routed bf16 row through the CUDA-core GEMV whose
    output row `[1, N]` the one-kernel residual norm takes (`rmsnorm.residual_supported`)."""
    return (
        routes(a, weight)
        and weight.shape[1] == a.shape[-1]
        and residual.shape[-1] == weight.shape[0]
        and residual.numel() == weight.shape[0]
        and residual.stride(-1) == 1
        and rmsnorm.residual_supported(residual, residual, w_post, w_next)
        and one_row_config(weight.shape[0], a.shape[-1]) is not None
    )


def linear_residual_norm(a, weight, w_post, eps_post: float, residual, w_next, eps_next: float):
    """`residual_rms_norm(gemv(a, weight), w_post, eps_post, residual, w_next, eps_next)` in one launch
    (`kernels.gemv_norm_out`): the program that completes the row's last column block runs the residual
    norm over the whole row with the exact kernel's code (`rmsnorm.residual_norm_row`), so h and x are
    bitwise the two launches'. Returns (h, x), each shaped like `residual`. Call only where
    `linear_norm_fusable`."""
    k, n = a.shape[-1], weight.shape[0]
    check_weight(weight, k)
    shape = reduce_shape(1, n)
    h, x = torch.empty_like(residual), torch.empty_like(residual)
    form = dict(
        u_ptr=a, res_ptr=residual.reshape(1, n), wy_ptr=w_post.contiguous(), wn_ptr=w_next.contiguous(),
        h_ptr=h, x_out_ptr=x, factor=mean_factor(1, n), eps_y=eps_post, eps_n=eps_next,
    )  # fmt: skip
    desc = rmsnorm.shuffle_order() == "desc"
    consts = dict(X_FORM=PLAIN, LANES=shape.lanes, VECS=shape.vectors_per_lane, DESC=desc,
                  CHUNK=rmsnorm.chunk_columns(n), NORM_N=n)  # fmt: skip
    launch(a.reshape(1, k), weight, one_row_config(n, k), form, consts, y_form=NORM_OUT)
    return h, x


def route_rows(batch: bool) -> int:
    """Rows up to which a projection takes the GEMV: one (ROUTE_ROWS), or MAX_ROWS under
    `kernels.gemv_batch` (`batch`)."""
    return tiles.MAX_ROWS if batch else tiles.ROUTE_ROWS


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    route_rows: int = tiles.ROUTE_ROWS,
) -> torch.Tensor:
    """`F.linear` with the Triton GEMV where it applies (`tiles.supported`) and pays: at most `route_rows`
    rows (ROUTE_ROWS; `kernels.gemv_batch`: MAX_ROWS), more than one only off `tiles.CUBLAS_MANY_ROWS`."""
    rows = x.numel() // max(1, x.shape[-1])
    if tiles.takes_rows(rows, weight, route_rows) and tiles.supported(x, weight, bias):
        return gemv(x, weight)
    return F.linear(x, weight, bias)
