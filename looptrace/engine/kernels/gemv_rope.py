"""The one-row q/k/v GEMV that finishes RoPE and the K/V cache write itself (R0: `kernels.gemv_rope_out`).

Why: in `fast` a layer pass of Ouro's attention is a chain of dependent launches (qkv GEMV, RoPE + K/V
write, attention, o GEMV), and at one row each launch boundary costs more than the work it separates:
`rope.rope_half_write_kv` moves 12 KB. Here the GEMV's programs rotate their own output columns and store
them where that kernel would (q to its buffer, k and v into the paged cache): one launch fewer per pass.

How (`_qkv_rope_kernel`): W is the fused `[Wq; Wk; Wv]` (`(Hq + 2 Hk) * D` rows). Program j holds
`BLOCK_N / 2` rotate-half pairs of one head (dims i and i + D/2), i.e. BLOCK_N / 2 consecutive W rows and
the BLOCK_N / 2 rows D/2 further, so both members of each pair are in its registers. Each row's products
are the plain GEMV's (`gemv.split_product` with the plain GEMV's tile, one split), rounded to bf16 as the
plain GEMV stores them; then q and k heads get `_rope_half_write_kernel`'s fenced rotation
`rn_bf16(rn_bf16(x1 c1) + rn_bf16(-x2 s1))`, `rn_bf16(rn_bf16(x2 c2) + rn_bf16(x1 s2))`, and v heads are
stored as they are. The bits are the two launches' (q, the cache rows); the un-rotated q/k/v never reach
memory. It runs only where the plain GEMV would not split K (with a split its sums would differ) and where
a pair's block fits in a head (`qkv_rope_fusable`).

Under `kernels.gemv_batch` the same launch takes 2-8 rows (`route_rows`): the plain GEMV's many-row
products (the tile table's tensor-core config, one split), then each row rotated with its own cos/sin row
and written to its own cache slot (`_store_rotated_rows`); the one-row path is unchanged.
"""

from __future__ import annotations

import torch

from looptrace.engine.kernels import launch_mode
from looptrace.engine.kernels.device_helpers import (
    EXACT_OPTIONS,
    let_dependents_launch,
    rotate_half,
    round_bf16,
    to_bf16,
    triton,
    wait_for_inputs,
)
from looptrace.engine.kernels.gemv import tiles
from looptrace.engine.kernels.gemv.kernel import split_product, weight_tile
from looptrace.engine.kernels.gemv.tiles import ROUTE_ROWS, one_row_config, split_for
from looptrace.engine.kernels.launch_mode import pdl_args

tl = triton.language


@triton.jit
def _pair_rows(pid, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """W rows of program pid: BLOCK_N / 2 first members of rotate-half pairs, then their partners D/2
    further. Pair p is dim p % HALF of head p // HALF (heads in q, k, v order, as W stacks them)."""
    j = tl.arange(0, BLOCK_N)
    pair = pid * (BLOCK_N // 2) + j % (BLOCK_N // 2)
    head, dim = pair // HALF, pair % HALF
    return head * (2 * HALF) + dim + tl.where(j < BLOCK_N // 2, 0, HALF)


@triton.jit
def _store_kv(kc_ptr, vc_ptr, dst, o1, o2, x1, x2, k_mask, v_mask, HALF: tl.constexpr):
    """k heads' rotated halves and v heads' values as they are, into the cache at `dst` (and HALF on)."""
    tl.store(kc_ptr + dst, o1.to(kc_ptr.dtype.element_ty), mask=k_mask)
    tl.store(kc_ptr + dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=k_mask)
    tl.store(vc_ptr + dst, to_bf16(x1).to(vc_ptr.dtype.element_ty), mask=v_mask)
    tl.store(vc_ptr + dst + HALF, to_bf16(x2).to(vc_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _store_rotated(acc, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer_id, pid,
                   stride_e, stride_s, stride_ch, HQ, HK, HALF: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """The pairs' bf16 values (as the plain GEMV stores them) rotated and stored as `rope_half_write_kv`
    does: q heads into q [1, Hq, D], k heads rotated and v heads as they are into the cache slot
    (write_entry + layer_id, write_offset); a padding row (write_entry < 0) writes no cache."""
    first, second = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N // 2]), (1, 0)))
    x1, x2 = round_bf16(first), round_bf16(second)
    pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head, d = pair // HALF, pair % HALF
    c1 = tl.load(cos_ptr + d).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + d).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + d).to(tl.float32)
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)
    o1, o2 = to_bf16(o1), to_bf16(o2)
    is_q, is_k = head < HQ, (head >= HQ) & (head < HQ + HK)
    is_v = (head >= HQ + HK) & (head < HQ + 2 * HK)
    qp = q_ptr + head * (2 * HALF) + d
    tl.store(qp, o1, mask=is_q)
    tl.store(qp + HALF, o2, mask=is_q)
    entry = tl.load(went_ptr).to(tl.int64)
    off = tl.load(woff_ptr).to(tl.int64)
    kv_head = tl.where(is_k, head - HQ, head - HQ - HK).to(tl.int64)
    dst = (entry + layer_id) * stride_e + off * stride_s + kv_head * stride_ch + d
    _store_kv(kc_ptr, vc_ptr, dst, o1, o2, x1, x2, is_k & (entry >= 0), is_v & (entry >= 0), HALF)


@triton.jit
def _store_rotated_rows(acc, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer_id, pid,
                        stride_e, stride_s, stride_ch, stride_cos, stride_sin, stride_went, stride_woff,
                        HQ, HK, M: tl.constexpr, M_PAD: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_N: tl.constexpr):  # fmt: skip
    """`_store_rotated` over M rows (acc `[BLOCK_N, M_PAD]`): row r rotates with cos/sin row r, stores q
    into q `[M, Hq, D]` and k and v into its own cache slot (write_entry[r] + layer_id, write_offset[r]);
    a padding row (write_entry < 0) writes no cache."""
    first, second = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N // 2, M_PAD]), (1, 2, 0)))
    x1, x2 = round_bf16(first), round_bf16(second)
    pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head, d = (pair // HALF)[:, None], (pair % HALF)[:, None]
    r = tl.arange(0, M_PAD)[None, :]
    live = r < M
    c1 = tl.load(cos_ptr + r * stride_cos + d, mask=live, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + r * stride_cos + HALF + d, mask=live, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + r * stride_sin + d, mask=live, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + r * stride_sin + HALF + d, mask=live, other=0.0).to(tl.float32)
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2)
    o1, o2 = to_bf16(o1), to_bf16(o2)
    is_q, is_k = (head < HQ) & live, (head >= HQ) & (head < HQ + HK) & live
    is_v = (head >= HQ + HK) & (head < HQ + 2 * HK) & live
    qp = q_ptr + r * (HQ * 2 * HALF) + head * (2 * HALF) + d
    tl.store(qp, o1, mask=is_q)
    tl.store(qp + HALF, o2, mask=is_q)
    entry = tl.load(went_ptr + r * stride_went, mask=live, other=-1).to(tl.int64)
    off = tl.load(woff_ptr + r * stride_woff, mask=live, other=0).to(tl.int64)
    kv_head = tl.where(is_k, head - HQ, head - HQ - HK).to(tl.int64)
    dst = (entry + layer_id) * stride_e + off * stride_s + kv_head * stride_ch + d
    _store_kv(kc_ptr, vc_ptr, dst, o1, o2, x1, x2, is_k & (entry >= 0), is_v & (entry >= 0), HALF)


@triton.jit(do_not_specialize=["layer_id"])
def _qkv_rope_kernel(x_ptr, w_ptr, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer_id,
                     stride_wn, stride_e, stride_s, stride_ch, HQ, HK, K: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
                     PRELOAD: tl.constexpr = 0, M: tl.constexpr = 1, M_PAD: tl.constexpr = 1,
                     DOT: tl.constexpr = False, X_FIRST: tl.constexpr = False, stride_cos=0, stride_sin=0,
                     stride_went=0, stride_woff=0):  # fmt: skip
    pid = tl.program_id(0)
    n = _pair_rows(pid, HALF, BLOCK_N)
    nmask = n < (HQ + 2 * HK) * (2 * HALF)
    let_dependents_launch(PDL)
    w_first = tl.zeros([BLOCK_N, BLOCK_K], tl.bfloat16)
    if PRELOAD:  # kernels.gemv_preload: weights are never written, so tile 0 may load before the wait
        w_first = weight_tile(w_ptr, stride_wn, n, nmask, tl.arange(0, BLOCK_K), K, EVEN_K)
    wait_for_inputs(PDL)  # x, cos/sin, the write slot, and the cache rows only after the kernel before
    one = tl.full([1], 1.0, tl.float32)
    if M == 1:
        # the plain GEMV's one-row products (X_FORM 0: x as stored; the fused-input pointers go unread)
        acc = split_product(
            x_ptr, w_ptr, 0, stride_wn, n, nmask, 0, x_ptr, x_ptr, x_ptr, x_ptr, one, one, w_first, K, 1, 1,
            BLOCK_N, BLOCK_K, K_TILES, EVEN_K, False, "ieee", 0, PRELOAD,
        )  # fmt: skip
        _store_rotated(acc, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer_id, pid,
                       stride_e, stride_s, stride_ch, HQ, HK, HALF, BLOCK_N)  # fmt: skip
    else:  # kernels.gemv_batch: the plain many-row GEMV's products (x rows K apart)
        acc = split_product(
            x_ptr, w_ptr, K, stride_wn, n, nmask, 0, x_ptr, x_ptr, x_ptr, x_ptr, one, one, w_first, K, M,
            M_PAD, BLOCK_N, BLOCK_K, K_TILES, EVEN_K, DOT, "tf32", 0, 0, X_FIRST,
        )  # fmt: skip
        _store_rotated_rows(acc, q_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, went_ptr, woff_ptr, layer_id, pid,
                            stride_e, stride_s, stride_ch, stride_cos, stride_sin, stride_went, stride_woff,
                            HQ, HK, M, M_PAD, HALF, BLOCK_N)  # fmt: skip


def _config(rows: int, n: int, k: int):
    """The plain GEMV's tile for these rows: the one-row CUDA-core config, or the table's many-row one."""
    return one_row_config(n, k) if rows == 1 else tiles.pick_config(rows, n, k)


def qkv_rope_fusable(x, weight, cos, sin, k_cache, v_cache, heads: tuple[int, int, int],
                     route_rows: int = ROUTE_ROWS) -> bool:  # fmt: skip
    """`qkv_rope_write` runs as one launch: routed bf16 rows (one through the CUDA-core GEMV; up to
    `route_rows` under `kernels.gemv_batch`) whose plain GEMV would not split K for this weight; `weight` is
    `[(Hq + 2 Hk) D, K]`; each program's pairs lie in one head; cos and sin one bf16 row of D per row; k
    and v caches `[E, block, Hk, D]` of one layout with D contiguous."""
    hq, hk, d = heads
    n, k = weight.shape
    rows = x.numel() // max(1, x.shape[-1])
    cfg = _config(rows, n, k)
    return (
        tiles.takes_rows(rows, weight, route_rows)
        and tiles.supported(x, weight, None)
        and k == x.shape[-1]
        and n == (hq + 2 * hk) * d
        and d % 2 == 0
        and cfg is not None
        and cfg.block_n >= 2
        and (d // 2) % (cfg.block_n // 2) == 0
        and split_for(n, k, cfg)[0] == 1
        and cos.dtype == sin.dtype == torch.bfloat16
        and cos.shape[-1] == sin.shape[-1] == d
        and cos.numel() == sin.numel() == rows * d
        and cos.stride(-1) == sin.stride(-1) == 1
        and k_cache.dim() == 4
        and k_cache.shape[2:] == (hk, d)
        and v_cache.shape == k_cache.shape
        and v_cache.stride() == k_cache.stride()
        and k_cache.stride(-1) == 1
    )


def qkv_rope_write(x, weight, cos, sin, k_cache, v_cache, write_entry, write_offset, layer_id: int,
                   heads: tuple[int, int, int]) -> torch.Tensor:  # fmt: skip
    """`q, k, v = gemv(x, weight).split(...)`, then `rope.rope_half_write_kv(q, k, v, cos, sin, k_cache,
    v_cache, write_entry, write_offset, layer_id)`, in one launch (`kernels.gemv_rope_out`): bitwise the two
    launches' rotated q `[R, Hq, D]` (returned) and cache rows. Call only where `qkv_rope_fusable`."""
    hq, hk, d = heads
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()  # rows K apart (the kernel's many-row x stride)
    m = x2.shape[0]
    cfg = _config(m, n, k)
    per_split = triton.cdiv(k, cfg.block_k)
    q = torch.empty((m, hq, d), dtype=x.dtype, device=x.device)
    launch = pdl_args()
    preload = int(m == 1 and launch_mode.weight_preload())  # the one-row CUDA-core path's preload
    cos2, sin2 = cos.reshape(m, d), sin.reshape(m, d)
    rows = {} if m == 1 else dict(
        M=m, M_PAD=16 if cfg.dot else triton.next_power_of_2(m), DOT=cfg.dot, X_FIRST=cfg.dot and cfg.x_first,
        stride_cos=cos2.stride(0), stride_sin=sin2.stride(0), stride_went=write_entry.stride(0),
        stride_woff=write_offset.stride(0),
    )  # fmt: skip
    _qkv_rope_kernel[(n // cfg.block_n,)](
        x2, weight, q, k_cache, v_cache, cos, sin, write_entry, write_offset, layer_id, weight.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), hq, hk, K=k, HALF=d // 2,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_TILES=per_split, EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch, PRELOAD=preload, **EXACT_OPTIONS,
        **rows,
    )  # fmt: skip
    return q


__all__ = ["qkv_rope_fusable", "qkv_rope_write"]
