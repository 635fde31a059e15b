"""Synthetic Kineto traces for the probes tests: builders for realistic torch.profiler event dicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

PID = 4242  # host process; CPU events use it as pid, device events use the device index
TID = 4242  # main host thread
STREAM = 7


class KinetoTrace:
    """Builds the events torch.profiler writes (same cats, names and args keys). Times in µs."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._corr = 1000
        self._ext = 1

    def _add(self, cat: str, name: str, ts: float, dur: float, pid: Any, tid: Any, args: dict) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        event["args"] = args
        self.events.append(event)
        return event

    def next_correlation(self) -> int:
        self._corr += 1
        return self._corr

    # host side
    def annotation(self, name: str, ts: float, dur: float, tid: Any = TID) -> dict:
        self._ext += 1
        return self._add("user_annotation", name, ts, dur, PID, tid, {"External id": self._ext})

    def cpu_op(self, name: str, ts: float, dur: float, tid: Any = TID) -> dict:
        self._ext += 1
        return self._add("cpu_op", name, ts, dur, PID, tid, {"External id": self._ext, "Sequence number": 0})

    def runtime(self, name: str, ts: float, dur: float = 2.0, corr=None, cat="cuda_runtime", tid=TID) -> int:
        corr = self.next_correlation() if corr is None else corr
        self._add(cat, name, ts, dur, PID, tid, {"cbid": 211, "correlation": corr, "External id": self._ext})
        return corr

    # device side
    def kernel(self, name: str, ts: float, dur: float, corr: int | None, graph_id: int = 0) -> dict:
        args = {"queued": 0, "device": 0, "context": 1, "stream": STREAM, "correlation": corr,
                "registers per thread": 32, "shared memory": 0, "grid": [1, 1, 1], "block": [128, 1, 1],
                "graph id": graph_id, "graph node id": 0}  # fmt: skip
        if corr is None:
            del args["correlation"]
        return self._add("kernel", name, ts, dur, 0, STREAM, args)

    def launch(self, kernel: str, ts: float, dur: float = 5.0, api: str = "cudaLaunchKernel", tid=TID) -> int:
        """Eager launch: the runtime call at `ts` on the host, its kernel 10 µs later on the device."""
        corr = self.runtime(api, ts, tid=tid)
        self.kernel(kernel, ts + 10.0, dur, corr)
        return corr

    def graph_launch(self, ts: float, kernels: list[str], graph_id: int = 1, dur: float = 4.0) -> int:
        """One replay: `cudaGraphLaunch` and its kernels, all sharing the launch's correlation id."""
        corr = self.runtime("cudaGraphLaunch", ts)
        for i, name in enumerate(kernels):
            self.kernel(name, ts + 10.0 + i * dur, dur, corr, graph_id=graph_id)
        return corr

    def memcpy(self, ts: float, kind: str, src: str, dst: str, nbytes: int, api="cudaMemcpyAsync") -> int:
        corr = self.runtime(api, ts)
        args = {"device": 0, "context": 1, "stream": STREAM, "correlation": corr, "bytes": nbytes,
                "memory bandwidth (GB/s)": 1.0}  # fmt: skip
        self._add("gpu_memcpy", f"Memcpy {kind} ({src} -> {dst})", ts + 5.0, 1.5, 0, STREAM, args)
        return corr

    def memset(self, ts: float, nbytes: int) -> int:
        corr = self.runtime("cudaMemsetAsync", ts)
        args = {"device": 0, "context": 1, "stream": STREAM, "correlation": corr, "bytes": nbytes}
        self._add("gpu_memset", "Memset (Device)", ts + 5.0, 1.0, 0, STREAM, args)
        return corr

    def sync_activity(self, name: str, ts: float, corr: int | None) -> dict:
        args = {"cuda_sync_kind": name, "stream": STREAM, "correlation": corr, "device": 0, "context": 1}
        if corr is None:
            del args["correlation"]
        return self._add("cuda_sync", name, ts, 3.0, 0, f"stream {STREAM} (sync)", args)

    def sync(self, api: str, ts: float, activity: str | None = None) -> int:
        """A sync runtime call, plus the cuda_sync activity CUPTI records for it when sync events are on."""
        corr = self.runtime(api, ts, dur=20.0)
        if activity:
            self.sync_activity(activity, ts + 1.0, corr)
        return corr

    def to_dict(self, **metadata: Any) -> dict[str, Any]:
        meta_events = [
            {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "ts": 0, "args": {"name": "python"}},
            {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 0},
        ]
        return {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150_000_000_000}],
            "traceEvents": meta_events + self.events,
            **metadata,
        }

    def write(self, path: Path, **metadata: Any) -> Path:
        path.write_text(json.dumps(self.to_dict(**metadata)))
        return path


@pytest.fixture
def kt() -> KinetoTrace:
    return KinetoTrace()
