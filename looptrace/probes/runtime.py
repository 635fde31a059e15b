"""GPU runtime vocabularies: what each CUDA or HIP (ROCm) runtime/driver API call is, one table per runtime.

Kineto writes both runtimes' calls under the categories `cuda_runtime` / `cuda_driver` (a ROCm trace keeps
the CUDA category names and changes only the call names), so the category says "an API call" and the name,
looked up here, says which kind. A name in neither table is some other API call (attributes, queries,
allocation), counted as nothing.

Kinds:
  eager_launch   one kernel launched from the host (cudaLaunchKernel, hipExtModuleLaunchKernel, ...)
  graph_launch   one CUDA/HIP graph replay (all its kernels share the call's correlation id)
  memcpy_async   a copy that returns at once (its hidden stalls show up as pageable copies)
  memset
  sync kinds     "stream", "device", "event", "sync_memcpy" (blocking), "stream_wait" (device-side,
                 not blocking), "event_query" (a poll, not blocking)
  capture_begin / capture_end   a stream capture into a graph starts / ends (capture traces)
"""

from __future__ import annotations

EAGER_LAUNCH = "eager_launch"
GRAPH_LAUNCH = "graph_launch"
MEMCPY_ASYNC = "memcpy_async"
MEMSET = "memset"
STREAM_WAIT = "stream_wait"
EVENT_QUERY = "event_query"
CAPTURE_BEGIN = "capture_begin"
CAPTURE_END = "capture_end"

_COMMON_KINDS = {
    "LaunchKernel": EAGER_LAUNCH,
    "GraphLaunch": GRAPH_LAUNCH,
    "MemcpyAsync": MEMCPY_ASYNC,
    "MemsetAsync": MEMSET,
    "Memset": MEMSET,
    "EventQuery": EVENT_QUERY,
    "StreamSynchronize": "stream",
    "DeviceSynchronize": "device",
    "EventSynchronize": "event",
    "StreamWaitEvent": STREAM_WAIT,
    "StreamBeginCapture": CAPTURE_BEGIN,
    "StreamEndCapture": CAPTURE_END,
    # Synchronous copies return only when the copy is done (the Async variants are not syncs).
    "Memcpy": "sync_memcpy",
    "Memcpy2D": "sync_memcpy",
}

CUDA_RUNTIME: dict[str, str] = {f"cuda{k}": v for k, v in _COMMON_KINDS.items()} | {
    "cudaLaunchKernelExC": EAGER_LAUNCH,
    "cudaLaunchCooperativeKernel": EAGER_LAUNCH,
    "cuLaunchKernel": EAGER_LAUNCH,
    "cuLaunchKernelEx": EAGER_LAUNCH,
    "cuLaunchCooperativeKernel": EAGER_LAUNCH,
    "cuGraphLaunch": GRAPH_LAUNCH,
    "cuEventQuery": EVENT_QUERY,
    "cuStreamSynchronize": "stream",
    "cuCtxSynchronize": "device",
    "cuEventSynchronize": "event",
    "cuStreamWaitEvent": STREAM_WAIT,
    "cuMemcpy": "sync_memcpy",
    "cuMemcpyDtoH_v2": "sync_memcpy",
    "cuMemcpyHtoD_v2": "sync_memcpy",
    "cuMemcpyDtoD_v2": "sync_memcpy",
    "cuMemcpyAsync": MEMCPY_ASYNC,
    "cuMemcpyHtoDAsync_v2": MEMCPY_ASYNC,
    "cuMemcpyDtoHAsync_v2": MEMCPY_ASYNC,
    "cuMemcpyDtoDAsync_v2": MEMCPY_ASYNC,
    "cuMemsetD8Async": MEMSET,
    "cuMemsetD32Async": MEMSET,
}

HIP_RUNTIME: dict[str, str] = {f"hip{k}": v for k, v in _COMMON_KINDS.items()} | {
    "hipExtLaunchKernel": EAGER_LAUNCH,
    "hipExtModuleLaunchKernel": EAGER_LAUNCH,
    "hipModuleLaunchKernel": EAGER_LAUNCH,
    "hipLaunchCooperativeKernel": EAGER_LAUNCH,
    "hipHccModuleLaunchKernel": EAGER_LAUNCH,
    "hipLaunchKernelExC": EAGER_LAUNCH,
    # A synchronous copy on a given stream: blocks the host like hipMemcpy.
    "hipMemcpyWithStream": "sync_memcpy",
    "hipMemcpyDtoH": "sync_memcpy",
    "hipMemcpyHtoD": "sync_memcpy",
    "hipMemcpyDtoD": "sync_memcpy",
    "hipMemcpyDtoHAsync": MEMCPY_ASYNC,
    "hipMemcpyHtoDAsync": MEMCPY_ASYNC,
    "hipMemcpyDtoDAsync": MEMCPY_ASYNC,
    "hipMemsetD8Async": MEMSET,
    "hipMemsetD32Async": MEMSET,
}

RUNTIMES: dict[str, dict[str, str]] = {"cuda": CUDA_RUNTIME, "hip": HIP_RUNTIME}
API_KINDS: dict[str, str] = CUDA_RUNTIME | HIP_RUNTIME
SYNC_KINDS = frozenset({"stream", "device", "event", "sync_memcpy", STREAM_WAIT, EVENT_QUERY})


def api_kind(name: str) -> str | None:
    """Kind of an API call (names already stripped of CUPTI's `_vNNNN` suffix), None if not listed."""
    return API_KINDS.get(name)


def runtime_of(name: str) -> str | None:
    """ "cuda" or "hip" for a listed call, else None."""
    return next((rt for rt, table in RUNTIMES.items() if name in table), None)


def names_of(kind: str) -> frozenset[str]:
    """Every listed call of one kind, both runtimes."""
    return frozenset(name for name, k in API_KINDS.items() if k == kind)
