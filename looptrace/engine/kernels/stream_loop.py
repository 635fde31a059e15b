"""One Ouro loop at one decode row as one persistent Gluon launch whose weights stream through a ring of
shared-memory tiles by TMA: `kernels.persistent_loop`'s one-row form on Hopper (sm_90). Imports Triton.

Why a second form: `persistent_loop.py` holds its weight tiles in registers, and Triton's `tl.load` cannot
keep several of them in flight across an item (the compiler moves or repacks the loaded registers and
waits), so each SM has about one 32 KB tile in flight and the loop runs near twice the copy floor. Here each
program owns a ring of SLOTS tiles in shared memory, each with an mbarrier: it asks TMA for its tile q + SLOTS
as soon as it has read tile q, and the mbarrier says when a tile's bytes have landed. A program's tiles of
the whole loop (every layer's q/k/v, o, gate/up and down items) form one stream, and weights are never
written, so the ring runs ahead across stage and layer boundaries: while a program waits at a grid barrier,
its next stage's tiles keep arriving. (`bench/kernel_weight_stream.py` measures that structure alone.)

Items: 16 W rows = two TMA boxes of 8 rows, a unit's first rows and their partners (q/k/v: 8 rotate-half
pairs of one head, so RoPE stays in the program; gate/up: 8 gate rows and their up rows; o and down: 16
consecutive rows), every K tile of them in order; program p takes units p, p + P, ... of each stage.

The stages of a layer and their arithmetic are `persistent_loop.py`'s at one row (R3 over exactloop): the
residual h lives in every program's registers (each computes the norms itself, the same code and so the same
bits), products are summed in fp32 per item over K tiles in a fixed order, and values are rounded to bf16
where the eager model stores a bf16 tensor. The attention takes 8 splits per head whatever the context
(Ouro's 16 heads: 128 items, one per program; blocks of 64 keys inside a split, an online softmax). A
program copies its item's first key blocks (K and V, `kv_blocks`) into shared memory as the layer starts
and asks L2 for the rest before the barrier that precedes the attention, so that after it the keys come
from shared memory or L2, not from HBM behind the ring's weight reads; the newest key, written by the q/k/v
stage, is read after that barrier.
Then the items draw tickets: the last split of a head combines the partials in split order. So a launch
repeats bit for bit; its bits are its own (not the register form's: the reduction trees differ).
"""

from __future__ import annotations

import torch
import triton.experimental.gluon.language as gl
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from looptrace.engine.kernels import persistent_loop as pl
from looptrace.engine.kernels.l2_prefetch import BULK_ASM
from looptrace.engine.kernels.launch_mode import pdl_args

BOX_ROWS = 8  # W rows per TMA box: an item is two boxes (a unit's first rows and their partners)
BLOCK_K = 256  # columns per weight tile (TMA boxes are at most 256 elements a side)
PRODUCER_REGS = gl.constexpr(40)  # registers of the warp-specialized producer warp (setmaxnreg)
COMBINE = gl.constexpr(16)  # attention partials per load of the combine (at least ATTN_SPLITS)
ATTN_SPLITS = gl.constexpr(8)  # splits per head: Ouro's 16 heads x 8 = 128 items, one per program
QKV, O_PROJ, GATE_UP, DOWN = (gl.constexpr(e) for e in range(4))  # GEMV epilogues
# `ablate` bits (bench/kernel_persistent_loop.py): parts left out to see what each costs; outputs are wrong
NO_ATTENTION = gl.constexpr(1)  # no attention stage and no barrier before it
NO_FMA = gl.constexpr(2)  # the GEMVs wait for and free every tile but compute nothing
NO_BARRIERS = gl.constexpr(4)  # no grid barrier waits anywhere

# The grid barrier's poll and the L2 prefetch: the register form's and `l2_prefetch`'s PTX, for Gluon.
_WAIT_ASM = gl.constexpr(pl.WAIT_PTX)
_L2_ASM = gl.constexpr(BULK_ASM.value)


# The PDL preamble (`device_helpers.await_inputs`) in Gluon, which cannot call a `triton.jit` function.
@gluon.jit
def let_dependents_launch(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def wait_for_inputs(PDL: gl.constexpr):
    """Nothing another kernel writes may be read, nor anything it reads written, before this returns."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def grid_arrive(bar_ptr):
    """This program's arrival at a grid barrier: every thread's stores before it are released to every program
    past the matching `grid_wait` (work that needs no other program may run between the two)."""
    gl.thread_barrier()
    gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def grid_wait(bar_ptr, target):
    """Wait until the grid has arrived `target` times in all (thread 0 polls with acquire loads, then a CTA
    barrier passes what it saw on); a wait that gives up (a program never arrived) counts in bar_ptr[2]."""
    seen = gl.inline_asm_elementwise(
        _WAIT_ASM, "=r,l,r", [bar_ptr, target], dtype=gl.int32, is_pure=False, pack=1
    )
    if seen < target:
        gl.atomic_add(bar_ptr + 2, 1, sem="relaxed", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def grid_barrier(bar_ptr, target):
    """Every program's stores before it are visible to every program after it."""
    grid_arrive(bar_ptr)
    grid_wait(bar_ptr, target)


_CLOCK_ASM = gl.constexpr("mov.u64 $0, %globaltimer;")


@gluon.jit
def _stamp(times_row, index, TIMED: gl.constexpr):
    """Record the GPU's nanosecond clock at `times_row[index]` (this program's row of
    `loop_streamed(times=...)`: when it arrives at and leaves each grid barrier)."""
    if TIMED:
        now = gl.inline_asm_elementwise(_CLOCK_ASM, "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(times_row + index, now)


@gluon.jit
def _bf16(x):
    """Round fp32 to bf16 and widen back (the eager model stores a bf16 tensor here)."""
    return x.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _share(units, pid, programs):
    """How many of a stage's units this program takes (units pid, pid + P, ...)."""
    return (units + programs - 1 - pid) // programs


# -------------------------------------------------------------------------------- tagged words (LINKED)
# The LINKED form hands values between programs without grid barriers: each value travels with the tag of
# the layer that made it in one word (bf16 bits high, a 16-bit tag low; the attention partials: fp32 bits
# low, a 31-bit tag high in 64 bits), stored and read whole, so a reader polls the values themselves until
# every word carries this layer's tag: no fence, no atomic, no second read after a counter (NCCL's LL
# protocol). A buffer's words are rewritten every layer, and a program can only write layer l + 1's words
# after every reader of layer l's has read them (each stage needs the whole output of the one before, so
# every program has passed layer l's reads), so a tag needs to differ only from the layer before's.
TAG_LAYERS = gl.constexpr(65535)  # 16-bit tags 1 .. 65535 (0, a fresh workspace's words, never matches)
EPOCHS_C = gl.constexpr(1 << 24)  # launches counted mod this (the count follows the tagged words)
POLLS = gl.constexpr(1 << 16)  # polls of one vector before a reader gives up (~0.1 s; counted, never a hang)


@gluon.jit
def _tag(epoch, L, layer):
    """Layer `layer`'s 16-bit tag in launch `epoch`: one more (mod 65535) than the layer before's, in this
    launch or the one before."""
    return (1 + (epoch.to(gl.int64) * L + layer) % TAG_LAYERS).to(gl.int32)


@gluon.jit
def _tag32(epoch, L, layer):
    """The partials' 31-bit tag: their words are not all rewritten every layer (the split count follows the
    context), so theirs repeats only after 2^31 layers."""
    return 1 + (epoch.to(gl.int64) * L + layer) % 2147483647


@gluon.jit
def _word(x, tag):
    """fp32 `x` holding bf16 values and a 16-bit tag as int32 words (`_value` reads them back)."""
    return (x.to(gl.bfloat16).to(gl.float32).to(gl.int32, bitcast=True) & -65536) | tag


@gluon.jit
def _value(words):
    return (words & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _word64(x, tag32):
    """fp32 `x` and a 31-bit tag as int64 words (`_value64` reads them back)."""
    return (x.to(gl.int32, bitcast=True).to(gl.int64) & 4294967295) | (tag32 << 32)


@gluon.jit
def _value64(words):
    return (words & 4294967295).to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def _missing(words, live, tag, WIDE: gl.constexpr):
    if WIDE:
        return live & ((words >> 32) != tag)
    else:
        return live & ((words & 65535) != tag)


@gluon.jit
def _poll(ptrs, live, tag, bar_ptr, WIDE: gl.constexpr, ABLATE: gl.constexpr):
    """The words at `ptrs` (2-D; 0 where not `live`) once each carries `tag` (WIDE: the 64-bit partials'),
    read whole again until they all do (reloading only the missing words, kept with a select, spilled 76
    bytes at 18 slots; this form spills none). A read that gives up counts in bar_ptr[2]; ablated forms
    read once (their outputs are wrong anyway)."""
    words = gl.load(ptrs, mask=live, other=0, volatile=True)
    missing = _missing(words, live, tag, WIDE)
    if ABLATE == 0:
        tries = 0
        while (gl.max(gl.max(missing.to(gl.int32), axis=1), axis=0) > 0) & (tries < POLLS):
            words = gl.load(ptrs, mask=live, other=0, volatile=True)
            missing = _missing(words, live, tag, WIDE)
            tries += 1
        if gl.max(gl.max(missing.to(gl.int32), axis=1), axis=0) > 0:
            gl.atomic_add(bar_ptr + 2, 1, sem="relaxed", scope="gpu")
    return words


@gluon.jit
def _linked(ptr, n, tag, bar_ptr, ROWS: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr,
            ABLATE: gl.constexpr):  # fmt: skip
    """`_made`'s vector from tagged words: fp32 [ROWS, BK], 0 past n, once all of layer `tag`'s are in."""
    offs = _offsets(ROWS, BK, layout)
    return _value(_poll(ptr + offs, offs < n, tag, bar_ptr, False, ABLATE))


# ------------------------------------------------------------------------------------------ the stream


@gluon.jit
def _issue(
    q,
    stream,
    ring,
    bars,
    descs,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NQKV: gl.constexpr,
    KO: gl.constexpr,
    D: gl.constexpr,
    BK: gl.constexpr,
    SLOTS: gl.constexpr,
):
    """Ask TMA for this program's tile q (its tiles in consumption order over every layer and stage) into
    ring slot q % SLOTS: two boxes of 8 rows, the unit's first rows and their partners. Past the stream's
    end: nothing."""
    total, per_layer, t0, t1, t2, pid, programs = stream
    d_qkv, d_o, d_gu, d_down = descs
    KH: gl.constexpr = H // BK
    KTO: gl.constexpr = KO // BK
    KI: gl.constexpr = INTER // BK
    if q < total:
        layer = q // per_layer
        r = q % per_layer
        slot = q % SLOTS
        bar = bars.index(slot)
        first = ring.index(slot).slice(0, 8)
        partner = ring.index(slot).slice(8, 8)
        mbarrier.expect(bar, 2 * 8 * BK * 2)
        if r < t0:  # q/k/v: unit u holds pairs 8u .. 8u + 7 of one head
            pair = (pid + (r // KH) * programs) * 8
            row = layer * NQKV + (pair // (D // 2)) * D + pair % (D // 2)
            col = (r % KH) * BK
            tma.async_copy_global_to_shared(d_qkv, [row, col], bar, first)
            tma.async_copy_global_to_shared(d_qkv, [row + D // 2, col], bar, partner)
        elif r < t0 + t1:  # o: 16 consecutive rows
            r = r - t0
            row = layer * H + (pid + (r // KTO) * programs) * 16
            col = (r % KTO) * BK
            tma.async_copy_global_to_shared(d_o, [row, col], bar, first)
            tma.async_copy_global_to_shared(d_o, [row + 8, col], bar, partner)
        elif r < t0 + t1 + t2:  # gate/up: 8 gate rows and the up rows of the same outputs
            r = r - t0 - t1
            row = layer * 2 * INTER + (pid + (r // KH) * programs) * 8
            col = (r % KH) * BK
            tma.async_copy_global_to_shared(d_gu, [row, col], bar, first)
            tma.async_copy_global_to_shared(d_gu, [row + INTER, col], bar, partner)
        else:  # down: 16 consecutive rows
            r = r - t0 - t1 - t2
            row = layer * H + (pid + (r // KI) * programs) * 16
            col = (r % KI) * BK
            tma.async_copy_global_to_shared(d_down, [row, col], bar, first)
            tma.async_copy_global_to_shared(d_down, [row + 8, col], bar, partner)


@gluon.jit
def _gemv(
    q,
    units,
    KT: gl.constexpr,
    EPI: gl.constexpr,
    out,
    x_tiles,
    stream,
    ring,
    bars,
    empty,
    descs,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NQKV: gl.constexpr,
    KO: gl.constexpr,
    HQ: gl.constexpr,
    HK: gl.constexpr,
    D: gl.constexpr,
    BK: gl.constexpr,
    SLOTS: gl.constexpr,
    WARPS: gl.constexpr,
    WS: gl.constexpr,
    ABLATE: gl.constexpr = 0,
    LINKED: gl.constexpr = False,
    tag=0,
):
    """This program's `units` items of one GEMV stage against x (`x_tiles`: [K tiles, BK] fp32 in shared
    memory), each item's sums handed to the epilogue EPI (LINKED: stored as words tagged `tag`). Reading a
    tile frees its slot for the tile SLOTS
    further on in the stream (near the stage's end, the next stage's): these warps ask TMA for it, or with
    WS (warp-specialized) they arrive on the slot's `empty` barrier and the producer warp asks. Returns the
    stream position after."""
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    _total, _per_layer, _t0, _t1, _t2, pid, programs = stream
    for i in range(units):
        acc_first = gl.zeros([8, BK], gl.float32, tile)
        acc_partner = gl.zeros([8, BK], gl.float32, tile)
        for kt in range(KT):
            slot = q % SLOTS
            mbarrier.wait(bars.index(slot), (q // SLOTS) & 1)
            w_first = ring.index(slot).slice(0, 8).load(tile)
            w_partner = ring.index(slot).slice(8, 8).load(tile)
            if WS:  # the arrive follows a barrier of these warps: every one has read the slot
                mbarrier.arrive(empty.index(slot))
            else:
                gl.thread_barrier()  # every warp has read the slot before TMA refills it
                _issue(q + SLOTS, stream, ring, bars, descs, H, INTER, NQKV, KO, D, BK, SLOTS)
            if (ABLATE & NO_FMA) == 0:
                x = gl.expand_dims(x_tiles.index(kt).load(gl.SliceLayout(0, tile)).to(gl.float32), 0)
                # one FMA per weight (the launch turns off fp fusion for the rounding the epilogues copy)
                acc_first = gl.fma(w_first.to(gl.float32), x, acc_first)
                acc_partner = gl.fma(w_partner.to(gl.float32), x, acc_partner)
            q += 1
        unit = pid + i * programs
        first = gl.sum(acc_first, axis=1)
        partner = gl.sum(acc_partner, axis=1)
        j = gl.arange(0, 8, layout=gl.SliceLayout(1, tile))
        if EPI == QKV:
            _rope_out(first, partner, unit * 8 + j, out, HQ, HK, D, LINKED, tag)
        elif EPI == GATE_UP:
            act_ptr = out
            gate, up = _bf16(first), _bf16(partner)
            act = _bf16(gate / (1.0 + gl.exp(-gate))) * up
            if LINKED:
                gl.store(act_ptr + unit * 8 + j, _word(act, tag), cache_modifier=".cg")
            else:
                gl.store(act_ptr + unit * 8 + j, act.to(gl.bfloat16))
        else:
            out_ptr = out
            if LINKED:
                gl.store(out_ptr + unit * 16 + j, _word(first, tag), cache_modifier=".cg")
                gl.store(out_ptr + unit * 16 + 8 + j, _word(partner, tag), cache_modifier=".cg")
            else:
                gl.store(out_ptr + unit * 16 + j, first.to(gl.bfloat16))
                gl.store(out_ptr + unit * 16 + 8 + j, partner.to(gl.bfloat16))
    return q


@gluon.jit
def _rope_out(first, partner, pair, out, HQ: gl.constexpr, HK: gl.constexpr, D: gl.constexpr,
              LINKED: gl.constexpr, tag):  # fmt: skip
    """RoPE (rotate-half, each eager bf16 term rounded) of a q/k unit; q to its buffer, k and v (v without
    RoPE) into the cache slot (write_entry + layer, write_offset); a padding row (entry < 0) writes none.
    LINKED: q as tagged words, and k and v as tagged words too (lk, lv) for this layer's attention."""
    q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, entry, offset, layer, stride_e, stride_s, stride_ch, lk, lv = out
    HALF: gl.constexpr = D // 2
    x1, x2 = _bf16(first), _bf16(partner)
    head, d = pair // HALF, pair % HALF
    c1 = gl.load(cos_ptr + d).to(gl.float32)
    c2 = gl.load(cos_ptr + d + HALF).to(gl.float32)
    s1 = gl.load(sin_ptr + d).to(gl.float32)
    s2 = gl.load(sin_ptr + d + HALF).to(gl.float32)
    o1 = _bf16(_bf16(x1 * c1) - _bf16(x2 * s1))
    o2 = _bf16(_bf16(x2 * c2) + _bf16(x1 * s2))
    is_q = head < HQ
    kv = head - HQ  # k heads, then v heads
    if LINKED:
        gl.store(q_ptr + head * D + d, _word(o1, tag), mask=is_q, cache_modifier=".cg")
        gl.store(q_ptr + head * D + d + HALF, _word(o2, tag), mask=is_q, cache_modifier=".cg")
        link = gl.where(kv >= HK, kv - HK, kv) * D + d  # k or v head's words
        gl.store(lk + link, _word(o1, tag), mask=(kv >= 0) & (kv < HK), cache_modifier=".cg")
        gl.store(lk + link + HALF, _word(o2, tag), mask=(kv >= 0) & (kv < HK), cache_modifier=".cg")
        gl.store(lv + link, _word(x1, tag), mask=kv >= HK, cache_modifier=".cg")
        gl.store(lv + link + HALF, _word(x2, tag), mask=kv >= HK, cache_modifier=".cg")
    else:
        gl.store(q_ptr + head * D + d, o1.to(gl.bfloat16), mask=is_q)
        gl.store(q_ptr + head * D + d + HALF, o2.to(gl.bfloat16), mask=is_q)
    is_k = (kv >= 0) & (kv < HK) & (entry >= 0)
    is_v = (kv >= HK) & (entry >= 0)
    kv_head = gl.where(kv >= HK, kv - HK, kv).to(gl.int64)
    dst = (entry + layer) * stride_e + offset * stride_s + kv_head * stride_ch + d
    gl.store(kc_ptr + dst, o1.to(gl.bfloat16), mask=is_k)
    gl.store(kc_ptr + dst + HALF, o2.to(gl.bfloat16), mask=is_k)
    gl.store(vc_ptr + dst, x1.to(gl.bfloat16), mask=is_v)
    gl.store(vc_ptr + dst + HALF, x2.to(gl.bfloat16), mask=is_v)


# ---------------------------------------------------------------------------------------- the vectors


@gluon.jit
def _offsets(ROWS: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """Offsets of a vector held as [ROWS, BK] (the shape of the x tiles in shared memory)."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims(r, 1) * BK + gl.expand_dims(c, 0)


@gluon.jit
def _made(ptr, n, ROWS: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """A bf16 vector other programs of this launch wrote, as fp32 [ROWS, BK] (through L2: `.cg`; 0 past n)."""
    offs = _offsets(ROWS, BK, layout)
    return gl.load(ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg").to(gl.float32)


@gluon.jit
def _weights(ptr, ROWS: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """A norm's bf16 weight vector as [ROWS, BK] (kept bf16: half the registers while it waits for use)."""
    return gl.load(ptr + _offsets(ROWS, BK, layout))


@gluon.jit
def _norm(x, w, N: gl.constexpr, eps):
    """Eager RMSNorm of one fp32 row holding bf16 values, weight `w` (`_weights`):
    bf16(bf16(x rsqrt(mean(x^2) + eps)) w)."""
    ms = gl.sum(gl.sum(x * x, axis=1), axis=0) / N
    return _bf16(_bf16(x * gl.rsqrt(ms + eps)) * w.to(gl.float32))


@gluon.jit
def _set_x(xs, x, ROWS: gl.constexpr):
    """x into this program's shared x tiles (every warp's reads of the stage before are done: a barrier
    precedes every call); the CTA barrier after lets every warp read all of it."""
    xs.slice(0, ROWS).store(x.to(xs.dtype))
    gl.thread_barrier()


# ------------------------------------------------------------------------------------------ attention


@gluon.jit
def _split_keys(ctx, SPLIT: gl.constexpr):
    """Keys per split: the context over ATTN_SPLITS splits, in whole blocks of SPLIT keys (fixed by the key
    count alone, so a row's bits depend on neither the grid nor the run)."""
    return ((ctx + ATTN_SPLITS - 1) // ATTN_SPLITS + SPLIT - 1) // SPLIT * SPLIT


@gluon.jit
def _key_rows(layer, ctx, split, block, head, attn, HQ: gl.constexpr, HK: gl.constexpr, D: gl.constexpr,
              PAGE: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Offsets into the K/V caches ([SPLIT, D]) of one block of keys of one (split, head) item and which keys
    are read: every key of the item but the newest (ctx - 1), which the q/k/v stage is writing (so the rest
    are safe to read any time in the launch)."""
    _q, _o, _kc, _vc, tab_ptr, _p, _t, _m, stride_e, stride_s, stride_ch = attn
    keys: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, keys))
    per_split = _split_keys(ctx, SPLIT)
    pos = split * per_split + block + gl.arange(0, SPLIT, layout=gl.SliceLayout(1, keys))
    live = (pos < ctx - 1) & (pos < (split + 1) * per_split)
    page = gl.load(tab_ptr + pos // PAGE, mask=live, other=-1).to(gl.int64)
    live = live & (page >= 0)  # a table's -1 padding: never read
    kv_off = (head // (HQ // HK)).to(gl.int64) * stride_ch + d
    kv = gl.expand_dims((page + layer) * stride_e + (pos % PAGE) * stride_s, 1) + gl.expand_dims(kv_off, 0)
    return kv, gl.expand_dims(live, 1)


@gluon.jit
def _key_block(layer, ctx, split, block, head, attn, HQ: gl.constexpr, HK: gl.constexpr, D: gl.constexpr,
               PAGE: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """K and V (bf16 [SPLIT, D], 0 where not read: `_key_rows`) of one block of keys, from global memory."""
    _q, _o, kc_ptr, vc_ptr, _tab, _p, _t, _m, _se, _ss, _sc = attn
    kv, mask = _key_rows(layer, ctx, split, block, head, attn, HQ, HK, D, PAGE, SPLIT, WARPS)
    k = gl.load(kc_ptr + kv, mask=mask, other=0.0, cache_modifier=".cg")
    v = gl.load(vc_ptr + kv, mask=mask, other=0.0, cache_modifier=".cg")
    return k, v


@gluon.jit
def _old_keys(kv_smem, preloaded, layer, ctx, split, block, head, attn, HQ: gl.constexpr, HK: gl.constexpr,
              D: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr,
              KV_BLOCKS: gl.constexpr):  # fmt: skip
    """`_key_block`'s K and V, from shared memory where `_preload_keys` put them (item `preloaded`, its
    first KV_BLOCKS blocks)."""
    keys: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    if KV_BLOCKS > 0:
        if preloaded & (block < KV_BLOCKS * SPLIT):
            b = (block // SPLIT).to(gl.int32)
            k = kv_smem.index(2 * b).load(keys)
            v = kv_smem.index(2 * b + 1).load(keys)
        else:
            k, v = _key_block(layer, ctx, split, block, head, attn, HQ, HK, D, PAGE, SPLIT, WARPS)
    else:
        k, v = _key_block(layer, ctx, split, block, head, attn, HQ, HK, D, PAGE, SPLIT, WARPS)
    return k, v


@gluon.jit
def _preload_keys(kv_smem, layer, ctx, attn, pid, HQ: gl.constexpr, HK: gl.constexpr, D: gl.constexpr,
                  PAGE: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr,
                  KV_BLOCKS: gl.constexpr):  # fmt: skip
    """Start copying (cp.async) the first KV_BLOCKS key blocks' K and V of this program's attention item
    (item pid) into shared memory: issued as the layer starts, they land during the q/k/v stage, while the
    weight stream keeps HBM's queues long (a load issued after the barrier waits behind them). Issued after
    the program's q/k/v units instead, to land during its wait, they made the loop slower: 0.972 against
    0.962 ms on an H200 (bench/results/h200/kernels/)."""
    _q, _o, kc_ptr, vc_ptr, _tab, _p, _t, _m, _se, _ss, _sc = attn
    per_split = _split_keys(ctx, SPLIT)
    if pid < HQ * ((ctx + per_split - 1) // per_split):
        for b in gl.static_range(KV_BLOCKS):
            split, head = pid // HQ, pid % HQ
            kv, mask = _key_rows(layer, ctx, split, b * SPLIT, head, attn, HQ, HK, D, PAGE, SPLIT, WARPS)
            async_copy.async_copy_global_to_shared(kv_smem.index(2 * b), kc_ptr + kv, mask=mask)
            async_copy.async_copy_global_to_shared(kv_smem.index(2 * b + 1), vc_ptr + kv, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _newest_page(layer, ctx, tab_ptr, PAGE: gl.constexpr):
    """The cache entry of the newest key (ctx - 1) at this layer: the same for every head, and the page table
    never changes inside the launch, so it is read before the barrier that the keys wait for."""
    return gl.load(tab_ptr + (ctx - 1) // PAGE).to(gl.int64) + layer


@gluon.jit
def _newest_key(entry, ctx, head, attn, HQ: gl.constexpr, HK: gl.constexpr, D: gl.constexpr,
                PAGE: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """K and V (bf16 [D]) of the newest key (ctx - 1) of a head, in cache entry `entry` (`_newest_page`),
    written by the q/k/v stage of this launch."""
    _q, _o, kc_ptr, vc_ptr, _tab, _p, _t, _m, stride_e, stride_s, stride_ch = attn
    keys: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, keys))
    row = entry * stride_e + ((ctx - 1) % PAGE) * stride_s + (head // (HQ // HK)).to(gl.int64) * stride_ch
    k = gl.load(kc_ptr + row + d, cache_modifier=".cg")
    v = gl.load(vc_ptr + row + d, cache_modifier=".cg")
    return k, v


@gluon.jit
def _prefetch_split(layer, ctx, attn, pid, HQ: gl.constexpr, HK: gl.constexpr, D: gl.constexpr,
                    PAGE: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr,
                    KV_BLOCKS: gl.constexpr):  # fmt: skip
    """Ask L2 for the K and V rows of every key of this program's first attention item but the newest
    (`cp.async.bulk.prefetch.L2`: a hint, no registers, no values): issued before the barrier after the
    q/k/v stage, so the rows come from HBM during the wait (earlier keys never change). Every block of the
    split, not only the first: past 512 keys a split holds two or more blocks, read one after the other."""
    _q, _o, kc_ptr, vc_ptr, tab_ptr, _p, _t, _m, stride_e, stride_s, stride_ch = attn
    one_key: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    split, head = pid // HQ, pid % HQ
    per_split = _split_keys(ctx, SPLIT)
    for block in range(KV_BLOCKS * SPLIT, per_split, SPLIT):  # blocks not in shared memory
        pos = split * per_split + block + gl.arange(0, SPLIT, layout=one_key)
        live = (pos < ctx - 1) & (split < ATTN_SPLITS) & (pos < (split + 1) * per_split)
        page = gl.load(tab_ptr + pos // PAGE, mask=live, other=-1).to(gl.int64)
        live = live & (page >= 0)
        kv_head = (head // (HQ // HK)).to(gl.int64)
        row = (page + layer) * stride_e + (pos % PAGE) * stride_s + kv_head * stride_ch
        size = gl.full([SPLIT], D * 2, gl.int32, one_key)  # bf16 rows
        flag = live.to(gl.int32)
        gl.inline_asm_elementwise(_L2_ASM, "=r,l,r,r", [kc_ptr + row, size, flag], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
        gl.inline_asm_elementwise(_L2_ASM, "=r,l,r,r", [vc_ptr + row, size, flag], dtype=gl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _attend(layer, newest, ctx, attn, pid, programs, qk_scale, kv_smem, HQ: gl.constexpr, HK: gl.constexpr,
            D: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr, WARPS: gl.constexpr,
            KV_BLOCKS: gl.constexpr, LINKED: gl.constexpr = False, links=None, tag=0, tag32=0, bar_ptr=None,
            ABLATE: gl.constexpr = 0):  # fmt: skip
    """Split-KV attention of every head: ATTN_SPLITS splits per head (16 heads x 8 = 128 items: one per
    program on a 132-SM Hopper whatever the context), each a run of SPLIT-key blocks with an online softmax;
    the last split of a head to draw a ticket combines the partials in split order. Every key but the newest
    is read from the cache as it was before the launch's q/k/v stage; the newest, written by that stage, is
    read once per item and put in its place. The first KV_BLOCKS blocks of item pid come from shared memory
    (`_preload_keys`). LINKED: q and the newest key from this layer's tagged words, the partials stored as
    tagged words, and split 0's program combines its head (every item is a program's only one)."""
    q_ptr, out_ptr, _kc, _vc, _tab, part_ptr, ticket_ptr, max_splits, _se, _ss, _sc = attn
    keys: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, keys))
    per_split = _split_keys(ctx, SPLIT)
    splits = (ctx + per_split - 1) // per_split
    for item in range(pid, HQ * splits, programs):
        split, head = item // HQ, item % HQ
        if LINKED:
            lq, lk, lv, _la, _lp = links
            kv_words = (head // (HQ // HK)) * D
            q = _linked_row(lq + head * D, tag, bar_ptr, D, keys, ABLATE) * qk_scale
            k_last = _linked_row(lk + kv_words, tag, bar_ptr, D, keys, ABLATE).to(gl.bfloat16)
            v_last = _linked_row(lv + kv_words, tag, bar_ptr, D, keys, ABLATE).to(gl.bfloat16)
        else:
            q = gl.load(q_ptr + head * D + d, cache_modifier=".cg").to(gl.float32) * qk_scale
            k_last, v_last = _newest_key(newest, ctx, head, attn, HQ, HK, D, PAGE, WARPS)
        m_i = gl.max(gl.full([SPLIT], float("-inf"), gl.float32, gl.SliceLayout(1, keys)), axis=0)
        l_i = gl.sum(gl.zeros([SPLIT], gl.float32, gl.SliceLayout(1, keys)), axis=0)
        acc = gl.zeros([D], gl.float32, gl.SliceLayout(0, keys))
        for block in range(0, gl.minimum(per_split, ctx - split * per_split), SPLIT):
            k_old, v_old = _old_keys(kv_smem, item == pid, layer, ctx, split, block, head, attn, HQ, HK, D,
                                     PAGE, SPLIT, WARPS, KV_BLOCKS)  # fmt: skip
            pos = split * per_split + block + gl.arange(0, SPLIT, layout=gl.SliceLayout(1, keys))
            live = (pos < ctx) & (pos < (split + 1) * per_split)
            is_last = gl.expand_dims(pos == ctx - 1, 1)  # the newest key: in no prefetched block
            k = gl.where(is_last, gl.expand_dims(k_last, 0), k_old)  # bf16: widened inside the products
            v = gl.where(is_last, gl.expand_dims(v_last, 0), v_old)
            score = gl.where(live, gl.sum(k.to(gl.float32) * gl.expand_dims(q, 0), axis=1), float("-inf"))
            m_new = gl.maximum(m_i, gl.max(score, axis=0))
            alpha = gl.exp(m_i - m_new)
            p = gl.exp(score - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=0)
            acc = acc * alpha + gl.sum(gl.expand_dims(p, 1) * v.to(gl.float32), axis=0)
            m_i = m_new
        base = (head * max_splits + split) * (D + 2)
        if LINKED:
            _lq, _lk, _lv, la, lp = links
            gl.store(lp + base + d, _word64(acc, tag32), cache_modifier=".cg")
            gl.store(lp + base + D, _word64(m_i, tag32), cache_modifier=".cg")
            gl.store(lp + base + D + 1, _word64(l_i, tag32), cache_modifier=".cg")
            if split == 0:
                _combine_linked(lp, la, head, splits, max_splits, tag, tag32, bar_ptr, D, keys, ABLATE)
        else:
            gl.store(part_ptr + base + d, acc)
            gl.store(part_ptr + base + D, m_i)
            gl.store(part_ptr + base + D + 1, l_i)
            _ticket_combine(part_ptr, out_ptr, ticket_ptr, head, splits, max_splits, D, keys)


@gluon.jit
def _ticket_combine(part_ptr, out_ptr, ticket_ptr, head, splits, max_splits, D: gl.constexpr,
                    keys: gl.constexpr):  # fmt: skip
    """The last split of a head to draw a ticket combines the head's partials and stores its output.
    (Every program of the o stage combining all heads' partials itself instead takes two L2 round trips
    off the attention's slowest program but adds more to the o stage: on an H100 the loop went from 1.211
    to 1.219 ms at 640 keys, 1.339 to 1.372 ms at 1,500; bench/results/h100/kernels/.)"""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, keys))
    gl.thread_barrier()  # this program's stores happen before its ticket releases them
    if gl.atomic_add(ticket_ptr + head, 1, sem="acq_rel", scope="gpu") == splits - 1:
        out = _combine(part_ptr + head * max_splits * (D + 2), splits, D, keys)
        gl.store(out_ptr + head * D + d, out.to(gl.bfloat16))
        gl.store(ticket_ptr + head, 0)  # every split has drawn: zero again for the next layer


@gluon.jit
def _combine(part_ptr, splits, D: gl.constexpr, keys: gl.constexpr):
    """softmax(q K^T) V of one head from its split partials (at most ATTN_SPLITS, all in one load), summed in
    split order."""
    gl.static_assert(ATTN_SPLITS <= COMBINE)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, keys))
    c = gl.arange(0, COMBINE, layout=gl.SliceLayout(1, keys))
    live = c < splits
    row = part_ptr + c * (D + 2)
    m_s = gl.load(row + D, mask=live, other=float("-inf"), cache_modifier=".cg")
    l_s = gl.load(row + D + 1, mask=live, other=0.0, cache_modifier=".cg")
    parts = gl.load(gl.expand_dims(row, 1) + gl.expand_dims(d, 0), mask=gl.expand_dims(live, 1), other=0.0,
                    cache_modifier=".cg")  # fmt: skip
    return _merge(parts, m_s, l_s)


@gluon.jit
def _merge(parts, m_s, l_s):
    """The partials' softmax-weighted sum, in split order (`_combine`, `_combine_linked`)."""
    scale = gl.exp(m_s - gl.max(m_s, axis=0))
    total = gl.sum(l_s * scale, axis=0)
    return gl.sum(parts * gl.expand_dims(scale, 1), axis=0) / total


@gluon.jit
def _combine_linked(lp, la, head, splits, max_splits, tag, tag32, bar_ptr, D: gl.constexpr,
                    keys: gl.constexpr, ABLATE: gl.constexpr):  # fmt: skip
    """`_combine` from the partials' tagged words once every split's are in; the head's output to its tagged
    words (the LINKED form's combine: split 0's program, no ticket)."""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, keys))
    c = gl.arange(0, COMBINE, layout=gl.SliceLayout(1, keys))
    live = gl.expand_dims(c < splits, 1)
    row = gl.expand_dims(lp + (head * max_splits + c) * (D + 2), 1)
    every_d = live & gl.expand_dims(d >= 0, 0)
    parts = _value64(_poll(row + gl.expand_dims(d, 0), every_d, tag32, bar_ptr, True, ABLATE))
    m_s = gl.sum(_value64(_poll(row + D, live, tag32, bar_ptr, True, ABLATE)), axis=1)
    l_s = gl.sum(_value64(_poll(row + D + 1, live, tag32, bar_ptr, True, ABLATE)), axis=1)
    m_s = gl.where(c < splits, m_s, float("-inf"))
    out = _merge(parts, m_s, l_s)
    gl.store(la + head * D + d, _word(out, tag), cache_modifier=".cg")


@gluon.jit
def _linked_row(ptr, tag, bar_ptr, D: gl.constexpr, keys: gl.constexpr, ABLATE: gl.constexpr):
    """D values (fp32, SliceLayout(0, keys)) from tagged words, once all of layer `tag`'s are in."""
    d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, keys)), 0)
    return gl.sum(_value(_poll(ptr + d, d >= 0, tag, bar_ptr, False, ABLATE)), axis=0)


# ------------------------------------------------------------------------------------------ the kernel


@gluon.jit(do_not_specialize=["L", "max_splits"])
def _stream_kernel(
    d_qkv,
    d_o,
    d_gu,
    d_down,
    h_in_ptr,
    state_ptr,
    wn_ptr,
    wf_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    went_ptr,
    woff_ptr,
    tab_ptr,
    ctx_ptr,
    q_ptr,
    attn_ptr,
    o_ptr,
    act_ptr,
    d_ptr,
    part_ptr,
    ticket_ptr,
    bar_ptr,
    times_ptr,
    link_ptr,
    lpart_ptr,
    L,
    max_splits,
    eps,
    qk_scale,
    stride_e,
    stride_s,
    stride_ch,
    H: gl.constexpr,
    INTER: gl.constexpr,
    HQ: gl.constexpr,
    HK: gl.constexpr,
    D: gl.constexpr,
    PAGE: gl.constexpr,
    BK: gl.constexpr,
    SPLIT: gl.constexpr,
    SLOTS: gl.constexpr,
    XROWS: gl.constexpr,
    WARPS: gl.constexpr,
    PDL: gl.constexpr = False,
    TIMED: gl.constexpr = False,
    WS: gl.constexpr = False,
    ABLATE: gl.constexpr = 0,
    KV_BLOCKS: gl.constexpr = 2,
    LINKED: gl.constexpr = False,
):
    let_dependents_launch(PDL)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    times_row = times_ptr + pid * (2 + 10 * L)  # TIMED: this program's stamps
    NQKV: gl.constexpr = (HQ + 2 * HK) * D
    KO: gl.constexpr = HQ * D
    KH: gl.constexpr = H // BK
    KTO: gl.constexpr = KO // BK
    KI: gl.constexpr = INTER // BK

    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, 16, BK], d_qkv.layout)
    bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())  # a slot's bytes landed
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())  # a slot was read (WS)
    # x as [K tiles, BK]: written whole through `xs`, read a K tile at a time through `x_tiles` (same bytes)
    # x is bf16 (every value it holds is: a norm's output, the attention's, the activation), half the bytes
    # of fp32 and room for two more ring slots (on an H100: 1.202 ms per loop with fp32 x and 16 slots,
    # 1.200 with bf16 x, 1.187 with bf16 x and 18 slots; bench/results/h100/kernels/)
    xs = gl.allocate_shared_memory(gl.bfloat16, [XROWS, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_tiles = xs._reinterpret(gl.bfloat16, [XROWS, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if KV_BLOCKS > 0:  # the attention item's first key blocks, K then V (`_preload_keys`)
        kv_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * KV_BLOCKS, SPLIT, D], kv_layout)
    else:
        kv_smem = xs  # never read
    for s in gl.static_range(SLOTS):
        mbarrier.init(bars.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.thread_barrier()

    n_qkv = _share(NQKV // 16, pid, programs)
    n_o = _share(H // 16, pid, programs)
    n_gu = _share(INTER // 8, pid, programs)
    n_down = _share(H // 16, pid, programs)
    t0, t1, t2 = n_qkv * KH, n_o * KTO, n_gu * KH
    per_layer = t0 + t1 + t2 + n_down * KI
    stream = (L * per_layer, per_layer, t0, t1, t2, pid, programs)
    descs = (d_qkv, d_o, d_gu, d_down)
    for s in gl.static_range(SLOTS):  # the ring's first fill
        _issue(s, stream, ring, bars, descs, H, INTER, NQKV, KO, D, BK, SLOTS)
    # weights are never written: the first tiles stream while the kernel before ends; all else waits
    wait_for_inputs(PDL)
    _stamp(times_row, 0, TIMED)

    io = (
        h_in_ptr,
        state_ptr,
        wn_ptr,
        wf_ptr,
        cos_ptr,
        sin_ptr,
        kc_ptr,
        vc_ptr,
        went_ptr,
        woff_ptr,
        tab_ptr,
        ctx_ptr,
    )
    bufs = (q_ptr, attn_ptr, o_ptr, act_ptr, d_ptr, part_ptr, ticket_ptr, bar_ptr, times_row, link_ptr,
            lpart_ptr)  # fmt: skip
    scalars = (L, max_splits, eps, qk_scale, stride_e, stride_s, stride_ch)
    smem = (ring, bars, empty, xs, x_tiles, kv_smem)
    counts = (n_qkv, n_o, n_gu, n_down)
    if WS:  # these warps compute; one more warp keeps the ring full (waits for a slot's reads, then asks TMA)
        gl.warp_specialize(
            [(_layers, (io, bufs, scalars, smem, stream, counts, descs, H, INTER, HQ, HK, D, PAGE, BK, SPLIT,
                        SLOTS, XROWS, WARPS, TIMED, WS, ABLATE, KV_BLOCKS, LINKED)),
             (_producer, (stream, ring, bars, empty, descs, H, INTER, NQKV, KO, D, BK, SLOTS))],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip
    else:
        _layers(
            io,
            bufs,
            scalars,
            smem,
            stream,
            counts,
            descs,
            H,
            INTER,
            HQ,
            HK,
            D,
            PAGE,
            BK,
            SPLIT,
            SLOTS,
            XROWS,
            WARPS,
            TIMED,
            WS,
            ABLATE,
            KV_BLOCKS,
            LINKED,
        )


@gluon.jit
def _producer(stream, ring, bars, empty, descs, H: gl.constexpr, INTER: gl.constexpr, NQKV: gl.constexpr,
              KO: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, SLOTS: gl.constexpr):  # fmt: skip
    """The warp-specialized ring's producer: tile q goes into its slot once the computing warps have read
    tile q - SLOTS there (the slot's `empty` barrier); the first SLOTS were asked for before the split.
    (Asking L2 for tiles further ahead as well made the loop 1.5x slower on an H100: HBM's queues grow, and
    every latency-bound read, the attention's above all, waits behind them. Asking for 16 or 32 tiles past
    the ring once, as the q/k/v stage ends, was slower too, 1.205 -> 1.214 / 1.234 ms per loop: the grid
    barrier's release after that stage went from 1.25 to 4 us behind the extra reads.)"""
    total = stream[0]
    for q in range(SLOTS, total):
        mbarrier.wait(empty.index(q % SLOTS), ((q // SLOTS) - 1) & 1)
        _issue(q, stream, ring, bars, descs, H, INTER, NQKV, KO, D, BK, SLOTS)


@gluon.jit
def _arrive(bar_ptr, times_row, stamp, TIMED: gl.constexpr, ABLATE: gl.constexpr):
    _stamp(times_row, stamp, TIMED)
    if (ABLATE & NO_BARRIERS) == 0:
        grid_arrive(bar_ptr)


@gluon.jit
def _wait(bar_ptr, target, times_row, stamp, TIMED: gl.constexpr, ABLATE: gl.constexpr):
    if (ABLATE & NO_BARRIERS) == 0:
        grid_wait(bar_ptr, target)
    _stamp(times_row, stamp + 1, TIMED)


@gluon.jit
def _stage_end(bar_ptr, arrivals, programs, times_row, stamp, TIMED: gl.constexpr, ABLATE: gl.constexpr,
               LINKED: gl.constexpr):  # fmt: skip
    """This program's end of a stage: its clock stamp and, with grid barriers, its arrival (returns the
    arrivals the barrier's wait then expects). Work needing no other program may follow before
    `_stage_input`."""
    if LINKED:
        _stamp(times_row, stamp, TIMED)
    else:
        arrivals += programs
        _arrive(bar_ptr, times_row, stamp, TIMED, ABLATE)
    return arrivals


@gluon.jit
def _stage_input(words_ptr, bf16_ptr, n, tag, bar_ptr, arrivals, times_row, stamp, ROWS: gl.constexpr,
                 BK: gl.constexpr, layout: gl.constexpr, TIMED: gl.constexpr, ABLATE: gl.constexpr,
                 LINKED: gl.constexpr):  # fmt: skip
    """The vector the next stage reads, fp32 [ROWS, BK], 0 past n (n = 0: a program with no units there
    reads nothing; with tagged words it must not, see "tagged words"): after the grid barrier's wait,
    through L2 from `bf16_ptr`, or (LINKED) once its words at `words_ptr` all carry `tag`; then the
    departure stamp."""
    if LINKED:
        x = _linked(words_ptr, n, tag, bar_ptr, ROWS, BK, layout, ABLATE)
        _stamp(times_row, stamp + 1, TIMED)
    else:
        _wait(bar_ptr, arrivals, times_row, stamp, TIMED, ABLATE)
        x = _made(bf16_ptr, n, ROWS, BK, layout)
    return x


@gluon.jit
def _layers(io, bufs, scalars, smem, stream,
    counts, descs, H: gl.constexpr, INTER: gl.constexpr, HQ: gl.constexpr,
            HK: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr,
            SLOTS: gl.constexpr, XROWS: gl.constexpr, WARPS: gl.constexpr, TIMED: gl.constexpr,
            WS: gl.constexpr, ABLATE: gl.constexpr, KV_BLOCKS: gl.constexpr,
            LINKED: gl.constexpr):  # fmt: skip
    """Every layer of the loop, then the final norm: the computing warps' work. Each grid barrier is split in
    two: between this program's arrival and its wait it loads what needs no other program (the norm weights
    of the stage after), so those loads overlap the wait instead of following it. LINKED: no grid barriers;
    each stage reads the words it needs once they carry this layer's tag (a program with no units in a
    stage reads nothing for it), and the clock stamps mark a stage's end and when its successor's inputs
    were all in."""
    (
        h_in_ptr,
        state_ptr,
        wn_ptr,
        wf_ptr,
        cos_ptr,
        sin_ptr,
        kc_ptr,
        vc_ptr,
        went_ptr,
        woff_ptr,
        tab_ptr,
        ctx_ptr,
    ) = io
    q_ptr, attn_ptr, o_ptr, act_ptr, d_ptr, part_ptr, ticket_ptr, bar_ptr, times_row, link_ptr, lpart_ptr = (
        bufs
    )
    L, max_splits, eps, qk_scale, stride_e, stride_s, stride_ch = scalars
    ring, bars, empty, xs, x_tiles, kv_smem = smem
    n_qkv, n_o, n_gu, n_down = counts
    _total, _per_layer, _t0, _t1, _t2, pid, programs = stream
    vec: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    NQKV: gl.constexpr = (HQ + 2 * HK) * D
    KO: gl.constexpr = HQ * D
    KH: gl.constexpr = H // BK
    KTO: gl.constexpr = KO // BK
    KI: gl.constexpr = INTER // BK
    # the LINKED form's tagged words (`loop_streamed`): q, the newest k and v, the attention's output, o,
    # the activation, down's output, then the launch count
    lq = link_ptr
    lk = lq + HQ * D
    lv = lk + HK * D
    la = lv + HK * D
    lo = la + HQ * D
    lact = lo + H
    ldown = lact + INTER
    epoch = gl.load(ldown + H) if LINKED else 0
    links = (lq, lk, lv, la, lpart_ptr)
    ctx = gl.load(ctx_ptr)
    entry = gl.load(went_ptr).to(gl.int64)
    offset = gl.load(woff_ptr).to(gl.int64)
    attn = (
        q_ptr,
        attn_ptr,
        kc_ptr,
        vc_ptr,
        tab_ptr,
        part_ptr,
        ticket_ptr,
        max_splits,
        stride_e,
        stride_s,
        stride_ch,
    )
    h = gl.load(h_in_ptr + _offsets(KH, BK, vec)).to(gl.float32)
    w_in1 = _weights(wn_ptr, KH, BK, vec)  # layer 0's input norm; later layers' are loaded during a wait
    q = pid * 0
    arrivals = programs * 0
    for layer in range(L):
        stamp = 1 + layer * 10  # this layer's first barrier: arrival, then departure
        tag = _tag(epoch, L, layer)
        _set_x(xs, _norm(h, w_in1, H, eps), KH)
        if KV_BLOCKS > 0:  # noqa: SIM102 (constexpr tests)
            if (ABLATE & NO_ATTENTION) == 0:
                _preload_keys(kv_smem, layer.to(gl.int64), ctx, attn, pid, HQ, HK, D, PAGE, SPLIT, WARPS,
                              KV_BLOCKS)  # fmt: skip
        rope = (
            lq if LINKED else q_ptr,
            kc_ptr,
            vc_ptr,
            cos_ptr,
            sin_ptr,
            entry,
            offset,
            layer.to(gl.int64),
            stride_e,
            stride_s,
            stride_ch,
            lk,
            lv,
        )
        q = _gemv(q, n_qkv, KH, QKV, rope, x_tiles, stream, ring, bars, empty, descs, H, INTER, NQKV, KO,
                  HQ, HK, D, BK, SLOTS, WARPS, WS, ABLATE, LINKED, tag)  # fmt: skip
        if (ABLATE & NO_ATTENTION) == 0:
            _prefetch_split(layer.to(gl.int64), ctx, attn, pid, HQ, HK, D, PAGE, SPLIT, WARPS, KV_BLOCKS)
            if LINKED:  # each attention item waits for its own head's words
                _stamp(times_row, stamp, TIMED)
                newest = entry
                _stamp(times_row, stamp + 1, TIMED)
            else:
                arrivals += programs
                _arrive(bar_ptr, times_row, stamp, TIMED, ABLATE)
                newest = _newest_page(layer.to(gl.int64), ctx, tab_ptr, PAGE)
                _wait(bar_ptr, arrivals, times_row, stamp, TIMED, ABLATE)
            if KV_BLOCKS > 0:  # this thread's copies landed; the CTA barrier: every thread's
                async_copy.wait_group(0)
                gl.thread_barrier()
            _attend(layer.to(gl.int64), newest, ctx, attn, pid, programs, qk_scale, kv_smem, HQ, HK, D, PAGE,
                    SPLIT, WARPS, KV_BLOCKS, LINKED, links, tag, _tag32(epoch, L, layer), bar_ptr,
                    ABLATE)  # fmt: skip
        arrivals = _stage_end(bar_ptr, arrivals, programs, times_row, stamp + 2, TIMED, ABLATE, LINKED)
        x = _stage_input(la, attn_ptr, KO * (n_o > 0).to(gl.int32), tag, bar_ptr, arrivals, times_row,
                         stamp + 2, KTO, BK, vec, TIMED, ABLATE, LINKED)  # fmt: skip
        _set_x(xs, x, KTO)
        q = _gemv(q, n_o, KTO, O_PROJ, lo if LINKED else o_ptr, x_tiles, stream, ring, bars, empty, descs, H,
                  INTER, NQKV, KO, HQ, HK, D, BK, SLOTS, WARPS, WS, ABLATE, LINKED, tag)  # fmt: skip
        arrivals = _stage_end(bar_ptr, arrivals, programs, times_row, stamp + 4, TIMED, ABLATE, LINKED)
        w_in2 = _weights(wn_ptr + (layer * 4 + 1) * H, KH, BK, vec)
        w_post1 = _weights(wn_ptr + (layer * 4 + 2) * H, KH, BK, vec)
        o_out = _stage_input(lo, o_ptr, H, tag, bar_ptr, arrivals, times_row, stamp + 4, KH, BK, vec, TIMED,
                             ABLATE, LINKED)  # fmt: skip
        # M = h + in2(o), the MLP's residual (kept in h); x = post1(M)
        h = _bf16(h + _norm(o_out, w_in2, H, eps))
        _set_x(xs, _norm(h, w_post1, H, eps), KH)
        act_out = lact if LINKED else act_ptr
        q = _gemv(q, n_gu, KH, GATE_UP, act_out, x_tiles, stream, ring, bars, empty, descs, H, INTER, NQKV,
                  KO, HQ, HK, D, BK, SLOTS, WARPS, WS, ABLATE, LINKED, tag)  # fmt: skip
        arrivals = _stage_end(bar_ptr, arrivals, programs, times_row, stamp + 6, TIMED, ABLATE, LINKED)
        x = _stage_input(lact, act_ptr, INTER * (n_down > 0).to(gl.int32), tag, bar_ptr, arrivals, times_row,
                         stamp + 6, XROWS, BK, vec, TIMED, ABLATE, LINKED)  # fmt: skip
        _set_x(xs, x, XROWS)
        q = _gemv(q, n_down, KI, DOWN, ldown if LINKED else d_ptr, x_tiles, stream, ring, bars, empty, descs,
                  H, INTER, NQKV, KO, HQ, HK, D, BK, SLOTS, WARPS, WS, ABLATE, LINKED, tag)  # fmt: skip
        arrivals = _stage_end(bar_ptr, arrivals, programs, times_row, stamp + 8, TIMED, ABLATE, LINKED)
        w_post2 = _weights(wn_ptr + (layer * 4 + 3) * H, KH, BK, vec)
        w_in1 = _weights(wn_ptr + ((layer + 1) % L * 4) * H, KH, BK, vec)  # past the last layer: unused
        down = _stage_input(ldown, d_ptr, H, tag, bar_ptr, arrivals, times_row, stamp + 8, KH, BK, vec, TIMED,
                            ABLATE, LINKED)  # fmt: skip
        h = _bf16(h + _norm(down, w_post2, H, eps))  # the next layer's input: M + post2(down)
    state = _norm(h, _weights(wf_ptr, KH, BK, vec), H, eps)
    if pid == 0:
        gl.store(state_ptr + _offsets(KH, BK, vec), state.to(gl.bfloat16))
    _stamp(times_row, 1 + L * 10, TIMED)
    # the last program to leave: every program is past its waits, the counters go back to zero (LINKED: and
    # the launch count goes one up, so the next launch's tags follow this one's)
    if gl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        gl.store(bar_ptr, 0)
        gl.store(bar_ptr + 1, 0)
        if LINKED:
            gl.store(ldown + H, (epoch + 1) % EPOCHS_C)


# -------------------------------------------------------------------------------------------------- host


def ring_refusal(
    state: torch.Tensor, weights: pl.LoopWeights, cos, sin, k_cache, v_cache, tables
) -> str | None:
    """Why `loop_streamed` cannot run this loop, the first unmet condition in words (None: it can): one
    row, a Hopper GPU, `persistent_loop.loop_fusable`'s shapes, and weights TMA can read as tiles
    (contiguous stacks, K multiples of BLOCK_K with a power-of-two count of tiles for the hidden width, rows
    in whole 16-row items)."""
    hq, hk, d = weights.heads
    _layers, hidden, inter = weights.shape
    if state.dim() != 2 or state.shape[0] != 1:
        return f"{state.shape[0] if state.dim() == 2 else 'no'} rows: the ring takes one"
    if not state.is_cuda or torch.cuda.get_device_capability(state.device)[0] != 9:
        return "the ring runs on Hopper GPUs (sm_90) only"
    if not pl.loop_fusable(state, weights, cos, sin, k_cache, v_cache, tables):
        return "shapes or layouts the persistent loop does not take"
    tiles_fit = (
        all(w.is_contiguous() for w in (weights.qkv, weights.o, weights.gate_up, weights.down))
        and hidden % BLOCK_K == 0
        and pl.pow2(hidden // BLOCK_K) == hidden // BLOCK_K
        and hq * d == hidden
        and inter % BLOCK_K == 0
        and (d // 2) % 8 == 0
        and inter % 8 == 0
        and state.is_contiguous()
    )
    return None if tiles_fit else f"weights the ring cannot read as {BLOCK_K}-column tiles"


def stream_fusable(state: torch.Tensor, weights: pl.LoopWeights, cos, sin, k_cache, v_cache, tables) -> bool:
    """Whether `loop_streamed` runs this loop (`ring_refusal` says why not)."""
    return ring_refusal(state, weights, cos, sin, k_cache, v_cache, tables) is None


_LINKS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def links(device, weights: pl.LoopWeights, max_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The LINKED form's tagged words (int32: q, the newest k and v, the attention's output, o, the
    activation, down's output, then the launch count) and partials (int64), zero at first (no tag is 0);
    kept for the process like `persistent_loop.workspace` (inside a capture: made for that graph alone)."""
    key = (device, weights.shape, weights.heads, max_splits)
    if key in _LINKS:
        return _LINKS[key]
    hq, hk, d = weights.heads
    _layers, hidden, inter = weights.shape
    words = torch.zeros(2 * hq * d + 2 * hk * d + 2 * hidden + inter + 1, dtype=torch.int32, device=device)
    parts = torch.zeros(hq * max_splits * (d + 2), dtype=torch.int64, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _LINKS[key] = (words, parts)
    return words, parts


def stamp_count(layers: int) -> int:
    """Clock stamps per program of a timed launch (`loop_streamed(times=...)`)."""
    return 2 + 10 * layers


def loop_streamed(
    state,
    weights: pl.LoopWeights,
    cos,
    sin,
    k_cache,
    v_cache,
    write_entry,
    write_offset,
    tables,
    ctx_lens,
    page: int,
    slots: int = 18,
    num_warps: int = 4,
    split_keys: int = 64,
    times: torch.Tensor | None = None,
    specialized: bool = True,
    ablate: int = 0,
    kv_blocks: int = 2,
    linked: bool = False,
) -> torch.Tensor:
    """One Ouro loop over one decode row `state` `[1, H]` as one persistent launch whose weights stream
    through a TMA ring of `slots` tiles (16 x BLOCK_K bf16 each) per SM; returns the new state `[1, H]`.
    `specialized` (default): one more warp (the producer) keeps the ring full, and the computing warps only
    arrive on a slot's barrier once they have read it (on an H100, 20 slots: 1.246 ms per 24-layer loop
    against 1.310 ms for 10 slots without it; bench/results/h100/kernels/). `kv_blocks` (default 2): the
    attention item's first key blocks (K and V) are copied into shared memory as each layer starts
    (`_preload_keys`), which with x held as bf16 leaves room for 18 slots (on an H100 at 640 keys: 1.205
    ms per loop against 1.275 ms for 20 slots without it, 1.339 against 1.411 ms at 1,500 keys; 18 slots
    1.187 against 1.202 ms for 16 with fp32 x). `linked` (off): the programs hand values over as tagged
    words instead of through grid barriers (the section "tagged words" above; needs a program per attention
    item); the same bits, but slower on an H100 (1.256 against 1.179 ms per loop at 640 keys: the q/k/v
    stage no longer waits, but the attention items then wait inside for the slowest q/k/v program, and
    polls that reread whole vectors from L2 see the last value later than a barrier releases). `times` (int64
    `[programs, 2 + 10 L]`, optional): each program's GPU clock in ns at its start, at its arrival at and its
    departure from each grid barrier (5 per layer), and at its end: the stage anatomy (`stamp_count`).
    `ablate` (bench only, wrong outputs): the NO_* bits, parts left out to see what each costs. Call where
    `stream_fusable`."""
    hq, hk, d = weights.heads
    layers, hidden, inter = weights.shape
    programs = torch.cuda.get_device_properties(state.device).multi_processor_count
    max_splits = pl.split_slots(tables, page, split_keys)
    ws = pl.workspace(state.device, programs, 1, weights, max_splits)
    words, parts = links(state.device, weights, max_splits) if linked else (ws.barrier, ws.part)
    if linked and programs < hq * ATTN_SPLITS.value:
        raise ValueError(f"the linked form needs a program per attention item: {hq * ATTN_SPLITS.value}")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    descs = [
        TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [BOX_ROWS, BLOCK_K], layout)
        for w in (weights.qkv, weights.o, weights.gate_up, weights.down)
    ]
    out = torch.empty_like(state)
    _stream_kernel[(programs,)](
        *descs,
        state,
        out,
        weights.norms,
        weights.final_norm,
        cos,
        sin,
        k_cache,
        v_cache,
        write_entry,
        write_offset,
        tables,
        ctx_lens,
        ws.q,
        ws.attn,
        ws.o,
        ws.act,
        ws.down,
        ws.part,
        ws.tickets,
        ws.barrier,
        ws.barrier if times is None else times,  # never written when untimed
        words,
        parts,
        layers,
        max_splits,
        weights.eps,
        d**-0.5,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        H=hidden,
        INTER=inter,
        HQ=hq,
        HK=hk,
        D=d,
        PAGE=page,
        BK=BLOCK_K,
        SPLIT=split_keys,
        SLOTS=slots,
        XROWS=pl.pow2(max(inter, hidden) // BLOCK_K),
        WARPS=num_warps,
        num_warps=num_warps,
        enable_fp_fusion=False,
        TIMED=times is not None,
        WS=specialized,
        ABLATE=ablate,
        KV_BLOCKS=kv_blocks,
        LINKED=linked,
        **pdl_args(),
    )
    return out


__all__ = ["BLOCK_K", "grid_barrier", "loop_streamed", "ring_refusal", "stamp_count", "stream_fusable"]
