"""Exact-match accuracy of an engine on a `{"prompt", "answer"}` JSONL set, measured through the engine
itself (greedy decoding, stop at EOS), and the evaluation-set reader shared by the CLI commands."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from looptrace.engine.request import SamplingParams
from looptrace.input_files import InputError, iter_jsonl


class EvalSetError(ValueError):
    """A prompts/eval file we cannot use; the message is one line naming file:line."""


@dataclass
class EvalItem:
    prompt: str
    answer: str | None


def read_items(path: Path, *, need_answer: bool = False) -> list[EvalItem]:
    """The items of a `{"prompt", "answer"}` JSONL file (a regular UTF-8 file, BOM and CRLF accepted)."""
    items = []
    try:
        for lineno, obj in iter_jsonl(path):
            items.append(_item(obj, f"{path}:{lineno}", need_answer))
    except InputError as exc:
        raise EvalSetError(str(exc)) from None
    if not items:
        raise EvalSetError(f"{path}: no prompts")
    return items


def _item(obj: object, where: str, need_answer: bool) -> EvalItem:
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise EvalSetError(f"{where}: needs a non-empty string field 'prompt'")
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise EvalSetError(f"{where}: field 'answer' must be a string")
    if need_answer and answer is None:
        raise EvalSetError(f"{where}: needs a string field 'answer'")
    return EvalItem(obj["prompt"], answer)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The trained models see BOS first (tokenizer.json adds none itself)."""
    ids = list(tokenizer.encode(text))
    return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else ids


def generate_texts(
    engine, tokenizer, prompts: list[str], max_tokens: int
) -> tuple[list[str], list[list[int]]]:
    """Greedy generation through the engine, stopping at EOS; returns decoded texts and token ids."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=False, seed=0)
    outs = engine.generate([encode_prompt(tokenizer, p) for p in prompts], params)
    return [tokenizer.decode(o, skip_special_tokens=True).strip() for o in outs], outs


def answer_budget(tokenizer, items: list[EvalItem]) -> int:
    """Tokens to generate: the longest reference answer + EOS."""
    return max(len(tokenizer.encode(it.answer or "")) for it in items) + 1


@dataclass
class Accuracy:
    correct: list[bool]

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def value(self) -> float:
        return sum(self.correct) / max(1, self.n)

    @property
    def stderr(self) -> float:
        p = self.value
        return math.sqrt(p * (1 - p) / max(1, self.n - 1)) if self.n > 1 else 0.0


def exact_match(engine, tokenizer, items: list[EvalItem]) -> tuple[Accuracy, list[str]]:
    texts, _ = generate_texts(engine, tokenizer, [it.prompt for it in items], answer_budget(tokenizer, items))
    return Accuracy([t == (it.answer or "").strip() for t, it in zip(texts, items)]), texts


def paired_difference(a: Accuracy, b: Accuracy) -> tuple[float, float]:
    """Accuracy difference b - a on the same items and its paired standard error."""
    diffs = [float(y) - float(x) for x, y in zip(a.correct, b.correct)]
    n = len(diffs)
    mean = sum(diffs) / max(1, n)
    if n < 2:
        return mean, 0.0
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var / n)
