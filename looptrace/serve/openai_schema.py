"""OpenAI-compatible request and response bodies (the subset looptrace serves), as pydantic models.

Every field we act on is validated with its bounds (a bad value is a 400 naming the field). Fields OpenAI
defines that we do not serve are rejected by `unsupported()` (a 400 naming the field), never accepted
without effect; a few that cannot change the output (`user`, `metadata`, ...) are accepted and ignored
(IGNORED_FIELDS); any other unknown field is a 400. Extensions (vLLM's): `top_k`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `return_token_ids` (each choice then carries its sampled `token_ids`).

Types are strict (pydantic's strict mode): `true` is not a number, `"yes"` is not a boolean and `"1"` is not
a token id; an integer is accepted where a float is expected (JSON does not tell 1 from 1.0).

Seeds are 64-bit unsigned values (0 <= seed < 2**64, torch.Generator's range); choice i of a request with
n > 1 uses seed + i (mod 2**64), so it equals a single request with that seed.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from looptrace.engine.request import (
    LOGIT_BIAS_MAX,
    MAX_LOGPROBS,
    PENALTY_MAX,
    REPETITION_PENALTY_RANGE,
    SAMPLING_EPS,
    SEED_MODULUS,
)

# float32's smallest normal number: the sampler works in fp32, where a smaller top_p is 0 or subnormal.
FP32_TINY = 1.1754943508222875e-38
DEFAULT_MAX_TOKENS = 16  # completions (OpenAI, vLLM); chat defaults to the rest of the context
MAX_N = 128  # choices per request (each is a sequence in the engine)
# Sequences one request may queue: prompts x n. A 5 KB body of 500 prompts x n=128 queued 64,000 sequences
# and starved every other client; vLLM bounds its batches the same way.
MAX_SEQUENCES_PER_REQUEST = 256
# Accepted and ignored: they cannot change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})

_Penalty = Field(default=0.0, ge=-PENALTY_MAX, le=PENALTY_MAX)


class _Request(BaseModel):
    # Extra fields are kept (not ignored) so that `unsupported()` can name them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # chat: the newer name
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # below 1e-5: greedy (vLLM's rule)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension (vLLM): 0 or -1 = off
    seed: int | None = Field(default=None, ge=0, lt=SEED_MODULUS)
    presence_penalty: float = _Penalty
    frequency_penalty: float = _Penalty
    repetition_penalty: float = Field(  # extension (vLLM)
        default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension (vLLM)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # {"include_usage": true}
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1)  # only best_of == n (no ranking of extra samples)
    ignore_eos: bool = False  # extension (vLLM)
    return_token_ids: bool = False  # extension (vLLM)

    # The engine copes with both edges (a tiny temperature is greedy, top-p keeps the top token), but at
    # the API they are almost always a client bug: reject them, naming the field, rather than silently
    # sampling greedily.
    @field_validator("temperature")
    @classmethod
    def _temperature_is_zero_or_usable(cls, value: float) -> float:
        if 0.0 < value < SAMPLING_EPS:
            raise ValueError(f"must be 0 (greedy) or at least {SAMPLING_EPS:g}, got {value!r}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_is_representable(cls, value: float) -> float:
        if value < FP32_TINY:
            raise ValueError(f"must be at least {FP32_TINY:.3g} (float32's smallest normal), got {value!r}")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def output_budget(self, default: int = DEFAULT_MAX_TOKENS) -> int:
        return self.max_tokens or self.max_completion_tokens or default

    def logprobs_k(self) -> int | None:
        """Top logprobs per token, or None when logprobs are off."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        """Top logprobs per prompt position, or None when prompt logprobs are off."""
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to something this server does not do, else None."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of={self.best_of} != n={self.n} is not supported (no ranking of samples)"
        for name, value in (self.model_extra or {}).items():
            if value is not None and name not in IGNORED_FIELDS:  # an explicit null asks for nothing
                return name, f"unsupported field `{name}`"
        return None

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer keys (a key that is not ASCII digits: ValueError naming it; Python's
        int() would read "٣" as 3 and " 3" as 3)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            out[int(key)] = bias
        return out


class CompletionRequest(_Request):
    # A string, a list of token ids, or a list of strings / of token-id lists (a batch: one choice set per
    # prompt, each prompt as its own request).
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Extension (vLLM): per prompt position after the first, the prompt token's logprob and the top k.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_false_is_off(cls, v: Any) -> Any:
        return None if v is False else v

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().unsupported()

    def prompt_logprobs_k(self) -> int | None:
        """Top logprobs per prompt position: `prompt_logprobs`, else `logprobs` when the prompt is echoed
        (OpenAI's legacy echo lists the prompt tokens' logprobs first), else None."""
        if self.prompt_logprobs is not None:
            return (
                self.prompt_logprobs
                if not self.echo or self.logprobs is None
                else max(self.prompt_logprobs, self.logprobs)
            )
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_hold_text(cls, value: Any) -> Any:
        """A text part's `text` is a string (an object there used to be sent to the model as its repr)."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                if part.get("type") == "text" and not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i} is of type 'text' but its `text` is not a string")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content if part.get("type") == "text")

    def non_text_part(self) -> str | None:
        """The type of the first content part that is not text (images, audio: not supported)."""
        if isinstance(self.content, list):
            return next((str(p.get("type")) for p in self.content if p.get("type") != "text"), None)
        return None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", f"response_format {self.response_format.get('type')!r} is not supported"
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported (no tools)"
        if self.functions:
            return "functions", "functions (function calling) are not supported"
        if self.function_call not in (None, "none", "auto"):
            return "function_call", "function_call is not supported"
        for i, m in enumerate(self.messages):
            kind = m.non_text_part()
            if kind is not None:
                return f"messages.{i}.content", f"content part of type {kind!r} is not supported (text only)"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages (rendered as the chat endpoint does)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as served)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# Responses ------------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, logprob, top alternatives and text offset."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None = None  # known for the prompt token itself
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    # Extension (vLLM, `prompt_logprobs`): None for position 0, then per position token id -> its
    # {logprob, rank, decoded_token}, the prompt token and the top k
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "looptrace"
    max_model_len: int | None = None


class VersionResponse(BaseModel):
    version: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
