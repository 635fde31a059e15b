"""The engine thread: the only code that touches the engine while the server runs.

HTTP handlers call `submit()` / `abort()`, which put a command on a thread-safe queue and return; the thread
drains the queue between engine steps, steps the engine while it has work, and hands every event of a
request (accepted, token, error) to that request's `sink`, a callable the handler gives it (the
server's sink moves the event onto the handler's asyncio queue with `call_soon_threadsafe`). An abort is
applied before the next step, so a disconnected client's KV blocks are freed within one engine step.

Fair admission. A submission joins its group's backlog (a group: the sequences of one HTTP request, its
prompts x n choices), not the engine's queue. Before each step the thread moves sequences from the backlogs
into the engine while it has a free slot (scheduler.max_num_seqs), taking one sequence from each group in
turn, and never lets one group hold more than GROUP_SHARE of the slots. A request of 256 sequences thus
shares the engine with a 1-sequence request that arrives after it, instead of queueing it behind all 256
(the engine's own queue is first come, first served). A sequence is `Accepted` when it joins the backlog
(a stream starts at once); the server checked it as the engine will, so an engine rejection at admission is
a bug that fails that sequence alone (a 400 error event).

Failure isolation. An exception while adding or admitting one request fails that request alone (the
engine finishes it with reason "error" and frees its KV). A batched forward cannot be blamed on one row:
a failed step fails the requests of that step (`StepError`), the others go on. An exception the engine
does not attribute (its state is then unknown) fails every request in flight. After
MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row, or any exception escaping the loop itself, the
engine is dead: every pending and later request gets a 503 at once, `alive` turns False (/health 503)
and `on_dead` is called (the server then exits non-zero so a supervisor restarts it).

Shutdown. `begin_drain(timeout)` refuses new requests (503) and lets those in flight finish; at the
deadline the rest get a 503 error event (a stream then ends with it and `[DONE]`).

The thread also publishes a stats snapshot (a plain dict, replaced whole, so readers never see a
half-built one) every `snapshot_interval` seconds and whenever the engine goes idle: /metrics, /v1/stats,
the stats stream and the in-process dashboard read it without touching the engine.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from looptrace.engine.request import EngineInputError, PromptLogprob, SamplingParams

if TYPE_CHECKING:
    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.engine.snapshot import (
        EngineSnapshot,
        GraphFamily,
        KVSnapshot,
        PrefixCacheSnapshot,
        StepCounts,
    )

log = logging.getLogger("looptrace.serve")

SCHEMA = "looptrace.stats/1"
LATENCY_WINDOW_S = 60.0  # latency percentiles in a snapshot cover requests of the last minute
MAX_LISTED_REQUESTS = 64
MAX_CONSECUTIVE_STEP_FAILURES = 3  # failed steps in a row, no success between: the engine is broken
# Of the engine's sequence slots, the most one request (group) may hold: the rest stay free for requests
# that arrive later, so they start at the next step rather than after a whole wave of the big one.
GROUP_SHARE = 0.75
# The snapshot's probe section when no live probe runs (the dashboard shows the note).
PROBE_OFF = {
    "off": True,
    "note": "live probe off (serve --probe-interval S turns it on; each window pauses serving: README)",
}


# Events sent to a request's sink ---------------------------------------------------------------------------
@dataclass
class Accepted:
    request_id: str


@dataclass
class TokenEvent:
    token_id: int
    finished: bool
    finish_reason: str | None
    logprob: float | None = None  # SamplingParams.logprobs: see TokenOutput
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # SamplingParams.prompt_logprobs: the first event


@dataclass
class Failed:
    """The request ended without its tokens; `status`/`type`/`code` are the HTTP error to answer with."""

    message: str
    status: int = 500
    type: str = "server_error"
    code: str | None = None


def unavailable(message: str) -> Failed:
    return Failed(message, 503, "server_error", "unavailable")


Event = Accepted | TokenEvent | Failed
Sink = Callable[[Event], None]


# Commands ---------------------------------------------------------------------------------------------------
@dataclass
class _Submit:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    arrival: float
    group: str  # the HTTP request it belongs to: groups are admitted in turn


@dataclass
class _Backlog:
    """Submissions not yet in the engine, a queue per group (insertion order = whose turn is next), and how
    many sequences each group has in the engine now."""

    queues: dict[str, deque[_Submit]] = field(default_factory=dict)
    live: dict[str, int] = field(default_factory=dict)
    group_of: dict[str, str] = field(default_factory=dict)  # request id -> group, while in the engine

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def push(self, cmd: _Submit) -> None:
        self.queues.setdefault(cmd.group, deque()).append(cmd)

    def pop_next(self, cap: int) -> _Submit | None:
        """The next submission of the first group (in turn) holding fewer than `cap` slots."""
        group = next((g for g in self.queues if self.live.get(g, 0) < cap), None)
        if group is None:
            return None
        waiting = self.queues.pop(group)
        cmd = waiting.popleft()
        if waiting:
            self.queues[group] = waiting  # re-inserted last: the other groups go first
        return cmd

    def remove(self, request_id: str) -> _Submit | None:
        for group, waiting in self.queues.items():
            for cmd in waiting:
                if cmd.request_id == request_id:
                    waiting.remove(cmd)
                    if not waiting:
                        del self.queues[group]
                    return cmd
        return None

    def take_all(self) -> list[_Submit]:
        out = [cmd for q in self.queues.values() for cmd in q]
        self.queues.clear()
        return out

    def entered(self, request_id: str, group: str) -> None:
        self.group_of[request_id] = group
        self.live[group] = self.live.get(group, 0) + 1

    def left(self, request_id: str) -> None:
        group = self.group_of.pop(request_id, None)
        if group is not None:
            self.live[group] -= 1
            if not self.live[group]:
                del self.live[group]


@dataclass
class _Abort:
    request_id: str
    reason: str


@dataclass
class _Track:
    """What the loop keeps per live request (timings for the latency metrics)."""

    sink: Sink
    arrival: float
    prompt_len: int
    max_tokens: int
    deadline: float | None = None  # perf_counter time after which the request is aborted (timeout)
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclass
class _Window:
    """(time, value) pairs of the last LATENCY_WINDOW_S seconds."""

    items: deque = field(default_factory=lambda: deque(maxlen=8192))

    def add(self, t: float, v: float) -> None:
        self.items.append((t, v))

    def summary(self, now: float) -> dict[str, float | int | None]:
        while self.items and self.items[0][0] < now - LATENCY_WINDOW_S:
            self.items.popleft()
        if not self.items:
            return {"p50": None, "p99": None, "n": 0}
        v = np.fromiter((x for _, x in self.items), dtype=float)
        p50, p99 = np.percentile(v, [50, 99])
        return {"p50": float(p50), "p99": float(p99), "n": int(v.size)}


class EngineDead(RuntimeError):
    """Raised on the engine thread to end it: the engine cannot be trusted to serve any more."""


@dataclass
class DrainReport:
    """What a shutdown drain did (read after the loop stopped)."""

    in_flight: int = 0  # requests queued or running when the drain began
    ended_at_deadline: int = 0  # of those, ended with an error event at the drain timeout
    request_blocks_at_exit: int | None = None  # KV blocks still held by requests after the stop


class EngineLoop:
    """Owns an engine on a dedicated thread. Thread-safe methods: submit, abort, snapshot, hold, wait_*."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        model_name: str = "looptrace",
        metrics: Any = None,  # looptrace.serve.metrics.ServerMetrics (observes latencies and tokens)
        probe: Any = None,  # looptrace.serve.live_probe.LiveProbe
        snapshot_interval: float = 0.25,
        info: dict[str, Any] | None = None,
        request_timeout: float | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine, self.model_name, self.metrics, self.probe = engine, model_name, metrics, probe
        self.snapshot_interval = snapshot_interval
        self.info = info or {}
        self.request_timeout = request_timeout or None  # seconds from submission; None: no limit
        self.on_dead = on_dead
        self._dead = False
        self._failed_steps = 0  # consecutive
        self._drain_deadline: float | None = None
        self.drain = DrainReport()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0  # submitted, not yet drained by the thread
        self._wake = threading.Event()
        self._gate = threading.Event()  # cleared while held: the thread neither drains nor steps
        self._gate.set()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._tracks: dict[str, _Track] = {}
        self._backlog = _Backlog()  # only the engine thread touches it
        slots = engine.snapshot().limits.max_num_seqs
        self._slots, self._group_cap = slots, max(1, int(slots * GROUP_SHARE))
        self._ids = itertools.count()
        self._windows = {k: _Window() for k in ("ttft", "tpot", "itl", "e2el")}
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0, "aborted": 0}
        self._started = time.time()
        self._last_snapshot = 0.0
        self._snapshot: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="looptrace-engine", daemon=True)
        self.error: BaseException | None = None
        self._publish(time.perf_counter())

    # Public, thread-safe --------------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._gate.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.probe is not None:
            self.probe.close()
        with contextlib.suppress(Exception):
            self.drain.request_blocks_at_exit = int(self.engine.kv_blocks()["request_blocks"])

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set() and not self._dead

    @property
    def dead(self) -> bool:
        """The engine failed for good (not a requested stop)."""
        return self._dead

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests; those in flight may finish for `timeout` seconds, then get a 503 event.
        Called again (a second signal), the earlier deadline of the two holds."""
        deadline = time.perf_counter() + max(0.0, timeout)
        with self._cond:
            if self._drain_deadline is None:
                self.drain.in_flight = len(self._tracks) + len(self._backlog) + self._pending
                self._drain_deadline = deadline
            else:
                self._drain_deadline = min(self._drain_deadline, deadline)
        self._wake.set()

    def new_request_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000) % 100000:05d}"

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str | None = None,
        group: str | None = None,
    ) -> str:
        """Queue a sequence; `group` (default: its own id) ties the sequences of one HTTP request."""
        rid = request_id or self.new_request_id()
        with self._cond:  # under the lock: a submission is either queued before death/drain or refused
            refusal = self._refusal()
            if refusal is None:
                self._pending += 1
                self._idle.clear()
                cmd = _Submit(rid, list(prompt), params, sink, time.perf_counter(), group or rid)
                self._commands.put(cmd)
                self._cond.notify_all()
        if refusal is not None:
            _send(sink, refusal)
            return rid
        self._wake.set()
        return rid

    def _refusal(self) -> Failed | None:
        if self._dead or not self._thread.is_alive() and self._thread.ident is not None:
            return unavailable(f"the engine is not running ({self._why_dead()})")
        if self._stop.is_set() or self._drain_deadline is not None:
            return unavailable("the server is shutting down")
        return None

    def status(self) -> str:
        """Why the engine is not serving (its last error), for /health and logs."""
        return self._why_dead()

    def _why_dead(self) -> str:
        return f"{type(self.error).__name__}: {self.error}" if self.error is not None else "stopped"

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._commands.put(_Abort(request_id, reason))
        self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Queue submissions without admitting them; on exit they are added before the next step (as many
        as the engine has slots for), in submission order across groups (one batch, as an offline run
        that adds them together)."""
        self._gate.clear()
        try:
            yield
        finally:
            self._gate.set()
            self._wake.set()

    def wait_pending(self, n: int, timeout: float = 30.0) -> bool:
        """Until at least `n` submissions wait to be drained (with `hold()`: queued requests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending >= n, timeout)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Until nothing is queued or running and a fresh snapshot has been published."""
        return self._idle.wait(timeout)

    # The thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - the thread is going: fail everything, then report
            log.critical("the engine thread died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._die(exc)
            return
        self._abort_all(unavailable("the server is shutting down"))
        self._fail_backlog(unavailable("the server is shutting down"))

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        with self._cond:
            self._dead = True  # from here submit() refuses; what is queued already is failed below
        event = unavailable(f"the engine is not running ({self._why_dead()})")
        self._abort_all(event)
        self._fail_backlog(event)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                _send(cmd.sink, event)
        with self._cond:
            self._pending = 0
        self._idle.set()
        with contextlib.suppress(Exception):
            self._publish(time.perf_counter())
        if self.on_dead is not None:
            with contextlib.suppress(Exception):
                self.on_dead(exc)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._gate.wait()
            if self._stop.is_set():
                break
            self._drain()
            self._report_failures()
            self._check_deadlines()
            self._admit()
            busy = self.engine.has_unfinished_requests()
            if busy:
                self._step()
            now = time.perf_counter()
            if not busy or now - self._last_snapshot >= self.snapshot_interval:
                self._publish(now)
            if not busy:
                with self._cond:
                    if self._pending == 0 and self._commands.empty() and not self._backlog.queues:
                        self._idle.set()
                self._wake.wait(self.snapshot_interval)
                self._wake.clear()

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Submit):
                self._backlog.push(cmd)
                with self._cond:
                    self._pending -= 1
                _send(cmd.sink, Accepted(cmd.request_id))
            elif self._backlog.remove(cmd.request_id) is None:  # not yet in the engine: just dropped
                self._abort(cmd.request_id, cmd.reason)

    def _admit(self) -> None:
        """Backlogged sequences into the engine's free slots, one group after another (see the module)."""
        while len(self._tracks) < self._slots:
            cmd = self._backlog.pop_next(self._group_cap)
            if cmd is None:
                return
            self._add(cmd)

    def _fail_backlog(self, event: Failed) -> None:
        for cmd in self._backlog.take_all():
            _send(cmd.sink, event)

    def _add(self, cmd: _Submit) -> None:
        try:
            rid = self.engine.add_request(
                cmd.prompt, cmd.params, request_id=cmd.request_id, arrival_time=None
            )
        except (EngineInputError, ValueError) as exc:  # accepted already: an error event, a 400
            _send(cmd.sink, Failed(str(exc), 400, "invalid_request_error"))
            return
        except Exception as exc:  # noqa: BLE001 - not the client's input: a 500 for this request alone
            log.exception("adding request %s failed", cmd.request_id)
            with contextlib.suppress(Exception):  # it may be half-added: take it out again
                self.engine.abort_request(cmd.request_id)
            self._forget(cmd.request_id)
            _send(cmd.sink, Failed(f"engine error: {type(exc).__name__}: {exc}"))
            return
        deadline = cmd.arrival + self.request_timeout if self.request_timeout else None
        self._tracks[rid] = _Track(cmd.sink, cmd.arrival, len(cmd.prompt), cmd.params.max_tokens, deadline)
        self._backlog.entered(rid, cmd.group)
        self._totals["prompt_tokens"] += len(cmd.prompt)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(cmd.prompt))

    def _untrack(self, rid: str) -> _Track | None:
        self._backlog.left(rid)
        return self._tracks.pop(rid, None)

    def _abort(self, rid: str, reason: str, event: Failed | None = None) -> None:
        track = self._untrack(rid)
        if track is None:
            return
        self.engine.abort_request(rid)
        self._forget(rid)
        self._totals["aborted"] += reason == "abort"
        self._finished(track, time.perf_counter(), reason)
        if event is not None:
            _send(track.sink, event)

    def _abort_all(self, event: Failed) -> None:
        for rid in list(self._tracks):
            track = self._untrack(rid)
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)
            self._forget(rid)
            _send(track.sink, event)

    def _report_failures(self) -> None:
        """Requests the engine finished with reason "error" on its own (admission, failed step)."""
        for rid, why in self.engine.take_failures():
            track = self._untrack(rid)
            self._forget(rid)
            if track is not None:
                log.error("request %s failed in the engine: %s", rid, why)
                self._finished(track, time.perf_counter(), "error")
                _send(track.sink, Failed(f"engine error: {why}"))

    def _check_deadlines(self) -> None:
        """Per-request timeouts and the drain deadline, checked between steps."""
        now = time.perf_counter()
        waiting = self._tracks or self._backlog.queues
        if self._drain_deadline is not None and now >= self._drain_deadline and waiting:
            self.drain.ended_at_deadline += len(self._tracks) + len(self._backlog)
            event = unavailable("the server is shutting down (drain timeout reached)")
            self._abort_all(event)
            self._fail_backlog(event)
        if self.request_timeout is None:
            return
        event = Failed(
            f"request timed out after {self.request_timeout:g} s (--request-timeout)",
            408,
            "timeout_error",
            "request_timeout",
        )
        for rid, track in list(self._tracks.items()):
            if track.deadline is not None and now >= track.deadline:
                log.warning("request %s timed out after %.1f s", rid, self.request_timeout)
                self._abort(rid, "timeout", event)
        for cmd in [c for q in self._backlog.queues.values() for c in q]:  # timed out before admission
            if now >= cmd.arrival + self.request_timeout:
                self._backlog.remove(cmd.request_id)
                _send(cmd.sink, event)

    def _forget(self, rid: str) -> None:
        # The engine keeps finished requests in `requests`; a server must not grow without bound.
        with contextlib.suppress(Exception):
            self.engine.forget(rid)

    def _step(self) -> None:
        # deferred: loads torch
        from looptrace.engine.llm_engine import StepError

        probe = self.probe
        if probe is not None:
            probe.before_step()
        try:
            outputs = self.engine.step()
        except StepError as exc:  # the engine failed that step's requests and freed their KV
            log.error("engine step failed; failing its %d request(s)", len(exc.request_ids), exc_info=exc)
            self._report_failures()
            self._deliver_all(exc.outputs)  # tokens of earlier steps read after the failure
            self._step_failed(exc)
            return
        except Exception as exc:  # noqa: BLE001 - not attributable: fail every request in flight
            log.exception("engine step failed; failing every request in flight")
            self._step_failed(exc)
            self._abort_all(Failed(f"engine error: {type(exc).__name__}: {exc}"))
            return
        self._failed_steps = 0
        if probe is not None:
            probe.after_step(len(outputs))
        self._deliver_all(outputs)

    def _deliver_all(self, outputs: list) -> None:
        now = time.perf_counter()
        for out in outputs:
            try:
                self._deliver(out, now)
            except Exception as exc:  # noqa: BLE001 - one request's bookkeeping: that request alone
                log.exception("delivering a token of %s failed", out.request_id)
                event = Failed(f"server error: {type(exc).__name__}: {exc}")
                self._abort(out.request_id, "error", event)

    def _step_failed(self, exc: Exception) -> None:
        self.error = exc
        self._failed_steps += 1
        if self.probe is not None:
            with contextlib.suppress(Exception):
                self.probe.abandon()
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDead(f"{self._failed_steps} engine steps failed in a row; last: {exc}") from exc

    def _deliver(self, out: Any, now: float) -> None:
        m = self.metrics
        track = self._tracks.get(out.request_id)
        if track is None:
            return
        track.tokens += 1
        self._totals["generation_tokens"] += 1
        if m is not None:
            m.generation_tokens.inc()
        if track.first is None:
            track.first = now
            self._windows["ttft"].add(now, now - track.arrival)
            if m is not None:
                m.ttft.observe(now - track.arrival)
        else:
            self._windows["itl"].add(now, now - track.last)
            if m is not None:
                m.itl.observe(now - track.last)
        track.last = now
        event = TokenEvent(
            out.token_id, out.finished, out.finish_reason, out.logprob, out.top_logprobs, out.prompt_logprobs
        )
        _send(track.sink, event)
        if out.finished:
            self._untrack(out.request_id)
            self._forget(out.request_id)
            self._finished(track, now, out.finish_reason or "length")

    def _finished(self, track: _Track, now: float, reason: str) -> None:
        self._totals["requests_finished"] += 1
        m = self.metrics
        e2el = now - track.arrival
        self._windows["e2el"].add(now, e2el)
        tpot = None
        if track.tokens > 1 and track.first is not None and track.last is not None:
            tpot = (track.last - track.first) / (track.tokens - 1)
            self._windows["tpot"].add(now, tpot)
        if m is not None:
            m.finished(reason)
            m.e2el.observe(e2el)
            if tpot is not None:
                m.tpot.observe(tpot)

    # Snapshot -------------------------------------------------------------------------------------------
    def _publish(self, now: float) -> None:
        try:
            self._snapshot = self._build_snapshot(now)
        except Exception:  # noqa: BLE001 - stats must never stop serving
            log.exception("building the stats snapshot failed")
        self._last_snapshot = now

    def _build_snapshot(self, now: float) -> dict[str, Any]:
        snap = self.engine.snapshot()
        return {
            "schema": SCHEMA,
            "source": "looptrace",
            "time": time.time(),
            "uptime_s": round(time.time() - self._started, 3),
            "model": self.model_name,
            "info": self.info,
            "requests": _requests_section(snap, now, len(self._backlog)),
            "tokens": {
                "prompt_total": self._totals["prompt_tokens"],
                "generation_total": self._totals["generation_tokens"],
                "requests_finished": self._totals["requests_finished"],
                "requests_aborted": self._totals["aborted"],
            },
            "latency": {k: w.summary(now) for k, w in self._windows.items()},
            "engine": _engine_section(snap.stats),
            "kv": _kv_section(snap.kv),
            "graphs": _graphs_section(snap.graphs),
            "prefix": _prefix_section(snap.prefix),
            "prefill_depth": float(snap.prefill_depth),
            "probe": self.probe.result() if self.probe is not None else PROBE_OFF,
        }


def _send(sink: Sink, event: Event) -> None:
    try:
        sink(event)
    except Exception:  # noqa: BLE001 - a closed client loop must not hurt the engine thread
        log.debug("dropping an event for a closed client", exc_info=True)


def _requests_section(snap: EngineSnapshot, now: float, backlog: int = 0) -> dict[str, Any]:
    """Queue counts (waiting: in the engine's queue or the server's backlog) and the oldest unfinished
    requests in the engine (at most MAX_LISTED_REQUESTS)."""
    oldest = sorted(snap.requests, key=lambda r: r.arrival_time)[:MAX_LISTED_REQUESTS]
    listed = [
        {
            "id": r.request_id,
            "stage": r.stage,
            "loop": r.loop,
            "max_loops": snap.decode.max_loops,
            "tokens": r.tokens,
            "max_tokens": r.max_tokens,
            "prompt_tokens": r.prompt_tokens,
            "age_s": round(max(0.0, now - r.arrival_time), 3),
        }
        for r in oldest
    ]
    return {"running": snap.queues.running, "waiting": snap.queues.waiting + backlog, "list": listed}


def _engine_section(stats: StepCounts) -> dict[str, Any]:
    out_tokens = stats.output_tokens
    return {
        "steps": stats.steps,
        "submissions": stats.submissions,
        "output_tokens": out_tokens,
        "steps_per_token": stats.steps / out_tokens if out_tokens else None,
        "submissions_per_token": stats.submissions / out_tokens if out_tokens else None,
        "steps_by_stage": dict(stats.steps_by_stage),
    }


def _kv_section(kv: KVSnapshot) -> dict[str, Any]:
    """Blocks held by requests, by the prefix cache only (evictable) and free; live vs dead slots per plane
    for the pages requests hold."""
    return {
        "layout": kv.layout,
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "used_blocks": kv.used_blocks,
        "request_blocks": kv.request_blocks,
        "cached_blocks": kv.cached_blocks,
        "free_blocks": kv.free_blocks,
        "usage": kv.usage,
        "planes": [
            {"plane": p.plane, "live_slots": p.live_slots, "dead_slots": p.dead_slots} for p in kv.planes
        ],
    }


def _graphs_section(families: tuple[GraphFamily, ...]) -> dict[str, Any]:
    caches = {
        g.name: {
            "captures": g.captures,
            "replays": g.replays,
            "fallbacks": g.fallbacks,
            "evictions": g.evictions,
            "fallback_reasons": dict(g.fallback_reasons),
            "graphs": g.graphs,
        }
        for g in families
    }
    return {"enabled": bool(families), "caches": caches}


def _prefix_section(prefix: PrefixCacheSnapshot) -> dict[str, Any]:
    return {
        "enabled": prefix.enabled,
        "hit_tokens": prefix.hit_tokens,
        "query_tokens": prefix.query_tokens,
        "hit_rate": prefix.hit_rate,
        "evictions": prefix.evictions,
    }
