"""CUDA graphs for decode: one captured pass per row count, with a budget and counted eager fallbacks.

Base engine behaviour: lazy capture on first use (2 eager warm-ups on a side stream, then capture into a
shared memory pool); replay copies the inputs into static buffers; a new row count when the budget is full
runs eager forever (no eviction) and is counted as a fallback with its reason.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from looptrace.engine.config import GraphConfig
from looptrace.engine.kernels import graph_warmup, join_prefetches

# Fallback reasons (reported per step and in the counters)
OVERSIZED = "oversized_batch"
BUDGET_FULL = "budget_full"
UNSEEN_SIZE = "unseen_size"


@dataclass
class GraphCounters:
    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    evictions: int = 0
    fallback_reasons: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "evictions": self.evictions,
            "fallback_reasons": dict(self.fallback_reasons),
        }


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static input buffers
    outputs: tuple[torch.Tensor, ...]  # static output buffers


class GraphCache:
    """Graphs of `fn(*inputs) -> tuple[Tensor, ...]` keyed by row count.

    `run(rows, inputs)` returns outputs that stay valid until the next call (the caller copies them out).
    """

    def __init__(
        self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]], cfg: GraphConfig, pool
    ) -> None:
        self.name, self.fn, self.cfg, self.pool = name, fn, cfg, pool
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.counters = GraphCounters()
        self.last_mode: str = "eager"
        self.last_reason: str | None = None

    def fallback_reason(self, rows: int) -> str | None:
        if rows > self.cfg.max_batch_size:
            return OVERSIZED
        if rows in self.entries:
            return None
        if self.cfg.capture_sizes is not None and rows not in self.cfg.capture_sizes:
            return UNSEEN_SIZE
        if len(self.entries) >= self.cfg.max_graphs and self.cfg.eviction == "none":
            return BUDGET_FULL
        return None

    def run(self, rows: int, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        reason = self.fallback_reason(rows)
        if reason is not None:
            self.counters.fallbacks += 1
            self.counters.fallback_reasons[reason] += 1
            self.last_mode, self.last_reason = "eager", reason
            return self.fn(*inputs)
        entry = self.entries.get(rows)
        self.last_mode, self.last_reason = "replay", None
        if entry is None:
            if len(self.entries) >= self.cfg.max_graphs:  # LRU eviction
                self.entries.popitem(last=False)
                self.counters.evictions += 1
            entry = self._capture(inputs)
            self.entries[rows] = entry
            self.last_mode = "capture"
        else:
            self.entries.move_to_end(rows)
        for static, new in zip(entry.inputs, inputs):
            static.copy_(new, non_blocking=True)
        entry.graph.replay()
        self.counters.replays += 1
        return entry.outputs

    def run_body_eagerly(self, rows: int) -> None:
        """Run the captured function eagerly on the static inputs of graph `rows`: the same kernels in the
        same order as a replay (profilers use this to attribute a replay's kernels to ops). Its only side
        effect, the KV writes, rewrites the slots the last replay wrote with the same values. It runs under
        `graph_warmup()`, the capture's code path: without it the exact Triton kernels fall back to their
        eager ops below 256 rows (H200, exactloop's whole-token graph: 5,142 eager kernels vs the replay's
        990, so no replay matched its body; bench/results/h200/profiles/)."""
        entry = self.entries[rows]
        with graph_warmup():
            self.fn(*entry.inputs)

    def _capture(self, inputs: tuple[torch.Tensor, ...]) -> _Entry:
        static = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), graph_warmup():
            for _ in range(2):  # warm-ups: allocator, cuBLAS handles, Triton compiles stay out of the graph
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*static)
            join_prefetches()  # kernels.l2_prefetch's side stream must rejoin before the capture ends
        self.counters.captures += 1
        return _Entry(graph, static, tuple(outputs))
