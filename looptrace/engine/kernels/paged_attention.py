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

Split decode (`split=True`, the recipe toggle `kernels.split_decode`, R0): at batch 1 the grid holds only
H programs, each walking its ~5 tiles one after another while most of the GPU idles. `_attn_split_kernel`
gives every (tile, head, row) its own program and computes **the same bits**: program t recomputes the
scores of tiles 0..t-1 (the same `_scores` code, so the same values) for the running max the one-pass loop
has when it reaches tile t, then its own tile's `alpha`, `sum(p * v)` and `sum(p)` with the same code
(`_tile_parts`), into a workspace; the last program of a (row, head) to arrive (an acq_rel atomic count)
folds the tiles in key order with the one-pass loop's own update `acc = acc * alpha + pv`, then divides
and rounds once. Max is exact and order-free, and every other operation sees the same operands in the same
order, so the result equals `_attn_kernel`'s bit for bit (GPU test `test_gpu_split_equals_one_pass`).
The launch picks the form (`split_tiles`): few (row, head) pairs and at most 16 tiles; otherwise, or with
`split=False`, the one-pass kernel. Counts reset to 0 by the folding program, so graph replays reuse them.

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
def _scores(q, k_ptr, tab, start, ctx, stride_e, stride_s, HEAD_DIM, D_PAD, PAGE, BLOCK):
    """Scores of keys `start .. start + BLOCK - 1` (-inf past ctx), with the tile's K/V offsets and mask.

    k_ptr already points at (layer, kv head) of entry 0; a key's page entry comes from the table.
    """
    d = tl.arange(0, D_PAD)
    pos = start + tl.arange(0, BLOCK)
    kmask = pos < ctx  # pos < ctx  =>  page < ceil(ctx / PAGE): padding entries are never loaded
    entry = tl.load(tab + pos // PAGE, mask=kmask, other=0).to(tl.int64)
    offs = (entry * stride_e + (pos % PAGE) * stride_s)[:, None] + d[None, :]
    lmask = kmask[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
    return tl.where(kmask, tl.sum(q[None, :] * k, axis=1), float("-inf")), offs, lmask


@triton.jit
def _tile_parts(q, k_ptr, v_ptr, tab, start, ctx, stride_e, stride_s, m_i, HEAD_DIM, D_PAD, PAGE, BLOCK):
    """One tile against the running max `m_i`: the new max, the factor `alpha` that rescales what came
    before, and the tile's `sum(p * v)` and `sum(p)`."""
    s, offs, lmask = _scores(q, k_ptr, tab, start, ctx, stride_e, stride_s, HEAD_DIM, D_PAD, PAGE, BLOCK)
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile holds at least one key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)  # masked keys: exactly 0
    v = tl.load(v_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
    return m_new, alpha, tl.sum(p[:, None] * v, axis=0), tl.sum(p, axis=0)


@triton.jit
def _tile(q, k_ptr, v_ptr, tab, start, ctx, stride_e, stride_s, m_i, l_i, acc, HEAD_DIM, D_PAD, PAGE, BLOCK):
    """One online-softmax step: (max, sum, accumulator) after the keys `start .. start + BLOCK - 1`."""
    m_new, alpha, pv, psum = _tile_parts(
        q, k_ptr, v_ptr, tab, start, ctx, stride_e, stride_s, m_i, HEAD_DIM, D_PAD, PAGE, BLOCK
    )
    acc = acc * alpha + pv
    l_i = l_i * alpha + psum
    return m_new, l_i, acc


@triton.jit
def _tile_max(q, k_ptr, tab, start, ctx, stride_e, stride_s, m_i, HEAD_DIM, D_PAD, PAGE, BLOCK):
    """The running max after keys `start .. start + BLOCK - 1` (the scores of `_tile_parts`, no V)."""
    s, _, _ = _scores(q, k_ptr, tab, start, ctx, stride_e, stride_s, HEAD_DIM, D_PAD, PAGE, BLOCK)
    return tl.maximum(m_i, tl.max(s, axis=0))


@triton.jit
def _row_setup(
    q_ptr,
    k_ptr,
    v_ptr,
    tab_ptr,
    ctx_ptr,
    row,
    head,
    layer_id,
    qk_scale,
    stride_qr,
    stride_qh,
    stride_e,
    stride_kh,
    stride_t,
    stride_c,
    GROUP,
    HEAD_DIM,
    D_PAD,
):
    """A (row, head)'s scaled query, context length, table and K/V bases (its layer and kv head)."""
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    q = q * qk_scale  # scale * log2(e): scores come out in log2 units for exp2
    ctx = tl.load(ctx_ptr + row * stride_c)
    shift = layer_id.to(tl.int64) * stride_e + (head // GROUP).to(tl.int64) * stride_kh  # layer, kv head
    return q, ctx, tab_ptr + row * stride_t, k_ptr + shift, v_ptr + shift


@triton.jit
def _store_out(acc, l_i, out_ptr, row, head, stride_or, HEAD_DIM, D_PAD):
    """One IEEE division and one rounding to the output dtype; zeros for a row without keys."""
    d = tl.arange(0, D_PAD)
    has_keys = l_i > 0.0
    out = tl.math.div_rn(acc, tl.where(has_keys, l_i, 1.0))
    out = tl.where(has_keys, out, 0.0)
    tl.store(
        out_ptr + row * stride_or + head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


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
    q, ctx, tab, k_base, v_base = _row_setup(
        q_ptr, k_ptr, v_ptr, tab_ptr, ctx_ptr, row, head, layer_id, qk_scale, stride_qr, stride_qh,
        stride_e, stride_kh, stride_t, stride_c, GROUP, HEAD_DIM, D_PAD,
    )  # fmt: skip
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D_PAD], tl.float32)
    if COMPILED:
        for start in range(0, ctx, BLOCK):
            m_i, l_i, acc = _tile(
                q, k_base, v_base, tab, start, ctx, stride_e, stride_s, m_i, l_i, acc, HEAD_DIM, D_PAD, PAGE,
                BLOCK,
            )  # fmt: skip
    else:  # the interpreter cannot take a loaded bound in range() (numpy >= 2): same tiles, same order
        start = 0
        while start < ctx:
            m_i, l_i, acc = _tile(
                q, k_base, v_base, tab, start, ctx, stride_e, stride_s, m_i, l_i, acc, HEAD_DIM, D_PAD, PAGE,
                BLOCK,
            )  # fmt: skip
            start += BLOCK
    _store_out(acc, l_i, out_ptr, row, head, stride_or, HEAD_DIM, D_PAD)


@triton.jit(
    do_not_specialize=["layer_id", "stride_t", "stride_c"],
    do_not_specialize_on_alignment=["q_ptr", "out_ptr"],
)
def _attn_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tab_ptr,
    ctx_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
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
    """`_attn_kernel` with one program per (key tile, head, row), bit for bit (module docstring)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    q, ctx, tab, k_base, v_base = _row_setup(
        q_ptr, k_ptr, v_ptr, tab_ptr, ctx_ptr, row, head, layer_id, qk_scale, stride_qr, stride_qh,
        stride_e, stride_kh, stride_t, stride_c, GROUP, HEAD_DIM, D_PAD,
    )  # fmt: skip
    pair = row * tl.num_programs(1) + head
    parts = part_ptr + pair * tl.num_programs(0) * (D_PAD + 2)  # per tile: sum(p * v)[D_PAD], alpha, sum(p)
    start = tile * BLOCK
    d = tl.arange(0, D_PAD)
    if start < ctx:
        # The running max before this tile: the one-pass kernel's scores and maxima, tile by tile from key 0.
        m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        j = start * 0
        while j < start:
            m_i = _tile_max(q, k_base, tab, j, ctx, stride_e, stride_s, m_i, HEAD_DIM, D_PAD, PAGE, BLOCK)
            j += BLOCK
        _, alpha, pv, psum = _tile_parts(
            q, k_base, v_base, tab, start, ctx, stride_e, stride_s, m_i, HEAD_DIM, D_PAD, PAGE, BLOCK
        )
        slot = parts + tile * (D_PAD + 2)
        tl.store(slot + d, pv)
        tl.store(slot + D_PAD, alpha)
        tl.store(slot + D_PAD + 1, psum)
        tiles = (ctx + BLOCK - 1) // BLOCK
        # acq_rel: this tile's parts are visible before the count, and the last arrival sees every tile's.
        if tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel") == tiles - 1:
            # The last tile to finish folds the tiles in key order, exactly as the one-pass loop does.
            l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
            acc = tl.zeros([D_PAD], tl.float32)
            t = tiles * 0
            while t < tiles:
                part = parts + t * (D_PAD + 2)
                a = tl.load(part + D_PAD, cache_modifier=".cg")  # .cg: from L2, never a stale L1 line
                acc = acc * a + tl.load(part + d, cache_modifier=".cg")
                l_i = l_i * a + tl.load(part + D_PAD + 1, cache_modifier=".cg")
                t += 1
            tl.atomic_xchg(lock_ptr + pair, 0)  # ready for the next launch (or graph replay)
            _store_out(acc, l_i, out_ptr, row, head, stride_or, HEAD_DIM, D_PAD)
    elif tile == 0:  # ctx 0, a padding row: zeros, as the one-pass kernel writes
        zero = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        _store_out(tl.zeros([D_PAD], tl.float32), zero, out_ptr, row, head, stride_or, HEAD_DIM, D_PAD)


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


# Split decode (`kernels.split_decode`): used where the one-pass grid leaves most of the GPU idle (few
# (row, head) programs) and the table holds at most SPLIT_MAX_TILES tiles (program t re-reads the keys of
# tiles 0..t-1 for the running max, so long tables would pay that many times over).
SPLIT_MAX_PAIRS = 256
SPLIT_MAX_TILES = 16
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per device: fp32 parts `[pairs * tiles * (D_PAD + 2)]` for the largest split launch, and one int32
    arrival count per (row, head), zero between launches. Allocated once and never freed, because captured
    graphs keep their addresses (one stream at a time: the engine's)."""
    if device not in _workspaces:
        parts = torch.empty(SPLIT_MAX_PAIRS * SPLIT_MAX_TILES * (256 + 2), dtype=torch.float32, device=device)
        _workspaces[device] = parts, torch.zeros(SPLIT_MAX_PAIRS, dtype=torch.int32, device=device)
    return _workspaces[device]


def split_tiles(rows: int, heads: int, table_width: int, page: int) -> int:
    """Key tiles per (row, head) of a split launch, or 0 where the one-pass kernel runs instead."""
    tiles = -(-table_width * page // BLOCK_N)
    return tiles if rows * heads <= SPLIT_MAX_PAIRS and 2 <= tiles <= SPLIT_MAX_TILES else 0


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    layer_id: int,
    scale: float,
    split: bool = False,
) -> torch.Tensor:
    """Attention of every row over its own pages; returns `[R, H * D]` in q's dtype.

    q `[R, H, D]`; k_cache/v_cache the entry view `[E, block_size, KVH, D]`; tables `[R, nb]` int64 entry
    bases (-1 beyond the row's pages; may be a column slice of the metadata tensor); ctx_lens `[R]` int64
    (may be strided): row r attends to key positions `0 .. ctx_lens[r] - 1`, whose page p slot s sits at
    `k_cache[tables[r, p] + layer_id, s]`. ctx 0 (padding row): zeros. `split`: one program per key tile
    where `split_tiles` allows, the same bits. See the module docstring for the design and the
    batch-invariance contract.
    """
    q, tables, out, strides, shape = prepare(q, k_cache, v_cache, tables)
    rows, heads = q.shape[0], q.shape[1]
    if rows == 0:
        return out
    args = (float(scale) * LOG2E, *strides, tables.stride(0), ctx_lens.stride(0), out.stride(0))
    tiles = split_tiles(rows, heads, tables.shape[1], shape["PAGE"]) if split else 0
    if tiles and shape["D_PAD"] <= 256:
        parts, locks = _split_workspace(q.device)
        _attn_split_kernel[(tiles, heads, rows)](
            q, k_cache, v_cache, tables, ctx_lens, out, parts, locks, layer_id, *args, **shape,
            BLOCK=BLOCK_N, num_warps=NUM_WARPS, num_stages=1,
        )  # fmt: skip
        return out
    _attn_kernel[(rows, heads)](
        q, k_cache, v_cache, tables, ctx_lens, out, layer_id, *args, **shape,
        BLOCK=BLOCK_N, num_warps=NUM_WARPS, num_stages=1,
    )  # fmt: skip
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


__all__ = ["BLOCK_N", "NUM_WARPS", "paged_attention", "split_tiles", "write_kv"]
