"""The split-combine ticket counters (`looptrace.engine.kernels.scratch`): zeroed when made, the same buffer
handed out while it is large enough, a larger one (the request or twice the last, whichever is more) made
when not, every buffer ever handed out kept alive (captured graphs keep their addresses), one list per
device. `tickets` works on any device: CPU and meta tensors here. GPU (`gpu` marker): a buffer made during a
CUDA-graph capture belongs to that graph alone and is not handed out again."""

from __future__ import annotations

import pytest
import torch

from looptrace.engine.kernels import scratch

CPU = torch.device("cpu")
META = torch.device("meta")


@pytest.fixture(autouse=True)
def no_buffers(monkeypatch):
    """Each test starts with no buffer on any device and leaves the engine's own untouched."""
    monkeypatch.setattr(scratch, "_TICKETS", {})


def test_the_first_buffer_is_zeroed_int32_of_the_count_asked_for():
    buffer = scratch.tickets(CPU, 5)
    assert buffer.dtype == torch.int32 and buffer.device == CPU
    assert buffer.tolist() == [0, 0, 0, 0, 0]


def test_the_same_buffer_is_handed_out_while_it_is_large_enough():
    first = scratch.tickets(CPU, 8)
    first[2] = 7  # a kernel's counter mid-launch: handing the buffer out again does not re-zero it
    assert scratch.tickets(CPU, 3) is first
    assert scratch.tickets(CPU, 8) is first
    assert first.tolist() == [0, 0, 7, 0, 0, 0, 0, 0]
    kept = scratch._TICKETS
    assert kept == {CPU: [first]}


def test_growth_takes_the_request_or_twice_the_last_and_keeps_the_old_buffers():
    first = scratch.tickets(CPU, 8)
    first[0] = 3
    doubled = scratch.tickets(CPU, 9)  # 9 < 2 x 8
    assert doubled.numel() == 16 and doubled.tolist() == [0] * 16
    requested = scratch.tickets(CPU, 40)  # 40 > 2 x 16
    assert requested.numel() == 40 and requested.tolist() == [0] * 40
    assert scratch.tickets(CPU, 17) is requested
    kept = scratch._TICKETS[CPU]
    assert [b.numel() for b in kept] == [8, 16, 40]
    assert kept[0] is first and kept[1] is doubled and first.tolist() == [3, 0, 0, 0, 0, 0, 0, 0]


def test_each_device_has_its_own_buffers():
    on_cpu = scratch.tickets(CPU, 4)
    on_meta = scratch.tickets(META, 64)
    assert on_meta.device == META and on_meta.numel() == 64
    assert scratch.tickets(CPU, 4) is on_cpu  # the larger buffer of another device is not this one's
    assert scratch.tickets(CPU, 5).numel() == 8  # grows from this device's last (4), not from 64
    assert {device: [b.numel() for b in kept] for device, kept in scratch._TICKETS.items()} == {
        CPU: [4, 8],
        META: [64],
    }


@pytest.mark.gpu
def test_a_buffer_made_during_capture_belongs_to_that_graph_alone():
    cuda = torch.device("cuda", torch.cuda.current_device())
    before = scratch.tickets(cuda, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        during = scratch.tickets(cuda, 100)
    graph.replay()
    torch.cuda.synchronize()
    assert during.numel() == 100 and during.cpu().tolist() == [0] * 100  # its zeroing was captured
    kept = scratch._TICKETS[cuda]
    assert kept == [before]
    assert scratch.tickets(cuda, 4) is before
    assert scratch.tickets(cuda, 5).numel() == 8  # made outside capture: kept, grown from the kept one
    assert len(scratch._TICKETS[cuda]) == 2
