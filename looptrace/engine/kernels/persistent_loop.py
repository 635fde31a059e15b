"""One Ouro loop (every core layer, then the final norm) at a few decode rows as one persistent Triton
kernel (`kernels.persistent_loop`, R3 over exactloop). Imports Triton.

Why: at batch 1, `fast` runs Ouro-1.4B's token as ~700 dependent launches (per layer pass: q/k/v GEMV with
RoPE and the K/V write, attention, o GEMV, residual norm, gate/up GEMV with SiLU, down GEMV, residual norm).
Each launch starts with a ramp and ends with a tail in which the memory system idles, and at one row those
boundaries cost more than the work they separate. Here the grid is one program per SM for the whole loop:
the programs stream every stage's weights and wait for one another at the stage boundaries through a
device counter (`_grid_barrier`), not a launch. A program's GEMV items of the whole loop (every layer's
q/k/v, o, gate/up and down units) form one stream, and a ring of `LOOK` weight tiles runs ahead of it
(`_fetch`): weights are never written, so the ring crosses stage and layer boundaries, and the next
stage's bytes are in flight while the slowest program finishes the stage before. Tiles are loaded as int32
words of bf16 pairs and each stream position keeps one ring slot (`_weight_tile`, `_take`): held as bf16
values, or moved between slots, a tile was repacked or copied by instructions that read its registers, and
those waited for the load at once (bench/kernel_persistent_loop_compile.py's tile-load overlap).

Stages of layer l (every program takes units `pid, pid + P, ...` of each):
- QKV: the residual stream h (the loop input at l = 0; else M + post2(down) of layer l - 1, stored by program
  0 in H), x = in1(h) (every program computes it: the norm needs all of h); q/k/v rows in units of 4
  rotate-half pairs (8 W rows), RoPE on q and k, q to a buffer, k and v into the paged cache.
- ATTN: (row, head, split) items of split-KV attention; a split's (max, sum, acc) partial goes to scratch,
  and the last split of a (row, head) to draw a ticket combines them in split order (deterministic).
- O_PROJ: 8-row units of o_proj over the combined attention output.
- GATE_UP: M = h + in2(o) (program 0 stores it), x = post1(M); units of 4 gate rows and the 4 up rows
  paired with them, storing SiLU(gate)·up.
- DOWN: 8-row units of down_proj.
After the last layer, every program computes norm(M + post2(down)) and program 0 stores it: the new state.

Arithmetic (R3): fp32 products summed per 8-row unit over K tiles in a fixed order, rounded to bf16 wherever
the eager model stores a bf16 tensor (projections, norms, residual adds, RoPE terms, SiLU, the product), so
it tracks the eager bf16 model closely; not the cuBLAS / PyTorch bits. Every row of a launch goes through
the same per-row code (`tl.static_range` over rows), so a row's bits do not depend on the other rows, and
every reduction order is fixed by the unit layout, so a launch repeats bit for bit.

`STAGE >= 0` runs one stage of one layer per launch and no barrier (`loop_staged`): the Triton interpreter
runs programs one after another, so a grid barrier would never open there; the staged form checks the same
stage code on a CPU, and on a GPU it is the persistent launch's bitwise twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looptrace.engine.kernels.device_helpers import (
    INTERPRET,
    let_dependents_launch,
    round_bf16,
    triton,
    wait_for_inputs,
)
from looptrace.engine.kernels.l2_prefetch import BULK_ASM
from looptrace.engine.kernels.launch_mode import pdl_args

tl = triton.language

MAX_ROWS = 8  # rows one launch serves (decode); more rows take the layer-by-layer path
COMBINE = tl.constexpr(16)  # split partials per load of the attention's combine
# The stages (`STAGE`: -1 all of them behind barriers, else this one alone); also the GEMV epilogues.
QKV, ATTN, O_PROJ, GATE_UP, DOWN, FINAL = (tl.constexpr(stage) for stage in range(6))
MAX_SPINS = 1 << 24  # polls of a barrier before it gives up (seconds): never a hang
LAYER_STAGES = (0, 1, 2, 3, 4)  # one layer's stages in order (host side)
FINAL_STAGE = 5
INTERPRETED = tl.constexpr(INTERPRET)


# ------------------------------------------------------------------------------------------ device helpers


@triton.jit
def _program():
    """(program id, programs) as scalars (the interpreter gives one-element arrays, which `range` refuses)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    if INTERPRETED:
        pid, programs = (
            tl.sum(pid + tl.zeros([1], tl.int32), 0),
            tl.sum(programs + tl.zeros([1], tl.int32), 0),
        )
    return pid, programs


# Thread 0 polls the arrival counter (`ld.acquire.gpu`) until it reaches the target or MAX_SPINS polls pass;
# the other threads skip the loop (a CTA's bar.sync after it holds them). Returns the last count seen (the
# target on the other threads). Labels inside `{}` are local to the block, so the asm may appear many times.
WAIT_PTX = f"""{{
.reg .pred %p_lead, %p_more;
.reg .b32 %lt_tid, %spins;
mov.u32 %lt_tid, %tid.x;
setp.eq.u32 %p_lead, %lt_tid, 0;
mov.u32 $0, $2;
@!%p_lead bra DONE;
mov.u32 %spins, 0;
POLL:
ld.acquire.gpu.global.b32 $0, [$1];
add.u32 %spins, %spins, 1;
setp.lt.s32 %p_more, $0, $2;
setp.lt.and.u32 %p_more, %spins, {MAX_SPINS}, %p_more;
@%p_more bra POLL;
DONE:
}}"""
_WAIT_ASM = tl.constexpr(WAIT_PTX)


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Wait until every program has arrived `target // P` times: all stores before it are visible to every
    program after it (a release add on arrival; thread 0 polls with acquire loads, then a CTA barrier passes
    what it saw to the other threads, as cooperative groups' grid sync does; data made inside the launch is
    read `.cg`)."""
    tl.debug_barrier()  # every thread's stores are done before this program's arrival releases them
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    if INTERPRETED:  # one program (`loop_persistent` refuses more there): it is the last to arrive
        seen = tl.load(bar_ptr)
    else:
        seen = tl.inline_asm_elementwise(
            _WAIT_ASM, "=r,l,r", [bar_ptr, target], dtype=tl.int32, is_pure=False, pack=1
        )
    if seen < target:  # a program never arrived (not resident, or a bug): give up rather than hang the GPU
        tl.atomic_add(bar_ptr + 2, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rms(x, w, N: tl.constexpr, eps):
    """Eager RMSNorm of fp32 rows `[RP, BH]` holding bf16 values: bf16(bf16(x rsqrt(mean(x^2) + eps)) w)."""
    ms = tl.sum(x * x, axis=1) / N
    return round_bf16(round_bf16(x * tl.rsqrt(ms + eps)[:, None]) * w[None, :])


@triton.jit
def _load_rows(ptr, stride_r, R, RP: tl.constexpr, cols, N: tl.constexpr):
    """`[RP, len(cols)]` fp32 of a bf16 buffer's rows (rows >= R and cols >= N: 0), through L2 (`.cg`):
    other programs of this launch wrote them."""
    rows = tl.arange(0, RP)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    ptrs = ptr + rows[:, None] * stride_r + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _store_rows(ptr, stride_r, R, RP: tl.constexpr, cols, N: tl.constexpr, values):
    rows = tl.arange(0, RP)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    tl.store(ptr + rows[:, None] * stride_r + cols[None, :], values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unit_rows(u, PAIR_OFF: tl.constexpr, HALF: tl.constexpr, HEAD: tl.constexpr):
    """W rows of unit u: 4 first members of pairs and their partners PAIR_OFF further. Plain units
    (PAIR_OFF = 4) are 8 consecutive rows; q/k/v units (HALF = D/2) hold dims of one head; gate/up units
    (PAIR_OFF = INTER) hold 4 gate rows and the up rows of the same outputs."""
    j = tl.arange(0, 8)
    pair = u * 4 + j % 4
    first = (pair // HALF) * HEAD + pair % HALF
    return first + tl.where(j < 4, 0, PAIR_OFF)


@triton.jit
def _weight_tile(w_ptr, stride_w, rows, k0, K: tl.constexpr, BK: tl.constexpr, live):
    """`[8, BK // 2]` int32 words, each two bf16 weights (columns 2j, 2j + 1; zeros where not live).

    Words, not bf16 values: a tile held across loop iterations is then plain 32-bit registers. Held as bf16
    it was repacked two halves at a time (`PRMT`) wherever the compiler merged it, and a repack reads the
    loaded registers, so it waited for the load it was meant to leave in flight."""
    kp = k0 // 2 + tl.arange(0, BK // 2)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    ptrs = words + rows[:, None].to(tl.int64) * (stride_w // 2) + kp[None, :]
    if K % BK:
        return tl.load(ptrs, mask=live & (kp < K // 2)[None, :], other=0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=live, other=0, eviction_policy="evict_first")  # whole tiles: vector loads


@triton.jit
def _unpack(words):
    """int32 words of bf16 pairs -> (even, odd) values as fp32 (a bf16 is the top half of its fp32)."""
    even = (words << 16).to(tl.float32, bitcast=True)
    odd = (words & -65536).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def _unit_tile(w_ptr, stride_w, u, kt, live, PAIR_OFF: tl.constexpr, HALF: tl.constexpr, HEAD: tl.constexpr,
               K: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The weight tile of (unit u, K tile kt): `[8, BK // 2]` words of bf16 pairs (zeros where not live)."""
    rows = _unit_rows(u, PAIR_OFF, HALF, HEAD)
    return _weight_tile(w_ptr, stride_w, rows, kt * BK, K, BK, live)


@triton.jit
def _x_words(x_ptr, stride_x, R, RP: tl.constexpr, kp, K: tl.constexpr, BK: tl.constexpr):
    """x's rows at word columns kp as (even, odd) fp32 `[RP, BK // 2]` (rows >= R: 0; written by this
    launch: through L2)."""
    rows = tl.arange(0, RP)
    ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_x // 2) + kp[None, :]
    mask = (rows < R)[:, None]
    if K % BK:
        mask = mask & (kp < K // 2)[None, :]
    return _unpack(tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg"))


@triton.jit
def _split_columns(x, RP: tl.constexpr, BK: tl.constexpr):
    """`[RP, BK]` fp32 -> (even columns, odd columns), each `[RP, BK // 2]`."""
    return tl.split(tl.reshape(x, [RP, BK // 2, 2]))


@triton.jit
def _stage_items(U, K: tl.constexpr, BK: tl.constexpr):
    """This program's (unit, K tile) items of a GEMV stage of U units: units pid, pid + P, ..."""
    pid, P = _program()
    return (U - pid + P - 1) // P * ((K + BK - 1) // BK)  # pid < P: never negative


@triton.jit
def _item_counts(H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                 BK: tl.constexpr):  # fmt: skip
    """This program's items per layer in each GEMV stage: (q/k/v, o, gate/up, down)."""
    return (
        _stage_items((HQ + 2 * HK) * D // 8, H, BK),
        _stage_items(H // 8, HQ * D, BK),
        _stage_items(INTER // 4, H, BK),
        _stage_items(H // 8, INTER, BK),
    )


@triton.jit
def _item_tile(w_ptr, stride_w, j, live, PAIR_OFF: tl.constexpr, HALF: tl.constexpr, HEAD: tl.constexpr,
               K: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The weight tile of this program's item j of one stage (units in the outer order, K tiles inner)."""
    pid, P = _program()
    KT: tl.constexpr = (K + BK - 1) // BK
    return _unit_tile(w_ptr, stride_w, pid + (j // KT) * P, j % KT, live, PAIR_OFF, HALF, HEAD, K, BK)


@triton.jit
def _fetch(e, counts, weights, L, H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr,
           D: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The weight tile of this program's GEMV item e. A program's items form one stream over the whole loop
    (every layer: its q/k/v, o, gate/up and down items), so a fetch ahead crosses stage and layer boundaries
    like any other: weights are never written. Past the loop's last item: zeros, no load."""
    wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, _wn, _wf = weights
    n_qkv, n_o, n_gu, n_down = counts
    per_layer = n_qkv + n_o + n_gu + n_down
    live = e < L * per_layer
    layer = tl.minimum(e // per_layer, L - 1).to(tl.int64)
    j = e % per_layer
    n = (HQ + 2 * HK) * D
    if j < n_qkv:
        tile = _item_tile(wqkv_ptr + layer * n * H, H, j, live, D // 2, D // 2, D, H, BK)
    elif j < n_qkv + n_o:
        tile = _item_tile(wo_ptr + layer * H * HQ * D, HQ * D, j - n_qkv, live, 4, 4, 8, HQ * D, BK)
    elif j < n_qkv + n_o + n_gu:
        tile = _item_tile(wgu_ptr + layer * 2 * INTER * H, H, j - n_qkv - n_o, live, INTER, 1 << 30, 1 << 30,
                          H, BK)  # fmt: skip
    else:
        tile = _item_tile(wd_ptr + layer * H * INTER, INTER, j - n_qkv - n_o - n_gu, live, 4, 4, 8, INTER, BK)
    return tile


@triton.jit
def _fill_ring(e, fetch, LOOK: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr,
               HK: tl.constexpr, D: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """The ring of tiles in flight: items e .. e + LOOK - 1 (LOOK <= 3), the item at stream position p in
    slot p % LOOK (`_take`)."""
    counts, weights, L = fetch
    t0 = _fetch(e + (0 - e % LOOK + LOOK) % LOOK, counts, weights, L, H, INTER, HQ, HK, D, BK)
    if LOOK == 1:
        ring = (t0,)
    elif LOOK == 2:
        ring = (t0, _fetch(e + (1 - e % LOOK + LOOK) % LOOK, counts, weights, L, H, INTER, HQ, HK, D, BK))
    else:
        t1 = _fetch(e + (1 - e % LOOK + LOOK) % LOOK, counts, weights, L, H, INTER, HQ, HK, D, BK)
        ring = (t0, t1, _fetch(e + (2 - e % LOOK + LOOK) % LOOK, counts, weights, L, H, INTER, HQ, HK, D, BK))
    return ring


@triton.jit
def _take(ring, e, fetch, LOOK: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr,
          HK: tl.constexpr, D: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Item e's tile as fp32 (even, odd) columns, and the ring with item e + LOOK fetched into the slot it
    leaves.

    Each stream position p has the fixed slot p % LOOK, so no tile ever moves between slots: a move of a
    tile's registers is an instruction that reads them, which waits for their load. (Rotating the ring as
    a queue compiled to such moves, and each item waited for the tile it had just asked for.) The tile is
    unpacked before the slot is refilled, so the new load can take the slot's own registers."""
    counts, weights, L = fetch
    if LOOK == 1:
        wf = _unpack(ring[0])
        ring = (_fetch(e + 1, counts, weights, L, H, INTER, HQ, HK, D, BK),)
    elif LOOK == 2:
        r0, r1 = ring
        if e % 2 == 0:
            wf = _unpack(r0)
            r0 = _fetch(e + 2, counts, weights, L, H, INTER, HQ, HK, D, BK)
        else:
            wf = _unpack(r1)
            r1 = _fetch(e + 2, counts, weights, L, H, INTER, HQ, HK, D, BK)
        ring = (r0, r1)
    else:
        r0, r1, r2 = ring
        if e % 3 == 0:
            wf = _unpack(r0)
            r0 = _fetch(e + 3, counts, weights, L, H, INTER, HQ, HK, D, BK)
        elif e % 3 == 1:
            wf = _unpack(r1)
            r1 = _fetch(e + 3, counts, weights, L, H, INTER, HQ, HK, D, BK)
        else:
            wf = _unpack(r2)
            r2 = _fetch(e + 3, counts, weights, L, H, INTER, HQ, HK, D, BK)
        ring = (r0, r1, r2)
    return wf, ring


@triton.jit
def _gemv_stage(ring, e, fetch, x_ptr, stride_x, x_rows, R, U, out, RP: tl.constexpr, PAIR_OFF: tl.constexpr,
                HALF: tl.constexpr, HEAD: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, EPI: tl.constexpr,
                LOOK: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr,
                D: tl.constexpr, JOINT: tl.constexpr):  # fmt: skip
    """This program's units of `x @ W.T` (x: `[R, K]` bf16), each unit's `[RP, 8]` fp32 sums handed to the
    epilogue EPI (QKV, GATE_UP or plain) with `out` (that epilogue's tuple of outputs). The (unit, K tile)
    items come from the ring of tiles in flight, oldest first; taking one fetches the item LOOK further on
    in the program's stream (`_fetch`), which near the stage's end is the next stage's. Returns the ring
    and the stream position after this stage. `x_rows`: x in this program's registers (fp32 `[RP, BH]`, the
    q/k/v and gate/up stages: this program normed it), else 0 (x made by other programs: read from L2)."""
    pid, P = _program()
    KT: tl.constexpr = (K + BK - 1) // BK
    counts, weights, L = fetch
    items = _stage_items(U, K, BK)
    # sums kept as [8, RP] (a unit's W rows down, x rows across): each row's [8] sums join them in the
    # layout the reduction left them, with no exchange; transposed once per unit for the epilogue
    acc = tl.zeros([8, RP], tl.float32)
    row_ids = tl.arange(0, RP)
    words = tl.arange(0, BK // 2)
    if KT == 1:  # one K tile: x is the same for every item (taken once per stage, held in registers)
        if isinstance(x_rows, tl.tensor) and x_rows.shape[1] == BK:
            x_even, x_odd = _split_columns(x_rows, RP, BK)  # in registers already: no round trip through L2
        else:
            x_even, x_odd = _x_words(x_ptr, stride_x, R, RP, words, K, BK)
    item = items * 0  # a while loop: the interpreter's range() refuses a computed bound (numpy >= 2)
    while item < items:
        tile, ring = _take(ring, e, fetch, LOOK, H, INTER, HQ, HK, D, BK)
        w_even, w_odd = tile
        kt = item % KT
        if KT > 1:
            x_even, x_odd = _x_words(x_ptr, stride_x, R, RP, kt * (BK // 2) + words, K, BK)
        if JOINT:  # every row in one reduction: one cross-warp exchange per item, not one per row
            prod = w_even[None, :, :] * x_even[:, None, :] + w_odd[None, :, :] * x_odd[:, None, :]
            acc += tl.trans(tl.sum(prod, axis=2))
        else:
            for r in tl.static_range(RP):  # one row at a time: a row's sums never depend on the others
                xe, xo = _row(x_even, r, RP), _row(x_odd, r, RP)
                part = tl.sum(w_even * xe[None, :] + w_odd * xo[None, :], axis=1)
                acc += tl.where(row_ids[None, :] == r, part[:, None], 0.0)
        if kt == KT - 1:
            u = pid + (item // KT) * P
            sums = tl.trans(acc)
            if EPI == QKV:
                _qkv_epilogue(sums, u, R, RP, HALF, out)
            elif EPI == GATE_UP:
                _silu_epilogue(sums, u, R, RP, out)
            else:
                _plain_epilogue(sums, _unit_rows(u, PAIR_OFF, HALF, HEAD), R, RP, out)
            acc = tl.zeros([8, RP], tl.float32)
        item += 1
        e += 1
    return ring, e


@triton.jit
def _row(rows, r: tl.constexpr, RP: tl.constexpr):
    """Row r of a `[RP, N]` tile as fp32 `[N]` (each thread holds every row of its columns: no exchange)."""
    if RP == 1:
        row = tl.reshape(rows, [rows.shape[1]]).to(tl.float32)
    else:
        row = tl.sum(tl.where(tl.arange(0, RP)[:, None] == r, rows.to(tl.float32), 0.0), axis=0)
    return row


@triton.jit
def _split_pairs(acc, RP: tl.constexpr):
    """`[RP, 8]` unit sums -> (first members, partners), each `[RP, 4]`."""
    first, second = tl.split(tl.permute(tl.reshape(acc, [RP, 2, 4]), (0, 2, 1)))
    return first, second


@triton.jit
def _plain_epilogue(acc, rows, R, RP: tl.constexpr, out):
    out_ptr, stride_o = out
    r = tl.arange(0, RP)
    tl.store(out_ptr + r[:, None] * stride_o + rows[None, :], acc.to(tl.bfloat16), mask=(r < R)[:, None])


@triton.jit
def _silu_epilogue(acc, u, R, RP: tl.constexpr, out):
    """SiLU(gate)·up as eager bf16 does it: bf16(bf16(silu(bf16 gate)) * bf16 up)."""
    act_ptr, stride_a = out
    gate, up = _split_pairs(acc, RP)
    gate, up = round_bf16(gate), round_bf16(up)
    act = round_bf16(gate / (1.0 + tl.exp(-gate))) * up
    r = tl.arange(0, RP)
    cols = u * 4 + tl.arange(0, 4)
    tl.store(act_ptr + r[:, None] * stride_a + cols[None, :], act.to(tl.bfloat16), mask=(r < R)[:, None])


@triton.jit
def _qkv_epilogue(acc, u, R, RP: tl.constexpr, HALF: tl.constexpr, out):
    """RoPE (rotate-half, each eager bf16 term rounded) of q and k pairs; q to its buffer `[R, HQ * D]`, k and
    v into the cache slot (write_entry[r] + layer, write_offset[r]); a padding row (entry < 0) writes no
    cache."""
    (q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer, stride_cs, stride_e, stride_s,
     stride_ch, HQ, HK) = out  # fmt: skip
    x1, x2 = _split_pairs(acc, RP)
    x1, x2 = round_bf16(x1), round_bf16(x2)
    pair = u * 4 + tl.arange(0, 4)
    head, d = pair // HALF, pair % HALF
    r = tl.arange(0, RP)
    live = (r < R)[:, None]
    cs = r[:, None] * stride_cs + d[None, :]
    c1 = tl.load(cos_ptr + cs, mask=live, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=live, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=live, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=live, other=0.0).to(tl.float32)
    o1 = round_bf16(round_bf16(x1 * c1) - round_bf16(x2 * s1))
    o2 = round_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2))
    is_q = (head < HQ)[None, :]
    qp = q_ptr + r[:, None] * (HQ * 2 * HALF) + (head * (2 * HALF) + d)[None, :]
    tl.store(qp, o1.to(tl.bfloat16), mask=live & is_q)
    tl.store(qp + HALF, o2.to(tl.bfloat16), mask=live & is_q)
    entry = tl.load(went_ptr + r, mask=r < R, other=-1).to(tl.int64)
    slot = tl.load(woff_ptr + r, mask=r < R, other=0).to(tl.int64)
    kv = head - HQ  # k heads, then v heads
    is_k = ((kv >= 0) & (kv < HK))[None, :]
    is_v = (kv >= HK)[None, :]
    kv_head = tl.where(kv >= HK, kv - HK, kv).to(tl.int64)
    dst = ((entry + layer) * stride_e + slot * stride_s)[:, None] + (kv_head * stride_ch + d)[None, :]
    write = live & (entry >= 0)[:, None]
    tl.store(kc_ptr + dst, o1.to(kc_ptr.dtype.element_ty), mask=write & is_k)
    tl.store(kc_ptr + dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=write & is_k)
    tl.store(vc_ptr + dst, x1.to(vc_ptr.dtype.element_ty), mask=write & is_v)
    tl.store(vc_ptr + dst + HALF, x2.to(vc_ptr.dtype.element_ty), mask=write & is_v)


# ------------------------------------------------------------------------------------------------ stages


@triton.jit
def _norm_weight(wn_ptr, layer, which, cols, H: tl.constexpr):
    """Norm weight `which` of layer (0 in1, 1 in2, 2 post1, 3 post2) as fp32 `[BH]`."""
    return tl.load(wn_ptr + (layer * 4 + which) * H + cols, mask=cols < H, other=0.0).to(tl.float32)


@triton.jit
def _layer_input(layer, io, bufs, wn_ptr, eps, R, RP: tl.constexpr, H: tl.constexpr, BH: tl.constexpr):
    """h entering `layer`: the loop input at layer 0, else M + post2(down) of the layer before (bf16)."""
    h_in_ptr, stride_in, _state_ptr = io
    _x_ptr, hb_ptr, mb_ptr, _q_ptr, _attn_ptr, _o_ptr, _act_ptr, d_ptr = bufs
    cols = tl.arange(0, BH)
    if layer == 0:
        h = _load_rows(h_in_ptr, stride_in, R, RP, cols, H)
    else:
        m = _load_rows(mb_ptr, H, R, RP, cols, H)
        d = _load_rows(d_ptr, H, R, RP, cols, H)
        h = round_bf16(m + _rms(d, _norm_weight(wn_ptr, layer - 1, 3, cols, H), H, eps))
    return h


@triton.jit
def _stage_x(
    h, which_norm, layer, wn_ptr, eps, x_ptr, R, RP: tl.constexpr, H: tl.constexpr, BH: tl.constexpr
):
    """x = norm(h) into this program's own x rows (every program computes it: a norm needs all of h)."""
    cols = tl.arange(0, BH)
    x = _rms(h, _norm_weight(wn_ptr, layer, which_norm, cols, H), H, eps)
    _store_rows(x_ptr + tl.program_id(0) * RP * H, H, R, RP, cols, H, x)
    tl.debug_barrier()  # this program's GEMV reads the rows its other threads stored
    return x


@triton.jit
def _stage_qkv(
    layer,
    ring,
    e,
    fetch,
    io,
    bufs,
    weights,
    attn_meta,
    R,
    eps,
    RP: tl.constexpr,
    H: tl.constexpr,
    BH: tl.constexpr,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    INTER: tl.constexpr,
    D: tl.constexpr,
    BK: tl.constexpr,
    LOOK: tl.constexpr,
    JOINT: tl.constexpr,
):
    """h entering the layer (program 0 stores it), x = in1(h), then q/k/v with RoPE and the K/V write."""
    x_ptr, hb_ptr, _mb, q_ptr, _attn, _o, _act, _d = bufs
    _wqkv, _wo, _wgu, _wd, wn_ptr, _wf = weights
    (cos_ptr, sin_ptr, stride_cs, kc_ptr, vc_ptr, stride_e, stride_s, stride_ch, went_ptr, woff_ptr, _t,
     _st, _c) = attn_meta  # fmt: skip
    pid, _programs = _program()
    h = _layer_input(layer, io, bufs, wn_ptr, eps, R, RP, H, BH)
    if pid == 0:
        _store_rows(hb_ptr, H, R, RP, tl.arange(0, BH), H, h)
    x = _stage_x(h, 0, layer, wn_ptr, eps, x_ptr, R, RP, H, BH)
    n = (HQ + 2 * HK) * D
    out = (q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer, stride_cs, stride_e,
           stride_s, stride_ch, HQ, HK)  # fmt: skip
    return _gemv_stage(ring, e, fetch, x_ptr + pid * RP * H, H, x, R, n // 8, out, RP, D // 2, D // 2, D, H,
                       BK, QKV, LOOK, H, INTER, HQ, HK, D, JOINT)  # fmt: skip


@triton.jit
def _stage_gate_up(layer, ring, e, fetch, bufs, weights, R, eps, RP: tl.constexpr, H: tl.constexpr,
                   BH: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                   BK: tl.constexpr, LOOK: tl.constexpr, JOINT: tl.constexpr):  # fmt: skip
    """M = h + in2(o) (program 0 stores it), x = post1(M), then SiLU(gate)·up."""
    x_ptr, hb_ptr, mb_ptr, _q, _attn, o_ptr, act_ptr, _d = bufs
    _wqkv, _wo, _wgu, _wd, wn_ptr, _wf = weights
    pid, _programs = _program()
    cols = tl.arange(0, BH)
    h = _load_rows(hb_ptr, H, R, RP, cols, H)
    o = _load_rows(o_ptr, H, R, RP, cols, H)
    m = round_bf16(h + _rms(o, _norm_weight(wn_ptr, layer, 1, cols, H), H, eps))
    if pid == 0:
        _store_rows(mb_ptr, H, R, RP, cols, H, m)
    x = _stage_x(m, 2, layer, wn_ptr, eps, x_ptr, R, RP, H, BH)
    return _gemv_stage(ring, e, fetch, x_ptr + pid * RP * H, H, x, R, INTER // 4, (act_ptr, INTER), RP, INTER,
                       1 << 30, 1 << 30, H, BK, GATE_UP, LOOK, H, INTER, HQ, HK, D, JOINT)  # fmt: skip


@triton.jit
def _attend(layer, bufs, attn_meta, partials, R, qk_scale, RP: tl.constexpr, HQ: tl.constexpr,
            HK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Split-KV attention of every (row, head): split s holds keys [s * SPLIT, (s + 1) * SPLIT) (fixed by the
    key count, not by the grid or the rows, so a row's bits do not depend on the launch); the last split of
    a (row, head) to draw a ticket combines the partials in split order."""
    _x, _h, _m, q_ptr, attn_ptr, _o, _act, _d = bufs
    part_ptr, ticket_ptr, max_splits = partials
    _cos, _sin, _scs, kc_ptr, vc_ptr, stride_e, stride_s, stride_ch, _we, _wo, tab_ptr, stride_t, ctx_ptr = (
        attn_meta
    )
    pid, P = _program()
    r_ids = tl.arange(0, RP)
    longest = tl.max(tl.load(ctx_ptr + r_ids, mask=r_ids < R, other=0), axis=0)
    rows_heads = R * HQ
    d = tl.arange(0, D)
    items = rows_heads * tl.cdiv(longest, SPLIT)
    item = pid
    while item < items:
        split, pair = item // rows_heads, item % rows_heads
        r, head = pair // HQ, pair % HQ
        ctx = tl.load(ctx_ptr + r)
        if split * SPLIT < ctx:
            q = tl.load(q_ptr + r * (HQ * D) + head * D + d, cache_modifier=".cg").to(tl.float32) * qk_scale
            kv_off = (head // (HQ // HK)).to(tl.int64) * stride_ch + d
            pos = split * SPLIT + tl.arange(0, SPLIT)  # one split = one block of keys
            live = pos < ctx
            page = tl.load(tab_ptr + r * stride_t + pos // PAGE, mask=live, other=-1).to(tl.int64)
            live = live & (page >= 0)  # a table's -1 padding: never read, whatever the context length says
            kv = ((page + layer) * stride_e + (pos % PAGE) * stride_s)[:, None] + kv_off[None, :]
            k = tl.load(kc_ptr + kv, mask=live[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            v = tl.load(vc_ptr + kv, mask=live[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            score = tl.where(live, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_i = tl.max(score, axis=0)
            p = tl.exp(score - m_i)
            l_i = tl.sum(p, axis=0)
            acc = tl.sum(p[:, None] * v, axis=0)
            base = (pair.to(tl.int64) * max_splits + split) * (D + 2)
            tl.store(part_ptr + base + d, acc)
            tl.store(part_ptr + base + D, m_i)
            tl.store(part_ptr + base + D + 1, l_i)
            tl.debug_barrier()  # all of this program's stores happen before its ticket releases them
            splits = tl.cdiv(ctx, SPLIT)
            if tl.atomic_add(ticket_ptr + pair, 1, sem="acq_rel", scope="gpu") == splits - 1:
                out = _combine(part_ptr + pair.to(tl.int64) * max_splits * (D + 2), splits, D)
                tl.store(attn_ptr + r * (HQ * D) + head * D + d, out.to(tl.bfloat16))
                tl.store(ticket_ptr + pair, 0)  # every split has drawn: zero again for the next one
        item += P


@triton.jit
def _prefetch_keys(layer, attn_meta, R, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                   PAGE: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """L2 prefetch (`cp.async.bulk.prefetch.L2`: a hint, no values) of the K and V rows of this program's
    first attention item, all but the newest position (which the q/k/v stage is writing)."""
    _cos, _sin, _scs, kc_ptr, vc_ptr, stride_e, stride_s, stride_ch, _we, _wo, tab_ptr, stride_t, ctx_ptr = (
        attn_meta
    )
    pid, _programs = _program()
    split, pair = pid // (R * HQ), pid % (R * HQ)
    r, head = pair // HQ, pair % HQ
    ctx = tl.load(ctx_ptr + r)
    pos = split * SPLIT + tl.arange(0, SPLIT)
    live = pos < ctx - 1
    page = tl.load(tab_ptr + r * stride_t + pos // PAGE, mask=live, other=-1).to(tl.int64)
    live = live & (page >= 0)
    rows = (page + layer) * stride_e + (pos % PAGE) * stride_s + (head // (HQ // HK)).to(tl.int64) * stride_ch
    size = tl.full(rows.shape, D * kc_ptr.dtype.element_ty.primitive_bitwidth // 8, tl.int32)
    flag = live.to(tl.int32)
    tl.inline_asm_elementwise(BULK_ASM, "=r,l,r,r", [kc_ptr + rows, size, flag], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip
    tl.inline_asm_elementwise(BULK_ASM, "=r,l,r,r", [vc_ptr + rows, size, flag], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _combine(part_ptr, splits, D: tl.constexpr):
    """softmax(q K^T) V of one (row, head) from its split partials, COMBINE splits per load (the order of
    the sums is fixed by the split count alone)."""
    d = tl.arange(0, D)
    c = tl.arange(0, COMBINE)
    m = tl.full([], float("-inf"), tl.float32)
    s = splits * 0
    while s < splits:
        live = s + c < splits
        m_s = tl.load(part_ptr + (s + c) * (D + 2) + D, mask=live, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, tl.max(m_s, axis=0))
        s += COMBINE
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    s = splits * 0
    while s < splits:
        live = s + c < splits
        row = part_ptr + (s + c) * (D + 2)
        scale = tl.exp(tl.load(row + D, mask=live, other=float("-inf"), cache_modifier=".cg") - m)
        total += tl.sum(tl.load(row + D + 1, mask=live, other=0.0, cache_modifier=".cg") * scale, axis=0)
        parts = tl.load(row[:, None] + d[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
        acc += tl.sum(parts * scale[:, None], axis=0)
        s += COMBINE
    return acc / total


@triton.jit
def _stage_plain(ring, e, fetch, x_ptr, out_ptr, R, RP: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, LOOK: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr,
                 HK: tl.constexpr, D: tl.constexpr, JOINT: tl.constexpr):  # fmt: skip
    """o_proj (x: the attention output) or down_proj (x: SiLU·up): 8-row units, bf16 out."""
    return _gemv_stage(ring, e, fetch, x_ptr, K, 0, R, N // 8, (out_ptr, N), RP, 4, 4, 8, K, BK, O_PROJ, LOOK,
                       H, INTER, HQ, HK, D, JOINT)  # fmt: skip


@triton.jit
def _stage_final(layer, io, bufs, weights, R, eps, RP: tl.constexpr, H: tl.constexpr, BH: tl.constexpr):
    """The loop's new state: norm(M + post2(down)) of the last layer (`layer` = L); program 0 stores it."""
    _h_in, _stride_in, state_ptr = io
    _wqkv, _wo, _wgu, _wd, wn_ptr, wf_ptr = weights
    pid, _programs = _program()
    cols = tl.arange(0, BH)
    h = _layer_input(layer, io, bufs, wn_ptr, eps, R, RP, H, BH)
    final = tl.load(wf_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    state = _rms(h, final, H, eps)
    if pid == 0:
        _store_rows(state_ptr, H, R, RP, cols, H, state)


@triton.jit
def _stage_start(STAGE: tl.constexpr, layer, counts):
    """Where STAGE of `layer` begins in this program's item stream (attention and the final norm have no
    items: where the next GEMV stage begins)."""
    n_qkv, n_o, n_gu, n_down = counts
    start = layer * (n_qkv + n_o + n_gu + n_down)
    if (STAGE == ATTN) | (STAGE == O_PROJ):
        start += n_qkv
    elif STAGE == GATE_UP:
        start += n_qkv + n_o
    elif STAGE == DOWN:
        start += n_qkv + n_o + n_gu
    return start


@triton.jit
def _run_stage(STAGE: tl.constexpr, layer, ring, e, fetch, io, bufs, weights, attn_meta, partials, R, eps,
               qk_scale, RP: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, INTER: tl.constexpr,
               HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr, LOOK: tl.constexpr, JOINT: tl.constexpr):  # fmt: skip
    """One stage of `layer`; returns the ring of tiles in flight and the stream position after it."""
    _x, _h, _m, _q, attn_ptr, o_ptr, act_ptr, d_ptr = bufs
    if STAGE == QKV:
        ring, e = _stage_qkv(layer, ring, e, fetch, io, bufs, weights, attn_meta, R, eps, RP, H, BH, HQ, HK,
                             INTER, D, BK, LOOK, JOINT)  # fmt: skip
    elif STAGE == ATTN:
        _attend(layer, bufs, attn_meta, partials, R, qk_scale, RP, HQ, HK, D, PAGE, SPLIT)
    elif STAGE == O_PROJ:
        ring, e = _stage_plain(
            ring, e, fetch, attn_ptr, o_ptr, R, RP, H, HQ * D, BK, LOOK, H, INTER, HQ, HK, D, JOINT
        )
    elif STAGE == GATE_UP:
        ring, e = _stage_gate_up(layer, ring, e, fetch, bufs, weights, R, eps, RP, H, BH, INTER, HQ, HK, D,
                                 BK, LOOK, JOINT)  # fmt: skip
    elif STAGE == DOWN:
        ring, e = _stage_plain(
            ring, e, fetch, act_ptr, d_ptr, R, RP, H, INTER, BK, LOOK, H, INTER, HQ, HK, D, JOINT
        )
    else:
        _stage_final(layer, io, bufs, weights, R, eps, RP, H, BH)
    return ring, e


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit(do_not_specialize=["R", "L", "stage_layer", "max_splits", "stride_in", "stride_cs", "stride_t"])
def _loop_kernel(h_in_ptr, state_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, wn_ptr, wf_ptr, cos_ptr, sin_ptr,
                 kc_ptr, vc_ptr, went_ptr, woff_ptr, tab_ptr, ctx_ptr, x_ptr, hb_ptr, mb_ptr, q_ptr,
                 attn_ptr, o_ptr, act_ptr, d_ptr, part_ptr, ticket_ptr, bar_ptr, R, L, stage_layer,
                 max_splits, eps, qk_scale, stride_in, stride_cs, stride_e, stride_s, stride_ch, stride_t,
                 H: tl.constexpr, BH: tl.constexpr, INTER: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr,
                 D: tl.constexpr, PAGE: tl.constexpr, RP: tl.constexpr, BK: tl.constexpr,
                 SPLIT: tl.constexpr, STAGE: tl.constexpr, LOOK: tl.constexpr, JOINT: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    let_dependents_launch(PDL)
    weights = (wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, wn_ptr, wf_ptr)
    counts = _item_counts(H, INTER, HQ, HK, D, BK)
    fetch = (counts, weights, L)
    e = _stage_start(STAGE if STAGE >= 0 else QKV, stage_layer, counts)
    # the first tiles (weights are never written, so under PDL they stream while the kernel before ends);
    # a launch of a stage without weights fetches nothing (past the stream's end)
    no_weights: tl.constexpr = (STAGE == ATTN) | (STAGE == FINAL)
    stream_end = L * (counts[0] + counts[1] + counts[2] + counts[3])
    ring = _fill_ring(e + stream_end * no_weights, fetch, LOOK, H, INTER, HQ, HK, D, BK)
    wait_for_inputs(PDL)
    io = (h_in_ptr, stride_in, state_ptr)
    bufs = (x_ptr, hb_ptr, mb_ptr, q_ptr, attn_ptr, o_ptr, act_ptr, d_ptr)
    attn_meta = (cos_ptr, sin_ptr, stride_cs, kc_ptr, vc_ptr, stride_e, stride_s, stride_ch, went_ptr,
                 woff_ptr, tab_ptr, stride_t, ctx_ptr)  # fmt: skip
    partials = (part_ptr, ticket_ptr, max_splits)
    if STAGE < 0:  # the whole loop, a grid barrier after each stage
        _pid, P = _program()
        arrivals = 0
        layer = L * 0  # a while loop: the interpreter's range() refuses an argument's bound (numpy >= 2)
        while layer < L:
            for s in tl.static_range(5):  # QKV, ATTN, O_PROJ, GATE_UP, DOWN
                # the ring holds the next stage's first tiles during the wait after this stage
                ring, e = _run_stage(s, layer, ring, e, fetch, io, bufs, weights, attn_meta, partials, R,
                                     eps, qk_scale, RP, H, BH, INTER, HQ, HK, D, PAGE, BK, SPLIT,
                                     LOOK, JOINT)  # fmt: skip
                # the attention's earlier keys do not change: ask L2 for them during the wait
                if s == QKV and not INTERPRETED:
                    _prefetch_keys(layer, attn_meta, R, HQ, HK, D, PAGE, SPLIT)
                arrivals += P
                _grid_barrier(bar_ptr, arrivals)
            layer += 1
        _run_stage(FINAL, L, ring, e, fetch, io, bufs, weights, attn_meta, partials, R, eps, qk_scale, RP, H,
                   BH, INTER, HQ, HK, D, PAGE, BK, SPLIT, LOOK, JOINT)  # fmt: skip
        # the last program to leave: every program is past its waits, the counters go back to zero
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == P - 1:
            tl.store(bar_ptr, 0)
            tl.store(bar_ptr + 1, 0)
    else:  # one stage of one layer (`loop_staged`); FINAL takes layer = L
        _run_stage(STAGE, stage_layer, ring, e, fetch, io, bufs, weights, attn_meta, partials, R, eps,
                   qk_scale, RP, H, BH, INTER, HQ, HK, D, PAGE, BK, SPLIT, LOOK, JOINT)  # fmt: skip


# -------------------------------------------------------------------------------------------------- host


@dataclass(frozen=True)
class LoopWeights:
    """One Ouro loop's weights stacked by layer (views the model's parameters share, see
    `models.ouro.stack_layer_weights`): q/k/v `[L, (Hq + 2 Hk) D, H]`, o `[L, H, Hq D]`, gate/up
    `[L, 2 I, H]`, down `[L, H, I]`, the four sandwich norms `[L, 4, H]` (in1, in2, post1, post2) and the
    final norm `[H]`."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norms: torch.Tensor
    final_norm: torch.Tensor
    eps: float
    heads: tuple[int, int, int]  # (Hq, Hk, D)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, hidden, intermediate)."""
        return self.qkv.shape[0], self.qkv.shape[2], self.down.shape[2]


@dataclass(frozen=True)
class LoopTiles:
    """Launch shape: `programs` (None: one per SM), the K tile of every GEMV, keys per attention split."""

    programs: int | None = None
    block_k: int = 2048
    split_keys: int = 64
    num_warps: int = 8
    # weight tiles in flight per program (1-3). One: on an H100 at one row (24 layers, the same call,
    # interleaved; bf16 tiles, before the int32 words) a loop took 1.86 ms with one, 1.92 with two, 1.98
    # with three; compiled for sm_90a, two tiles still read their loads within one item (the tile-load
    # overlap of bench/kernel_persistent_loop_compile.py does not grow) and spill more
    lookahead: int = 1
    # every row's sums of an item in one reduction (one cross-warp exchange per item) instead of one per row
    joint_rows: bool = False


DEFAULT_TILES = LoopTiles()


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def split_slots(tables: torch.Tensor, page: int, split_keys: int) -> int:
    """Attention partials per (row, head) a workspace holds: the table width's splits, a power of two, so
    eager steps of every table width share a few workspaces."""
    return pow2(triton.cdiv(tables.shape[1] * page, split_keys))


def loop_fusable(state: torch.Tensor, weights: LoopWeights, cos, sin, k_cache, v_cache, tables) -> bool:
    """Whether `loop_persistent` runs this loop: bf16 rows <= MAX_ROWS, the unit layouts fit the shapes
    (head_dim / 2 and the intermediate width multiples of 4, hidden of 8), one cos/sin row per state row,
    K/V caches `[E, page, Hk, D]` of one layout with D contiguous."""
    hq, hk, d = weights.heads
    layers, hidden, inter = weights.shape
    rows = state.shape[0] if state.dim() == 2 else -1
    return (
        1 <= rows <= MAX_ROWS
        and state.dtype == weights.qkv.dtype == torch.bfloat16
        and state.shape[1] == hidden
        and (d // 2) % 4 == 0
        and inter % 4 == 0
        and hidden % 8 == 0
        and hq % hk == 0
        and cos.shape == sin.shape == (rows, d)
        and cos.stride(-1) == sin.stride(-1) == 1
        and cos.stride() == sin.stride()
        and k_cache.dim() == 4
        and k_cache.shape[2:] == (hk, d)
        and v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
        and k_cache.stride(-1) == 1
        and tables.dim() == 2
        and tables.shape[0] == rows
        and tables.stride(-1) == 1
    )


@dataclass
class _Workspace:
    x: torch.Tensor  # [P, RP, H] bf16: each program's normed input
    h: torch.Tensor  # [RP, H] bf16: the residual stream after the attention / MLP block
    m: torch.Tensor
    q: torch.Tensor  # [RP, Hq D] bf16
    attn: torch.Tensor
    o: torch.Tensor
    act: torch.Tensor  # [RP, I] bf16
    down: torch.Tensor
    part: torch.Tensor  # [RP Hq, max_splits, D + 2] fp32 attention partials
    tickets: torch.Tensor  # [RP Hq] int32, zero between launches
    barrier: torch.Tensor  # [3] int32: arrivals, departures (zero between launches), waits that gave up


_WORKSPACES: dict[tuple, _Workspace] = {}


def workspace(device, programs: int, rows_pad: int, weights: LoopWeights, max_splits: int) -> _Workspace:
    """Scratch for one launch shape, kept for the life of the process (captured graphs hold its addresses);
    inside a capture a new one is made for that graph alone."""
    key = (device, programs, rows_pad, weights.shape, weights.heads, max_splits)
    if key in _WORKSPACES:
        return _WORKSPACES[key]
    hq, _hk, d = weights.heads
    _layers, hidden, inter = weights.shape
    bf16 = dict(dtype=torch.bfloat16, device=device)
    ws = _Workspace(x=torch.zeros(programs, rows_pad, hidden, **bf16),
                    h=torch.zeros(rows_pad, hidden, **bf16), m=torch.zeros(rows_pad, hidden, **bf16),
                    q=torch.zeros(rows_pad, hq * d, **bf16), attn=torch.zeros(rows_pad, hq * d, **bf16),
                    o=torch.zeros(rows_pad, hidden, **bf16), act=torch.zeros(rows_pad, inter, **bf16),
                    down=torch.zeros(rows_pad, hidden, **bf16),
                    part=torch.zeros(rows_pad * hq, max_splits, d + 2, dtype=torch.float32, device=device),
                    tickets=torch.zeros(rows_pad * hq, dtype=torch.int32, device=device),
                    barrier=torch.zeros(3, dtype=torch.int32, device=device))  # fmt: skip
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        _WORKSPACES[key] = ws
    return ws


def barrier_timeouts() -> int:
    """Barrier waits that gave up since the process started, over every workspace (0 when all is well;
    synchronizes)."""
    return sum(int(ws.barrier[2]) for ws in _WORKSPACES.values())


def _programs(device, tiles: LoopTiles) -> int:
    if tiles.programs is not None:
        return tiles.programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(stage: int, layer: int, state, weights: LoopWeights, cos, sin, k_cache, v_cache, write_entry,
            write_offset, tables, ctx_lens, page: int, tiles: LoopTiles, out, programs: int):  # fmt: skip
    hq, hk, d = weights.heads
    layers, hidden, inter = weights.shape
    rows = state.shape[0]
    rows_pad = pow2(rows)
    max_splits = split_slots(tables, page, tiles.split_keys)
    ws = workspace(state.device, programs, rows_pad, weights, max_splits)
    block_k = min(tiles.block_k, pow2(max(hidden, inter, hq * d)))
    return _loop_kernel[(programs,)](state, out, weights.qkv, weights.o, weights.gate_up, weights.down,
                                     weights.norms, weights.final_norm, cos, sin, k_cache, v_cache,
                                     write_entry, write_offset, tables, ctx_lens, ws.x, ws.h, ws.m, ws.q,
                                     ws.attn, ws.o, ws.act, ws.down, ws.part, ws.tickets, ws.barrier, rows,
                                     layers, layer, max_splits, weights.eps, d**-0.5, state.stride(0),
                                     cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                     tables.stride(0), H=hidden, BH=pow2(hidden), INTER=inter, HQ=hq,
                                     HK=hk, D=d, PAGE=page, RP=rows_pad, BK=block_k, SPLIT=tiles.split_keys,
                                     STAGE=stage, LOOK=tiles.lookahead, JOINT=tiles.joint_rows,
                                     num_warps=tiles.num_warps,
                                     num_stages=1, **pdl_args())  # fmt: skip


def loop_persistent(
    state,
    weights: LoopWeights,
    cos,
    sin,
    k_cache,
    v_cache,
    write_entry,
    write_offset,
    tables,
    ctx_lens,
    page: int,
    tiles: LoopTiles = DEFAULT_TILES,
) -> torch.Tensor:
    """One Ouro loop over `state` `[R, H]` (R <= MAX_ROWS decode rows) as one persistent launch: every
    layer's attention (writing its K/V at (write_entry + layer, write_offset)) and MLP, then the final norm;
    returns the new state `[R, H]`. Its grid barrier needs every program resident at once: on a GPU, one
    program per SM; under the Triton interpreter, which runs programs one after another, one program alone
    (`tiles.programs=1`). Call where `loop_fusable`."""
    programs = 1 if INTERPRET else _programs(state.device, tiles)
    if INTERPRET and tiles.programs != 1:
        raise RuntimeError(
            "loop_persistent under the interpreter runs one program: pass LoopTiles(programs=1)"
        )
    out = torch.empty_like(state)
    _launch(-1, 0, state, weights, cos, sin, k_cache, v_cache, write_entry, write_offset, tables, ctx_lens,
            page, tiles, out, programs)  # fmt: skip
    return out


def loop_staged(state, weights: LoopWeights, cos, sin, k_cache, v_cache, write_entry, write_offset, tables,
                ctx_lens, page: int, tiles: LoopTiles = DEFAULT_TILES) -> torch.Tensor:  # fmt: skip
    """`loop_persistent`'s stages as one launch each (5 per layer + the final norm), same code, no barrier:
    its bitwise twin on a GPU, and the form the Triton interpreter can run (tests on a CPU)."""
    out = torch.empty_like(state)
    programs = tiles.programs or (4 if INTERPRET else _programs(state.device, tiles))
    args = (state, weights, cos, sin, k_cache, v_cache, write_entry, write_offset, tables, ctx_lens, page,
            tiles, out, programs)  # fmt: skip
    for layer in range(weights.shape[0]):
        for stage in LAYER_STAGES:
            _launch(stage, layer, *args)
    _launch(FINAL_STAGE, weights.shape[0], *args)
    return out


__all__ = ["DEFAULT_TILES", "MAX_ROWS", "LoopTiles", "LoopWeights", "barrier_timeouts", "loop_fusable",
           "loop_persistent", "loop_staged"]  # fmt: skip
