"""Workload definitions: sizes, determinism, arrival statistics, session prefixes, JSONL parsing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from looptrace.drive.workloads import (
    BurstWorkload,
    JsonlWorkload,
    PoissonWorkload,
    SessionWorkload,
    WorkItem,
    WorkloadError,
)


# Burst -----------------------------------------------------------------------------------------------
def test_burst_sizes_range_and_arrivals():
    wl = BurstWorkload(
        concurrency=5, prompt_len=7, max_tokens=3, seed=1, vocab_size=100, token_low=10, token_high=90
    )
    items = wl.initial_items()
    assert len(items) == 5 == wl.total_requests()
    for it in items:
        assert len(it.prompt) == 7 and it.max_tokens == 3 and it.arrival == 0.0
        assert all(type(t) is int and 10 <= t < 90 for t in it.prompt)
        assert it.session_id is None and it.turn is None


def test_burst_deterministic_by_seed():
    a = BurstWorkload(4, 16, 8, seed=3, vocab_size=1000).initial_items()
    b = BurstWorkload(4, 16, 8, seed=3, vocab_size=1000).initial_items()
    c = BurstWorkload(4, 16, 8, seed=4, vocab_size=1000).initial_items()
    assert [i.prompt for i in a] == [i.prompt for i in b]
    assert [i.prompt for i in a] != [i.prompt for i in c]
    assert len({tuple(i.prompt) for i in a}) == 4  # requests differ from each other


def test_workload_is_reusable():
    wl = BurstWorkload(2, 5, 1, seed=0, vocab_size=50)
    assert wl.initial_items() == wl.initial_items()


@pytest.mark.parametrize(
    ("make", "field", "value"),
    [
        (lambda: BurstWorkload(0, 4, 4), "concurrency", "0"),
        (lambda: BurstWorkload(-2, 4, 4), "concurrency", "-2"),
        (lambda: BurstWorkload(2, 0, 4), "prompt_len", "0"),
        (lambda: BurstWorkload(2, 4, 0), "max_tokens", "0"),
        (lambda: BurstWorkload(2.5, 4, 4), "concurrency", "2.5"),
        (lambda: BurstWorkload(2, 4, 4, vocab_size=10, token_low=10), "token_low", "10"),
        (lambda: BurstWorkload(2, 4, 4, vocab_size=10, token_low=5, token_high=5), "token_high", "5"),
        (lambda: PoissonWorkload(0, 4, 4, 4), "rate", "0"),
        (lambda: PoissonWorkload(-1.5, 4, 4, 4), "rate", "-1.5"),
        (lambda: PoissonWorkload(float("nan"), 4, 4, 4), "rate", "nan"),
        (lambda: PoissonWorkload(1.0, 0, 4, 4), "num_requests", "0"),
        (lambda: PoissonWorkload(1.0, 4, -1, 4), "prompt_len", "-1"),
        (lambda: SessionWorkload(0, 2, 4, 4, 4), "num_sessions", "0"),
        (lambda: SessionWorkload(1, 0, 4, 4, 4), "turns", "0"),
        (lambda: SessionWorkload(1, 2, 4, 0, 4), "turn_prompt_len", "0"),
        (lambda: SessionWorkload(1, 2, 4, 4, 4, think_time=-1.0), "think_time", "-1.0"),
    ],
)
def test_validation_names_field_and_value(make, field, value):
    with pytest.raises(WorkloadError) as exc:
        make()
    msg = str(exc.value)
    assert msg.startswith(f"{field} must be") and msg.endswith(f"got {value}")
    assert isinstance(exc.value, ValueError)


# Poisson ---------------------------------------------------------------------------------------------
def test_poisson_mean_interarrival_within_statistical_bound():
    rate, n = 4.0, 20_001
    items = PoissonWorkload(rate, n, prompt_len=1, max_tokens=1, seed=7).initial_items()
    arrivals = np.array([it.arrival for it in items])
    assert len(items) == n and arrivals[0] == 0.0
    gaps = np.diff(arrivals)
    assert (gaps >= 0).all()
    # Exponential gaps: std = mean = 1/rate, so the sample mean is within 5 standard errors w.h.p.
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(len(gaps))
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # coefficient of variation 1: exponential, not fixed


def test_poisson_deterministic_and_prompts_independent_of_rate():
    a = PoissonWorkload(2.0, 50, 8, 4, seed=11).initial_items()
    b = PoissonWorkload(2.0, 50, 8, 4, seed=11).initial_items()
    c = PoissonWorkload(9.0, 50, 8, 4, seed=11).initial_items()
    d = PoissonWorkload(2.0, 50, 8, 4, seed=12).initial_items()
    assert a == b
    assert [i.prompt for i in a] == [i.prompt for i in c]
    assert [i.arrival for i in a] != [i.arrival for i in c]
    assert [i.arrival for i in a] != [i.arrival for i in d]


# Sessions --------------------------------------------------------------------------------------------
def _fake_outputs(item: WorkItem) -> list[int]:
    return [1000 + item.turn * 10 + k for k in range(item.max_tokens)]


def test_session_turns_grow_and_share_exact_prefix():
    wl = SessionWorkload(
        num_sessions=2,
        turns=4,
        first_prompt_len=6,
        turn_prompt_len=3,
        max_tokens=2,
        seed=5,
        vocab_size=500,
        think_time=0.5,
    )
    first = wl.initial_items()
    summary = [(i.session_id, i.turn, i.arrival, len(i.prompt)) for i in first]
    assert summary == [(0, 0, 0.0, 6), (1, 0, 0.0, 6)]
    assert wl.total_requests() == 8
    item, now = first[1], 0.0
    for turn in range(1, 4):
        outputs = _fake_outputs(item)
        now += 1.25
        (nxt,) = wl.next_items(item, outputs, now)
        assert (nxt.session_id, nxt.turn, nxt.arrival, nxt.max_tokens) == (1, turn, now + 0.5, 2)
        assert nxt.prompt[: len(item.prompt)] == item.prompt  # the exact previous prompt ...
        assert nxt.prompt[len(item.prompt) : len(item.prompt) + 2] == outputs  # ... then its generation
        assert len(nxt.prompt) == len(item.prompt) + len(outputs) + 3
        assert len(nxt.prompt) <= wl.max_prompt_len()
        item = nxt
    assert len(item.prompt) == wl.max_prompt_len() == 6 + 3 * (2 + 3)
    assert wl.next_items(item, _fake_outputs(item), now) == []  # last turn releases nothing


def test_session_followups_do_not_depend_on_completion_order():
    def run(order: list[int]) -> dict[int, list[int]]:
        wl = SessionWorkload(3, 2, 4, 4, 2, seed=9, vocab_size=100)
        first = wl.initial_items()
        return {s: wl.next_items(first[s], [1, 2], 0.0)[0].prompt for s in order}

    assert run([0, 1, 2]) == run([2, 0, 1])
    prompts = run([0, 1, 2])
    assert prompts[0][-4:] != prompts[1][-4:]  # sessions get their own user tokens


def test_session_item_without_session_releases_nothing():
    wl = SessionWorkload(1, 3, 4, 4, 2)
    assert wl.next_items(WorkItem([1, 2], 2), [3], 1.0) == []


# JSONL -----------------------------------------------------------------------------------------------
class CharTokenizer:
    """One id per character; special tokens: a leading 1 (the workload asks for them, as vLLM does)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]


class EncodingTokenizer:
    """Like `tokenizers.Tokenizer`: encode returns an object with `.ids`."""

    class _Enc:
        def __init__(self, ids: list[int]):
            self.ids = ids

    def encode(self, text: str, add_special_tokens: bool = True) -> _Enc:
        return self._Enc([len(text)])


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "work.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_parses_text_ids_max_tokens_and_arrival(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "hi", "max_tokens": 5, "arrival": 1.5}),
            "",
            json.dumps({"prompt_token_ids": [3, 4, 5], "extra": "ignored"}),
            "   ",
            json.dumps({"prompt_token_ids": [9], "arrival": 2}),
        ],
    )
    wl = JsonlWorkload(path, CharTokenizer(), default_max_tokens=7)
    items = wl.initial_items()
    assert wl.total_requests() == 3
    assert [(i.prompt, i.max_tokens, i.arrival) for i in items] == [
        ([1, 104, 105], 5, 1.5),  # text: encoded with special tokens; ids: as given
        ([3, 4, 5], 7, 0.0),
        ([9], 7, 2.0),
    ]
    items[0].prompt.append(0)  # callers may mutate what they get; the workload stays intact
    assert wl.initial_items()[0].prompt == [1, 104, 105]


def test_jsonl_accepts_tokenizers_encoding(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "abcd"})])
    assert JsonlWorkload(path, EncodingTokenizer()).initial_items()[0].prompt == [4]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"prompt_token_ids": [1, 2]', "invalid JSON (Expecting ',' delimiter at column 28)"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"max_tokens": 3}', "needs exactly one of 'prompt' or 'prompt_token_ids'"),
        ('{"prompt": "a", "prompt_token_ids": [1]}', "needs exactly one of 'prompt' or 'prompt_token_ids'"),
        ('{"prompt_token_ids": [1, -2]}', "prompt_token_ids must be a list of non-negative integers"),
        ('{"prompt_token_ids": [1, true]}', "prompt_token_ids must be a list of non-negative integers"),
        ('{"prompt_token_ids": "12"}', "prompt_token_ids must be a list of non-negative integers"),
        ('{"prompt_token_ids": []}', "empty prompt"),
        ('{"prompt": 12}', "prompt must be a string, got int"),
        ('{"prompt_token_ids": [1], "max_tokens": 0}', "max_tokens must be an integer >= 1, got 0"),
        ('{"prompt_token_ids": [1], "max_tokens": 2.0}', "max_tokens must be an integer >= 1, got 2.0"),
        (
            '{"prompt_token_ids":[1],"arrival":-1}',
            "arrival must be a number of seconds in [0, 1e+07], got -1",
        ),
        # a finite but absurd arrival overflowed the driver's sleep (OverflowError)
        (
            '{"prompt_token_ids":[1],"arrival":1e308}',
            "arrival must be a number of seconds in [0, 1e+07], got 1e+308",
        ),
        (
            '{"prompt_token_ids":[1],"arrival":"0"}',
            "arrival must be a number of seconds in [0, 1e+07], got '0'",
        ),
    ],
)
def test_jsonl_errors_name_file_line_and_problem(tmp_path, bad_line, problem):
    path = _write(tmp_path, ['{"prompt_token_ids": [1]}', "", bad_line, '{"prompt_token_ids": [2]}'])
    with pytest.raises(WorkloadError) as exc:
        JsonlWorkload(path, CharTokenizer())
    assert str(exc.value) == f"{path}:3: {problem}"


def test_jsonl_token_outside_the_vocabulary_names_the_line(tmp_path):
    """An out-of-vocabulary id was submitted and "rejected" (exit 0) instead of FILE:LINE."""
    path = _write(tmp_path, ['{"prompt_token_ids": [1, 2]}', '{"prompt_token_ids": [3, 512]}'])
    with pytest.raises(WorkloadError) as exc:
        JsonlWorkload(path, vocab_size=512)
    assert str(exc.value) == f"{path}:2: token id 512 is outside the model's vocabulary (0..511)"
    assert len(JsonlWorkload(path).items) == 2  # without a vocabulary size, nothing is checked


def test_describe_is_plain_data(tmp_path):
    """Run headers carried `repr(workload)` (with a memory address); now a JSON dict."""
    wl = BurstWorkload(concurrency=2, prompt_len=3, max_tokens=4, seed=5, vocab_size=10)
    assert wl.describe() == {
        "kind": "burst",
        "concurrency": 2,
        "prompt_len": 3,
        "max_tokens": 4,
        "seed": 5,
        "vocab_size": 10,
        "token_low": 0,
        "token_high": None,
    }
    path = _write(tmp_path, ['{"prompt": "ab"}'])
    described = JsonlWorkload(path, CharTokenizer(), vocab_size=99).describe()
    assert described == {
        "kind": "jsonl",
        "path": str(path),
        "tokenizer": "CharTokenizer",
        "default_max_tokens": 128,
        "vocab_size": 99,
    }
    json.dumps(described)


def test_jsonl_text_prompt_without_tokenizer(tmp_path):
    path = _write(tmp_path, ['{"prompt": "hello"}'])
    with pytest.raises(WorkloadError, match=r":1: text 'prompt' needs a tokenizer"):
        JsonlWorkload(path)


def test_jsonl_tokenizer_failure_is_one_line(tmp_path):
    class Broken:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            raise RuntimeError("boom\nsecond line")

    path = _write(tmp_path, ['{"prompt": "hello"}'])
    with pytest.raises(WorkloadError) as exc:
        JsonlWorkload(path, Broken())
    assert str(exc.value) == f"{path}:1: tokenizer failed (RuntimeError: boom second line)"


def test_jsonl_invalid_utf8(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"prompt_token_ids": [1]}\n{"prompt": "\xff"}\n')
    with pytest.raises(WorkloadError, match=r"bin\.jsonl:2: not valid UTF-8$"):
        JsonlWorkload(path, CharTokenizer())


def test_jsonl_missing_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(WorkloadError) as exc:
        JsonlWorkload(missing)
    assert str(exc.value) == f"{missing}: no such file"
    empty = _write(tmp_path, ["", "  "])
    with pytest.raises(WorkloadError, match=r"work\.jsonl: no requests"):
        JsonlWorkload(empty)
    with pytest.raises(WorkloadError, match=r"^default_max_tokens must be an integer >= 1, got 0$"):
        JsonlWorkload(empty, default_max_tokens=0)
