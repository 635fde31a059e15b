"""Benchmark workloads: what to submit and when (burst, Poisson, closed-loop sessions, JSONL files).

A workload hands `benchmark.run_workload` its `initial_items()`; arrivals are seconds from the start of
the run. Closed-loop workloads (sessions) also produce follow-up items from `next_items(item, outputs,
now)`, which the driver calls once per completed request. Workloads keep no per-run state, so one
workload object can drive several runs and gives the same prompts every time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from looptrace.engine.tokenizer import load_tokenizer
from looptrace.input_files import InputError, iter_jsonl


class WorkloadError(ValueError):
    """A bad workload definition or file; the message is one line and names the field or file:line."""


# Longest wait a run can schedule (115 days): beyond it a sleep or a timer overflows (OverflowError for
# an arrival of 1e308), and no benchmark means it. Poisson's rate and think times are bounded to match.
ARRIVAL_MAX_S = 1e7
RATE_MIN = 1e-6  # requests per second: a mean gap of ~12 days


@dataclass
class WorkItem:
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0  # scheduled submission, seconds from the start of the run
    session_id: int | None = None
    turn: int | None = None  # 0-based turn within the session


class Workload:
    """Base class: static workloads override `initial_items`; closed-loop ones also `next_items`."""

    def total_requests(self) -> int:
        """Requests the run submits if every request completes (the progress-bar total)."""
        raise NotImplementedError

    def initial_items(self) -> list[WorkItem]:
        raise NotImplementedError

    def next_items(self, item: WorkItem, outputs: list[int], now: float) -> list[WorkItem]:
        """Items released by the completion of `item` (which generated `outputs`) at `now` seconds."""
        return []

    def describe(self) -> dict[str, Any]:
        """The workload's kind and settings as plain JSON data (run headers)."""
        out: dict[str, Any] = {"kind": type(self).__name__.removesuffix("Workload").lower()}
        for f in fields(self) if is_dataclass(self) else ():
            if not f.init:
                continue
            value = getattr(self, f.name)
            if f.name == "tokenizer":
                value = None if value is None else type(value).__name__
            elif isinstance(value, Path):
                value = str(value)
            out[f.name] = value
        return out


class Tokenizer(Protocol):
    def encode(self, text: str) -> Any: ...


# Validation ------------------------------------------------------------------------------------------
def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise WorkloadError(f"{name} must be {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_count(name: str, value: object) -> None:
    _require(_is_int(value) and value >= 1, name, value, "an integer >= 1")


def _check_tokens(vocab_size: int, low: int, high: int | None) -> tuple[int, int]:
    """The [low, high) range prompt tokens are drawn from; `high` defaults to `vocab_size`."""
    _check_count("vocab_size", vocab_size)
    hi = vocab_size if high is None else high
    _require(_is_int(low) and 0 <= low < vocab_size, "token_low", low, f"in [0, vocab_size={vocab_size})")
    _require(_is_int(hi) and low < hi <= vocab_size, "token_high", hi, f"in (token_low={low}, {vocab_size}]")
    return low, hi


def _random_prompt(rng: np.random.Generator, n: int, low: int, high: int) -> list[int]:
    return rng.integers(low, high, size=n).tolist()


def _random_prompts(rng: np.random.Generator, count: int, n: int, low: int, high: int) -> list[list[int]]:
    return rng.integers(low, high, size=(count, n)).tolist()  # one draw: fast for many requests


# Synthetic workloads ---------------------------------------------------------------------------------
@dataclass
class BurstWorkload(Workload):
    """`concurrency` random prompts, all arriving at t=0 (vLLM's `--request-rate inf`)."""

    concurrency: int
    prompt_len: int
    max_tokens: int
    seed: int = 0
    vocab_size: int = 32000
    token_low: int = 0  # draw from [token_low, token_high) to keep clear of special token ids
    token_high: int | None = None

    def __post_init__(self) -> None:
        _check_count("concurrency", self.concurrency)
        _check_count("prompt_len", self.prompt_len)
        _check_count("max_tokens", self.max_tokens)
        self._range = _check_tokens(self.vocab_size, self.token_low, self.token_high)

    def total_requests(self) -> int:
        return self.concurrency

    def initial_items(self) -> list[WorkItem]:
        prompts = _random_prompts(
            np.random.default_rng(self.seed), self.concurrency, self.prompt_len, *self._range
        )
        return [WorkItem(p, self.max_tokens) for p in prompts]


@dataclass
class PoissonWorkload(Workload):
    """Open-loop arrivals with exponential inter-arrival times of mean 1/rate. The first request arrives
    at t=0, as `vllm bench serve` sends before its first sleep."""

    rate: float  # requests per second
    num_requests: int
    prompt_len: int
    max_tokens: int
    seed: int = 0
    vocab_size: int = 32000
    token_low: int = 0
    token_high: int | None = None

    def __post_init__(self) -> None:
        ok = isinstance(self.rate, (int, float)) and not isinstance(self.rate, bool) and self.rate >= RATE_MIN
        _require(ok, "rate", self.rate, f">= {RATE_MIN:g} requests/s")
        _check_count("num_requests", self.num_requests)
        _check_count("prompt_len", self.prompt_len)
        _check_count("max_tokens", self.max_tokens)
        self._range = _check_tokens(self.vocab_size, self.token_low, self.token_high)

    def total_requests(self) -> int:
        return self.num_requests

    def initial_items(self) -> list[WorkItem]:
        rng = np.random.default_rng(self.seed)
        prompts = _random_prompts(rng, self.num_requests, self.prompt_len, *self._range)
        # A separate stream for arrivals, so the prompts stay the same when only the rate changes.
        gaps = np.random.default_rng([self.seed, 1]).exponential(1.0 / self.rate, self.num_requests - 1)
        arrivals = [0.0, *np.cumsum(gaps).tolist()]
        return [WorkItem(p, self.max_tokens, arrival=t) for p, t in zip(prompts, arrivals, strict=True)]


@dataclass
class SessionWorkload(Workload):
    """Closed-loop multi-turn chats with growing shared prefixes (prefix-cache and long-context load).

    Every session's turn 0 arrives at t=0. Turn k (k >= 1) is released when turn k-1 of the same session
    completes, `think_time` seconds later; its prompt is turn k-1's prompt + turn k-1's generated tokens +
    `turn_prompt_len` new user tokens. A session whose turn fails or is aborted ends there.
    """

    num_sessions: int
    turns: int
    first_prompt_len: int
    turn_prompt_len: int
    max_tokens: int
    seed: int = 0
    vocab_size: int = 32000
    token_low: int = 0
    token_high: int | None = None
    think_time: float = 0.0  # seconds between a turn's completion and the next turn's arrival

    def __post_init__(self) -> None:
        _check_count("num_sessions", self.num_sessions)
        _check_count("turns", self.turns)
        _check_count("first_prompt_len", self.first_prompt_len)
        _check_count("turn_prompt_len", self.turn_prompt_len)
        _check_count("max_tokens", self.max_tokens)
        ok = isinstance(self.think_time, (int, float)) and 0 <= self.think_time <= ARRIVAL_MAX_S
        _require(ok, "think_time", self.think_time, f"a number of seconds in [0, {ARRIVAL_MAX_S:g}]")
        self._range = _check_tokens(self.vocab_size, self.token_low, self.token_high)

    def total_requests(self) -> int:
        return self.num_sessions * self.turns

    def max_prompt_len(self) -> int:
        """Longest prompt any turn can have (every turn generating `max_tokens`)."""
        return self.first_prompt_len + (self.turns - 1) * (self.max_tokens + self.turn_prompt_len)

    def _user_tokens(self, session: int, turn: int, n: int) -> list[int]:
        # One generator per (session, turn): prompts do not depend on the order in which turns complete.
        return _random_prompt(np.random.default_rng([self.seed, session, turn]), n, *self._range)

    def initial_items(self) -> list[WorkItem]:
        return [
            WorkItem(self._user_tokens(s, 0, self.first_prompt_len), self.max_tokens, 0.0, s, 0)
            for s in range(self.num_sessions)
        ]

    def next_items(self, item: WorkItem, outputs: list[int], now: float) -> list[WorkItem]:
        if item.session_id is None or item.turn is None or item.turn + 1 >= self.turns:
            return []
        s, turn = item.session_id, item.turn + 1
        prompt = [*item.prompt, *outputs, *self._user_tokens(s, turn, self.turn_prompt_len)]
        return [WorkItem(prompt, self.max_tokens, now + self.think_time, s, turn)]


# Recorded workloads ----------------------------------------------------------------------------------
@dataclass
class JsonlWorkload(Workload):
    """One request per non-blank line: `{"prompt": "text"}` (needs `tokenizer`) or
    `{"prompt_token_ids": [1, 2, 3]}`, optional `"max_tokens"` and `"arrival"` (seconds from the start).
    Other keys are ignored. The file is read and checked when the workload is created; with `vocab_size`,
    a token id outside the model's vocabulary is an error naming its line."""

    path: str | Path
    tokenizer: Tokenizer | None = None
    default_max_tokens: int = 128
    vocab_size: int | None = None
    items: list[WorkItem] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_count("default_max_tokens", self.default_max_tokens)
        self.items = []
        try:  # a regular UTF-8 file (BOM and CRLF accepted), each line within the nesting/number limits
            for lineno, obj in iter_jsonl(self.path):
                self.items.append(self._parse_item(obj, lineno))
        except InputError as exc:
            raise WorkloadError(str(exc)) from None
        if not self.items:
            raise WorkloadError(f"{self.path}: no requests (the file is empty)")

    def total_requests(self) -> int:
        return len(self.items)

    def initial_items(self) -> list[WorkItem]:
        return [WorkItem(list(it.prompt), it.max_tokens, it.arrival) for it in self.items]

    def _fail(self, lineno: int, problem: str) -> WorkloadError:
        return WorkloadError(f"{self.path}:{lineno}: {problem}")

    def _parse_item(self, obj: Any, lineno: int) -> WorkItem:
        if not isinstance(obj, dict):
            raise self._fail(lineno, f"expected a JSON object, got {type(obj).__name__}")
        prompt = self._prompt(obj, lineno)
        max_tokens = obj.get("max_tokens", self.default_max_tokens)
        if not (_is_int(max_tokens) and max_tokens >= 1):
            raise self._fail(lineno, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        arrival = obj.get("arrival", 0.0)
        ok = (
            isinstance(arrival, (int, float))
            and not isinstance(arrival, bool)
            and 0 <= arrival <= ARRIVAL_MAX_S
        )
        if not ok:
            raise self._fail(
                lineno, f"arrival must be a number of seconds in [0, {ARRIVAL_MAX_S:g}], got {arrival!r}"
            )
        return WorkItem(prompt, int(max_tokens), float(arrival))

    def _prompt(self, obj: dict[str, Any], lineno: int) -> list[int]:
        if ("prompt" in obj) == ("prompt_token_ids" in obj):
            raise self._fail(lineno, "needs exactly one of 'prompt' or 'prompt_token_ids'")
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
                raise self._fail(lineno, "prompt_token_ids must be a list of non-negative integers")
        else:
            ids = self._encode(obj["prompt"], lineno)
        if not ids:
            raise self._fail(lineno, "empty prompt")
        if self.vocab_size is not None:
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise self._fail(
                    lineno, f"token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})"
                )
        return ids

    def _encode(self, text: object, lineno: int) -> list[int]:
        if not isinstance(text, str):
            raise self._fail(lineno, f"prompt must be a string, got {type(text).__name__}")
        if self.tokenizer is None:
            raise self._fail(lineno, "text 'prompt' needs a tokenizer (or give 'prompt_token_ids')")
        try:
            encoded = self.tokenizer.encode(text, add_special_tokens=True)  # BOS where the model wants it
        except Exception as e:  # a tokenizer bug or bad input: report it with the line it came from
            detail = " ".join(str(e).split())  # keep the message on one line
            raise self._fail(lineno, f"tokenizer failed ({type(e).__name__}: {detail})") from None
        # `tokenizers.Tokenizer.encode` returns an Encoding; its ids are what we want.
        return list(getattr(encoded, "ids", encoded))


# The one constructor ---------------------------------------------------------------------------------
WORKLOAD_KINDS = ("burst", "poisson", "sessions", "jsonl")


def make_workload(
    kind: str,
    *,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    vocab_size: int,
    rate: float | None = None,
    num_requests: int | None = None,
    sessions: int | None = None,
    turns: int | None = None,
    turn_prompt_len: int | None = None,
    prompts: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> Workload:
    """Workload options (`looptrace run`'s, `looptrace bench`'s bursts) -> a Workload of `kind` (one of
    WORKLOAD_KINDS; a `run_workload.WorkloadKind` compares equal to its name). The workload validates its
    own numbers; a missing option of the kind is a one-line WorkloadError."""
    shared = dict(max_tokens=max_tokens, seed=seed, vocab_size=vocab_size)
    if kind == "burst":
        return BurstWorkload(concurrency=concurrency, prompt_len=prompt_len, **shared)
    if kind == "poisson":
        if rate is None:
            raise WorkloadError("--workload poisson needs --rate (requests per second)")
        count = concurrency if num_requests is None else num_requests
        return PoissonWorkload(rate=rate, num_requests=count, prompt_len=prompt_len, **shared)
    if kind == "sessions":
        return SessionWorkload(
            num_sessions=sessions,
            turns=turns,
            first_prompt_len=prompt_len,
            turn_prompt_len=turn_prompt_len,
            **shared,
        )
    return _jsonl_workload(prompts, tokenizer_dir, max_tokens, vocab_size)


def _jsonl_workload(prompts: Path | None, tokenizer_dir: Path | None, max_tokens: int, vocab_size: int):
    if prompts is None:
        raise WorkloadError("--workload jsonl needs --prompts FILE")
    return JsonlWorkload(
        path=prompts,
        tokenizer=load_tokenizer(tokenizer_dir),
        default_max_tokens=max_tokens,
        vocab_size=vocab_size,
    )
