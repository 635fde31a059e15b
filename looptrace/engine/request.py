"""Request state: stages, sampling parameters and per-request progress (the scheduler's unit of work)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Stage(str, enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"  # one chunk per step, all loops on the chunk
    PRELUDE = "prelude"  # embed the last sampled token (Huginn/OLMo: prelude layers + fresh state)
    RECURRENT = "recurrent"  # one loop per engine step
    CODA = "coda"  # head (+ coda layers), sample
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator (sampling and Huginn noise)
    ignore_eos: bool = True
    priority: int = 0  # lower runs first under `priority` admission

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    request_id: str = ""
    arrival_time: float = 0.0
    stage: Stage = Stage.WAITING
    outputs: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)  # depth of every emitted token
    num_prefilled: int = 0  # prompt tokens whose all-loop prefill is done (incl. cached prefix)
    num_cached: int = 0  # prompt tokens taken from the prefix cache
    loops_done: int = 0  # loops completed for the token in flight
    remaining_probability: float = 1.0  # Ouro exit: prod(1 - sigmoid(gate)) so far
    finish_reason: str | None = None
    state_slot: int = -1  # row in the runner's carried-state pool
    generator: torch.Generator | None = None  # created on first use (noise and sampling share it)
    noise_seed: int | None = None  # position-keyed noise: params.seed, else the engine's seed
    prefix_salt: bytes = b""  # starts the prefix-cache key chain (KV that depends on the noise seed)
    seq: int = field(default_factory=lambda: next(_ids))  # FCFS tie-break; the engine numbers its own

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{self.seq}"

    # Positions ---------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def decode_position(self) -> int:
        """Position of the token being processed in decode: the last sampled token."""
        return len(self.prompt) + len(self.outputs) - 1

    @property
    def max_kv_tokens(self) -> int:
        """KV positions this request can ever need: the final sampled token is never fed back."""
        return len(self.prompt) + self.params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.stage == Stage.FINISHED
