"""Synthetic Kineto traces for the probes tests: builders for realistic torch.profiler event dicts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
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
        self.now = 0.0  # host-time cursor for `range` and `tick`

    def _add(self, cat: str, name: str, ts: float, dur: float, pid: Any, tid: Any, args: dict) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        event["args"] = args
        self.events.append(event)
        return event

    def tick(self, dt: float = 3.0) -> float:
        """Current host time, then advance the cursor: the start time of the next host call."""
        t, self.now = self.now, self.now + dt
        return t

    @contextmanager
    def range(self, name: str, tid: Any = TID) -> Iterator[dict]:
        """A `record_function` range around whatever the block adds at the cursor."""
        event = self.annotation(name, self.tick(1.0), 0.0, tid)
        yield event
        event["dur"] = self.tick(1.0) + 1.0 - event["ts"]

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

    def launch(
        self, kernel: str, ts: float, dur: float = 5.0, api="cudaLaunchKernel", tid=TID, cat="cuda_runtime"
    ):
        """Eager launch: the runtime call at `ts` on the host, its kernel 10 µs later on the device."""
        corr = self.runtime(api, ts, tid=tid, cat=cat)
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


# --- a looped model's prefill + decode, as the engine annotates it --------------------------------------

NORM_KERNELS = [
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, "
    "float, float>, unsigned int, float, 4>>(...)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2> >",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::"
    "{lambda(c10::BFloat16)#1}>(int, ...)",
]  # the last one is the cast back to bf16: a copy/cast kernel
ROPE_KERNELS = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::mul_kernel_cuda(at::TensorIteratorBase&)>",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
    "OpaqueType<2u>, unsigned int, 4, 64, 64>(...)",
]  # the cat is a copy kernel
ATTN_KERNEL = (
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>(Flash_fwd_params)"
)
MLP_KERNEL = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel"
CODA_GRAPH = ["coda_norm_kernel", "coda_gemm_kernel", "coda_act_kernel", "coda_add_kernel"]
HEAD_GRAPH = ["lm_head_gemm_kernel", "softcap_kernel"]


def scalar_read(kt: KinetoTrace) -> None:
    """`.item()`: aten::item with its aten::_local_scalar_dense child."""
    t = kt.tick(10.0)
    kt.cpu_op("aten::item", t, 8.0)
    kt.cpu_op("aten::_local_scalar_dense", t + 1.0, 6.0)


def build_decode_trace(kt: KinetoTrace) -> KinetoTrace:
    """A prefill window (step 0) then a decode window of 2 steps (one token each) of a model with 2 core
    layers looped twice; per layer: 2 norm calls (3 kernels, one a cast), attention (1 kernel) around rope
    (2 kernels, one a cat), mlp (1 kernel); coda as two graph replays; sampling with a pinned D2H and a
    stream sync. Then window-level extras and events after the window. Counts: see test_counters.py."""
    with kt.range("lt.window/prefill"):
        with kt.range("lt.step#0"), kt.range("lt.stage/prefill"), kt.range("lt.op/mlp"):
            for _ in range(5):
                kt.launch("prefill_gemm_kernel", kt.tick(), 20.0)
            kt.memcpy(kt.tick(), "HtoD", "Pageable", "Device", 4096)
        kt.sync("cudaStreamSynchronize", kt.tick(20.0), activity="Stream Sync")
        scalar_read(kt)
    kt.tick(50.0)
    with kt.range("lt.window/decode"):
        for step in (1, 2):
            with kt.range(f"lt.step#{step}"):
                _decode_step(kt)
        kt.memset(kt.tick(), 256)
        kt.sync("cudaEventSynchronize", kt.tick(20.0))  # sync events off for this one: runtime only
        kt.sync("cudaDeviceSynchronize", kt.tick(20.0), activity="Context Sync")
        kt.memcpy(kt.tick(20.0), "DtoH", "Device", "Pageable", 4, api="cudaMemcpy")  # blocking + pageable
        kt.sync("cudaStreamWaitEvent", kt.tick(), activity="Stream Wait Event")
        kt.launch("side_thread_kernel", kt.tick(), 1.0, tid=99)  # another thread: no lt ranges there
        kt.kernel("orphan_kernel", kt.tick(), 1.0, corr=None)  # no runtime call: placed by its own ts
    kt.tick(50.0)
    kt.kernel("late_orphan_kernel", kt.tick(), 1.0, corr=None)
    kt.launch("after_window_kernel", kt.tick(), 1.0)
    return kt


def _decode_step(kt: KinetoTrace) -> None:
    with kt.range("lt.stage/recurrent"):
        for loop in range(2):
            with kt.range(f"lt.loop/{loop}"):
                for layer in range(2):
                    with kt.range(f"lt.layer/core{layer}"):
                        _layer(kt)
    with kt.range("lt.stage/coda"):
        kt.graph_launch(kt.tick(), CODA_GRAPH, graph_id=1)
        with kt.range("lt.op/head"):
            kt.graph_launch(kt.tick(), HEAD_GRAPH, graph_id=2)
    with kt.range("lt.stage/sample"), kt.range("lt.op/sample"):
        kt.launch("argmax_kernel", kt.tick(), 3.0)
        kt.memcpy(kt.tick(), "DtoH", "Device", "Pinned", 8)
        kt.sync("cudaStreamSynchronize", kt.tick(20.0), activity="Stream Sync")
        scalar_read(kt)


def _layer(kt: KinetoTrace) -> None:
    for _ in range(2):
        with kt.range("lt.op/norm"):
            for name in NORM_KERNELS:
                kt.launch(name, kt.tick(), 2.0)
    with kt.range("lt.op/attention"):
        with kt.range("lt.op/rope"):  # nested: the innermost op wins
            for name in ROPE_KERNELS:
                kt.launch(name, kt.tick(), 1.5)
        kt.launch(ATTN_KERNEL, kt.tick(), 5.0, api="cudaLaunchKernelExC")
    with kt.range("lt.op/mlp"):
        kt.launch(MLP_KERNEL, kt.tick(), 10.0, api="cuLaunchKernelEx_v11060", cat="cuda_driver")


@pytest.fixture
def decode_kt() -> KinetoTrace:
    return build_decode_trace(KinetoTrace())
