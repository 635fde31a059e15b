"""A normalised event model for Chrome/Kineto traces (torch.profiler, vLLM, SGLang) and its loaders.

Only complete events (`"ph": "X"`) are kept: every Kineto activity (cpu_op, user_annotation, kernel,
gpu_memcpy, gpu_memset, cuda_runtime, cuda_driver, cuda_sync, ...) is written as one. Runtime/driver API
names are normalised so that Kineto names (suffix already stripped) and nsys-style names
(`cudaGraphLaunch_v10000`) compare equal.
"""

from __future__ import annotations

import gzip
import math
import re
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from looptrace.input_files import InputError, check_regular_file, parse_json
from looptrace.probes import runtime as rt

# Categories whose names are CUDA API calls (the only ones that carry CUPTI's `_vNNNN` suffix).
API_CATS = frozenset({"cuda_runtime", "cuda_driver"})

_API_SUFFIX = re.compile(r"_v\d{4,}$")


class TraceError(ValueError):
    """A trace that cannot be read; the message is one line naming the file and the problem."""


def normalize_api_name(name: str) -> str:
    """Strip CUPTI's `_vNNNN` version suffix (4+ digits); `_v2`/`_v3` are part of the API name and stay."""
    return _API_SUFFIX.sub("", name)


@dataclass(slots=True, eq=False)
class TraceEvent:
    """One complete event. Times are in µs as written by Kineto (`ts` is absolute, `dur` a duration)."""

    cat: str
    name: str
    ts: float
    dur: float
    pid: int | str = 0
    tid: int | str = 0
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def correlation(self) -> int | None:
        """CUPTI correlation id: links a device activity to the runtime/driver call that issued it."""
        return _as_int(self.args.get("correlation"))

    @property
    def external_id(self) -> int | None:
        """Kineto's link from a runtime call / device op to the CPU op (`External id`)."""
        return _as_int(self.args.get("External id"))

    @property
    def graph_id(self) -> int | None:
        """`graph id` of a kernel (CUDA >= 12); nonzero when the kernel ran inside a CUDA-graph replay."""
        return _as_int(self.args.get("graph id"))

    @property
    def bytes(self) -> int:
        return _as_int(self.args.get("bytes")) or 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TraceEvent:
        cat = str(raw.get("cat", ""))
        name = str(raw.get("name", ""))
        if cat in API_CATS:
            name = normalize_api_name(name)
        args = raw.get("args")
        return cls(
            cat=cat,
            name=name,
            ts=float(raw["ts"]),
            dur=float(raw.get("dur", 0.0)),
            pid=raw.get("pid", 0),
            tid=raw.get("tid", 0),
            args=args if isinstance(args, dict) else {},
        )


@dataclass
class Trace:
    """Complete events in file order, plus the trace's top-level metadata (everything but `traceEvents`)."""

    events: list[TraceEvent]
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def device_properties(self) -> list[dict[str, Any]]:
        return list(self.metadata.get("deviceProperties") or [])

    @property
    def distributed_info(self) -> dict[str, Any] | None:
        return self.metadata.get("distributedInfo")

    def by_cat(self, *cats: str) -> list[TraceEvent]:
        return [e for e in self.events if e.cat in cats]


def enclosing_chains(ranges: list[TraceEvent], times: Sequence[float]) -> list[tuple[TraceEvent, ...]]:
    """For each time, the ranges of one thread that contain it (start <= t < end), outer → inner.
    `ranges` must be sorted by (ts, -dur). One sweep, so cost is O((ranges + times) log) per thread."""
    out: list[tuple[TraceEvent, ...]] = [()] * len(times)
    stack: list[TraceEvent] = []
    i = 0
    for q in sorted(range(len(times)), key=times.__getitem__):
        t = times[q]
        while i < len(ranges) and ranges[i].ts <= t:
            while stack and stack[-1].end <= ranges[i].ts:
                stack.pop()
            stack.append(ranges[i])
            i += 1
        while stack and stack[-1].end <= t:
            stack.pop()
        out[q] = tuple(r for r in stack if r.end > t)  # tolerate ranges that overlap without nesting
    return out


def _as_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


MAX_TRACE_BYTES = 4 << 30  # decompressed: parsed, that is tens of GiB of Python objects
PROGRESS_MIN_BYTES = 64 * 2**20  # files this large show a progress bar (stderr on a terminal only)
_CHUNK = 8 * 2**20


@contextmanager
def _progress(path: Path, size: int) -> Iterator[Callable[[int], None]]:
    """A callback taking the bytes of the file read so far: a transient Rich bar on stderr for a large
    file when stderr is a terminal, else a no-op."""
    if size < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield lambda done: None
        return
    columns = (TextColumn("reading {task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(path.name, total=size)
        yield lambda done: bar.update(task, completed=done)


def _read_bytes(path: Path) -> bytes:
    """The decompressed file in one pass (read in chunks, so that a long read shows progress); only a
    regular file (a fifo would block, /dev/zero never end) and at most MAX_TRACE_BYTES decompressed."""
    size = check_regular_file(path).st_size
    chunks, total = [], 0
    with open(path, "rb") as raw, _progress(path, size) as advance:
        stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        while chunk := stream.read(_CHUNK):
            total += len(chunk)
            if total > MAX_TRACE_BYTES:
                raise InputError(f"{path}: more than {MAX_TRACE_BYTES >> 30} GiB of trace (decompressed)")
            chunks.append(chunk)
            advance(raw.tell())
    return b"".join(chunks)


def _utf8_text(data: bytes) -> str | bytes:
    """The file as text, so that json.loads makes no decoded copy of its own while the bytes are still
    held (a 184 MB trace would be in memory three times at the parse's peak). Bytes that are not UTF-8 are
    left to json.loads, which names the problem."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


def _read_json(path: Path) -> Any:
    """The trace's JSON, parsed within looptrace.input_files' limits (nesting, digits, surrogates)."""
    try:
        return parse_json(_utf8_text(_read_bytes(path)), str(path), check=False)
    except InputError as exc:
        raise TraceError(str(exc).replace("; expected a file", ", not a trace file")) from None
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, bad or truncated gzip
        raise TraceError(f"{path}: cannot read trace ({exc})".replace("\n", " ")) from None


def parse_chrome_trace(data: Any, source: str = "<memory>", consume: bool = False) -> Trace:
    """Build a `Trace` from already-decoded JSON: an object with `traceEvents` or a bare event list.
    `consume=True` drops each raw event from the list once it is converted, so the decoded JSON and the
    events are never both whole in memory (a large trace's peak memory; the caller's list is emptied)."""
    if isinstance(data, dict):
        raw_events = data.get("traceEvents")
        if not isinstance(raw_events, list):
            raise TraceError(f"{source}: not a Chrome trace (object without a 'traceEvents' list)")
        metadata = {k: v for k, v in data.items() if k != "traceEvents"}
    elif isinstance(data, list):
        raw_events, metadata = data, {}
    else:
        raise TraceError(f"{source}: not a Chrome trace (expected an object or a list of events)")
    events = []
    for i, raw in enumerate(raw_events):
        if consume:
            raw_events[i] = None
        if not isinstance(raw, dict) or raw.get("ph") != "X":
            continue
        try:
            event = TraceEvent.from_dict(raw)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise TraceError(f"{source}: event {i} has no numeric 'ts'/'dur'") from None
        if not (math.isfinite(event.ts) and math.isfinite(event.dur)):  # NaN would poison every sum
            raise TraceError(f"{source}: event {i} has a non-finite 'ts'/'dur' ({event.ts}, {event.dur})")
        events.append(event)
    charge_replay_overlaps(events)
    return Trace(events=events, metadata=metadata, source=source)


def charge_replay_overlaps(events: list[TraceEvent]) -> int:
    """Make the kernels of one CUDA-graph replay on one stream charge disjoint time; returns how many changed.

    A replay's kernels on a stream run one after the other, except under programmatic dependent launch
    (Hopper PDL: looptrace's `kernels.pdl`, vLLM's and FlashInfer's PDL kernels): a dependent kernel starts
    early and waits inside itself until the one before completes, so its raw span covers the other's tail.
    Summed raw, per-op and per-kernel times count that tail twice (H200, Ouro's fast recipe with PDL: 18 ms
    of kernel time in a 5.3 ms token). A kernel that starts before the previous kernel of its replay and
    stream ends starts, here, at that end (the waiting is the other kernel's time); its raw start and
    duration stay in its args (`raw_ts`, `raw_dur`); the replay's busy time is unchanged. A replay is the
    kernels sharing a `cudaGraphLaunch` correlation id: a kernel belongs to one when it has a nonzero
    `graph id` or (traces without the id: torch 2.11's on the H200, evidently) its correlation is a graph
    launch's, the rule of `classify.is_graph_kernel`; eager kernels are left as they are."""
    launches = {e.correlation for e in events if e.cat in API_CATS and rt.api_kind(e.name) == rt.GRAPH_LAUNCH}
    replays: dict[tuple[Any, Any, int], list[TraceEvent]] = {}
    for e in events:
        if e.cat != "kernel" or e.correlation is None:
            continue
        if e.args.get("graph id") not in (None, 0) or e.correlation in launches:
            replays.setdefault((e.pid, e.tid, e.correlation), []).append(e)
    changed = 0
    for kernels in replays.values():
        kernels.sort(key=lambda e: e.ts)
        busy_until = float("-inf")
        for e in kernels:
            if e.ts < busy_until:
                e.args = {**e.args, "raw_ts": e.ts, "raw_dur": e.dur}
                start = min(busy_until, e.end)
                e.ts, e.dur = start, e.end - start
                changed += 1
            busy_until = max(busy_until, e.end)
    return changed


def load_chrome_trace(path: str | Path) -> Trace:
    """Read a Chrome/Kineto JSON trace (`.json` or `.json.gz`); raise `TraceError` on any problem."""
    path = Path(path)
    return parse_chrome_trace(_read_json(path), source=str(path), consume=True)


def trace_from_profiler(prof: Any, path: str | Path | None = None) -> Trace:
    """Load an in-process `torch.profiler.profile` session through its Chrome export, so that live sessions
    and saved files go through exactly the same parsing. Torch exports a session only once: pass `path` to
    keep the JSON (otherwise it goes to a temporary file)."""
    if path is not None:
        prof.export_chrome_trace(str(path))
        trace = load_chrome_trace(path)
    else:
        with tempfile.TemporaryDirectory(prefix="looptrace-") as tmp:
            tmp_path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(tmp_path))
            trace = load_chrome_trace(tmp_path)
        trace.source = "<torch.profiler>"
    return trace
