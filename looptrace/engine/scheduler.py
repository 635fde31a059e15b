"""Scheduler: stage queues, the per-step stage choice, admission by block budget.

A batch is always one stage: prefill never shares a launch with decode, nor prelude/coda with the core.
Recurrent batches mix depths (each row reads its own plane). The scheduler decides (queues, admission,
which rows form the batch); the runner computes; the engine applies the results to requests and moves them
between stages; the block manager owns blocks.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass

from looptrace.engine.config import SchedulerConfig
from looptrace.engine.kv_cache import BlockManager
from looptrace.engine.request import Batch, PrefillSpan, Request, Stage

DECODE_STAGES = (Stage.PRELUDE, Stage.RECURRENT, Stage.CODA)


@dataclass
class Admission:
    request: Request
    cached_tokens: int  # prompt tokens served by the prefix cache


@dataclass(frozen=True)
class QueueView:
    """What a stage policy sees. Policies are pure functions of it."""

    prefill: int
    prelude: int
    recurrent: int
    coda: int
    decode_due: bool  # enough prefill batches since the last recurrent step
    running: int  # admitted and not finished


ADMIT = "admit"  # a policy's answer: run admission, then ask `after_admission`


class RefillPolicy:
    """Base engine default: (1) PRELUDE if queued; (2) CODA if enough rows or no recurrent work;
    (3) RECURRENT if decode is due; (4) admit, then PREFILL; (5) PRELUDE, CODA, RECURRENT."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.min_coda = cfg.min_coda_batch_size

    def choose(self, v: QueueView) -> Stage | str | None:
        if v.prelude:
            return Stage.PRELUDE
        if v.coda and (v.coda >= self.min_coda or not v.recurrent):
            return Stage.CODA
        if v.recurrent and v.decode_due:
            return Stage.RECURRENT
        return ADMIT

    def after_admission(self, v: QueueView) -> Stage | None:
        for stage, n in (
            (Stage.PREFILL, v.prefill),
            (Stage.PRELUDE, v.prelude),
            (Stage.CODA, v.coda),
            (Stage.RECURRENT, v.recurrent),
        ):
            if n:
                return stage
        return None


class NoRefillPolicy:
    """Cohorts: admit only when nothing runs; fill (prefill, prelude) -> core -> coda."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        pass

    def choose(self, v: QueueView) -> Stage | str | None:
        return ADMIT if not v.running else self.after_admission(v)

    def after_admission(self, v: QueueView) -> Stage | None:
        for stage, n in (
            (Stage.PREFILL, v.prefill),
            (Stage.PRELUDE, v.prelude),
            (Stage.RECURRENT, v.recurrent),
            (Stage.CODA, v.coda),
        ):
            if n:
                return stage
        return None


POLICIES = {"refill": RefillPolicy, "norefill": NoRefillPolicy}


class Scheduler:
    """Owns the queues (which request waits where), admission and the KV claims of a batch. It never
    changes a request's stage or progress: the engine applies every transition (`LLMEngine._advance`) and
    places the request with `enqueue`."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        watermark_blocks: int,
        fused_loops: int = 1,
        position_stage: Stage = Stage.PRELUDE,
    ) -> None:
        self.cfg, self.blocks, self.watermark = cfg, blocks, watermark_blocks
        # The stage whose batch appends a decode position (PRELUDE; RECURRENT under whole-token decode):
        # taking a row into it claims the page that position needs.
        self.position_stage = position_stage
        # Prefill batches allowed between two recurrent steps. With prefill share, an L-loop fused step
        # is followed by up to L prefill batches (ExactLoop: fusion would otherwise admit L x less often).
        self.prefill_allowance = cfg.max_prefill_batches_before_decode
        if cfg.prefill_share:
            self.prefill_allowance *= fused_loops
        self.policy = POLICIES[cfg.policy](cfg)
        self.waiting: deque[Request] = deque()
        self.queues: dict[Stage, deque[Request]] = {st: deque() for st in (Stage.PREFILL, *DECODE_STAGES)}
        self.running: dict[str, Request] = {}  # admitted, not finished: at most cfg.max_num_seqs
        self.bypasses: dict[str, int] = {}  # times a waiting request was passed over at admission
        self.prefill_batches_since_recurrent = 0

    # Queues ---------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def enqueue(self, req: Request, stage: Stage) -> None:
        """Place a request at the tail of a stage queue (round-robin: an unfinished prefill goes behind
        the requests already waiting for a chunk)."""
        self.queues[stage].append(req)

    def requeue(self, req: Request, stage: Stage) -> None:
        """Move a queued request to the tail of another stage queue (a late exit decision)."""
        for q in self.queues.values():
            if req in q:
                q.remove(req)
        self.queues[stage].append(req)

    def remove(self, req: Request) -> None:
        """Finish or abort at any stage: drop from whichever queue holds it."""
        for q in (self.waiting, *self.queues.values()):
            if req in q:
                q.remove(req)
        self.running.pop(req.request_id, None)
        self.bypasses.pop(req.request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.queues.values())

    # Admission ------------------------------------------------------------------------------------------
    def admit(self) -> list[Admission]:
        """FCFS (or priority) scan of at most `admission_scan_limit` waiting requests while fewer than
        `max_num_seqs` run; a request that does not fit may be bypassed at most `max_admission_bypasses`
        times, then it blocks the queue. Admitted requests claim their blocks and join the PREFILL queue."""
        if not self.waiting:
            return []
        limit = self.cfg.admission_scan_limit
        if self.cfg.admission == "priority":
            order = heapq.nsmallest(limit, self.waiting, key=lambda r: (r.params.priority, r.seq))
        else:  # the head of the queue only: a long queue costs nothing per step
            order = list(itertools.islice(self.waiting, limit))
        admitted: list[Admission] = []
        blocked: Request | None = None
        for req in order:
            if len(self.running) >= self.cfg.max_num_seqs:
                break
            if self.blocks.can_admit(
                req.request_id, req.prompt, req.max_kv_tokens, self.watermark, req.prefix_salt
            ):
                admitted.append(self._admit_one(req))
                if blocked is not None:
                    n = self.bypasses[blocked.request_id] = self.bypasses.get(blocked.request_id, 0) + 1
                    if n >= self.cfg.max_admission_bypasses:
                        break
            elif blocked is None:
                blocked = req
                if self.bypasses.get(req.request_id, 0) >= self.cfg.max_admission_bypasses:
                    break
        return admitted

    def _admit_one(self, req: Request) -> Admission:
        self.waiting.remove(req)
        self.bypasses.pop(req.request_id, None)
        cached = self.blocks.admit(req.request_id, req.prompt, req.max_kv_tokens, req.prefix_salt)
        self.running[req.request_id] = req
        self.queues[Stage.PREFILL].append(req)
        return Admission(req, cached)

    # Batches --------------------------------------------------------------------------------------------
    def view(self) -> QueueView:
        q = self.queues
        return QueueView(
            prefill=len(q[Stage.PREFILL]),
            prelude=len(q[Stage.PRELUDE]),
            recurrent=len(q[Stage.RECURRENT]),
            coda=len(q[Stage.CODA]),
            decode_due=self.prefill_batches_since_recurrent >= self.prefill_allowance,
            running=len(self.running),
        )

    def choose(self) -> Stage | str | None:
        """The policy's pick for this step: a stage, ADMIT (run `admit`, then `choose_after_admission`),
        or None when nothing can run."""
        return self.policy.choose(self.view())

    def choose_after_admission(self) -> Stage | None:
        return self.policy.after_admission(self.view())

    def take(self, stage: Stage) -> Batch | None:
        """Pop the rows of one batch of `stage` (claiming the KV pages they will write)."""
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
            if stage == self.position_stage and not self.blocks.ensure_capacity(
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
