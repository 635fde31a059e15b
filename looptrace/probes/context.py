"""Where a kernel ran in the engine's terms: the innermost lt.* ranges around its host position.

A leaf module: `counters` (which finds contexts from lt.* ranges) and `loops` (which infers them for
traces without ranges) both build `Context`s, and neither needs the other's import for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from looptrace.probes.events import TraceEvent

NONE = "-"  # no stage / role known


@dataclass(frozen=True)
class Context:
    """Innermost lt.* ranges around a host position."""

    stage: str = NONE
    loop: int | None = None
    layer: str | None = None  # e.g. "core3"
    role: str = NONE  # e.g. "core"
    op: str | None = None
    op_range: TraceEvent | None = None  # the lt.op range instance (for per-call factors)
