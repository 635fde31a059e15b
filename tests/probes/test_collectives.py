"""Collectives: their own category, bytes, and NCCL-tests bus bandwidth, on a recorded gloo trace and on a
Kineto-shaped NCCL trace."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from looptrace.probes import collectives as comms
from looptrace.probes.counters import analyze
from looptrace.probes.events import load_chrome_trace, parse_chrome_trace


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "all_gather"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
        ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "broadcast"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("nccl:all_reduce", "all_reduce"),
        ("c10d::recv_", "send_recv"),
    ],
)
def test_kinds(name: str, kind: str) -> None:
    assert comms.is_comm_name(name)
    assert comms.kind_of(name) == kind


@pytest.mark.parametrize(
    ("kind", "n", "factor"),
    [
        ("all_reduce", 8, 2 * 7 / 8),
        ("all_gather", 4, 3 / 4),
        ("reduce_scatter", 2, 1 / 2),
        ("broadcast", 8, 1.0),
    ],
)
def test_bus_bandwidth_follows_nccl_tests(kind: str, n: int, factor: float) -> None:
    stat = comms.comm_stat(kind, [1_000_000, 1_000_000], 1_000.0, n)  # 2 MB in 1 ms = 2 GB/s
    assert stat.alg_gbps == pytest.approx(2.0)
    assert stat.bus_gbps == pytest.approx(2.0 * factor)
    unknown = comms.comm_stat(kind, [1_000_000], 1_000.0, None)
    assert unknown.bus_gbps is None and "world size unknown" in unknown.note


def test_gloo_collectives_recorded_on_cpu(tmp_path) -> None:
    """A real torch.profiler trace of gloo collectives in a 1-process group: the c10d ops are
    communication; bytes from the `gloo:` ranges' shapes; world size 1 from `distributedInfo`."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.ones(1024)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            dist.all_reduce(x)
            dist.all_gather([torch.empty(1024)], x)
        prof.export_chrome_trace(str(tmp_path / "gloo.json"))
    finally:
        dist.destroy_process_group()
    a = analyze(load_chrome_trace(tmp_path / "gloo.json"))
    rows = {r.op: r for r in a.ops if r.category == "communication"}
    assert set(rows) == {"c10d::allreduce_", "c10d::allgather_"}
    ar, ag = rows["c10d::allreduce_"], rows["c10d::allgather_"]
    assert (ar.collective, ar.bytes, ar.world_size, ar.bus_gbps) == ("all_reduce", 4096, 1, 0.0)
    assert ar.alg_gbps == pytest.approx(4096 / ar.gpu_us / 1e3)
    assert (ag.collective, ag.bytes) == ("all_gather", 4096)  # n × the 4 KiB input, n = 1
    assert "communication" in {r.category for r in a.categories}
    assert any(n.startswith("communication c10d::allreduce_: all_reduce: 1 call(s)") for n in a.notes)


def _nccl_trace(kt, group_size: int | None) -> dict:
    """Two NCCL collectives as torch.profiler records them on a GPU: the c10d op, `record_param_comms`
    (its argument names from torch/csrc/distributed/c10d/ParamCommsUtils.hpp) and `nccl:all_reduce`
    around the launch; kernel names as NCCL >= 2.19 and NCCL 2.18 / RCCL write them."""
    t = kt.tick(1.0)
    kt.cpu_op("c10d::allreduce_", t, 50.0)
    param = kt.cpu_op("record_param_comms", t + 1.0, 40.0)
    param["args"].update({"Collective name": "allreduce", "dtype": "BFloat16", "In msg nelems": 4_194_304,
                          "Out msg nelems": 4_194_304})  # fmt: skip
    if group_size:
        param["args"]["Group size"] = group_size
    kt.annotation("nccl:all_reduce", t + 2.0, 30.0)  # a record_function range, as `gloo:all_reduce`
    kt.now = t + 3.0
    kt.launch("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", kt.tick(), 1000.0)
    kt.now = t + 100.0
    t = kt.tick(1.0)
    kt.cpu_op("c10d::_allgather_base_", t, 50.0)
    kt.now = t + 1.0
    kt.launch("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", kt.tick(), 500.0)
    return kt.to_dict()


def test_nccl_kernels_are_communication_with_bus_bandwidth(kt) -> None:
    a = analyze(parse_chrome_trace(_nccl_trace(kt, group_size=8), "nccl.json"))
    assert [r.category for r in a.categories] == ["communication"]
    rows = {r.op: r for r in a.ops}
    ar = rows["record_param_comms"]
    # 4 Mi bf16 elements = 8 MiB in 1,000 µs; busbw = algbw × 2(n-1)/n with n = 8 (its Group size)
    assert (ar.collective, ar.bytes, ar.world_size) == ("all_reduce", 8_388_608, 8)
    assert ar.alg_gbps == pytest.approx(8.388608) and ar.bus_gbps == pytest.approx(8.388608 * 14 / 8)
    ag = rows["c10d::_allgather_base_"]  # no shapes recorded: bytes unknown, said so
    assert (ag.collective, ag.bytes, ag.bus_gbps) == ("all_gather", None, None)
    assert "void" not in rows


def test_world_size_unknown_is_said(kt) -> None:
    a = analyze(parse_chrome_trace(_nccl_trace(kt, group_size=None), "nccl.json"))
    ar = next(r for r in a.ops if r.collective == "all_reduce")
    assert ar.bytes == 8_388_608 and ar.bus_gbps is None
    assert any("busbw unknown (world size unknown)" in n for n in a.notes)


def test_sizes_on_the_kernel_and_world_size_from_distributed_info(kt) -> None:
    """Newer Kineto copies the collective's record_param_comms arguments onto the NCCL kernel; the world
    size is the trace's `distributedInfo` (torch.profiler writes it). An all-gather's bytes are its output."""
    corr = kt.launch("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", kt.tick(), 250.0)
    (kernel,) = [e for e in kt.events if e["cat"] == "kernel" and e["args"]["correlation"] == corr]
    kernel["args"].update({"Collective name": "_allgather_base", "dtype": "Float", "In msg nelems": 262_144,
                           "Out msg nelems": 1_048_576, "Group size": 4})  # fmt: skip
    trace = kt.to_dict(distributedInfo={"backend": "nccl", "rank": 0, "world_size": 4})
    a = analyze(parse_chrome_trace(trace, "ag.json"))
    (row,) = a.ops
    assert (row.category, row.collective, row.bytes, row.world_size) == (
        "communication",
        "all_gather",
        4 << 20,
        4,
    )
    assert row.alg_gbps == pytest.approx((4 << 20) / 250.0 / 1e3)
    assert row.bus_gbps == pytest.approx(row.alg_gbps * 3 / 4)
