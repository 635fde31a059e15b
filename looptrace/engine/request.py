"""Request-level types: stages, sampling parameters, per-request progress (the scheduler's unit of work),
the events that move a request, its output tokens and the batches it runs in. Imports no other engine
module, so every engine file (and `perturb`, which raises `EngineInputError`) can depend on it."""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes a uint64: seeds are 64-bit unsigned values
# Temperatures below this sample greedily (vLLM's rule): 1/T would push fp32 logits to inf and NaN.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # top-logprobs per token (vLLM's default max_logprobs; OpenAI's top_logprobs bound)
LOGIT_BIAS_MAX = 100.0  # |bias| bound (OpenAI's -100..100)
PENALTY_MAX = 2.0  # presence / frequency penalties in [-2, 2] (OpenAI, vLLM)
# vLLM takes any repetition penalty > 0; bounded here so logit / penalty and logit * penalty stay finite.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def reduce_seed(seed: int) -> int:
    """Any integer into the generator's range [0, 2**64), modulo 2**64: a seed already in range is itself,
    so reducing changes nothing that worked before; derived seeds (engine seed * k + i, seed + i) wrap."""
    return seed % SEED_MODULUS


def derive_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a seeded request with n > 1: seed + index, modulo 2**64 (so choice i
    equals a single request with that seed)."""
    return reduce_seed(seed + index)


class EngineInputError(ValueError):
    """A request or configuration the engine cannot serve (bad prompt, too long, bad setting)."""


class SamplingParamsError(ValueError):
    """A sampling field out of its range; `param` names the field (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class Stage(str, enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"  # one chunk per step, all loops on the chunk
    PRELUDE = "prelude"  # embed the last sampled token (Huginn/OLMo: prelude layers + fresh state)
    RECURRENT = "recurrent"  # one loop per engine step
    CODA = "coda"  # head (+ coda layers), sample
    FINISHED = "finished"


class Event(enum.Enum):
    """What just happened to a request (the input of `LLMEngine._advance`)."""

    ADMITTED = "admitted"
    CHUNK_DONE = "chunk_done"
    PRELUDE_DONE = "prelude_done"
    LOOP_DONE = "loop_done"
    LOOPS_DONE = "loops_done"
    TOKEN = "token"
    DECODED = "decoded"  # whole-token step: prelude, every loop and the coda in one step
    LOOP_SUBMITTED = "loop_submitted"  # async gate: a loop ran, its exit gate not yet read
    TOKEN_SUBMITTED = "token_submitted"  # async decode: a whole token ran, the host has not read it yet
    TOKEN_READ = "token_read"  # async decode: that token, read one step late
    GATE_READ = "gate_read"  # async gate: the exit decision of an earlier loop
    ABORTED = "aborted"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or below SAMPLING_EPS) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator (sampling and Huginn noise), 0 <= seed < 2**64
    ignore_eos: bool = True
    priority: int = 0  # lower runs first under `priority` admission
    # Logit processing (vLLM semantics), off at the defaults: a request that sets none samples as before.
    presence_penalty: float = 0.0  # - p for every token already in the output
    frequency_penalty: float = 0.0  # - f * count in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: logit / r if > 0, else logit * r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    stop_token_ids: list[int] | None = None  # finish ("stop") on any of these, whatever ignore_eos says
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob and the top k
    # None = off; k >= 0: per prompt position after the first, the prompt token's logprob given the
    # positions before it, the argmax and the top k (teacher-forced scoring, `scoring.py`)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def processes_logits(self) -> bool:
        """Whether logits are changed before sampling (penalties, bias); needs the token history."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def needs_sampler(self) -> bool:
        """Not a plain argmax of the logits (the batched greedy fast path and the graphs' argmax)."""
        return not self.greedy or self.processes_logits

    def check(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError for the first field out of range: everything that passes samples
        without raising or producing NaN (finite logits stay finite after bias, penalties and 1/T)."""

        def finite(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < lo or value > hi or (lo_open and value == lo):
                rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi < math.inf else f">= {lo:g}"
                raise SamplingParamsError(name, f"must be a finite number {rng}, got {value!r}")

        def integer(name: str, value: Any, lo: int, hi: int | None = None) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi and value >= hi):
                rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
                raise SamplingParamsError(name, f"must be an integer {rng}, got {value!r}")

        integer("max_tokens", self.max_tokens, 1)
        finite("temperature", self.temperature, 0.0, math.inf)
        finite("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        integer("top_k", self.top_k, 0)
        if self.seed is not None:
            integer("seed", self.seed, 0, SEED_MODULUS)
        finite("presence_penalty", self.presence_penalty, -PENALTY_MAX, PENALTY_MAX)
        finite("frequency_penalty", self.frequency_penalty, -PENALTY_MAX, PENALTY_MAX)
        finite("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        for tok, bias in (self.logit_bias or {}).items():
            integer("logit_bias", tok, 0, vocab_size)
            finite("logit_bias", bias, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX)
        for tok in self.stop_token_ids or ():
            integer("stop_token_ids", tok, 0)
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS + 1)


@dataclass
class LogprobRecord:
    """One sampled token's logprobs, still on the logits' device (read when the token reaches the host):
    log-softmax of the model's raw logits (before bias, penalties and temperature, as vLLM's default)."""

    chosen: torch.Tensor  # [] the sampled token's logprob
    top_values: torch.Tensor  # [k] descending
    top_ids: torch.Tensor  # [k]


@dataclass
class PromptLogprobRecord:
    """The scores of one prompt token given the positions before it, still on the logits' device."""

    token: torch.Tensor  # [] the prompt token's logprob
    argmax_id: torch.Tensor  # [] the most likely token there
    argmax: torch.Tensor  # [] its logprob
    rank: torch.Tensor  # [] 1 + the number of tokens more likely than the prompt token
    top_values: torch.Tensor  # [k] descending
    top_ids: torch.Tensor  # [k]


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored teacher-forced: its logprob given the earlier prompt, the argmax there and
    its logprob, and the top k (log-softmax of the raw float32 logits, as the sampled tokens' logprobs)."""

    position: int  # prompt position of the token
    token_id: int
    logprob: float
    argmax_id: int
    argmax_logprob: float
    rank: int  # 1 + the number of tokens more likely than this one (vLLM's rank)
    top_logprobs: list[tuple[int, float]]


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
    logprob_records: list[LogprobRecord] = field(default_factory=list)  # params.logprobs: one per token
    # params.prompt_logprobs: prompt position -> the record of the prompt token that follows it
    prompt_logprob_records: dict[int, PromptLogprobRecord] = field(default_factory=dict)
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


@dataclass
class TokenOutput:
    request_id: str
    token_id: int
    finished: bool
    finish_reason: str | None
    exit_depth: int
    logprob: float | None = None  # params.logprobs: the token's log-softmax of the raw logits
    top_logprobs: list[tuple[int, float]] | None = None  # params.logprobs = k: the k most likely, descending
    # params.prompt_logprobs, on the first output only: prompt positions 1.. (position 0 has no context)
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass
class PrefillSpan:
    request: Request
    start: int  # first prompt position of the chunk
    length: int

    @property
    def is_last_chunk(self) -> bool:
        return self.start + self.length == len(self.request.prompt)


@dataclass
class Batch:
    stage: Stage
    requests: list[Request]
    spans: list[PrefillSpan] = field(default_factory=list)  # PREFILL only

    @property
    def num_rows(self) -> int:
        return sum(s.length for s in self.spans) if self.stage == Stage.PREFILL else len(self.requests)
