"""One test (or parametrised set) per classification rule."""

from __future__ import annotations

import pytest

from looptrace.probes import classify as cl
from looptrace.probes.events import TraceEvent, parse_chrome_trace


def ev(cat: str, name: str, ts: float = 0.0, dur: float = 1.0, tid: int = 1, **args) -> TraceEvent:
    raw = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}
    return TraceEvent.from_dict(raw)


# --- kernels, launches, graphs --------------------------------------------------------------------------


def test_kernel_is_cat_kernel() -> None:
    assert cl.is_kernel(ev("kernel", "void foo<float>()"))
    assert not cl.is_kernel(ev("cpu_op", "aten::mm"))
    assert not cl.is_kernel(ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)"))


@pytest.mark.parametrize(
    "name", ["cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
             "cudaLaunchKernel_v7000", "cuLaunchKernelEx_v11060"],
)  # fmt: skip
@pytest.mark.parametrize("cat", ["cuda_runtime", "cuda_driver"])
def test_eager_launch_names(name: str, cat: str) -> None:
    e = ev(cat, name)
    assert cl.is_eager_launch(e)
    assert not cl.is_graph_launch(e)


@pytest.mark.parametrize("name", ["cudaGraphLaunch", "cuGraphLaunch", "cudaGraphLaunch_v10000"])
def test_graph_launch_names(name: str) -> None:
    e = ev("cuda_runtime", name)
    assert cl.is_graph_launch(e)
    assert not cl.is_eager_launch(e)


def test_launch_names_only_count_as_api_calls() -> None:
    assert not cl.is_eager_launch(ev("cpu_op", "cudaLaunchKernel"))
    assert not cl.is_graph_launch(ev("user_annotation", "cudaGraphLaunch"))
    assert not cl.is_eager_launch(ev("cuda_runtime", "cudaMemcpyAsync"))


def test_graph_kernels_by_graph_id_or_launch_correlation() -> None:
    events = [
        ev("cuda_runtime", "cudaGraphLaunch", correlation=5),
        ev("cuda_runtime", "cudaLaunchKernel", correlation=6),
    ]
    graph_corr = cl.graph_launch_correlations(events)
    assert graph_corr == {5}
    by_id = ev("kernel", "k", correlation=99, **{"graph id": 12})
    by_corr = ev("kernel", "k", correlation=5, **{"graph id": 0})  # pre-CUDA-12 trace: id 0/absent
    eager = ev("kernel", "k", correlation=6, **{"graph id": 0})
    no_args = ev("kernel", "k")
    assert cl.is_graph_kernel(by_id, graph_corr)
    assert cl.is_graph_kernel(by_corr, graph_corr)
    assert not cl.is_graph_kernel(eager, graph_corr)
    assert not cl.is_graph_kernel(no_args, graph_corr)


# --- memory ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "direction", "src", "dst", "pageable", "pinned"),
    [
        ("Memcpy HtoD (Pageable -> Device)", "HtoD", "Pageable", "Device", True, False),
        ("Memcpy HtoD (Pinned -> Device)", "HtoD", "Pinned", "Device", False, True),
        ("Memcpy DtoH (Device -> Pageable)", "DtoH", "Device", "Pageable", True, False),
        ("Memcpy DtoH (Device -> Pinned)", "DtoH", "Device", "Pinned", False, True),
        ("Memcpy DtoD (Device -> Device)", "DtoD", "Device", "Device", False, False),
        (
            "Memcpy HtoD (Managed Static -> Device Static)",
            "HtoD",
            "Managed Static",
            "Device Static",
            False,
            False,
        ),
        ("Memcpy PtoP (Device -> Device)", "PtoP", "Device", "Device", False, False),
    ],
)
def test_memcpy_parse(name: str, direction: str, src: str, dst: str, pageable: bool, pinned: bool) -> None:
    info = cl.parse_memcpy(ev("gpu_memcpy", name, bytes=4096))
    assert (info.direction, info.src, info.dst, info.bytes) == (direction, src, dst, 4096)
    assert (info.pageable, info.pinned) == (pageable, pinned)


def test_memcpy_parse_rejects_other_cats_and_odd_names() -> None:
    assert cl.parse_memcpy(ev("kernel", "Memcpy DtoH (Device -> Pinned)")) is None
    odd = cl.parse_memcpy(ev("gpu_memcpy", "Memcpy something else", bytes=8))
    assert (odd.direction, odd.pageable, odd.pinned, odd.bytes) == ("Unknown", False, False, 8)


def test_memset() -> None:
    assert cl.is_memset(ev("gpu_memset", "Memset (Device)", bytes=16))
    assert not cl.is_memset(ev("cuda_runtime", "cudaMemsetAsync"))


# --- syncs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cat", "name", "kind"),
    [
        ("cuda_runtime", "cudaStreamSynchronize", "stream"),
        ("cuda_runtime", "cudaDeviceSynchronize", "device"),
        ("cuda_runtime", "cudaEventSynchronize", "event"),
        ("cuda_runtime", "cudaStreamWaitEvent", "stream_wait"),
        ("cuda_runtime", "cudaMemcpy", "sync_memcpy"),
        ("cuda_runtime", "cudaStreamSynchronize_v3020", "stream"),
        ("cuda_driver", "cuCtxSynchronize", "device"),
        ("cuda_driver", "cuMemcpyDtoH_v2", "sync_memcpy"),
        ("cuda_sync", "Stream Sync", "stream"),
        ("cuda_sync", "Context Sync", "device"),
        ("cuda_sync", "Event Sync", "event"),
        ("cuda_sync", "Unknown Sync", "unknown"),
        ("cuda_sync", "Stream Wait Event", "stream_wait"),
        ("cuda_runtime", "cudaMemcpyAsync", None),
        ("cuda_runtime", "cudaEventQuery", "event_query"),
        ("cuda_runtime", "cudaLaunchKernel", None),
        ("cpu_op", "cudaDeviceSynchronize", None),
    ],
)
def test_sync_kind(cat: str, name: str, kind: str | None) -> None:
    assert cl.sync_kind(ev(cat, name)) == kind


def test_stream_wait_is_not_blocking() -> None:
    assert not cl.is_blocking("stream_wait")
    assert all(cl.is_blocking(k) for k in ("stream", "device", "event", "sync_memcpy", "unknown"))


def test_select_syncs_counts_each_correlation_once(kt) -> None:
    both = kt.sync("cudaStreamSynchronize", 0.0, activity="Stream Sync")  # runtime + activity: one sync
    kt.sync("cudaEventSynchronize", 100.0)  # runtime only (sync events off)
    kt.sync_activity("Context Sync", 200.0, corr=777)  # activity only (API tracing off)
    kt.sync_activity("Unknown Sync", 300.0, corr=None)  # no correlation: cannot be matched
    kt.runtime("cudaMemcpy", 400.0)  # synchronous copy: never has an activity
    kt.sync("cudaStreamWaitEvent", 500.0, activity="Stream Wait Event")
    kt.sync("cudaStreamSynchronize", 600.0, activity="Event Sync")  # the activity's kind wins...
    kt.sync("cudaDeviceSynchronize", 700.0, activity="Unknown Sync")  # ...unless it is Unknown
    syncs = cl.select_syncs(parse_chrome_trace(kt.to_dict()).events)
    kinds = [kind for kind, _ in syncs]
    expected = ["stream", "event", "device", "unknown", "sync_memcpy", "stream_wait", "event", "device"]
    assert sorted(kinds) == sorted(expected)
    matched = next(e for kind, e in syncs if e.correlation == both)
    assert (matched.cat, matched.name) == ("cuda_runtime", "cudaStreamSynchronize")  # host position


# --- scalar reads ---------------------------------------------------------------------------------------


def test_item_with_local_scalar_dense_child_counts_once() -> None:
    events = [
        ev("cpu_op", "aten::item", 0, 10),
        ev("cpu_op", "aten::_local_scalar_dense", 2, 5),  # child of the item above
        ev("cpu_op", "aten::_local_scalar_dense", 20, 5),  # direct call: a read of its own
        ev("cpu_op", "aten::item", 30, 10),  # item whose inner op was not recorded
        ev("cpu_op", "aten::item", 50, 10),
        ev("cpu_op", "aten::to", 51, 8),  # an intermediate op does not hide the item ancestor
        ev("cpu_op", "aten::_local_scalar_dense", 52, 2),
        ev("cpu_op", "aten::_local_scalar_dense", 3, 1, tid=2),  # other thread: not inside the item
        ev("cpu_op", "aten::mul", 70, 1),
    ]
    reads = cl.scalar_reads(events)
    assert sorted((e.ts, e.name) for e in reads) == [
        (0, "aten::item"),
        (3, "aten::_local_scalar_dense"),
        (20, "aten::_local_scalar_dense"),
        (30, "aten::item"),
        (50, "aten::item"),
    ]


# --- copy/cast kernels ----------------------------------------------------------------------------------

COPY_KERNELS = [
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::"
    "{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>>"
    "(int, ...)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2> >(int, ...)",
    "void at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::"
    "OpaqueType<2u>, unsigned int, 3, 64, 64>(...)",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<...>(...)",
    "triton_poi_fused__to_copy_0",
    "triton_poi_fused_cat_3",
    "triton_poi_fused__to_copy_cat_clone_12",
]
NOT_COPY_KERNELS = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "at::detail::Array<char*, 1> >",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0",  # RMSNorm with a fused cast: compute
    "triton_poi_fused_add_1",
    "Kernel",
]


@pytest.mark.parametrize("name", COPY_KERNELS)
def test_copy_kernel_names(name: str) -> None:
    assert cl.is_copy_kernel_name(name)


@pytest.mark.parametrize("name", NOT_COPY_KERNELS)
def test_not_copy_kernel_names(name: str) -> None:
    assert not cl.is_copy_kernel_name(name)


# --- CPU mode -------------------------------------------------------------------------------------------


def test_leaf_cpu_ops_by_containment_per_thread() -> None:
    events = [
        ev("cpu_op", "aten::linear", 0, 100),
        ev("cpu_op", "aten::t", 1, 2),  # view: ignored
        ev("cpu_op", "aten::transpose", 1.5, 1),
        ev("cpu_op", "aten::addmm", 5, 90),  # leaf once its no-kernel children are ignored
        ev("cpu_op", "aten::resolve_conj", 6, 1),
        ev("cpu_op", "aten::empty", 8, 1),
        ev("cpu_op", "aten::to", 110, 30),
        ev("cpu_op", "aten::_to_copy", 111, 28),
        ev("cpu_op", "aten::empty_strided", 112, 1),
        ev("cpu_op", "aten::copy_", 114, 20),  # the leaf under to -> _to_copy
        ev("cpu_op", "aten::to", 150, 1),  # no-op alias: not a kernel
        ev("cpu_op", "aten::mul", 200, 10),
        ev("cpu_op", "aten::add", 202, 1, tid=2),  # overlaps mul, other thread: both leaves
        ev("cpu_op", "aten::cat", 220, 5),
        ev("cpu_op", "looptrace::rms_norm", 230, 0),  # zero-length custom op: a leaf too
        ev("user_annotation", "lt.op/norm", 199, 30),  # annotations never make an op non-leaf
    ]
    leaves = sorted((e.ts, e.name) for e in cl.leaf_cpu_ops(events))
    assert leaves == [
        (5, "aten::addmm"),
        (114, "aten::copy_"),
        (200, "aten::mul"),
        (202, "aten::add"),
        (220, "aten::cat"),
        (230, "looptrace::rms_norm"),
    ]


def test_cpu_copy_ops() -> None:
    assert cl.is_cpu_copy_op(ev("cpu_op", "aten::copy_"))
    assert cl.is_cpu_copy_op(ev("cpu_op", "aten::_to_copy"))
    assert cl.is_cpu_copy_op(ev("cpu_op", "aten::cat"))
    assert not cl.is_cpu_copy_op(ev("cpu_op", "aten::to"))  # a leaf `to` copies nothing
    assert not cl.is_cpu_copy_op(ev("cpu_op", "aten::mul"))
    assert not cl.is_cpu_copy_op(ev("kernel", "aten::copy_"))


def test_detect_mode() -> None:
    assert cl.detect_mode([ev("cpu_op", "aten::mm"), ev("kernel", "gemm")]) == "gpu"
    assert (
        cl.detect_mode([ev("cpu_op", "aten::mm"), ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)")])
        == "cpu"
    )
    assert cl.detect_mode([]) == "cpu"


# --- runtime vocabularies: HIP (ROCm) counted like CUDA ---------------------------------------------------


@pytest.mark.parametrize(
    ("hip", "cuda"),
    [("hipLaunchKernel", "cudaLaunchKernel"), ("hipExtModuleLaunchKernel", "cuLaunchKernel"),
     ("hipModuleLaunchKernel", "cuLaunchKernel"), ("hipGraphLaunch", "cudaGraphLaunch"),
     ("hipStreamSynchronize", "cudaStreamSynchronize"), ("hipDeviceSynchronize", "cudaDeviceSynchronize"),
     ("hipEventSynchronize", "cudaEventSynchronize"), ("hipStreamWaitEvent", "cudaStreamWaitEvent"),
     ("hipEventQuery", "cudaEventQuery"), ("hipMemcpy", "cudaMemcpy"), ("hipMemcpyAsync", "cudaMemcpyAsync"),
     ("hipMemsetAsync", "cudaMemsetAsync")],
)  # fmt: skip
def test_hip_names_count_like_cuda(hip: str, cuda: str) -> None:
    from looptrace.probes import runtime as rt

    h, c = ev("cuda_runtime", hip), ev("cuda_runtime", cuda)
    assert rt.api_kind(hip) == rt.api_kind(cuda) is not None
    assert (rt.runtime_of(hip), rt.runtime_of(cuda)) == ("hip", "cuda")
    assert (cl.is_eager_launch(h), cl.is_graph_launch(h), cl.sync_kind(h)) == (
        cl.is_eager_launch(c), cl.is_graph_launch(c), cl.sync_kind(c)
    )  # fmt: skip


def test_hip_memcpy_with_stream_is_a_synchronous_copy() -> None:
    assert cl.sync_kind(ev("cuda_runtime", "hipMemcpyWithStream")) == "sync_memcpy"
    assert cl.sync_kind(ev("cuda_runtime", "hipGetDevicePropertiesR0600")) is None
