"""LLMEngine: the step loop. schedule -> run one stage -> apply the results to requests -> report.

The engine owns the request lifecycle: `_advance` is the one function that changes a request's stage and
progress (admission, chunk done, prelude done, loop done, token sampled, finish/abort). The scheduler only
decides and keeps queues; the runner only computes; exit policies only decide. What runs (decode mode,
kernels, graph families) is resolved once into `engine.plan` (plan.py); each stage, and each decode mode
of the RECURRENT stage, is one small strategy picked from a table at construction.

engine = LLMEngine.from_preset("ouro", EngineConfig(), device="cpu")
engine.add_request([1, 2, 3], SamplingParams(max_tokens=8))
while engine.has_unfinished_requests():
    for out in engine.step(): ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from looptrace.engine import kernels
from looptrace.engine.assemble import assemble
from looptrace.engine.config import ConfigError, EngineConfig, validate_config
from looptrace.engine.depth_control import queue_age_p
from looptrace.engine.hooks import (
    DepthEvent,
    HookDispatcher,
    Observer,
    RequestEvent,
    StepInfo,
    StepResult,
)
from looptrace.engine.kernels import launch_mode
from looptrace.engine.kv_cache import BlockManager, KVPool, size_pool_blocks
from looptrace.engine.model_config import ModelSpec, resolve_preset
from looptrace.engine.models import LoopedModel
from looptrace.engine.noise import NOISE
from looptrace.engine.perturb import install_perturbation
from looptrace.engine.plan import (
    ASYNC_GATE,
    ASYNC_WHOLE_TOKEN,
    FUSED_LOOPS,
    RECURRENT,
    WHOLE_TOKEN,
    PrefillDepth,
    resolve_plan,
)
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
from looptrace.engine.runner import ModelRunner, PendingRead
from looptrace.engine.scheduler import ADMIT, Admission, Scheduler
from looptrace.engine.snapshot import EngineSnapshot, snapshot_engine
from looptrace.engine.weights import create_model, init_random


def attention_backend(device: torch.device):
    """Pin SDPA to the memory-efficient kernel on CUDA. PyTorch's default choice on an H200 (torch 2.11)
    was not run-to-run deterministic for Huginn decode with a boolean mask (1/4 identical streams by default,
    4/4 with this backend or the math backend; `git show 050bfe4:bench/determinism_probe.py`)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

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


PENDING_TOKEN = -1  # async decode: an output whose token the host has not read yet


@dataclass
class PendingLoops:
    """An async recurrent step's gate logits in flight and the (request, loops done) rows they decide."""

    gate: PendingRead
    rows: list[tuple[Request, int]]
    resolved: bool = False


@dataclass
class PendingTokens:
    """An async whole-token step's sampled tokens in flight (scheduler.async_decode) and the rows they
    belong to: (request, index of the token's placeholder in its outputs)."""

    tokens: PendingRead
    rows: list[tuple[Request, int]]
    resolved: bool = False


@dataclass
class EngineStats:
    steps: int = 0
    submissions: int = 0
    output_tokens: int = 0
    steps_by_stage: dict[str, int] = field(default_factory=dict)


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
        self.plan = resolve_plan(cfg, model.spec, device, kernels_on, pdl_on)
        # Rungs that a startup check on this device decides (config.rung_check == "device").
        self.checked_rungs: dict[str, str] = assemble(model, self.plan, device, dtype)
        # Settings accepted but without effect on this device, and why (reported in run headers).
        self.inactive_settings = self.plan.inactive_settings
        self.exit_policy, self.layout = self.plan.exit_policy, self.plan.layout
        self.blocks, self.pool = self._build_kv()
        self.max_model_len = self._max_model_len()
        self.hooks = HookDispatcher()
        self.noise = NOISE[cfg.noise](self.spec)
        self.scheduler = self._build_scheduler()
        self._depth = PrefillDepth(self.plan.prefill_loops)  # LoopDuet split depth
        self.runner = self._build_runner()
        # One strategy per stage, RECURRENT's chosen by the plan's decode mode (unbound functions: no cycle).
        self._stage_runs = {**self.STAGE_RUNS, Stage.RECURRENT: self.DECODE_MODES[self.plan.decode_mode]}
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._pending: PendingLoops | None = None  # async gate: a recurrent step's gates still unread
        self._pending_tokens: PendingTokens | None = None  # async decode: a whole-token step's tokens unread
        self._early_exits: list[Request] = []
        self._rollbacks: list[Request] = []
        self._next_seq = 0  # per engine, so request ids and derived seeds repeat across engines
        self._failures: list[tuple[str, str]] = []  # (request id, why) failed alone: see take_failures
        self.perturbation = install_perturbation(self, cfg.debug.perturb)  # debug.perturb (test aid)

    def _build_kv(self) -> tuple[BlockManager, KVPool]:
        """The block manager and the pool, sized for this device (kv.num_blocks, or memory)."""
        kv, spec, layout = self.cfg.kv, self.spec, self.layout
        num_blocks = size_pool_blocks(
            spec,
            layout,
            kv.block_size,
            self.dtype,
            self.device,
            kv.num_blocks,
            kv.cpu_pool_tokens,
            kv.gpu_memory_utilization,
        )
        if num_blocks < layout.blocks_per_page:
            raise EngineInputError(
                f"kv.num_blocks={num_blocks} holds no page of {layout.blocks_per_page} blocks"
            )
        blocks = BlockManager(layout, num_blocks, kv.block_size, kv.prefix_caching, kv.prefix_publication)
        pool = KVPool(spec, num_blocks, kv.block_size, self.dtype, self.device)
        if kv.poison_freed_blocks:
            blocks.on_freed = pool.poison
        return blocks, pool

    def _max_model_len(self) -> int:
        """The longest context: the model's, the recipe's, and what the pool holds past the watermark
        (which is never admitted into, so a request must fit in the rest of the pool)."""
        kv, num_blocks = self.cfg.kv, self.blocks.pool_blocks
        usable = (num_blocks - kv.watermark_blocks) // self.layout.blocks_per_page * kv.block_size
        if usable < 1:
            raise EngineInputError(
                f"kv.watermark_blocks={kv.watermark_blocks} leaves no usable page "
                f"in a pool of {num_blocks} blocks"
            )
        cap = min(self.blocks.capacity_tokens, usable)
        limit = self.cfg.scheduler.max_model_len or self.spec.max_position
        return min(limit, self.spec.max_position, cap)

    def _build_scheduler(self) -> Scheduler:
        return Scheduler(
            self.cfg.scheduler,
            self.blocks,
            self.cfg.kv.watermark_blocks,
            self.plan.loops_per_decode_step,
            position_stage=self.plan.decode_entry,
        )

    def _build_runner(self) -> ModelRunner:
        # One carried-state slot per request that may be active at once: admission caps them.
        return ModelRunner(
            self.model,
            self.cfg,
            self.plan,
            self.blocks,
            self.pool,
            self.noise,
            self.hooks,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_slots=self.cfg.scheduler.max_num_seqs,
            prefill_depth=self._depth,
        )

    # The plan's choices under the names clients read -----------------------------------------------------
    @property
    def max_loops(self) -> int:
        return self.plan.max_loops

    @property
    def fuse_loops(self) -> bool:
        return self.plan.fuse_loops

    @property
    def async_gate(self) -> bool:
        return self.plan.async_gate

    @property
    def whole_token(self) -> bool:
        return self.plan.whole_token

    @property
    def async_decode(self) -> bool:
        return self.plan.async_decode

    @property
    def decode_entry(self) -> Stage:
        return self.plan.decode_entry

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
        self._validate(prompt, params, request_id)
        req = Request(
            list(prompt), params, request_id or "", arrival_time or time.perf_counter(), seq=self._next_seq
        )
        if getattr(self.noise, "keyed_by_seed", False) and self.spec.family != "ouro":
            # The initial state depends on the seed: cached KV must come from the same seed.
            # Reduced mod 2**64 (the noise hash masks to 64 bits anyway); the salt's bytes are those of the
            # signed encoding for every seed it could take before (seeds >= 2**63 used to overflow it).
            req.noise_seed = reduce_seed(params.seed if params.seed is not None else self.seed)
            req.prefix_salt = req.noise_seed.to_bytes(8, "little")
        self._next_seq += 1
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.hooks.active:
            self.hooks.request_event(RequestEvent("arrived", req.request_id, time.perf_counter()))
        return req.request_id

    def _validate(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> None:
        if not prompt:
            raise EngineInputError("prompt is empty: at least one token is needed")
        if params.max_tokens < 1:
            raise EngineInputError(f"max_tokens must be >= 1, got {params.max_tokens}")
        try:  # every field in a range that samples without raising (an error here fails this request only)
            params.check(self.spec.vocab_size)
        except SamplingParamsError as exc:
            raise EngineInputError(f"sampling: {exc}") from None
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise EngineInputError(f"token id {bad[0]} outside the vocabulary [0, {self.spec.vocab_size})")
        need = len(prompt) + params.max_tokens - 1
        if need > self.max_model_len:
            raise EngineInputError(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {need} KV positions; "
                f"max context is {self.max_model_len}"
            )
        if request_id is not None and request_id in self.requests:
            raise EngineInputError(f"request id '{request_id}' is already in use")

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
        return self.scheduler.has_work() or self._pending_tokens is not None

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, message) of requests the engine finished with reason "error" since the last call
        (an exception while admitting one, or a failed step); a server tells their clients."""
        out, self._failures = self._failures, []
        return out

    def _fail(self, req: Request, exc: BaseException) -> None:
        if not req.is_finished:
            self._finish(req, "error")
        self._failures.append((req.request_id, f"{type(exc).__name__}: {exc}"))

    def num_running(self) -> int:
        """Admitted and not finished (at most scheduler.max_num_seqs)."""
        return len(self.scheduler.running)

    @property
    def prefill_depth(self) -> int:
        """Core loops a prompt row runs now: P under split depth (`depth.*`), else every loop (S)."""
        p = self._depth.loops
        return self.max_loops if p is None else p

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # The step -------------------------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Schedule one batch (one stage), run it, apply the results. Returns the tokens sampled."""
        batch = self._schedule()
        if batch is None:
            if self._pending is not None:
                with torch.inference_mode():
                    self._resolve_gates(self._pending)
            if self._pending_tokens is not None:  # nothing left to submit behind it
                return self._resolve_tokens(self._pending_tokens)
            return []
        label = self._label(batch)
        if self.plan.split_depth:
            self._pick_depth(label)
        self.stats.steps += 1
        self.stats.steps_by_stage[label] = self.stats.steps_by_stage.get(label, 0) + 1
        if self.hooks.active:
            self.hooks.step_begin(self._step_info(batch))
        t0 = time.perf_counter()
        earlier = self._pending  # a gate readback submitted by an earlier step
        earlier_tokens = self._pending_tokens  # an async whole-token step's tokens
        try:
            with torch.inference_mode(), self._step_modes():
                outputs = self._run(batch)
                if earlier is not None:  # read it now: this step is already submitted behind it
                    self._resolve_gates(earlier)
                if earlier_tokens is not None and not earlier_tokens.resolved:
                    outputs = self._resolve_tokens(earlier_tokens) + outputs
        except Exception as exc:
            self._fail_step(batch, earlier, earlier_tokens, exc, t0)
        self.stats.submissions = self.runner.submissions
        if self.hooks.active:
            self.hooks.step_end(self._step_result(batch, outputs, time.perf_counter() - t0))
        return outputs

    def _fail_step(
        self, batch: Batch, earlier: PendingLoops | None, earlier_tokens: PendingTokens | None, exc, t0
    ) -> None:
        """Finish the failed step's requests (free their KV), read what earlier steps left in flight (their
        rows failed too where that read raises), drop any read of this step; then raise StepError."""
        reqs = {r.request_id: r for r in batch.requests}
        outputs: list[TokenOutput] = []
        try:
            with torch.inference_mode(), self._step_modes():
                if earlier is not None and not earlier.resolved:
                    self._resolve_gates(earlier)
                if earlier_tokens is not None and not earlier_tokens.resolved:
                    outputs = self._resolve_tokens(earlier_tokens)
        except Exception:  # noqa: BLE001 - their results are unknown: those rows fail as well
            for p in (earlier, earlier_tokens):
                reqs.update((r.request_id, r) for r, _ in (p.rows if p is not None else ()))
        self._pending = self._pending_tokens = None
        for req in reqs.values():
            self._fail(req, exc)
        if self.hooks.active:  # close the step for observers (a profiler range stays balanced)
            with contextlib.suppress(Exception):
                self.hooks.step_end(self._step_result(batch, [], time.perf_counter() - t0))
        kept = [o for o in outputs if o.request_id not in reqs]
        raise StepError(list(reqs), exc, kept) from exc

    def _pick_depth(self, stage: str) -> None:
        """Before each step: the queue-age controller sets P; observers get the (S, P) in force."""
        d, q = self.cfg.depth, None
        if d.controller == "queue_age":
            now = time.perf_counter()
            waiting = [
                now - r.arrival_time
                for r in self.requests.values()
                if not r.outputs and r.stage not in (Stage.WAITING, Stage.FINISHED)
            ]
            q = max(waiting, default=0.0)
            self._depth.loops = queue_age_p(q, self.plan.p_max, d.p_min, d.q_low, d.q_high)
        if self.hooks.active:
            now, p = time.perf_counter(), self._depth.loops
            self.hooks.depth(DepthEvent(self.stats.steps + 1, now, p, self.max_loops, q, stage))

    def _schedule(self) -> Batch | None:
        """The scheduler decides; admissions it makes are applied here before the batch is taken (an
        admitted request's cached prefix decides where its first chunk starts)."""
        choice = self.scheduler.choose()
        if choice == ADMIT:
            for admission in self.scheduler.admit():
                try:
                    self._advance(admission.request, Event.ADMITTED, admission=admission)
                except Exception as exc:  # noqa: BLE001 - e.g. a seed its generator rejects: that one alone
                    self._fail(admission.request, exc)
            choice = self.scheduler.choose_after_admission()
        return self.scheduler.take(choice) if choice is not None else None

    # Stage strategies: the runner computes, `_advance` applies each row's result --------------------------
    def _run(self, batch: Batch) -> list[TokenOutput]:
        return self._stage_runs[batch.stage](self, batch)

    def _run_prefill(self, batch: Batch) -> list[TokenOutput]:
        self.runner.prefill(batch.spans)
        for span in batch.spans:
            self._advance(span.request, Event.CHUNK_DONE, chunk=span.length)
        return []

    def _run_prelude(self, batch: Batch) -> list[TokenOutput]:
        self.runner.prelude(batch.requests)
        for req in batch.requests:
            self._advance(req, Event.PRELUDE_DONE)
        return []

    def _run_coda(self, batch: Batch) -> list[TokenOutput]:
        tokens = self.runner.coda(batch.requests)
        return [self._advance(req, Event.TOKEN, token=tok) for req, tok in zip(batch.requests, tokens)]

    def _async_whole_token(self, batch: Batch) -> list[TokenOutput]:
        """Submit the token step before the previous one's tokens are read, where the batch allows it."""
        if not self._defers(batch):
            return self._whole_token(batch)
        pending = self.runner.whole_token(batch.requests, defer=True)
        rows = [(req, len(req.outputs)) for req in batch.requests]
        for req in batch.requests:
            self._advance(req, Event.TOKEN_SUBMITTED)
        self._pending_tokens = PendingTokens(pending, rows)
        return []

    def _whole_token(self, batch: Batch) -> list[TokenOutput]:
        outputs = []
        if self._pending_tokens is not None:  # the phases below need every input token on the host
            outputs = self._resolve_tokens(self._pending_tokens)
        requests = [req for req in batch.requests if not req.is_finished]  # stopped just now: dropped
        if not requests:
            return outputs
        tokens = self.runner.whole_token(requests)
        return outputs + [self._advance(req, Event.DECODED, token=t) for req, t in zip(requests, tokens)]

    def _fused_loops(self, batch: Batch) -> list[TokenOutput]:
        self.runner.recurrent_fused(batch.requests)
        for req in batch.requests:
            self._advance(req, Event.LOOPS_DONE)
        return []

    def _async_gate(self, batch: Batch) -> list[TokenOutput]:
        """One loop whose exit gates are read one step late; observers of hidden states see no
        speculative loop, so under one the loop runs with its gates read at once."""
        if self.hooks.wants_hidden:
            return self._one_loop(batch)
        gate = self.runner.recurrent(batch.requests, True, defer=True)
        for req in batch.requests:
            self._advance(req, Event.LOOP_SUBMITTED)
        self._pending = PendingLoops(gate, [(req, req.loops_done) for req in batch.requests])
        return []

    def _one_loop(self, batch: Batch) -> list[TokenOutput]:
        if self._pending is not None:  # observers of hidden states see no speculative loop
            self._resolve_gates(self._pending)
        gates = self.runner.recurrent(batch.requests, self.exit_policy.needs_gate)
        self._early_exits = []
        for i, req in enumerate(batch.requests):
            self._advance(req, Event.LOOP_DONE, gate=gates[i] if gates is not None else None)
        if self._early_exits:  # one batched plane copy for every row that left early
            self.runner.finalize_exits(self._early_exits)
        return []

    STAGE_RUNS: dict[Stage, Callable[[LLMEngine, Batch], list[TokenOutput]]] = {
        Stage.PREFILL: _run_prefill,
        Stage.PRELUDE: _run_prelude,
        Stage.CODA: _run_coda,
    }
    # plan.decode_mode -> how a RECURRENT batch runs
    DECODE_MODES: dict[str, Callable[[LLMEngine, Batch], list[TokenOutput]]] = {
        ASYNC_WHOLE_TOKEN: _async_whole_token,
        WHOLE_TOKEN: _whole_token,
        FUSED_LOOPS: _fused_loops,
        ASYNC_GATE: _async_gate,
        RECURRENT: _one_loop,
    }

    def _defers(self, batch: Batch) -> bool:
        """Whether a whole-token batch can run without its tokens read first: one graph pass (the phases
        of a larger batch, or under a hidden-state observer, need every input token on the host)."""
        return (
            len(batch.requests) <= self.plan.whole_token_max_rows
            and not self.hooks.wants_hidden
            and not any(r.params.processes_logits for r in batch.requests)  # penalties read past tokens
        )

    def _resolve_tokens(self, pending: PendingTokens) -> list[TokenOutput]:
        """Async decode: the tokens of an earlier whole-token step reach the host. A row that stopped
        there (EOS, stop) and ran one more token since drops it."""
        pending.resolved = True
        if self._pending_tokens is pending:
            self._pending_tokens = None
        outputs = []
        for (req, index), token in zip(pending.rows, pending.tokens.result()):
            if not req.is_finished:  # not aborted, not stopped by an earlier token
                outputs.append(self._advance(req, Event.TOKEN_READ, token=token, index=index))
        return outputs

    def _resolve_gates(self, pending: PendingLoops) -> None:
        """Async gate readback: apply the exit decisions of an earlier recurrent step. A row that exited
        there but ran one more loop since is rolled back; every early exit copies its KV slot deeper."""
        if pending.resolved:
            return
        pending.resolved = True
        self._early_exits, self._rollbacks = [], []
        for (req, loop), gate in zip(pending.rows, pending.gate.result()):
            if req.stage != Stage.FINISHED and req.loops_done >= loop:  # not aborted, not rolled back
                self._advance(req, Event.GATE_READ, gate=gate, loop=loop)
        if self._rollbacks:
            self.runner.rollback(self._rollbacks)
        if self._early_exits:
            self.runner.finalize_exits(self._early_exits)
        if self._pending is pending:
            self._pending = None

    def _advance(
        self,
        req: Request,
        event: Event,
        *,
        admission: Admission | None = None,
        chunk: int = 0,
        gate: float | None = None,
        loop: int = 0,
        token: int = 0,
        index: int = 0,
    ) -> TokenOutput | None:
        """The request state machine: every stage transition and progress update happens here.

        WAITING --ADMITTED--> PREFILL --CHUNK_DONE--> PREFILL (tail of the queue) | CODA (last chunk)
        CODA --TOKEN--> PRELUDE | FINISHED;  PRELUDE --PRELUDE_DONE--> RECURRENT
        RECURRENT --LOOP_DONE--> RECURRENT | CODA (exit; an early exit copies its KV slot deeper)
        RECURRENT --LOOP_SUBMITTED--> RECURRENT | CODA at max depth (async gate: decision still unread)
        RECURRENT/CODA --GATE_READ--> CODA (a late early exit; a loop run past it is rolled back) | unchanged
        RECURRENT --LOOPS_DONE--> CODA (loop fusion: every loop in one step)
        RECURRENT --DECODED--> RECURRENT | FINISHED (whole-token: TOKEN enters decode at RECURRENT)
        RECURRENT --TOKEN_SUBMITTED--> RECURRENT | held (async decode: at max_tokens, waits for its read)
        any --TOKEN_READ--> unchanged | FINISHED (async decode: the token read one step late)
        any --ABORTED--> FINISHED
        """
        if event == Event.ADMITTED:
            assert admission is not None
            req.num_cached = req.num_prefilled = admission.cached_tokens
            req.state_slot = self.runner.take_slot()
            if self.noise.uses_generator or not req.params.greedy:
                seed = req.params.seed if req.params.seed is not None else self.seed * 1_000_003 + req.seq
                req.generator = torch.Generator(device=self.device).manual_seed(reduce_seed(seed))
            req.stage = Stage.PREFILL  # the scheduler already queued it for this step's prefill
            self._emit(req, "admitted")
        elif event == Event.CHUNK_DONE:
            req.num_prefilled += chunk
            self.blocks.publish(req.request_id, req.num_prefilled, len(req.prompt))
            if req.num_prefilled == len(req.prompt):
                req.loops_done = self.max_loops  # the first output token always has full depth
                self._move(req, Stage.CODA)
            else:
                self._move(req, Stage.PREFILL)
        elif event == Event.PRELUDE_DONE:
            req.loops_done, req.remaining_probability = 0, 1.0
            self._move(req, Stage.RECURRENT)
        elif event == Event.LOOP_DONE:
            req.loops_done += 1
            decision = self.exit_policy.decide(req.loops_done, req.remaining_probability, gate)
            req.remaining_probability = decision.remaining_probability
            if not decision.exited:
                self._move(req, Stage.RECURRENT)
            else:
                if req.loops_done < self.max_loops:
                    self._early_exits.append(req)  # its KV slot is copied deeper before the step ends
                self._move(req, Stage.CODA)
        elif event == Event.LOOP_SUBMITTED:  # async gate: continue until the gate is read
            req.loops_done += 1
            self._move(req, Stage.CODA if req.loops_done >= self.max_loops else Stage.RECURRENT)
        elif event == Event.GATE_READ:  # the decision of loop `loop`, read one step late
            decision = self.exit_policy.decide(loop, req.remaining_probability, gate)
            req.remaining_probability = decision.remaining_probability
            if decision.exited and loop < self.max_loops:
                if req.loops_done > loop:
                    self._rollbacks.append(req)
                req.loops_done = loop
                self._early_exits.append(req)
                req.stage = Stage.CODA
                self.scheduler.requeue(req, Stage.CODA)
        elif event == Event.LOOPS_DONE:  # loop fusion: all loops in one step, no early exit
            req.loops_done = self.max_loops
            self._move(req, Stage.CODA)
        elif event == Event.TOKEN:
            return self._emit_token(req, token)
        elif event == Event.DECODED:
            req.loops_done = self.max_loops
            return self._emit_token(req, token)
        elif event == Event.TOKEN_SUBMITTED:  # a placeholder until the token is read
            req.loops_done = self.max_loops
            req.outputs.append(PENDING_TOKEN)
            req.exit_depths.append(req.loops_done)
            if len(req.outputs) < req.params.max_tokens:
                self._move(req, Stage.RECURRENT)
        elif event == Event.TOKEN_READ:
            req.outputs[index] = token
            return self._token_known(req, index, requeue=False)
        elif event == Event.ABORTED:
            self._finish(req, "abort")
        return None

    def _emit_token(self, req: Request, token: int) -> TokenOutput:
        req.outputs.append(token)
        req.exit_depths.append(req.loops_done)
        return self._token_known(req, len(req.outputs) - 1, requeue=True)

    def _token_known(self, req: Request, index: int, requeue: bool) -> TokenOutput:
        """Output `index` of the request is known on the host: count it, report it, stop the request on
        EOS or at max_tokens (dropping any later token an async step already ran), else `requeue` it for
        its next token (an async row is queued already)."""
        token, depth = req.outputs[index], req.exit_depths[index]
        self.stats.output_tokens += 1
        reason = None
        stops = req.params.stop_token_ids or ()  # stop whatever ignore_eos says (vLLM)
        if (not req.params.ignore_eos and token in self.spec.eos_token_ids) or token in stops:
            reason = "stop"
        elif index + 1 >= req.params.max_tokens:
            reason = "length"
        logprob = top = None
        if req.params.logprobs is not None and req.logprob_records:  # one record per token, in order
            rec = req.logprob_records.pop(0)
            logprob = float(rec.chosen)
            top = list(zip(rec.top_ids.tolist(), rec.top_values.tolist()))
        if self.hooks.active:
            kind = "first_token" if index == 0 else "token"
            now = time.perf_counter()
            self.hooks.request_event(RequestEvent(kind, req.request_id, now, token, exit_depth=depth))
        if reason is not None:
            del req.outputs[index + 1 :], req.exit_depths[index + 1 :]
            self._finish(req, reason)
        elif requeue:
            self._move(req, self.decode_entry)
        return TokenOutput(req.request_id, token, reason is not None, reason, depth, logprob, top)

    def _move(self, req: Request, stage: Stage) -> None:
        req.stage = stage
        self.scheduler.enqueue(req, stage)

    def _finish(self, req: Request, reason: str) -> None:
        while req.outputs and req.outputs[-1] == PENDING_TOKEN:  # aborted with tokens unread: never read
            req.outputs.pop()
            req.exit_depths.pop()
        self.scheduler.remove(req)
        req.stage, req.finish_reason = Stage.FINISHED, reason
        self.blocks.free_request(req.request_id)
        if req.state_slot >= 0:
            self.runner.release_slot(req.state_slot)
            req.state_slot = -1
        self._emit(req, "aborted" if reason == "abort" else "finished", reason=reason)

    def _emit(self, req: Request, kind: str, reason: str | None = None) -> None:
        if self.hooks.active:
            self.hooks.request_event(RequestEvent(kind, req.request_id, time.perf_counter(), reason=reason))

    def _label(self, batch: Batch) -> str:
        """The step's stage name for observers and stats: `token` for a whole-token decode step."""
        return "token" if self.plan.whole_token and batch.stage == Stage.RECURRENT else batch.stage.value

    def _step_info(self, batch: Batch) -> StepInfo:
        loops = [r.loops_done for r in batch.requests] if batch.stage == Stage.RECURRENT else []
        ids = [r.request_id for r in batch.requests]
        return StepInfo(self.stats.steps, self._label(batch), ids, batch.num_rows, loops)

    def _step_result(self, batch: Batch, outputs: list[TokenOutput], elapsed: float) -> StepResult:
        graph_stage = batch.stage in (Stage.RECURRENT, Stage.CODA)
        return StepResult(
            self.stats.steps,
            self._label(batch),
            batch.num_rows,
            elapsed,
            graph_mode=self.runner.last_graph_mode if graph_stage else None,
            fallback_reason=self.runner.last_fallback if graph_stage else None,
            new_tokens=len(outputs),
            finished=[o.request_id for o in outputs if o.finished],
        )

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

    def _step_modes(self) -> contextlib.ExitStack:
        """The modes every step's kernels run under: SDPA's backend pin and the launch mode (kernels.pdl,
        kernels.gemv_preload, kernels.attn_prefetch).
        CUDA graphs keep the mode they were captured with."""
        stack = contextlib.ExitStack()
        stack.enter_context(attention_backend(self.device))
        stack.enter_context(launch_mode.entered(self.plan.launch))
        return stack

    def graph_bodies(self) -> list[tuple[str, int, Callable[[], None]]]:
        """(graph name, rows, thunk) for every captured CUDA graph; the thunk runs the graph's body eagerly
        (see GraphCache.run_body_eagerly) under the same modes as an engine step."""
        out = []
        r = self.runner
        for cache in (r.recurrent_graphs, r.fused_graphs, r.coda_graphs, r.token_graphs, r.prefill_graphs):
            if cache is None:
                continue
            for rows in list(cache.entries):

                def thunk(cache=cache, rows=rows) -> None:
                    with torch.inference_mode(), self._step_modes():
                        cache.run_body_eagerly(rows)

                out.append((cache.name, rows, thunk))
        return out

    def graph_counters(self) -> dict:
        out = {}
        caches = (
            ("recurrent", self.runner.recurrent_graphs),
            ("recurrent_fused", self.runner.fused_graphs),
            ("coda", self.runner.coda_graphs),
            ("whole_token", self.runner.token_graphs),
            ("prefill", self.runner.prefill_graphs),
        )
        for name, cache in caches:
            if cache is not None:
                out[name] = cache.counters.as_dict()
        return out

    def snapshot(self) -> EngineSnapshot:
        """Queues, requests, step counts, KV, graphs, prefix cache and decode mode, read between steps (no
        device sync): what clients may know of the engine (engine/snapshot.py)."""
        return snapshot_engine(self)
