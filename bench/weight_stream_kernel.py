"""A structure probe for batch-1 decode: every weight of an Ouro loop streamed through a shared-memory ring by
TMA, inside one persistent Gluon launch, with grid barriers between the GEMV stages.

Why it exists: the Triton persistent loop (`engine/kernels/persistent_loop.py`) holds its weight tiles in
registers, and Triton's `tl.load` cannot keep several of them in flight across an item (the compiler moves
or repacks the loaded registers and waits), so it sits near one 32 KB tile per SM in flight, about 2x the
copy floor. Here the tiles land in shared memory: a program asks for tile q + SLOTS as soon as it has read
tile q, and the mbarrier of each ring slot says when its bytes have arrived. Weights never depend on the
activations, so the ring runs ahead across stage and layer boundaries: while a program waits at a grid
barrier, the next stage's tiles keep arriving.

The data flow is a skeleton of one Ouro layer with the same weights, shapes and dependencies, not its
arithmetic: no norms, no RoPE, no attention (the o stage reads the first H outputs of q/k/v in its place).
Per layer, with h the residual (fp32, kept in every program's registers):

    qkv = Wqkv h            (NQKV x H)
    o   = Wo qkv[:H]        (H x H)
    h   = h + o
    gu  = Wgu h             (2 INTER x H)
    d   = Wd (silu(g) u)    (H x INTER)
    h   = h + d

Each GEMV item is BN whole rows (every K tile of them), so a row's sum is one program's, in a fixed order:
the result is the same bits run to run. The bench (`bench/kernel_weight_stream.py`) checks it against
float64 and times it against the copy floor and against cuBLAS per stage.
"""

from __future__ import annotations

import triton.experimental.gluon.language as gl
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from looptrace.engine.kernels.stream_loop import grid_barrier  # a wait that gives up counts in bar[2]


@gluon.jit
def _share(n_blocks, pid, programs):
    """How many of a stage's row blocks this program takes (blocks pid, pid + P, pid + 2P, ...)."""
    return (n_blocks + programs - 1 - pid) // programs


@gluon.jit
def _issue(
    q,
    total,
    per_layer,
    t0,
    t1,
    t2,
    pid,
    programs,
    ring,
    bars,
    d_qkv,
    d_o,
    d_gu,
    d_down,
    H: gl.constexpr,
    NQKV: gl.constexpr,
    INTER: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    SLOTS: gl.constexpr,
):
    """Ask for this program's tile number q (its tiles in consumption order, over every layer and stage)
    into ring slot q % SLOTS. Past the last tile it does nothing."""
    if q < total:
        layer = q // per_layer
        r = q % per_layer
        slot = q % SLOTS
        bar = bars.index(slot)
        dst = ring.index(slot)
        mbarrier.expect(bar, BN * BK * 2)
        if r < t0:
            block = pid + (r // (H // BK)) * programs
            tma.async_copy_global_to_shared(
                d_qkv, [layer * NQKV + block * BN, (r % (H // BK)) * BK], bar, dst
            )
        elif r < t0 + t1:
            r = r - t0
            block = pid + (r // (H // BK)) * programs
            tma.async_copy_global_to_shared(d_o, [layer * H + block * BN, (r % (H // BK)) * BK], bar, dst)
        elif r < t0 + t1 + t2:
            r = r - t0 - t1
            block = pid + (r // (H // BK)) * programs
            tma.async_copy_global_to_shared(
                d_gu, [layer * 2 * INTER + block * BN, (r % (H // BK)) * BK], bar, dst
            )
        else:
            r = r - t0 - t1 - t2
            block = pid + (r // (INTER // BK)) * programs
            tma.async_copy_global_to_shared(
                d_down, [layer * H + block * BN, (r % (INTER // BK)) * BK], bar, dst
            )


@gluon.jit
def _gemv_stage(
    q,
    count,
    KT: gl.constexpr,
    out_ptr,
    x_tiles,
    total,
    per_layer,
    t0,
    t1,
    t2,
    pid,
    programs,
    ring,
    bars,
    d_qkv,
    d_o,
    d_gu,
    d_down,
    H: gl.constexpr,
    NQKV: gl.constexpr,
    INTER: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    SLOTS: gl.constexpr,
    WARPS: gl.constexpr,
):
    """This program's `count` row blocks of one stage: out[rows] = W[rows, :] x, with x in
    `x_tiles` as [KT, BK] fp32. Each tile read from the ring frees its slot for the tile SLOTS further on."""
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    for i in range(count):
        acc = gl.zeros([BN, BK], gl.float32, tile)
        for kt in range(KT):
            slot = q % SLOTS
            mbarrier.wait(bars.index(slot), (q // SLOTS) & 1)
            w = ring.index(slot).load(tile)
            gl.thread_barrier()  # every warp has read the slot before the TMA below refills it
            _issue(
                q + SLOTS,
                total,
                per_layer,
                t0,
                t1,
                t2,
                pid,
                programs,
                ring,
                bars,
                d_qkv,
                d_o,
                d_gu,
                d_down,
                H,
                NQKV,
                INTER,
                BN,
                BK,
                SLOTS,
            )
            x = x_tiles.index(kt).load(gl.SliceLayout(0, tile))
            acc += w.to(gl.float32) * gl.expand_dims(x, 0)
            q += 1
        rows = (pid + i * programs) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, tile))
        gl.store(out_ptr + rows, gl.sum(acc, axis=1))
    return q


@gluon.jit
def _offsets(ROWS: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """Offsets of a vector laid out as [ROWS, BK] (the shape of `xs`)."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims(r, 1) * BK + gl.expand_dims(c, 0)


@gluon.jit
def _vector(ptr, ROWS: gl.constexpr, BK: gl.constexpr, n, layout: gl.constexpr):
    """A length-n fp32 vector made inside this launch, as [ROWS, BK] (read past L1: `.cg`; 0 past n)."""
    offs = _offsets(ROWS, BK, layout)
    return gl.load(ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg")


@gluon.jit
def weight_stream_kernel(
    d_qkv,
    d_o,
    d_gu,
    d_down,
    h_ptr,
    qkv_ptr,
    o_ptr,
    gu_ptr,
    dn_ptr,
    out_ptr,
    bar_ptr,
    L,
    H: gl.constexpr,
    NQKV: gl.constexpr,
    INTER: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    SLOTS: gl.constexpr,
    XROWS: gl.constexpr,
    BARRIERS: gl.constexpr,
    WARPS: gl.constexpr,
):
    """L skeleton layers in one launch of one program per SM. `BARRIERS=False` drops the grid barriers (the
    results are then wrong; it times the stream alone)."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    vec: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    KH: gl.constexpr = H // BK
    KI: gl.constexpr = INTER // BK

    ring = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BN, BK], d_qkv.layout)
    bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    # x as [K tiles, BK], written whole; `x_tiles.index(kt)` (the same bytes) is its K tile kt
    xs = gl.allocate_shared_memory(gl.float32, [XROWS, BK], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_tiles = xs._reinterpret(gl.float32, [XROWS, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for s in gl.static_range(SLOTS):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    gl.thread_barrier()

    c0 = _share(NQKV // BN, pid, programs)
    c1 = _share(H // BN, pid, programs)
    c2 = _share(2 * INTER // BN, pid, programs)
    c3 = _share(H // BN, pid, programs)
    t0, t1, t2 = c0 * KH, c1 * KH, c2 * KH
    per_layer = t0 + t1 + t2 + c3 * KI
    total = L * per_layer
    for s in gl.static_range(SLOTS):  # the ring's first fill
        _issue(
            s,
            total,
            per_layer,
            t0,
            t1,
            t2,
            pid,
            programs,
            ring,
            bars,
            d_qkv,
            d_o,
            d_gu,
            d_down,
            H,
            NQKV,
            INTER,
            BN,
            BK,
            SLOTS,
        )

    h = _vector(h_ptr, KH, BK, H, vec)
    q = pid * 0
    target = programs * 0
    for _ in range(L):
        xs.slice(0, KH).store(h)
        gl.thread_barrier()
        q = _gemv_stage(q, c0, KH, qkv_ptr, x_tiles, total, per_layer, t0, t1, t2, pid, programs, ring,
                        bars, d_qkv, d_o, d_gu, d_down, H, NQKV, INTER, BN, BK, SLOTS, WARPS)  # fmt: skip
        if BARRIERS:
            target += programs
            grid_barrier(bar_ptr, target)
        xs.slice(0, KH).store(_vector(qkv_ptr, KH, BK, H, vec))
        gl.thread_barrier()
        q = _gemv_stage(q, c1, KH, o_ptr, x_tiles, total, per_layer, t0, t1, t2, pid, programs, ring, bars,
                        d_qkv, d_o, d_gu, d_down, H, NQKV, INTER, BN, BK, SLOTS, WARPS)  # fmt: skip
        if BARRIERS:
            target += programs
            grid_barrier(bar_ptr, target)
        h = h + _vector(o_ptr, KH, BK, H, vec)
        xs.slice(0, KH).store(h)
        gl.thread_barrier()
        q = _gemv_stage(q, c2, KH, gu_ptr, x_tiles, total, per_layer, t0, t1, t2, pid, programs, ring, bars,
                        d_qkv, d_o, d_gu, d_down, H, NQKV, INTER, BN, BK, SLOTS, WARPS)  # fmt: skip
        if BARRIERS:
            target += programs
            grid_barrier(bar_ptr, target)
        g = _vector(gu_ptr, XROWS, BK, INTER, vec)
        u = _vector(gu_ptr + INTER, XROWS, BK, INTER, vec)
        xs.store(g / (1.0 + gl.exp(-g)) * u)
        gl.thread_barrier()
        q = _gemv_stage(q, c3, KI, dn_ptr, x_tiles, total, per_layer, t0, t1, t2, pid, programs, ring, bars,
                        d_qkv, d_o, d_gu, d_down, H, NQKV, INTER, BN, BK, SLOTS, WARPS)  # fmt: skip
        if BARRIERS:
            target += programs
            grid_barrier(bar_ptr, target)
        h = h + _vector(dn_ptr, KH, BK, H, vec)
    if pid == 0:
        gl.store(out_ptr + _offsets(KH, BK, vec), h)
