"""The request lifecycle: the one place a request's stage and progress change, as a table of event
handlers (`EVENT_HANDLERS`: one small method per `Event`).

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

The scheduler only keeps queues, the runner only computes, exit policies only decide; the engine's stage
runs (decode_modes.py) call `advance` with each row's result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from looptrace.engine.hooks import HookDispatcher, RequestEvent
from looptrace.engine.kv_cache import BlockManager
from looptrace.engine.model_config import ModelSpec
from looptrace.engine.plan import EnginePlan
from looptrace.engine.request import Event, Request, Stage, TokenOutput, reduce_seed
from looptrace.engine.runner import ModelRunner
from looptrace.engine.scheduler import Admission, Scheduler
from looptrace.engine.scoring import read_prompt_logprobs

PENDING_TOKEN = -1  # async decode: an output whose token the host has not read yet


@dataclass
class EngineStats:
    steps: int = 0
    submissions: int = 0
    output_tokens: int = 0
    steps_by_stage: dict[str, int] = field(default_factory=dict)


class RequestLifecycle:
    """Applies events to requests. Early exits and rollbacks found while applying a step's events are
    collected in `early_exits` / `rollbacks` for the stage run to hand to the runner in one batch."""

    def __init__(
        self,
        spec: ModelSpec,
        plan: EnginePlan,
        scheduler: Scheduler,
        blocks: BlockManager,
        runner: ModelRunner,
        hooks: HookDispatcher,
        stats: EngineStats,
        *,
        device: torch.device,
        seed: int,
        noise,
    ) -> None:
        self.spec, self.plan, self.scheduler, self.blocks, self.runner = spec, plan, scheduler, blocks, runner
        self.hooks, self.stats = hooks, stats
        self.device, self.seed, self.noise = device, seed, noise
        self.max_loops, self.exit_policy = plan.max_loops, plan.exit_policy
        self.early_exits: list[Request] = []
        self.rollbacks: list[Request] = []
        self.failures: list[tuple[str, str]] = []  # (request id, why) failed alone: LLMEngine.take_failures

    def advance(self, req: Request, event: Event, **detail) -> TokenOutput | None:
        """Apply one event (with its detail: admission, chunk, gate, loop, token, index) to a request;
        returns the token output where the event made one known."""
        return EVENT_HANDLERS[event](self, req, **detail)

    # One handler per event --------------------------------------------------------------------------------
    def _admitted(self, req: Request, *, admission: Admission) -> None:
        req.num_cached = req.num_prefilled = admission.cached_tokens
        req.state_slot = self.runner.take_slot()
        if self.noise.uses_generator or not req.params.greedy:
            seed = req.params.seed if req.params.seed is not None else self.seed * 1_000_003 + req.seq
            req.generator = torch.Generator(device=self.device).manual_seed(reduce_seed(seed))
        req.stage = Stage.PREFILL  # the scheduler already queued it for this step's prefill
        self.emit(req, "admitted")

    def _chunk_done(self, req: Request, *, chunk: int) -> None:
        req.num_prefilled += chunk
        self.blocks.publish(req.request_id, req.num_prefilled, len(req.prompt))
        if req.num_prefilled == len(req.prompt):
            req.loops_done = self.max_loops  # the first output token always has full depth
            self.move(req, Stage.CODA)
        else:
            self.move(req, Stage.PREFILL)

    def _prelude_done(self, req: Request) -> None:
        req.loops_done, req.remaining_probability = 0, 1.0
        self.move(req, Stage.RECURRENT)

    def _loop_done(self, req: Request, *, gate: float | None) -> None:
        req.loops_done += 1
        decision = self.exit_policy.decide(req.loops_done, req.remaining_probability, gate)
        req.remaining_probability = decision.remaining_probability
        if not decision.exited:
            self.move(req, Stage.RECURRENT)
            return
        if req.loops_done < self.max_loops:
            self.early_exits.append(req)  # its KV slot is copied deeper before the step ends
        self.move(req, Stage.CODA)

    def _loop_submitted(self, req: Request) -> None:
        """Async gate: continue until the gate is read."""
        req.loops_done += 1
        self.move(req, Stage.CODA if req.loops_done >= self.max_loops else Stage.RECURRENT)

    def _gate_read(self, req: Request, *, gate: float, loop: int) -> None:
        """The decision of loop `loop`, read one step late."""
        decision = self.exit_policy.decide(loop, req.remaining_probability, gate)
        req.remaining_probability = decision.remaining_probability
        if decision.exited and loop < self.max_loops:
            if req.loops_done > loop:
                self.rollbacks.append(req)
            req.loops_done = loop
            self.early_exits.append(req)
            req.stage = Stage.CODA
            self.scheduler.requeue(req, Stage.CODA)

    def _loops_done(self, req: Request) -> None:
        """Loop fusion: all loops in one step, no early exit."""
        req.loops_done = self.max_loops
        self.move(req, Stage.CODA)

    def _token(self, req: Request, *, token: int) -> TokenOutput:
        return self.emit_token(req, token)

    def _decoded(self, req: Request, *, token: int) -> TokenOutput:
        req.loops_done = self.max_loops
        return self.emit_token(req, token)

    def _token_submitted(self, req: Request) -> None:
        """Async decode: a placeholder until the token is read."""
        req.loops_done = self.max_loops
        req.outputs.append(PENDING_TOKEN)
        req.exit_depths.append(req.loops_done)
        if len(req.outputs) < req.params.max_tokens:
            self.move(req, Stage.RECURRENT)

    def _token_read(self, req: Request, *, token: int, index: int) -> TokenOutput:
        req.outputs[index] = token
        return self.token_known(req, index, requeue=False)

    def _aborted(self, req: Request) -> None:
        self.finish(req, "abort")

    # What the handlers share ----------------------------------------------------------------------------
    def emit_token(self, req: Request, token: int) -> TokenOutput:
        req.outputs.append(token)
        req.exit_depths.append(req.loops_done)
        return self.token_known(req, len(req.outputs) - 1, requeue=True)

    def token_known(self, req: Request, index: int, requeue: bool) -> TokenOutput:
        """Output `index` of the request is known on the host: count it, report it, stop the request on
        EOS or at max_tokens (dropping any later token an async step already ran), else `requeue` it for
        its next token (an async row is queued already)."""
        token, depth = req.outputs[index], req.exit_depths[index]
        self.stats.output_tokens += 1
        reason = self._stop_reason(req, token, index)
        logprob = top = None
        if req.params.logprobs is not None and req.logprob_records:  # one record per token, in order
            rec = req.logprob_records.pop(0)
            logprob = float(rec.chosen)
            top = list(zip(rec.top_ids.tolist(), rec.top_values.tolist()))
        prompt = read_prompt_logprobs(req) if index == 0 and req.params.prompt_logprobs is not None else None
        if self.hooks.active:
            kind = "first_token" if index == 0 else "token"
            now = time.perf_counter()
            self.hooks.request_event(RequestEvent(kind, req.request_id, now, token, exit_depth=depth))
        if reason is not None:
            del req.outputs[index + 1 :], req.exit_depths[index + 1 :]
            self.finish(req, reason)
        elif requeue:
            self.move(req, self.plan.decode_entry)
        return TokenOutput(req.request_id, token, reason is not None, reason, depth, logprob, top, prompt)

    def _stop_reason(self, req: Request, token: int, index: int) -> str | None:
        stops = req.params.stop_token_ids or ()  # stop whatever ignore_eos says (vLLM)
        if (not req.params.ignore_eos and token in self.spec.eos_token_ids) or token in stops:
            return "stop"
        return "length" if index + 1 >= req.params.max_tokens else None

    def move(self, req: Request, stage: Stage) -> None:
        req.stage = stage
        self.scheduler.enqueue(req, stage)

    def finish(self, req: Request, reason: str) -> None:
        while req.outputs and req.outputs[-1] == PENDING_TOKEN:  # aborted with tokens unread: never read
            req.outputs.pop()
            req.exit_depths.pop()
        self.scheduler.remove(req)
        req.stage, req.finish_reason = Stage.FINISHED, reason
        self.blocks.free_request(req.request_id)
        if req.state_slot >= 0:
            self.runner.release_slot(req.state_slot)
            req.state_slot = -1
        self.emit(req, "aborted" if reason == "abort" else "finished", reason=reason)

    def fail(self, req: Request, exc: BaseException) -> None:
        """Finish a request with reason "error" (its KV freed) and keep why for `take_failures`."""
        if not req.is_finished:
            self.finish(req, "error")
        self.failures.append((req.request_id, f"{type(exc).__name__}: {exc}"))

    def emit(self, req: Request, kind: str, reason: str | None = None) -> None:
        if self.hooks.active:
            self.hooks.request_event(RequestEvent(kind, req.request_id, time.perf_counter(), reason=reason))


# Event -> its handler; every Event has one (tests/engine/test_request_events.py checks it).
EVENT_HANDLERS: dict[Event, Callable[..., TokenOutput | None]] = {
    Event.ADMITTED: RequestLifecycle._admitted,
    Event.CHUNK_DONE: RequestLifecycle._chunk_done,
    Event.PRELUDE_DONE: RequestLifecycle._prelude_done,
    Event.LOOP_DONE: RequestLifecycle._loop_done,
    Event.LOOP_SUBMITTED: RequestLifecycle._loop_submitted,
    Event.GATE_READ: RequestLifecycle._gate_read,
    Event.LOOPS_DONE: RequestLifecycle._loops_done,
    Event.TOKEN: RequestLifecycle._token,
    Event.DECODED: RequestLifecycle._decoded,
    Event.TOKEN_SUBMITTED: RequestLifecycle._token_submitted,
    Event.TOKEN_READ: RequestLifecycle._token_read,
    Event.ABORTED: RequestLifecycle._aborted,
}
