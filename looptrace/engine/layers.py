"""Building blocks shared by the model families: norms, rotary embeddings, paged attention, small linears.

Every op is a module with an `op_kind` so probes can attach PyTorch module hooks (NVTX / record_function
ranges) without the engine knowing about them. The math is written the way the public reference code
writes it (eager PyTorch), because the kernel count and rounding of that code is what we measure.

Kernel variants (`ExactRMSNorm`, `TritonPagedAttention`, `GemvLinear`, ...) are subclasses that
`engine/assemble.py` swaps in where the engine plan turns a kernel on; the base forwards hold no kernel
switches. A variant's only branch is its own fallback (e.g. the exact kernels' row-count scope).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from looptrace.engine import kernels as K  # imports no Triton; a kernel's caller imports its module


def exact_kernels_on(rows: int) -> bool:
    """ExactLoop's scope for the exact kernels: inside CUDA-graph capture, or eager calls over 256 rows
    (below that an eager Triton launch costs more host time than the eager kernels it replaces)."""
    return K.use_exact(rows, K.is_capturing())


class RMSNorm(nn.Module):
    """HF/raven RMSNorm: fp32 `x * rsqrt(mean(x^2) + eps)`, cast back, times weight (8 eager kernels)."""

    op_kind = "norm"

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


class ExactRMSNorm(RMSNorm):
    """`kernels.exact`: the fenced Triton kernel where it pays (see exact_kernels_on), the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if exact_kernels_on(x.numel() // x.shape[-1]):
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels import rmsnorm  # imports Triton: only where a kernel runs

            return rmsnorm.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class ResidualRMSNorm(nn.Module):
    """`h = residual + post(y); return h, nxt(h)`: a sandwich block's post-norm, residual add and the next
    pre-norm as one exact kernel (`kernels.residual_norm`). Holds no weights: it reads the two RMSNorm
    modules it is given, so checkpoint names do not change. Its own module so probes see a range around
    the fused launch (op_kind `residual_norm`: an op of its own, apart from the four `norm` ops)."""

    op_kind = "residual_norm"

    def forward(self, y, residual, post: RMSNorm, nxt: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import rmsnorm  # imports Triton: only where a kernel runs

        return rmsnorm.residual_rms_norm(y, post.weight, post.eps, residual, nxt.weight, nxt.eps)


@dataclass
class PendingNorm:
    """A sandwich block's `h = residual + post(y); x = nxt(h)` not launched yet (`kernels.gemv_norm`): the
    one-row projection that reads x computes it itself (`project`), bit for bit, and records the new
    residual stream in `h`. Any other consumer calls `materialize` (the `ResidualRMSNorm` launch)."""

    y: torch.Tensor
    residual: torch.Tensor
    post: RMSNorm
    nxt: RMSNorm
    launch: ResidualRMSNorm
    h: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        self.h, x = self.launch(self.y, self.residual, self.post, self.nxt)
        return x


def materialized(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    return x.materialize() if isinstance(x, PendingNorm) else x


@dataclass
class ResidualTail:
    """What follows a sandwich block's output projection y = proj(a) in the fused chain
    (`kernels.residual_norm`): h' = residual + post(y), x' = nxt(h'). `after(y)` runs it on a projected y;
    `finish(proj, a)` (`kernels.gemv_norm_out`: the block hands its output projection to the tail) runs
    the projection too. Both return (h', x'):
    - `in_gemv` (one routed row): the norm runs inside the projection's GEMV launch
      (`gemv.forms.linear_residual_norm`), bit for bit;
    - `defer` (`kernels.gemv_norm`, one row): the norm is left to the next projection (h' None, x' a
      PendingNorm);
    - else the `ResidualRMSNorm` launch.
    The residual stream is h, or, where the block's input x was a PendingNorm, the h its consumer recorded
    (read when the tail runs, after the block has read x)."""

    launch: ResidualRMSNorm
    h: torch.Tensor | None
    x: torch.Tensor | PendingNorm
    post: RMSNorm
    nxt: RMSNorm
    defer: bool = False
    in_gemv: bool = False

    @property
    def residual(self) -> torch.Tensor:
        return self.x.h if isinstance(self.x, PendingNorm) else self.h

    def finish(self, proj: nn.Linear, a: torch.Tensor):
        """(h', x') of y = proj(a)."""
        residual, w_post, w_next = self.residual, self.post.weight, self.nxt.weight
        if self.in_gemv:
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

            if gemv_forms.linear_norm_fusable(a, proj.weight, residual, w_post, w_next):
                return gemv_forms.linear_residual_norm(
                    a, proj.weight, w_post, self.post.eps, residual, w_next, self.nxt.eps
                )
        return self.after(proj(a))

    def after(self, y: torch.Tensor):
        """(h', x') of a y already projected."""
        if self.defer:
            return None, PendingNorm(y, self.residual, self.post, self.nxt, self.launch)
        return self.launch(y, self.residual, self.post, self.nxt)


def finish(proj: nn.Linear, a: torch.Tensor, tail: ResidualTail | None):
    """`proj(a)`, or with a tail the tail's (h', x') (see ResidualTail)."""
    return proj(a) if tail is None else tail.finish(proj, a)


def project(x: torch.Tensor | PendingNorm, weight: torch.Tensor, linear) -> torch.Tensor:
    """`linear(x, weight)`; for a PendingNorm, one GEMV launch that also computes the norm where the fused
    form applies (one routed row: `gemv.forms.residual_norm_fusable`), else the norm's own launch first."""
    if not isinstance(x, PendingNorm):
        return linear(x, weight)
    # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
    from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

    if gemv_forms.residual_norm_fusable(x.y, x.residual, x.post.weight, x.nxt.weight, weight):
        out, x.h = gemv_forms.residual_norm_linear(
            x.y, x.post.weight, x.post.eps, x.residual, x.nxt.weight, x.nxt.eps, weight
        )
        return out
    return linear(x.materialize(), weight)


class GemvLinear(nn.Linear):
    """`kernels.gemv`: a bias-free projection through the Triton GEMV for inputs of at most a few rows
    (`gemv.forms.linear` routes; above that, or off CUDA, it is `F.linear`). The weight is read at call
    time, so fused or tied weights stay what they are. Swapped onto every bias-free nn.Linear (LMHead and
    Adapter included, which keep their op_kind)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

        return gemv_forms.linear(x, self.weight, self.bias)


class GemvBatchLinear(GemvLinear):
    """`kernels.gemv_batch`: `GemvLinear` that routes every decode batch the GEMV takes (up to
    `tiles.MAX_ROWS` rows), not only one row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels.gemv import forms as gemv_forms  # imports Triton

        return gemv_forms.linear(x, self.weight, self.bias, route_rows=gemv_forms.route_rows(batch=True))


class Embedding(nn.Embedding):
    op_kind = "embed"


class LMHead(nn.Linear):
    op_kind = "head"


class Adapter(nn.Linear):
    """Huginn/OLMo re-injection: Linear over cat([state, embedding])."""

    op_kind = "adapter"


class ExitGate(nn.Linear):
    """Ouro's early-exit gate: Linear(hidden -> 1, bias)."""

    op_kind = "gate"


class RotaryHalf(nn.Module):
    """Rotate-half RoPE (Ouro, OLMo): dims i and i + d/2 pair; cos/sin in fp32, cast to model dtype."""

    op_kind = "rope"

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per forward: cos/sin [rows, head_dim], shared by every layer and loop."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, q, k, cos, sin):  # q: [R, H, D], cos/sin: [R, D]
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k


class ExactRotaryHalf(RotaryHalf):
    """`kernels.exact`: rotate-half RoPE of q and k as one fenced Triton kernel where it pays."""

    def forward(self, q, k, cos, sin):
        if exact_kernels_on(q.shape[0]):
            # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
            from looptrace.engine.kernels import rope  # imports Triton: only where a kernel runs

            return rope.rope_half(q, k, cos, sin)
        return super().forward(q, k, cos, sin)


class RotaryInterleaved(nn.Module):
    """Huginn RoPE: interleaved pairs (2i, 2i+1), rotated in fp32 and cast back once."""

    op_kind = "rope"

    def __init__(self, head_dim: int, theta: float, max_position: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        # The persistent `freqs_cis` buffer of the checkpoint, stored as (cos, sin) pairs; recomputed here.
        self.register_buffer("freqs_cis", torch.stack([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.freqs_cis[positions]  # [R, D/2, 2] fp32
        return rows[..., 0], rows[..., 1]

    def forward(self, q, k, cos, sin):  # q: [R, H, D]; cos/sin: [R, D/2] fp32
        heads_q = q.shape[1]
        qk = torch.cat([q, k], dim=1).unflatten(-1, (-1, 2)).float()
        c, s = cos[:, None, :], sin[:, None, :]
        x0, x1 = qk[..., 0], qk[..., 1]
        rotated = torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)
        rotated = rotated.type_as(q)
        return rotated[:, :heads_q], rotated[:, heads_q:]


@dataclass
class AttnContext:
    """Per-traversal attention metadata on the device, derived once and reused by every layer.

    Addressing is by *entry* (kv_cache.py): the pool `[num_blocks, num_layers, block_size, kv_heads,
    head_dim]` is seen as `[num_blocks * num_layers, block_size, ...]`; slot s of block b is entry
    `b * num_layers + s`. The metadata carries per-row *entry bases* (the layout's unit stride and plane
    offset already applied); layer l reads and writes entry `base + l`. Each row writes its K/V at
    (write_entry + l, write_offset) and reads the pages of its own plane's table.
    """

    k_cache: torch.Tensor  # entry view [num_blocks * num_layers, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    write_entry: torch.Tensor  # [R] int64 entry base of the page holding the row's position
    write_offset: torch.Tensor  # [R] int64
    tables: torch.Tensor  # [R, nb] int64 entry bases, -1 padded (the Triton kernel reads only real pages)
    ctx_lens: torch.Tensor  # [R] int64 keys each row attends to (= position + 1)
    cos: torch.Tensor
    sin: torch.Tensor
    table_width: int  # nb
    block_size: int
    packed: PackedRows | None = None  # packed prefill: rows grouped into one query block per request
    blocks: torch.Tensor | None = None  # packed prefill, Triton path: [B, 2] query blocks (first row, rows)
    _gather: torch.Tensor | None = None
    _mask: torch.Tensor | None = None
    _mask_from: AttnContext | None = None  # another plane's context of the same rows (shares its mask)

    # The torch path's gather list and mask, built on first use and shared by every layer of the traversal
    # (the Triton path needs neither, so its traversals do not pay for them).
    @property
    def gather_entries(self) -> torch.Tensor:
        """[R * nb] entry bases, -1 padding clamped to 0 (masked out)."""
        if self._gather is None:
            self._gather = self.tables.clamp_min(0).reshape(-1)
        return self._gather

    @property
    def mask(self) -> torch.Tensor:
        """[R, 1, 1, nb * block_size] bool: key position < context length."""
        if self._mask is None and self._mask_from is not None:
            self._mask = self._mask_from.mask
        if self._mask is None:
            rows = self.tables.shape[0]
            key_pos = torch.arange(self.table_width * self.block_size, device=self.tables.device)
            self._mask = (key_pos[None, :] < self.ctx_lens[:, None]).view(rows, 1, 1, -1)
        return self._mask


@dataclass
class PackedRows:
    """Packed (variable-length) prefill: the rows of one request's chunk form one causal query block that
    reads its request's pages once, instead of one query row per token with its own gathered table.
    `slot_rows[s * n_max + i]` is the batch row of query i of sequence s (-1: padding); `table_rows[s]` the
    row whose table (the sequence's last position) all its queries read; `row_slots[r]` where row r sits in
    the packed block. Same function as per-row attention, another reduction shape (R3)."""

    slot_rows: torch.Tensor  # [S * n_max] int64
    table_rows: torch.Tensor  # [S] int64
    row_slots: torch.Tensor  # [R] int64
    n_max: int


# Column layout of the raw per-row metadata tensor (one host->device copy per traversal): carried-state
# slot, position, context length (= pos + 1), write entry base and offset, token id, then the row's page
# table as entry bases (-1 padded).
META_SLOT, META_POS, META_CTX, META_WBLOCK, META_WOFF, META_TOKEN = range(6)
META_WENTRY = META_WBLOCK
META_FIXED = 6


def entry_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, num_layers, bs, kvh, D] -> [num_blocks * num_layers, bs, kvh, D] (a view)."""
    return cache if cache.dim() == 4 else cache.flatten(0, 1)


class AttentionMetadata(nn.Module):
    """Derives the device metadata of one traversal from the raw int64 rows (runs inside CUDA graphs)."""

    op_kind = "metadata"

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size

    def forward(
        self, raw: torch.Tensor, rope: nn.Module, dtype: torch.dtype, k_cache, v_cache
    ) -> AttnContext:
        width = raw.shape[1] - META_FIXED
        cos, sin = rope.tables(raw[:, META_POS], dtype)
        ctx = AttnContext(
            k_cache=entry_view(k_cache),
            v_cache=entry_view(v_cache),
            write_entry=raw[:, META_WENTRY],
            write_offset=raw[:, META_WOFF],
            tables=raw[:, META_FIXED:],
            ctx_lens=raw[:, META_CTX],
            cos=cos,
            sin=sin,
            table_width=width,
            block_size=self.block_size,
        )
        self.prebuild(ctx)
        return ctx

    def prebuild(self, ctx: AttnContext) -> None:
        """The torch attention path's gather list and length mask, built once per traversal here, inside
        the metadata op (the properties cache them)."""
        ctx.gather_entries  # noqa: B018
        ctx.mask  # noqa: B018

    @staticmethod
    def for_plane(raw: torch.Tensor, base: AttnContext) -> AttnContext:
        """Same rows, another plane: only the write address and the page tables change (the mask and
        the rotary tables depend on the positions alone and are shared)."""
        ctx = AttnContext(
            k_cache=base.k_cache,
            v_cache=base.v_cache,
            write_entry=raw[:, META_WENTRY],
            write_offset=raw[:, META_WOFF],
            tables=raw[:, META_FIXED:],
            ctx_lens=base.ctx_lens,
            cos=base.cos,
            sin=base.sin,
            table_width=base.table_width,
            block_size=base.block_size,
            packed=base.packed,
            blocks=base.blocks,
            _mask_from=base,
        )
        if base._mask is not None:  # the torch path (AttentionMetadata.prebuild): gather list now
            ctx.gather_entries  # noqa: B018
        return ctx


class TritonAttentionMetadata(AttentionMetadata):
    """The metadata of the Triton attention path (`kernels.attention=triton`), which needs no gather list
    and no mask: its traversals do not pay for them."""

    def prebuild(self, ctx: AttnContext) -> None:
        pass


class PagedAttention(nn.Module):
    """Write this layer's K/V for every row, then attend over the row's own block table: index_put the
    K/V, gather the pages, SDPA with a length mask (or one causal block per request under packed prefill).
    The Triton path is the `TritonPagedAttention` variant."""

    op_kind = "paged_attention"

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id  # physical layer: index into the pool's layer dimension
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        rows = q.shape[0]
        # Entry view shifted by this layer: row e is entry e + layer_id (no per-layer index arithmetic).
        k_layer = ctx.k_cache[self.layer_id :]
        v_layer = ctx.v_cache[self.layer_id :]
        k_layer.index_put_((ctx.write_entry, ctx.write_offset), k)
        v_layer.index_put_((ctx.write_entry, ctx.write_offset), v)
        keys = k_layer.index_select(0, ctx.gather_entries).view(rows, -1, self.num_kv_heads, self.head_dim)
        vals = v_layer.index_select(0, ctx.gather_entries).view(rows, -1, self.num_kv_heads, self.head_dim)
        gqa = {"enable_gqa": True} if self.num_heads != self.num_kv_heads else {}
        if ctx.packed is not None:
            return self._packed(q, k_layer, v_layer, ctx, gqa)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys.transpose(1, 2),
            vals.transpose(1, 2),
            attn_mask=ctx.mask,
            scale=self.scale,
            **gqa,
        )
        return out.reshape(rows, self.num_heads * self.head_dim)

    def _packed(self, q, k_layer, v_layer, ctx: AttnContext, gqa: dict) -> torch.Tensor:
        pk, rows = ctx.packed, q.shape[0]
        seqs = pk.table_rows.shape[0]
        entries = ctx.gather_entries.view(rows, -1).index_select(0, pk.table_rows).reshape(-1)
        keys = k_layer.index_select(0, entries).view(seqs, -1, self.num_kv_heads, self.head_dim)
        vals = v_layer.index_select(0, entries).view(seqs, -1, self.num_kv_heads, self.head_dim)
        take = pk.slot_rows.clamp_min(0)
        qp = q.index_select(0, take).view(seqs, pk.n_max, self.num_heads, self.head_dim)
        mask = ctx.mask.view(rows, -1).index_select(0, take).view(seqs, 1, pk.n_max, -1)
        mask = mask | (pk.slot_rows < 0).view(seqs, 1, pk.n_max, 1)  # padding rows: any finite result
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            keys.transpose(1, 2),
            vals.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            **gqa,
        )  # [S, H, n_max, D]
        out = out.transpose(1, 2).reshape(seqs * pk.n_max, self.num_heads * self.head_dim)
        return out.index_select(0, pk.row_slots)


class TritonPagedAttention(PagedAttention):
    """`kernels.attention=triton`: one K/V write kernel and one paged-attention kernel, one query row per
    token for prefill rows too, or under packed prefill one program per block of a request's consecutive
    prompt rows (`kernels/packed_attention.py`)."""

    key_slots = False  # the paged kernel's per-key-slot form (`KeySlotPagedAttention`)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        # write every row's K/V first: a prompt row attends to the rows before it
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import paged_attention  # imports Triton: only where a kernel runs

        paged_attention.write_kv(
            k, v, ctx.k_cache, ctx.v_cache, ctx.write_entry, ctx.write_offset, self.layer_id
        )
        return self.attend_written(q, ctx)

    def attend_written(self, q: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """After this layer's K/V of every row are in the cache (by `write_kv`, or by a kernel that fused
        the write, `kernels.rope_kv_write`)."""
        # deferred: Triton kernels (CUDA only): importing the engine imports no Triton
        from looptrace.engine.kernels import (  # imports Triton: only where a kernel runs
            packed_attention,
            paged_attention,
        )

        if ctx.blocks is not None:  # packed prefill (per traversal, not a setting)
            return packed_attention.packed_attention(
                q, ctx.k_cache, ctx.v_cache, ctx.tables, ctx.ctx_lens, ctx.blocks, self.layer_id, self.scale
            )
        return paged_attention.paged_attention(
            q,
            ctx.k_cache,
            ctx.v_cache,
            ctx.tables,
            ctx.ctx_lens,
            self.layer_id,
            self.scale,
            key_slots=self.key_slots,
        )


class KeySlotPagedAttention(TritonPagedAttention):
    """`kernels.attn_slots`: the Triton paged kernel keeps its online-softmax state per key slot."""

    key_slots = True
