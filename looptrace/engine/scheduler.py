"""Scheduler: stage queues, the per-step stage choice, admission by block budget.

A batch is always one stage: prefill never shares a launch with decode, nor prelude/coda with the core.
Recurrent batches mix depths (each row reads its own plane). The scheduler owns queues and progress;
the runner owns tensors; the block manager owns blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from looptrace.engine.config import SchedulerConfig
from looptrace.engine.kv_cache import BlockManager
from looptrace.engine.request import Request, Stage

DECODE_STAGES = (Stage.PRELUDE, Stage.RECURRENT, Stage.CODA)


@dataclass
class PrefillSpan:
    request: Request
    start: int  # first prompt position of the chunk
    length: int

    @property
    def is_last_chunk(self) -> bool:
        return self.start + self.length == len(self.request.prompt)


@dataclass
class Batch:
    stage: Stage
    requests: list[Request]
    spans: list[PrefillSpan] = field(default_factory=list)  # PREFILL only

    @property
    def num_rows(self) -> int:
        return sum(s.length for s in self.spans) if self.stage == Stage.PREFILL else len(self.requests)


class RefillPolicy:
    """Base engine default: (1) PRELUDE if queued; (2) CODA if enough rows or no recurrent work;
    (3) RECURRENT if decode is due; (4) admit, then PREFILL; (5) PRELUDE, CODA, RECURRENT."""

    def choose(self, s: Scheduler) -> Stage | None:
        q, cfg = s.queues, s.cfg
        if q[Stage.PRELUDE]:
            return Stage.PRELUDE
        if q[Stage.CODA] and (len(q[Stage.CODA]) >= cfg.min_coda_batch_size or not q[Stage.RECURRENT]):
            return Stage.CODA
        if q[Stage.RECURRENT] and s.prefill_batches_since_recurrent >= cfg.max_prefill_batches_before_decode:
            return Stage.RECURRENT
        s.admit()
        if q[Stage.PREFILL]:
            return Stage.PREFILL
        for stage in (Stage.PRELUDE, Stage.CODA, Stage.RECURRENT):
            if q[stage]:
                return stage
        return None


class NoRefillPolicy:
    """Cohorts: admit only when nothing runs; fill (prefill, prelude) -> core -> coda."""

    def choose(self, s: Scheduler) -> Stage | None:
        if not s.running:
            s.admit()
        for stage in (Stage.PREFILL, Stage.PRELUDE, Stage.RECURRENT, Stage.CODA):
            if s.queues[stage]:
                return stage
        return None


POLICIES = {"refill": RefillPolicy, "norefill": NoRefillPolicy}


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, watermark_blocks: int) -> None:
        self.cfg, self.blocks, self.watermark = cfg, blocks, watermark_blocks
        self.policy = POLICIES[cfg.policy]()
        self.waiting: deque[Request] = deque()
        self.queues: dict[Stage, deque[Request]] = {st: deque() for st in (Stage.PREFILL, *DECODE_STAGES)}
        self.running: dict[str, Request] = {}
        self.prefill_batches_since_recurrent = 0
        self.on_admit = None  # callback(request, cached_tokens), set by the engine

    # Queues ---------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def enqueue(self, req: Request, stage: Stage, front: bool = False) -> None:
        req.stage = stage
        (self.queues[stage].appendleft if front else self.queues[stage].append)(req)

    def remove(self, req: Request) -> None:
        """Abort at any stage: drop from whichever queue holds it."""
        for q in (self.waiting, *self.queues.values()):
            if req in q:
                q.remove(req)
        self.running.pop(req.request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.queues.values())

    # Admission ------------------------------------------------------------------------------------------
    def admit(self) -> None:
        """FCFS (or priority) scan of at most `admission_scan_limit` waiting requests; a request that does
        not fit may be bypassed at most `max_admission_bypasses` times, then it blocks the queue."""
        if not self.waiting:
            return
        order = list(self.waiting)
        if self.cfg.admission == "priority":
            order.sort(key=lambda r: (r.params.priority, r.seq))
        blocked: Request | None = None
        for req in order[: self.cfg.admission_scan_limit]:
            if self.blocks.can_admit(req.request_id, req.prompt, req.max_kv_tokens, self.watermark):
                self._admit_one(req)
                if blocked is not None:
                    blocked.admission_bypasses += 1
                    if blocked.admission_bypasses >= self.cfg.max_admission_bypasses:
                        return
            elif blocked is None:
                blocked = req
                if req.admission_bypasses >= self.cfg.max_admission_bypasses:
                    return

    def _admit_one(self, req: Request) -> None:
        self.waiting.remove(req)
        cached = self.blocks.admit(req.request_id, req.prompt, req.max_kv_tokens)
        req.num_cached = req.num_prefilled = cached
        self.running[req.request_id] = req
        if self.on_admit is not None:
            self.on_admit(req, cached)
        self.enqueue(req, Stage.PREFILL)

    # Batches --------------------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        stage = self.policy.choose(self)
        if stage is None:
            return None
        batch = self._take_prefill() if stage == Stage.PREFILL else self._take_rows(stage)
        if not batch.requests:
            return None
        if stage == Stage.PREFILL:
            self.prefill_batches_since_recurrent += 1
        elif stage == Stage.RECURRENT:
            self.prefill_batches_since_recurrent = 0
        return batch

    def _take_rows(self, stage: Stage) -> Batch:
        q, taken = self.queues[stage], []
        for _ in range(len(q)):  # scan at most the initial queue length
            if len(taken) >= self.cfg.max_num_seqs or len(taken) >= self.cfg.max_num_batched_tokens:
                break
            req = q.popleft()
            # PRELUDE appends one KV position (the token being fed back): claim a page if needed.
            if stage == Stage.PRELUDE and not self.blocks.ensure_capacity(
                req.request_id, req.decode_position + 1
            ):
                q.append(req)  # requeue at the tail
                continue
            taken.append(req)
        return Batch(stage, taken)

    def _take_prefill(self) -> Batch:
        q, spans, budget = self.queues[Stage.PREFILL], [], self.cfg.max_num_batched_tokens
        for _ in range(len(q)):
            if budget <= 0 or len(spans) >= self.cfg.max_num_seqs:
                break
            req = q.popleft()
            length = min(budget, self.cfg.prefill_chunk_size, len(req.prompt) - req.num_prefilled)
            if not self.blocks.ensure_capacity(req.request_id, req.num_prefilled + length):
                q.append(req)
                continue
            spans.append(PrefillSpan(req, req.num_prefilled, length))
            budget -= length
        return Batch(Stage.PREFILL, [s.request for s in spans], spans)
