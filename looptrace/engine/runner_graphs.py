"""The runner's CUDA graphs: one `GraphCache` per captured stage family, each capturing a traversal of
runner_passes.py, and `GraphRuns`, which runs a traversal through its family's cache (capture or replay)
or eagerly where the family is not captured, and remembers how the last one ran (the step's trace)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from looptrace.engine.config import GraphConfig
from looptrace.engine.cuda_graphs import GraphCache
from looptrace.engine.hooks import HookDispatcher
from looptrace.engine.runner_passes import Traversals


def build_graph_caches(
    passes: Traversals, families: frozenset[str], cfg: GraphConfig
) -> dict[str, GraphCache]:
    """One cache per family the plan captures, all in one memory pool (none off CUDA)."""
    if not families:
        return {}
    bodies = {
        "recurrent": passes.core_pass,
        "recurrent_fused": passes.fused_pass,
        "coda": passes.coda_pass,
        "prefill": passes.prefill_pass,
        "whole_token": passes.token_pass,
    }
    mempool = torch.cuda.graph_pool_handle()
    return {name: GraphCache(name, body, cfg, mempool) for name, body in bodies.items() if name in families}


@dataclass
class GraphRuns:
    """How the last traversal ran: its cache's mode and fallback reason, or None (no cache: eager)."""

    last_mode: str | None = None
    last_fallback: str | None = None

    def run(self, cache: GraphCache | None, rows: int, traversal: Callable, inputs: tuple):
        """The traversal through `cache` (keyed by the row count), or called directly without one."""
        if cache is None:
            self.ran_eagerly()
            return traversal(*inputs)
        out = cache.run(rows, inputs)
        self.last_mode, self.last_fallback = cache.last_mode, cache.last_reason
        return out

    def ran_eagerly(self) -> None:
        self.last_mode, self.last_fallback = None, None


@contextmanager
def one_loop_range(hooks: HookDispatcher, stage: str) -> Iterator[None]:
    """Loops fused into one submission show range observers (the profiler's) one loop range, -1; the graph
    stays on (observers of hidden states get the loops one by one instead)."""
    if hooks.active:
        hooks.loop_begin(stage, -1)
    yield
    if hooks.active:
        hooks.loop_end(stage, -1)
