"""A typed, read-only view of an engine between steps: what clients (serve, probes, `run`) may know.

Clients read an `EngineSnapshot` (`LLMEngine.snapshot()`) instead of reaching into the block manager, the
layout, the runner's graph caches, the engine's config or request objects. Building one is cheap and safe on
the engine thread between steps: it reads host-side counters and small Python structures only (no device
sync, no tensor is touched or copied, no request's token list is copied), and every value is copied, so a
snapshot does not change when the engine steps on.

One request's tokens are read apart, through `LLMEngine.request_view(request_id)` (`view_request`): a
`RequestOutputs` copies that request's output ids, so it costs what its outputs hold and is read when a
client needs them (a finished request's tokens, a warm-up's progress), not on every step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from looptrace.engine.request import Request, Stage

if TYPE_CHECKING:
    from looptrace.engine.config import EngineConfig
    from looptrace.engine.cuda_graphs import GraphCache
    from looptrace.engine.kv_cache import BlockManager, KVLayout
    from looptrace.engine.plan import EnginePlan
    from looptrace.engine.runner import ModelRunner


class SnapshotSource(Protocol):
    """What a snapshot reads of an engine (`LLMEngine` is one): typed here so this module need not import
    the engine, which imports it."""

    requests: Mapping[str, Request]
    cfg: EngineConfig
    max_model_len: int
    stats: Any  # EngineStats: steps, submissions, output_tokens, steps_by_stage
    layout: KVLayout
    blocks: BlockManager
    runner: ModelRunner
    plan: EnginePlan

    @property
    def prefill_depth(self) -> int: ...

    def kv_blocks(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class RequestView:
    """One unfinished request."""

    request_id: str
    stage: str  # Stage value: waiting, prefill, prelude, recurrent, coda
    loop: int  # loops done for the token in flight
    tokens: int  # output tokens so far
    max_tokens: int
    prompt_tokens: int
    arrival_time: float  # time.perf_counter() at add_request (or as the caller gave it)


@dataclass(frozen=True)
class RequestOutputs:
    """One request the engine still holds (unfinished, or finished and not yet `forget`-ed), with the
    output token ids it has produced so far (a copy)."""

    request_id: str
    stage: str  # Stage value: waiting, prefill, prelude, recurrent, coda, finished
    finish_reason: str | None  # None until finished; then "stop", "length", "abort" or "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens taken from the prefix cache
    outputs: tuple[int, ...]

    @property
    def finished(self) -> bool:
        return self.stage == Stage.FINISHED.value

    @property
    def context_tokens(self) -> int:
        """Tokens in context: the prompt and every output so far."""
        return self.prompt_tokens + len(self.outputs)


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler's limits the engine runs under (recipe `scheduler.*`, `max_model_len` as resolved)."""

    max_num_seqs: int  # requests admitted at once; also the rows of one batch
    max_num_batched_tokens: int
    prefill_chunk_size: int  # prompt tokens of one request per prefill step
    max_model_len: int  # longest prompt + output: the setting, else the model's positions, capped by the pool


@dataclass(frozen=True)
class QueueCounts:
    """Unfinished requests: not yet admitted (waiting) and admitted (running, any stage)."""

    waiting: int
    running: int


@dataclass(frozen=True)
class StepCounts:
    steps: int
    submissions: int
    output_tokens: int
    steps_by_stage: Mapping[str, int]


@dataclass(frozen=True)
class PlaneSlots:
    """KV slots of one depth plane over the pages requests hold: live (layers that write the plane) and
    dead (slots the plane reserves for layers that never write it)."""

    plane: int
    live_slots: int
    dead_slots: int


@dataclass(frozen=True)
class KVSnapshot:
    """Pool blocks (`LLMEngine.kv_blocks`: held by requests, by the prefix cache only, free) and slots."""

    layout: str
    num_planes: int
    block_size: int
    blocks_per_page: int  # pool blocks one page of one request takes (all planes; fewer under `packed`)
    num_blocks: int
    used_blocks: int
    request_blocks: int
    cached_blocks: int
    free_blocks: int
    planes: tuple[PlaneSlots, ...]

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (prefix-cache-only blocks are evictable: free)."""
        return self.request_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True)
class GraphFamily:
    """One CUDA graph cache (one per stage family): graphs held now and its counters since the start."""

    name: str
    graphs: int  # captured graphs held (one per row count)
    captures: int
    replays: int
    fallbacks: int
    evictions: int
    fallback_reasons: Mapping[str, int]


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    enabled: bool
    hit_tokens: int
    query_tokens: int
    evictions: int
    cached_blocks: int  # blocks held by the prefix cache alone

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None

    def counters(self) -> dict[str, int]:
        """The block manager's counters under their own names (as `looptrace run` reports them)."""
        return {
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_query_tokens": self.query_tokens,
            "evictions": self.evictions,
        }


@dataclass(frozen=True)
class DecodeMode:
    """How a decode token is computed (recipe settings as the engine resolved them)."""

    max_loops: int
    fuse_loops: bool  # all loops of a fixed-depth row in one submission
    whole_token: bool  # prelude, loops, coda and head in one submission
    async_gate: bool
    async_decode: bool

    @property
    def steps_per_token(self) -> int:
        """Engine steps one decode token takes per batch: loops + 2 (prelude, a step per loop, coda); 3
        with loop fusion (prelude, fused loops, coda); 1 with whole-token decode."""
        if self.whole_token:
            return 1
        if self.fuse_loops:
            return 3
        return self.max_loops + 2


@dataclass(frozen=True)
class EngineSnapshot:
    queues: QueueCounts
    requests: tuple[RequestView, ...]  # unfinished, in the engine's request order
    stats: StepCounts
    kv: KVSnapshot
    graphs: tuple[GraphFamily, ...]  # only the families whose cache exists (CUDA graphs on)
    prefix: PrefixCacheSnapshot
    prefill_depth: int  # core loops a prompt row runs now (P under split depth, else every loop)
    decode: DecodeMode
    limits: SchedulerLimits
    # Decode rows -> how the persistent loop op (`kernels.persistent_loop*`) ran the last loop of that many
    # rows: in one launch (which form) or layer by layer and why; empty without the op
    loop_routes: Mapping[int, str]

    def by_stage(self) -> dict[str, int]:
        return dict(Counter(r.stage for r in self.requests))

    def by_loop(self) -> dict[int, int]:
        return dict(Counter(r.loop for r in self.requests))


def snapshot_engine(engine: SnapshotSource) -> EngineSnapshot:
    requests = tuple(_request_view(r) for r in engine.requests.values() if r.stage != Stage.FINISHED)
    waiting = sum(r.stage == Stage.WAITING.value for r in requests)
    kv = _kv_snapshot(engine)
    return EngineSnapshot(
        queues=QueueCounts(waiting=waiting, running=len(requests) - waiting),
        requests=requests,
        stats=_step_counts(engine),
        kv=kv,
        graphs=_graph_families(engine),
        prefix=_prefix_snapshot(engine, kv.cached_blocks),
        prefill_depth=int(engine.prefill_depth),
        decode=_decode_mode(engine.plan),
        limits=_scheduler_limits(engine),
        loop_routes=_loop_routes(engine),
    )


def _loop_routes(engine: SnapshotSource) -> dict[int, str]:
    op = getattr(engine.runner.model, "persistent", None)  # the loop op `assemble` attached, if any
    return dict(sorted(op.routes.items())) if op is not None else {}


def view_request(engine: SnapshotSource, request_id: str) -> RequestOutputs:
    """The request `request_id` with its outputs so far; KeyError if the engine does not hold it (never
    added, or forgotten)."""
    req = engine.requests[request_id]
    return RequestOutputs(
        request_id=req.request_id,
        stage=req.stage.value,
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt),
        cached_tokens=req.num_cached,
        outputs=tuple(req.outputs),
    )


def _request_view(req: Request) -> RequestView:
    return RequestView(
        request_id=req.request_id,
        stage=req.stage.value,
        loop=req.loops_done,
        tokens=len(req.outputs),
        max_tokens=req.params.max_tokens,
        prompt_tokens=len(req.prompt),
        arrival_time=req.arrival_time,
    )


def _step_counts(engine: SnapshotSource) -> StepCounts:
    s = engine.stats
    return StepCounts(s.steps, s.submissions, s.output_tokens, dict(s.steps_by_stage))


def _kv_snapshot(engine: SnapshotSource) -> KVSnapshot:
    kv, layout, block_size = engine.kv_blocks(), engine.layout, engine.blocks.block_size
    tokens_per_plane = kv["request_blocks"] // layout.blocks_per_page * block_size
    planes = []
    for p in range(layout.num_planes):
        live = len(layout.layers_in_plane(p))
        dead = layout.plane_width(p) - live  # packed: a plane reserves only its live layers
        planes.append(PlaneSlots(p, live * tokens_per_plane, dead * tokens_per_plane))
    return KVSnapshot(
        layout=layout.name,
        num_planes=layout.num_planes,
        block_size=block_size,
        blocks_per_page=layout.blocks_per_page,
        planes=tuple(planes),
        **kv,
    )


def _graph_families(engine: SnapshotSource) -> tuple[GraphFamily, ...]:
    caches = _graph_caches(engine.runner)
    return tuple(_graph_family(name, cache) for name, cache in caches if cache is not None)


def _graph_caches(runner: ModelRunner) -> tuple[tuple[str, GraphCache | None], ...]:
    """(family name, cache or None), in `LLMEngine.graph_counters` order and under its names."""
    return (
        ("recurrent", runner.recurrent_graphs),
        ("recurrent_fused", runner.fused_graphs),
        ("coda", runner.coda_graphs),
        ("whole_token", runner.token_graphs),
        ("prefill", runner.prefill_graphs),
    )


def _graph_family(name: str, cache: GraphCache) -> GraphFamily:
    c = cache.counters
    return GraphFamily(
        name=name,
        graphs=len(cache.entries),
        captures=c.captures,
        replays=c.replays,
        fallbacks=c.fallbacks,
        evictions=c.evictions,
        fallback_reasons=dict(c.fallback_reasons),
    )


def _prefix_snapshot(engine: SnapshotSource, cached_blocks: int) -> PrefixCacheSnapshot:
    blocks = engine.blocks
    return PrefixCacheSnapshot(
        enabled=blocks.prefix_caching,
        hit_tokens=blocks.stats["prefix_hit_tokens"],
        query_tokens=blocks.stats["prefix_query_tokens"],
        evictions=blocks.stats["evictions"],
        cached_blocks=cached_blocks,
    )


def _scheduler_limits(engine: SnapshotSource) -> SchedulerLimits:
    sched = engine.cfg.scheduler
    return SchedulerLimits(
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        prefill_chunk_size=sched.prefill_chunk_size,
        max_model_len=int(engine.max_model_len),
    )


def _decode_mode(plan: EnginePlan) -> DecodeMode:
    return DecodeMode(
        max_loops=plan.max_loops,
        fuse_loops=plan.fuse_loops,
        whole_token=plan.whole_token,
        async_gate=plan.async_gate,
        async_decode=plan.async_decode,
    )
