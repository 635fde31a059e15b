"""One `looptrace diff`, start to end: load both recipes, check them, build the engines (one at a time, on
copies of the same weights), run the graded comparison, then bisect, localize and the accuracy check as
asked, and return the report data: `execute(prepare(request), request, progress)`. No CLI here: input
errors are `DiffInputError` (the CLI: exit 2)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looptrace import assets
from looptrace.analysis import diff as d
from looptrace.analysis.bisect import bisect
from looptrace.analysis.localize import localize
from looptrace.build import (
    POOL_CAP_TOKENS,
    BuildRequest,
    check_seed,
    device_name,
    engine_factory,
    fit_max_model_len,
    load,
    place,
    versions,
)
from looptrace.drive import workloads as w
from looptrace.engine.budget import PoolNeed, check_memory, workload_needs
from looptrace.engine.config import config_to_dict
from looptrace.engine.perturb import PerturbSpecError, parse_place
from looptrace.engine.tokenizer import load_tokenizer
from looptrace.recipes import RecipeError, load_recipe
from looptrace.train.evaluate import EvalSetError, read_items

SCHEMA = "looptrace.diff/1"
Progress = Callable[[str, int, int], None]  # (what, done, total)


class DiffInputError(ValueError):
    """A diff that cannot run as asked (the CLI: one line, exit code 2)."""


@dataclass(frozen=True)
class DiffRequest:
    """What `looptrace diff` was asked (the CLI's options)."""

    recipe_a: str = "base"
    recipe_b: str | None = None  # None: recipe A
    model: str | None = None
    a_sets: list[str] | None = field(default_factory=list)
    b_sets: list[str] | None = field(default_factory=list)
    concurrency: int = 4  # requests outstanding at once (the batch window)
    prompt_len: int = 16
    max_tokens: int = 8
    num_requests: int | None = None  # None: `concurrency`
    prompts: Path | None = None  # JSONL prompts instead of random ones
    accuracy: Path | None = None  # exact-match set (None: the built-in one, when it applies)
    bisect: bool = False
    localize: str | None = None  # request id to replay with per-op capture
    strict: bool = False  # R0/R1 also need bitwise-identical logits
    device: str = "auto"
    dtype: str = "auto"
    weights: Path | None = None
    seed: int = 0
    threads: int = 1

    def build_request(self) -> BuildRequest:
        """What both arms' engines share: the model, its weights and where they run (recipes and
        overrides differ per arm and go into the configs the factory builds)."""
        return BuildRequest(
            model=self.model,
            weights=self.weights,
            device=self.device,
            dtype=self.dtype,
            seed=self.seed,
            threads=self.threads,
        )


@dataclass
class DiffSetup:
    """Everything checked and built before the first graded run."""

    rec_a: Any  # Recipe
    rec_b: Any
    cfg_a: Any  # the recipes' configs with the decode tables sized to the workload
    cfg_b: Any
    toggles: list  # d.Toggle: the settings that differ, graded on this device
    spec: Any
    device: Any
    dtype: Any
    factory: Callable  # EngineConfig -> a fresh engine on a copy of `net`
    net: Any
    items: list  # d.DiffItem
    inactive: dict[str, str]  # settings without effect on this device: graded "untested"
    accuracy: dict[str, Any] | None
    weights: Path | None
    workload: str


# Preparation ---------------------------------------------------------------------------------------------
def prepare(req: DiffRequest) -> DiffSetup:
    """Validate the request and build what the runs need; every input error before any graded run."""
    check_seed(req.seed)
    _check_sizes(req)
    rec_a = _load(req.recipe_a, req.a_sets, "--a-set")
    rec_b = _load(req.recipe_b or req.recipe_a, req.b_sets, "--b-set")
    build = req.build_request()
    placement = place(build)
    dev, dt = placement.device, placement.dtype
    toggles = _toggles(rec_a, rec_b, dev.type)
    _check_perturb(rec_a.config, rec_b.config)
    model, spec, net = load(build, placement)
    items = _items(req, model.weights, spec)
    acc = _accuracy_plan(req.accuracy, toggles, spec, model.weights)
    if req.localize is not None:
        find_item(items, req.localize)
    longest = max(len(i.prompt) + i.max_tokens for i in items)
    cfg_a, cfg_b = _sized(rec_a.config, longest), _sized(rec_b.config, longest)
    need = PoolNeed(min(req.concurrency, len(items)), longest)
    factory = engine_factory(net, dev, dt, req.seed, need, cap_tokens=POOL_CAP_TOKENS)
    checked, inactive = _preflight_arms(factory, (("A", cfg_a, rec_a), ("B", cfg_b, rec_b)))
    toggles = d.differing_toggles(rec_a.config, rec_b.config, dev.type, checked)
    _check_fits(items, spec)
    workload = _workload_text(items, req.prompts, req.concurrency, req.seed)
    return DiffSetup(
        rec_a=rec_a,
        rec_b=rec_b,
        cfg_a=cfg_a,
        cfg_b=cfg_b,
        toggles=toggles,
        spec=spec,
        device=dev,
        dtype=dt,
        factory=factory,
        net=net,
        items=items,
        inactive=inactive,
        accuracy=acc,
        weights=model.weights,
        workload=workload,
    )


def _toggles(rec_a, rec_b, device_type: str) -> list:
    toggles = d.differing_toggles(rec_a.config, rec_b.config, device_type)
    if not toggles:
        raise DiffInputError(
            f"recipes A ({arm_text(rec_a)}) and B ({arm_text(rec_b)}) differ in no setting: nothing to "
            "compare (change B with --b-set section.key=value)"
        )
    return toggles


def _sized(config, longest: int):
    """A copy of `config` with the decode tables sized to the workload, the same way in both arms."""
    config = copy.deepcopy(config)
    fit_max_model_len(config, longest)
    return config


def _check_sizes(req: DiffRequest) -> None:
    sizes = (("-c", req.concurrency), ("--prompt-len", req.prompt_len), ("--max-tokens", req.max_tokens))
    for name, value in sizes:
        if value < 1:
            raise DiffInputError(f"{name} must be >= 1, got {value}")
    if req.num_requests is not None and req.num_requests < 1:
        raise DiffInputError(f"--num-requests must be >= 1, got {req.num_requests}")
    if req.threads < 1:
        raise DiffInputError(f"--threads must be >= 1, got {req.threads}")
    if req.prompts is None:  # the random prompts are drawn at once: they must fit in host memory
        n = req.num_requests if req.num_requests is not None else req.concurrency
        check_memory(workload_needs(n, req.prompt_len, "--num-requests / --prompt-len"), "cpu")


def _check_fits(items, spec) -> None:
    for it in items:
        if len(it.prompt) + it.max_tokens - 1 > spec.max_position:
            raise DiffInputError(
                f"request {it.id}: prompt {len(it.prompt)} + max_tokens {it.max_tokens} exceeds the model"
            )


def _load(recipe: str, sets: list[str], flag: str):
    """The recipe with its overrides; an override error names the arm's option (--a-set, --b-set)."""
    try:
        return load_recipe(recipe, list(sets or []))
    except RecipeError as exc:
        msg = str(exc)
        raise RecipeError(flag + msg[len("--set") :] if msg.startswith("--set") else msg) from None


def arm_text(rec) -> str:
    return rec.name + (" + " + ", ".join(rec.overrides) if rec.overrides else "")


def _check_perturb(*cfgs) -> None:
    for cfg in cfgs:
        if cfg.debug.perturb:
            try:
                parse_place(cfg.debug.perturb)
            except PerturbSpecError as exc:
                raise DiffInputError(str(exc)) from None


def _preflight_arms(factory, arms) -> tuple[dict[str, str], dict[str, str]]:
    """Build each arm once so that a setting the engine does not implement yet fails before any run;
    returns the rungs the engines' startup checks decided on this device (`engine.checked_rungs`) and
    the settings that have no effect on it (`engine.inactive_settings`)."""

    def facts(engine) -> tuple[dict[str, str], dict[str, str]]:
        return dict(engine.checked_rungs), dict(engine.inactive_settings)

    checked: dict[str, str] = {}
    inactive: dict[str, str] = {}
    for arm, cfg, rec in arms:
        try:
            arm_checked, arm_inactive = d.with_engine(factory, cfg, facts)
        except (KeyError, NotImplementedError) as exc:
            what = exc.args[0] if exc.args else type(exc).__name__
            raise DiffInputError(
                f"recipe {arm} ({arm_text(rec)}): the engine does not implement a setting yet "
                f"({type(exc).__name__}: {what})"
            ) from None
        checked.update(arm_checked)
        inactive.update(arm_inactive)
    return checked, inactive


def _items(req: DiffRequest, weights: Path | None, spec) -> list:
    if req.prompts is not None:
        wl = w.JsonlWorkload(
            path=req.prompts, tokenizer=load_tokenizer(weights), default_max_tokens=req.max_tokens
        )
        raw = sorted(wl.initial_items(), key=lambda i: i.arrival)  # arrival order (stable)
        bad = [t for i in raw for t in i.prompt if t >= spec.vocab_size]
        if bad:
            raise DiffInputError(
                f"{req.prompts}: token id {bad[0]} outside the vocabulary [0, {spec.vocab_size})"
            )
    else:
        n = req.num_requests if req.num_requests is not None else req.concurrency
        raw = w.BurstWorkload(
            concurrency=n,
            prompt_len=req.prompt_len,
            max_tokens=req.max_tokens,
            seed=req.seed,
            vocab_size=spec.vocab_size,
        ).initial_items()
    return [d.DiffItem(f"r{i}", list(it.prompt), it.max_tokens) for i, it in enumerate(raw)]


def _workload_text(items, prompts, window, seed) -> str:
    src = (
        str(prompts)
        if prompts is not None
        else f"random prompts of {len(items[0].prompt)} tokens, seed {seed}"
    )
    return f"{len(items)} requests ({src}), {items[0].max_tokens} output tokens, window {window}, greedy"


def find_item(items, request: str):
    key = request if request.startswith("r") else f"r{request}"
    for it in items:
        if it.id == key:
            return it
    raise DiffInputError(f"--localize {request}: no such request (expected r0..r{len(items) - 1})")


def _accuracy_plan(accuracy: Path | None, toggles, spec, weights) -> dict[str, Any] | None:
    """Which evaluation set and weights the accuracy check uses, read and validated now."""
    path = accuracy
    eval_weights = weights if weights is not None else assets.shipped_weights(spec.name)
    if path is None:
        # The built-in set is for the trained tiny models: only with the preset's own (or given) weights.
        if not any(t.graded == "R3" for t in toggles) or eval_weights is None:
            return None
        path = assets.default_eval_set(spec.name)
        if path is None:
            return None
    try:
        items = read_items(Path(path), need_answer=True)
    except EvalSetError as exc:
        raise DiffInputError(f"--accuracy {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DiffInputError(f"--accuracy {path}: cannot read it ({exc})") from None
    return {"path": str(path), "items": items, "weights": eval_weights, "explicit": accuracy is not None}


# Execution -----------------------------------------------------------------------------------------------
def execute(s: DiffSetup, req: DiffRequest, progress: Progress) -> tuple[dict[str, Any], bool]:
    """The graded runs, then bisect, localize and accuracy as asked: (report data, every claim holds)."""
    t0 = time.perf_counter()
    lab = d.Lab(s.cfg_a, s.toggles, s.factory, s.items, req.concurrency, dtype=s.dtype, progress=progress)
    extras: dict[str, Any] = {}
    result = d.diff(lab, strict=req.strict)
    if req.bisect:
        extras["bisect"] = bisect(lab).to_dict()
    if req.localize is not None:
        extras["localize"] = _localize(s, result, req.localize, progress)
    acc = None
    if s.accuracy is not None:
        progress("accuracy", 0, 2)
        acc = _accuracy(s, req.seed)
    d.apply_accuracy(result.grades, acc)
    extras["perturb"] = _perturb_report(lab.perturb_hits())
    d.mark_untested(result.grades, {**s.inactive, **_never_fired(extras["perturb"])})
    result.accuracy = acc
    result.runs, result.elapsed_s = lab.runs, time.perf_counter() - t0
    return report_data(s, req, result, extras), not result.violations


def _perturb_report(hits: dict[str, dict[str, int]]) -> list[dict[str, Any]] | None:
    """Each debug.perturb place of the runs: how many runs had it and how often it fired."""
    return [{"place": place, **h} for place, h in sorted(hits.items())] or None


def _never_fired(report: list[dict[str, Any]] | None) -> dict[str, str]:
    """debug.perturb is untested when no place of it ever fired: the runs were A's arithmetic."""
    if not report or any(p["hits"] for p in report):
        return {}
    places = ", ".join(p["place"] for p in report)
    return {"debug.perturb": f"{places} never fired: no op output matched it"}


def _localize(s: DiffSetup, result, request: str, progress: Progress) -> dict[str, Any]:
    item = find_item(s.items, request)
    rows = [r for r in (*result.requests, *result.solo_requests) if r.id == item.id]
    if all(r.identical and r.logits_identical is not False for r in rows):
        # Nothing differs to localize: say so instead of replaying (a replay would blame batch-mates).
        return {"request": item.id, "found": False, "diverged": False, "max_tokens": item.max_tokens}
    fds = [r.first_divergence for r in rows if r.first_divergence is not None]
    max_tokens = min(item.max_tokens, min(fds) + 1) if fds else item.max_tokens
    progress(f"localize {item.id}", 0, 1)
    loc = localize(s.factory, s.cfg_a, s.cfg_b, item.id, item.prompt, max_tokens)
    progress(f"localize {item.id}", 1, 1)
    return {**loc.to_dict(), "diverged": True}


def _accuracy(s: DiffSetup, seed: int):
    plan = s.accuracy
    if plan["weights"] is not None and plan["weights"] == s.weights:
        net = s.net  # the diff's own checkpoint: no second copy on the device
        label = str(plan["weights"])
    elif plan["weights"] is not None:
        # deferred: loads torch
        from looptrace.engine.checkpoint import load_checkpoint

        _, net = load_checkpoint(plan["weights"], s.device, s.dtype)
        label = str(plan["weights"])
    else:
        net = s.net  # the diff's own (random) weights
        label = "random (seeded): accuracy is meaningless without trained --weights"
    factory = engine_factory(net, s.device, s.dtype, seed)
    tok = load_tokenizer(plan["weights"])
    cfg_a, cfg_b = s.rec_a.config, s.rec_b.config
    where = dict(path=plan["path"], weights=label, runs={})
    acc = d.accuracy_check(factory, cfg_a, cfg_b, plan["items"], tok, **where)
    if not acc.holds and sum(t.graded == "R3" for t in s.toggles) > 1:  # which one misses the rule?
        acc.by_setting = d.accuracy_by_setting(factory, cfg_a, s.toggles, plan["items"], tok, **where)
    return acc


# Report --------------------------------------------------------------------------------------------------
def report_data(s: DiffSetup, req: DiffRequest, result, extras: dict[str, Any]) -> dict[str, Any]:
    viol = [g.toggle.path for g in result.violations]
    untested = [g.toggle.path for g in result.grades if g.verdict == d.UNTESTED]
    return {
        "schema": SCHEMA,
        "header": _header(s, req, result),
        "summary": {
            "requests": len(result.requests),
            "identical_batched": result.combined["batched"].identical,
            "identical_solo": result.combined["solo"].identical,
            "logits_identical_batched": result.combined["batched"].logits_identical,
            "logits_identical_solo": result.combined["solo"].logits_identical,
            "runs": result.runs,
            "elapsed_s": round(result.elapsed_s, 3),
        },
        "toggles": [g.to_dict() for g in result.grades],
        "requests": [r.to_dict() for r in result.requests],
        "solo_requests": [r.to_dict() for r in result.solo_requests],
        "accuracy": result.accuracy.to_dict() if result.accuracy else None,
        **extras,
        "verdict": {"ok": not viol, "violations": viol, "untested": untested},
    }


def _header(s: DiffSetup, req: DiffRequest, result) -> dict[str, Any]:
    arms = (("a", s.rec_a), ("b", s.rec_b))
    return {
        "tool": "looptrace",
        "command": "diff",
        "model_preset": s.spec.name,
        "family": s.spec.family,
        "loops": s.spec.default_loops,
        "weights": str(s.weights) if s.weights else "random (seeded)",
        "device": device_name(s.device),
        "dtype": str(s.dtype).replace("torch.", ""),
        "versions": versions(),
        "recipes": {
            arm: {
                "name": rec.name,
                "source": rec.source,
                "overrides": rec.overrides,
                "config": config_to_dict(rec.config),
            }
            for arm, rec in arms
        },
        "differing_toggles": [t.to_dict() for t in result.toggles],
        "claimed_rung": d.max_rung(t.graded for t in result.toggles),
        "workload": s.workload,
        "seed": req.seed,
        "strict": req.strict,
    }
