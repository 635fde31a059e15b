"""Collective communication in a trace: which collective an op or kernel is, its bytes, and its algorithm
and bus bandwidth in the NCCL-tests convention (nccl-tests `doc/PERFORMANCE.md`).

Names, as the tools write them:
  * NCCL / RCCL device kernels: `ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)`
    (NCCL >= 2.19), `ncclKernel_AllGather_RING_LL_Sum_int8_t(...)` (older NCCL and RCCL),
    `ncclDevKernel_SendRecv(...)`, `ncclDevKernel_Generic_4(...)` (RCCL);
  * c10d CPU ops (torch.distributed): `c10d::allreduce_`, `c10d::allgather_`, `c10d::_allgather_base_`,
    `c10d::reduce_scatter_`, `c10d::_reduce_scatter_base_`, `c10d::alltoall_`, `c10d::alltoall_base_`,
    `c10d::broadcast_`, `c10d::send`, `c10d::recv_`; the functional collectives `_c10d_functional::…`;
  * the process group's record_function range `nccl:all_reduce`, `gloo:all_reduce`, … (it carries the
    tensor's shape and dtype, where the c10d op records only `TensorList`), and `record_param_comms` with
    its "Collective name", "In msg nelems", "Out msg nelems", "dtype" and "Group size" arguments;
  * vLLM's own all-reduce: `vllm::all_reduce`, `_C_custom_ar::all_reduce`, kernel `cross_device_reduce_*`.

Bytes S of one call (nccl-tests' "size"): all-reduce, broadcast, reduce, send/recv, all-to-all: the input
buffer; all-gather: the gathered output (n × the input); reduce-scatter: the input (n × the output).
algbw = S / time; busbw = algbw × factor(n), factor = 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for broadcast, reduce and send/recv. Without the world size n, busbw is
not given (it says so) and an all-gather's S is only known from its output.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from looptrace.probes.events import TraceEvent
from looptrace.probes.roofline import DTYPE_BYTES

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
ALL_TO_ALL, BROADCAST, REDUCE, SEND_RECV = "all_to_all", "broadcast", "reduce", "send_recv"

# (kind, pattern on the lower-cased name with `_`, `:` and spaces removed). Order matters: reduce-scatter
# and all-reduce before plain reduce.
_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (REDUCE_SCATTER, re.compile(r"reducescatter")),
    (ALL_REDUCE, re.compile(r"allreduce|crossdevicereduce")),
    (ALL_GATHER, re.compile(r"allgather")),
    (ALL_TO_ALL, re.compile(r"alltoall")),
    (BROADCAST, re.compile(r"broadcast")),
    (
        SEND_RECV,
        re.compile(r"sendrecv|send$|recv$|ncclkernelsend|ncclkernelrecv|devkernelsend|devkernelrecv"),
    ),
    (REDUCE, re.compile(r"reduce")),
)
# A name that is communication at all (lower-cased, as written).
COMM_NAME_RE = re.compile(
    r"^nccl(?:dev)?kernel_|^nccl:|^gloo:|^mpi:|^ucc:|^c10d::|^_c10d_functional::|^c10d_functional::"
    r"|^record_param_comms$|rccl|^vllm::all_reduce|_custom_ar::|cross_device_reduce"
)
BUSBW_FACTOR = {
    ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    ALL_GATHER: lambda n: (n - 1) / n,
    REDUCE_SCATTER: lambda n: (n - 1) / n,
    ALL_TO_ALL: lambda n: (n - 1) / n,
    BROADCAST: lambda n: 1.0,
    REDUCE: lambda n: 1.0,
    SEND_RECV: lambda n: 1.0,
}
# dtype strings of `record_param_comms` ("Float", "BFloat16", ...) -> element bytes
_PARAM_DTYPE_BYTES = {"float": 4, "double": 8, "bfloat16": 2, "half": 2, "long": 8, "int": 4, "byte": 1,
                      "char": 1, "bool": 1, "short": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip


# Cached: a trace repeats a few hundred op and kernel names over hundreds of thousands of events.
@functools.lru_cache(maxsize=1 << 16)
def is_comm_name(name: str) -> bool:
    return bool(COMM_NAME_RE.search(name.lower()))


def kind_of(name: str, args: dict[str, Any] | None = None) -> str | None:
    """The collective a CPU op, range or kernel name says (its "Collective name" argument first)."""
    named = str((args or {}).get("Collective name") or "")
    for text in (named, name):
        flat = re.sub(r"[_:\s]", "", text.lower())
        flat = flat.split("(", 1)[0]
        for kind, pattern in _KINDS:
            if text and pattern.search(flat):
                return kind
    return None


def _param_bytes(args: dict[str, Any], key: str) -> int | None:
    """Bytes of `record_param_comms`' element count `key` and its dtype, where both are given."""
    nelems, dtype = args.get(key), str(args.get("dtype") or "").lower()
    size = _PARAM_DTYPE_BYTES.get(dtype)
    if not isinstance(nelems, int) or nelems <= 0 or size is None:
        return None
    return nelems * size


def _tensor_bytes(e: TraceEvent) -> int | None:
    """Bytes of the first tensor argument of a range with record_shapes (`nccl:all_reduce`, …)."""
    dims, types = e.args.get("Input Dims"), e.args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    for d, t in zip(dims, types, strict=False):
        size = DTYPE_BYTES.get(t, 0)
        if size and isinstance(d, list) and all(isinstance(x, int) for x in d):
            return math.prod(d) * size
    return None


def call_bytes(kind: str, events: Sequence[TraceEvent], world_size: int | None) -> int | None:
    """S of one call (module docstring) from the first event that gives shapes: `record_param_comms`
    arguments (input and output element counts) or a range's tensor shape."""
    for e in events:
        inp, out = _param_bytes(e.args, "In msg nelems"), _param_bytes(e.args, "Out msg nelems")
        if inp is None and out is None:
            inp = _tensor_bytes(e)
            out = None
        if inp is None and out is None:
            continue
        if kind == ALL_GATHER:
            if out is not None:
                return out
            return inp * world_size if inp is not None and world_size else None
        return inp if inp is not None else out
    return None


@dataclass(frozen=True)
class CommStat:
    """The collectives of one op row: bytes moved by its calls and the bandwidths their time gives."""

    kind: str
    calls: int
    bytes: int | None
    world_size: int | None
    alg_gbps: float | None  # GB/s
    bus_gbps: float | None  # GB/s; None when the world size is unknown

    @property
    def note(self) -> str:
        if self.bytes is None:
            return f"{self.kind}: bytes unknown (no recorded shapes)"
        text = (
            f"{self.kind}: {self.calls} call(s), {self.bytes / 1e6:,.3f} MB, algbw {self.alg_gbps:,.2f} GB/s"
        )
        if self.bus_gbps is None:
            return text + ", busbw unknown (world size unknown)"
        return text + f", busbw {self.bus_gbps:,.2f} GB/s (world size {self.world_size})"


def comm_stat(kind: str, per_call: Sequence[int | None], us: float, world_size: int | None) -> CommStat:
    """Bytes and bandwidths of `per_call` byte counts (None: unknown) moved in `us` µs of device time."""
    if not per_call or any(b is None for b in per_call):
        return CommStat(kind, len(per_call), None, world_size, None, None)
    total = sum(b or 0 for b in per_call)
    alg = total / us / 1e3 if us > 0 else None  # bytes/µs = MB/s; /1e3 → GB/s
    bus = alg * BUSBW_FACTOR[kind](world_size) if alg is not None and world_size else None
    return CommStat(kind, len(per_call), total, world_size, alg, bus)


def world_size_of(distributed_info: dict[str, Any] | None, events: Sequence[TraceEvent] = ()) -> int | None:
    """The process group's size: the trace's `distributedInfo.world_size` (torch.profiler writes it), else
    a "Group size" argument of `record_param_comms`; None when the trace does not say."""
    if isinstance(distributed_info, dict) and isinstance(distributed_info.get("world_size"), int):
        return distributed_info["world_size"]
    sizes = {e.args.get("Group size") for e in events if isinstance(e.args.get("Group size"), int)}
    return sizes.pop() if len(sizes) == 1 else None
