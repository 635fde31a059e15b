"""Two served token streams for the same prompt, compared position by position, and the verdict on them.

Greedy streams: identical token ids are `identical`. Otherwise the first divergent position decides: each
arm's *margin* there is its own token's logprob minus the logprob it gives the other arm's token (looked
up by text in its top-k). When both margins are at most the noise margin, the arms stood at a near tie
that rounding can flip (`changed-within-noise`); otherwise, or when the other token is not in an arm's
top-k at all, the change is `changed-beyond-noise`.

Sampled streams (temperature > 0) come from two samplers, which need not draw alike even from the same
distribution: they are `same-distribution` when, at every position up to the first divergence (where both
arms had the same context), the logprobs of the tokens in both top-k lists agree within the noise margin.

The noise margin is a rule of thumb per dtype (NOISE_MARGIN, in nats), or the user's `--noise-margin`.
It is not a measurement: a reference judge (teacher-forced scoring by our engine) is the place to measure
it per model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from looptrace.analysis.endpoint_arm import Position, Served

IDENTICAL = "identical"
SAME_DISTRIBUTION = "same-distribution"
WITHIN_NOISE = "changed-within-noise"
BEYOND_NOISE = "changed-beyond-noise"
FAILED = "error"
VERDICT_ORDER = (IDENTICAL, SAME_DISTRIBUTION, WITHIN_NOISE, BEYOND_NOISE)  # better to worse

# What a claim (`--expect`) allows.
CLAIMS = {
    "identical": frozenset({IDENTICAL}),
    "noise": frozenset({IDENTICAL, SAME_DISTRIBUTION, WITHIN_NOISE}),
}

# Logprob margins (nats) within which a flip is put down to rounding. float32 keeps 24 significant bits,
# float16 11 and bfloat16 8: one rounding moves a logit of magnitude ~10 by ~1e-6, ~5e-3 and ~4e-2, and a
# model's dozens of layers add several such errors. Rules of thumb, deliberately generous for the 16-bit
# types; `--noise-margin` overrides them.
NOISE_MARGIN = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.1}


def noise_margin(dtype: str, override: float | None = None) -> float:
    if override is not None:
        return override
    if dtype not in NOISE_MARGIN:
        raise ValueError(
            f"dtype '{dtype}': expected one of {', '.join(NOISE_MARGIN)} (or give --noise-margin)"
        )
    return NOISE_MARGIN[dtype]


@dataclass
class StreamDiff:
    """One request, arm A against arm B."""

    id: str
    verdict: str
    tokens_a: int = 0
    tokens_b: int = 0
    first_divergence: int | None = None  # position of the first differing token (None: identical)
    token_a: int | None = None  # the two tokens there, their texts and logprobs
    token_b: int | None = None
    text_a: str | None = None
    text_b: str | None = None
    logprob_a: float | None = None
    logprob_b: float | None = None
    margin_a: float | None = None  # A's own logprob minus A's logprob of B's token (None: not in A's top-k)
    margin_b: float | None = None
    later_differ: int = 0  # positions after the first divergence whose tokens differ too
    logprobs_first_differ: int | None = None  # first position (same tokens so far) whose logprob differs
    max_logprob_delta: float = 0.0  # the largest |logprob A - logprob B| over that common prefix
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin(own: Position, other: Position) -> float | None:
    """own's logprob minus the logprob own's arm gives the other token; None when that token is not among
    own's top-k, or when the two tokens print alike (the top-k is keyed by text and cannot tell them)."""
    if own.logprob is None or own.text == other.text or other.text not in own.top:
        return None
    return own.logprob - own.top[other.text]


def compare(a: Served, b: Served, noise: float, *, greedy: bool = True) -> StreamDiff:
    """Arm A's and arm B's answers to one request, with the verdict (FAILED when either has an error)."""
    out = StreamDiff(a.id, FAILED, len(a.positions), len(b.positions))
    if a.error or b.error:
        out.error = "; ".join(f"{arm}: {s.error}" for arm, s in (("A", a), ("B", b)) if s.error)
        return out
    ids_a, ids_b = a.token_ids, b.token_ids
    fd = first_divergence(ids_a, ids_b)
    common = len(ids_a) if fd is None else fd
    _logprob_drift(out, a.positions[:common], b.positions[:common])
    if fd is None:
        out.verdict = IDENTICAL
        return out
    out.first_divergence = fd
    out.later_differ = sum(x != y for x, y in zip(ids_a[fd + 1 :], ids_b[fd + 1 :])) + abs(
        len(ids_a) - len(ids_b)
    )
    if fd >= min(len(ids_a), len(ids_b)):  # one stream stopped earlier: nothing to weigh at fd
        out.verdict = BEYOND_NOISE
        return out
    pa, pb = a.positions[fd], b.positions[fd]
    out.token_a, out.token_b, out.text_a, out.text_b = pa.token_id, pb.token_id, pa.text, pb.text
    out.logprob_a, out.logprob_b = pa.logprob, pb.logprob
    out.margin_a, out.margin_b = margin(pa, pb), margin(pb, pa)
    if greedy:
        near_tie = all(m is not None and m <= noise for m in (out.margin_a, out.margin_b))
        out.verdict = WITHIN_NOISE if near_tie else BEYOND_NOISE
    else:
        same = _same_distribution(a.positions[: fd + 1], b.positions[: fd + 1], noise)
        out.verdict = SAME_DISTRIBUTION if same else BEYOND_NOISE
    return out


def _logprob_drift(out: StreamDiff, pa: list[Position], pb: list[Position]) -> None:
    """Where the logprobs of the same tokens first differ, and by how much at most."""
    for i, (x, y) in enumerate(zip(pa, pb)):
        if x.logprob is None or y.logprob is None:
            continue
        delta = abs(x.logprob - y.logprob)
        if delta > 0 and out.logprobs_first_differ is None:
            out.logprobs_first_differ = i
        out.max_logprob_delta = max(out.max_logprob_delta, delta)


def _same_distribution(pa: list[Position], pb: list[Position], noise: float) -> bool:
    """Both arms' top-k logprobs agree within `noise` on every token listed by both, at every position."""
    for x, y in zip(pa, pb):
        shared = x.top.keys() & y.top.keys()
        if not shared or any(abs(x.top[t] - y.top[t]) > noise for t in shared):
            return False
    return True


# Many requests -------------------------------------------------------------------------------------------
def compare_all(a: list[Served], b: list[Served], noise: float, *, greedy: bool = True) -> list[StreamDiff]:
    return [compare(x, y, noise, greedy=greedy) for x, y in zip(a, b, strict=True)]


def counts(diffs: list[StreamDiff]) -> dict[str, int]:
    return {v: sum(d.verdict == v for d in diffs) for v in (*VERDICT_ORDER, FAILED)}


def overall(diffs: list[StreamDiff]) -> str:
    """The worst verdict among the compared requests (FAILED only when none could be compared)."""
    seen = [VERDICT_ORDER.index(d.verdict) for d in diffs if d.verdict != FAILED]
    return VERDICT_ORDER[max(seen)] if seen else FAILED


def violations(diffs: list[StreamDiff], expect: str | None) -> list[str]:
    """Requests that break the claim (`identical` or `noise`); a failed request cannot confirm it."""
    if expect is None:
        return []
    allowed = CLAIMS[expect]
    return [d.id for d in diffs if d.verdict not in allowed]
