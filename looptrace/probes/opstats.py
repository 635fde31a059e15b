"""Which CPU op launched each device event, its category and layer; per-category and per-op rows.

A device event's *ancestry* is the stack of CPU ops (and `nn.Module` Python events, for the layer) open
on the launching thread when its runtime call was made; for a graph-replay kernel it is the ancestry of
the same launch in the capture trace (`capture`). `categories.categorize` picks the op that decides the
category; that op instance is the kernel's *call*: a call's FLOPs and bytes (from its recorded shapes,
`roofline.op_cost`) count once, against the total time of the kernels it launched.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from looptrace.probes import categories as cats
from looptrace.probes import collectives as comms
from looptrace.probes import roofline
from looptrace.probes.classify import CPU_OP_CAT
from looptrace.probes.events import TraceError, TraceEvent, enclosing_chains

PYTHON_CAT = "python_function"
MODULE_PREFIX = "nn.Module: "
_ANON_NS = "(anonymous namespace)::"
_TEMPLATE_RE = re.compile(r"^([^<(]+)")


@dataclass(frozen=True)
class KernelOp:
    """What one device event is: category, the op that launched it, layer, and its call instance."""

    category: str
    op: str
    layer: int | str | None = None  # a module's layer index; looptrace's own traces: the lt.layer name
    call: Hashable | None = None  # one instance of `op`; None when the kernel name decided
    shapes: TraceEvent | None = None  # the CPU op whose recorded shapes give the call's cost
    # (keys, pairs) of the engine step that launched it: what a paged attention op reads and computes
    kv: tuple[int, int | None] | None = None
    device: TraceEvent | None = None  # communication: the kernel itself (newer Kineto copies the
    # collective's "In msg nelems", "dtype", "Group size" onto it)


@dataclass
class CategoryRow:
    """Device time of one op category. Kernel categories count kernels (their sum is the report's kernel
    count); the `memcpy` and `memset` rows count those operations (events), which are not kernels."""

    category: str
    kernels: int
    gpu_us: float
    share: float  # % of the device time of the window (kernels + memcpy + memset)
    per_token_us: float
    events: int = 0  # kernels, or memcpys / memsets in those two rows


@dataclass
class OpRow:
    category: str
    op: str
    layer: int | str | None
    calls: int
    kernels: int
    gpu_us: float
    bytes: float | None = None
    flops: float | None = None
    achieved_tbps: float | None = None
    achieved_tflops: float | None = None
    pct_of_peak: float | None = None
    bound: str | None = None
    shape: str | None = None  # the calls' input shapes, where rows are split by shape (GEMM, attention)
    collective: str | None = None  # communication rows: all_reduce, all_gather, ...
    world_size: int | None = None
    alg_gbps: float | None = None  # NCCL-tests algorithm bandwidth, GB/s
    bus_gbps: float | None = None  # NCCL-tests bus bandwidth, GB/s (None: world size unknown)


@dataclass(frozen=True)
class CommContext:
    """What the bandwidth of a collective needs beyond its op: the process group's size (None: unknown)
    and the process group's ranges (`nccl:all_reduce`, …) that carry the tensors' shapes."""

    world_size: int | None
    ranges: Sequence[TraceEvent] = ()

    @classmethod
    def of(cls, events: Iterable[TraceEvent], distributed_info: dict[str, Any] | None) -> CommContext:
        named = [e for e in events if comms.is_comm_name(e.name)]
        ranges = [e for e in named if e.cat != "kernel"]
        return cls(comms.world_size_of(distributed_info, named), sorted(ranges, key=lambda e: e.ts))


def is_ancestry_range(e: TraceEvent) -> bool:
    """Events that can be a kernel's ancestors: CPU ops, and module events (they carry the layer)."""
    return e.cat == CPU_OP_CAT or (e.cat == PYTHON_CAT and e.name.startswith(MODULE_PREFIX))


def ancestry_chains(
    events: Iterable[TraceEvent], positions: Sequence[tuple[tuple | None, float]]
) -> list[tuple[TraceEvent, ...]]:
    """For each host position (thread, time), the CPU ops and module events open there, outer → inner."""
    by_thread: dict[tuple, list[TraceEvent]] = defaultdict(list)
    for e in events:
        if is_ancestry_range(e):
            by_thread[(e.pid, e.tid)].append(e)
    queries: dict[tuple, list[int]] = defaultdict(list)
    for i, (thread, _) in enumerate(positions):
        if thread is not None and thread in by_thread:
            queries[thread].append(i)
    out: list[tuple[TraceEvent, ...]] = [()] * len(positions)
    for thread, idx in queries.items():
        ranges = sorted(by_thread[thread], key=lambda r: (r.ts, -r.dur))
        for i, chain in zip(idx, enclosing_chains(ranges, [positions[i][1] for i in idx]), strict=True):
            out[i] = chain
    return out


def short_kernel_name(name: str) -> str:
    """`void at::native::reduce_kernel<512, 1, ...>(...)` → `at::native::reduce_kernel`;
    `void (anonymous namespace)::softmax_warp_forward<...>(...)` → `softmax_warp_forward`."""
    bare = name.removeprefix("void ").replace(_ANON_NS, "")
    m = _TEMPLATE_RE.match(bare)
    return (m.group(1).strip() if m else name)[:80] or name[:80]


def kernel_op(kernel: str, chain: Sequence[TraceEvent], call_scope: Hashable = None) -> KernelOp:
    """Category, op, layer and call of one kernel from its ancestry. `call_scope` tells apart calls of
    one captured op replayed several times (the replay's correlation id)."""
    ops = [r for r in chain if r.cat == CPU_OP_CAT]
    category, i = cats.categorize([r.name for r in ops], kernel)
    layer = cats.layer_index([r.name for r in chain if r.cat == PYTHON_CAT])
    if i is None and not ops:
        return KernelOp(category, short_kernel_name(kernel), layer)
    # The kernel's name may decide the category, but the op that launched it keeps its name (innermost).
    op = ops[-1 if i is None else i]
    return KernelOp(category, op.name, layer, (call_scope, id(op)), op)


def category_rows(durations: Sequence[float], ops: Sequence[KernelOp], tokens: int) -> list[CategoryRow]:
    """Device time per category, largest first; shares of the summed device time."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for dur, op in zip(durations, ops, strict=True):
        acc[op.category][0] += 1
        acc[op.category][1] += dur
    total = sum(durations) or 1.0
    rows = [
        CategoryRow(cat, 0 if cat in cats.MEMORY else int(n), us, 100.0 * us / total, us / tokens, int(n))
        for cat, (n, us) in acc.items()
    ]
    return sorted(rows, key=lambda r: (-r.gpu_us, r.category))


def device_peak(device_properties: list[dict[str, Any]] | None, override: str | None = None) -> Any:
    """The roofline's device (peaks) from the trace's `deviceProperties` or a name; None if unknown.
    TraceError for a name the device table does not know."""
    try:
        return roofline.device_for(device_properties, override)
    except ValueError as exc:
        raise TraceError(f"--device: {exc}") from None


def op_rows(
    durations: Sequence[float], ops: Sequence[KernelOp], peak: Any = None, comm: CommContext | None = None
) -> list[OpRow]:
    """One row per (category, op, layer): calls, kernels, time, and the calls' summed cost and roofline
    position (against `peak`, a `roofline.DevicePeak`) where `roofline` knows the op; communication rows
    get their collective's bytes and bandwidths instead (`collectives`, with `comm`)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        groups[(op.category, op.op, op.layer, _shape(roofline, op))].append(i)
    rows = []
    for (category, name, layer, shape), idx in groups.items():
        calls = {ops[i].call: ops[i] for i in idx if ops[i].call is not None}
        row = OpRow(category, name, layer, len(calls) or len(idx), len(idx), sum(durations[i] for i in idx))
        row.shape = shape
        if category == cats.COMM:
            comm_calls = list(calls.values()) or [ops[i] for i in idx]  # kernel-named only: each kernel
            _add_comm(row, comm_calls, comm or CommContext(None))
        elif calls:
            _add_cost(row, roofline, list(calls.values()), peak)
        rows.append(row)
    return sorted(rows, key=lambda r: (-r.gpu_us, r.category, r.op, str(r.layer), r.shape or ""))


# Rows of these categories are split by the calls' shapes: one GEMM op runs several shapes in a model
# (qkv, out, gate-up, down projections), each at its own place on the roofline.
SHAPED_CATEGORIES = (cats.GEMM, cats.ATTENTION)


def _shape(roofline: ModuleType | None, op: KernelOp) -> str | None:
    if roofline is None or op.shapes is None or op.category not in SHAPED_CATEGORIES:
        return None
    return roofline.shape_label(op.shapes.name, op.shapes.args.get("Input Dims"))


def _add_comm(row: OpRow, calls: list[KernelOp], comm: CommContext) -> None:
    """Collective, bytes and bandwidths of a communication row (rule in `collectives`): each call's bytes
    from its kernel's arguments, its op's, or its process group range's shapes, the first that has them."""
    first = calls[0] if calls else None
    args = next((e.args for e in (first.device, first.shapes) if e is not None), None) if first else None
    row.collective = comms.kind_of(row.op, args)
    if row.collective is None and first is not None and first.device is not None:
        row.collective = comms.kind_of(first.device.name, first.device.args)
    row.world_size = comm.world_size
    if row.collective is None or not calls:
        return
    per_call = []
    for call in calls:
        found = [e for e in (call.device, call.shapes) if e is not None]
        if call.shapes is not None:
            found += [r for r in (_pg_range(call.shapes, row.collective, comm),) if r is not None]
        per_call.append(comms.call_bytes(row.collective, found, comm.world_size) if found else None)
    stat = comms.comm_stat(row.collective, per_call, row.gpu_us, comm.world_size)
    row.bytes, row.alg_gbps, row.bus_gbps = stat.bytes, stat.alg_gbps, stat.bus_gbps


def _pg_range(op: TraceEvent, kind: str, comm: CommContext) -> TraceEvent | None:
    """The process group's range of one call (`nccl:all_reduce`, `gloo:all_gather`, which carry the
    shapes): the first range of the same collective starting at or after the op, on any thread (gloo runs
    it on a worker thread, possibly after the c10d op returned)."""
    return next(
        (r for r in comm.ranges if r is not op and r.ts >= op.ts and comms.kind_of(r.name, r.args) == kind),
        None,
    )


def comm_notes(rows: Sequence[OpRow]) -> list[str]:
    """One line per communication row: what it moved and at what algorithm and bus bandwidth."""
    out = []
    for r in rows:
        if r.category != cats.COMM:
            continue
        kind = r.collective or "collective of unknown kind"
        stat = comms.CommStat(kind, r.calls, r.bytes, r.world_size, r.alg_gbps, r.bus_gbps)
        out.append(f"communication {r.op}: {stat.note if r.collective else kind}")
    return out


def _add_cost(row: OpRow, roofline: ModuleType, calls: list[KernelOp], peak: Any) -> None:
    """Sum the calls' costs; the row gets them only when every call has one (a partial sum would
    understate the floor)."""
    flops = nbytes = 0.0
    dtypes: Counter[str] = Counter()
    first = None
    for call in calls:
        e = call.shapes
        cost = _cost(roofline, e, call.kv if call.category == cats.ATTENTION else None)
        if cost is None:
            return
        first = first or cost
        flops, nbytes = flops + (cost.flops or 0.0), nbytes + (cost.bytes or 0.0)
        types = e.args.get("Input type") if e is not None else None
        if isinstance(types, list) and types and types[0]:
            dtypes[str(types[0])] += 1
    row.flops, row.bytes = flops, nbytes
    if first is None or row.gpu_us <= 0:
        return
    total = dataclasses.replace(first, flops=flops, bytes=nbytes)  # the calls' sum, as one cost
    dtype = dtypes.most_common(1)[0][0] if dtypes else None
    got = roofline.achieved(total, row.gpu_us, peak, dtype)
    row.achieved_tbps, row.achieved_tflops = got.achieved_tbps, got.achieved_tflops
    row.pct_of_peak, row.bound = got.pct_of_peak, got.bound


def _cost(roofline: ModuleType, e: TraceEvent | None, kv: tuple[int, int | None] | None = None) -> Any:
    """A call's cost from its recorded shapes; an attention op the table does not know (vLLM's paged
    attention) from its q/k shapes and the step's KV length `kv`, where the annotation gives it."""
    if e is None:
        return None
    dims, types = e.args.get("Input Dims"), e.args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    concrete = e.args.get("Concrete Inputs")
    cost = roofline.op_cost(e.name, dims, types, concrete if isinstance(concrete, list) else None)
    if cost is None and kv is not None and kv[1] is not None:
        cost = roofline.paged_attention_cost(dims, types, kv[0], kv[1])
    return cost
