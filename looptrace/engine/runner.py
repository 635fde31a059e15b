"""ModelRunner: turns a scheduled batch into tensors, runs one stage of the model, keeps carried state.

The runner owns device tensors (KV pool, carried recurrent state, per-traversal metadata, CUDA graphs);
its host metadata (`runner_metadata.HostMetadata`) asks the block manager for addresses and keeps the
written-state guard up to date. Each call of
stage method (`prefill`, `prelude`, `recurrent`, `coda`) is one submission (one engine step). The runner
computes and returns results; it never changes a request's stage or progress (the engine does). Stages:

- PREFILL: one chunk per request, all loops in this step, depth-major (every chunk row does loop 1, then
  loop 2, ...). Huginn/OLMo also run the coda layers on non-final prompt positions to fill coda KV.
- PRELUDE: embed the token being fed back (Huginn/OLMo: prelude layers + a fresh initial state).
- RECURRENT: exactly one loop per row; rows may be at different depths, each reads its own plane.
- CODA: coda layers (Huginn/OLMo) and head, then sampling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from looptrace.engine import kernels as K  # imports no Triton until a kernel runs
from looptrace.engine.config import EngineConfig, GraphConfig
from looptrace.engine.cuda_graphs import GraphCache
from looptrace.engine.hooks import HookDispatcher
from looptrace.engine.kv_cache import BlockManager, KVPool
from looptrace.engine.layers import (
    META_SLOT,
    META_TOKEN,
    AttentionMetadata,
    AttnContext,
    PackedRows,
    TritonAttentionMetadata,
)
from looptrace.engine.models import LoopedModel
from looptrace.engine.plan import EnginePlan, PrefillDepth
from looptrace.engine.request import PrefillSpan, Request
from looptrace.engine.runner_metadata import HostMetadata
from looptrace.engine.runner_parts import (  # PendingRead, Row: re-exported (old import path)
    GateReadback,
    HostStaging,
    PendingRead,
    PlaneCopy,
    Row,
    Sampler,
    StateInit,
)
from looptrace.engine.sampling import record_logprobs
from looptrace.engine.scoring import score_coda_hidden, score_prefill_state


class ModelRunner:
    def __init__(
        self,
        model: LoopedModel,
        cfg: EngineConfig,
        plan: EnginePlan,
        blocks: BlockManager,
        pool: KVPool,
        noise,
        hooks: HookDispatcher,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_slots: int,
        prefill_depth: PrefillDepth,
    ) -> None:
        self.model, self.cfg, self.plan, self.layout = model, cfg, plan, plan.layout
        self.blocks, self.pool = blocks, pool
        self.spec = model.spec
        self.noise, self.hooks = noise, hooks
        self.device, self.dtype, self.max_loops = device, dtype, plan.max_loops
        # LoopDuet P for non-endpoint prompt rows, set by the engine's depth controller before each step.
        self.prefill_depth = prefill_depth
        self.block_size = cfg.kv.block_size
        # On CUDA, decode rows always gather a full-width table so eager steps and graph replays run the
        # same shapes (and give the same bits); on CPU the batch's own width is enough.
        self.fixed_width = math.ceil(max_model_len / self.block_size) if device.type == "cuda" else None
        self._init_slots(max_slots)
        self.host_meta = HostMetadata(blocks, self.block_size)  # rows -> host metadata, written-state guard
        # The Triton attention path needs no mask and no gather list (TritonAttentionMetadata).
        self.metadata = (TritonAttentionMetadata if plan.triton_attention else AttentionMetadata)(
            self.block_size
        )
        self.ops = nn.ModuleDict(
            dict(
                metadata=self.metadata,
                sampler=Sampler(),
                gate_readback=GateReadback(),
                state_init=StateInit(noise),
                kv_copy=PlaneCopy(pool),
            )
        )
        self.staging = HostStaging(device)
        self.submissions = 0
        # Copies of the plan's flags, not re-derived: a test may flip them to try a path on CPU.
        self.triton_attention = plan.triton_attention
        self._no_blocks = torch.zeros((0, 2), dtype=torch.int64, device=device)  # per-row prefill attention
        self.async_decode = plan.async_decode  # whole-token rows may take their input from token_buf
        graphs = self._graph_caches(plan.graphs, cfg.cuda_graphs)
        self.recurrent_graphs: GraphCache | None = graphs.get("recurrent")
        self.fused_graphs: GraphCache | None = graphs.get("recurrent_fused")
        self.coda_graphs: GraphCache | None = graphs.get("coda")
        self.token_graphs: GraphCache | None = graphs.get("whole_token")
        self.prefill_graphs: GraphCache | None = graphs.get("prefill")
        self.last_graph_mode: str | None = None
        self.last_fallback: str | None = None

    def _init_slots(self, max_slots: int) -> None:
        """Carried recurrent state (and injection) per slot; one slot per request that may be active."""
        h, dtype, device = self.spec.hidden_size, self.dtype, self.device
        self.state_pool = torch.zeros(max_slots, h, dtype=dtype, device=device)
        self.inject_pool = (
            torch.zeros(max_slots, h, dtype=dtype, device=device) if self.spec.has_injection else None
        )
        self.free_slots = list(reversed(range(max_slots)))
        self._prev_state: torch.Tensor | None = None
        # scheduler.async_decode: each slot's last sampled token, written on the device by a whole-token
        # step and read by the next one when the host does not know the token yet.
        self.token_buf = torch.zeros(max_slots, dtype=torch.int64, device=device)

    def _graph_caches(self, families: frozenset[str], cfg: GraphConfig) -> dict[str, GraphCache]:
        """One cache per family the plan captures, all in one memory pool (none off CUDA)."""
        if not families:
            return {}
        bodies = {
            "recurrent": self._core_pass,
            "recurrent_fused": self._fused_pass,
            "coda": self._coda_pass,
            "prefill": self._prefill_pass,
            "whole_token": self._token_pass,
        }
        mempool = torch.cuda.graph_pool_handle()
        return {
            name: GraphCache(name, body, cfg, mempool) for name, body in bodies.items() if name in families
        }

    def graph_caches(self) -> list[tuple[str, GraphCache]]:
        """(family name, cache) of every family captured here, in `LLMEngine.graph_counters` order."""
        named = (
            ("recurrent", self.recurrent_graphs),
            ("recurrent_fused", self.fused_graphs),
            ("coda", self.coda_graphs),
            ("whole_token", self.token_graphs),
            ("prefill", self.prefill_graphs),
        )
        return [(name, cache) for name, cache in named if cache is not None]

    # Carried-state slots ----------------------------------------------------------------------------------
    def take_slot(self) -> int:
        """A free carried-state row; there is one per admissible request (scheduler.max_num_seqs)."""
        return self.free_slots.pop()

    def release_slot(self, slot: int) -> None:
        self.free_slots.append(slot)

    # Metadata -------------------------------------------------------------------------------------------
    def _index(self, values: list[int]) -> torch.Tensor:
        """A small int64 index on the device, staged through pinned memory (no blocking copy)."""
        return self.staging.to_device(np.asarray(values, dtype=np.int64))

    def _decode_width(self, rows: list[Row]) -> int:
        return self.fixed_width or self.host_meta.width(rows)

    # Traversals (also the bodies captured into CUDA graphs) ------------------------------------------------
    def _core_pass(self, raw: torch.Tensor, state: torch.Tensor, inject: torch.Tensor | None = None):
        """One loop for every row: metadata, core layers (Ouro: + loop norm + gate)."""
        ctx = self.metadata(raw, self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)
        state, gate = self.model.core(state, inject, ctx)
        return (state, gate) if gate is not None else (state,)

    def _coda_pass(self, raw: torch.Tensor, state: torch.Tensor):
        ctx = None
        if self.model.has_coda_layers:
            ctx = self.metadata(raw, self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)
        return (self.model.head(self.model.coda_hidden(state, ctx)),)

    def _maybe_graph(self, cache: GraphCache | None, rows: int, fn, inputs):
        if cache is None:
            self.last_graph_mode, self.last_fallback = None, None
            return fn(*inputs)
        out = cache.run(rows, inputs)
        self.last_graph_mode, self.last_fallback = cache.last_mode, cache.last_reason
        return out

    @contextmanager
    def _fused_range(self, stage: str) -> Iterator[None]:
        """Loops fused into one submission show range observers (the profiler's) one loop range, -1; the
        graph stays on (observers of hidden states get the loops one by one instead)."""
        if self.hooks.active:
            self.hooks.loop_begin(stage, -1)
        yield
        if self.hooks.active:
            self.hooks.loop_end(stage, -1)

    def _plane_contexts(
        self, raw: torch.Tensor, planes: list[int], blocks: torch.Tensor | None = None
    ) -> dict[int, AttnContext]:
        """Attention metadata of one traversal for each plane of `raw` [planes, R, ...]: built once for the
        first plane, then only each plane's addresses (the rows, their mask, rotary tables and packed
        query blocks are shared)."""
        base = self.metadata(raw[0], self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)
        base.blocks = blocks
        return {p: base if i == 0 else self.metadata.for_plane(raw[i], base) for i, p in enumerate(planes)}

    def _emit_hidden(self, stage: str, loop: int, rows: list[Row], state: torch.Tensor) -> None:
        ids = [r.request.request_id for r in rows]
        self.hooks.loop_hidden(stage, loop, ids, [r.pos for r in rows], state.detach().float().cpu())

    # Stages ---------------------------------------------------------------------------------------------
    def prefill(self, spans: list[PrefillSpan]) -> None:
        """One chunk per request, all loops, depth-major. Under a layout that overwrites one plane per
        loop (`shared`) the chunk runs one position per request at a time, so each row reads earlier
        positions at their final loop and the result does not depend on the chunk size (base engine)."""
        self.submissions += 1
        self._endpoints = {(sp.request.request_id, sp.start + sp.length - 1) for sp in spans}  # keep S
        if not getattr(self.layout, "prefill_position_by_position", False):
            self._prefill_rows(spans)
            return
        for k in range(max(s.length for s in spans)):
            self._prefill_rows([PrefillSpan(s.request, s.start + k, 1) for s in spans if k < s.length])

    def _prefill_rows(self, spans: list[PrefillSpan]) -> None:
        rows = [
            Row(s.request, p, s.request.prompt[p]) for s in spans for p in range(s.start, s.start + s.length)
        ]
        boundary = self.layout.plane("prelude", 0)
        core_planes = [self.layout.plane("core", t) for t in range(self.max_loops)]
        planes = sorted({boundary, *core_planes})
        if self._prefill_graphable():
            self._prefill_graphed(spans, rows, boundary, core_planes, planes)
            return
        raw = self.staging.to_device(
            self.host_meta.raw(rows, [[p] * len(rows) for p in planes], self.host_meta.width(rows))
        )
        raw_of = {p: raw[i] for i, p in enumerate(planes)}
        ctx0 = self.metadata(
            raw_of[boundary], self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache
        )
        if self.plan.packed_prefill and self.triton_attention:
            ctx0.blocks = self._packed_blocks(spans, len(rows))
        elif self.plan.packed_prefill:
            ctx0.packed = self._packed_rows(spans)
        ctx_of = {p: ctx0 if p == boundary else self.metadata.for_plane(raw_of[p], ctx0) for p in planes}
        tokens = raw_of[boundary][:, META_TOKEN]

        if self.spec.n_prelude:
            self.host_meta.check(rows, boundary, "prelude")
        embedded, inject = self.model.prelude(tokens, ctx0)
        if self.spec.n_prelude:
            self.host_meta.mark(rows, boundary, "prelude")
        state = self.model.first_state(embedded)
        if state is None:
            state = self.ops.state_init(embedded, [(s.request, s.start, s.length) for s in spans])

        p_loops = self.prefill_depth.loops  # LoopDuet split depth (S, P); None: uniform S
        full = [  # chunk endpoints, and the rows of prompts scored teacher-forced (full depth)
            i
            for i, r in enumerate(rows)
            if (r.request.request_id, r.pos) in self._endpoints
            or r.request.params.prompt_logprobs is not None
        ]
        if p_loops is None or p_loops >= self.max_loops or len(full) == len(rows):
            state = self._core_loops(rows, state, inject, [ctx_of[p] for p in core_planes], core_planes)
        else:
            state = self._split_loops(rows, full, state, inject, raw_of, ctx_of, core_planes, p_loops)

        last_rows = self._last_rows(spans)
        score_prefill_state(self.model, rows, state)  # rows whose request asks for prompt logprobs
        if self.model.has_coda_layers:
            self._fill_coda(rows, state, last_rows, boundary)
        self._hand_off(rows, last_rows, state, inject)

    # Prefill as a CUDA graph (cuda_graphs.prefill) ---------------------------------------------------------
    def _prefill_graphable(self) -> bool:
        """Whether this chunk can replay a prefill graph: uniform depth, one traversal per loop, no observer
        of hidden states, and no packed torch-path attention, whose block shape changes per chunk (the
        Triton path's packed blocks have a fixed count per row count)."""
        return (
            self.prefill_graphs is not None
            and (self.prefill_depth.loops is None or self.prefill_depth.loops >= self.max_loops)
            and not self.hooks.wants_hidden
            and (self.triton_attention or not self.plan.packed_prefill)
        )

    def _prefill_graphed(self, spans, rows, boundary: int, core_planes: list[int], planes: list[int]) -> None:
        """The eager chunk's work (`_prefill_rows`) with the prelude and the loops in one graph replay; the
        initial-state draw (request generators), the coda fill and the state hand-off stay eager."""
        raw = self.staging.to_device(
            self.host_meta.raw(rows, [[p] * len(rows) for p in planes], self._decode_width(rows))
        )
        if self.spec.n_prelude:
            self.host_meta.check(rows, boundary, "prelude")
        for plane in core_planes:  # history before each request's first row: the same for every loop
            self.host_meta.check(rows, plane, "core")
        packed = self.plan.packed_prefill  # only on the Triton path here (`_prefill_graphable`)
        blocks = self._packed_blocks(spans, len(rows)) if packed else self._no_blocks
        inputs: tuple = (raw, blocks)
        if self.spec.has_injection:
            inputs += (self.ops.state_init(self.state_pool, [(s.request, s.start, s.length) for s in spans]),)
        with self._fused_range("prefill"):
            out = self._maybe_graph(self.prefill_graphs, len(rows), self._prefill_pass, inputs)
        state, inject = out[0], (out[1] if len(out) > 1 else None)
        if self.spec.n_prelude:
            self.host_meta.mark(rows, boundary, "prelude")
        for plane in core_planes:
            self.host_meta.mark(rows, plane, "core")
        last_rows = self._last_rows(spans)
        score_prefill_state(self.model, rows, state)  # rows whose request asks for prompt logprobs
        if self.model.has_coda_layers:
            self._fill_coda(rows, state, last_rows, boundary)
        self._hand_off(rows, last_rows, state, inject)

    def _prefill_pass(self, raw: torch.Tensor, blocks: torch.Tensor, init_state: torch.Tensor | None = None):
        """raw [planes (sorted), R, ...]: prelude on the boundary plane, then loop t on plane t for every
        row (depth-major), as `_prefill_rows` runs them eagerly; blocks: packed prefill's query blocks
        (none: per-row attention). Returns (state, injection)."""
        boundary = self.layout.plane("prelude", 0)
        planes = sorted({boundary, *(self.layout.plane("core", t) for t in range(self.max_loops))})
        ctx_of = self._plane_contexts(raw, planes, blocks if blocks.shape[0] else None)
        tokens = raw[planes.index(boundary)][:, META_TOKEN]
        embedded, inject = self.model.prelude(tokens, ctx_of[boundary])
        state = self.model.first_state(embedded)
        if state is None:
            state = init_state
        for t in range(self.max_loops):
            state, _ = self.model.core(state, inject, ctx_of[self.layout.plane("core", t)])
        return (state, inject) if inject is not None else (state,)

    def _hand_off(self, rows, last_rows: dict[str, int], state: torch.Tensor, inject) -> None:
        """The final prompt rows' state (and injection) into their carried-state slots for the CODA step."""
        if last_rows:
            idx = self._index(list(last_rows.values()))
            slots = self._index([rows[i].request.state_slot for i in last_rows.values()])
            self.state_pool.index_copy_(0, slots, state.index_select(0, idx))
            if inject is not None:
                self.inject_pool.index_copy_(0, slots, inject.index_select(0, idx))

    def _core_loops(
        self,
        rows: list[Row],
        state: torch.Tensor,
        inject: torch.Tensor | None,
        ctxs: list,
        planes: list[int],
        loops: range | None = None,
    ) -> torch.Tensor:
        """Every loop on these rows, depth-major: all rows do loop 1, then loop 2, ... (loop t on plane t)."""
        for t in loops if loops is not None else range(self.max_loops):
            self.host_meta.check(rows, planes[t], "core")
            if self.hooks.active:
                self.hooks.loop_begin("prefill", t)
            state, _ = self.model.core(state, inject, ctxs[t])
            self.host_meta.mark(rows, planes[t], "core")
            if self.hooks.active:
                if self.hooks.wants_hidden:
                    self._emit_hidden("prefill", t, rows, state)
                self.hooks.loop_end("prefill", t)
        return state

    def _split_loops(self, rows, full, state, inject, raw_of, ctx_of, core_planes, p_loops) -> torch.Tensor:
        """LoopDuet (S, P): P loops on every row; then the chunk endpoints `full` (row indices) gathered into
        a compact batch (their own attention metadata, the same KV planes) run loops P..S-1 and are scattered
        back; the other rows keep their loop-P state (and the plane keeps their loop-P K/V)."""
        state = self._core_loops(
            rows, state, inject, [ctx_of[p] for p in core_planes], core_planes, loops=range(p_loops)
        )
        if not full:
            return state
        idx = self._index(full)
        sub_ctx: dict[int, object] = {}
        for plane in core_planes[p_loops:]:
            if plane not in sub_ctx:
                raw = raw_of[plane].index_select(0, idx)
                sub_ctx[plane] = self.metadata(
                    raw, self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache
                )
        sub = self._core_loops(
            [rows[i] for i in full],
            state.index_select(0, idx),
            inject.index_select(0, idx) if inject is not None else None,
            [sub_ctx.get(p) for p in core_planes],
            core_planes,
            loops=range(p_loops, self.max_loops),
        )
        return state.index_copy(0, idx, sub)

    def _packed_blocks(self, spans: list[PrefillSpan], rows: int) -> torch.Tensor:
        """Packed prefill on the Triton path: each span's rows cut into query blocks, padded to a count
        that depends only on the row count (a prefill graph keyed by rows fits any split into spans)."""
        count = K.packed_block_count(rows, self.cfg.scheduler.max_num_seqs)
        return self.staging.to_device(K.packed_blocks([s.length for s in spans], count))

    def _packed_rows(self, spans: list[PrefillSpan]) -> PackedRows:
        """Packed prefill: one query block per span (its rows are consecutive), padded to the longest."""
        n_max = max(s.length for s in spans)
        slot_rows = np.full(len(spans) * n_max, -1, dtype=np.int64)
        row_slots, table_rows, offset = [], [], 0
        for i, s in enumerate(spans):
            slot_rows[i * n_max : i * n_max + s.length] = np.arange(offset, offset + s.length)
            row_slots.extend(range(i * n_max, i * n_max + s.length))
            table_rows.append(offset + s.length - 1)
            offset += s.length
        staged = self.staging.to_device(np.concatenate([slot_rows, table_rows, row_slots]))
        a, b = len(slot_rows), len(slot_rows) + len(spans)
        return PackedRows(staged[:a], staged[a:b], staged[b:], n_max)

    @staticmethod
    def _last_rows(spans: list[PrefillSpan]) -> dict[str, int]:
        """Row index of each final prompt position in this batch (its hidden state feeds CODA)."""
        out, offset = {}, 0
        for s in spans:
            if s.is_last_chunk:
                out[s.request.request_id] = offset + s.length - 1
            offset += s.length
        return out

    def _fill_coda(self, rows: list[Row], state: torch.Tensor, last_rows: dict[str, int], plane: int) -> None:
        """Huginn/OLMo: coda layers on non-final prompt positions fill coda KV (no head, no logits)."""
        keep = [i for i in range(len(rows)) if i not in set(last_rows.values())]
        if not keep:
            return
        sub = [rows[i] for i in keep]
        self.host_meta.check(sub, plane, "coda")
        raw = self.staging.to_device(
            self.host_meta.raw(sub, [[plane] * len(sub)], self.host_meta.width(sub))
        )[0]
        ctx = self.metadata(raw, self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)
        part = state if len(keep) == len(rows) else state.index_select(0, self._index(keep))
        score_coda_hidden(self.model, sub, self.model.coda_hidden(part, ctx))
        self.host_meta.mark(sub, plane, "coda")

    def prelude(self, requests: list[Request]) -> None:
        self.submissions += 1
        rows = [Row(r, r.decode_position, r.outputs[-1]) for r in requests]
        plane = self.layout.plane("prelude", 0)
        width = self._decode_width(rows)
        raw_np = (
            self.host_meta.raw(rows, [[plane] * len(rows)], width)
            if self.spec.n_prelude
            else self.host_meta.raw_no_kv(rows)
        )
        raw = self.staging.to_device(raw_np)[0]
        ctx = None
        if self.spec.n_prelude:
            self.host_meta.check(rows, plane, "prelude")
            ctx = self.metadata(raw, self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)
        embedded, inject = self.model.prelude(raw[:, META_TOKEN], ctx)
        if self.spec.n_prelude:
            self.host_meta.mark(rows, plane, "prelude")
        state = self.model.first_state(embedded)
        if state is None:
            state = self.ops.state_init(embedded, [(r, r.decode_position, 1) for r in requests])
        slots = raw[:, META_SLOT]
        self.state_pool.index_copy_(0, slots, state)
        if inject is not None:
            self.inject_pool.index_copy_(0, slots, inject)

    def recurrent(
        self, requests: list[Request], need_gate: bool, defer: bool = False
    ) -> list[float] | PendingRead | None:
        """One loop for every row at its own depth; returns gate logits when the exit policy needs them.
        `defer` (async gate readback): the logits come back as a PendingRead, and each row's state before
        this loop is kept so a late exit decision can restore it (`rollback`)."""
        self.submissions += 1
        rows = [Row(r, r.decode_position) for r in requests]
        planes = [self.layout.plane("core", r.loops_done) for r in requests]
        for row, plane in zip(rows, planes):
            self.host_meta.check([row], plane, "core")
        raw = self.staging.to_device(self.host_meta.raw(rows, [planes], self._decode_width(rows)))[0]
        slots = raw[:, META_SLOT]
        inputs = (raw, self.state_pool.index_select(0, slots))
        if self.inject_pool is not None:
            inputs += (self.inject_pool.index_select(0, slots),)
        loops = sorted({r.loops_done for r in requests})
        loop_tag = loops[0] if len(loops) == 1 else -1  # -1: rows at different depths share this loop
        if self.hooks.active:
            self.hooks.loop_begin("recurrent", loop_tag)
        out = self._maybe_graph(self.recurrent_graphs, len(rows), self._core_pass, inputs)
        if defer:
            self.prev_state.index_copy_(0, slots, inputs[1])
        self.state_pool.index_copy_(0, slots, out[0])
        for row, plane in zip(rows, planes):
            self.host_meta.mark([row], plane, "core")
        if self.hooks.active:
            if self.hooks.wants_hidden:
                for t in loops:
                    sel = [i for i, r in enumerate(requests) if r.loops_done == t]
                    self._emit_hidden(
                        "recurrent", t, [rows[i] for i in sel], out[0].index_select(0, self._index(sel))
                    )
            self.hooks.loop_end("recurrent", loop_tag)
        return self.ops.gate_readback(out[1], defer) if need_gate and len(out) > 1 else None

    @property
    def prev_state(self) -> torch.Tensor:
        """Each slot's state before its last deferred-gate loop (allocated on first use)."""
        if self._prev_state is None:
            self._prev_state = torch.zeros_like(self.state_pool)
        return self._prev_state

    def rollback(self, requests: list[Request]) -> None:
        """Async gate readback: these rows ran one loop past their exit; restore the exit loop's state."""
        slots = self._index([r.state_slot for r in requests])
        self.state_pool.index_copy_(0, slots, self.prev_state.index_select(0, slots))

    def recurrent_fused(self, requests: list[Request]) -> None:
        """Loop fusion (ExactLoop): every row is a fresh token at depth 0 that cannot exit early; run all
        `max_loops` loops in one submission (one CUDA graph for the L loops). Per-row arithmetic is that of
        L single-loop steps; only the batch each loop runs in may differ (R1)."""
        self.submissions += 1
        loops = self.max_loops
        rows = [Row(r, r.decode_position) for r in requests]
        plane_sets = [[self.layout.plane("core", t)] * len(rows) for t in range(loops)]
        for planes in plane_sets:
            self.host_meta.check(rows, planes[0], "core")
        raw = self.staging.to_device(self.host_meta.raw(rows, plane_sets, self._decode_width(rows)))
        slots = raw[0][:, META_SLOT]
        inputs = (raw, self.state_pool.index_select(0, slots))
        if self.inject_pool is not None:
            inputs += (self.inject_pool.index_select(0, slots),)
        if self.hooks.wants_hidden:  # observers read every loop's state: run the loops one by one, eagerly
            state = inputs[1]
            for t in range(loops):
                self.hooks.loop_begin("recurrent", t)
                (state,) = self._fused_pass(raw[t : t + 1], state, *inputs[2:])
                if self.hooks.wants_hidden:
                    self._emit_hidden("recurrent", t, rows, state)
                self.hooks.loop_end("recurrent", t)
            self.last_graph_mode, self.last_fallback = None, None
            out = (state,)
        else:
            with self._fused_range("recurrent"):
                out = self._maybe_graph(self.fused_graphs, len(rows), self._fused_pass, inputs)
        self.state_pool.index_copy_(0, slots, out[0])
        for t in range(loops):
            self.host_meta.mark(rows, plane_sets[t][0], "core")

    def _fused_pass(self, raw: torch.Tensor, state: torch.Tensor, inject: torch.Tensor | None = None):
        """raw [loops, R, ...]: loop t reads and writes plane t."""
        for t in range(raw.shape[0]):
            ctx = self.metadata(raw[t], self.model.rope, self.dtype, self.pool.k_cache, self.pool.v_cache)
            state, _ = self.model.core(state, inject, ctx)
        return (state,)

    # Whole-token decode (scheduler.whole_token) ----------------------------------------------------------
    def whole_token(self, requests: list[Request], defer: bool = False) -> list[int] | PendingRead:
        """Prelude, every loop, coda, head and sampling for fresh decode rows in one submission (one CUDA
        graph per row count, greedy sampling inside it). The per-row arithmetic is that of the prelude,
        fused-recurrent and coda steps. Batches over `whole_token_max_rows`, or with an observer of
        hidden states, run those three phases one after another in this step instead.

        `defer` (scheduler.async_decode): the tokens come back as a PendingRead, read after the next
        submission; a row whose token the host does not know yet (-1) takes it from `token_buf`."""
        if len(requests) > self.plan.whole_token_max_rows or self.hooks.wants_hidden:
            self.prelude(requests)
            self.recurrent_fused(requests)
            return self.coda(requests)
        self.submissions += 1
        rows = [Row(r, r.decode_position, r.outputs[-1]) for r in requests]
        planes = self._token_planes()
        raw = self.staging.to_device(
            self.host_meta.raw(rows, [[p] * len(rows) for p in planes], self._decode_width(rows))
        )
        for role, plane in self._token_roles():
            self.host_meta.check(rows, plane, role)
        inputs: tuple = (raw,)
        if self.spec.has_injection:  # Huginn/OLMo: the noise draw stays eager (request generators), in order
            inputs += (self.ops.state_init(self.state_pool, [(r, r.decode_position, 1) for r in requests]),)
        with self._fused_range("recurrent"):
            tokens, logits = self._maybe_graph(self.token_graphs, len(rows), self._token_pass, inputs)
        for role, plane in self._token_roles():
            self.host_meta.mark(rows, plane, role)
        if self.hooks.active and self.hooks.wants_logits:
            self.hooks.logits([r.request_id for r in requests], logits)
        if any(r.params.needs_sampler for r in requests):  # the graph's argmax serves plain greedy rows
            tokens = self.ops.sampler(logits, requests)
            if self.async_decode:
                self.token_buf.index_copy_(0, raw[0][:, META_SLOT], tokens)
        record_logprobs(logits, tokens, requests)
        return PendingRead.start(tokens) if defer else self._to_host(tokens)

    def _token_planes(self) -> list[int]:
        """The distinct KV planes one whole-token pass touches (prelude/coda plane, then the core planes)."""
        out = [self.layout.plane("prelude", 0), self.layout.plane("coda", 0)]
        out += [self.layout.plane("core", t) for t in range(self.max_loops)]
        return sorted(set(out), key=out.index)

    def _token_roles(self) -> list[tuple[str, int]]:
        roles = [("core", self.layout.plane("core", t)) for t in range(self.max_loops)]
        if self.spec.n_prelude:
            roles.insert(0, ("prelude", self.layout.plane("prelude", 0)))
        if self.model.has_coda_layers:
            roles.append(("coda", self.layout.plane("coda", 0)))
        return roles

    def _token_pass(self, raw: torch.Tensor, init_state: torch.Tensor | None = None):
        """raw [planes, R, ...] in `_token_planes` order. Returns (greedy tokens, logits)."""
        ctx_of = self._plane_contexts(raw, self._token_planes())

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

    def finalize_exits(self, requests: list[Request]) -> None:
        """Early exit at depth e < max_loops: copy the exit plane's slot into planes e..max-1 (planes and
        packed layouts; the shared layout already holds version e) and mark them written. The exit plane
        must hold the position in every core layer (base rule), else `KVHistoryError`."""
        copies, marks = [], []
        for r in requests:
            e = r.loops_done
            exit_plane = self.layout.plane("core", e - 1)
            deeper = sorted({self.layout.plane("core", d) for d in range(e, self.max_loops)} - {exit_plane})
            pos = r.decode_position
            self.blocks.check_written(r.request_id, exit_plane, "core", pos)
            src = self.blocks.slot(r.request_id, exit_plane, pos)
            for p in deeper:
                copies.append((*src, *self.blocks.slot(r.request_id, p, pos)))
                marks.append((r.request_id, p, pos))
        if copies:
            self.ops.kv_copy(self._index([c for row in copies for c in row]).view(-1, 4))
        for rid, plane, pos in marks:
            self.blocks.mark_written(rid, plane, "core", pos, pos + 1)

    def coda(self, requests: list[Request]) -> list[int]:
        """Coda (+ head) and sampling for every row; returns the sampled token ids on the host."""
        self.submissions += 1
        rows = [Row(r, r.decode_position) for r in requests]
        plane = self.layout.plane("coda", 0)
        has_kv = self.model.has_coda_layers
        if has_kv:
            self.host_meta.check(rows, plane, "coda")
        raw_np = (
            self.host_meta.raw(rows, [[plane] * len(rows)], self._decode_width(rows))
            if has_kv
            else self.host_meta.raw_no_kv(rows)
        )
        raw = self.staging.to_device(raw_np)[0]
        state = self.state_pool.index_select(0, raw[:, META_SLOT])
        (logits,) = self._maybe_graph(self.coda_graphs, len(rows), self._coda_pass, (raw, state))
        if has_kv:
            self.host_meta.mark(rows, plane, "coda")
        if self.hooks.active and self.hooks.wants_logits:
            self.hooks.logits([r.request_id for r in requests], logits)
        tokens = self.ops.sampler(logits, requests)
        record_logprobs(logits, tokens, requests)
        return self._to_host(tokens)

    def _to_host(self, tokens: torch.Tensor) -> list[int]:
        if self.device.type != "cuda":
            return tokens.tolist()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the step's one blocking read: the sampled tokens
        return host.tolist()
