"""The GEMV's Triton kernel (`_gemv_kernel`), its device helpers, its launch and the plain `gemv`
(`kernels.gemv`; design in the package docstring). Imports Triton."""

from __future__ import annotations

import os

import torch

from looptrace.engine.kernels import launch_mode
from looptrace.engine.kernels.device_helpers import (
    EXACT_OPTIONS,
    add_rn,
    div_rn,
    exp_like_aten,
    let_dependents_launch,
    mul_rn,
    neg,
    round_bf16,
    rsqrt_approx,
    to_bf16,
    triton,
    wait_for_inputs,
)
from looptrace.engine.kernels.gemv.tiles import MAX_ROWS, TileConfig, pick_config, split_for
from looptrace.engine.kernels.l2_prefetch import BULK_ASM
from looptrace.engine.kernels.launch_mode import pdl_args
from looptrace.engine.kernels.rmsnorm import residual_norm_row, residual_row_mean, residual_value, row_mean
from looptrace.engine.kernels.scratch import tickets

tl = triton.language
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# Under `kernels.pdl`: prefetch each program's weight slice into L2 before waiting for the kernel before.
# Off: measured slower on the H200 (bench/results/h200/decode-token/, Ouro token at 1 row: PDL 5.52 ->
# 5.05 ms without it, 6.88 ms with it; the early programs' prefetches compete with the kernel before).
PREFETCH_UNDER_PDL = False


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def _load_x(x_ptr, stride_xm, k, kmask, M: tl.constexpr, M_PAD: tl.constexpr):
    """x rows 0..M-1 at columns k as a `[M_PAD, BLOCK_K]` tile (rows past M: 0)."""
    rows = tl.arange(0, M_PAD)
    mask = (rows < M)[:, None] & kmask[None, :]
    return tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)


# What the one-row kernel multiplies W with (`X_FORM`, a constexpr): the row x as stored (PLAIN), or a
# row it computes itself from the inputs of the exact kernel that would otherwise run before it, with that
# kernel's fenced arithmetic, so x holds the same bits and the GEMV the same sums:
# SILU_MUL: x = silu(gate) * up (`kernels.gemv_silu`: the down projection without `silu_mul.py`'s launch);
# RESIDUAL_NORM: x = nxt(h + post(y)) (`kernels.gemv_norm`: a sandwich block's residual norm folded into
# the next projection, `rmsnorm.residual_rms_norm`'s values; program (0, 0) also stores the new h).
PLAIN, SILU_MUL, RESIDUAL_NORM = 0, 1, 2

# What the one-row kernel does with its output (`Y_FORM`, a constexpr): store y (PLAIN_OUT), or finish the
# exact kernel that would otherwise run after it, with that kernel's fenced arithmetic, so the bits are the
# same as the two launches':
# SILU_OUT: W is gate/up stacked ([gate; up], 2 I rows); program j computes gate and up columns of one
# block and stores silu(gate) * up (`kernels.gemv_silu_out`: Ouro's gate/up without `silu_mul.py`'s launch);
# NORM_OUT: y is a sandwich block's output (o or down projection); the program that completes the row's
# last column block applies `rmsnorm.residual_rms_norm` to the whole row: h = res + post(y), x = nxt(h)
# (`kernels.gemv_norm_out`: without the residual norm's launch).
PLAIN_OUT, SILU_OUT, NORM_OUT = 0, 1, 2


@triton.jit
def _weight_rows(pid_n, N, BLOCK_N: tl.constexpr, Y_FORM: tl.constexpr):
    """(W rows, mask) of column block pid_n: BLOCK_N consecutive rows; SILU_OUT: BLOCK_N / 2 gate rows and
    the up rows N further (N: the output width, I). Each row's products are the plain GEMV's."""
    if Y_FORM == 1:
        j = tl.arange(0, BLOCK_N)
        col = pid_n * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        n = tl.where(j < BLOCK_N // 2, col, col + N)
        nmask = col < N
    else:
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
    return n, nmask


@triton.jit
def _store_silu_mul(acc, y_ptr, pid_n, N, BLOCK_N: tl.constexpr):
    """SILU_OUT (one row): the gate and up halves of acc rounded to bf16 as the plain GEMV stores them,
    then `silu_mul.py`'s arithmetic: rn_bf16(rn_bf16(g / (1 + exp(-g))) * u), stored to y [1, N]."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N // 2]), (1, 0)))
    g, u = round_bf16(gate), round_bf16(up)
    one = tl.full([BLOCK_N // 2], 1.0, tl.float32)
    silu = round_bf16(div_rn(g, add_rn(one, exp_like_aten(neg(g)))))
    col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + col, to_bf16(mul_rn(silu, u)), mask=col < N)


@triton.jit
def _store_silu_mul_rows(acc, y_ptr, stride_ym, pid_n, N, M: tl.constexpr, BLOCK_N: tl.constexpr,
                         M_PAD: tl.constexpr):  # fmt: skip
    """SILU_OUT over M rows (`kernels.gemv_batch`): `_store_silu_mul`'s arithmetic on each row's gate and up
    halves of acc `[BLOCK_N, M_PAD]`, stored to y `[M, N]`."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N // 2, M_PAD]), (1, 2, 0)))
    g, u = round_bf16(gate), round_bf16(up)
    one = tl.full([BLOCK_N // 2, M_PAD], 1.0, tl.float32)
    silu = round_bf16(div_rn(g, add_rn(one, exp_like_aten(neg(g)))))
    col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    rows = tl.arange(0, M_PAD)
    mask = (col < N)[:, None] & (rows < M)[None, :]
    tl.store(y_ptr + rows[None, :] * stride_ym + col[:, None], to_bf16(mul_rn(silu, u)), mask=mask)


@triton.jit
def _finish_row(y_ptr, res_ptr, wy_ptr, wn_ptr, h_ptr, x_out_ptr, ticket_ptr, factor, eps_y, eps_n,
                NORM_N: tl.constexpr, LANES: tl.constexpr, VECS: tl.constexpr, DESC: tl.constexpr,
                CHUNK: tl.constexpr):  # fmt: skip
    """NORM_OUT, called once per column block after its y is stored: the block's program takes the row's
    ticket (the counter after the column blocks' ones); the one that draws the last runs the residual norm
    over the whole row (`rmsnorm.residual_norm_row`, the exact kernel's code) and resets the counter."""
    tl.debug_barrier()  # all of this program's y stores happen before its ticket releases them
    row_ticket = ticket_ptr + tl.num_programs(0)
    if tl.atomic_add(row_ticket, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        residual_norm_row(y_ptr, wy_ptr, res_ptr, h_ptr, wn_ptr, x_out_ptr, factor, eps_y, eps_n, NORM_N,
                          LANES, VECS, DESC, CHUNK)  # fmt: skip
        tl.store(row_ticket, 0)


@triton.jit
def _input_slice(x_ptr, u_ptr, res_ptr, wy_ptr, wn_ptr, r_y, r_h, k, kmask, X_FORM: tl.constexpr):
    """fp32 values of the GEMV's input row at columns k (see X_FORM)."""
    x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)  # PLAIN: x; SILU_MUL: gate; else y
    if X_FORM == 1:  # silu_mul.py's arithmetic: rn_bf16(rn_bf16(g / (1 + exp(-g))) * u)
        u = tl.load(u_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        silu = round_bf16(div_rn(x, add_rn(tl.full(x.shape, 1.0, tl.float32), exp_like_aten(neg(x)))))
        x = round_bf16(mul_rn(silu, u))
    elif X_FORM == 2:  # rmsnorm's residual kernel: h = rn_bf16(res + post(y)); x = rn_bf16(rn_bf16(h r_h) wn)
        res = tl.load(res_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        wy = tl.load(wy_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        wn = tl.load(wn_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        h = round_bf16(residual_value(x, res, wy, r_y))
        x = round_bf16(mul_rn(round_bf16(mul_rn(h, r_h)), wn))
    return x


@triton.jit
def weight_tile(w_ptr, stride_wn, n, nmask, k, K: tl.constexpr, EVEN_K: tl.constexpr):
    """W rows n at columns k, `[BLOCK_N, BLOCK_K]` (0 outside)."""
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    if EVEN_K:
        return tl.load(w_rows + k[None, :], mask=nmask[:, None], other=0.0)
    return tl.load(w_rows + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def split_product(x_ptr, w_ptr, stride_xm, stride_wn, n, nmask, k_first, u_ptr, res_ptr, wy_ptr, wn_ptr,
                   r_y, r_h, w_first, K: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT: tl.constexpr, PRECISION: tl.constexpr, X_FORM: tl.constexpr,
                   PRELOAD: tl.constexpr, X_FIRST: tl.constexpr = False):  # fmt: skip
    """fp32 `[BLOCK_N, M_PAD]`: columns n of `x @ W.T` over the K_TILES tiles from column k_first.
    PRELOAD (M == 1 on CUDA cores): tile 0 is `w_first`, loaded by the caller before its wait.
    X_FIRST (with DOT): x is the dot's left operand (`[16, BLOCK_K] @ W_tile.T`: 16-row MMAs with the
    weight tile as the right operand) instead of the right one (`W_tile @ x.T`: BLOCK_N-row MMAs)."""
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    acc_x = tl.zeros([M_PAD, BLOCK_N], tl.float32)  # X_FIRST: transposed once after the loop
    acc_1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # M == 1 on CUDA cores: reduced after the loop
    cols = tl.arange(0, M_PAD)
    if PRELOAD:  # the same FMAs in the same order as the loop's first iteration
        k = k_first + tl.arange(0, BLOCK_K)
        x0 = _input_slice(x_ptr, u_ptr, res_ptr, wy_ptr, wn_ptr, r_y, r_h, k, k < K, X_FORM)
        acc_1 = tl.fma(w_first.to(tl.float32), x0[None, :], acc_1)
    for t in range(PRELOAD, K_TILES):  # PRELOAD: 1 (tile 0 done above) or 0
        k = k_first + t * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = weight_tile(w_ptr, stride_wn, n, nmask, k, K, EVEN_K)
        if DOT:
            x = _load_x(x_ptr, stride_xm, k, kmask, M, M_PAD)
            if INTERPRETED:  # the interpreter's dot reads bf16 as raw integers: the same sums in fp32
                wf, xf = w.to(tl.float32), x.to(tl.float32)
                if X_FIRST:
                    acc_x = tl.dot(xf, tl.trans(wf), acc_x, input_precision="ieee")
                else:
                    acc = tl.dot(wf, tl.trans(xf), acc, input_precision="ieee")
            elif X_FIRST:
                acc_x = tl.dot(x, tl.trans(w), acc_x, input_precision=PRECISION)
            else:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        elif M == 1:
            # x as a 1-D row: it takes the column layout of w directly (a [1, K] tile would go through
            # shared memory every iteration)
            x0 = _input_slice(x_ptr, u_ptr, res_ptr, wy_ptr, wn_ptr, r_y, r_h, k, kmask, X_FORM)
            # an explicit FMA: the same bits whether or not the launch lets the compiler contract
            # (the fused input forms are compiled without contraction, as their exact kernels are)
            acc_1 = tl.fma(w.to(tl.float32), x0[None, :], acc_1)
        else:
            wf = w.to(tl.float32)
            for m in tl.static_range(M):
                xm = tl.load(x_ptr + m * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
                part = tl.sum(wf * xm[None, :], axis=1)
                acc = tl.where((cols == m)[None, :], acc + part[:, None], acc)
    if not DOT and M == 1:
        acc = tl.where((cols == 0)[None, :], tl.sum(acc_1, axis=1)[:, None], 0.0)
    if DOT and X_FIRST:
        acc = tl.trans(acc_x)
    return acc


@triton.jit
def _combine(part_ptr, y_ptr, stride_ym, n, nmask, N, M: tl.constexpr, M_PAD: tl.constexpr,
             SPLIT_K: tl.constexpr):  # fmt: skip
    """Sum of the SPLIT_K partials of columns n in split order (fixed: whoever runs it), stored to y."""
    cols = tl.arange(0, M_PAD)
    mask = nmask[:, None] & (cols < M)[None, :]
    offs = cols[None, :] * N + n[:, None]
    total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(y_ptr + cols[None, :] * stride_ym + n[:, None], total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_slice(w_ptr, stride_wn, n, nmask, k_first, K: tl.constexpr, SPAN: tl.constexpr):
    """Ask L2 for this program's weight slice (rows n, columns k_first .. k_first + SPAN - 1): one bulk
    prefetch per row. Weights are never written, so this may run before `wait_for_inputs`: under
    `kernels.pdl` it streams while the kernel before is still finishing. A hint; it moves no values."""
    nbytes = tl.maximum(tl.minimum(SPAN, K - k_first), 0) * 2 // 16 * 16  # bf16; bulk: 16-byte multiples
    rows = w_ptr + n.to(tl.int64) * stride_wn + k_first
    size = tl.zeros_like(n).to(tl.int32) + nbytes
    live = (nmask & (size > 0)).to(tl.int32)
    tl.inline_asm_elementwise(BULK_ASM, "=r,l,r,r", [rows, size, live], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _residual_scales(y_ptr, res_ptr, wy_ptr, factor, eps_y, eps_n, K: tl.constexpr, LANES: tl.constexpr,
                     VECS: tl.constexpr, DESC: tl.constexpr):  # fmt: skip
    """RESIDUAL_NORM: the two rsqrt factors of the whole row (post-norm of y, next norm of h), each
    program computing them itself in PyTorch's mean order (rmsnorm's `row_mean`); fp32 [1] each."""
    r_y = rsqrt_approx(add_rn(row_mean(y_ptr, factor, K, LANES, VECS, DESC), tl.full([1], eps_y, tl.float32)))
    mean_h = residual_row_mean(y_ptr, res_ptr, wy_ptr, r_y, factor, K, LANES, VECS, DESC)
    return r_y, rsqrt_approx(add_rn(mean_h, tl.full([1], eps_n, tl.float32)))


@triton.jit
def _store_residual(y_ptr, res_ptr, wy_ptr, h_ptr, r_y, K: tl.constexpr, CHUNK: tl.constexpr):
    """RESIDUAL_NORM: the new residual row h = rn_bf16(res + post(y)), stored by one program."""
    for c0 in range(0, K, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        m = cols < K
        y = tl.load(y_ptr + cols, mask=m, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + cols, mask=m, other=0.0).to(tl.float32)
        wy = tl.load(wy_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + cols, to_bf16(residual_value(y, res, wy, r_y)), mask=m)


@triton.jit(do_not_specialize=["stride_xm", "stride_ym"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, N, stride_xm, stride_wn, stride_ym,
                 u_ptr, res_ptr, wy_ptr, wn_ptr, h_ptr, x_out_ptr, factor, eps_y, eps_n,
                 K: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
                 PREFETCH: tl.constexpr = 0, X_FORM: tl.constexpr = 0, LANES: tl.constexpr = 1,
                 VECS: tl.constexpr = 1, DESC: tl.constexpr = True, CHUNK: tl.constexpr = 1,
                 PRELOAD: tl.constexpr = 0, Y_FORM: tl.constexpr = 0,
                 NORM_N: tl.constexpr = 1, X_FIRST: tl.constexpr = False):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n, nmask = _weight_rows(pid_n, N, BLOCK_N, Y_FORM)
    let_dependents_launch(PDL)
    if PREFETCH > 0:  # under PDL: PREFETCH tiles after the preloaded one stream into L2 before the wait
        _prefetch_slice(w_ptr, stride_wn, n, nmask, pid_k * (K_TILES * BLOCK_K) + PRELOAD * BLOCK_K, K,
                        PREFETCH * BLOCK_K)  # fmt: skip
    w_first = tl.zeros([BLOCK_N, BLOCK_K], tl.bfloat16)
    if PRELOAD:  # kernels.gemv_preload: weights are never written, so tile 0 may load before the wait
        k0 = pid_k * (K_TILES * BLOCK_K) + tl.arange(0, BLOCK_K)
        w_first = weight_tile(w_ptr, stride_wn, n, nmask, k0, K, EVEN_K)
    wait_for_inputs(PDL)  # x, y, the partials and the tickets only after the kernel before completed
    r_y = tl.full([1], 1.0, tl.float32)
    r_h = tl.full([1], 1.0, tl.float32)
    if X_FORM == 2:
        r_y, r_h = _residual_scales(x_ptr, res_ptr, wy_ptr, factor, eps_y, eps_n, K, LANES, VECS, DESC)
    acc = split_product(
        x_ptr, w_ptr, stride_xm, stride_wn, n, nmask, pid_k * (K_TILES * BLOCK_K), u_ptr, res_ptr, wy_ptr,
        wn_ptr, r_y, r_h, w_first, K, M, M_PAD, BLOCK_N, BLOCK_K, K_TILES, EVEN_K, DOT, PRECISION, X_FORM,
        PRELOAD, X_FIRST,
    )  # fmt: skip
    if X_FORM == 2:  # noqa: SIM102 (a constexpr test, then a device one)
        if (pid_n == 0) & (pid_k == 0):
            _store_residual(x_ptr, res_ptr, wy_ptr, h_ptr, r_y, K, CHUNK)
    cols = tl.arange(0, M_PAD)
    mask = nmask[:, None] & (cols < M)[None, :]
    if Y_FORM == 1 and M == 1:  # SILU_OUT: one split (the launch makes sure), gate and up in this program
        _store_silu_mul(acc, y_ptr, pid_n, N, BLOCK_N)
    elif Y_FORM == 1:
        _store_silu_mul_rows(acc, y_ptr, stride_ym, pid_n, N, M, BLOCK_N, M_PAD)
    elif SPLIT_K == 1:
        tl.store(y_ptr + cols[None, :] * stride_ym + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)
        if Y_FORM == 2:
            _finish_row(y_ptr, res_ptr, wy_ptr, wn_ptr, h_ptr, x_out_ptr, ticket_ptr, factor, eps_y, eps_n,
                        NORM_N, LANES, VECS, DESC, CHUNK)  # fmt: skip
    else:
        tl.store(part_ptr + pid_k * M * N + cols[None, :] * N + n[:, None], acc, mask=mask)
        tl.debug_barrier()  # all of this program's stores happen before its ticket releases them
        if tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:  # the last split to finish
            _combine(part_ptr, y_ptr, stride_ym, n, nmask, N, M, M_PAD, SPLIT_K)
            tl.store(ticket_ptr + pid_n, 0)  # every split has drawn: ready for the next launch
            if Y_FORM == 2:
                _finish_row(y_ptr, res_ptr, wy_ptr, wn_ptr, h_ptr, x_out_ptr, ticket_ptr, factor, eps_y,
                            eps_n, NORM_N, LANES, VECS, DESC, CHUNK)  # fmt: skip


# ------------------------------------------------------------------------------------------------ launch


def gemv(x: torch.Tensor, weight: torch.Tensor, cfg: TileConfig | None = None) -> torch.Tensor:
    """`x @ weight.T` for `x [..., K]` with at most MAX_ROWS rows and `weight [N, K]` (K contiguous); the
    result has x's dtype and shape `[..., N]`. fp32 accumulation. `cfg` overrides the tile table."""
    *lead, k = x.shape
    check_weight(weight, k)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    return launch(x2, weight, cfg or pick_config(m, weight.shape[0], k)).reshape(*lead, weight.shape[0])


def check_weight(weight: torch.Tensor, k: int) -> None:
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {k}] with K contiguous")


def launch(
    x2: torch.Tensor, weight: torch.Tensor, cfg: TileConfig, form=None, consts=None, y_form: int = PLAIN_OUT
) -> torch.Tensor:
    """One `_gemv_kernel` launch over the `[M, K]` rows x2, or (`form`: the fused form's tensors and
    scalars, `consts`: X_FORM or Y_FORM's constants) over the one row the kernel computes from them, x2
    being their first input. Returns y `[M, N]` (SILU_OUT: N is half the weight's rows)."""
    (m, k), n = x2.shape, weight.shape[0]
    columns = cfg.block_n  # output columns per program
    if y_form == SILU_OUT:  # gate and up of one column block in one program, one split
        n, columns = n // 2, cfg.block_n // 2
        split, per_split = 1, triton.cdiv(k, cfg.block_k)
    else:
        split, per_split = split_for(n, k, cfg)
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    blocks = triton.cdiv(n, columns)
    even_k = k % cfg.block_k == 0 and split * per_split == triton.cdiv(k, cfg.block_k)
    scratch = (split, m, n) if split > 1 else (1,)  # one split stores y directly: no partials, no ticket
    partials = torch.empty(scratch, dtype=torch.float32, device=x2.device)
    # a ticket per column block when K is split; NORM_OUT: the row's after them (at index `blocks`)
    counters = tickets(x2.device, blocks + 1 if y_form == NORM_OUT else blocks if split > 1 else 1)
    launch = pdl_args()
    early = launch_mode.weight_preload()  # kernels.gemv_preload: weight work before the PDL wait
    preload = int(m == 1 and not cfg.dot and early)
    form = form or unused_inputs(x2)
    # the fused forms hold exact kernels' arithmetic: compiled with their options (no contraction,
    # libdevice without flush-to-zero); the GEMV's own products are explicit FMAs either way
    consts = {**consts, **EXACT_OPTIONS} if consts else {}
    _gemv_kernel[(blocks, split)](
        x2, weight, y, partials, counters, n, x2.stride(0), weight.stride(0), y.stride(0), **form,
        K=k, M=m, M_PAD=16 if cfg.dot else triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, K_TILES=per_split, SPLIT_K=split, EVEN_K=even_k, DOT=cfg.dot,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
        PREFETCH=_prefetch_tiles(cfg, per_split, preload, weight, launch["PDL"], early), **consts,
        PRELOAD=preload, Y_FORM=y_form, X_FIRST=cfg.dot and cfg.x_first,
    )  # fmt: skip
    return y


def _prefetch_tiles(
    cfg: TileConfig, per_split: int, preload: int, weight: torch.Tensor, pdl: bool, early: bool
) -> int:
    """Weight tiles each program prefetches into L2 before its PDL wait, after the `preload` tiles it loads:
    the whole slice under `PREFETCH_UNDER_PDL`; else, where the GEMV starts on its weights before the wait
    (`early`: `kernels.gemv_preload`), the tile's `prefetch_tiles`. None without PDL."""
    if not pdl or not prefetch_aligned(weight):
        return 0
    if PREFETCH_UNDER_PDL:
        return per_split - preload
    return max(0, min(cfg.prefetch_tiles, per_split - preload)) if early else 0


def unused_inputs(x2: torch.Tensor) -> dict:
    """The fused forms' arguments where the kernel does not read them (PLAIN; the silu form's norm ones)."""
    return dict(
        u_ptr=x2, res_ptr=x2, wy_ptr=x2, wn_ptr=x2, h_ptr=x2, x_out_ptr=x2, factor=1.0, eps_y=0.0, eps_n=0.0
    )


def prefetch_aligned(weight: torch.Tensor) -> bool:
    """Bulk L2 prefetches take 16-byte aligned addresses: the weight's base and row stride must be."""
    return weight.dtype == torch.bfloat16 and weight.data_ptr() % 16 == 0 and (weight.stride(0) * 2) % 16 == 0


def warmup(device: torch.device | str, shapes, rows=range(1, MAX_ROWS + 1)) -> None:
    """Compile the GEMV for every `(N, K)` in `shapes` and row count, outside graph capture."""
    for n, k in shapes:
        w = torch.zeros(n, k, dtype=torch.bfloat16, device=device)
        for m in rows:
            gemv(torch.zeros(m, k, dtype=torch.bfloat16, device=device), w)
    torch.cuda.synchronize(device)
