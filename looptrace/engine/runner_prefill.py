"""The runner's prefill paths: one chunk per request, all loops, depth-major, run eagerly (uniform depth or
LoopDuet split depth (S, P), per-row or packed attention) or as one prefill graph replay; then the coda
fill (Huginn/OLMo) and the hand-off of each final prompt row's state to its carried-state slot.

`PrefillPaths` works on its runner's device state (staging, host metadata, KV pool, carried-state pools,
graph caches), read through the runner at call time: the engine sets the runner's prefill depth before
each step, and a test may swap the runner's prefill graph cache or flip its attention path."""

from __future__ import annotations

import numpy as np
import torch

from looptrace.engine import kernels as K  # imports no Triton until a kernel runs
from looptrace.engine.layers import META_TOKEN, PackedRows
from looptrace.engine.request import PrefillSpan
from looptrace.engine.runner_graphs import one_loop_range
from looptrace.engine.runner_parts import Row
from looptrace.engine.scoring import score_coda_hidden, score_prefill_state


class PrefillPaths:
    """The PREFILL stage of a `ModelRunner` (runner.py), which owns the state it reads and writes."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.no_blocks = torch.zeros((0, 2), dtype=torch.int64, device=runner.device)  # per-row attention
        self.endpoints: set[tuple[str, int]] = set()  # (request id, position) of each chunk's last row

    def run(self, spans: list[PrefillSpan]) -> None:
        """One chunk per request, all loops, depth-major. Under a layout that overwrites one plane per
        loop (`shared`) the chunk runs one position per request at a time, so each row reads earlier
        positions at their final loop and the result does not depend on the chunk size (base engine)."""
        self.endpoints = {(sp.request.request_id, sp.start + sp.length - 1) for sp in spans}  # keep S
        if not getattr(self.runner.layout, "prefill_position_by_position", False):
            self._rows(spans)
            return
        for k in range(max(s.length for s in spans)):
            self._rows([PrefillSpan(s.request, s.start + k, 1) for s in spans if k < s.length])

    def _rows(self, spans: list[PrefillSpan]) -> None:
        r = self.runner
        rows = [
            Row(s.request, p, s.request.prompt[p]) for s in spans for p in range(s.start, s.start + s.length)
        ]
        boundary = r.layout.plane("prelude", 0)
        core_planes = [r.layout.plane("core", t) for t in range(r.max_loops)]
        planes = sorted({boundary, *core_planes})
        if self.graphable():
            self._graphed(spans, rows, boundary, core_planes, planes)
            return
        raw = r.staging.to_device(
            r.host_meta.raw(rows, [[p] * len(rows) for p in planes], r.host_meta.width(rows))
        )
        raw_of = {p: raw[i] for i, p in enumerate(planes)}
        ctx0 = r.passes.context(raw_of[boundary])
        if r.plan.packed_prefill and r.triton_attention:
            ctx0.blocks = self.packed_blocks(spans, len(rows))
        elif r.plan.packed_prefill:
            ctx0.packed = self._packed_rows(spans)
        ctx_of = {p: ctx0 if p == boundary else r.metadata.for_plane(raw_of[p], ctx0) for p in planes}
        tokens = raw_of[boundary][:, META_TOKEN]

        if r.spec.n_prelude:
            r.host_meta.check(rows, boundary, "prelude")
        embedded, inject = r.model.prelude(tokens, ctx0)
        if r.spec.n_prelude:
            r.host_meta.mark(rows, boundary, "prelude")
        state = r.model.first_state(embedded)
        if state is None:
            state = r.ops.state_init(embedded, [(s.request, s.start, s.length) for s in spans])

        p_loops = r.prefill_depth.loops  # LoopDuet split depth (S, P); None: uniform S
        full = [  # chunk endpoints, and the rows of prompts scored teacher-forced (full depth)
            i
            for i, row in enumerate(rows)
            if (row.request.request_id, row.pos) in self.endpoints
            or row.request.params.prompt_logprobs is not None
        ]
        if p_loops is None or p_loops >= r.max_loops or len(full) == len(rows):
            state = self._core_loops(rows, state, inject, [ctx_of[p] for p in core_planes], core_planes)
        else:
            state = self._split_loops(rows, full, state, inject, raw_of, ctx_of, core_planes, p_loops)

        last_rows = self._last_rows(spans)
        score_prefill_state(r.model, rows, state)  # rows whose request asks for prompt logprobs
        if r.model.has_coda_layers:
            self._fill_coda(rows, state, last_rows, boundary)
        self._hand_off(rows, last_rows, state, inject)

    # Prefill as a CUDA graph (cuda_graphs.prefill) ---------------------------------------------------------
    def graphable(self) -> bool:
        """Whether this chunk can replay a prefill graph: uniform depth, one traversal per loop, no observer
        of hidden states, and no packed torch-path attention, whose block shape changes per chunk (the
        Triton path's packed blocks have a fixed count per row count)."""
        r = self.runner
        return (
            r.prefill_graphs is not None
            and (r.prefill_depth.loops is None or r.prefill_depth.loops >= r.max_loops)
            and not r.hooks.wants_hidden
            and (r.triton_attention or not r.plan.packed_prefill)
        )

    def _graphed(self, spans, rows, boundary: int, core_planes: list[int], planes: list[int]) -> None:
        """The eager chunk's work (`_rows`) with the prelude and the loops in one graph replay; the
        initial-state draw (request generators), the coda fill and the state hand-off stay eager."""
        r = self.runner
        raw = r.staging.to_device(
            r.host_meta.raw(rows, [[p] * len(rows) for p in planes], r.decode_width(rows))
        )
        if r.spec.n_prelude:
            r.host_meta.check(rows, boundary, "prelude")
        for plane in core_planes:  # history before each request's first row: the same for every loop
            r.host_meta.check(rows, plane, "core")
        packed = r.plan.packed_prefill  # only on the Triton path here (`graphable`)
        blocks = self.packed_blocks(spans, len(rows)) if packed else self.no_blocks
        inputs: tuple = (raw, blocks)
        if r.spec.has_injection:
            inputs += (r.ops.state_init(r.state_pool, [(s.request, s.start, s.length) for s in spans]),)
        with one_loop_range(r.hooks, "prefill"):
            out = r.graph_runs.run(r.prefill_graphs, len(rows), r.passes.prefill_pass, inputs)
        state, inject = out[0], (out[1] if len(out) > 1 else None)
        if r.spec.n_prelude:
            r.host_meta.mark(rows, boundary, "prelude")
        for plane in core_planes:
            r.host_meta.mark(rows, plane, "core")
        last_rows = self._last_rows(spans)
        score_prefill_state(r.model, rows, state)  # rows whose request asks for prompt logprobs
        if r.model.has_coda_layers:
            self._fill_coda(rows, state, last_rows, boundary)
        self._hand_off(rows, last_rows, state, inject)

    def _hand_off(self, rows, last_rows: dict[str, int], state: torch.Tensor, inject) -> None:
        """The final prompt rows' state (and injection) into their carried-state slots for the CODA step."""
        r = self.runner
        if last_rows:
            idx = r.index(list(last_rows.values()))
            slots = r.index([rows[i].request.state_slot for i in last_rows.values()])
            r.state_pool.index_copy_(0, slots, state.index_select(0, idx))
            if inject is not None:
                r.inject_pool.index_copy_(0, slots, inject.index_select(0, idx))

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
        r = self.runner
        for t in loops if loops is not None else range(r.max_loops):
            r.host_meta.check(rows, planes[t], "core")
            if r.hooks.active:
                r.hooks.loop_begin("prefill", t)
            state, _ = r.model.core(state, inject, ctxs[t])
            r.host_meta.mark(rows, planes[t], "core")
            if r.hooks.active:
                if r.hooks.wants_hidden:
                    r.emit_hidden("prefill", t, rows, state)
                r.hooks.loop_end("prefill", t)
        return state

    def _split_loops(self, rows, full, state, inject, raw_of, ctx_of, core_planes, p_loops) -> torch.Tensor:
        """LoopDuet (S, P): P loops on every row; then the chunk endpoints `full` (row indices) gathered into
        a compact batch (their own attention metadata, the same KV planes) run loops P..S-1 and are scattered
        back; the other rows keep their loop-P state (and the plane keeps their loop-P K/V)."""
        r = self.runner
        state = self._core_loops(
            rows, state, inject, [ctx_of[p] for p in core_planes], core_planes, loops=range(p_loops)
        )
        if not full:
            return state
        idx = r.index(full)
        sub_ctx: dict[int, object] = {}
        for plane in core_planes[p_loops:]:
            if plane not in sub_ctx:
                sub_ctx[plane] = r.passes.context(raw_of[plane].index_select(0, idx))
        sub = self._core_loops(
            [rows[i] for i in full],
            state.index_select(0, idx),
            inject.index_select(0, idx) if inject is not None else None,
            [sub_ctx.get(p) for p in core_planes],
            core_planes,
            loops=range(p_loops, r.max_loops),
        )
        return state.index_copy(0, idx, sub)

    def packed_blocks(self, spans: list[PrefillSpan], rows: int) -> torch.Tensor:
        """Packed prefill on the Triton path: each span's rows cut into query blocks, padded to a count
        that depends only on the row count (a prefill graph keyed by rows fits any split into spans)."""
        count = K.packed_block_count(rows, self.runner.cfg.scheduler.max_num_seqs)
        return self.runner.staging.to_device(K.packed_blocks([s.length for s in spans], count))

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
        staged = self.runner.staging.to_device(np.concatenate([slot_rows, table_rows, row_slots]))
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
        r = self.runner
        keep = [i for i in range(len(rows)) if i not in set(last_rows.values())]
        if not keep:
            return
        sub = [rows[i] for i in keep]
        r.host_meta.check(sub, plane, "coda")
        raw = r.staging.to_device(r.host_meta.raw(sub, [[plane] * len(sub)], r.host_meta.width(sub)))[0]
        ctx = r.passes.context(raw)
        part = state if len(keep) == len(rows) else state.index_select(0, r.index(keep))
        score_coda_hidden(r.model, sub, r.model.coda_hidden(part, ctx))
        r.host_meta.mark(sub, plane, "coda")
