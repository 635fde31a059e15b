"""Triton paged attention: one launch per (layer, loop) for attention, one for the K/V cache write.

Replaces, on CUDA, the torch path of `layers.PagedAttention` (two `index_put_`, two `index_select`
gathers that materialise every row's pages, the mask and SDPA: eight kernels and an `[R, nb*bs, ...]`
copy per layer). Addressing is the engine's *entry* addressing (`layers.AttnContext`): the pool
`[num_blocks, num_layers, block_size, kv_heads, head_dim]` is seen as `[num_blocks * num_layers,
block_size, kv_heads, head_dim]`; a row's table holds entry bases and layer l reads entry `base + l`.

Kernel design (`_attn_kernel`, split-KV decode): a row's keys are cut into *segments* of
`segment_keys(ctx)` keys, a whole number of `BLOCK_N`-key tiles (a `SplitConfig` per head size, chosen by
H200 sweeps: 32-key tiles and segments of at least 2 for both models): the shortest
segments up to 16 of them, then as many tiles per segment as keep the count at `MAX_SEGMENTS = 16`
(the bound keeps the scratch at `R * H * 16` partials whatever the table width: Ouro's 65,536 positions
would otherwise need 1,024 segments per row). Grid `(R, H, segment slots)` (rows on axis 0, which holds
2^31 - 1: a 65,536-row prefill step overflowed axis 2), one program per (row, query head, segment),
kv head `head // (H // KVH)` (GQA: both target models are MHA, where nothing is read twice):
Ouro's 1 row x 640 keys x 16 heads runs 10 x 16 = 160 programs on the H200's 132 SMs, where one program per
(row, head) ran 16. A program walks its segment's tiles in order (each key's page entry comes from the
table, so pages may lie anywhere in the pool) with an online softmax in fp32: scores `sum(q * k)` with q
pre-scaled by `scale * log2(e)`, running max and sum, `exp2`, fp32 accumulator `acc = acc * alpha +
sum(p * v)`. The products and sums are plain fp32 CUDA-core math (no tensor cores: no tf32, no bf16
rounding of p); decode attention is bound by memory, not arithmetic. The *key-slot* form (`key_slots`:
Huginn's split; Ouro's under `kernels.attn_slots` for one-row launches) keeps that state per key slot of
the tile (slot j sees keys j, j + BLOCK_N, ...), so a tile needs no reduction over keys, and folds the
slots once per segment (`_merge_slots`): another summation order, the same function. Under
`kernels.attn_prefetch` (with PDL, one-row launches) a program asks L2 for its segment's K/V rows before
its `griddepcontrol.wait` (`_prefetch_segment`: it reads the context length and page entries through L2
only and issues hints, so no value can come from before the wait). A row with one segment writes
`acc / sum` (one IEEE division, one rounding to q's dtype) and touches no scratch. Otherwise every segment
stores its (max, sum, acc) partial in a scratch buffer and takes a ticket (an `acq_rel` atomic on a
per-(row, head) counter, after a barrier so the whole program's stores are released with it); the program
that draws the last ticket reads all partials back (`.cg` loads, from L2), combines them over the 16
partial slots in one fixed order (max; weights `exp2(m_s - max)`; weighted sums; empty slots add exact
zeros), writes the output and resets the counter to zero for the next launch. The counters are a
persistent zeroed buffer per device (`scratch.tickets`, shared with the GEMV), so the launch needs no
memset; launches on one stream never overlap, which is what makes sharing it safe (concurrent launches on
two streams would not be).
head_dim is covered by two power-of-two tiles where it splits so (`head_split`: Huginn's 96 = 64 + 32, no
padded lanes), else by one tile padded with masks. Keys past `ctx` are masked on load, so table entries of
pages `p >= ceil(ctx / bs)` (the -1 padding) and their pages are never read; a row with `ctx == 0` (a
padding row) reads nothing and its segment 0 writes zeros. No host syncs, no data-dependent grid: the
segment count is read on the device, the grid depends only on (R, H, nb) (segment slots beyond a row's
count exit at once), so the launch can be captured in a CUDA graph.

Determinism contract (R0 batch invariance): a row's output depends only on its q, its ctx_len and the
K/V values it reads, never on R, on the other rows, on the table width nb or on what the padding holds.
The segment length, the segment count and the combine depend on the row's own ctx only (the grid only
decides which slots exist, and every segment of a valid row has one); tile size, tile order and the
combine order are constants of one compiled kernel, and masked keys contribute exact zeros (p =
exp2(-inf) = 0, v loaded as 0). The kernel never sees R; the integer arguments that vary with the batch
(the table and ctx_len strides, which follow nb when they are columns of the per-row metadata tensor, and
the scratch stride) are excluded from Triton's value specialisation, and q, out, the table and ctx_len
(which may be row slices: a step whose partials would pass SCRATCH_BYTES runs in several launches) are
excluded from alignment specialisation, so every batch runs the same binary with the same reduction
order. (The pool pointers come from the allocator: their 16-byte alignment is fixed.) Results are run-to-run
deterministic whichever program draws the last ticket; they are not bitwise equal to SDPA (another
reduction order).

`write_kv` stores K and V of every row in one launch (grid `(R, KVH)`): row r goes to
`cache[write_entry[r] + layer_id, write_offset[r]]`; rows with `write_entry < 0` are skipped. Importing
this module imports Triton.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from looptrace.engine.kernels import launch_mode
from looptrace.engine.kernels.device_helpers import (
    await_inputs,
    let_dependents_launch,
    triton,
    wait_for_inputs,
)
from looptrace.engine.kernels.l2_prefetch import BULK_ASM
from looptrace.engine.kernels.launch_mode import pdl_args
from looptrace.engine.kernels.scratch import tickets as _tickets

tl = triton.language

# Keys per tile, the segment bound and warps: constants of the kernel (the determinism contract), never
# functions of R or nb. 64-key segments give Ouro's 640-key decode row 10 segments per head (160 programs).
# (The defaults below are Ouro's 128-wide heads; `SPLIT_BY_HEAD_DIM` holds the others.)
BLOCK_N = 32
MAX_SEGMENTS = 16
MIN_SEGMENT_TILES = 2
NUM_WARPS = 2
LOG2E = math.log2(math.e)
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@dataclass(frozen=True)
class SplitConfig:
    """The kernel's compile-time split policy. One config serves every launch of a process (the
    determinism contract: never chosen from R or nb); `bench/kernel_decode_attention.py --sweep` times others.
    `min_tiles`: a segment holds at least this many tiles (fewer, longer segments: less partial traffic
    and fewer programs at large batch, less parallelism for one short row)."""

    block_n: int = BLOCK_N
    max_segments: int = MAX_SEGMENTS
    min_tiles: int = MIN_SEGMENT_TILES
    num_warps: int = NUM_WARPS  # (no stages: the key loop's loads are page-table gathers, never pipelined)
    key_slots: bool = False  # per-key-slot softmax state (`_slot_math`): no cross-key reduction per tile


# The H200 sweep (bench/results/h200/kernels/*attention_sweep_h200.md, 19 configs x 9 shapes): 32-key tiles,
# 2 warps and segments of at least 2 tiles had the lowest mean time/floor at Ouro's 128-wide heads (2.26x,
# against 3.15x for the 64-key, 4-warp kernel before it; 32 x 640: 54.5 vs 90.4 µs); at Huginn's 96-wide
# heads 64-key tiles with 2 warps and one-tile segments were best, until the per-key-slot form of Ouro's
# split beat it at every Huginn shape (attention_sweep_slots_h200.md: 64 x 2112 1,021 -> 849 µs,
# 79 % of copy bandwidth; 32 x 2112 513 -> 421 µs). At Ouro's heads the key-slot form is faster for one row
# (1 x 640 6.6 -> 5.9 µs) and slower for 8-64 rows (32 x 640 53.7 -> 57.5 µs: 255 registers per thread),
# so Ouro keeps the plain form unless a recipe asks for key slots (`kernels.attn_slots`, in `fast`). One
# config per head size and recipe: never a function of the batch, so every request and batch of a
# model runs the same binary (the R0 contract).
DEFAULT_SPLIT = SplitConfig()
SPLIT_BY_HEAD_DIM = {96: SplitConfig(key_slots=True)}
# Launches of at most this many rows take the key-slot form under `kernels.attn_slots` and prefetch their
# K/V under `kernels.attn_prefetch`: both were measured faster for one decode row; with both at every row
# count, `fast` decoded 8 and 32 rows 2.4 % and 7 % slower than exactloop (H200). Like the GEMV's
# one-row route, this makes a row's bits under `kernels.attn_slots` (R3) depend on whether it decodes alone.
ONE_ROW_FORMS = 1


def split_for_head(dim: int, key_slots: bool = False) -> SplitConfig:
    """The split of a head size; `key_slots` (`kernels.attn_slots`): in its per-key-slot form."""
    cfg = SPLIT_BY_HEAD_DIM.get(dim, DEFAULT_SPLIT)
    return replace(cfg, key_slots=True) if key_slots else cfg


def segment_keys(ctx: int, cfg: SplitConfig = DEFAULT_SPLIT) -> int:
    """Keys per segment of a row with `ctx` keys (the kernel's `_segment_keys`, for tests and the bench)."""
    tiles = -(-ctx // cfg.block_n)
    return max(cfg.min_tiles, -(-tiles // cfg.max_segments)) * cfg.block_n


def segment_count(ctx: int, cfg: SplitConfig = DEFAULT_SPLIT) -> int:
    return -(-ctx // segment_keys(ctx, cfg))


def launch_split(dim: int, rows: int, key_slots: bool = False) -> SplitConfig:
    """The split a launch of `rows` rows runs: the head size's, in its key-slot form under
    `kernels.attn_slots` for launches of at most ONE_ROW_FORMS rows."""
    return split_for_head(dim, key_slots and rows <= ONE_ROW_FORMS)


def head_split(dim: int) -> tuple[int, int]:
    """(D_A, D_B), both powers of two, D_A + D_B = dim (96 -> 64 + 32; 128 -> 128 + 0); where no such
    split exists, one tile padded to the next power of two (D_A > dim, D_B = 0)."""
    first = 1 << (dim.bit_length() - 1)
    rest = dim - first
    if rest & (rest - 1) == 0:
        return first, rest
    return triton.next_power_of_2(dim), 0


@triton.jit
def _segment_keys(ctx, BLOCK: tl.constexpr, MAX_SEGS: tl.constexpr, MIN_TILES: tl.constexpr):
    tiles = tl.cdiv(tl.cdiv(ctx, BLOCK), MAX_SEGS)
    return tl.maximum(tiles, MIN_TILES) * BLOCK


@triton.jit
def _load_dims(base, rows, kmask, D0: tl.constexpr, W: tl.constexpr, HEAD_DIM: tl.constexpr,
               FULL: tl.constexpr = False):  # fmt: skip
    """`[keys, W]` tile (the cache's dtype) of head dims `D0 .. D0 + W - 1` (past HEAD_DIM: 0) at row
    offsets `rows`. FULL: every key of the tile is valid (no key mask, so no predicates and no zero-fill)."""
    d = D0 + tl.arange(0, W)
    ptrs = base + rows[:, None] + d[None, :]
    if FULL and D0 + W <= HEAD_DIM:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=kmask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _tile_keys(tab, start, end, stride_e, stride_s, PAGE: tl.constexpr, BLOCK: tl.constexpr,
               FULL: tl.constexpr = False):  # fmt: skip
    """Key mask (`pos < end`) and cache row offsets of keys `start .. start + BLOCK - 1`; a key's page
    entry comes from the table (masked keys read no entry: padding pages are never touched)."""
    pos = start + tl.arange(0, BLOCK)
    kmask = pos < end  # end <= ctx  =>  page < ceil(ctx / PAGE)
    if FULL:  # noqa: SIM108 (a constexpr test: only one of the loads is compiled)
        entry = tl.load(tab + pos // PAGE)
    else:
        entry = tl.load(tab + pos // PAGE, mask=kmask, other=0)
    return kmask, entry.to(tl.int64) * stride_e + (pos % PAGE) * stride_s


@triton.jit
def _tile_kv(k_ptr, v_ptr, rows, kmask, HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
             DB_W: tl.constexpr, FULL: tl.constexpr = False):  # fmt: skip
    """K and V of a tile's keys, head dims split as (D_A, D_B) (D_B = 0: `k_b`/`v_b` unused zeros).
    K and V are both requested before any math: one memory round trip per tile, not two."""
    k_a = _load_dims(k_ptr, rows, kmask, 0, D_A, HEAD_DIM, FULL)
    v_a = _load_dims(v_ptr, rows, kmask, 0, D_A, HEAD_DIM, FULL)
    k_b = tl.zeros([rows.shape[0], DB_W], k_a.dtype)
    v_b = tl.zeros([rows.shape[0], DB_W], k_a.dtype)
    if D_B > 0:
        k_b = _load_dims(k_ptr, rows, kmask, D_A, D_B, HEAD_DIM, FULL)
        v_b = _load_dims(v_ptr, rows, kmask, D_A, D_B, HEAD_DIM, FULL)
    return k_a, v_a, k_b, v_b


@triton.jit
def _tile_math(q_a, q_b, k_a, v_a, k_b, v_b, kmask, m_i, l_i, acc_a, acc_b, D_B: tl.constexpr):
    """Online-softmax update of (max, sum, accumulators) by one tile's keys (masked keys: exact zeros)."""
    s = tl.sum(q_a[None, :] * k_a.to(tl.float32), axis=1)
    if D_B > 0:
        s += tl.sum(q_b[None, :] * k_b.to(tl.float32), axis=1)
    s = tl.where(kmask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile holds at least one key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)  # masked keys: exactly 0
    acc_a = acc_a * alpha + tl.sum(p[:, None] * v_a.to(tl.float32), axis=0)
    if D_B > 0:
        acc_b = acc_b * alpha + tl.sum(p[:, None] * v_b.to(tl.float32), axis=0)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return m_new, l_i, acc_a, acc_b


@triton.jit
def _slot_math(q_a, q_b, k_a, v_a, k_b, v_b, kmask, m_i, l_i, acc_a, acc_b, D_B: tl.constexpr,
               FULL: tl.constexpr):  # fmt: skip
    """`_tile_math` with the softmax state kept per key slot (`m_i`, `l_i` `[BLOCK]`; `acc_*` `[BLOCK, W]`):
    slot j sees keys `j, j + BLOCK, ...` of the segment, so a tile needs no reduction over keys (the
    shuffles, shared-memory round trips and barriers of `_tile_math`'s max, sum and p·v); `_merge_slots`
    folds the slots once per segment. FULL: all keys are valid (no mask)."""
    s = tl.sum(q_a[None, :] * k_a.to(tl.float32), axis=1)
    if D_B > 0:
        s += tl.sum(q_b[None, :] * k_b.to(tl.float32), axis=1)
    if not FULL:
        s = tl.where(kmask, s, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slot with no key yet: alpha = p = 0, no NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref)
    acc_a = acc_a * alpha[:, None] + p[:, None] * v_a.to(tl.float32)
    if D_B > 0:
        acc_b = acc_b * alpha[:, None] + p[:, None] * v_b.to(tl.float32)
    return m_new, l_i * alpha + p, acc_a, acc_b


@triton.jit
def _tile(q_a, q_b, k_ptr, v_ptr, tab, start, end, stride_e, stride_s, m_i, l_i, acc_a, acc_b,
          HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DB_W: tl.constexpr,
          PAGE: tl.constexpr, BLOCK: tl.constexpr, KEY_SLOTS: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    """Keys `start .. min(start + BLOCK, end) - 1` loaded and folded into the state (either form).
    k_ptr/v_ptr already point at (layer, kv head) of entry 0."""
    kmask, rows = _tile_keys(tab, start, end, stride_e, stride_s, PAGE, BLOCK, FULL)
    k_a, v_a, k_b, v_b = _tile_kv(k_ptr, v_ptr, rows, kmask, HEAD_DIM, D_A, D_B, DB_W, FULL)
    if KEY_SLOTS:  # (one return: the two forms' states have different shapes)
        m_i, l_i, acc_a, acc_b = _slot_math(q_a, q_b, k_a, v_a, k_b, v_b, kmask, m_i, l_i, acc_a, acc_b, D_B,
                                            FULL)  # fmt: skip
    else:
        m_i, l_i, acc_a, acc_b = _tile_math(q_a, q_b, k_a, v_a, k_b, v_b, kmask, m_i, l_i, acc_a, acc_b, D_B)
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _walk(q_a, q_b, k_ptr, v_ptr, tab, start, end, stride_e, stride_s, m_i, l_i, acc_a, acc_b,
          HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DB_W: tl.constexpr,
          PAGE: tl.constexpr, BLOCK: tl.constexpr, KEY_SLOTS: tl.constexpr):  # fmt: skip
    """The tiles from `start` to `end`, in order. Key slots: the full tiles unmasked, then the partial one
    (the plain form masks every tile). No tile when `start >= end`."""
    full_end = end
    if KEY_SLOTS:
        full_end = tl.maximum(start, start + (end - start) // BLOCK * BLOCK)
    if COMPILED:
        for t in range(start, full_end, BLOCK):
            m_i, l_i, acc_a, acc_b = _tile(
                q_a, q_b, k_ptr, v_ptr, tab, t, end, stride_e, stride_s, m_i, l_i, acc_a, acc_b,
                HEAD_DIM, D_A, D_B, DB_W, PAGE, BLOCK, KEY_SLOTS, KEY_SLOTS,
            )  # fmt: skip
    else:  # the interpreter cannot take a loaded bound in range() (numpy >= 2): same tiles, same order
        t = start
        while t < full_end:
            m_i, l_i, acc_a, acc_b = _tile(
                q_a, q_b, k_ptr, v_ptr, tab, t, end, stride_e, stride_s, m_i, l_i, acc_a, acc_b,
                HEAD_DIM, D_A, D_B, DB_W, PAGE, BLOCK, KEY_SLOTS, KEY_SLOTS,
            )  # fmt: skip
            t += BLOCK
    if KEY_SLOTS:  # noqa: SIM102 (a constexpr test, then a device one)
        if full_end < end:
            m_i, l_i, acc_a, acc_b = _tile(
                q_a, q_b, k_ptr, v_ptr, tab, full_end, end, stride_e, stride_s, m_i, l_i, acc_a, acc_b,
                HEAD_DIM, D_A, D_B, DB_W, PAGE, BLOCK, True, False,
            )  # fmt: skip
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _initial_state(BLOCK: tl.constexpr, D_A: tl.constexpr, DB_W: tl.constexpr, KEY_SLOTS: tl.constexpr):
    """(max, sum, acc_a, acc_b) before any key: scalars and `[W]` accumulators, or per key slot."""
    if KEY_SLOTS:  # (one return: the two forms' states have different shapes)
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        acc_a = tl.zeros([BLOCK, D_A], tl.float32)
        acc_b = tl.zeros([BLOCK, DB_W], tl.float32)
    else:
        m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        acc_a = tl.zeros([D_A], tl.float32)
        acc_b = tl.zeros([DB_W], tl.float32)
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _merge_slots(m_i, l_i, acc_a, acc_b):
    """(max, sum, acc) of a segment from its key slots, in one fixed order (as `_combine` merges segments)."""
    m = tl.max(m_i, axis=0)  # finite: the segment holds at least one key
    w = tl.exp2(m_i - m)  # slots that saw no key: exp2(-inf) = 0
    return m, tl.sum(l_i * w, axis=0), tl.sum(acc_a * w[:, None], axis=0), tl.sum(acc_b * w[:, None], axis=0)


@triton.jit
def _store_out(out, acc_a, acc_b, l_i, HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr):
    """`acc / sum` (IEEE division, one rounding to out's dtype); zeros where the row had no keys."""
    has_keys = l_i > 0.0
    den = tl.where(has_keys, l_i, 1.0)
    d_a = tl.arange(0, D_A)
    o_a = tl.where(has_keys, tl.math.div_rn(acc_a, den), 0.0)
    tl.store(out + d_a, o_a.to(out.dtype.element_ty), mask=d_a < HEAD_DIM)
    if D_B > 0:
        o_b = tl.where(has_keys, tl.math.div_rn(acc_b, den), 0.0)
        tl.store(out + D_A + tl.arange(0, D_B), o_b.to(out.dtype.element_ty))


@triton.jit
def _store_partial(part_ptr, ml_ptr, idx, m_i, l_i, acc_a, acc_b,
                   HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr):  # fmt: skip
    d_a = tl.arange(0, D_A)
    tl.store(part_ptr + idx * HEAD_DIM + d_a, acc_a, mask=d_a < HEAD_DIM)
    if D_B > 0:
        tl.store(part_ptr + idx * HEAD_DIM + D_A + tl.arange(0, D_B), acc_b)
    tl.store(ml_ptr + idx * 2, m_i)
    tl.store(ml_ptr + idx * 2 + 1, l_i)


@triton.jit
def _combined_dims(part_ptr, idx, valid, w, D0: tl.constexpr, W: tl.constexpr, HEAD_DIM: tl.constexpr):
    """sum over partial slots of `w[s] * acc_s[D0 : D0 + W]` (invalid slots: 0), fixed order."""
    d = D0 + tl.arange(0, W)
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(part_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return tl.sum(acc * w[:, None], axis=0)


@triton.jit
def _combine(out, part_ptr, ml_ptr, first_idx, parts,
             HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DB_W: tl.constexpr,
             MAX_SEGS: tl.constexpr):  # fmt: skip
    """Segments 0 .. parts-1 of one (row, head), read back from scratch, combined into the output."""
    slot = tl.arange(0, MAX_SEGS)
    valid = slot < parts
    idx = first_idx + slot
    m_s = tl.load(ml_ptr + idx * 2, mask=valid, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(ml_ptr + idx * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
    w = tl.exp2(m_s - tl.max(m_s, axis=0))  # empty slots: exp2(-inf) = 0
    l_i = tl.sum(l_s * w, axis=0)
    acc_a = _combined_dims(part_ptr, idx, valid, w, 0, D_A, HEAD_DIM)
    acc_b = tl.zeros([DB_W], tl.float32)
    if D_B > 0:
        acc_b = _combined_dims(part_ptr, idx, valid, w, D_A, D_B, HEAD_DIM)
    _store_out(out, acc_a, acc_b, l_i, HEAD_DIM, D_A, D_B)


@triton.jit
def _load_q(
    q_ptr, qk_scale, HEAD_DIM: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DB_W: tl.constexpr
):
    """q pre-scaled by `scale * log2(e)`: scores come out in log2 units for exp2."""
    d_a = tl.arange(0, D_A)
    q_a = tl.load(q_ptr + d_a, mask=d_a < HEAD_DIM, other=0.0).to(tl.float32) * qk_scale
    q_b = tl.zeros([DB_W], tl.float32)
    if D_B > 0:
        q_b = tl.load(q_ptr + D_A + tl.arange(0, D_B)).to(tl.float32) * qk_scale
    return q_a, q_b


@triton.jit
def _prefetch_segment(k_ptr, v_ptr, tab, ctx_ptr, row, part, stride_c, stride_e, stride_s,
                      HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, MAX_SEGS: tl.constexpr,
                      MIN_TILES: tl.constexpr, KEYS: tl.constexpr):  # fmt: skip
    """L2 prefetch of the K and V rows of the segment's first KEYS keys (`kernels.attn_prefetch`). Runs
    before the PDL wait, so it reads the context length and the table through L2 only (`.cg`: nothing it
    reads stays in L1 for the loads after the wait) and only issues hints: whatever it read (a row the
    kernel before is still writing included), the kernel's values are unchanged."""
    ctx = tl.load(ctx_ptr + row * stride_c, cache_modifier=".cg")
    seg_keys = _segment_keys(ctx, BLOCK, MAX_SEGS, MIN_TILES)
    first = part * seg_keys
    pos = first + tl.arange(0, KEYS)
    live = pos < tl.minimum(first + seg_keys, ctx)
    entry = tl.load(tab + pos // PAGE, mask=live, other=0, cache_modifier=".cg")
    rows = entry.to(tl.int64) * stride_e + (pos % PAGE) * stride_s
    # whole rows of one head (bf16: Ouro 256, Huginn 192 bytes; bulk sizes are 16-byte units)
    size = tl.full(rows.shape, HEAD_DIM * k_ptr.dtype.element_ty.primitive_bitwidth // 8, tl.int32)
    flag = live.to(tl.int32)
    tl.inline_asm_elementwise(BULK_ASM, "=r,l,r,r", [k_ptr + rows, size, flag], dtype=tl.int32, is_pure=False,
                              pack=1)  # fmt: skip
    tl.inline_asm_elementwise(BULK_ASM, "=r,l,r,r", [v_ptr + rows, size, flag], dtype=tl.int32, is_pure=False,
                              pack=1)  # fmt: skip


@triton.jit(
    do_not_specialize=["layer_id", "stride_t", "stride_c", "seg_stride"],
    do_not_specialize_on_alignment=["q_ptr", "out_ptr", "tab_ptr", "ctx_ptr"],  # row slices of a launch
)
def _attn_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, ctx_ptr, out_ptr, part_ptr, ml_ptr, ticket_ptr,
                 layer_id, qk_scale, stride_qr, stride_qh, stride_e, stride_s, stride_kh, stride_t, stride_c,
                 stride_or, seg_stride, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_A: tl.constexpr,
                 D_B: tl.constexpr, DB_W: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                 MAX_SEGS: tl.constexpr, MIN_TILES: tl.constexpr, KEY_SLOTS: tl.constexpr = False,
                 PDL: tl.constexpr = False, PREFETCH_KEYS: tl.constexpr = 0):  # fmt: skip
    let_dependents_launch(PDL)
    row, head, part = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # rows: axis 0 (2^31)
    shift = layer_id.to(tl.int64) * stride_e + (head // GROUP).to(tl.int64) * stride_kh  # layer, kv head
    k_ptr, v_ptr, tab = k_ptr + shift, v_ptr + shift, tab_ptr + row * stride_t
    if PREFETCH_KEYS > 0:  # kernels.attn_prefetch, under PDL only: hints while the kernel before finishes
        _prefetch_segment(k_ptr, v_ptr, tab, ctx_ptr, row, part, stride_c, stride_e, stride_s, HEAD_DIM, PAGE,
                          BLOCK, MAX_SEGS, MIN_TILES, PREFETCH_KEYS)  # fmt: skip
    wait_for_inputs(PDL)
    ctx = tl.load(ctx_ptr + row * stride_c)
    seg_keys = _segment_keys(ctx, BLOCK, MAX_SEGS, MIN_TILES)
    parts = tl.cdiv(ctx, seg_keys)
    if part < tl.maximum(parts, 1):  # segment 0 of a ctx-0 row writes its zeros
        q_a, q_b = _load_q(q_ptr + row * stride_qr + head * stride_qh, qk_scale, HEAD_DIM, D_A, D_B, DB_W)
        m_i, l_i, acc_a, acc_b = _initial_state(BLOCK, D_A, DB_W, KEY_SLOTS)
        first = part * seg_keys
        m_i, l_i, acc_a, acc_b = _walk(
            q_a, q_b, k_ptr, v_ptr, tab, first, tl.minimum(first + seg_keys, ctx), stride_e, stride_s, m_i,
            l_i, acc_a, acc_b, HEAD_DIM, D_A, D_B, DB_W, PAGE, BLOCK, KEY_SLOTS,
        )  # fmt: skip
        if KEY_SLOTS:
            m_i, l_i, acc_a, acc_b = _merge_slots(m_i, l_i, acc_a, acc_b)
        out = out_ptr + row * stride_or + head * HEAD_DIM
        if parts <= 1:
            _store_out(out, acc_a, acc_b, l_i, HEAD_DIM, D_A, D_B)
        else:
            pair = row * tl.num_programs(1) + head
            _store_partial(
                part_ptr, ml_ptr, pair * seg_stride + part, m_i, l_i, acc_a, acc_b, HEAD_DIM, D_A, D_B
            )
            tl.debug_barrier()  # all of this program's stores happen before its ticket releases them
            if tl.atomic_add(ticket_ptr + pair, 1, sem="acq_rel") == parts - 1:  # the last segment to finish
                _combine(out, part_ptr, ml_ptr, pair * seg_stride, parts, HEAD_DIM, D_A, D_B, DB_W, MAX_SEGS)
                tl.store(ticket_ptr + pair, 0)  # every segment has drawn: ready for the next launch


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
    PDL: tl.constexpr = False,
):
    await_inputs(PDL)
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


def segment_slots(table_width: int, page: int, cfg: SplitConfig = DEFAULT_SPLIT) -> int:
    """Grid size over segments: the most segments any row that fits a table of `table_width` pages can have.

    Not `segment_count(table_width * page)`: the count is not monotonic in the context (1,024 keys are 16
    one-tile segments, 1,025 keys 9 two-tile ones), so a row of 1,000 keys in a 70-page table needs 16
    slots where 1,120 keys would need 9. With too few slots a row's last segments never ran, its ticket
    never reached the combine and the counter stayed off zero for every later launch (the H200's first
    GPU run: batch-invariance and graph-replay failures, then every GEMV test in the same process, which
    shares the counters)."""
    if not table_width:
        return 1
    tiles = -(-table_width * page // cfg.block_n)
    # the count rises with ctx up to max_segments one-min_tiles segments (ctx = max_segments * min_tiles
    # tiles), then never exceeds max_segments: the most any held context has
    return min(cfg.max_segments, -(-tiles // cfg.min_tiles))


def prefetch_keys(cfg: SplitConfig) -> int:
    """Keys per segment whose K/V rows a program prefetches before its PDL wait: the shortest segment."""
    return cfg.block_n * cfg.min_tiles


SCRATCH_BYTES = 1 << 28  # partials of one launch (fp32 acc + max/sum per (row, head, segment slot))


def rows_per_launch(rows: int, heads: int, slots: int, dim: int) -> int:
    """Rows one launch takes so that its partials fit SCRATCH_BYTES (all of them without partials)."""
    return min(rows, max(1, SCRATCH_BYTES // (heads * slots * (dim + 2) * 4))) if slots > 1 else rows


def _launch(q, k_cache, v_cache, tables, ctx_lens, out, layer_id, scale, cfg, slots, strides, shape,
            prefetch: bool) -> None:  # fmt: skip
    rows, heads, dim = q.shape
    scratch = rows * heads * slots if slots > 1 else 1  # one-segment rows never touch it
    partials = torch.empty((scratch, dim), dtype=torch.float32, device=q.device)
    max_sum = torch.empty((scratch, 2), dtype=torch.float32, device=q.device)
    d_a, d_b = head_split(dim)
    launch = pdl_args()
    _attn_kernel[(rows, heads, slots)](
        q, k_cache, v_cache, tables, ctx_lens, out, partials, max_sum, _tickets(q.device, rows * heads),
        layer_id, float(scale) * LOG2E, *strides, tables.stride(0), ctx_lens.stride(0), out.stride(0), slots,
        **shape, D_A=d_a, D_B=d_b, DB_W=max(d_b, 16), BLOCK=cfg.block_n, MAX_SEGS=cfg.max_segments,
        MIN_TILES=cfg.min_tiles, KEY_SLOTS=cfg.key_slots, num_warps=cfg.num_warps, num_stages=1, **launch,
        PREFETCH_KEYS=prefetch_keys(cfg) if prefetch else 0,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    layer_id: int,
    scale: float,
    cfg: SplitConfig | None = None,
    key_slots: bool = False,
) -> torch.Tensor:
    """Attention of every row over its own pages; returns `[R, H * D]` in q's dtype.

    q `[R, H, D]`; k_cache/v_cache the entry view `[E, block_size, KVH, D]`; tables `[R, nb]` int64 entry
    bases (-1 beyond the row's pages; may be a column slice of the metadata tensor); ctx_lens `[R]` int64
    (may be strided): row r attends to key positions `0 .. ctx_lens[r] - 1`, whose page p slot s sits at
    `k_cache[tables[r, p] + layer_id, s]`. ctx 0 (padding row): zeros. See the module docstring for the
    design and the batch-invariance contract. `key_slots` (`kernels.attn_slots`): a launch of at most
    ONE_ROW_FORMS rows runs the head size's split in its per-key-slot form (another reduction order);
    `cfg` overrides both.
    """
    q, tables, out, strides, shape = prepare(q, k_cache, v_cache, tables)
    rows, heads, dim = q.shape
    if rows == 0:
        return out
    cfg = cfg or launch_split(dim, rows, key_slots)
    prefetch = launch_mode.kv_prefetch() and rows <= ONE_ROW_FORMS  # kernels.attn_prefetch (under PDL only)
    del shape["D_PAD"]  # the attention kernel takes D_A + D_B
    slots = segment_slots(tables.shape[1], shape["PAGE"], cfg)
    # Rows per launch: the partials of a launch stay under SCRATCH_BYTES (a 65,536-row prefill step of
    # Ouro would need 8 GiB). A row's result never depends on its batch-mates, so slicing the rows
    # changes no bit.
    per_launch = rows_per_launch(rows, heads, slots, dim)
    for first in range(0, rows, per_launch):
        last = min(rows, first + per_launch)
        _launch(q[first:last], k_cache, v_cache, tables[first:last], ctx_lens[first:last], out[first:last],
                layer_id, scale, cfg, slots, strides, shape, prefetch)  # fmt: skip
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
        **pdl_args(),
    )


__all__ = [
    "BLOCK_N",
    "DEFAULT_SPLIT",
    "SplitConfig",
    "MAX_SEGMENTS",
    "NUM_WARPS",
    "head_split",
    "paged_attention",
    "segment_keys",
    "split_for_head",
    "write_kv",
]
