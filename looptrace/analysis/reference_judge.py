"""The reference as judge of an endpoint diff (`looptrace diff A B --reference MODEL_OR_WEIGHTS`): our
engine scores each arm's served stream teacher-forced (`engine.scoring.score`: the prompt and the served
tokens in one prefill, float32 by default), so that at each divergence the report can say whose token the
reference ranks lower and by how much, and whether that is more than rounding can explain.

The noise is measured, not assumed: the same streams scored by the same model in bfloat16 and in the
reference dtype; per position |delta logprob| of the scored token (its maximum and 99th percentile), and
the reference's smallest top-1/top-2 margin at which bfloat16 picks another argmax. Two tokens' margin can
move by the error of both, so a divergence is a `near tie` when |margin| <= 2 x the largest |delta|, else
the arm whose token the reference ranks lower is blamed. Nothing is cached across runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looptrace.build import BuildInputError, BuildRequest, build, resolve_model
from looptrace.engine.budget import pool_geometry
from looptrace.engine.model_config import UnknownModelError
from looptrace.engine.request import EngineInputError
from looptrace.recipes import load_recipe

NEAR_TIE = "near tie"
NOISE_DTYPE = "bfloat16"  # what a served model commonly runs in; measured against the reference dtype


class ReferenceError(ValueError):
    """A --reference that names no model or weights (the CLI: one line, exit 2)."""


@dataclass(frozen=True)
class ReferenceSpec:
    model_or_weights: str
    dtype: str = "float32"
    device: str = "cpu"


@dataclass
class Reference:
    """The reference engine, its noise engine and what they are."""

    spec: ReferenceSpec
    engine: Any
    noise_engine: Any
    preset: str
    weights: str | None


def check_reference(spec: ReferenceSpec) -> tuple[Any, Path | None]:
    """The reference's resolved model and weights directory; a name that is neither a preset nor a
    checkpoint directory is a ReferenceError (before any engine or server starts)."""
    path = Path(spec.model_or_weights)
    weights = path if path.is_dir() else None
    if weights is None and ("/" in spec.model_or_weights or path.exists()):
        raise ReferenceError(f"--reference {spec.model_or_weights}: no such checkpoint directory")
    try:
        return resolve_model(None if weights else spec.model_or_weights, spec.device, weights), weights
    except (UnknownModelError, BuildInputError, OSError, ValueError) as exc:
        raise ReferenceError(f"--reference {spec.model_or_weights}: {exc}") from None


def open_reference(spec: ReferenceSpec, longest: int | None = None) -> Reference:
    """Both engines (base recipe) for a preset name or a checkpoint directory. `longest`: the most
    positions a scored stream holds (prompt + served tokens). Its KV pool is sized to one such stream
    rather than to the free memory, because the reference often shares its GPU with the server it judges,
    which has taken most of it (a pool sized on what was left held 16 positions)."""
    resolved, weights = check_reference(spec)
    sets = _one_stream_pool(resolved.spec, longest) if longest is not None else ()
    try:

        def reference_engine(dtype: str):
            request = BuildRequest(
                weights=weights,
                device=spec.device,
                dtype=dtype,
                seed=0,
                threads=1,
                sets=sets,
                max_model_len=longest,
            )
            return build(request, resolved).engine

        engine, noise_engine = reference_engine(spec.dtype), reference_engine(NOISE_DTYPE)
    except (UnknownModelError, BuildInputError, OSError, ValueError) as exc:
        raise ReferenceError(f"--reference {spec.model_or_weights}: {exc}") from None
    shown = str(resolved.weights) if resolved.weights is not None else None
    return Reference(spec, engine, noise_engine, engine.spec.name, shown)


def _one_stream_pool(model_spec: Any, longest: int) -> tuple[str, ...]:
    """`kv.num_blocks` for one request of `longest` positions in the base recipe's layout."""
    cfg = load_recipe("base").config
    geometry = pool_geometry(model_spec, cfg, elt=4)  # the block count does not depend on the dtype
    return (f"kv.num_blocks={geometry.blocks_for_tokens(longest) + cfg.kv.watermark_blocks}",)


def _score(engine, prompt: list[int], tokens: list[int]) -> list:
    # deferred: torch, only when a reference scores
    from looptrace.engine.scoring import score

    try:
        return score(engine, prompt, tokens, top_k=2) if tokens else []
    except EngineInputError as exc:  # e.g. a served token outside the reference's vocabulary
        raise ReferenceError(f"the reference cannot score a served stream ({exc})") from None


def measure_noise(ref: Reference, streams: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """bfloat16 against the reference dtype on the same (prompt, tokens) streams."""
    deltas, flips, margins = [], [], []
    for prompt, tokens in streams:
        for hi, lo in zip(_score(ref.engine, prompt, tokens), _score(ref.noise_engine, prompt, tokens)):
            deltas.append(abs(hi.logprob - lo.logprob))
            top2 = hi.top_logprobs[0][1] - hi.top_logprobs[1][1] if len(hi.top_logprobs) > 1 else math.inf
            margins.append(top2)
            if hi.argmax_id != lo.argmax_id:
                flips.append(top2)
    worst = max(deltas, default=0.0)
    return {
        "method": f"the same streams scored teacher-forced in {NOISE_DTYPE} and in {ref.spec.dtype} "
        f"({ref.spec.device}); near tie: |margin| <= 2 x the largest |delta logprob|",
        "dtype": NOISE_DTYPE,
        "positions": len(deltas),
        "max_abs_dlogprob": worst,
        "q99_abs_dlogprob": _quantile(deltas, 0.99),
        "argmax_flips": len(flips),
        "min_flip_margin": min(flips) if flips else None,  # reference top-1/top-2 margin of a flip
        "min_top2_margin": min(margins, default=None),
        "margin": 2 * worst,
    }


def agreement(ref: Reference, prompts: dict[str, list[int]], served: list) -> dict[str, Any]:
    """One arm's served streams against the reference, position by position: how often the served token
    is the reference's argmax, and how far the served logprobs are from the reference's."""
    positions = equal = 0
    deltas: list[float] = []
    for s in served:
        if s.error:
            continue
        for pos, scored in zip(s.positions, _score(ref.engine, prompts[s.id], s.token_ids)):
            positions += 1
            equal += scored.argmax_id == pos.token_id
            if pos.logprob is not None:
                deltas.append(abs(pos.logprob - scored.logprob))
    return {
        "positions": positions,
        "argmax_agree": equal,
        "fraction": equal / positions if positions else None,
        "max_abs_dlogprob": max(deltas, default=None),
        "q99_abs_dlogprob": _quantile(deltas, 0.99) if deltas else None,
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def judge_divergence(ref: Reference, prompt: list[int], a: list[int], b: list[int], fd: int, noise: float):
    """At the first divergence `fd` (same context on both arms): the reference's view of both tokens."""
    sa, sb = _score(ref.engine, prompt, a[: fd + 1]), _score(ref.engine, prompt, b[: fd + 1])
    pa, pb = sa[fd], sb[fd]
    margin = pa.logprob - pb.logprob
    return {
        "ref_logprob_a": pa.logprob,
        "ref_logprob_b": pb.logprob,
        "ref_argmax": pa.argmax_id,
        "ref_argmax_logprob": pa.argmax_logprob,
        "ref_margin": margin,  # reference logprob of A's token minus B's
        "blame": blame(margin, noise),
    }


def blame(margin: float, noise: float) -> str:
    """`margin`: the reference's logprob of A's token minus B's. Within the noise nobody is to blame;
    else the arm whose token the reference ranks lower."""
    return NEAR_TIE if abs(margin) <= noise else ("arm A" if margin < 0 else "arm B")


def judge_all(ref: Reference, prompts: dict[str, list[int]], served: dict[str, list], diffs: list) -> dict:
    """Per request the judge's fields (None where the streams agree or failed), and the noise."""
    pairs = [(d, a, b) for d, a, b in zip(diffs, served["A"], served["B"]) if not (a.error or b.error)]
    noise = measure_noise(ref, [(prompts[d.id], a.token_ids) for d, a, _ in pairs])
    verdicts: dict[str, Any] = {}
    for d, a, b in pairs:
        fd = d.first_divergence
        if fd is None or fd >= min(len(a.token_ids), len(b.token_ids)):
            verdicts[d.id] = None
            continue
        verdicts[d.id] = judge_divergence(ref, prompts[d.id], a.token_ids, b.token_ids, fd, noise["margin"])
    blames = [v["blame"] for v in verdicts.values() if v]
    return {
        "reference": {
            "model_or_weights": ref.spec.model_or_weights,
            "preset": ref.preset,
            "weights": ref.weights,
            "dtype": ref.spec.dtype,
            "device": ref.spec.device,
            "noise": noise,
            "blame_counts": {k: blames.count(k) for k in ("arm A", "arm B", NEAR_TIE)},
            "agreement": {arm.lower(): agreement(ref, prompts, served[arm]) for arm in ("A", "B")},
        },
        "per_request": verdicts,
    }
