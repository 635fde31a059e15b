"""Classification rules: what each trace event counts as. One small function per rule.

Names are compared after `normalize_api_name` (done at load time), so Kineto and nsys-style names match.

Sync double counting: CUPTI gives the cuda_sync activity of a blocking call the correlation id of the
runtime/driver call that caused it. `select_syncs` therefore counts one sync per correlation id: when
both the runtime call and its activity are in the trace, the activity's kind is used (the call's when the
activity says `Unknown Sync`) and the runtime call gives the host position; a runtime call without an
activity (sync events disabled, or a synchronous `cudaMemcpy`, which has none) and an activity without a
runtime call (API tracing off) count on their own.
This never double counts and never drops a sync, whether or not `enable_cuda_sync_events` was set.

Copy/cast kernels (GPU), matched on the demangled name:
  * `copy_kernel`             ATen copies and casts: `direct_copy_kernel_cuda` (inside
                              `unrolled_elementwise_kernel<…>`/`vectorized_elementwise_kernel<…>`,
                              used by `.to()`, `.contiguous()`, `clone`), `bfloat16_copy_kernel_cuda`,
                              `float16_copy_kernel_cuda`, `float8_copy_kernel_cuda`;
  * `CatArrayBatchedCopy`     `torch.cat` (all `_contig`/`_aligned`/`_vectorized` variants);
  * Inductor/Triton kernels `triton_{poi,per,red}_fused_<ops>_<n>` whose fused ops are *only* copy ops
    (`_to_copy`, `cat`, `clone`, `copy`, views): a cast fused into a norm is compute, not a copy.
Copy/cast ops (CPU mode): leaf `aten::copy_`, `aten::_to_copy`, `aten::cat`. A *leaf* `aten::to` is
excluded on purpose: `to` only copies through an `aten::_to_copy` child, so a leaf `to` is a no-op alias.

CPU mode (the trace has no kernel events): "kernels" are leaf cpu_ops, i.e. cpu_ops that contain no other
cpu_op on their thread. Ops in `CPU_NO_KERNEL_OPS` (allocation, views, metadata, scalar reads: nothing a
GPU would run as a kernel) are ignored on both sides of that test; otherwise `aten::mm`, which calls
`aten::resolve_conj`, would vanish behind three no-op leaves, and every allocation would count as a kernel.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from looptrace.probes import runtime as rt
from looptrace.probes.events import API_CATS, TraceEvent

KERNEL_CAT = "kernel"
CPU_OP_CAT = "cpu_op"
MEMCPY_CAT = "gpu_memcpy"
MEMSET_CAT = "gpu_memset"
SYNC_CAT = "cuda_sync"

# Call names per kind, both runtimes (CUDA and HIP): the tables live in `runtime`.
EAGER_LAUNCH_NAMES = rt.names_of(rt.EAGER_LAUNCH)
GRAPH_LAUNCH_NAMES = rt.names_of(rt.GRAPH_LAUNCH)

# Sync kinds. `stream_wait` orders two streams on the device and does not block the host: it is counted
# apart and left out of the blocking total.
BLOCKING_SYNC_KINDS = ("stream", "device", "event", "sync_memcpy", "unknown")
STREAM_WAIT = rt.STREAM_WAIT
# cudaEventQuery returns at once (cudaErrorNotReady if the event is pending), yet CUPTI records an
# `Event Sync` activity for it (seen on an H200, CUDA 13) and HTA lists it as blocking. It is a poll:
# counted apart, not in the blocking total.
EVENT_QUERY = rt.EVENT_QUERY
RUNTIME_SYNC_KINDS = {name: kind for name, kind in rt.API_KINDS.items() if kind in rt.SYNC_KINDS}
ACTIVITY_SYNC_KINDS = {
    "Stream Sync": "stream",
    "Context Sync": "device",
    "Event Sync": "event",
    "Unknown Sync": "unknown",
    "Stream Wait Event": STREAM_WAIT,
}

SCALAR_READ_OPS = ("aten::item", "aten::_local_scalar_dense")
# ATen ops that never launch a device kernel (a scalar read is a memcpy on GPU, counted as a scalar read).
CPU_NO_KERNEL_OPS = frozenset(
    "aten::" + name
    for name in (
        "empty", "empty_strided", "empty_like", "resize_", "set_", "resolve_conj", "resolve_neg", "alias",
        "as_strided", "view", "_unsafe_view", "view_as", "reshape", "_reshape_alias", "flatten", "unflatten",
        "t", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select",
        "narrow", "split", "split_with_sizes", "chunk", "unbind", "detach", "detach_", "lift_fresh",
        "contiguous", "to", "type_as", "result_type", "size", "stride", "numel", "dim", "is_nonzero",
        "_local_scalar_dense", "item",
    )
)  # fmt: skip
CPU_COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy", "aten::cat"})

_MEMCPY_RE = re.compile(r"^Memcpy (\w+) \(([\w ]+) -> ([\w ]+)\)$")
_COPY_KERNEL_RE = re.compile(r"copy_kernel|CatArrayBatchedCopy")
_INDUCTOR_RE = re.compile(r"^triton_(?:poi|per|red)_fused_(\w+?)_\d+$")
_INDUCTOR_COPY_OPS = frozenset(
    {"to", "copy", "cat", "clone", "view", "unsqueeze", "squeeze", "expand", "permute", "transpose", "slice"}
)


# --- kernels and launches -------------------------------------------------------------------------------


def is_kernel(e: TraceEvent) -> bool:
    return e.cat == KERNEL_CAT


def is_api_call(e: TraceEvent) -> bool:
    """A CUDA runtime or driver call made by a host thread."""
    return e.cat in API_CATS


def is_eager_launch(e: TraceEvent) -> bool:
    return e.cat in API_CATS and e.name in EAGER_LAUNCH_NAMES


def is_graph_launch(e: TraceEvent) -> bool:
    return e.cat in API_CATS and e.name in GRAPH_LAUNCH_NAMES


def graph_launch_correlations(events: Iterable[TraceEvent]) -> set[int]:
    return {c for e in events if is_graph_launch(e) and (c := e.correlation) is not None}


def is_graph_kernel(e: TraceEvent, graph_correlations: set[int]) -> bool:
    """Kernel of a graph replay: a nonzero `graph id` (CUDA >= 12), or launched by a `cudaGraphLaunch`
    (older CUDA, or traces that drop the arg)."""
    return is_kernel(e) and (bool(e.graph_id) or e.correlation in graph_correlations)


def is_copy_kernel_name(name: str) -> bool:
    """A device kernel that only copies or casts (patterns in the module docstring)."""
    if _COPY_KERNEL_RE.search(name):
        return True
    m = _INDUCTOR_RE.match(name)
    if not m:
        return False
    ops = m.group(1).replace("_to_copy", "_to_")
    return all(tok in _INDUCTOR_COPY_OPS for tok in ops.split("_") if tok)


# --- memory operations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemcpyInfo:
    direction: str  # HtoD, DtoH, DtoD, HtoH, PtoP, ...
    src: str  # Pageable, Pinned, Device, Managed, ...
    dst: str
    bytes: int

    @property
    def pageable(self) -> bool:
        return "Pageable" in (self.src, self.dst)

    @property
    def pinned(self) -> bool:
        return "Pinned" in (self.src, self.dst)


def parse_memcpy(e: TraceEvent) -> MemcpyInfo | None:
    """Direction and memory kinds of a `gpu_memcpy`; pageable vs pinned exists only in the name."""
    if e.cat != MEMCPY_CAT:
        return None
    m = _MEMCPY_RE.match(e.name)
    if not m:
        return MemcpyInfo("Unknown", "Unknown", "Unknown", e.bytes)
    return MemcpyInfo(m.group(1), m.group(2), m.group(3), e.bytes)


def is_memset(e: TraceEvent) -> bool:
    return e.cat == MEMSET_CAT


# --- syncs ----------------------------------------------------------------------------------------------


def sync_kind(e: TraceEvent) -> str | None:
    """Kind of a sync (runtime/driver call or cuda_sync activity), or None if the event is not a sync."""
    if e.cat == SYNC_CAT:
        return ACTIVITY_SYNC_KINDS.get(e.name, "unknown")
    if e.cat in API_CATS:
        return RUNTIME_SYNC_KINDS.get(e.name)
    return None


def select_syncs(events: Iterable[TraceEvent]) -> list[tuple[str, TraceEvent]]:
    """Syncs of the trace, one per correlation id (rule in the module docstring), as (kind, event).

    The event is the runtime/driver call when there is one (its host thread and time place the sync in
    annotation ranges), else the cuda_sync activity. Stream waits are included with kind `stream_wait`.
    """
    calls: dict[int, TraceEvent] = {}
    activities: dict[int, TraceEvent] = {}
    loose: list[tuple[str, TraceEvent]] = []  # no correlation id: cannot be matched, count as is
    for e in events:
        kind = sync_kind(e)
        if kind is None:
            continue
        corr = e.correlation
        if corr is None:
            loose.append((kind, e))
        elif e.cat == SYNC_CAT:
            activities[corr] = e
        else:
            calls[corr] = e
    out = []
    for corr in sorted(calls.keys() | activities.keys()):
        activity, call = activities.get(corr), calls.get(corr)
        kind = sync_kind(activity) if activity is not None else None
        if call is not None and (kind in (None, "unknown") or sync_kind(call) == EVENT_QUERY):
            kind = sync_kind(call)
        out.append((kind, call if call is not None else activity))
    return out + loose


def is_blocking(kind: str) -> bool:
    return kind in BLOCKING_SYNC_KINDS


# --- CPU ops --------------------------------------------------------------------------------------------


def _by_thread(events: Iterable[TraceEvent]) -> dict[tuple, list[TraceEvent]]:
    threads: dict[tuple, list[TraceEvent]] = {}
    for e in events:
        threads.setdefault((e.pid, e.tid), []).append(e)
    return threads


def _parents(ops: list[TraceEvent]) -> dict[int, TraceEvent | None]:
    """Direct parent (by id) of each op of one thread sorted by (ts, -dur): the innermost op still open
    when it starts. A zero-length op contains nothing."""
    parents: dict[int, TraceEvent | None] = {}
    stack: list[TraceEvent] = []
    for e in ops:
        while stack and stack[-1].end <= e.ts:
            stack.pop()
        parents[id(e)] = stack[-1] if stack else None
        stack.append(e)
    return parents


def _sorted_thread_ops(events: Iterable[TraceEvent]) -> list[list[TraceEvent]]:
    ops = [e for e in events if e.cat == CPU_OP_CAT]
    return [sorted(t, key=lambda e: (e.ts, -e.dur)) for t in _by_thread(ops).values()]


def leaf_cpu_ops(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    """CPU-mode "kernels": cpu_ops that contain no other cpu_op on their thread (time containment), both
    sides ignoring `CPU_NO_KERNEL_OPS`. Any leaf counts, not only `aten::` ones: custom ops are kernels.
    """
    leaves = []
    for ops in _sorted_thread_ops(e for e in events if e.name not in CPU_NO_KERNEL_OPS):
        has_child = {id(p) for p in _parents(ops).values() if p is not None}
        leaves.extend(e for e in ops if id(e) not in has_child)
    return leaves


def is_cpu_copy_op(e: TraceEvent) -> bool:
    """A copy/cast among leaf cpu_ops (see module docstring for why a leaf `aten::to` is not one)."""
    return e.cat == CPU_OP_CAT and e.name in CPU_COPY_OPS


def scalar_reads(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    """Host reads of a device scalar: `aten::item`, plus `aten::_local_scalar_dense` not called (directly
    or not) by an `aten::item`: each `.item()` is one read, whether or not the trace shows the inner op."""
    reads = []
    for ops in _sorted_thread_ops(events):
        parents = _parents(ops)
        for e in ops:
            inner = e.name == "aten::_local_scalar_dense" and not _has_ancestor(e, parents, "aten::item")
            if e.name == "aten::item" or inner:
                reads.append(e)
    return reads


def _has_ancestor(e: TraceEvent, parents: dict[int, TraceEvent | None], name: str) -> bool:
    parent = parents[id(e)]
    while parent is not None:
        if parent.name == name:
            return True
        parent = parents[id(parent)]
    return False


def detect_mode(events: Iterable[TraceEvent]) -> str:
    """Return "gpu" when the trace has kernel events, else "cpu" (kernels are then leaf cpu_ops)."""
    return "gpu" if any(is_kernel(e) for e in events) else "cpu"
