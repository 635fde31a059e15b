"""Findings: what each cost in the window is, where it sits, and the change that removes it.

Each finding is computed from the trace's own events (`Analysis.device_items`, `Analysis.sync_items` and
the window counters), never looked up: a cost measured per token and as a share of the window's wall
time, where it sits (stage / layer / loop / op, whatever the kernels' contexts carry), the evidence, the
change that removes it and the saving that change would bring, with how that saving was estimated.

Kinds (each silent unless its estimated saving reaches `MIN_SAVING_PCT` of the window's wall time, of its
device busy time for the norm):

- `host_gaps`: the GPU idles between eagerly launched kernels, waiting for the host to launch the next
  one. CUDA graphs remove those gaps (a replay leaves only its own, measured, per-node gaps).
- `loop_sync`: a blocking sync inside the loops (the exit gate's logit read back every loop) drains the
  GPU: it idles from the sync until the host has launched the next loop. An asynchronous gate (read one
  loop late) keeps the next loop queued.
- `unfused_norm`: an RMSNorm that runs as more kernels per call than the exact fused norm
  (`EXACT_NORM_KERNELS`). A fused kernel makes one pass over its input: its time is estimated as the
  call's longest kernel (in an eager RMSNorm that is the mean, which reads the whole input once); the
  saving is the median call's (robust to one preempted CPU op), times the calls.
- `dead_kv` (`findings_kv`): decode attention over a padded key length reads dead KV slots.
- `fusable_launch`: ops outside the layers that run once per loop (more than once per token; with loop
  indices, in more than one loop), each call a few short kernels (median ≤ `SHORT_KERNEL_US`): the
  traversal metadata, the exit gate, the loop-closing norm, Huginn's adapter. Each launch costs its idle
  gap before it plus its duration; fusing the op into a neighbouring kernel (or building it once per token)
  keeps the work but removes, per launch, the gap and the fixed cost of a kernel, taken as the window's
  shortest device event. Its cost may overlap `host_gaps` (an eager launch's gap counts in both).

The GPU timeline is the union of the window's device events (as `counters._timeline`); a gap is the idle
time between two busy intervals, charged to the event that ends it.
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from looptrace.probes.classify import KERNEL_CAT, is_copy_kernel_name
from looptrace.probes.context import NONE, Context
from looptrace.probes.counters import Analysis
from looptrace.probes.finding import MIN_SAVING_PCT, Finding
from looptrace.probes.findings_kv import dead_kv
from looptrace.probes.window_items import DeviceItem, SyncItem

# The engine's exact RMSNorm is at most three kernels (square, mean, fenced normalize; base-engine.md
# "Exact fusion"); an eager RMSNorm is eight. More kernels per call than this is an unfused norm.
EXACT_NORM_KERNELS = 3
NORM_OPS = frozenset({"norm", "RMSNorm"})  # looptrace's lt.op kind; the op category of foreign traces
LOOP_SYNC_OPS = frozenset({"gate", "readback"})  # looptrace's ops that read the gate back
TOP_SITES = 3
NOT_OPS = ("graph", "other")  # counters' names for kernels with no op range (graph replay, eager)
SHORT_KERNEL_US = 5.0  # a kernel this short is dominated by its launch: fusing it away saves the launch
# What removes each per-loop op's launches, by looptrace's op kind; other ops get the generic remedy.
PER_LOOP_REMEDIES = {
    "metadata": "build the traversal metadata once per token, not once per loop: looptrace's engine "
    "scheduler.loop_fusion + scheduler.whole_token (one whole-token step; each loop's plane only swaps its "
    "page table)",
    "norm": "fuse the loop-closing norm into the kernel before it: looptrace's engine kernels.exact + "
    "kernels.residual_norm (one exact kernel per norm)",
    "gate": "fuse the exit gate (GEMV, sigmoid, copy) into the loop-closing norm's kernel, or read it once "
    "per token: exit.policy=fixed where the depth is fixed",
    "readback": "read the gate back once per token: scheduler.whole_token with scheduler.async_decode",
    "adapter": "fuse the adapter's concat into its GEMM (two GEMMs summed into one output)",
}

# PyTorch's eager RMSNorm, by kernel (GPU) or leaf op (CPU) name: [cast] pow mean add rsqrt mul [cast mul].
_POW = re.compile(r"pow_tensor_scalar|^aten::pow$")
_RSQRT = re.compile(r"rsqrt")
_NORM_TAIL = re.compile(r"elementwise_kernel|^aten::(mul|copy_|_to_copy|add)$")
_CPU_CAST = re.compile(r"^aten::(copy_|_to_copy)$")


def find(analysis: Analysis) -> list[Finding]:
    """The findings of one analysed window, largest saving first."""
    found = [
        f
        for f in (
            _host_gaps(analysis),
            _loop_sync(analysis),
            _unfused_norm(analysis),
            _fusable_launch(analysis),
            dead_kv(analysis),
        )
        if f is not None
    ]
    return sorted(found, key=lambda f: -f.saving_us_per_token)


# --- the GPU timeline -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gap:
    start: float  # end of the busy interval before
    end: float  # start of the device event that ends the gap
    after: DeviceItem  # that event

    @property
    def us(self) -> float:
        return self.end - self.start


def gaps(items: Sequence[DeviceItem]) -> list[Gap]:
    """Idle intervals between the busy intervals of the device events (in device-time order)."""
    out: list[Gap] = []
    busy_end: float | None = None
    for item in sorted(items, key=lambda i: i.event.ts):
        e = item.event
        if busy_end is not None and e.ts > busy_end:
            out.append(Gap(busy_end, e.ts, item))
        busy_end = e.end if busy_end is None else max(busy_end, e.end)
    return out


def _wall(analysis: Analysis) -> float:
    c = analysis.counters
    return c.wall_us if c.wall_us else c.host_us


def _pct(us: float, base: float) -> float:
    return 100.0 * us / base if base else 0.0


def _place(cx: Context) -> str:
    """A context in words: stage / layer / loop / op, the parts it has."""
    parts = [cx.stage if cx.stage != NONE else None, cx.layer]
    parts += [f"loop {cx.loop}" if cx.loop is not None else None, cx.op]
    return " / ".join(p for p in parts if p) or "no range"


def _top_places(weights: Iterable[tuple[str, float]], total: float) -> str:
    acc: dict[str, float] = defaultdict(float)
    for place, us in weights:
        acc[place] += us
    top = sorted(acc.items(), key=lambda kv: -kv[1])[:TOP_SITES]
    return "; ".join(f"{place} {_pct(us, total):.0f} %" for place, us in top)


def _coarse(cx: Context) -> str:
    """Stage and op of a context (loops and layers summed): where a launch or a sync sits."""
    return _place(Context(stage=cx.stage, op=cx.op))


# --- host gaps → CUDA graphs ----------------------------------------------------------------------------


def _host_gaps(analysis: Analysis) -> Finding | None:
    c = analysis.counters
    if c.mode != "gpu" or c.gpu_idle_us is None:
        return None
    wall, tokens = _wall(analysis), c.tokens
    sync_ends = sorted(s.event.end for s in analysis.sync_items)
    launch_gaps = [
        g
        for g in gaps(analysis.device_items)
        if g.after.eager and g.after.event.cat == KERNEL_CAT and not _spans_any(g, sync_ends)
    ]
    if not launch_gaps:
        return None
    gap_us = sum(g.us for g in launch_gaps)
    # A graph replay still idles between dependent nodes: the trace's own replays give that gap per kernel.
    per_node = (c.graph_gap_us or 0.0) / c.graph_kernels if c.graph_kernels else 0.0
    saving = max(0.0, gap_us - per_node * len(launch_gaps))
    if _pct(saving, wall) < MIN_SAVING_PCT:
        return None
    idle_on_host = c.gpu_idle_us - min(c.graph_gap_us or 0.0, c.gpu_idle_us)
    if per_node:
        estimate = (
            f"the idle gaps before {len(launch_gaps):,} eagerly launched kernels ({gap_us / 1e3:,.3f} ms in "
            f"the window, gaps that span a blocking sync left out) minus the idle a graph replay keeps "
            f"per kernel, measured on this trace's own replays ({per_node:.2f} µs)"
        )
    else:
        estimate = (
            f"the idle gaps before {len(launch_gaps):,} eagerly launched kernels ({gap_us / 1e3:,.3f} ms in "
            "the window, gaps that span a blocking sync left out); the trace has no graph replay to measure "
            "the per-node gap a replay keeps, so this is an upper bound"
        )
    if c.graph_launches:
        remedy = (
            "put the eager launches left around the graph replays into the graph: a whole-token graph "
            "(looptrace's engine: scheduler.loop_fusion + scheduler.whole_token) replays prelude, every "
            "loop, coda and sampling as one"
        )
    else:
        remedy = (
            "replay the decode step as CUDA graphs: looptrace's engine cuda_graphs.enabled (one graph per "
            "loop) or scheduler.whole_token (one per token); vLLM without --enforce-eager; Hugging Face "
            "with a static cache and torch.compile(mode='reduce-overhead')"
        )
    return Finding(
        kind="host_gaps",
        cost=(
            f"the GPU idles {idle_on_host / 1e3 / tokens:,.3f} ms/token waiting on the host "
            f"({_pct(idle_on_host, wall):.0f} % of the wall), {gap_us / 1e3 / tokens:,.3f} ms/token of it "
            "in the gaps before eagerly launched kernels"
        ),
        cost_us_per_token=idle_on_host / tokens,
        cost_pct_of_wall=_pct(idle_on_host, wall),
        where="gaps before kernels of "
        + _top_places(((_coarse(g.after.context), g.us) for g in launch_gaps), gap_us),
        evidence=(
            f"{c.eager_launches / tokens:,.1f} eager launches/token, {c.graph_launches / tokens:,.2f} graph "
            f"launches/token; GPU busy {c.gpu_busy_us / 1e3 / tokens if c.gpu_busy_us else 0.0:,.3f} "
            f"ms/token of {wall / 1e3 / tokens:,.3f} ms/token wall; mean gap before an eager kernel "
            f"{gap_us / len(launch_gaps):,.2f} µs"
        ),
        remedy=remedy,
        saving_us_per_token=saving / tokens,
        saving_pct_of_wall=_pct(saving, wall),
        estimate=estimate,
    )


def _spans_any(gap: Gap, times: list[float]) -> bool:
    """Whether a sorted time list has a point inside the gap."""
    i = bisect.bisect_left(times, gap.start)
    return i < len(times) and times[i] <= gap.end


# --- a sync per loop → asynchronous gate ----------------------------------------------------------------


def _in_loop(cx: Context) -> bool:
    return cx.loop is not None or cx.stage == "recurrent" or cx.op in LOOP_SYNC_OPS


def loop_syncs(syncs: Sequence[SyncItem], items: Sequence[DeviceItem]) -> list[SyncItem]:
    """The syncs inside the loops: by their own ranges (looptrace's traces), else, where the trace has no
    range around them (foreign traces, whose loops come from the kernels), a sync whose end falls between
    two device events that both ran inside loops; it takes the context of the one before."""
    ordered = sorted(items, key=lambda i: i.event.ts)
    starts = [i.event.ts for i in ordered]
    out = []
    for s in syncs:
        if _in_loop(s.context):
            out.append(s)
            continue
        if s.context != Context():
            continue
        k = bisect.bisect_right(starts, s.event.end)
        before, after = (ordered[k - 1] if k else None), (ordered[k] if k < len(ordered) else None)
        if before and after and before.context.loop is not None and after.context.loop is not None:
            out.append(SyncItem(s.kind, s.event, before.context))
    return out


def _loop_sync(analysis: Analysis) -> Finding | None:
    c = analysis.counters
    if c.mode != "gpu":
        return None
    syncs = loop_syncs(analysis.sync_items, analysis.device_items)
    if not syncs:
        return None
    wall, tokens = _wall(analysis), c.tokens
    drains = sync_drains(syncs, gaps(analysis.device_items))
    drained = sum(drains)
    if _pct(drained, wall) < MIN_SAVING_PCT:
        return None
    host_wait = sum(s.event.dur for s in syncs)
    # Loops a token runs, from the kernels' contexts (the readback itself may sit outside the loop range).
    loops = {i.context.loop for i in analysis.device_items if i.context.loop is not None}
    per_loop = f", {len(syncs) / tokens / len(loops):,.2f} per loop over {len(loops)} loops" if loops else ""
    apis = Counter(f"{s.event.name} ({s.kind})" for s in syncs)
    return Finding(
        kind="loop_sync",
        cost=(
            f"{len(syncs) / tokens:,.2f} blocking syncs/token inside the loops{per_loop}: the GPU drains "
            f"and idles {drained / 1e3 / tokens:,.3f} ms/token ({_pct(drained, wall):.0f} % of the wall) "
            "until the host launches the next loop"
        ),
        cost_us_per_token=drained / tokens,
        cost_pct_of_wall=_pct(drained, wall),
        where=_top_places(((_coarse(s.context), d) for s, d in zip(syncs, drains, strict=True)), drained)
        if drained
        else _coarse(syncs[0].context),
        evidence=(
            ", ".join(f"{n:,} × {api}" for api, n in apis.most_common())
            + f"; the host waits {host_wait / 1e3 / tokens:,.3f} ms/token in them"
        ),
        remedy=(
            "read the exit gate one loop late: looptrace's engine scheduler.async_gate (the next loop is "
            "submitted before the last gate logit is read), or exit.policy=fixed where the depth is fixed"
        ),
        saving_us_per_token=drained / tokens,
        saving_pct_of_wall=_pct(drained, wall),
        estimate=(
            "the GPU idle gap around the end of each of these syncs (from the last device event before it to "
            "the first after it): with the next loop already queued the GPU runs through it"
        ),
    )


def sync_drains(syncs: Sequence[SyncItem], idle: Sequence[Gap]) -> list[float]:
    """Per sync, the idle gap that holds its end (0 if the GPU was busy then); each gap counts once."""
    starts = [g.start for g in idle]
    used: set[int] = set()
    out = []
    for s in syncs:
        i = bisect.bisect_right(starts, s.event.end) - 1
        if i >= 0 and idle[i].start <= s.event.end <= idle[i].end and i not in used:
            used.add(i)
            out.append(idle[i].us)
        else:
            out.append(0.0)
    return out


# --- an RMSNorm of many kernels → the fused exact norm --------------------------------------------------


def norm_calls(items: Sequence[DeviceItem]) -> tuple[list[list[DeviceItem]], str]:
    """The window's RMSNorm calls as lists of kernels, and how they were found: from op ranges (looptrace's
    lt.op/norm instances), else runs of kernels whose op is a norm, else PyTorch's eager RMSNorm pattern
    in the kernel names."""
    kernels = [i for i in items if i.event.cat == KERNEL_CAT or i.event.cat == "cpu_op"]
    by_range: dict[int, list[DeviceItem]] = defaultdict(list)
    for i in kernels:
        if i.context.op in NORM_OPS and i.context.op_range is not None:
            by_range[id(i.context.op_range)].append(i)
    if by_range:
        return list(by_range.values()), "op ranges (lt.op/norm)"
    runs: list[list[DeviceItem]] = []
    previous: Context | None = None  # context of the kernel before, if it was a norm's
    for i in kernels:
        cx = i.context
        if cx.op not in NORM_OPS:
            previous = None
            continue
        if previous is not None and (previous.layer, previous.loop) == (cx.layer, cx.loop):
            runs[-1].append(i)  # the same call goes on (a new layer or loop starts a new one)
        else:
            runs.append([i])
        previous = cx
    if runs:
        return runs, "runs of kernels of the norm op"
    return _eager_rmsnorm_pattern(
        kernels
    ), "PyTorch's eager RMSNorm kernel pattern (pow, mean, add, rsqrt, mul)"


def _eager_rmsnorm_pattern(kernels: Sequence[DeviceItem]) -> list[list[DeviceItem]]:
    names = [k.event.name for k in kernels]
    calls = []
    for r, name in enumerate(names):
        if not _RSQRT.search(name):
            continue
        pow_at = next((j for j in range(r - 1, max(-1, r - 6), -1) if _POW.search(names[j])), None)
        if pow_at is None:
            continue
        start = pow_at - 1 if pow_at and _is_cast(names[pow_at - 1]) else pow_at
        end = r + 1
        while (
            end < len(names)
            and end - r <= 3
            and _NORM_TAIL.search(names[end])
            and not _POW.search(names[end])
        ):
            if end + 1 < len(names) and _POW.search(names[end + 1]):  # the next norm's input cast
                break
            end += 1
        calls.append(list(kernels[start:end]))
    return calls


def _is_cast(name: str) -> bool:
    return is_copy_kernel_name(name) or bool(_CPU_CAST.match(name))


def _unfused_norm(analysis: Analysis) -> Finding | None:
    c = analysis.counters
    calls, how = norm_calls(analysis.device_items)
    if not calls:
        return None
    n_kernels = sum(len(k) for k in calls)
    per_call = n_kernels / len(calls)
    if per_call <= EXACT_NORM_KERNELS:
        return None
    tokens, wall = c.tokens, _wall(analysis)
    norm_us = sum(k.event.dur for call in calls for k in call)
    # Per call: its kernels' time minus its longest kernel's. The median call times the calls, so that one
    # preempted CPU op or a stalled kernel does not decide the estimate.
    per_call_saving = statistics.median(
        sum(k.event.dur for k in call) - max(k.event.dur for k in call) for call in calls
    )
    saving = per_call_saving * len(calls)
    device_us = c.gpu_busy_us if c.gpu_busy_us else c.gpu_us
    if _pct(saving, device_us) < MIN_SAVING_PCT:
        return None
    time_word = "GPU" if c.mode == "gpu" else "CPU op"
    formula = next((f for f in analysis.breakdown.formulas if f.split(":", 1)[0] in NORM_OPS), None)
    where = formula.split(":", 1)[1].strip() if formula and "×" in formula else _norm_places(calls, tokens)
    removed = (n_kernels - len(calls)) / tokens
    launches = " and as many launches" if c.mode == "gpu" else ""
    gone = f"{removed:,.1f} kernels{launches}/token would go"
    return Finding(
        kind="unfused_norm",
        cost=(
            f"RMSNorm runs as {per_call:,.1f} kernels per call, {len(calls) / tokens:,.1f} calls/token: "
            f"{n_kernels / tokens:,.1f} kernels and {norm_us / tokens:,.1f} µs/token of {time_word} time "
            f"({_pct(norm_us, device_us):.0f} % of the {time_word} busy time)"
        ),
        cost_us_per_token=norm_us / tokens,
        cost_pct_of_wall=_pct(norm_us, wall),
        where=where,
        evidence=f"calls found by {how}; {gone}",
        remedy=(
            "one fused norm kernel per call: looptrace's engine kernels.exact (CUDA: the exact fused "
            "RMSNorm, bitwise equal to eager) and kernels.residual_norm (post-norm + residual add + next "
            "pre-norm as one kernel); elsewhere a fused RMSNorm kernel (vLLM's rms_norm, torch.compile)"
        ),
        saving_us_per_token=saving / tokens,
        saving_pct_of_wall=_pct(saving, wall),
        estimate=(
            "per norm call, its kernels' time minus one fused kernel, taken as the call's longest kernel "
            f"(one pass over the input): the median call saves {per_call_saving:,.2f} µs, times "
            f"{len(calls) / tokens:,.1f} calls/token ({_pct(saving, device_us):.0f} % of the {time_word} "
            "busy time)"
        ),
    )


def _norm_places(calls: Sequence[list[DeviceItem]], tokens: int) -> str:
    """Calls per token by where their first kernel sits (loop structure where the contexts carry it)."""
    firsts = [call[0].context for call in calls]
    loops = {cx.loop for cx in firsts if cx.loop is not None}
    layers = {cx.layer for cx in firsts if cx.layer is not None}
    text = f"{len(calls) / tokens:,.1f} calls/token"
    if loops:
        in_loops = sum(1 for cx in firsts if cx.loop is not None)
        text += f", {in_loops / tokens:,.1f} of them inside {len(loops)} loops"
    if layers:
        text += f" over {len(layers)} layers"
    return text if loops or layers else text + " (no stage, layer or loop in the trace: per-op counts)"


# --- small per-loop launches → fused into a neighbouring kernel -----------------------------------------


@dataclass(frozen=True)
class PerLoopOp:
    """An op outside the layers that runs once per loop, with its kernels and the idle gap before each."""

    stage: str
    op: str
    calls: int
    kernels: list[DeviceItem]
    gaps_us: list[float]  # idle time before each kernel (0 where the GPU or CPU was busy)

    @property
    def launch_us(self) -> float:
        """What its launches cost: gaps before them plus their durations."""
        return sum(self.gaps_us) + sum(k.event.dur for k in self.kernels)


def per_loop_ops(items: Sequence[DeviceItem], tokens: int) -> list[PerLoopOp]:
    """Ops outside every layer that run more than once per token (in more than one loop where the contexts
    carry loops), each call of short kernels (median ≤ SHORT_KERNEL_US): what a loop launches on its own."""
    gap_before = {id(g.after): g.us for g in gaps(items)}
    by_op: dict[tuple[str, str], list[DeviceItem]] = defaultdict(list)
    calls_of: Counter[tuple[str, str]] = Counter()
    previous: Context | None = None
    for i in items:
        cx = i.context
        if i.event.cat not in (KERNEL_CAT, "cpu_op"):
            continue
        if cx.op not in (None, *NOT_OPS) and cx.layer is None:
            by_op[(cx.stage, cx.op)].append(i)
            # a call: its op range (looptrace's traces), else a run of kernels of the op in one loop
            same_call = previous is not None and previous.op_range is cx.op_range
            calls_of[(cx.stage, cx.op)] += not (
                same_call and (previous.op, previous.loop) == (cx.op, cx.loop)
            )
        previous = cx
    out = []
    for (stage, op), kernels in by_op.items():
        calls = calls_of[(stage, op)]
        loops = {k.context.loop for k in kernels if k.context.loop is not None}
        per_loop = calls > tokens and (not loops or len(loops) > 1)
        if per_loop and statistics.median(k.event.dur for k in kernels) <= SHORT_KERNEL_US:
            out.append(PerLoopOp(stage, op, calls, kernels, [gap_before.get(id(k), 0.0) for k in kernels]))
    return sorted(out, key=lambda o: -o.launch_us)


def _fusable_launch(analysis: Analysis) -> Finding | None:
    c = analysis.counters
    tokens, wall = c.tokens, _wall(analysis)
    ops = per_loop_ops(analysis.device_items, tokens)
    if not ops or not analysis.device_items:
        return None
    # The fixed cost of one kernel: the window's shortest device event (a kernel that does almost nothing).
    floor = min(i.event.dur for i in analysis.device_items)
    saved = {o.op: sum(o.gaps_us) + sum(min(k.event.dur, floor) for k in o.kernels) for o in ops}
    saving = sum(saved.values())
    if _pct(saving, wall) < MIN_SAVING_PCT:
        return None
    launches = sum(len(o.kernels) for o in ops)
    cost = sum(o.launch_us for o in ops)
    word = "kernels" if c.mode == "gpu" else "CPU ops"
    remedies = [PER_LOOP_REMEDIES.get(o.op) for o in ops]
    generic = (
        "fuse the op's kernels into the neighbouring kernel of the loop (one launch fewer per loop each)"
    )
    return Finding(
        kind="fusable_launch",
        cost=(
            f"{launches / tokens:,.1f} short {word}/token launched once per loop outside the layers: "
            f"{cost / tokens:,.1f} µs/token in their launches (gap before + duration, "
            f"{_pct(cost, wall):.0f} % of the wall)"
        ),
        cost_us_per_token=cost / tokens,
        cost_pct_of_wall=_pct(cost, wall),
        where="; ".join(
            f"{_coarse(Context(stage=o.stage, op=o.op))} {o.calls / tokens:,.1f} calls/token × "
            f"{len(o.kernels) / o.calls:,.1f} {word}"
            for o in ops[:TOP_SITES]
        ),
        evidence="; ".join(
            f"{o.op}: mean gap before {sum(o.gaps_us) / len(o.kernels):,.2f} µs, mean duration "
            f"{statistics.fmean(k.event.dur for k in o.kernels):,.2f} µs"
            for o in ops[:TOP_SITES]
        ),
        remedy="; ".join(dict.fromkeys(r or generic for r in remedies[:TOP_SITES])),
        saving_us_per_token=saving / tokens,
        saving_pct_of_wall=_pct(saving, wall),
        estimate=(
            f"per launch, the idle gap before it plus the fixed cost of a kernel, taken as the window's "
            f"shortest device event ({floor:,.2f} µs); the work itself stays (it moves into the neighbouring "
            "kernel): " + ", ".join(f"{op} {us / tokens:,.1f} µs/token" for op, us in saved.items())
        ),
    )
