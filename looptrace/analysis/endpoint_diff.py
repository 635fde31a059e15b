"""`looptrace diff` where an arm is an endpoint: the same prompts to both arms (a recipe arm is served
in-process, `endpoint_arm.served_recipe`), every stream compared (`stream_diff`), the claim of `--expect`
checked, and the report data returned: `execute(request, progress)`. No CLI here: input errors are
`EndpointDiffInputError` or `EndpointError` (the CLI: one line, exit 2)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looptrace.analysis import endpoint_arm as ea
from looptrace.analysis import reference_judge as rj
from looptrace.analysis import stream_diff as sd
from looptrace.engine.budget import check_memory, workload_needs
from looptrace.train.evaluate import Accuracy, EvalSetError, paired_difference, read_items

SCHEMA = "looptrace.diff-endpoints/1"
RANDOM_PROMPT_VOCAB = 256  # ids below 256 exist in every tokenizer we know; a recipe arm gives the real one
DEFAULT_SERVED_DTYPE = "bfloat16"  # what vLLM serves Ouro in; servers do not report their dtype
ONE_POINT = -1.0  # the one-point rule: B may lose at most one point of accuracy against A
Progress = Callable[[str, int, int], None]  # (what, done, total)


class EndpointDiffInputError(ValueError):
    """An endpoint diff that cannot run as asked (the CLI: one line, exit code 2)."""


@dataclass(frozen=True)
class EndpointDiffRequest:
    """What `looptrace diff` was asked when an arm is a URL."""

    arm_a: str
    arm_b: str | None = None  # None: arm A again (is the server repeatable?)
    served_model: str | None = None
    a_sets: list[str] | None = field(default_factory=list)  # for a recipe arm
    b_sets: list[str] | None = field(default_factory=list)
    model: str | None = None  # a recipe arm's model
    concurrency: int = 4
    num_requests: int | None = None
    prompt_len: int = 16
    max_tokens: int = 8
    prompts: Path | None = None
    accuracy: Path | None = None
    temperature: float = 0.0
    seed: int = 0
    top_logprobs: int = 5
    timeout: float = ea.DEFAULT_TIMEOUT_S
    retries: int = 1
    batch_probe: bool = False
    expect: str | None = None  # "identical" | "noise"
    noise_margin: float | None = None
    served_dtype: str | None = None  # None: a recipe arm's dtype, else bfloat16
    device: str = "auto"
    dtype: str = "auto"
    weights: Path | None = None
    threads: int = 1
    api_key: str | None = None  # sent to URL arms as a bearer token (never printed)
    reference: str | None = None  # a preset or checkpoint directory: our engine judges each divergence
    reference_dtype: str = "float32"
    reference_device: str = "cpu"


@dataclass
class Arm:
    name: str  # "A" or "B"
    endpoint: ea.Endpoint
    facts: dict[str, Any]  # a recipe arm's preset, device, dtype; empty for a URL


# Checks --------------------------------------------------------------------------------------------------
def check(req: EndpointDiffRequest) -> None:
    """The numbers and names, before any server is contacted or started."""
    sizes = [("-c", req.concurrency), ("--prompt-len", req.prompt_len), ("--max-tokens", req.max_tokens)]
    sizes += [("--num-requests", req.num_requests), ("--threads", req.threads)]
    for name, value in sizes:
        if value is not None and value < 1:
            raise EndpointDiffInputError(f"{name} must be >= 1, got {value}")
    if not 0 <= req.top_logprobs <= 20:
        raise EndpointDiffInputError(f"--top-logprobs must be in 0..20, got {req.top_logprobs}")
    if not 0.0 <= req.temperature <= 2.0:
        raise EndpointDiffInputError(f"--temperature must be in [0, 2], got {req.temperature}")
    if not req.timeout > 0 or req.retries < 0:  # `not >`: a NaN timeout is refused too
        raise EndpointDiffInputError("--timeout must be > 0 and --retries >= 0")
    if req.prompts is None:  # the random prompts are drawn at once: they must fit in host memory
        n = req.num_requests if req.num_requests is not None else req.concurrency
        check_memory(workload_needs(n, req.prompt_len, "--num-requests / --prompt-len"), "cpu")
    if req.expect is not None and req.expect not in sd.CLAIMS:
        raise EndpointDiffInputError(f"--expect {req.expect}: expected one of {', '.join(sd.CLAIMS)}")
    if not 0 <= req.seed < 2**64:
        raise EndpointDiffInputError(f"--seed must be in [0, 2**64), got {req.seed}")
    if req.reference_dtype not in sd.NOISE_MARGIN or req.reference_device not in ("cpu", "cuda"):
        raise EndpointDiffInputError(
            f"--reference-dtype {req.reference_dtype} / --reference-device {req.reference_device}: "
            f"expected one of {', '.join(sd.NOISE_MARGIN)} / cpu or cuda"
        )
    if req.noise_margin is not None and not req.noise_margin >= 0:
        raise EndpointDiffInputError(f"--noise-margin must be >= 0 nats, got {req.noise_margin}")
    if req.served_dtype is not None and req.served_dtype not in sd.NOISE_MARGIN:
        raise EndpointDiffInputError(
            f"--served-dtype {req.served_dtype}: expected one of {', '.join(sd.NOISE_MARGIN)}"
        )
    for arm, sets, flag in ((req.arm_a, req.a_sets, "--a-set"), (req.arm_b, req.b_sets, "--b-set")):
        if ea.is_endpoint(arm) and sets:
            raise EndpointDiffInputError(f"{flag} changes a recipe; arm {arm} is an endpoint")


# Run -----------------------------------------------------------------------------------------------------
def execute(req: EndpointDiffRequest, progress: Progress) -> tuple[dict[str, Any], bool]:
    """Both arms on the same prompts; (report data, the claim holds)."""
    check(req)
    t0 = time.perf_counter()
    ref_spec = _reference_spec(req)  # before any server: a bad --reference is one line, at once
    with ExitStack() as stack:
        arm_a = _open_arm(stack, "A", req.arm_a, req.a_sets, req)
        arm_b = _open_arm(stack, "B", req.arm_b or req.arm_a, req.b_sets, req)
        items = _items(req, arm_a)
        ref = _open_reference(ref_spec, max(len(it.prompt) + it.max_tokens for it in items))
        noise_info = _noise((arm_a, arm_b), req)
        noise = noise_info["margin"]
        sampling = ea.Sampling(req.max_tokens, req.temperature, _sampling_seed(req), req.top_logprobs)
        served = {}
        for i, arm in enumerate((arm_a, arm_b)):
            progress(f"arm {arm.name}", i, 2)
            served[arm.name] = _run(arm, items, sampling, req, req.concurrency)
        diffs = sd.compare_all(served["A"], served["B"], noise, greedy=sampling.greedy)
        probe = _batch_probe((arm_a, arm_b), items, sampling, req, noise) if req.batch_probe else None
        acc = _accuracy((arm_a, arm_b), req) if req.accuracy is not None else None
    viol = sd.violations(diffs, req.expect)
    acc_ok = acc is None or acc["holds"]
    ok = not viol and acc_ok
    data = _report(req, (arm_a, arm_b), items, diffs, probe, acc, noise_info, time.perf_counter() - t0)
    if ref is not None:
        _add_judge(data, ref, items, served, diffs)
    data["verdict"] = {
        "ok": ok,
        "expect": req.expect,
        "overall": sd.overall(diffs),
        "violations": viol,
        "failed": [d.id for d in diffs if d.verdict == sd.FAILED],
        "accuracy_holds": None if acc is None else acc["holds"],
    }
    return data, ok


def _reference_spec(req: EndpointDiffRequest) -> rj.ReferenceSpec | None:
    if req.reference is None:
        return None
    spec = rj.ReferenceSpec(req.reference, req.reference_dtype, req.reference_device)
    try:
        rj.check_reference(spec)
    except rj.ReferenceError as exc:
        raise EndpointDiffInputError(str(exc)) from None
    return spec


def _open_reference(spec: rj.ReferenceSpec | None, longest: int):
    """The reference's engines, their pools sized to the longest stream they will score."""
    if spec is None:
        return None
    try:
        return rj.open_reference(spec, longest)
    except rj.ReferenceError as exc:
        raise EndpointDiffInputError(str(exc)) from None


def _add_judge(data: dict[str, Any], ref, items, served, diffs) -> None:
    """The reference's scores of both arms' streams: its noise figure and, per divergence, its blame."""
    try:
        judged = rj.judge_all(ref, {it.id: it.prompt for it in items}, served, diffs)
    except rj.ReferenceError as exc:
        raise EndpointDiffInputError(str(exc)) from None
    data["reference"] = judged["reference"]
    for row in data["requests"]:
        row["judge"] = judged["per_request"].get(row["id"])


def _noise(arms, req: EndpointDiffRequest) -> dict[str, Any]:
    """The near-tie margin: `--noise-margin`, else the widest of the arms' dtypes (a recipe arm knows its
    own; a URL arm runs --served-dtype, default bfloat16: servers do not report it)."""
    dtypes = {
        arm.name.lower(): arm.facts.get("dtype") or req.served_dtype or DEFAULT_SERVED_DTYPE for arm in arms
    }
    widest = max(dtypes.values(), key=lambda dt: sd.NOISE_MARGIN.get(dt, 0.0))
    if req.noise_margin is not None:
        return {"dtypes": dtypes, "dtype": widest, "margin": req.noise_margin, "source": "--noise-margin"}
    return {"dtypes": dtypes, "dtype": widest, "margin": sd.noise_margin(widest), "source": "dtype"}


def _sampling_seed(req: EndpointDiffRequest) -> int | None:
    return None if req.temperature == 0 else req.seed


def _open_arm(stack: ExitStack, name: str, arm: str, sets, req: EndpointDiffRequest) -> Arm:
    if ea.is_endpoint(arm):
        endpoint = ea.discover(arm, req.served_model, timeout=min(req.timeout, 10.0), api_key=req.api_key)
        return Arm(name, endpoint, {})
    served = ea.served_recipe(
        arm,
        sets,
        model=req.model,
        device=req.device,
        dtype=req.dtype,
        weights=req.weights,
        seed=req.seed,
        threads=req.threads,
        max_model_len=2048,  # as `looptrace serve` (capped by the model)
    )
    endpoint, facts = stack.enter_context(served)
    return Arm(name, endpoint, facts)


def _run(arm: Arm, items, sampling, req: EndpointDiffRequest, concurrency: int) -> list[ea.Served]:
    return ea.run_arm(
        arm.endpoint,
        items,
        sampling,
        concurrency=concurrency,
        timeout=req.timeout,
        retries=req.retries,
        api_key=_key(arm, req),
    )


def _key(arm: Arm, req: EndpointDiffRequest) -> str | None:
    """The API key for a URL arm; a recipe arm is our own in-process server, which needs none."""
    return None if arm.facts else req.api_key


def _items(req: EndpointDiffRequest, arm_a: Arm) -> list[ea.PromptItem]:
    """The prompts, as token ids: random ones, or the --prompts file (text tokenized by arm A)."""
    # deferred: numpy, only for workloads
    from looptrace.drive import workloads as w

    if req.prompts is not None:

        class ArmTokenizer:  # the JSONL reader's tokenizer: arm A's /tokenize
            def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
                special = add_special_tokens
                return ea.tokenize(arm_a.endpoint, text, add_special_tokens=special, api_key=_key(arm_a, req))

        try:
            raw = w.JsonlWorkload(
                path=req.prompts, tokenizer=ArmTokenizer(), default_max_tokens=req.max_tokens
            )
        except w.WorkloadError as exc:
            raise EndpointDiffInputError(f"--prompts {exc}") from None
        raw_items = raw.initial_items()
    else:
        n = req.num_requests if req.num_requests is not None else req.concurrency
        vocab = arm_a.facts.get("vocab_size", RANDOM_PROMPT_VOCAB)
        raw_items = w.BurstWorkload(
            concurrency=n,
            prompt_len=req.prompt_len,
            max_tokens=req.max_tokens,
            seed=req.seed,
            vocab_size=vocab,
        ).initial_items()
    return [ea.PromptItem(f"r{i}", list(it.prompt), it.max_tokens) for i, it in enumerate(raw_items)]


def _batch_probe(arms, items, sampling, req, noise: float) -> dict[str, Any]:
    """Each arm alone: every prompt sent by itself, then all at once; what the crowd changes."""
    out = {}
    for arm in arms:
        solo = _run(arm, items, sampling, req, 1)
        crowd = _run(arm, items, sampling, req, len(items))
        diffs = sd.compare_all(solo, crowd, noise, greedy=sampling.greedy)
        out[arm.name] = {
            "crowd": len(items),
            "counts": sd.counts(diffs),
            "overall": sd.overall(diffs),
            "requests": [d.to_dict() for d in diffs],
        }
    return out


def _accuracy(arms, req: EndpointDiffRequest) -> dict[str, Any]:
    """Exact match per arm on the --accuracy set (greedy, stop at EOS), and the one-point rule on B - A."""
    try:
        evals = read_items(Path(req.accuracy), need_answer=True)
    except EvalSetError as exc:
        raise EndpointDiffInputError(f"--accuracy {exc}") from None
    ep_a, key = arms[0].endpoint, _key(arms[0], req)
    budget = max(len(ea.tokenize(ep_a, it.answer or "", api_key=key)) for it in evals) + 1
    prompts = [ea.tokenize(ep_a, it.prompt, api_key=key) for it in evals]
    items = [ea.PromptItem(f"q{i}", ids, budget) for i, ids in enumerate(prompts)]
    sampling = ea.Sampling(budget, 0.0, None, 0, ignore_eos=False)
    result: dict[str, Any] = {"file": str(req.accuracy), "n": len(evals), "failed": {}}
    correct = {}
    for arm in arms:
        served = _run(arm, items, sampling, req, req.concurrency)
        correct[arm.name] = Accuracy(
            [s.error is None and s.text.strip() == (it.answer or "").strip() for s, it in zip(served, evals)]
        )
        result["failed"][arm.name] = [s.id for s in served if s.error]
        result[f"{arm.name.lower()}_accuracy"] = correct[arm.name].value
    mean, se = paired_difference(correct["A"], correct["B"])
    result["diff_points"], result["se_points"] = 100 * mean, 100 * se
    result["holds"] = 100 * mean >= ONE_POINT and not any(result["failed"].values())
    return result


# Report --------------------------------------------------------------------------------------------------
def _report(req, arms, items, diffs, probe, acc, noise, elapsed: float) -> dict[str, Any]:
    src = (
        str(req.prompts) if req.prompts else f"random prompts of {req.prompt_len} token ids, seed {req.seed}"
    )
    how = "greedy" if req.temperature == 0 else f"temperature {req.temperature:g}, seed {req.seed}"
    return {
        "schema": SCHEMA,
        "header": {
            "tool": "looptrace",
            "command": "diff",
            "arms": {
                arm.name.lower(): {
                    "label": arm.endpoint.label,
                    "url": arm.endpoint.url,
                    "model": arm.endpoint.model,
                    **arm.facts,
                }
                for arm in arms
            },
            "workload": f"{len(items)} requests ({src}), {req.max_tokens} output tokens, "
            f"window {req.concurrency}, {how}, top {req.top_logprobs} logprobs",
            "noise": noise,
            "expect": req.expect,
        },
        "summary": {"requests": len(diffs), **sd.counts(diffs), "elapsed_s": round(elapsed, 3)},
        "requests": [d.to_dict() for d in diffs],
        "batch_probe": probe,
        "accuracy": acc,
    }
