"""The engine API a client drives: the part of `LLMEngine` that workloads, `diff`, `depth` and the server use.

A structural type (Protocol), so clients name what they rely on without importing engine internals, and a
test double needs only these members.
"""

from __future__ import annotations

from typing import Protocol

from looptrace.engine.hooks import Observer
from looptrace.engine.llm_engine import EngineStats, TokenOutput
from looptrace.engine.request import SamplingParams


class ServingEngine(Protocol):
    max_model_len: int
    stats: EngineStats

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str: ...

    def step(self) -> list[TokenOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def abort_request(self, request_id: str) -> None: ...

    def kv_usage(self) -> float: ...

    def attach(self, observer: Observer) -> None: ...

    def detach(self, observer: Observer) -> None: ...
