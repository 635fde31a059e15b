"""Per-window counters and kernel attribution.

Annotation convention (the `record_function` names looptrace emits; Kineto records them as
`user_annotation` events, which is what this module reads):

    lt.window/decode, lt.window/prefill   the measured windows
    lt.tokens/<n>                         n tokens of the window's unit done (output tokens sampled by
                                          a decode step; prompt tokens prefilled, once per prefill window)
    lt.step#<n>                           one engine step
    lt.stage/<stage>                      prefill | prelude | recurrent | coda | sample
    lt.loop/<i>                           0-based loop of the recurrent block
    lt.layer/<role><i>                    e.g. lt.layer/core3, lt.layer/prelude0, lt.layer/coda1
    lt.op/<kind>                          norm | rope | attention | mlp | gate | adapter | embed | head |
                                          sample | state_init | kv_copy | paged_attention | metadata

Windows are time ranges: an event is in the window when its host position (below) lies inside any window
range, on any thread. Without window ranges the whole trace is the window. Steps are instances of a step
marker (a user_annotation name prefix: `lt.step#`, else `ProfilerStep#`, or `step_marker=`, e.g. vLLM's
`execute_model`) that start inside the window.

Host position: host events (cpu_op, runtime/driver calls) are where they are. Device events (kernels,
memcpy, memset, cuda_sync) sit at the runtime/driver call with the same `args.correlation`; graph-replay
kernels share the correlation of their `cudaGraphLaunch`, so they land on the ranges enclosing the replay.
Device events without such a call fall back to their own timestamp and get no attribution; those that ran
before the first device event launched in the trace were queued before profiling began and are left out.

Attribution: each kernel (GPU mode) or leaf cpu_op (CPU mode: the trace has no kernel events) takes the
innermost enclosing lt.stage / lt.loop / lt.layer / lt.op ranges *on the thread of its host position*.
Kernels with no lt.op range are `graph` (inside a graph replay) or `other`.

Tokens: per-token values divide window totals by `tokens=` (the caller knows how many tokens it sampled);
else, with `step_marker=`, by its instances in the window (an error if there are none); else by the sum
of the window's `lt.tokens/<n>` markers (looptrace's own traces: the same divisor as `looptrace profile`,
whatever the steps per token); else, in traces without lt ranges, by the tokens of the engine's step
annotations (`steps`: output tokens when the window decodes, else prompt tokens); else by the instances
of a default step marker (right for one token per step); else by 1 (totals), and the notes say so.

Foreign traces (no lt ranges): every device event also gets a category, op and layer from the CPU ops
open at its launch (`opstats`, `categories`; graph replays through capture traces, `capture`), and
kernels' contexts become op = category, with loops inferred by `loops` where a looped model shows (GPU
kernels and CPU-mode leaf ops alike; `loops=` / `layers_per_loop=` are its hints). `Breakdown.by_loop` and
`by_op_layer_loop` give the op × loop and op × layer × loop tables either way (ranges or inference).
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields

from looptrace.probes import categories as cats
from looptrace.probes import classify as cl
from looptrace.probes import steps as st
from looptrace.probes.capture import HOW_TO_RECORD, CapturedGraph, attribute_replay, pick_graph
from looptrace.probes.context import NONE, Context
from looptrace.probes.events import Trace, TraceError, TraceEvent, enclosing_chains
from looptrace.probes.forwards import FORWARD_CAT, find_forwards
from looptrace.probes.loops import LoopStructure, detect_loops
from looptrace.probes.opstats import (
    CategoryRow,
    CommContext,
    KernelOp,
    OpRow,
    ancestry_chains,
    category_rows,
    comm_notes,
    device_peak,
    kernel_op,
    op_rows,
    short_kernel_name,
)
from looptrace.probes.structure import RANGES, Structure, source_kind, structure_of
from looptrace.probes.window_items import DeviceItem, SyncItem

# --- annotation-name convention -------------------------------------------------------------------------

PREFIX = "lt."
WINDOW_PREFIX = "lt.window/"
WINDOW_DECODE = "lt.window/decode"
WINDOW_PREFILL = "lt.window/prefill"
STEP_PREFIX = "lt.step#"
TOKENS_PREFIX = "lt.tokens/"
KV_PREFIX = "lt.kv/"  # in a decode step: the live KV positions its rows attend to (context lengths summed)
STAGE_PREFIX = "lt.stage/"
LOOP_PREFIX = "lt.loop/"
LAYER_PREFIX = "lt.layer/"
OP_PREFIX = "lt.op/"
GRAPH_BODY_PREFIX = "lt.graph/"  # an eager run of a captured graph's body: maps replay kernels to ops
RING_CLOCK = "lt.ring_clock"  # timed eager launches of the persistent loop (probes/ring_clock.py)
STAGES = ("prefill", "prelude", "recurrent", "coda", "token", "sample")
OP_KINDS = (
    "norm", "rope", "attention", "paged_attention", "mlp", "gate", "adapter", "embed", "head", "sample",
    "state_init", "kv_copy", "metadata", "readback", "persistent_loop",
)  # fmt: skip
DEFAULT_STEP_MARKERS = (STEP_PREFIX, "ProfilerStep#", *st.OLD_STEP_MARKERS)  # engine grammars: `steps`
WINDOW_CHOICES = ("auto", "decode", "prefill", "all")
GRAPH_OP = "graph"  # kernel of a graph replay with no finer range
OTHER_OP = "other"  # eager kernel outside every lt.op range

ANNOTATION_CAT = "user_annotation"
DEVICE_CATS = frozenset({cl.KERNEL_CAT, cl.MEMCPY_CAT, cl.MEMSET_CAT, cl.SYNC_CAT})

_LAYER_RE = re.compile(r"^([A-Za-z_]*?)(\d+)$")


def window_name(kind: str) -> str:
    return f"{WINDOW_PREFIX}{kind}"


def step_name(n: int) -> str:
    return f"{STEP_PREFIX}{n}"


def tokens_name(n: int) -> str:
    return f"{TOKENS_PREFIX}{n}"


def kv_name(n: int) -> str:
    return f"{KV_PREFIX}{n}"


def stage_name(stage: str) -> str:
    return f"{STAGE_PREFIX}{stage}"


def loop_name(i: int) -> str:
    return f"{LOOP_PREFIX}{i}"


def layer_name(role: str, i: int) -> str:
    return f"{LAYER_PREFIX}{role}{i}"


def op_name(kind: str) -> str:
    return f"{OP_PREFIX}{kind}"


# Counters field of each sync kind of `classify`.
SYNC_FIELDS = {
    "stream": "sync_stream",
    "device": "sync_device",
    "event": "sync_event",
    "sync_memcpy": "sync_memcpy",
    "unknown": "sync_unknown",
    cl.STREAM_WAIT: "stream_wait",
    cl.EVENT_QUERY: "event_query",
}

# --- results --------------------------------------------------------------------------------------------


@dataclass
class Counters:
    """Window totals. `per_token()`/`per_step()` divide them; `pageable` stays a window count in Table A4."""

    tokens: int
    steps: int
    window: str
    mode: str  # "gpu" | "cpu"
    kernels: int = 0
    eager_launches: int = 0
    graph_launches: int = 0
    graph_kernels: int = 0
    htod: int = 0
    dtoh: int = 0
    dtod: int = 0
    memcpy_other: int = 0  # HtoH, PtoP, array copies, unparsed names
    htod_bytes: int = 0
    dtoh_bytes: int = 0
    dtod_bytes: int = 0
    pageable: int = 0
    pinned: int = 0
    memset: int = 0
    sync_stream: int = 0
    sync_device: int = 0
    sync_event: int = 0
    sync_memcpy: int = 0
    sync_unknown: int = 0
    stream_wait: int = 0  # device-side wait, not blocking: not in `syncs`
    event_query: int = 0  # cudaEventQuery polls, not blocking: not in `syncs`
    scalar_reads: int = 0
    copy_kernels: int = 0
    gpu_us: float = 0.0  # kernels + memcpy + memset; CPU mode: leaf-op time
    host_us: float = 0.0  # window wall time on the host
    submissions: int | None = None  # engine submissions, when the caller knows them
    # Where the window's wall time goes on the GPU timeline (GPU mode only; `_timeline`): busy = union of
    # its kernels and copies; idle inside graph replays = gaps between the kernels of one replay; idle =
    # wall (host_us) - busy, the part not inside replays being time the GPU waited for the host.
    gpu_busy_us: float | None = None
    graph_gap_us: float | None = None
    gpu_idle_us: float | None = None
    # Wall time on the GPU timeline: first to last device event of the window (TraceLens's "GPU timeline
    # total"), extended to the lt.window ranges when they define the window (`_timeline`).
    wall_us: float | None = None

    @property
    def syncs(self) -> int:
        """Blocking syncs (stream, device, event, synchronous memcpy, unknown)."""
        return sum(getattr(self, SYNC_FIELDS[k]) for k in cl.BLOCKING_SYNC_KINDS)

    @property
    def syncs_by_kind(self) -> dict[str, int]:
        """Every sync kind of `classify` (stream waits included, not blocking) → count."""
        return {kind: getattr(self, name) for kind, name in SYNC_FIELDS.items()}

    def totals(self) -> dict[str, float]:
        """Every counter of the window, by name (with `syncs`), in a stable order."""
        out: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sync_stream":
                out["syncs"] = self.syncs
            if f.name not in ("tokens", "steps", "window", "mode") and value is not None:
                out[f.name] = value
        return out

    def per_token(self) -> dict[str, float]:
        return {k: v / self.tokens for k, v in self.totals().items()}

    def per_step(self) -> dict[str, float] | None:
        return {k: v / self.steps for k, v in self.totals().items()} if self.steps else None


@dataclass
class KernelStat:
    name: str
    count: int
    total_us: float

    @property
    def avg_us(self) -> float:
        return self.total_us / self.count if self.count else 0.0


@dataclass
class GroupStat:
    key: tuple[str, ...]  # values of Breakdown columns, e.g. ("norm",) or ("norm", "core")
    kernels: int
    gpu_us: float


@dataclass
class Breakdown:
    by_op: list[GroupStat] = field(default_factory=list)  # key: (op,)
    by_stage: list[GroupStat] = field(default_factory=list)  # key: (stage,)
    by_op_role: list[GroupStat] = field(default_factory=list)  # key: (op, layer role)
    formulas: list[str] = field(default_factory=list)
    # Loop index as a string ("0", "1", ...; NONE outside loops); ops in by_op order, then loop, layer.
    by_loop: list[GroupStat] = field(default_factory=list)  # key: (op, loop)
    by_op_layer_loop: list[GroupStat] = field(default_factory=list)  # key: (op, layer, loop)

    @property
    def has_loops(self) -> bool:
        return any(s.key[1] != NONE for s in self.by_loop)


@dataclass
class Analysis:
    counters: Counters
    breakdown: Breakdown
    top_by_count: list[KernelStat]
    top_by_time: list[KernelStat]
    tokens_source: str
    step_marker: str | None
    notes: list[str] = field(default_factory=list)
    sites: list[SiteStat] = field(default_factory=list)  # where syncs and copies come from
    categories: list[CategoryRow] = field(default_factory=list)  # device time per op category
    ops: list[OpRow] = field(default_factory=list)  # per (category, op, layer), with roofline costs
    phases: list[PhaseStat] = field(default_factory=list)  # engine steps by phase (foreign traces)
    device: str | None = None  # the trace's device, by name
    replays: ReplayStat | None = None  # graph-replayed kernels and how much of their time has an op
    # The window's device events and blocking syncs with their contexts, for `findings` (not rendered).
    device_items: list[DeviceItem] = field(default_factory=list, repr=False)
    sync_items: list[SyncItem] = field(default_factory=list, repr=False)
    # (host time, live KV positions) of the window's `lt.kv/<n>` markers, one per decode step, for `findings`
    live_keys: list[tuple[float, int]] = field(default_factory=list, repr=False)
    # A looped model's prelude / loop / coda layers and the share of device time they account for
    # (`structure`); None without loops. Kernels' stage/layer/loop are in `breakdown` (by_op_layer_loop).
    structure: Structure | None = None


@dataclass
class ReplayStat:
    """Kernels of graph replays in the window; `attributed_us`: their time mapped to a launching CPU op
    (through a capture trace) whose category is not `other`."""

    kernels: int
    gpu_us: float
    attributed_us: float

    @property
    def attributed_share(self) -> float:
        return 100.0 * self.attributed_us / self.gpu_us if self.gpu_us else 0.0


@dataclass
class PhaseStat:
    """Engine steps of one phase in the window: decode per output token, prefill per prompt token."""

    phase: str  # prefill | decode | mixed
    steps: int
    tokens: int
    unit: str  # "output token" | "prompt token" | "token"
    gpu_us: float  # device time of the events launched inside these steps

    @property
    def per_token_us(self) -> float | None:
        return self.gpu_us / self.tokens if self.tokens else None


@dataclass
class SiteStat:
    """Syncs or memcpys of one kind from one place: API call x innermost lt.stage and lt.op range."""

    what: str  # e.g. "sync stream", "memcpy DtoH pinned"
    api: str  # the runtime call, e.g. cudaStreamSynchronize, cudaMemcpyAsync
    stage: str
    op: str
    count: int


def context_of(chain: Sequence[TraceEvent]) -> Context:
    """Context from enclosing ranges ordered outer → inner, so the innermost of each level wins."""
    stage, loop, layer, role, op, op_range = NONE, None, None, NONE, None, None
    for r in chain:
        name = r.name
        if name.startswith(OP_PREFIX):
            op, op_range = name[len(OP_PREFIX) :], r
        elif name.startswith(LAYER_PREFIX):
            layer = name[len(LAYER_PREFIX) :]
            m = _LAYER_RE.match(layer)
            role = (m.group(1) or NONE) if m else layer
        elif name.startswith(LOOP_PREFIX) and name[len(LOOP_PREFIX) :].isdigit():
            loop = int(name[len(LOOP_PREFIX) :])
        elif name.startswith(STAGE_PREFIX):
            stage = name[len(STAGE_PREFIX) :]
    return Context(stage, loop, layer, role, op, op_range)


# --- windows and positions ------------------------------------------------------------------------------


Interval = tuple[float, float]


def select_windows(trace: Trace, window: str = "auto") -> tuple[list[Interval] | None, str]:
    """Window intervals (None = whole trace) and a label. `auto`: decode windows if any, else the whole
    trace; `decode`/`prefill`: those windows, or TraceError if the trace has none; `all`: whole trace."""
    if window not in WINDOW_CHOICES:
        raise ValueError(f"window must be one of {WINDOW_CHOICES}, not {window!r}")
    if window == "all":
        return None, "whole trace"
    name = WINDOW_PREFILL if window == "prefill" else WINDOW_DECODE
    ranges = [e for e in trace.events if e.cat == ANNOTATION_CAT and e.name == name]
    if ranges:
        return _merge([(e.ts, e.end) for e in ranges]), f"{name} ×{len(ranges)}"
    if window == "auto":
        return None, f"whole trace (no {name} range)"
    raise TraceError(f"{trace.source}: no '{name}' range in the trace")


def _merge(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _window_test(windows: list[Interval] | None) -> Callable[[float], bool]:
    if windows is None:
        return lambda t: True
    starts = [w[0] for w in windows]

    def inside(t: float) -> bool:  # start <= t < end, like the attribution ranges
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t < windows[i][1]

    return inside


def _host_span(events: list[TraceEvent]) -> float:
    host = [e for e in events if e.cat not in DEVICE_CATS and e.cat != "Trace"] or events
    return max(e.end for e in host) - min(e.ts for e in host) if host else 0.0


Position = tuple[tuple | None, float]  # (host thread (pid, tid) or None, host time)


class _Locator:
    """Host position of any event (module docstring)."""

    def __init__(self, events: Iterable[TraceEvent]) -> None:
        self.calls = {c: e for e in events if cl.is_api_call(e) and (c := e.correlation) is not None}

    def __call__(self, e: TraceEvent) -> Position:
        if e.cat not in DEVICE_CATS:
            return (e.pid, e.tid), e.ts
        call = self.calls.get(e.correlation) if e.correlation is not None else None
        if call is None:
            return None, e.ts
        return (call.pid, call.tid), call.ts


def _contexts(positions: list[Position], ranges: list[TraceEvent]) -> list[Context]:
    """Context of each position, from the lt.* ranges of its thread."""
    by_thread: dict[tuple, list[TraceEvent]] = defaultdict(list)
    for r in ranges:
        by_thread[(r.pid, r.tid)].append(r)
    for rs in by_thread.values():
        rs.sort(key=lambda r: (r.ts, -r.dur))
    queries: dict[tuple, list[int]] = defaultdict(list)
    for i, (thread, _) in enumerate(positions):
        if thread is not None and thread in by_thread:
            queries[thread].append(i)
    out = [Context()] * len(positions)
    for thread, idx in queries.items():
        chains = enclosing_chains(by_thread[thread], [positions[i][1] for i in idx])
        for i, chain in zip(idx, chains, strict=True):
            out[i] = context_of(chain)
    return out


# --- analysis -------------------------------------------------------------------------------------------


def analyze(
    trace: Trace,
    *,
    tokens: int | None = None,
    window: str = "auto",
    step_marker: str | None = None,
    submissions: int | None = None,
    top: int = 10,
    captures: Sequence[CapturedGraph] | None = None,
    device: str | None = None,
    loops: int | None = None,
    layers_per_loop: int | None = None,
) -> Analysis:
    """Counters, attribution and top kernels of one window of `trace` (rules in the module docstring).
    `captures`: graphs of the capture traces that attribute replayed kernels; `device`: a device name
    overriding the trace's `deviceProperties` for the roofline; `loops`, `layers_per_loop`: hints for the
    loop inference of traces without lt ranges (`loops.detect_loops`; ignored where lt ranges exist)."""
    events = trace.events
    if not events:
        raise TraceError(f"{trace.source}: no complete events in the trace")
    if tokens is not None and tokens < 1:
        raise ValueError("tokens must be >= 1")
    for hint, flag in ((loops, "loops"), (layers_per_loop, "layers_per_loop")):
        if hint is not None and hint < 1:
            raise ValueError(f"{flag} must be >= 1")
    mode = cl.detect_mode(events)
    ranges = [e for e in events if e.cat == ANNOTATION_CAT and e.name.startswith(PREFIX)]
    all_engine_steps = [] if ranges else st.engine_steps(events)
    # Without lt ranges and engine annotations, the model's forward passes are the steps (`forwards`):
    # they group the kernels for the loop inference and, where no step marker or --tokens says
    # otherwise, give the tokens and the default window (the decode forwards).
    all_forwards = [] if ranges or all_engine_steps else find_forwards(events)[1]
    by_forwards = bool(all_forwards) and tokens is None and step_marker is None and not _has_marker(events)
    windows, label = _forward_windows(all_forwards, window, trace.source) if by_forwards else (None, "")
    if not label:
        windows, label = select_windows(trace, window)
    inside = _window_test(windows)
    locate = _Locator(events)
    stale = _queued_before_trace(events, locate)

    def in_window(items: Iterable[TraceEvent]) -> list[tuple[TraceEvent, Position]]:
        located = ((e, locate(e)) for e in items if id(e) not in stale)
        return [(e, pos) for e, pos in located if inside(pos[1])]

    engine_steps = [s for s in all_engine_steps if inside(s.event.ts)]
    forward_steps = [s for s in all_forwards if inside(s.event.ts)]
    marker, steps = _count_steps(events, step_marker, inside, f"{trace.source} (window {label})")
    tokens_source = ""
    if tokens is None and step_marker is None:
        tokens, tokens_source = _marked_tokens(events, inside)
    if tokens is None and step_marker is None and engine_steps and marker != STEP_PREFIX:
        marker, steps, tokens, tokens_source = _engine_tokens(engine_steps)
    if by_forwards and forward_steps:
        marker, steps, tokens, tokens_source = _engine_tokens(forward_steps)
    if not tokens_source:
        tokens, tokens_source = _resolve_tokens(tokens, marker, steps)
    host_us = _host_span(events) if windows is None else sum(end - start for start, end in windows)
    c = Counters(tokens, steps, label, mode, host_us=host_us, submissions=submissions)

    kernel_events = [e for e in events if cl.is_kernel(e)] if mode == "gpu" else cl.leaf_cpu_ops(events)
    kernels = in_window(kernel_events)
    graph_corr = cl.graph_launch_correlations(events)
    _count_kernels(c, [e for e, _ in kernels], graph_corr)
    memory = in_window(e for e in events if e.cat in (cl.MEMCPY_CAT, cl.MEMSET_CAT))
    _count_memory(c, memory)
    if mode == "gpu":
        _timeline(c, [e for e, _ in kernels + memory], graph_corr, extend_to_window=windows is not None)
    unlinked = sum(1 for _, (thread, _) in kernels + memory if thread is None)
    for e, _ in in_window(e for e in events if cl.is_api_call(e)):
        c.eager_launches += cl.is_eager_launch(e)
        c.graph_launches += cl.is_graph_launch(e)
    reads = in_window(cl.scalar_reads(events))
    c.scalar_reads = len(reads)
    site_items: list[tuple[str, TraceEvent, Position]] = []
    for kind, e in cl.select_syncs(events):
        pos = locate(e)
        if id(e) not in stale and inside(pos[1]):
            setattr(c, SYNC_FIELDS[kind], getattr(c, SYNC_FIELDS[kind]) + 1)
            site_items.append((f"sync {kind}", e, pos))
    site_items += [("host scalar read", e, pos) for e, pos in reads]
    for e, pos in memory:
        info = cl.parse_memcpy(e) if not cl.is_memset(e) else None
        what = (
            "memset" if info is None else f"memcpy {info.direction}" + (" pageable" if info.pageable else "")
        )
        site_items.append((what, e, pos))

    # lt.op instances get a context too (their own layer/loop), for the per-call factors of the formulas.
    op_positions = [((r.pid, r.tid), r.ts) for r in ranges if r.name.startswith(OP_PREFIX) and inside(r.ts)]
    site_positions = [pos for _, _, pos in site_items]
    contexts = _contexts([p for _, p in kernels] + op_positions + site_positions, ranges)
    n_k, n_o = len(kernels), len(op_positions)
    kernel_ctx, op_ctx, site_ctx = contexts[:n_k], contexts[n_k : n_k + n_o], contexts[n_k + n_o :]
    sites = _sites(site_items, site_ctx, locate)
    bodies = _graph_bodies(events, ranges, locate)
    replay_note = None
    if bodies:
        kernel_ctx, replay_ops, replay_note = _attribute_replays(kernels, kernel_ctx, graph_corr, bodies)
        op_ctx = op_ctx + replay_ops
    device_items = kernels + memory
    if by_forwards:  # every forward's phase, whatever the window: prefill per prompt token too
        on_device = (
            [e for e in events if e.cat in DEVICE_CATS - {cl.SYNC_CAT}] if mode == "gpu" else kernel_events
        )
        phases = _phases(all_forwards, [(e, locate(e)) for e in on_device if id(e) not in stale])
    else:
        phases = _phases(engine_steps, device_items)
    kops, op_notes = _kernel_ops(events, device_items, kernel_ctx, graph_corr, captures, engine_steps)
    _attach_kv(kops, device_items, engine_steps)
    for i, (e, _) in enumerate(kernels):  # a collective's kernel may carry its sizes (newer Kineto)
        if kops[i].category == cats.COMM:
            kops[i] = dataclasses.replace(kops[i], device=e)
    if not ranges:  # CPU traces too: their leaf cpu_ops have categories from `_kernel_ops`
        hints = {"loops": loops, "layers_per_loop": layers_per_loop}
        kernel_ctx, found = _foreign_contexts(kops[:n_k], kernels, engine_steps or forward_steps, hints)
        op_notes += [f"loops inferred from the kernel pattern: {found.how}"] if found.how else []
        structure_source = ", ".join(sorted({source_kind(how) for how in found.sources}))
    else:
        structure_source = RANGES
    structure = structure_of(kernel_ctx, [e.dur for e, _ in kernels], structure_source)
    breakdown = _breakdown(kernels, kernel_ctx, op_ctx, graph_corr, tokens)
    by_count, by_time = _top_kernels([e for e, _ in kernels], top)
    notes = _notes(c, tokens_source, unlinked, mode)
    if stale:
        notes.append(_stale_note(events, stale))
    if replay_note:
        notes.append(replay_note)
    notes += op_notes
    durations = [e.dur for e, _ in device_items]
    props = trace.device_properties
    peak = device_peak(props, device)
    ops = op_rows(durations, kops, peak, CommContext.of(events, trace.distributed_info))
    notes += comm_notes(ops)
    return Analysis(
        c, breakdown, by_count, by_time, tokens_source, marker, notes, sites,
        categories=category_rows(durations, kops, tokens),
        ops=ops,
        phases=phases,
        device=_device_name(peak, props),
        replays=_replay_stat(kernels, kops, graph_corr),
        device_items=_device_items(kernels, kernel_ctx, memory, graph_corr, kops),
        sync_items=[
            SyncItem(what[len("sync ") :], e, cx)
            for (what, e, _), cx in zip(site_items, site_ctx, strict=True)
            if what.startswith("sync ") and what[len("sync ") :] in cl.BLOCKING_SYNC_KINDS
        ],
        structure=structure,
        live_keys=_live_keys(ranges, inside),
    )  # fmt: skip


def _device_items(
    kernels: list[tuple[TraceEvent, Position]],
    kernel_ctx: list[Context],
    memory: list[tuple[TraceEvent, Position]],
    graph_corr: set[int],
    kops: list[KernelOp],
) -> list[DeviceItem]:
    """The window's kernels (with their contexts and the CPU op whose shapes they ran), copies and memsets,
    in device-time order."""
    items = [
        DeviceItem(e, cx, not cl.is_graph_kernel(e, graph_corr), ko.shapes)
        for (e, _), cx, ko in zip(kernels, kernel_ctx, kops[: len(kernels)], strict=True)
    ]
    items += [DeviceItem(e, Context(), True) for e, _ in memory]
    return sorted(items, key=lambda item: item.event.ts)


def _live_keys(ranges: list[TraceEvent], inside: Callable[[float], bool]) -> list[tuple[float, int]]:
    """The window's `lt.kv/<n>` markers in time order: live KV positions of each decode step's rows."""
    marks = [(e.ts, e.name[len(KV_PREFIX) :]) for e in ranges if e.name.startswith(KV_PREFIX)]
    marks = [(ts, n) for ts, n in marks if inside(ts)]
    return sorted((ts, int(n)) for ts, n in marks if n.isdigit())


def _has_marker(events: list[TraceEvent]) -> bool:
    """Whether any default step marker (lt.step#, ProfilerStep#, ...) is in the trace: then its
    instances, not the forwards, are the steps (as before forwards were found)."""
    return any(e.cat == ANNOTATION_CAT and e.name.startswith(DEFAULT_STEP_MARKERS) for e in events)


def _forward_windows(forwards: list[st.Step], window: str, source: str) -> tuple[list[Interval] | None, str]:
    """The spans of the decode (or, with --window prefill, the prefill) forwards as the window; (None,
    "") where the choice is not theirs (--window all, or auto with no decode forward)."""
    if window == "all":
        return None, ""
    phase = st.PREFILL if window == "prefill" else st.DECODE
    mine = [s for s in forwards if s.phase == phase]
    if not mine:
        if window == "auto":
            return None, ""
        raise TraceError(f"{source}: no 'lt.window/{phase}' range and no {phase} forward in the trace")
    spans = _merge([(s.event.ts, s.event.end) for s in mine])
    return spans, f"{phase} forwards ×{len(mine)} (no lt.window/{phase} range)"


def _device_name(peak: object, props: list[dict]) -> str | None:
    """The roofline table's device name, else the trace's own (MI300X traces from vLLM leave it empty)."""
    if peak is not None:
        return str(getattr(peak, "name", peak))
    return next((str(x["name"]) for x in props if x.get("name")), None)


def _replay_stat(
    kernels: list[tuple[TraceEvent, Position]], kops: list[KernelOp], graph_corr: set[int]
) -> ReplayStat | None:
    graph = [(e, k) for (e, _), k in zip(kernels, kops, strict=False) if cl.is_graph_kernel(e, graph_corr)]
    if not graph:
        return None
    attributed = sum(e.dur for e, k in graph if k.call is not None and k.category != cats.OTHER)
    return ReplayStat(len(graph), sum(e.dur for e, _ in graph), attributed)


# --- foreign traces: steps, stale device events, op attribution -----------------------------------------


def _engine_tokens(steps: list[st.Step]) -> tuple[str, int, int, str]:
    """(marker, steps, tokens, source) from the engine's step annotations; tokens 1 (totals) if the
    annotations carry no counts (older vLLM `execute_model`)."""
    totals = st.step_tokens(steps)
    marker = {"vllm": st.VLLM_STEP, "sglang": st.SGLANG_STEP}.get(steps[0].grammar, steps[0].grammar)
    if totals.tokens < 1:
        return marker, totals.steps, 1, "unknown (step annotations without token counts): pass --tokens"
    return marker, totals.steps, totals.tokens, st.describe(totals, steps[0].grammar)


def _phases(steps: list[st.Step], items: list[tuple[TraceEvent, Position]]) -> list[PhaseStat]:
    """Device time of the events launched inside each phase's steps (by host time, any thread)."""
    if not steps:
        return []
    spans = sorted((s.event.ts, s.event.end, s) for s in steps)
    starts = [x[0] for x in spans]
    gpu: dict[str, float] = defaultdict(float)
    for e, (_, t) in items:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t < spans[i][1]:
            gpu[spans[i][2].phase] += e.dur
    out = []
    for phase in (st.PREFILL, st.DECODE, st.MIXED):
        mine = [s for s in steps if s.phase == phase]
        if not mine:
            continue
        prompt = sum(s.prompt_tokens or 0 for s in mine)
        output = sum(s.output_tokens or 0 for s in mine)
        count, unit = {
            st.PREFILL: (prompt, "prompt token"),
            st.DECODE: (output, "output token"),
            st.MIXED: (prompt + output, "token"),
        }[phase]
        out.append(PhaseStat(phase, len(mine), count, unit, gpu.get(phase, 0.0)))
    return out


def _queued_before_trace(events: list[TraceEvent], locate: _Locator) -> set[int]:
    """Device events that ran before the first device event launched in the trace and have no launching
    call: work queued before profiling began (Kineto flushes it with the trace). They belong to no
    profiled step, so they are left out (TraceLens drops them too: on the H100 trace, 436 kernels and 73
    memsets of the previous step, 13.7 ms of GPU time)."""
    device = [e for e in events if e.cat in (cl.KERNEL_CAT, cl.MEMCPY_CAT, cl.MEMSET_CAT)]
    linked = [e.ts for e in device if e.correlation in locate.calls]
    if not linked:
        return set()
    first = min(linked)
    return {id(e) for e in device if e.ts < first and e.correlation not in locate.calls}


def _stale_note(events: list[TraceEvent], stale: set[int]) -> str:
    gone = [e for e in events if id(e) in stale]
    us = sum(e.dur for e in gone)
    return (
        f"{len(gone)} device events ({us / 1e3:,.2f} ms) ran before the first launch the trace records and "
        "have no launching call (work queued before profiling began): left out"
    )


def _kernel_ops(
    events: list[TraceEvent],
    items: list[tuple[TraceEvent, Position]],
    ctx: list[Context],
    graph_corr: set[int],
    captures: Sequence[CapturedGraph] | None,
    steps: list[st.Step],
) -> tuple[list[KernelOp], list[str]]:
    """Category, op, layer and call of every device event of the window: CPU-op ancestry at the launch;
    graph replays through the capture traces; lt.op ranges set the category in looptrace's traces."""
    chains = ancestry_chains(events, [pos for _, pos in items])
    kops = [kernel_op(e.name, chain) for (e, _), chain in zip(items, chains, strict=True)]
    for i, (e, _) in enumerate(items):  # memcpy / memset: their own category, the launching op's name
        if e.cat in (cl.MEMCPY_CAT, cl.MEMSET_CAT):
            kind = cats.MEMSET if e.cat == cl.MEMSET_CAT else cats.MEMCPY
            kops[i] = KernelOp(kind, kops[i].op if kops[i].call is not None else kind, kops[i].layer)
    for i, cx in enumerate(ctx):  # kernels come first in `items`
        if cx.op is not None:
            ko = kops[i]
            layer = cx.layer if cx.layer is not None else ko.layer
            kops[i] = dataclasses.replace(ko, category=cats.lt_category(cx.op, items[i][0].name), layer=layer)
    replays: dict[int, list[int]] = defaultdict(list)
    for i, (e, _) in enumerate(items[: len(ctx)]):  # kernels only; those an lt.graph body mapped stay
        if e.correlation in graph_corr and ctx[i].op is None:
            replays[e.correlation].append(i)
    if not replays:
        return kops, []
    return kops, _attribute_foreign_replays(items, kops, replays, captures, steps)


def _attribute_foreign_replays(
    items: list[tuple[TraceEvent, Position]],
    kops: list[KernelOp],
    replays: dict[int, list[int]],
    captures: Sequence[CapturedGraph] | None,
    steps: list[st.Step],
) -> list[str]:
    """Map each replay's kernels (device order) to the capture of its graph; a note on the outcome."""
    total = sum(len(idx) for idx in replays.values())
    if not captures:
        us = sum(items[i][0].dur for idx in replays.values() for i in idx)
        for i in (i for idx in replays.values() for i in idx):
            name = items[i][0].name
            kops[i] = KernelOp(cats.kernel_category(name), short_kernel_name(name))
        return [
            f"{total} kernels of {len(replays)} graph replay(s) ({us / 1e3:,.2f} ms) cannot be attributed to "
            f"the CPU ops that launched them (categories from kernel names only): {HOW_TO_RECORD}"
        ]
    matched = attributed = differ = 0
    for corr, idx in replays.items():
        idx.sort(key=lambda i: items[i][0].ts)
        names = [items[i][0].name for i in idx]
        graph = pick_graph(captures, names, _step_rows(steps, items[idx[0]][1][1]))
        if graph is None:
            continue
        ops, bad = attribute_replay([items[i][0] for i in idx], graph, corr)
        for i, op in zip(idx, ops, strict=True):
            kops[i] = op
        matched, attributed, differ = matched + 1, attributed + len(idx), differ + bad
    note = (
        f"graph replays attributed through the capture traces: {matched} of {len(replays)} replay(s), "
        f"{attributed} of {total} kernels matched by order to the capture's launches"
    )
    if differ:
        note += f" ({differ} kernel names differ from the capture's)"
    return [note]


def _attach_kv(kops: list[KernelOp], items: list[tuple[TraceEvent, Position]], steps: list[st.Step]) -> None:
    """Give each attention kernel the KV length (keys, pairs) of the engine step that launched it, where
    the step annotation says: the cost of a paged attention op (`opstats._cost`)."""
    for i, (_, (_, t)) in enumerate(items):
        if kops[i].category != cats.ATTENTION:
            continue
        step = next((s for s in steps if s.event.ts <= t < s.event.end), None)
        if step is not None and step.keys is not None:
            kops[i] = dataclasses.replace(kops[i], kv=(step.keys, step.pairs))


def _step_rows(steps: list[st.Step], t: float) -> int | None:
    """Tokens scheduled in the step around host time t: the graph's batch size in vLLM/SGLang."""
    step = next((s for s in steps if s.event.ts <= t < s.event.end), None)
    if step is None:
        return None
    return (step.prompt_tokens or 0) + (step.output_tokens or 0) or step.rows


def _foreign_contexts(
    kops: list[KernelOp],
    kernels: list[tuple[TraceEvent, Position]],
    steps: list[st.Step],
    hints: dict[str, int | None],
) -> tuple[list[Context], LoopStructure]:
    """Contexts of kernels in a trace without lt ranges: op = category, layer from the module path; and,
    where a looped pattern repeats within a step, stage/loop/layer/role from `loops.detect_loops` (the
    one call site; kernels grouped by engine step, in launch order), and what it found."""
    ctx = [Context(op=k.category, layer=None if k.layer is None else f"layer{k.layer}") for k in kops]

    groups = group_by_step([t for _, (_, t) in kernels], steps)
    # launch order; kernels of one graph replay share a launch time, so device order breaks ties
    order = {
        j: sorted(idx, key=lambda i: (kernels[i][1][1], kernels[i][0].ts))
        for j, idx in sorted(groups.items())
    }
    outside = order.pop(-1, None) if order.keys() - {-1} else None
    prefill = [j >= 0 and steps[j].phase == st.PREFILL for j in order]  # a prefill forward's stage: prefill
    found = _detect(ctx, kernels, list(order.values()), hints, prefill)
    if outside is not None:  # kernels outside every step: their own sequence, not counted as a step
        alone = _detect(ctx, kernels, [outside], hints, [False])
        found = found if found.found or not alone.found else alone
    return ctx, found


def group_by_step(times: Sequence[float], steps: list[st.Step]) -> dict[int, list[int]]:
    """Indices of `times` by the step around each (-1: outside every step). Ops before the first forward
    found without annotations prepare it (its positions and masks come before its embedding lookup,
    where `forwards` starts it), so they are its."""
    groups: dict[int, list[int]] = defaultdict(list)
    starts = [s.event.ts for s in steps]
    first_prepares = bool(steps) and steps[0].event.cat == FORWARD_CAT
    for i, t in enumerate(times):
        j = bisect.bisect_right(starts, t) - 1
        if j < 0 and first_prepares:
            j = 0
        groups[j if j >= 0 and t < steps[j].event.end else -1].append(i)
    return groups


def _detect(
    ctx: list[Context],
    kernels: list[tuple[TraceEvent, Position]],
    order: list[list[int]],
    hints: dict[str, int | None],
    prefill: list[bool],
) -> LoopStructure:
    """`loops.detect_loops` on the kernels of each sequence in `order`; their contexts updated in `ctx`."""
    found = detect_loops(
        [[ctx[i] for i in idx] for idx in order],
        names=[[kernels[i][0].name for i in idx] for idx in order],
        prefill=prefill,
        times=[[kernels[i][1][1] for i in idx] for idx in order],
        **hints,
    )
    for idx, inferred in zip(order, found.steps, strict=True):
        for i, cx in zip(idx, inferred, strict=True):
            ctx[i] = cx
    return found


def _sites(items: list[tuple[str, TraceEvent, Position]], ctx: list[Context], locate) -> list[SiteStat]:
    """Group syncs and copies by (what, API call, stage, op): where a hidden sync or copy comes from."""
    calls = locate.calls
    acc: Counter[tuple[str, str, str, str]] = Counter()
    for (what, e, _), cx in zip(items, ctx, strict=True):
        call = calls.get(e.correlation) if e.cat in DEVICE_CATS and e.correlation is not None else e
        api = call.name if call is not None else e.name
        acc[(what, api, cx.stage, cx.op or NONE)] += 1
    return [SiteStat(*key, n) for key, n in sorted(acc.items(), key=lambda kv: (-kv[1], kv[0]))]


# --- kernels inside CUDA-graph replays ------------------------------------------------------------------
# A replay has no host-side op ranges. looptrace runs each captured graph's body once eagerly inside an
# `lt.graph/<name>/<rows>` range: the same kernels in the same order (one stream, so the captured graph is
# a chain). A replay whose kernel names, in device order, equal such a body's takes that body's op and
# layer for each position; stage and loop still come from the ranges around the replay's launch.


def _graph_bodies(events: list[TraceEvent], ranges: list[TraceEvent], locate) -> dict[tuple, list[Context]]:
    body_ranges = [r for r in ranges if r.name.startswith(GRAPH_BODY_PREFIX)]
    if not body_ranges:
        return {}
    kernels = [(e, locate(e)) for e in events if cl.is_kernel(e)]
    out: dict[tuple, list[Context]] = {}
    for r in body_ranges:
        inside = sorted(
            ((e, pos) for e, pos in kernels if pos[0] == (r.pid, r.tid) and r.ts <= pos[1] < r.end),
            key=lambda item: item[0].ts,
        )
        if inside:
            names = tuple(e.name for e, _ in inside)
            out.setdefault(names, _contexts([pos for _, pos in inside], ranges))
    return out


def _match_body(names: tuple, bodies: dict[tuple, list[Context]]) -> tuple[list[Context] | None, str]:
    """Exact name sequence first. Else the body whose kernels align best with the replay's (difflib's
    matching blocks), if few replay kernels stay unmatched: under capture cuBLAS may run other or extra
    kernels than eagerly, at several places (H200, exactloop's whole-token graph: a `memcpy_post` before
    each of the 4 gate gemvs, 990 kernels vs the body's 986). An unmatched kernel takes the op of the
    first matched kernel after it (a library's prologue kernel belongs to the call that follows)."""
    body = bodies.get(names)
    if body is not None:
        return body, "exact"
    slack = max(8, len(names) // 50)
    best, best_blocks, best_matched = None, [], 0
    for key, b in bodies.items():
        if abs(len(key) - len(names)) > slack:
            continue
        blocks = difflib.SequenceMatcher(None, key, names, autojunk=False).get_matching_blocks()
        matched = sum(m.size for m in blocks)
        if matched > best_matched:
            best, best_blocks, best_matched = b, blocks, matched
    if best is None or len(names) - best_matched > slack:
        return None, "unmatched"
    mapped: list[Context | None] = [None] * len(names)
    for m in best_blocks:
        mapped[m.b : m.b + m.size] = best[m.a : m.a + m.size]
    following = best[-1]
    for j in range(len(names) - 1, -1, -1):  # fill the gaps from the right: the next matched kernel's op
        if mapped[j] is None:
            mapped[j] = following
        following = mapped[j]
    return mapped, "aligned"


def _mismatch(names: tuple, bodies: dict[tuple, list[Context]]) -> str:
    key = min(bodies, key=lambda k: abs(len(k) - len(names)))
    first = next((i for i, (x, y) in enumerate(zip(key, names)) if x != y), min(len(key), len(names)))
    ours = names[first][:60] if first < len(names) else "<end>"
    theirs = key[first][:60] if first < len(key) else "<end>"
    return f"{len(names)} kernels vs body {len(key)}, first difference at #{first}: {ours!r} vs {theirs!r}"


# `kernels.l2_prefetch` issues these on a side stream only while a graph is captured: the eager graph body
# has none of them, so they are left out of the body match and counted as their own op.
PREFETCH_KERNELS = frozenset({"_prefetch_kernel"})
PREFETCH_OP = "l2_prefetch"


def _attribute_replays(
    kernels: list[tuple[TraceEvent, Position]],
    kernel_ctx: list[Context],
    graph_corr: set[int],
    bodies: dict[tuple, list[Context]],
) -> tuple[list[Context], list[Context], str]:
    """New contexts for graph-replay kernels that match a graph body, plus one op-call instance per
    (replay, body op call) for the per-call factors of the formulas, and a note on the matching."""
    replays: dict[int, list[int]] = defaultdict(list)
    for i, (e, _) in enumerate(kernels):
        if e.correlation in graph_corr:
            replays[e.correlation].append(i)
    ctx = list(kernel_ctx)
    op_calls: list[Context] = []
    outcome: Counter[str] = Counter()
    matched: dict[tuple, tuple[list[Context] | None, str]] = {}
    example = ""
    for idx in replays.values():
        idx.sort(key=lambda i: kernels[i][0].ts)
        for i in idx:  # side-stream hints with no eager counterpart: an op of their own
            if kernels[i][0].name in PREFETCH_KERNELS:
                launch = kernel_ctx[i]
                ctx[i] = Context(launch.stage, launch.loop, None, NONE, PREFETCH_OP)
        idx = [i for i in idx if kernels[i][0].name not in PREFETCH_KERNELS]
        if not idx:
            continue
        names = tuple(kernels[i][0].name for i in idx)
        if names not in matched:  # replays of one graph repeat one sequence: align it once
            matched[names] = _match_body(names, bodies)
        body, how = matched[names]
        outcome[how] += 1
        if body is None:
            example = example or _mismatch(names, bodies)
            continue
        launch = kernel_ctx[idx[0]]  # stage and loop of the replay's launch
        calls: dict[int, TraceEvent] = {}
        for i, b in zip(idx, body, strict=True):
            op_range = None
            if b.op_range is not None:
                op_range = calls.get(id(b.op_range))
                if op_range is None:  # a distinct object per (replay, op call): per-call kernel counts
                    op_range = calls[id(b.op_range)] = dataclasses.replace(b.op_range)
                    op_calls.append(Context(launch.stage, launch.loop, b.layer, b.role, b.op, op_range))
            ctx[i] = Context(launch.stage, launch.loop, b.layer, b.role, b.op or GRAPH_OP, op_range)
    note = "graph replays mapped to ops by their eager graph bodies: " + ", ".join(
        f"{n} {how}" for how, n in sorted(outcome.items())
    )
    if example:
        note += f" (unmatched example: {example})"
    return ctx, op_calls, note


def _count_steps(
    events: list[TraceEvent], marker: str | None, inside: Callable[[float], bool], where: str
) -> tuple[str | None, int]:
    """(marker, instances in the window). A given marker with no instance in the window is an error: it
    would silently make per-token values window totals."""
    annotations = [e for e in events if e.cat == ANNOTATION_CAT]
    candidates = (marker,) if marker else DEFAULT_STEP_MARKERS
    for prefix in candidates:
        steps = [e for e in annotations if e.name.startswith(prefix)]
        if steps:
            inside_steps = sum(1 for e in steps if inside(e.ts))
            if marker and not inside_steps:
                raise TraceError(
                    f"{where}: step marker {marker!r} has {len(steps)} instance(s), none in the window"
                )
            return prefix, inside_steps
    if marker:
        known = [p for p in DEFAULT_STEP_MARKERS if any(e.name.startswith(p) for e in annotations)]
        names = sorted({re.sub(r"\d+$", "", e.name) for e in annotations})
        hint = f"present: {', '.join(known)}" if known else "names: " + (", ".join(names[:6]) or "none")
        hint += ", ..." if not known and len(names) > 6 else ""
        raise TraceError(f"{where}: step marker {marker!r} matches no user_annotation ({hint})")
    return marker, 0


def _marked_tokens(events: list[TraceEvent], inside: Callable[[float], bool]) -> tuple[int | None, str]:
    """Sum of the lt.tokens/<n> markers in the window (None if there are none)."""
    total, found = 0, False
    for e in events:
        if e.cat == ANNOTATION_CAT and e.name.startswith(TOKENS_PREFIX) and inside(e.ts):
            count = e.name[len(TOKENS_PREFIX) :]
            if count.isdigit():
                total, found = total + int(count), True
    if not found or total < 1:
        return None, ""
    return total, f"looptrace token markers ({TOKENS_PREFIX}<n>)"


def _resolve_tokens(tokens: int | None, marker: str | None, steps: int) -> tuple[int, str]:
    if tokens is not None:
        return tokens, "given"
    if steps:
        return steps, f"step-marker instances ({marker!r}); pass tokens for batched or multi-stage steps"
    return 1, "unknown, so per-token values are window totals: pass --tokens or --step-marker"


def _count_kernels(c: Counters, kernels: list[TraceEvent], graph_corr: set[int]) -> None:
    for e in kernels:
        c.kernels += 1
        c.gpu_us += e.dur
        if c.mode == "gpu":
            c.graph_kernels += cl.is_graph_kernel(e, graph_corr)
            c.copy_kernels += cl.is_copy_kernel_name(e.name)
        else:
            c.copy_kernels += cl.is_cpu_copy_op(e)


def _count_memory(c: Counters, items: list[tuple[TraceEvent, Position]]) -> None:
    for e, _ in items:
        c.gpu_us += e.dur
        if cl.is_memset(e):
            c.memset += 1
            continue
        info = cl.parse_memcpy(e)
        direction = {"HtoD": "htod", "DtoH": "dtoh", "DtoD": "dtod"}.get(info.direction)
        if direction:
            setattr(c, direction, getattr(c, direction) + 1)
            setattr(c, f"{direction}_bytes", getattr(c, f"{direction}_bytes") + info.bytes)
        else:
            c.memcpy_other += 1
        c.pageable += info.pageable
        c.pinned += info.pinned


def _union_us(spans: list[Interval]) -> float:
    return sum(end - start for start, end in _merge(spans))


def _timeline(c: Counters, device: list[TraceEvent], graph_corr: set[int], extend_to_window: bool) -> None:
    """GPU busy time (union of the device events' intervals: overlapping work counts once), idle time
    between the kernels of each graph replay (a replay's span minus its busy union: launch latency between
    dependent graph nodes), wall time and idle wall time (wall - busy).

    Wall = first to last device event of the window (TraceLens's "GPU timeline total"), extended to the
    lt.window ranges' length when those define the window (looptrace's windows end after a sync, so they
    are the measured interval). Without lt.window ranges the host span is not used: host and device
    clocks need not agree (on the vLLM MI300X trace the first kernel starts 8.4 ms after the host's step
    annotation began and runs 8 ms past its end), and the GPU may still run work queued earlier."""
    c.gpu_busy_us = _union_us([(e.ts, e.end) for e in device])
    replays: dict[int, list[Interval]] = defaultdict(list)
    for e in device:
        if cl.is_graph_kernel(e, graph_corr) and e.correlation is not None:
            replays[e.correlation].append((e.ts, e.end))
    c.graph_gap_us = sum(
        max(end for _, end in spans) - min(start for start, _ in spans) - _union_us(spans)
        for spans in replays.values()
    )
    span = max(e.end for e in device) - min(e.ts for e in device) if device else 0.0
    c.wall_us = max(span, c.host_us) if extend_to_window else span
    c.gpu_idle_us = max(0.0, c.wall_us - c.gpu_busy_us)


def _kernel_op(e: TraceEvent, ctx: Context, graph_corr: set[int]) -> str:
    if ctx.op is not None:
        return ctx.op
    return GRAPH_OP if cl.is_graph_kernel(e, graph_corr) else OTHER_OP


def _groups(acc: dict[tuple[str, ...], list[float]]) -> list[GroupStat]:
    stats = [GroupStat(key, int(v[0]), v[1]) for key, v in acc.items()]
    return sorted(stats, key=lambda s: (-s.kernels, s.key))


def _loop_order(value: str) -> tuple[int, int]:
    """Loop "0", "1", ... in numeric order, NONE (no loop) last."""
    return (1, 0) if value == NONE else (0, int(value))


def _layer_order(layer: str) -> tuple[int, int, str]:
    """prelude0.., core0.., coda0.., then other names; numeric within a role."""
    m = _LAYER_RE.match(layer)
    if m is None:
        return (len(ROLE_ORDER) + 1, 0, layer)
    return (ROLE_ORDER.get(m.group(1) or NONE, len(ROLE_ORDER)), int(m.group(2)), layer)


def _loop_groups(acc: dict[tuple[str, ...], list[float]], rank: dict[str, int]) -> list[GroupStat]:
    """Groups keyed (op, loop) or (op, layer, loop): ops as in `by_op`, then loop, then layer."""

    def order(s: GroupStat) -> tuple:
        op, *layer, loop = s.key
        return (rank.get(op, len(rank)), op, _loop_order(loop), *(_layer_order(x) for x in layer))

    return sorted((GroupStat(key, int(v[0]), v[1]) for key, v in acc.items()), key=order)


def _breakdown(
    kernels: list[tuple[TraceEvent, Position]],
    kernel_ctx: list[Context],
    op_ctx: list[Context],
    graph_corr: set[int],
    tokens: int,
) -> Breakdown:
    by_op: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    by_stage: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    by_op_role: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    by_loop: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    by_cell: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    per_call: Counter[int] = Counter()  # kernels per lt.op range instance, by id
    for (e, _), ctx in zip(kernels, kernel_ctx, strict=True):
        op = _kernel_op(e, ctx, graph_corr)
        loop = NONE if ctx.loop is None else str(ctx.loop)
        for acc, key in (
            (by_op, (op,)),
            (by_stage, (ctx.stage,)),
            (by_op_role, (op, ctx.role)),
            (by_loop, (op, loop)),
            (by_cell, (op, ctx.layer or NONE, loop)),
        ):
            acc[key][0] += 1
            acc[key][1] += e.dur
        if ctx.op_range is not None:
            per_call[id(ctx.op_range)] += 1
    b = Breakdown(_groups(by_op), _groups(by_stage), _groups(by_op_role))
    rank = {s.key[0]: i for i, s in enumerate(b.by_op)}
    b.by_loop = _loop_groups(by_loop, rank)
    b.by_op_layer_loop = _loop_groups(by_cell, rank)
    instances: dict[str, list[Context]] = defaultdict(list)
    for ctx in op_ctx:
        instances[ctx.op].append(ctx)
    total = len(kernels)
    for stat in b.by_op:
        op = stat.key[0]
        b.formulas.append(op_formula(op, stat.kernels, instances.get(op, []), per_call, tokens, total))
    for op in sorted(instances.keys() - {s.key[0] for s in b.by_op}):  # op ranges that issued no kernel
        b.formulas.append(op_formula(op, 0, instances[op], per_call, tokens, total))
    return b


# --- formulas -------------------------------------------------------------------------------------------


ROLE_ORDER = {"prelude": 0, "core": 1, "coda": 2, NONE: 3}


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x - round(x)) < 1e-9 else f"{x:,.2f}"


def _plural(n: float, word: str) -> str:
    return f"{_num(n)} {word}" + ("" if n == 1 else "s")


def _term(op: str, part: list[Context], per_call: Counter[int], tokens: int, role: str = NONE) -> str:
    """`K kernels × C <op> calls × Y layers × L loops` for one group of op calls, if it factors evenly:
    every (layer, loop) cell present with the same number of calls, whole calls per token, whole kernels
    per call. Otherwise the measured totals per token and the average per call."""
    n_calls = len(part)
    n_kernels = sum(per_call[id(ctx.op_range)] for ctx in part)
    cells = Counter((ctx.layer, ctx.loop) for ctx in part)
    layers = {ctx.layer for ctx in part if ctx.layer is not None}
    loops = {ctx.loop for ctx in part if ctx.loop is not None}
    n_cells = max(len(layers), 1) * max(len(loops), 1)
    calls_per_cell = n_calls / n_cells
    even = (
        len(cells) == n_cells
        and len(set(cells.values())) == 1
        and calls_per_cell % tokens == 0
        and n_kernels % n_calls == 0
    )
    if not even:
        return (
            f"{_num(n_kernels / tokens)} kernels in {_num(n_calls / tokens)} {op} calls "
            f"(avg {n_kernels / n_calls:.2f} kernels/call)"
        )
    text = f"{_plural(n_kernels // n_calls, 'kernel')} × {_plural(calls_per_cell // tokens, op + ' call')}"
    if layers:
        text += f" × {_plural(len(layers), 'layer' if role in (NONE, 'core') else role + ' layer')}"
    if loops:
        text += f" × {_plural(len(loops), 'loop')}"
    return text


def op_formula(
    op: str, kernels: int, instances: list[Context], per_call: Counter[int], tokens: int, total: int
) -> str:
    """One line per op kind, e.g. `norm: 8 kernels × 4 norm calls × 24 layers × 4 loops = 3,072
    kernels/token (54 %)`. Calls are factored per layer role, inside and outside loops separately."""
    share = 100.0 * kernels / total if total else 0.0
    tail = f"{_plural(kernels / tokens, 'kernel')}/token ({share:.0f} %)"
    if not instances:
        where = "inside CUDA-graph replays, no lt.op range" if op == GRAPH_OP else "no lt.op range"
        return f"{op}: {tail}, {where}"
    # One term per (layer role, inside a loop or not): e.g. Ouro's norms are 4 per layer in 24 layers x 4
    # loops, plus the loop-closing norm (no layer) once per loop; Huginn's prelude norms run in no loop.
    groups: dict[tuple[bool, int, str], list[Context]] = defaultdict(list)
    for ctx in instances:
        groups[(ctx.loop is None, ROLE_ORDER.get(ctx.role, len(ROLE_ORDER)), ctx.role)].append(ctx)
    terms = [_term(op, groups[key], per_call, tokens, key[2]) for key in sorted(groups)]
    return f"{op}: {' + '.join(terms)} = {tail}"


def _top_kernels(kernels: list[TraceEvent], top: int) -> tuple[list[KernelStat], list[KernelStat]]:
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        acc[e.name][0] += 1
        acc[e.name][1] += e.dur
    stats = [KernelStat(name, int(v[0]), v[1]) for name, v in acc.items()]
    by_count = sorted(stats, key=lambda s: (-s.count, -s.total_us, s.name))[:top]
    by_time = sorted(stats, key=lambda s: (-s.total_us, -s.count, s.name))[:top]
    return by_count, by_time


def _notes(c: Counters, tokens_source: str, unlinked: int, mode: str) -> list[str]:
    notes = [
        "mode gpu: kernels are `kernel` events"
        if mode == "gpu"
        else "mode cpu: the trace has no kernel events, kernels are leaf cpu_ops (containment per thread)",
        f"window: {c.window}",
        f"tokens: {c.tokens} ({tokens_source})",
        "syncs: one per correlation id (runtime call + its cuda_sync activity count once); "
        "stream waits are not blocking and are counted apart",
    ]
    if unlinked:
        notes.append(
            f"{unlinked} device events in the window have no runtime call with their correlation id: "
            "placed by their own timestamps, not attributed"
        )
    if c.pageable:
        notes.append(f"WARNING: {c.pageable} pageable memcpy in the window (each stalls the host)")
    return notes
