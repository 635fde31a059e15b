"""Graph replays attributed through capture traces (vLLM `--profiler-config.capture_torch_profiler`,
SGLang `--enable-profile-cuda-graph`).

A replay trace shows one `cudaGraphLaunch`/`hipGraphLaunch` and its kernels, with no CPU op around them.
The capture trace, recorded while the graph was captured at start-up, has the launch calls made inside
the stream capture (between `*StreamBeginCapture` and `*StreamEndCapture` on one thread) with their CPU
ops and modules; a graph replays its nodes in capture order (one stream), so the i-th kernel of a replay
is the i-th launch of the capture of the same batch size.

Folder layout (as vLLM writes it): `capture_traces/execution_details.json`, a list of
`{"file": <trace in the folder>, "batch_size": <n>, "mode": "FULL" | "PIECEWISE"}`, beside the traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from looptrace.input_files import InputError, read_json
from looptrace.probes import runtime as rt
from looptrace.probes.events import API_CATS, TraceError, TraceEvent, load_chrome_trace
from looptrace.probes.opstats import KernelOp, ancestry_chains, kernel_op

DETAILS_FILE = "execution_details.json"
FOLDER_NAME = "capture_traces"
HOW_TO_RECORD = (
    "record one with vLLM `--profiler-config.capture_torch_profiler` or SGLang "
    "`--enable-profile-cuda-graph`, and pass its folder with --capture (a `capture_traces/` folder beside "
    "the trace is found by itself)"
)


@dataclass
class CapturedLaunch:
    kernel: str  # the launch call's `kernel` arg (the kernel name the replay shows)
    chain: tuple[TraceEvent, ...]  # CPU ops and modules open at the launch, outer → inner


@dataclass
class CapturedGraph:
    batch_size: int | None
    mode: str
    source: str
    launches: list[CapturedLaunch] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [x.kernel for x in self.launches]


def find_capture_dir(trace_path: Path) -> Path | None:
    """The capture folder vLLM/SGLang write beside the trace, if there is one."""
    candidate = trace_path.parent / FOLDER_NAME
    return candidate if candidate.is_dir() else None


def load_captures(folder: Path) -> list[CapturedGraph]:
    """Every graph captured in the folder's traces; TraceError (one line) on a broken folder."""
    details = folder / DETAILS_FILE
    if not folder.is_dir():
        raise TraceError(f"{folder}: capture folder not found (or not a folder)")
    if not details.is_file():
        raise TraceError(f"{folder}: capture folder without its {DETAILS_FILE}")
    try:  # a regular file within the nesting/number limits (looptrace.input_files)
        entries = read_json(details)
    except InputError as exc:
        raise TraceError(str(exc)) from None
    if isinstance(entries, dict):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(x, dict) and "file" in x for x in entries):
        raise TraceError(f"{details}: expected a list of {{'file', 'batch_size', 'mode'}} entries")
    graphs: list[CapturedGraph] = []
    for entry in entries:
        trace = load_chrome_trace(folder / str(entry["file"]))
        size = entry.get("batch_size")
        size = size if isinstance(size, int) else None
        mode = str(entry.get("mode", ""))
        graphs += [CapturedGraph(size, mode, trace.source, x) for x in _captured_launches(trace.events)]
    return graphs


def _captured_launches(events: list[TraceEvent]) -> list[list[CapturedLaunch]]:
    """Launches inside each stream capture (begin → end on one thread), in call order."""
    calls = sorted((e for e in events if e.cat in API_CATS), key=lambda e: e.ts)
    spans: list[tuple[tuple, float, float]] = []
    open_at: dict[tuple, float] = {}
    for e in calls:
        kind, thread = rt.api_kind(e.name), (e.pid, e.tid)
        if kind == rt.CAPTURE_BEGIN:
            open_at[thread] = e.ts
        elif kind == rt.CAPTURE_END and thread in open_at:
            spans.append((thread, open_at.pop(thread), e.end))
    out = []
    for thread, start, end in spans:
        launches = [
            e
            for e in calls
            if (e.pid, e.tid) == thread and start <= e.ts < end and rt.api_kind(e.name) == rt.EAGER_LAUNCH
        ]
        chains = ancestry_chains(events, [(thread, e.ts) for e in launches])
        out.append(
            [CapturedLaunch(str(e.args.get("kernel", "")), c) for e, c in zip(launches, chains, strict=True)]
        )
    return out


@dataclass
class ReplayMatch:
    """Outcome of mapping the replays of one trace: kernels attributed, and any mismatch to report."""

    replays: int = 0
    matched: int = 0
    kernels: int = 0
    attributed: int = 0
    problems: list[str] = field(default_factory=list)


def pick_graph(
    graphs: Sequence[CapturedGraph], names: Sequence[str], rows: int | None
) -> CapturedGraph | None:
    """The captured graph a replay ran: same kernel sequence, the step's batch size breaking ties; else
    the graph of that batch size (vLLM pads a batch up to the next captured size) with as many kernels."""
    same = [g for g in graphs if g.names == list(names)]
    if same:
        return next((g for g in same if g.batch_size == rows), same[0])
    sized = [g for g in graphs if len(g.launches) == len(names)]
    if rows is not None:
        fits = sorted((g for g in sized if g.batch_size is not None and g.batch_size >= rows),
                      key=lambda g: g.batch_size or 0)  # fmt: skip
        if fits:
            return fits[0]
    return sized[0] if len(sized) == 1 else None


def attribute_replay(
    kernels: Sequence[TraceEvent], graph: CapturedGraph, scope: int | None
) -> tuple[list[KernelOp], int]:
    """KernelOps of one replay's kernels (device order) from the capture, and how many names differ."""
    ops = [kernel_op(k.name, launch.chain, scope) for k, launch in zip(kernels, graph.launches, strict=True)]
    differ = sum(1 for k, launch in zip(kernels, graph.launches, strict=True) if launch.kernel != k.name)
    return ops, differ
