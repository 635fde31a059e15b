"""The loop structure of a looped model as one summary: the report's `structure` object.

    prelude_layers   layers that run once per forward before the loops (Huginn: 2; Ouro: 0)
    layers_per_loop  layers of the recurrent block
    loops            passes of the recurrent block per forward (the most seen: early exit can stop sooner;
                     the per-loop tables show how often each ran)
    coda_layers      layers that run once per forward after the loops
    source           where the contexts came from: "ranges" (looptrace's lt.* ranges), "module paths"
                     (layer indices of module events or vLLM's per-(loop, layer) names), "inferred" (the
                     repeated op pattern, `loops`), "hints" (--loops / --layers-per-loop split a block)
    coverage         share of the window's device time (CPU op time in a CPU trace) whose kernels got
                     a stage, and inside the recurrent stage a loop: what the per-loop tables account for

Built from the kernels' `Context`s (stage, loop, layer, role), whichever way they were found, so looptrace's
own traces and foreign ones summarise alike. A model without loops has no structure (None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from looptrace.probes.context import NONE, Context

RANGES, MODULE_PATHS, INFERRED, HINTS = "ranges", "module paths", "inferred", "hints"
RECURRENT = "recurrent"


@dataclass(frozen=True)
class Structure:
    prelude_layers: int
    layers_per_loop: int
    loops: int
    coda_layers: int
    source: str
    coverage: float  # 0..1


def source_kind(how: str) -> str:
    """The `source` value for one of `loops.LoopStructure.sources` ("module layer indices", "repeated op
    pattern", "hint --loops 4")."""
    if how.startswith("hint"):
        return HINTS
    return MODULE_PATHS if how.startswith("module") else INFERRED


def structure_of(contexts: Sequence[Context], durations: Sequence[float], source: str) -> Structure | None:
    """The structure the kernels' contexts show (None where no kernel has a loop)."""
    loops = {c.loop for c in contexts if c.loop is not None}
    if not loops:
        return None
    layers: dict[str, set[str]] = {"prelude": set(), "core": set(), "coda": set()}
    for c in contexts:
        if c.layer is not None and c.role in layers:
            layers[c.role].add(c.layer)
    total = sum(durations)
    covered = sum(d for c, d in zip(contexts, durations, strict=True) if _attributed(c))
    return Structure(
        prelude_layers=len(layers["prelude"]),
        layers_per_loop=len(layers["core"]),
        loops=max(loops) + 1,
        coda_layers=len(layers["coda"]),
        source=source,
        coverage=covered / total if total else 0.0,
    )


def _attributed(c: Context) -> bool:
    return c.stage != NONE and (c.stage != RECURRENT or c.loop is not None)
