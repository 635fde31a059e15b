"""The graph cache's bookkeeping (which row counts capture, replay, evict or fall back, with counters), run on
CPU with a stand-in for the CUDA graph: capture keeps static buffers and replay re-runs the body on them,
which is what a CUDA graph replay computes. The real capture is covered by tests/engine/test_gpu_graphs.py."""

from __future__ import annotations

import torch

from looptrace.engine.config import GraphConfig
from looptrace.engine.cuda_graphs import GraphCache
from tests.helpers import stand_in_graphs


def cache(**cfg) -> GraphCache:
    return stand_in_graphs("recurrent", lambda x: (x * 2,), GraphConfig(**cfg))


def run(gc: GraphCache, rows: int) -> torch.Tensor:
    return gc.run(rows, (torch.arange(rows, dtype=torch.float32),))[0]


def test_lru_evicts_the_least_recent_and_recaptures_it():
    gc = cache(max_graphs=2, eviction="lru")
    for rows in (1, 2, 1, 3, 2, 1):  # 3 evicts 2 (1 was used more recently); 2 evicts 1; 1 evicts 3
        assert torch.equal(run(gc, rows), torch.arange(rows, dtype=torch.float32) * 2)
    c = gc.counters.as_dict()
    assert (c["captures"], c["replays"], c["evictions"], c["fallbacks"]) == (5, 6, 3, 0)
    assert list(gc.entries) == [2, 1]


def test_no_eviction_keeps_the_first_graphs_and_counts_fallbacks_with_reasons():
    gc = cache(max_graphs=2, eviction="none", max_batch_size=4)
    for rows in (1, 2, 3, 1, 5):
        run(gc, rows)
    c = gc.counters.as_dict()
    assert (c["captures"], c["replays"], c["evictions"]) == (2, 3, 0)
    assert dict(c["fallback_reasons"]) == {"budget_full": 1, "oversized_batch": 1}


def test_graph_warmups_take_the_capture_code_path(monkeypatch):
    # The eager warm-ups before a capture must run the exact Triton kernels as the capture will, so the
    # kernels are compiled there and not inside the capture (a Huginn capture on the H200 failed so).
    # torch.cuda's stream and graph objects are stubbed: the warm-up/capture sequence runs on CPU.
    import contextlib

    from looptrace.engine import layers

    seen = []
    body = lambda x: (seen.append(layers.exact_kernels_on(1)) or x * 2,)  # noqa: E731
    gc = GraphCache("recurrent", body, GraphConfig(), pool=None)
    stub = type("Stub", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stub())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stub())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    gc._capture((torch.ones(1),))
    # two warm-ups on the exact path; the "capture" here is not a real one, so is_capturing() is False
    assert seen == [True, True, False]
    assert not layers.exact_kernels_on(1)  # outside the warm-ups: eager calls of one row stay on torch ops
