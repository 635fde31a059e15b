"""LLMEngine: the step loop. schedule -> run one stage -> apply the results to requests -> report.

What runs (decode mode, kernels, graph families) is resolved once into `engine.plan` (plan.py). A step
takes one batch (one stage) from the scheduler and hands it to that stage's run (decode_modes.py: one class
per stage, and one per decode mode of the RECURRENT stage, owning its reads in flight); the stage run calls
the runner (runner.py), which computes, then the request lifecycle (request_events.py), the one place a
request's stage and progress change, as a table of event handlers.

engine = LLMEngine.from_preset("ouro", EngineConfig(), device="cpu")
engine.add_request([1, 2, 3], SamplingParams(max_tokens=8))
while engine.has_unfinished_requests():
    for out in engine.step(): ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from looptrace.engine import kernels
from looptrace.engine.assemble import assemble
from looptrace.engine.config import ConfigError, EngineConfig, validate_config
from looptrace.engine.decode_modes import DECODE_MODES, STAGE_RUNS, PendingLoops, PendingTokens, StageRun
from looptrace.engine.depth_control import queue_age_p
from looptrace.engine.hooks import DepthEvent, HookDispatcher, Observer, RequestEvent, StepInfo, StepResult
from looptrace.engine.kernels import launch_mode
from looptrace.engine.kernels.launch_mode import LaunchPlan
from looptrace.engine.kv_cache import BlockManager, KVLayout, KVPool, size_pool_blocks
from looptrace.engine.model_config import ModelSpec, resolve_preset
from looptrace.engine.models import LoopedModel
from looptrace.engine.noise import NOISE
from looptrace.engine.perturb import install_perturbation
from looptrace.engine.plan import EnginePlan, PrefillDepth, resolve_plan
from looptrace.engine.request import (  # EngineInputError, Event, TokenOutput: re-exported (old path)
    Batch,
    EngineInputError,
    Event,
    Request,
    SamplingParams,
    SamplingParamsError,
    Stage,
    TokenOutput,
    reduce_seed,
)
from looptrace.engine.request_events import (  # EngineStats, PENDING_TOKEN: re-exported (old path)
    PENDING_TOKEN,
    EngineStats,
    RequestLifecycle,
)
from looptrace.engine.runner import ModelRunner
from looptrace.engine.scheduler import ADMIT, Scheduler
from looptrace.engine.scoring import fresh_prefix_salt
from looptrace.engine.snapshot import EngineSnapshot, RequestOutputs, snapshot_engine, view_request
from looptrace.engine.weights import create_model, init_random

__all__ = [
    "PENDING_TOKEN",
    "EngineInputError",
    "EngineStats",
    "Event",
    "LLMEngine",
    "StepError",
    "TokenOutput",
]


def attention_backend(device: torch.device):
    """Pin SDPA to the memory-efficient kernel on CUDA. PyTorch's default choice on an H200 (torch 2.11)
    was not run-to-run deterministic for Huginn decode with a boolean mask (1/4 identical streams by default,
    4/4 with this backend or the math backend; `git show 050bfe4:bench/determinism_probe.py`)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class StepError(RuntimeError):
    """A step's forward or its bookkeeping raised. A batched forward cannot be blamed on one row, so the
    requests of that step are finished with reason "error", their KV freed, before this is raised; the
    tokens of async reads submitted by earlier steps are still read (`outputs`; where that read fails
    too, its rows are failed as well). Other requests are untouched and the engine can go on stepping."""

    def __init__(self, request_ids: list[str], cause: BaseException, outputs: list | None = None) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.outputs: list[TokenOutput] = outputs or []


def _check_config(cfg: EngineConfig) -> None:
    """Sections may have been changed after they were built: check the whole config again."""
    try:
        validate_config(cfg)
    except ConfigError as exc:
        raise EngineInputError(str(exc)) from None


class LLMEngine:
    def __init__(
        self,
        model: LoopedModel,
        cfg: EngineConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        _check_config(cfg)
        self.model, self.spec, self.cfg = model, model.spec, cfg
        self.device, self.dtype, self.seed = device, dtype, seed
        kernels_on = device.type == "cuda" and kernels.available()
        pdl_on = kernels_on and launch_mode.supported(device)
        self.plan = plan = resolve_plan(cfg, model.spec, device, kernels_on, pdl_on)
        # Rungs that a startup check on this device decides (config.rung_check == "device").
        self.checked_rungs: dict[str, str] = assemble(model, plan, device, dtype)
        # Settings accepted but without effect on this device, and why (reported in run headers).
        self.inactive_settings = plan.inactive_settings
        # The plan's choices under the names clients read.
        self.max_loops, self.exit_policy, self.layout = plan.max_loops, plan.exit_policy, plan.layout
        self.fuse_loops, self.async_gate = plan.fuse_loops, plan.async_gate
        self.whole_token, self.async_decode = plan.whole_token, plan.async_decode
        self.decode_entry = plan.decode_entry
        self.blocks, self.pool = build_kv(cfg, self.spec, self.layout, dtype, device)
        self.max_model_len = max_model_len(cfg, self.spec, self.layout, self.blocks)
        self.hooks = HookDispatcher()
        self.noise = NOISE[cfg.noise](self.spec)
        self.scheduler = Scheduler(
            cfg.scheduler,
            self.blocks,
            cfg.kv.watermark_blocks,
            plan.loops_per_decode_step,
            position_stage=plan.decode_entry,
        )
        self._depth = PrefillDepth(plan.prefill_loops)  # LoopDuet split depth
        # One carried-state slot per request that may be active at once: admission caps them.
        self.runner = ModelRunner(
            model,
            cfg,
            plan,
            self.blocks,
            self.pool,
            self.noise,
            self.hooks,
            device=device,
            dtype=dtype,
            max_model_len=self.max_model_len,
            max_slots=cfg.scheduler.max_num_seqs,
            prefill_depth=self._depth,
        )
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.lifecycle = RequestLifecycle(
            self.spec,
            plan,
            self.scheduler,
            self.blocks,
            self.runner,
            self.hooks,
            self.stats,
            device=device,
            seed=seed,
            noise=self.noise,
        )
        # One run per stage; RECURRENT's is the plan's decode mode, which owns its reads in flight.
        parts = (self.runner, self.lifecycle, plan, self.hooks)
        self.decode: StageRun = DECODE_MODES[plan.decode_mode](*parts)
        self.stage_runs: dict[Stage, StageRun] = {
            **{stage: run(*parts) for stage, run in STAGE_RUNS.items()},
            Stage.RECURRENT: self.decode,
        }
        self._next_seq = 0  # per engine, so request ids and derived seeds repeat across engines
        # debug.perturb (a test aid): None unless the setting names a place
        self.perturbation = install_perturbation(self, cfg.debug.perturb, cfg.debug.perturb_ulps)

    # Construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec,
        cfg: EngineConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> LLMEngine:
        device = torch.device(device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = create_model(spec, device, dtype)
        init_random(model, seed)
        return cls(model, cfg or EngineConfig(), device=device, dtype=dtype, seed=seed)

    @classmethod
    def from_preset(
        cls,
        name: str,
        cfg: EngineConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> LLMEngine:
        device = torch.device(device)
        return cls.from_spec(resolve_preset(name, device.type), cfg, device=device, dtype=dtype, seed=seed)

    # Observers ------------------------------------------------------------------------------------------
    def attach(self, observer: Observer) -> None:
        self.hooks.attach(observer)

    def detach(self, observer: Observer) -> None:
        self.hooks.detach(observer)

    def observable_modules(self):
        """(name, module) for every op module a probe may hook (model ops and the runner's own)."""
        yield from self.model.named_modules()
        yield from (("runner." + n, m) for n, m in self.runner.ops.named_modules() if n)

    # Requests -------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
        validate_request(prompt, params, self.spec.vocab_size, self.max_model_len)
        if request_id is not None and request_id in self.requests:
            raise EngineInputError(f"request id '{request_id}' is already in use")
        req = Request(
            list(prompt), params, request_id or "", arrival_time or time.perf_counter(), seq=self._next_seq
        )
        if getattr(self.noise, "keyed_by_seed", False) and self.spec.family != "ouro":
            # The initial state depends on the seed: cached KV must come from the same seed.
            # Reduced mod 2**64 (the noise hash masks to 64 bits anyway); the salt's bytes are those of the
            # signed encoding for every seed it could take before (seeds >= 2**63 used to overflow it).
            req.noise_seed = reduce_seed(params.seed if params.seed is not None else self.seed)
            req.prefix_salt = req.noise_seed.to_bytes(8, "little")
        req.prefix_salt = fresh_prefix_salt(req)  # a scored prompt needs every position computed
        self._next_seq += 1
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.hooks.active:
            self.hooks.request_event(RequestEvent("arrived", req.request_id, time.perf_counter()))
        return req.request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        self._advance(req, Event.ABORTED)

    def forget(self, request_id: str) -> None:
        """Drop the record of a finished or aborted request (its outputs stay readable until then); an
        unknown id is ignored. A request still running is kept: abort it first."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.decode.holds_requests()

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, message) of requests the engine finished with reason "error" since the last call
        (an exception while admitting one, or a failed step); a server tells their clients."""
        out, self.lifecycle.failures = self.lifecycle.failures, []
        return out

    @property
    def prefill_depth(self) -> int:
        """Core loops a prompt row runs now: P under split depth (`depth.*`), else every loop (S)."""
        p = self._depth.loops
        return self.max_loops if p is None else p

    # The step -------------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule one batch (one stage), run it, apply the results. Returns the tokens sampled."""
        batch = self._schedule()
        if batch is None:  # nothing left to submit: read what the decode mode still has in flight
            return self.decode.drain()
        label = stage_label(self.plan, batch)
        if self.plan.split_depth:
            pick_prefill_depth(self, label)
        self.stats.steps += 1
        self.stats.steps_by_stage[label] = self.stats.steps_by_stage.get(label, 0) + 1
        if self.hooks.active:
            self.hooks.step_begin(step_info(self.stats.steps, label, batch))
        t0 = time.perf_counter()
        earlier = self.decode.in_flight  # a read submitted by an earlier step
        try:
            with torch.inference_mode(), step_modes(self.device, self.plan.launch):
                outputs = self.stage_runs[batch.stage].run(batch)
                outputs = self.decode.settle(earlier) + outputs  # this step is already submitted behind it
        except Exception as exc:
            self._fail_step(batch, earlier, exc, t0)
        self.stats.submissions = self.runner.submissions
        if self.hooks.active:
            self.hooks.step_end(step_result(self, batch, outputs, time.perf_counter() - t0))
        return outputs

    def _fail_step(self, batch: Batch, earlier: PendingLoops | PendingTokens | None, exc, t0) -> None:
        """Finish the failed step's requests (free their KV), read what earlier steps left in flight (their
        rows failed too where that read raises), drop any read of this step; then raise StepError."""
        reqs = {r.request_id: r for r in batch.requests}
        outputs: list[TokenOutput] = []
        try:
            with torch.inference_mode(), step_modes(self.device, self.plan.launch):
                outputs = self.decode.settle(earlier)
        except Exception:  # noqa: BLE001 - their results are unknown: those rows fail as well
            reqs.update((r.request_id, r) for r, _ in (earlier.rows if earlier is not None else ()))
        self.decode.in_flight = None
        for req in reqs.values():
            self.lifecycle.fail(req, exc)
        if self.hooks.active:  # close the step for observers (a profiler range stays balanced)
            with contextlib.suppress(Exception):
                self.hooks.step_end(step_result(self, batch, [], time.perf_counter() - t0))
        kept = [o for o in outputs if o.request_id not in reqs]
        raise StepError(list(reqs), exc, kept) from exc

    def _schedule(self) -> Batch | None:
        """The scheduler decides; admissions it makes are applied here before the batch is taken (an
        admitted request's cached prefix decides where its first chunk starts)."""
        choice = self.scheduler.choose()
        if choice == ADMIT:
            for admission in self.scheduler.admit():
                try:
                    self._advance(admission.request, Event.ADMITTED, admission=admission)
                except Exception as exc:  # noqa: BLE001 - e.g. a seed its generator rejects: that one alone
                    self.lifecycle.fail(admission.request, exc)
            choice = self.scheduler.choose_after_admission()
        return self.scheduler.take(choice) if choice is not None else None

    def _advance(self, req: Request, event: Event, **detail) -> TokenOutput | None:
        """The request state machine (request_events.py): every stage transition happens there."""
        return self.lifecycle.advance(req, event, **detail)

    # Convenience ----------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished_requests():
            self.step()
        return [self.requests[i].outputs for i in ids]

    # Reporting ------------------------------------------------------------------------------------------
    def kv_blocks(self) -> dict[str, int]:
        """Pool blocks held by requests, held only by the prefix cache (evictable) and free."""
        used, cached = self.blocks.used_blocks(), self.blocks.cache_only_blocks()
        return {
            "num_blocks": self.blocks.num_blocks,
            "used_blocks": used,
            "request_blocks": used - cached,
            "cached_blocks": cached,
            "free_blocks": self.blocks.num_blocks - used,
        }

    def kv_usage(self) -> float:
        """Fraction of the pool held by requests. Blocks only the prefix cache holds are evictable, so they
        count as free (vLLM's convention; `kv_blocks()` reports them apart)."""
        kv = self.kv_blocks()
        return kv["request_blocks"] / kv["num_blocks"]

    def kv_summary(self) -> dict:
        reserved, live = self.layout.reserved_slots_per_token, self.layout.live_slots_per_token
        slot_bytes = self.spec.num_kv_heads * self.spec.head_dim * 2 * self.pool.k_cache.element_size()
        return {
            "layout": self.layout.name,
            "planes": self.layout.num_planes,
            "block_size": self.blocks.block_size,
            "num_blocks": self.blocks.pool_blocks,
            "blocks_per_page": self.layout.blocks_per_page,
            "capacity_tokens": self.blocks.capacity_tokens,
            # what the `planes` layout would hold in this pool (packed: more tokens in the same bytes)
            "planes_capacity_tokens": self.blocks.pool_blocks // self.max_loops * self.blocks.block_size,
            "reserved_slots_per_token": reserved,
            "live_slots_per_token": live,
            "dead_slots_per_token": self.layout.dead_slots_per_token,
            "padding_slots_per_token": self.layout.padding_slots_per_token,
            "reserved_bytes_per_token": reserved * slot_bytes,
            "live_bytes_per_token": live * slot_bytes,
            "pool_bytes": 2 * self.pool.k_cache.numel() * self.pool.k_cache.element_size(),
            "max_model_len": self.max_model_len,
            "prefix_caching": self.blocks.prefix_caching,
            **self.blocks.prefix_summary(),  # publication rule, query/hit tokens, hit rate
        }

    def graph_bodies(self) -> list[tuple[str, int, Callable[[], None]]]:
        """(graph name, rows, thunk) for every captured CUDA graph; the thunk runs the graph's body eagerly
        (see GraphCache.run_body_eagerly) under the same modes as an engine step."""
        out = []
        for _, cache in self.runner.graph_caches():
            for rows in list(cache.entries):

                def thunk(cache=cache, rows=rows) -> None:
                    with torch.inference_mode(), step_modes(self.device, self.plan.launch):
                        cache.run_body_eagerly(rows)

                out.append((cache.name, rows, thunk))
        return out

    def graph_counters(self) -> dict:
        return {name: cache.counters.as_dict() for name, cache in self.runner.graph_caches()}

    def snapshot(self) -> EngineSnapshot:
        """Queues, requests, step counts, KV, graphs, prefix cache and decode mode, read between steps (no
        device sync): what clients may know of the engine (engine/snapshot.py)."""
        return snapshot_engine(self)

    def request_view(self, request_id: str) -> RequestOutputs:
        """One request the engine holds, with a copy of its output ids (costs what its outputs hold: read
        it when a client needs them, not per step); KeyError for an id never added or forgotten."""
        return view_request(self, request_id)


# Construction ---------------------------------------------------------------------------------------------
def build_kv(
    cfg: EngineConfig, spec: ModelSpec, layout: KVLayout, dtype: torch.dtype, device: torch.device
) -> tuple[BlockManager, KVPool]:
    """The block manager and the pool, sized for this device (kv.num_blocks, or memory)."""
    kv = cfg.kv
    num_blocks = size_pool_blocks(
        spec,
        layout,
        kv.block_size,
        dtype,
        device,
        kv.num_blocks,
        kv.cpu_pool_tokens,
        kv.gpu_memory_utilization,
    )
    if num_blocks < layout.blocks_per_page:
        raise EngineInputError(f"kv.num_blocks={num_blocks} holds no page of {layout.blocks_per_page} blocks")
    blocks = BlockManager(layout, num_blocks, kv.block_size, kv.prefix_caching, kv.prefix_publication)
    pool = KVPool(spec, num_blocks, kv.block_size, dtype, device)
    if kv.poison_freed_blocks:
        blocks.on_freed = pool.poison
    return blocks, pool


def max_model_len(cfg: EngineConfig, spec: ModelSpec, layout: KVLayout, blocks: BlockManager) -> int:
    """The longest context: the model's, the recipe's, and what the pool holds past the watermark
    (which is never admitted into, so a request must fit in the rest of the pool)."""
    kv, num_blocks = cfg.kv, blocks.pool_blocks
    usable = (num_blocks - kv.watermark_blocks) // layout.blocks_per_page * kv.block_size
    if usable < 1:
        raise EngineInputError(
            f"kv.watermark_blocks={kv.watermark_blocks} leaves no usable page "
            f"in a pool of {num_blocks} blocks"
        )
    cap = min(blocks.capacity_tokens, usable)
    limit = cfg.scheduler.max_model_len or spec.max_position
    return min(limit, spec.max_position, cap)


def validate_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_len: int) -> None:
    """A request the engine can run, else EngineInputError naming the field and what was expected."""
    if not prompt:
        raise EngineInputError("prompt is empty: at least one token is needed")
    if params.max_tokens < 1:
        raise EngineInputError(f"max_tokens must be >= 1, got {params.max_tokens}")
    try:  # every field in a range that samples without raising (an error here fails this request only)
        params.check(vocab_size)
    except SamplingParamsError as exc:
        raise EngineInputError(f"sampling: {exc}") from None
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineInputError(f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    need = len(prompt) + params.max_tokens - 1
    if need > max_len:
        raise EngineInputError(
            f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {need} KV positions; "
            f"max context is {max_len}"
        )


# Around each step -------------------------------------------------------------------------------------------
def step_modes(device: torch.device, launch: LaunchPlan) -> contextlib.ExitStack:
    """The modes every step's kernels run under: SDPA's backend pin and the launch mode (kernels.pdl,
    kernels.gemv_preload, kernels.attn_prefetch). CUDA graphs keep the mode they were captured with."""
    stack = contextlib.ExitStack()
    stack.enter_context(attention_backend(device))
    stack.enter_context(launch_mode.entered(launch))
    return stack


def pick_prefill_depth(engine: LLMEngine, stage: str) -> None:
    """Before each step under split depth: the queue-age controller sets P; observers get the (S, P) in
    force."""
    d, q = engine.cfg.depth, None
    if d.controller == "queue_age":
        q = _oldest_wait(engine.requests.values(), time.perf_counter())
        engine._depth.loops = queue_age_p(q, engine.plan.p_max, d.p_min, d.q_low, d.q_high)
    if engine.hooks.active:
        now, p = time.perf_counter(), engine._depth.loops
        engine.hooks.depth(DepthEvent(engine.stats.steps + 1, now, p, engine.max_loops, q, stage))


def _oldest_wait(requests: Iterable[Request], now: float) -> float:
    """Seconds the oldest admitted request without a first token has waited (0 if none)."""
    waits = [
        now - r.arrival_time
        for r in requests
        if not r.outputs and r.stage not in (Stage.WAITING, Stage.FINISHED)
    ]
    return max(waits, default=0.0)


def stage_label(plan: EnginePlan, batch: Batch) -> str:
    """The step's stage name for observers and stats: `token` for a whole-token decode step."""
    return "token" if plan.whole_token and batch.stage == Stage.RECURRENT else batch.stage.value


def step_info(step: int, label: str, batch: Batch) -> StepInfo:
    loops = [r.loops_done for r in batch.requests] if batch.stage == Stage.RECURRENT else []
    ids, context = [r.request_id for r in batch.requests], [r.num_tokens for r in batch.requests]
    return StepInfo(step, label, ids, batch.num_rows, loops, context)


def step_result(engine: LLMEngine, batch: Batch, outputs: list[TokenOutput], elapsed: float) -> StepResult:
    graph_stage = batch.stage in (Stage.RECURRENT, Stage.CODA)
    runner = engine.runner
    return StepResult(
        engine.stats.steps,
        stage_label(engine.plan, batch),
        batch.num_rows,
        elapsed,
        graph_mode=runner.graph_runs.last_mode if graph_stage else None,
        fallback_reason=runner.graph_runs.last_fallback if graph_stage else None,
        new_tokens=len(outputs),
        finished=[o.request_id for o in outputs if o.finished],
    )
