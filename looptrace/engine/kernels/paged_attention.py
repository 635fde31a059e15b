"""Triton paged attention: one launch per (layer, loop) for attention, one for the K/V cache write.

Replaces, on CUDA, the torch path of `layers.PagedAttention` (two `index_put_`, two `index_select`
gathers that materialise every row's pages, the mask and SDPA: eight kernels and an `[R, nb*bs, ...]`
copy per layer). Addressing is the engine's *entry* addressing (`layers.AttnContext`): the pool
`[num_blocks, num_layers, block_size, kv_heads, head_dim]` is seen as `[num_blocks * num_layers,
block_size, kv_heads, head_dim]`; a row's table holds entry bases and layer l reads entry `base + l`.

Kernel design (`_attn_kernel`): grid `(R, H)`, one program per (row, query head), kv head
`head // (H // KVH)` (GQA: the K/V of one kv head is read by its `group` query heads, from L2; both
target models are MHA, where nothing is read twice). A program walks its row's keys in tiles of
`BLOCK_N = 128` keys (8 pages of 16; each key's page entry comes from the table, so pages may lie anywhere
in the pool), from key 0 upwards, `ceil(ctx / BLOCK_N)` tiles, with an online softmax in fp32: scores
`sum(q * k)` with q pre-scaled by `scale * log2(e)`, running max and sum, `exp2`, fp32 accumulator
`acc = acc * alpha + sum(p * v)`, and one IEEE division and one rounding to q's dtype at the end. The
products and sums are plain fp32 CUDA-core math (no tensor cores: no tf32, no bf16 rounding of p); decode
attention is bound by memory, not arithmetic. head_dim is padded to a power of two with masks (Huginn's
96 -> 128). Keys past `ctx` are masked on load, so table entries of pages `p >= ceil(ctx / bs)` (the -1
padding) and their pages are never read; a row with `ctx == 0` (a padding row) reads nothing and writes
zeros. No host syncs, no data-dependent grid: the loop bound is read on the device, the grid depends only
on (R, H), so the launch can be captured in a CUDA graph.

Determinism contract (R0 batch invariance): a row's output depends only on its q, its ctx_len and the
K/V values it reads, never on R, on the other rows, on the table width nb or on what the padding holds.
Each program computes its (row, head) alone; the tile size and the tile order are constants (not
functions of R, nb or the launch), every reduction is over a fixed-shape tile of one compiled kernel, and
masked keys contribute exact zeros (p = exp2(-inf) = 0, v loaded as 0). The kernel never sees R; the
integer arguments that vary with the batch (the table and ctx_len strides, which follow nb when they are
columns of the per-row metadata tensor) are excluded from Triton's value specialisation, and q/out are
excluded from alignment specialisation, so every batch runs the same binary with the same reduction
order. (Pool and table pointers come from the allocator: their 16-byte alignment is fixed.) Results are
run-to-run deterministic; they are not bitwise equal to SDPA (another reduction order).

`write_kv` stores K and V of every row in one launch (grid `(R, KVH)`): row r goes to
`cache[write_entry[r] + layer_id, write_offset[r]]`; rows with `write_entry < 0` are skipped. Importing
this module imports Triton.
"""

from __future__ import annotations

import math
import os

import torch

from looptrace.engine.kernels._fences import triton

tl = triton.language

# Keys per tile and warps: constants of the kernel (the determinism contract), never functions of R or nb.
# Measured on an H200 (bf16, ctx 2700, R 1/8/64): 128 keys x 4 warps was best or near best for Ouro and
# Huginn among 32/64/128 x 2/4/8 warps; num_stages made no difference (the loads are indirect).
BLOCK_N = 128
NUM_WARPS = 4
LOG2E = math.log2(math.e)
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _tile(q, k_ptr, v_ptr, tab, start, ctx, stride_e, stride_s, m_i, l_i, acc, HEAD_DIM, D_PAD, PAGE, BLOCK):
    """Keys `start .. start + BLOCK - 1`: online-softmax update of (max, sum, accumulator).

    k_ptr/v_ptr already point at (layer, kv head) of entry 0; a key's page entry comes from the table.
    """
    d = tl.arange(0, D_PAD)
    pos = start + tl.arange(0, BLOCK)
    kmask = pos < ctx  # pos < ctx  =>  page < ceil(ctx / PAGE): padding entries are never loaded
    entry = tl.load(tab + pos // PAGE, mask=kmask, other=0).to(tl.int64)
    offs = (entry * stride_e + (pos % PAGE) * stride_s)[:, None] + d[None, :]
    lmask = kmask[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
    s = tl.where(kmask, tl.sum(q[None, :] * k, axis=1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile holds at least one key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)  # masked keys: exactly 0
    v = tl.load(v_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return m_new, l_i, acc


@triton.jit(
    do_not_specialize=["layer_id", "stride_t", "stride_c"],
    do_not_specialize_on_alignment=["q_ptr", "out_ptr"],
)
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tab_ptr,
    ctx_ptr,
    out_ptr,
    layer_id,
    qk_scale,
    stride_qr,
    stride_qh,
    stride_e,
    stride_s,
    stride_kh,
    stride_t,
    stride_c,
    stride_or,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM

    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    q = q * qk_scale  # scale * log2(e): scores come out in log2 units for exp2
    ctx = tl.load(ctx_ptr + row * stride_c)
    tab = tab_ptr + row * stride_t
    shift = layer_id.to(tl.int64) * stride_e + (head // GROUP).to(tl.int64) * stride_kh  # layer, kv head
    k_base, v_base = k_ptr + shift, v_ptr + shift

    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], tl.float32)
    if COMPILED:
        for start in range(0, ctx, BLOCK):
            m_i, l_i, acc = _tile(
                q,
                k_base,
                v_base,
                tab,
                start,
                ctx,
                stride_e,
                stride_s,
                m_i,
                l_i,
                acc,
                HEAD_DIM,
                D_PAD,
                PAGE,
                BLOCK,
            )
    else:  # the interpreter cannot take a loaded bound in range() (numpy >= 2): same tiles, same order
        start = 0
        while start < ctx:
            m_i, l_i, acc = _tile(
                q,
                k_base,
                v_base,
                tab,
                start,
                ctx,
                stride_e,
                stride_s,
                m_i,
                l_i,
                acc,
                HEAD_DIM,
                D_PAD,
                PAGE,
                BLOCK,
            )
            start += BLOCK
    has_keys = l_i > 0.0
    out = tl.math.div_rn(acc, tl.where(has_keys, l_i, 1.0))
    out = tl.where(has_keys, out, 0.0)
    tl.store(out_ptr + row * stride_or + head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["layer_id", "stride_w", "stride_o"])
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    went_ptr,
    woff_ptr,
    layer_id,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_e,
    stride_s,
    stride_ch,
    stride_w,
    stride_o,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    entry = tl.load(went_ptr + row * stride_w).to(tl.int64)
    slot = tl.load(woff_ptr + row * stride_o).to(tl.int64)
    m = (d < HEAD_DIM) & (entry >= 0)  # write_entry < 0: a padding row, nothing is written
    dst = (entry + layer_id) * stride_e + slot * stride_s + head * stride_ch + d
    k = tl.load(k_ptr + row * stride_kr + head * stride_kh + d, mask=m)
    v = tl.load(v_ptr + row * stride_vr + head * stride_vh + d, mask=m)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache/v_cache: the same [entries, block_size, kv_heads, head_dim] view")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: head_dim must be contiguous")


def prepare(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor):
    """Shared by both attention wrappers: checks the shapes; returns q and tables with a unit inner stride,
    the empty output `[R, H * D]`, and the launch arguments that follow the pointers and the scale (row,
    head, cache, table, context and output strides) with the compile-time shape."""
    _check_cache(k_cache, v_cache)
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads or k_cache.shape[3] != dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    q, tables = _inner_contiguous(q), _inner_contiguous(tables)
    out = torch.empty((rows, heads * dim), dtype=q.dtype, device=q.device)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    shape = dict(
        GROUP=heads // kv_heads, HEAD_DIM=dim, D_PAD=triton.next_power_of_2(dim), PAGE=k_cache.shape[1]
    )
    return q, tables, out, strides, shape


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    layer_id: int,
    scale: float,
) -> torch.Tensor:
    """Attention of every row over its own pages; returns `[R, H * D]` in q's dtype.

    q `[R, H, D]`; k_cache/v_cache the entry view `[E, block_size, KVH, D]`; tables `[R, nb]` int64 entry
    bases (-1 beyond the row's pages; may be a column slice of the metadata tensor); ctx_lens `[R]` int64
    (may be strided): row r attends to key positions `0 .. ctx_lens[r] - 1`, whose page p slot s sits at
    `k_cache[tables[r, p] + layer_id, s]`. ctx 0 (padding row): zeros. See the module docstring for the
    design and the batch-invariance contract.
    """
    q, tables, out, strides, shape = prepare(q, k_cache, v_cache, tables)
    if q.shape[0] == 0:
        return out
    _attn_kernel[(q.shape[0], q.shape[1])](
        q,
        k_cache,
        v_cache,
        tables,
        ctx_lens,
        out,
        layer_id,
        float(scale) * LOG2E,
        *strides,
        tables.stride(0),
        ctx_lens.stride(0),
        out.stride(0),
        **shape,
        BLOCK=BLOCK_N,
        num_warps=NUM_WARPS,
        num_stages=1,
    )
    return out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_entry: torch.Tensor,
    write_offset: torch.Tensor,
    layer_id: int,
) -> None:
    """`cache[write_entry[r] + layer_id, write_offset[r]] = k[r]` (and v) for every row, one launch.

    k/v `[R, KVH, D]` (rows and heads may be strided, e.g. slices of a fused QKV output); write_entry and
    write_offset `[R]` int64 (may be strided). Rows with `write_entry < 0` are skipped (padding).
    """
    _check_cache(k_cache, v_cache)
    rows, kv_heads, dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (kv_heads, dim):
        raise ValueError(f"k/v {tuple(k.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if rows == 0:
        return
    k, v = _inner_contiguous(k), _inner_contiguous(v)
    _write_kv_kernel[(rows, kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        write_entry,
        write_offset,
        layer_id,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        write_entry.stride(0),
        write_offset.stride(0),
        HEAD_DIM=dim,
        D_PAD=triton.next_power_of_2(dim),
        num_warps=1 if dim <= 128 else 2,
    )


__all__ = ["BLOCK_N", "NUM_WARPS", "paged_attention", "write_kv"]
