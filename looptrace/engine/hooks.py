"""The engine's observer interface: how probes, the dashboard and analyses watch without being imported.

The engine calls a dispatcher only when at least one observer is attached (`if hooks.active:`), so with
no observer the engine makes no hook calls at all. Op-level ranges (norm, rope, attention, …) are not
emitted by the engine: every model op is an `nn.Module` with an `op_kind` attribute, and a probe attaches
PyTorch module hooks to the ones it wants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class StepInfo:
    """What the scheduler picked for one engine step (one stage, one submission)."""

    step: int
    stage: str  # "prefill" | "prelude" | "recurrent" | "coda"
    request_ids: list[str]
    num_rows: int  # token rows in the batch (prefill: chunk tokens; others: one per request)
    loop_indices: list[int] = field(default_factory=list)  # recurrent: 0-based loop each row runs
    # Tokens in context of each row's request (prompt + outputs so far): the KV positions its row attends to.
    context_tokens: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    step: int
    stage: str
    num_rows: int
    elapsed_s: float
    # "replay" | "capture" | "eager" for stages that can use CUDA graphs; None otherwise.
    graph_mode: str | None = None
    fallback_reason: str | None = None  # why a graph-able step ran eager
    new_tokens: int = 0  # tokens sampled in this step (coda)
    finished: list[str] = field(default_factory=list)


@dataclass
class RequestEvent:
    kind: str  # "arrived" | "admitted" | "first_token" | "token" | "finished" | "aborted"
    request_id: str
    time: float
    token_id: int | None = None
    reason: str | None = None  # finish reason: "stop" | "length" | "abort"
    exit_depth: int | None = None  # depth of the token just emitted


@dataclass
class DepthEvent:
    """LoopDuet split depth chosen before a step (emitted when depth.* is active): the prefill depth P,
    the decode depth S and the queue age q (s) the controller read (None with a fixed P)."""

    step: int
    time: float
    prefill_loops: int
    decode_loops: int
    queue_age_s: float | None = None
    stage: str | None = None  # the stage of the step about to run (P acts on "prefill" steps)


class Observer:
    """Subclass and override what you need. Set `wants_hidden = True` to receive per-loop hidden states
    (costs a device->host copy per loop, so it is opt-in). Set `wants_logits = True` to receive the coda's
    logits for every sampled token (`on_logits`; also opt-in: a device->host copy per coda step)."""

    wants_hidden: bool = False
    wants_logits: bool = False

    def on_step_begin(self, info: StepInfo) -> None: ...

    def on_step_end(self, result: StepResult) -> None: ...

    def on_request_event(self, event: RequestEvent) -> None: ...

    def on_depth(self, event: DepthEvent) -> None:
        """Split depth (S, P) in force for the next step (LoopDuet; P over time)."""

    def on_loop_begin(self, stage: str, loop_index: int) -> None:
        """loop_index is 0-based; -1 for a recurrent batch whose rows run different loops, or for all loops
        fused into one submission (loop fusion without hidden-state observers)."""

    def on_loop_end(self, stage: str, loop_index: int) -> None: ...

    def on_loop_hidden(
        self, stage: str, loop_index: int, request_ids: list[str], positions: list[int], hidden: torch.Tensor
    ) -> None:
        """hidden: [rows, hidden_size] state after loop `loop_index` (0-based) for each row."""

    def on_logits(self, request_ids: list[str], logits: torch.Tensor) -> None:
        """logits: [rows, vocab] (device, model dtype) the coda step samples from, one row per request."""


class HookDispatcher:
    """Fans events out to observers. The engine checks `active` before building any event."""

    def __init__(self) -> None:
        self.observers: list[Observer] = []
        self.active = False
        self.wants_hidden = False
        self.wants_logits = False

    def attach(self, observer: Observer) -> None:
        self.observers.append(observer)
        self._refresh()

    def detach(self, observer: Observer) -> None:
        self.observers.remove(observer)
        self._refresh()

    def _refresh(self) -> None:
        self.active = bool(self.observers)
        self.wants_hidden = any(o.wants_hidden for o in self.observers)
        self.wants_logits = any(o.wants_logits for o in self.observers)

    def step_begin(self, info: StepInfo) -> None:
        for o in self.observers:
            o.on_step_begin(info)

    def step_end(self, result: StepResult) -> None:
        for o in self.observers:
            o.on_step_end(result)

    def request_event(self, event: RequestEvent) -> None:
        for o in self.observers:
            o.on_request_event(event)

    def depth(self, event: DepthEvent) -> None:
        for o in self.observers:
            o.on_depth(event)

    def loop_begin(self, stage: str, loop_index: int) -> None:
        for o in self.observers:
            o.on_loop_begin(stage, loop_index)

    def loop_end(self, stage: str, loop_index: int) -> None:
        for o in self.observers:
            o.on_loop_end(stage, loop_index)

    def loop_hidden(
        self, stage: str, loop_index: int, request_ids: list[str], positions: list[int], hidden: torch.Tensor
    ) -> None:
        for o in self.observers:
            if o.wants_hidden:
                o.on_loop_hidden(stage, loop_index, request_ids, positions, hidden)

    def logits(self, request_ids: list[str], logits: torch.Tensor) -> None:
        for o in self.observers:
            if o.wants_logits:
                o.on_logits(request_ids, logits)
