"""A dense (no paged KV) training forward over the engine's own model modules.

The engine's attention modules end in a `paged` submodule (`PagedAttention`, no parameters) that writes
K/V into the paged pool and attends over a block table. For training we swap that submodule for a dense
causal attention over `[batch, seq]`; every parameter stays where the engine reads it, so the trained
`state_dict` is the engine's and `save_checkpoint` / `load_checkpoint` round-trip it unchanged.

Dense attention at loop t attends to the keys of loop t of earlier positions, exactly what the engine's
`planes` KV layout serves (one plane per depth), so greedy outputs agree up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from looptrace.engine.layers import PagedAttention
from looptrace.engine.models import LoopedModel


@dataclass
class DenseContext:
    """Stands in for AttnContext: the dense attention only needs the batch shape and the RoPE tables."""

    batch: int
    seq: int
    cos: torch.Tensor
    sin: torch.Tensor


class DenseCausalAttention(nn.Module):
    op_kind = "dense_attention"

    def __init__(self, paged: PagedAttention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = paged.num_heads, paged.num_kv_heads, paged.head_dim
        self.scale = paged.scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DenseContext) -> torch.Tensor:
        b, t = ctx.batch, ctx.seq
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        gqa = {"enable_gqa": True} if self.num_heads != self.num_kv_heads else {}
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, **gqa)
        return out.transpose(1, 2).reshape(b * t, self.num_heads * self.head_dim)


def make_dense(model: LoopedModel) -> LoopedModel:
    """Swap every `paged` attention submodule for the dense one (in place; no parameter changes)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name == "paged" and isinstance(child, PagedAttention):
                module.paged = DenseCausalAttention(child)
    return model


def context(model: LoopedModel, tokens: torch.Tensor) -> DenseContext:
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).repeat(b)
    cos, sin = model.rope.tables(positions, next(model.parameters()).dtype)
    return DenseContext(b, t, cos, sin)


def initial_state(model: LoopedModel, embedded: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """The engine's initial state: Ouro reads the embedding; Huginn/OLMo a trunc-normal draw (noise.py)."""
    first = model.first_state(embedded)
    if first is not None:
        return first
    spec = model.spec
    std = spec.state_init_std
    x = torch.empty_like(embedded)
    with torch.no_grad():
        nn.init.trunc_normal_(x, 0.0, std, -3 * std, 3 * std, generator=gen)
    return x * spec.embed_scale


def forward_loops(
    model: LoopedModel,
    tokens: torch.Tensor,
    loops: int,
    *,
    grad_loops: int | None = None,
    every_loop: bool = False,
    gen: torch.Generator | None = None,
    logits_from: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits `[batch, seq, vocab]` after the last loop (or after every loop with `every_loop`), plus the
    exit-gate logits per loop (Ouro). `grad_loops`: backprop only through the last k loops (truncated
    BPTT, as Huginn-0125 was trained); earlier loops run without a graph. `logits_from`: the head runs
    only on positions >= this (the coda layers still see every position)."""
    b, t = tokens.shape
    ctx = context(model, tokens)
    embedded, inject = model.prelude(tokens.reshape(-1), ctx)
    state = initial_state(model, embedded, gen)
    first_grad = 0 if grad_loops is None else max(0, loops - grad_loops)
    logits, gates = [], []

    def out(s: torch.Tensor) -> torch.Tensor:
        hidden = model.coda_hidden(s, ctx).view(b, t, -1)[:, logits_from:]
        return model.head(hidden)

    for i in range(loops):
        if i < first_grad:
            with torch.no_grad():
                state, gate = model.core(state, inject, ctx)
        else:
            state, gate = model.core(state, inject, ctx)
        if gate is not None:
            gates.append(gate.view(b, t))
        if every_loop or i == loops - 1:
            logits.append(out(state))
    return logits, gates
