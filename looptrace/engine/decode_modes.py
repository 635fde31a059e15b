"""How each stage's batch runs: the runner computes, the lifecycle applies each row's result.

One class per stage (`Prefill`, `Prelude`, `Coda`) and one per decode mode of the RECURRENT stage
(`plan.decode_mode` picks it from `DECODE_MODES`). A decode mode that reads its results one step late owns
its read in flight (`in_flight`): `AsyncGate` a recurrent step's exit gates, `AsyncWholeToken` a whole-token
step's sampled tokens. The engine asks the decode mode to `settle` the read an earlier step left once this
step is submitted behind it, and to `drain` it when nothing is left to submit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looptrace.engine.hooks import HookDispatcher
from looptrace.engine.plan import (
    ASYNC_GATE,
    ASYNC_WHOLE_TOKEN,
    FUSED_LOOPS,
    RECURRENT,
    WHOLE_TOKEN,
    EnginePlan,
)
from looptrace.engine.request import Batch, Event, Request, Stage, TokenOutput
from looptrace.engine.request_events import RequestLifecycle
from looptrace.engine.runner import ModelRunner
from looptrace.engine.runner_parts import PendingRead


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


class StageRun:
    """Runs one stage's batch. A stage run without reads in flight settles and drains nothing."""

    def __init__(
        self, runner: ModelRunner, lifecycle: RequestLifecycle, plan: EnginePlan, hooks: HookDispatcher
    ) -> None:
        self.runner, self.lifecycle, self.plan, self.hooks = runner, lifecycle, plan, hooks
        self.in_flight: PendingLoops | PendingTokens | None = None

    def run(self, batch: Batch) -> list[TokenOutput]:
        raise NotImplementedError

    def settle(self, earlier: PendingLoops | PendingTokens | None) -> list[TokenOutput]:
        """Read what an earlier step left in flight (this step is already submitted behind it)."""
        return []

    def drain(self) -> list[TokenOutput]:
        """No batch to submit: read what is still in flight."""
        return []

    def holds_requests(self) -> bool:
        """Whether a read in flight still decides whether some request goes on."""
        return False


class Prefill(StageRun):
    def run(self, batch: Batch) -> list[TokenOutput]:
        self.runner.prefill(batch.spans)
        for span in batch.spans:
            self.lifecycle.advance(span.request, Event.CHUNK_DONE, chunk=span.length)
        return []


class Prelude(StageRun):
    def run(self, batch: Batch) -> list[TokenOutput]:
        self.runner.prelude(batch.requests)
        for req in batch.requests:
            self.lifecycle.advance(req, Event.PRELUDE_DONE)
        return []


class Coda(StageRun):
    def run(self, batch: Batch) -> list[TokenOutput]:
        tokens = self.runner.coda(batch.requests)
        return [self.lifecycle.advance(req, Event.TOKEN, token=t) for req, t in zip(batch.requests, tokens)]


# Decode modes: how a RECURRENT batch runs ------------------------------------------------------------------
class OneLoop(StageRun):
    """One loop a step, its exit gates read at once (`recurrent`)."""

    def run(self, batch: Batch) -> list[TokenOutput]:
        gates = self.runner.recurrent(batch.requests, self.plan.exit_policy.needs_gate)
        self.lifecycle.early_exits = []
        for i, req in enumerate(batch.requests):
            self.lifecycle.advance(req, Event.LOOP_DONE, gate=gates[i] if gates is not None else None)
        if self.lifecycle.early_exits:  # one batched plane copy for every row that left early
            self.runner.finalize_exits(self.lifecycle.early_exits)
        return []


class AsyncGate(OneLoop):
    """One loop a step whose exit gates are read one step late (`async_gate`); observers of hidden states
    see no speculative loop, so under one the loop runs with its gates read at once."""

    def run(self, batch: Batch) -> list[TokenOutput]:
        if self.hooks.wants_hidden:
            if self.in_flight is not None:
                self._read_gates(self.in_flight)
            return super().run(batch)
        gate = self.runner.recurrent(batch.requests, True, defer=True)
        for req in batch.requests:
            self.lifecycle.advance(req, Event.LOOP_SUBMITTED)
        self.in_flight = PendingLoops(gate, [(req, req.loops_done) for req in batch.requests])
        return []

    def settle(self, earlier: PendingLoops | None) -> list[TokenOutput]:
        if earlier is not None:
            self._read_gates(earlier)
        return []

    def drain(self) -> list[TokenOutput]:
        if self.in_flight is not None:
            with torch.inference_mode():
                self._read_gates(self.in_flight)
        return []

    def _read_gates(self, pending: PendingLoops) -> None:
        """Apply the exit decisions of an earlier recurrent step. A row that exited there but ran one more
        loop since is rolled back; every early exit copies its KV slot deeper."""
        if pending.resolved:
            return
        pending.resolved = True
        life = self.lifecycle
        life.early_exits, life.rollbacks = [], []
        for (req, loop), gate in zip(pending.rows, pending.gate.result()):
            if req.stage != Stage.FINISHED and req.loops_done >= loop:  # not aborted, not rolled back
                life.advance(req, Event.GATE_READ, gate=gate, loop=loop)
        if life.rollbacks:
            self.runner.rollback(life.rollbacks)
        if life.early_exits:
            self.runner.finalize_exits(life.early_exits)
        if self.in_flight is pending:
            self.in_flight = None


class FusedLoops(StageRun):
    """Every loop of a fresh decode row in one step (`fused_loops`); prelude and coda run apart."""

    def run(self, batch: Batch) -> list[TokenOutput]:
        self.runner.recurrent_fused(batch.requests)
        for req in batch.requests:
            self.lifecycle.advance(req, Event.LOOPS_DONE)
        return []


class WholeToken(StageRun):
    """Prelude, every loop and the coda in one step (`whole_token`)."""

    def run(self, batch: Batch) -> list[TokenOutput]:
        outputs = []
        if self.in_flight is not None:  # the phases below need every input token on the host
            outputs = self._read_tokens(self.in_flight)
        requests = [req for req in batch.requests if not req.is_finished]  # stopped just now: dropped
        if not requests:
            return outputs
        tokens = self.runner.whole_token(requests)
        decoded = [self.lifecycle.advance(req, Event.DECODED, token=t) for req, t in zip(requests, tokens)]
        return outputs + decoded

    def settle(self, earlier: PendingTokens | None) -> list[TokenOutput]:
        if earlier is not None and not earlier.resolved:
            return self._read_tokens(earlier)
        return []

    def drain(self) -> list[TokenOutput]:
        return self._read_tokens(self.in_flight) if self.in_flight is not None else []

    def holds_requests(self) -> bool:
        return self.in_flight is not None

    def _read_tokens(self, pending: PendingTokens) -> list[TokenOutput]:
        """The tokens of an earlier whole-token step reach the host. A row that stopped there (EOS, stop)
        and ran one more token since drops it."""
        pending.resolved = True
        if self.in_flight is pending:
            self.in_flight = None
        outputs = []
        for (req, index), token in zip(pending.rows, pending.tokens.result()):
            if not req.is_finished:  # not aborted, not stopped by an earlier token
                outputs.append(self.lifecycle.advance(req, Event.TOKEN_READ, token=token, index=index))
        return outputs


class AsyncWholeToken(WholeToken):
    """Whole-token steps submitted before the last one's tokens are read (`async_whole_token`), where the
    batch allows it."""

    def run(self, batch: Batch) -> list[TokenOutput]:
        if not self._defers(batch):
            return super().run(batch)
        pending = self.runner.whole_token(batch.requests, defer=True)
        rows = [(req, len(req.outputs)) for req in batch.requests]
        for req in batch.requests:
            self.lifecycle.advance(req, Event.TOKEN_SUBMITTED)
        self.in_flight = PendingTokens(pending, rows)
        return []

    def _defers(self, batch: Batch) -> bool:
        """Whether the batch can run without its tokens read first: one graph pass (the phases of a larger
        batch, or under a hidden-state observer, need every input token on the host)."""
        return (
            len(batch.requests) <= self.plan.whole_token_max_rows
            and not self.hooks.wants_hidden
            and not any(r.params.processes_logits for r in batch.requests)  # penalties read past tokens
        )


STAGE_RUNS: dict[Stage, type[StageRun]] = {Stage.PREFILL: Prefill, Stage.PRELUDE: Prelude, Stage.CODA: Coda}
# plan.decode_mode -> how a RECURRENT batch runs
DECODE_MODES: dict[str, type[StageRun]] = {
    ASYNC_WHOLE_TOKEN: AsyncWholeToken,
    WHOLE_TOKEN: WholeToken,
    FUSED_LOOPS: FusedLoops,
    ASYNC_GATE: AsyncGate,
    RECURRENT: OneLoop,
}
