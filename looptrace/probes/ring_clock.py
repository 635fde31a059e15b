"""Inside the persistent loop: where one launch's time goes, stage by stage, from the GPU's own clock.

`fast` runs a one-row loop of Ouro as one persistent launch (engine/kernels/stream_loop.py): the profiler
sees one kernel per loop, so its time cannot be split by op the way the chained path's kernels are. The
kernel can instead stamp every program's clock (ns) as it reaches and leaves the end of each stage (q/k/v,
attention, o, gate/up, down) of each layer. `measure` re-runs the captured graphs' bodies eagerly (as the
profile's op map does, on the same inputs, so the K/V writes repeat the values already written) with the
loop op's `stage_clock` set, and keeps the stamps of every launch; `anatomy` reads them:

- wall: how far the median program's departure from a stage's end moved since the stage before (the
  stages and the tail add up to the launch, start to end, exactly);
- work: a program's time from leaving the stage before to arriving at this stage's end (mean, slowest);
- wait: a program's time at the stage's end (a grid barrier, or polling for the values it needs);
- release: the first departure after the last arrival (what a barrier costs once everyone is in).

Medians over the layers of every launch. A timed launch is the same kernel with the stamps compiled in;
the profile's time for the loop comes from the untimed graph replays, and the stamps only split it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import Any

TAIL = "final_norm"  # after the last layer's down stage: the loop's final norm and the state's write


@dataclass(frozen=True)
class StageClock:
    """One stage of one layer, medians over the layers and launches (µs)."""

    stage: str
    wall_us: float
    work_mean_us: float
    work_max_us: float
    wait_mean_us: float
    release_us: float


@dataclass(frozen=True)
class RingAnatomy:
    """The stages of the loop's launch: per layer each, then the tail once per launch."""

    op: str  # the op module's name (engine.observable_modules)
    launches: int
    layers: int
    programs: int
    loop_us: float  # median start-to-end of the timed launches
    stages: list[StageClock]
    tail_us: float

    def shares(self) -> dict[str, float]:
        """Each stage's (and the tail's) share of the launch; they add up to 1."""
        total = self.layers * sum(s.wall_us for s in self.stages) + self.tail_us
        out = {s.stage: self.layers * s.wall_us / total for s in self.stages}
        out[TAIL] = self.tail_us / total
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"shares": self.shares()}


def anatomy(op: str, launches: list[Any], stages: tuple[str, ...]) -> RingAnatomy:
    """The stage anatomy of timed launches: each an int64 `[programs, 2 + 2 * len(stages) * layers]` tensor
    of clock stamps in ns (the layout of `StreamedPersistentLoop.stage_clock`)."""
    if not launches:
        raise ValueError("no timed launch to read")
    per = 2 * len(stages)
    programs, stamps = launches[0].shape
    layers = (stamps - 2) // per
    acc: dict[str, dict[str, list[float]]] = {s: {k: [] for k in ("wall", "mean", "max", "wait", "rel")}
                                             for s in stages}  # fmt: skip
    tails, loops = [], []
    for t in launches:
        t = t.double().cpu() / 1e3  # µs
        prev = t[:, 0]
        for layer in range(layers):
            for k, stage in enumerate(stages):
                arrive, leave = t[:, 1 + per * layer + 2 * k], t[:, 2 + per * layer + 2 * k]
                r = acc[stage]
                r["wall"].append(float(leave.median() - prev.median()))
                work = arrive - prev
                r["mean"].append(float(work.mean()))
                r["max"].append(float(work.max()))
                r["wait"].append(float((leave - arrive).mean()))
                r["rel"].append(float(leave.min() - arrive.max()))
                prev = leave
        tails.append(float(t[:, -1].median() - prev.median()))
        loops.append(float(t[:, -1].median() - t[:, 0].median()))
    med = statistics.median
    clocks = [
        StageClock(s, med(r["wall"]), med(r["mean"]), med(r["max"]), med(r["wait"]), med(r["rel"]))
        for s, r in acc.items()
    ]
    return RingAnatomy(op, len(launches), layers, programs, med(loops), clocks, med(tails))


def ring_ops(engine: Any) -> list[tuple[str, Any]]:
    """The engine's op modules that can clock their stages (a persistent loop with `stage_clock`)."""
    return [
        (name, m)
        for name, m in engine.observable_modules()
        if getattr(m, "op_kind", None) == "persistent_loop" and hasattr(m, "stage_clock")
    ]


@contextmanager
def _clocked(name: str, module: Any, clock: Any, found: dict[str, list[Any]]) -> Iterator[None]:
    """`module.stage_clock` set to `clock` while inside; each call leaves a copy of it in `found[name]`
    and the clock cleared, so that a later launch cannot pass off an earlier one's stamps."""

    def keep(_module, _inputs, _output) -> None:
        # A loop the ring did not take (the chained path) leaves the clock at zero: `measure` drops it.
        found[name].append(clock.clone())
        clock.zero_()

    module.stage_clock = clock
    handle = module.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()
        module.stage_clock = None


def measure(engine: Any, repeats: int = 5) -> list[RingAnatomy]:
    """Run the captured graphs' bodies eagerly with the ring ops' clocks on: every body once, then those
    that launched the ring `repeats - 1` times more; one anatomy per op that launched timed (none: no ring
    op, a CPU engine, or no graph body took the ring)."""
    ops = ring_ops(engine)
    if not ops or engine.device.type != "cuda":
        return []
    found: dict[str, list[Any]] = {name: [] for name, _ in ops}
    bodies = [thunk for _, _, thunk in engine.graph_bodies()]
    with _all_clocked(ops, engine.device, found):
        run_clocked(bodies, found, repeats)
    out = []
    for name, module in ops:
        written = [t for t in found[name] if _written(t)]
        if written:
            out.append(anatomy(name, written[1:] or written, module.stages))  # the first: cold caches
    return out


def _written(clock: Any) -> bool:
    """Whether a launch filled this clock (its last stamp, the end of every program, is set)."""
    return bool(clock[:, -1].any())  # a device tensor: waits for the launch


def run_clocked(bodies: list[Any], found: dict[str, list[Any]], repeats: int) -> int:
    """Each body once, then `repeats - 1` more times those whose run left a written clock in `found` (a
    profile may hold dozens of captured batch sizes whose rows the ring never takes); returns how many
    bodies took the ring."""
    taking = []
    for thunk in bodies:
        before = {name: len(v) for name, v in found.items()}
        thunk()
        took = False
        for name, v in found.items():  # zero clocks (loops the ring did not take) are dropped
            v[before[name] :] = [t for t in v[before[name] :] if _written(t)]
            took = took or len(v) > before[name]
        if took:
            taking.append(thunk)
    for _ in range(repeats - 1):
        for thunk in taking:
            thunk()
    return len(taking)


@contextmanager
def _all_clocked(ops: Iterable[tuple[str, Any]], device: Any, found: dict[str, list[Any]]) -> Iterator[None]:
    # deferred: torch loads with the engine, not with this module
    import torch

    programs = torch.cuda.get_device_properties(device).multi_processor_count
    with ExitStack() as stack:
        for name, module in ops:
            clock = torch.zeros(programs, module.stamps_per_program(), dtype=torch.int64, device=device)
            stack.enter_context(_clocked(name, module, clock, found))
        yield
