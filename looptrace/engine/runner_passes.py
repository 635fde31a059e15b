"""The runner's traversals: the device work of one stage on staged metadata, with no host work, so that
each is also the body a CUDA graph captures (runner_graphs.py). Inputs are tensors only: `raw` holds the
per-row metadata of one or more KV planes ([planes, R, ...] where a pass touches several)."""

from __future__ import annotations

import torch

from looptrace.engine.kv_cache import KVPool
from looptrace.engine.layers import META_SLOT, META_TOKEN, AttentionMetadata, AttnContext
from looptrace.engine.models import LoopedModel


class Traversals:
    """The five traversal bodies (core loop, fused loops, coda, whole token, prefill) over one model."""

    def __init__(
        self,
        model: LoopedModel,
        metadata: AttentionMetadata,
        pool: KVPool,
        layout,
        *,
        dtype: torch.dtype,
        max_loops: int,
        async_decode: bool,
        token_buf: torch.Tensor,
    ) -> None:
        self.model, self.metadata, self.pool, self.layout = model, metadata, pool, layout
        self.spec = model.spec
        self.dtype, self.max_loops = dtype, max_loops
        # scheduler.async_decode: a whole-token row whose input token the host does not know yet (-1)
        # reads the slot's last sampled token from `token_buf`, which the pass then overwrites.
        self.async_decode, self.token_buf = async_decode, token_buf

    def context(self, raw: torch.Tensor) -> AttnContext:
        """Attention metadata of one plane's rows."""
        return self.metadata(raw, self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)

    def plane_contexts(
        self, raw: torch.Tensor, planes: list[int], blocks: torch.Tensor | None = None
    ) -> dict[int, AttnContext]:
        """Attention metadata of one traversal for each plane of `raw` [planes, R, ...]: built once for the
        first plane, then only each plane's addresses (the rows, their mask, rotary tables and packed
        query blocks are shared)."""
        base = self.context(raw[0])
        base.blocks = blocks
        return {p: base if i == 0 else self.metadata.for_plane(raw[i], base) for i, p in enumerate(planes)}

    def core_pass(self, raw: torch.Tensor, state: torch.Tensor, inject: torch.Tensor | None = None):
        """One loop for every row: metadata, core layers (Ouro: + loop norm + gate)."""
        ctx = self.context(raw)
        state, gate = self.model.core(state, inject, ctx)
        return (state, gate) if gate is not None else (state,)

    def coda_pass(self, raw: torch.Tensor, state: torch.Tensor):
        ctx = None
        if self.model.has_coda_layers:
            ctx = self.context(raw)
        return (self.model.head(self.model.coda_hidden(state, ctx)),)

    def fused_pass(self, raw: torch.Tensor, state: torch.Tensor, inject: torch.Tensor | None = None):
        """raw [loops, R, ...]: loop t reads and writes plane t."""
        for t in range(raw.shape[0]):
            ctx = self.context(raw[t])
            state, _ = self.model.core(state, inject, ctx)
        return (state,)

    def token_planes(self) -> list[int]:
        """The distinct KV planes one whole-token pass touches (prelude/coda plane, then the core planes)."""
        out = [self.layout.plane("prelude", 0), self.layout.plane("coda", 0)]
        out += [self.layout.plane("core", t) for t in range(self.max_loops)]
        return sorted(set(out), key=out.index)

    def token_roles(self) -> list[tuple[str, int]]:
        """(role, plane) of each KV write of one whole-token pass, in the order the pass writes them."""
        roles = [("core", self.layout.plane("core", t)) for t in range(self.max_loops)]
        if self.spec.n_prelude:
            roles.insert(0, ("prelude", self.layout.plane("prelude", 0)))
        if self.model.has_coda_layers:
            roles.append(("coda", self.layout.plane("coda", 0)))
        return roles

    def token_pass(self, raw: torch.Tensor, init_state: torch.Tensor | None = None):
        """raw [planes, R, ...] in `token_planes` order. Returns (greedy tokens, logits)."""
        ctx_of = self.plane_contexts(raw, self.token_planes())

        def ctx(role: str, t: int = 0):
            return ctx_of[self.layout.plane(role, t)]

        tokens_in, slots = raw[0][:, META_TOKEN], raw[0][:, META_SLOT]
        if self.async_decode:  # a token still on its way to the host: the previous step's, on the device
            tokens_in = torch.where(tokens_in >= 0, tokens_in, self.token_buf.index_select(0, slots))
        embedded, inject = self.model.prelude(tokens_in, ctx("prelude") if self.spec.n_prelude else None)
        state = self.model.first_state(embedded)
        if state is None:
            state = init_state
        for t in range(self.max_loops):
            state, _ = self.model.core(state, inject, ctx("core", t))
        coda_ctx = ctx("coda") if self.model.has_coda_layers else None
        logits = self.model.head(self.model.coda_hidden(state, coda_ctx))
        tokens = logits.argmax(dim=-1)
        if self.async_decode:
            self.token_buf.index_copy_(0, slots, tokens)
        return tokens, logits

    def prefill_pass(self, raw: torch.Tensor, blocks: torch.Tensor, init_state: torch.Tensor | None = None):
        """raw [planes (sorted), R, ...]: prelude on the boundary plane, then loop t on plane t for every
        row (depth-major), as the eager prefill chunk runs them; blocks: packed prefill's query blocks
        (none: per-row attention). Returns (state, injection)."""
        boundary = self.layout.plane("prelude", 0)
        planes = sorted({boundary, *(self.layout.plane("core", t) for t in range(self.max_loops))})
        ctx_of = self.plane_contexts(raw, planes, blocks if blocks.shape[0] else None)
        tokens = raw[planes.index(boundary)][:, META_TOKEN]
        embedded, inject = self.model.prelude(tokens, ctx_of[boundary])
        state = self.model.first_state(embedded)
        if state is None:
            state = init_state
        for t in range(self.max_loops):
            state, _ = self.model.core(state, inject, ctx_of[self.layout.plane("core", t)])
        return (state, inject) if inject is not None else (state,)
