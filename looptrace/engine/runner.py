"""ModelRunner: turns a scheduled batch into tensors, runs one stage of the model, keeps carried state.

The runner holds the stage entry points (`prefill`, `prelude`, `recurrent`, `recurrent_fused`,
`whole_token`, `coda`, `finalize_exits`, `rollback`) and the device state they share (KV pool, carried
recurrent state per slot, CUDA graph caches). Each stage call is one submission (one engine step). The runner
computes and returns results; it never changes a request's stage or progress (the engine does). Roles:

host metadata and the written-state guard (runner_metadata.py), PREFILL's paths (runner_prefill.py), the
traversals CUDA graphs capture (runner_passes.py), the graph caches (runner_graphs.py), leaf ops
(runner_parts.py). PRELUDE embeds the token fed back (Huginn/OLMo: prelude layers + a fresh initial state);
RECURRENT runs one loop per row, each at its own depth and plane; CODA runs coda layers, head, sampling.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from looptrace.engine.config import EngineConfig
from looptrace.engine.cuda_graphs import GraphCache
from looptrace.engine.hooks import HookDispatcher
from looptrace.engine.kv_cache import BlockManager, KVPool
from looptrace.engine.layers import META_SLOT, META_TOKEN, AttentionMetadata, TritonAttentionMetadata
from looptrace.engine.models import LoopedModel
from looptrace.engine.plan import EnginePlan, PrefillDepth
from looptrace.engine.request import PrefillSpan, Request
from looptrace.engine.runner_graphs import GraphRuns, build_graph_caches, one_loop_range
from looptrace.engine.runner_metadata import HostMetadata
from looptrace.engine.runner_parts import (  # PendingRead, Row: re-exported (old import path)
    GateReadback,
    HostStaging,
    PendingRead,
    PlaneCopy,
    Row,
    Sampler,
    StateInit,
    tokens_to_host,
)
from looptrace.engine.runner_passes import Traversals
from looptrace.engine.runner_prefill import PrefillPaths
from looptrace.engine.sampling import record_logprobs


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
        self.async_decode = plan.async_decode  # whole-token rows may take their input from token_buf
        self.passes = Traversals(
            model,
            self.metadata,
            pool,
            self.layout,
            dtype=dtype,
            max_loops=self.max_loops,
            async_decode=self.async_decode,
            token_buf=self.token_buf,
        )
        self.prefill_paths = PrefillPaths(self)
        # The caches stay attributes of the runner: a test may swap one for a stand-in.
        graphs = build_graph_caches(self.passes, plan.graphs, cfg.cuda_graphs)
        self.recurrent_graphs: GraphCache | None = graphs.get("recurrent")
        self.fused_graphs: GraphCache | None = graphs.get("recurrent_fused")
        self.coda_graphs: GraphCache | None = graphs.get("coda")
        self.token_graphs: GraphCache | None = graphs.get("whole_token")
        self.prefill_graphs: GraphCache | None = graphs.get("prefill")
        self.graph_runs = GraphRuns()  # how the last traversal ran (graph mode, fallback), for the trace

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

    # Carried-state slots ----------------------------------------------------------------------------------
    def take_slot(self) -> int:
        """A free carried-state row; there is one per admissible request (scheduler.max_num_seqs)."""
        return self.free_slots.pop()

    def release_slot(self, slot: int) -> None:
        self.free_slots.append(slot)

    # Metadata -------------------------------------------------------------------------------------------
    def index(self, values: list[int]) -> torch.Tensor:
        """A small int64 index on the device, staged through pinned memory (no blocking copy)."""
        return self.staging.to_device(np.asarray(values, dtype=np.int64))

    def decode_width(self, rows: list[Row]) -> int:
        return self.fixed_width or self.host_meta.width(rows)

    def emit_hidden(self, stage: str, loop: int, rows: list[Row], state: torch.Tensor) -> None:
        ids = [r.request.request_id for r in rows]
        self.hooks.loop_hidden(stage, loop, ids, [r.pos for r in rows], state.detach().float().cpu())

    # Stages ---------------------------------------------------------------------------------------------
    def prefill(self, spans: list[PrefillSpan]) -> None:
        """One chunk per request, all loops, depth-major (runner_prefill.py)."""
        self.submissions += 1
        self.prefill_paths.run(spans)

    def prelude(self, requests: list[Request]) -> None:
        self.submissions += 1
        rows = [Row(r, r.decode_position, r.outputs[-1]) for r in requests]
        plane = self.layout.plane("prelude", 0)
        width = self.decode_width(rows)
        raw_np = (
            self.host_meta.raw(rows, [[plane] * len(rows)], width)
            if self.spec.n_prelude
            else self.host_meta.raw_no_kv(rows)
        )
        raw = self.staging.to_device(raw_np)[0]
        ctx = None
        if self.spec.n_prelude:
            self.host_meta.check(rows, plane, "prelude")
            ctx = self.passes.context(raw)
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
        loops = sorted({r.loops_done for r in requests})
        loop_tag = loops[0] if len(loops) == 1 else -1  # -1: rows at different depths share this loop
        # The loop's range holds all this step does for the loop: its state gather and metadata before
        # the pass, its state write and gate readback after (what the loop costs, as a trace shows it).
        if self.hooks.active:
            self.hooks.loop_begin("recurrent", loop_tag)
        rows = [Row(r, r.decode_position) for r in requests]
        planes = [self.layout.plane("core", r.loops_done) for r in requests]
        for row, plane in zip(rows, planes):
            self.host_meta.check([row], plane, "core")
        raw = self.staging.to_device(self.host_meta.raw(rows, [planes], self.decode_width(rows)))[0]
        slots = raw[:, META_SLOT]
        inputs = (raw, self.state_pool.index_select(0, slots))
        if self.inject_pool is not None:
            inputs += (self.inject_pool.index_select(0, slots),)
        out = self.graph_runs.run(self.recurrent_graphs, len(rows), self.passes.core_pass, inputs)
        if defer:
            self.prev_state.index_copy_(0, slots, inputs[1])
        self.state_pool.index_copy_(0, slots, out[0])
        for row, plane in zip(rows, planes):
            self.host_meta.mark([row], plane, "core")
        if self.hooks.active and self.hooks.wants_hidden:
            for t in loops:
                sel = [i for i, r in enumerate(requests) if r.loops_done == t]
                self.emit_hidden(
                    "recurrent", t, [rows[i] for i in sel], out[0].index_select(0, self.index(sel))
                )
        gate = self.ops.gate_readback(out[1], defer) if need_gate and len(out) > 1 else None
        if self.hooks.active:
            self.hooks.loop_end("recurrent", loop_tag)
        return gate

    @property
    def prev_state(self) -> torch.Tensor:
        """Each slot's state before its last deferred-gate loop (allocated on first use)."""
        if self._prev_state is None:
            self._prev_state = torch.zeros_like(self.state_pool)
        return self._prev_state

    def rollback(self, requests: list[Request]) -> None:
        """Async gate readback: these rows ran one loop past their exit; restore the exit loop's state."""
        slots = self.index([r.state_slot for r in requests])
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
        raw = self.staging.to_device(self.host_meta.raw(rows, plane_sets, self.decode_width(rows)))
        slots = raw[0][:, META_SLOT]
        inputs = (raw, self.state_pool.index_select(0, slots))
        if self.inject_pool is not None:
            inputs += (self.inject_pool.index_select(0, slots),)
        if self.hooks.wants_hidden:  # observers read every loop's state: run the loops one by one, eagerly
            state = inputs[1]
            for t in range(loops):
                self.hooks.loop_begin("recurrent", t)
                (state,) = self.passes.fused_pass(raw[t : t + 1], state, *inputs[2:])
                if self.hooks.wants_hidden:
                    self.emit_hidden("recurrent", t, rows, state)
                self.hooks.loop_end("recurrent", t)
            self.graph_runs.ran_eagerly()
            out = (state,)
        else:
            with one_loop_range(self.hooks, "recurrent"):
                out = self.graph_runs.run(self.fused_graphs, len(rows), self.passes.fused_pass, inputs)
        self.state_pool.index_copy_(0, slots, out[0])
        for t in range(loops):
            self.host_meta.mark(rows, plane_sets[t][0], "core")

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
        planes = self.passes.token_planes()
        raw = self.staging.to_device(
            self.host_meta.raw(rows, [[p] * len(rows) for p in planes], self.decode_width(rows))
        )
        for role, plane in self.passes.token_roles():
            self.host_meta.check(rows, plane, role)
        inputs: tuple = (raw,)
        if self.spec.has_injection:  # Huginn/OLMo: the noise draw stays eager (request generators), in order
            inputs += (self.ops.state_init(self.state_pool, [(r, r.decode_position, 1) for r in requests]),)
        with one_loop_range(self.hooks, "recurrent"):
            tokens, logits = self.graph_runs.run(self.token_graphs, len(rows), self.passes.token_pass, inputs)
        for role, plane in self.passes.token_roles():
            self.host_meta.mark(rows, plane, role)
        if self.hooks.active and self.hooks.wants_logits:
            self.hooks.logits([r.request_id for r in requests], logits)
        if any(r.params.needs_sampler for r in requests):  # the graph's argmax serves plain greedy rows
            tokens = self.ops.sampler(logits, requests)
            if self.async_decode:
                self.token_buf.index_copy_(0, raw[0][:, META_SLOT], tokens)
        record_logprobs(logits, tokens, requests)
        return PendingRead.start(tokens) if defer else tokens_to_host(tokens)

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
            self.ops.kv_copy(self.index([c for row in copies for c in row]).view(-1, 4))
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
            self.host_meta.raw(rows, [[plane] * len(rows)], self.decode_width(rows))
            if has_kv
            else self.host_meta.raw_no_kv(rows)
        )
        raw = self.staging.to_device(raw_np)[0]
        state = self.state_pool.index_select(0, raw[:, META_SLOT])
        (logits,) = self.graph_runs.run(self.coda_graphs, len(rows), self.passes.coda_pass, (raw, state))
        if has_kv:
            self.host_meta.mark(rows, plane, "coda")
        if self.hooks.active and self.hooks.wants_logits:
            self.hooks.logits([r.request_id for r in requests], logits)
        tokens = self.ops.sampler(logits, requests)
        record_logprobs(logits, tokens, requests)
        return tokens_to_host(tokens)
