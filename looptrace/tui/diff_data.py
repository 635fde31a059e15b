"""The diff screen's input: two token streams per request (arms A and B) and where they first diverge.

Format (what `looptrace diff` writes, or any dict of the same shape):

    {"requests": [{"id": "r0", "a_tokens": [1, 2, 3], "b_tokens": [1, 2, 4], "first_divergence": 2}, ...]}

`first_divergence` is the index of the first differing position (a length difference counts at the shorter
length), or null when the streams are identical; when the key is missing it is computed. Optional
`a_text` / `b_text` hold one decoded piece per token; without them the pieces are decoded with the
tokenizer of the run's weights (`header.weights` of a `looptrace diff` result; byte-level tokens for
random weights, as the engine reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looptrace.engine.tokenizer import TokenizerError, load_tokenizer
from looptrace.input_files import InputError, read_json


class DiffDataError(ValueError):
    pass


@dataclass
class DiffRequest:
    id: str
    a_tokens: list[int]
    b_tokens: list[int]
    first_divergence: int | None
    a_text: list[str] | None = None  # optional decoded pieces, one per token
    b_text: list[str] | None = None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tokens(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise DiffDataError(f"{where}: expected a list of token ids")
    return list(value)


def parse_diff(data: Any, source: str = "diff data") -> list[DiffRequest]:
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise DiffDataError(f'{source}: expected {{"requests": [...]}}')
    out = []
    for i, r in enumerate(data["requests"]):
        where = f"{source}: requests[{i}]"
        if not isinstance(r, dict):
            raise DiffDataError(f"{where}: expected an object")
        a, b = (
            _tokens(r.get("a_tokens"), f"{where}.a_tokens"),
            _tokens(r.get("b_tokens"), f"{where}.b_tokens"),
        )
        if "first_divergence" in r:
            fd = r["first_divergence"]
            if fd is not None and (not isinstance(fd, int) or isinstance(fd, bool) or fd < 0):
                raise DiffDataError(f"{where}.first_divergence: expected a non-negative integer or null")
        else:
            fd = first_divergence(a, b)
        texts = [r.get(k) if isinstance(r.get(k), list) else None for k in ("a_text", "b_text")]
        out.append(DiffRequest(str(r.get("id", i)), a, b, fd, *texts))
    _decode_pieces(out, data.get("header"))
    return out


def _decode_pieces(requests: list[DiffRequest], header: Any) -> None:
    """Fill in each token's text where the result has none, so the diff screen shows words, not ids."""
    if not isinstance(header, dict):
        return  # not a `looptrace diff` result: which model's ids these are is unknown
    weights = header.get("weights")
    directory = Path(weights) if isinstance(weights, str) and Path(weights).is_dir() else None
    try:
        tokenizer = load_tokenizer(directory)
    except (TokenizerError, OSError):
        return  # ids it is: the screen still works
    vocab = tokenizer.vocab_size

    def pieces(tokens: list[int]) -> list[str] | None:
        if any(t >= vocab for t in tokens):  # another model's ids: no text rather than a wrong one
            return None
        return [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]

    for r in requests:
        r.a_text = r.a_text if r.a_text is not None else pieces(r.a_tokens)
        r.b_text = r.b_text if r.b_text is not None else pieces(r.b_tokens)


def load_diff(source: str | Path | dict) -> list[DiffRequest]:
    """A diff result file (JSON) or an already-loaded dict -> requests. DiffDataError on bad input."""
    if isinstance(source, dict):
        return parse_diff(source)
    path = Path(source)
    try:  # looptrace.input_files: a regular file, within the nesting/number limits
        data = read_json(path)
    except InputError as exc:
        raise DiffDataError(str(exc).replace("invalid JSON", "not a JSON file")) from None
    return parse_diff(data, str(path))
