"""The window's device events and blocking syncs with their contexts: what `analyze` keeps for `findings`.

A leaf module (like `context`): `counters` builds these lists, `findings` reads them, and neither the report
tables nor the JSON show them (they are per event, so large).
"""

from __future__ import annotations

from dataclasses import dataclass

from looptrace.probes.context import Context
from looptrace.probes.events import TraceEvent


@dataclass(frozen=True)
class DeviceItem:
    """One device event of the window: a kernel (CPU mode: a leaf cpu_op), memcpy or memset."""

    event: TraceEvent
    context: Context  # where it ran (kernels; copies and memsets get an empty one)
    eager: bool  # launched by its own call (cudaLaunchKernel, cudaMemcpyAsync, ...), not a graph replay
    shapes: TraceEvent | None = None  # the CPU op that launched it, with its recorded input shapes


@dataclass(frozen=True)
class SyncItem:
    """One blocking sync of the window (one per correlation id, `classify.select_syncs`)."""

    kind: str  # stream | device | event | sync_memcpy | unknown
    event: TraceEvent  # the runtime call where there is one, else the cuda_sync activity
    context: Context
