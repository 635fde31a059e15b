"""`looptrace diff`: run two engine configurations (arms A and B) on the same requests and grade the
differences against the exactness rungs each differing setting declares (engine/config.py).

Rungs (base-engine.md §10): R0 bitwise-identical tokens under the same batches; R1 identical at batch 1,
may move with batch composition; R2 same distribution, other random numbers; R3 changed arithmetic (needs
an accuracy check). Evidence comes from two kinds of runs of the same workload:

- *batched*: requests submitted in order with at most `window` outstanding (the same batches in both arms
  unless a toggle changes scheduling);
- *solo*: one request at a time (batch 1), which removes batch composition.

Rules: a claimed R0 must be identical batched and solo; R1 identical solo; R2 is reported; R3 is graded by
the one-point accuracy rule when an evaluation set is given (`accuracy_check`). A setting whose rung holds
only after a device check (`rung_check(path) == "device"`) is graded by the engine's startup check
(`engine.checked_rungs`), or R3 where none ran.

When A and B differ in several settings, each setting needs its own evidence: the settings claiming R0
run together on A (batched and solo) and those claiming R0 or R1 together (solo); only when a group fails
does delta debugging (`ddmin`) look for the settings that break their claim.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from looptrace.analysis.ddmin import ddmin
from looptrace.build import free_memory
from looptrace.engine.config import (
    RUNGS,
    ConfigError,
    EngineConfig,
    config_differences,
    config_to_dict,
    rung_check,
    toggle_rung,
    validate_config,
)
from looptrace.engine.hooks import Observer
from looptrace.engine.request import SamplingParams
from looptrace.train.evaluate import exact_match, paired_difference

BATCHED, SOLO = "batched", "solo"
TOP_K = 5
EVAL_BATCH = 64  # rows per batch of the accuracy runs (when the arms do not differ in it)
ProgressFn = Callable[[str, int, int], None]  # (what is running, requests done, requests total)
EngineFactory = Callable[[EngineConfig], Any]  # config -> a fresh LLMEngine on the shared weights


class DiffError(ValueError):
    """Bad input for a diff (arms identical, unknown request, ...); one line."""


# Workload ------------------------------------------------------------------------------------------------
@dataclass
class DiffItem:
    id: str
    prompt: list[int]
    max_tokens: int


# Runs ----------------------------------------------------------------------------------------------------
class LogitsRecorder(Observer):
    """Per request and sampled token: the top-k logits and a digest of the full logits row (bitwise)."""

    wants_logits = True

    def __init__(self) -> None:
        self.tops: dict[str, list[tuple[list[float], list[int]]]] = {}
        self.digests: dict[str, list[str]] = {}

    def on_logits(self, request_ids: list[str], logits: torch.Tensor) -> None:
        host = logits.detach().to("cpu")
        vals, idx = torch.topk(host.float(), k=min(TOP_K, host.shape[-1]), dim=-1)
        raw = host.contiguous().view(torch.uint8) if host.dtype != torch.uint8 else host
        for i, rid in enumerate(request_ids):
            self.tops.setdefault(rid, []).append((vals[i].tolist(), idx[i].tolist()))
            digest = hashlib.blake2b(raw[i].numpy().tobytes(), digest_size=8).hexdigest()
            self.digests.setdefault(rid, []).append(digest)


@dataclass
class ArmRun:
    tokens: dict[str, list[int]]
    tops: dict[str, list[tuple[list[float], list[int]]]]
    digests: dict[str, list[str]]
    elapsed_s: float
    steps: int
    perturb: tuple[str, int] | None = None  # debug.perturb: (place, times it fired)


def run_arm(
    engine,
    items: list[DiffItem],
    window: int,
    params: SamplingParams | None = None,
    on_request: Callable[[int, int], None] | None = None,
) -> ArmRun:
    """Submit `items` in order, at most `window` outstanding (1 = solo), step until all finish."""
    params = params or SamplingParams()
    rec = LogitsRecorder()
    engine.attach(rec)
    pending, live, done = deque(items), set(), 0
    t0 = time.perf_counter()
    try:
        while pending or live:
            while pending and len(live) < window:
                it = pending.popleft()
                engine.add_request(
                    list(it.prompt), replace(params, max_tokens=it.max_tokens), request_id=it.id
                )
                live.add(it.id)
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
                    done += 1
                    if on_request is not None:
                        on_request(done, len(items))
            if live and not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine dropped request(s) {sorted(live)} without finishing them")
    finally:
        engine.detach(rec)
    tokens = {it.id: list(engine.request_view(it.id).outputs) for it in items}
    pert = engine.perturbation
    perturb = (str(pert.place), pert.hits) if pert is not None else None
    return ArmRun(tokens, rec.tops, rec.digests, time.perf_counter() - t0, engine.stats.steps, perturb)


def release(engine) -> None:
    """Drop what an engine registered on its (copied) model."""
    if engine.perturbation is not None:
        engine.perturbation.remove()


def with_engine(factory: EngineFactory, cfg: EngineConfig, use: Callable[[Any], Any]) -> Any:
    """Build an engine, `use(engine)`, then release and free it before returning: nothing else may keep a
    reference (the result of `use` must not hold the engine)."""
    engine = factory(cfg)
    try:
        return use(engine)
    finally:
        release(engine)
        del engine
        free_memory()


# Comparison ----------------------------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter length), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def near_tie_tolerance(dtype: torch.dtype | None) -> float:
    """Relative top-1/top-2 margin below which a flip is a near-tie: 1e-3, or 8 ulps of a 16-bit dtype."""
    eps = torch.finfo(dtype).eps if dtype is not None and dtype.is_floating_point else 0.0
    return max(1e-3, 8 * eps)


@dataclass
class Margin:
    top1: float
    top2: float
    margin: float  # top1 - top2
    other_rank: int | None  # rank of the other arm's token among this arm's top-k (0-based), None if lower
    other_gap: float | None  # this arm's logit of its token minus that of the other arm's token
    near_tie: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "top1": self.top1,
            "top2": self.top2,
            "margin": self.margin,
            "other_token_rank": self.other_rank,
            "other_token_gap": self.other_gap,
            "near_tie": self.near_tie,
        }


def _margin(top: tuple[list[float], list[int]], own: int, other: int | None, tol: float) -> Margin:
    vals, idx = top
    m = vals[0] - vals[1] if len(vals) > 1 else float("inf")
    rank = idx.index(other) if other is not None and other in idx else None
    gap = vals[idx.index(own)] - vals[rank] if rank is not None and own in idx else None
    return Margin(
        vals[0], vals[1] if len(vals) > 1 else vals[0], m, rank, gap, m <= tol * max(1.0, abs(vals[0]))
    )


@dataclass
class RequestDiff:
    id: str
    a_tokens: list[int]
    b_tokens: list[int]
    first_divergence: int | None
    logits_identical: bool | None  # every logits row bitwise equal (None: not captured)
    a_margin: Margin | None = None
    b_margin: Margin | None = None

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    @property
    def common_prefix(self) -> int:
        return len(self.a_tokens) if self.first_divergence is None else self.first_divergence

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "a_tokens": self.a_tokens,
            "b_tokens": self.b_tokens,
            "first_divergence": self.first_divergence,
            "identical": self.identical,
            "common_prefix": self.common_prefix,
            "logits_identical": self.logits_identical,
            "margins": {
                "a": self.a_margin.to_dict() if self.a_margin else None,
                "b": self.b_margin.to_dict() if self.b_margin else None,
            },
        }


def compare_runs(
    a: ArmRun, b: ArmRun, ids: Iterable[str], dtype: torch.dtype | None = None
) -> list[RequestDiff]:
    tol = near_tie_tolerance(dtype)
    out = []
    for rid in ids:
        ta, tb = a.tokens[rid], b.tokens[rid]
        fd = first_divergence(ta, tb)
        da, db = a.digests.get(rid), b.digests.get(rid)
        logits_same = None if da is None or db is None else da == db
        d = RequestDiff(rid, ta, tb, fd, logits_same)
        if fd is not None and fd < min(len(ta), len(tb)):
            tops_a, tops_b = a.tops.get(rid, []), b.tops.get(rid, [])
            if fd < len(tops_a):
                d.a_margin = _margin(tops_a[fd], ta[fd], tb[fd], tol)
            if fd < len(tops_b):
                d.b_margin = _margin(tops_b[fd], tb[fd], ta[fd], tol)
        out.append(d)
    return out


@dataclass
class Evidence:
    """Identical requests between two runs of one mode."""

    identical: int
    logits_identical: int | None
    total: int

    @property
    def tokens_ok(self) -> bool:
        return self.identical == self.total

    @property
    def logits_ok(self) -> bool | None:
        return None if self.logits_identical is None else self.logits_identical == self.total

    def text(self) -> str:
        return f"{self.identical}/{self.total}"

    def to_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, "logits_identical": self.logits_identical, "total": self.total}


def evidence(diffs: list[RequestDiff]) -> Evidence:
    li = [d.logits_identical for d in diffs]
    return Evidence(
        sum(d.identical for d in diffs), None if any(x is None for x in li) else sum(li), len(diffs)
    )


# Configurations ------------------------------------------------------------------------------------------
def set_path(cfg: EngineConfig, path: str, value: Any) -> None:
    *sections, key = path.split(".")
    node: Any = cfg
    for s in sections:
        node = getattr(node, s)
    setattr(node, key, copy.deepcopy(value))


@dataclass
class Toggle:
    path: str
    a: Any
    b: Any
    declared: str  # the schema's rung for a -> b
    graded: str  # what it is graded as here (device-checked rungs count as R3 off the checked device)
    device_check: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "a": self.a,
            "b": self.b,
            "declared_rung": self.declared,
            "graded_rung": self.graded,
            "device_check": self.device_check,
        }


def differing_toggles(
    a: EngineConfig, b: EngineConfig, device_type: str, checked: dict[str, str] | None = None
) -> list[Toggle]:
    """The settings A and B differ in, with the rung each is graded at here. A rung that holds only where
    a device check passes takes the engine's startup-check result (`engine.checked_rungs`) when one ran,
    else R3 off CUDA."""
    out = []
    for path, (va, vb) in config_differences(a, b).items():
        declared = toggle_rung(path, va, vb)
        check = rung_check(path) == "device"
        if check and checked and path in checked:
            graded = max_rung([declared, checked[path]])
        else:
            graded = "R3" if check and device_type != "cuda" else declared
        out.append(Toggle(path, va, vb, declared, graded, check))
    return out


def max_rung(rungs: Iterable[str]) -> str:
    return max(rungs, key=RUNGS.index, default="R0")


class Lab:
    """Runs A with any subset of B's differing settings applied, cached by (subset, mode)."""

    def __init__(
        self,
        cfg_a: EngineConfig,
        toggles: list[Toggle],
        factory: EngineFactory,
        items: list[DiffItem],
        window: int,
        *,
        params: SamplingParams | None = None,
        dtype: torch.dtype | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.cfg_a, self.toggles = cfg_a, {t.path: t for t in toggles}
        self.factory, self.items, self.window = factory, items, window
        self.params, self.dtype, self.progress = params, dtype, progress
        self.cache: dict[tuple[frozenset[str], str], ArmRun] = {}
        self.runs = 0

    @property
    def all(self) -> frozenset[str]:
        return frozenset(self.toggles)

    def config(self, subset: frozenset[str]) -> EngineConfig:
        """A with the subset's B values; raises ConfigError when the combination is invalid."""
        cfg = copy.deepcopy(self.cfg_a)
        for path in sorted(subset):
            set_path(cfg, path, self.toggles[path].b)
        return validate_config(cfg)

    def closure(self, subset: frozenset[str]) -> frozenset[str] | None:
        """The subset plus the fewest other differing settings that make a valid configuration
        (e.g. scheduler.prefill_share needs scheduler.loop_fusion); None if there is none."""
        try:
            self.config(subset)
            return subset
        except ConfigError:
            pass
        rest = sorted(self.all - subset)
        for extra in rest:
            try:
                self.config(subset | {extra})
                return subset | {extra}
            except ConfigError:
                continue
        try:
            self.config(self.all)
            return self.all if subset else None
        except ConfigError:
            return None

    def baseline(self, subset: frozenset[str], full: frozenset[str]) -> frozenset[str]:
        """What the settings `subset` are measured against when `full` (their closure) runs: the other
        settings of `full` (those they need, and any background) when these make a valid configuration on
        their own, else A. A setting that needs another is marked by its own effect, not the other's."""
        rest = full - subset
        return rest if rest and self.closure(rest) == rest else frozenset()

    def own_evidence(
        self, subset: frozenset[str], mode: str, background: frozenset[str] = frozenset()
    ) -> tuple[Evidence, frozenset[str], frozenset[str]] | None:
        """Evidence of `subset` (on top of `background`): its closure against its baseline; with the
        subsets run and compared. None when no valid configuration contains it."""
        full = self.closure(background | subset)
        if full is None:
            return None
        base = self.baseline(subset, full)
        return self.evidence(full, mode, base), full, base

    def label(self, subset: frozenset[str]) -> str:
        if not subset:
            return "A"
        if subset == self.all:
            return "B"
        return "A+" + ",".join(sorted(subset))

    def run(self, subset: frozenset[str], mode: str) -> ArmRun:
        key = (subset, mode)
        if key not in self.cache:
            what = f"{self.label(subset)} {mode}"

            def tick(done: int, total: int) -> None:
                if self.progress is not None:
                    self.progress(what, done, total)

            tick(0, len(self.items))
            window = 1 if mode == SOLO else self.window
            self.cache[key] = with_engine(
                self.factory,
                self.config(subset),
                lambda engine: run_arm(engine, self.items, window, self.params, tick),
            )
            self.runs += 1
        return self.cache[key]

    def perturb_hits(self) -> dict[str, dict[str, int]]:
        """Per debug.perturb place: the runs that had it installed and how often it fired in all."""
        out: dict[str, dict[str, int]] = {}
        for run in self.cache.values():
            if run.perturb is not None:
                place, hits = run.perturb
                entry = out.setdefault(place, {"runs": 0, "hits": 0})
                entry["runs"] += 1
                entry["hits"] += hits
        return out

    def compare(
        self, subset: frozenset[str], mode: str, base: frozenset[str] = frozenset()
    ) -> list[RequestDiff]:
        return compare_runs(
            self.run(base, mode), self.run(subset, mode), [i.id for i in self.items], self.dtype
        )

    def evidence(self, subset: frozenset[str], mode: str, base: frozenset[str] = frozenset()) -> Evidence:
        return evidence(self.compare(subset, mode, base))


# Grading -------------------------------------------------------------------------------------------------
HOLDS, VIOLATED, REPORTED, UNCHECKED = "holds", "violated", "reported", "unchecked"
UNTESTED = "untested"  # the setting has no effect on this device: identical runs prove nothing


@dataclass
class Grade:
    toggle: Toggle
    batched: Evidence | None
    solo: Evidence | None
    source: str  # which runs gave the evidence
    verdict: str = REPORTED
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.toggle.to_dict(),
            "batched": self.batched.to_dict() if self.batched else None,
            "solo": self.solo.to_dict() if self.solo else None,
            "evidence": self.source,
            "verdict": self.verdict,
            "reason": self.reason,
        }


def _ok(ev: Evidence | None, strict: bool) -> bool:
    return ev is not None and ev.tokens_ok and (not strict or ev.logits_ok is not False)


def _judge(rung: str, batched: Evidence | None, solo: Evidence | None, strict: bool) -> tuple[str, str]:
    what = "tokens and logits" if strict else "tokens"
    if rung == "R0":
        if not _ok(batched, strict):
            return VIOLATED, f"R0 needs identical {what} batched ({batched.text() if batched else '-'})"
        if not _ok(solo, strict):
            return VIOLATED, f"R0 needs identical {what} at batch 1 ({solo.text() if solo else '-'})"
        return HOLDS, "identical batched and at batch 1"
    if rung == "R1":
        if not _ok(solo, strict):
            return VIOLATED, f"R1 needs identical {what} at batch 1 ({solo.text() if solo else '-'})"
        return HOLDS, "identical at batch 1"
    if rung == "R2":
        return REPORTED, "R2: other random numbers, same distribution (reported)"
    return UNCHECKED, "R3: needs an accuracy check (--accuracy FILE.jsonl)"


def _isolate(
    lab: Lab, group: frozenset[str], mode: str, strict: bool, background: frozenset[str]
) -> list[str]:
    """Settings of `group` whose runs (on top of `background`) differ from their baseline in `mode`."""

    def fails(subset: frozenset[str]) -> bool | None:
        own = lab.own_evidence(subset, mode, background)
        return None if own is None else not _ok(own[0], strict)

    bad: list[str] = []
    rest = set(group)
    while rest and fails(frozenset(rest)):
        found = ddmin(sorted(rest), fails)
        if not found:
            break
        bad += found
        rest -= set(found)
    return bad


def _own_grade(
    lab: Lab,
    paths: frozenset[str],
    modes: tuple[str, ...],
    what: str,
    background: frozenset[str] = frozenset(),
) -> tuple[Evidence | None, Evidence | None, str]:
    """(batched, solo, source) for `paths` measured on their own (see Lab.baseline)."""
    full = lab.closure(background | paths) or (background | paths)
    base = lab.baseline(paths, full)
    ev = {mode: lab.evidence(full, mode, base) if mode in modes else None for mode in (BATCHED, SOLO)}
    source = what + ("" if not base else f" on {lab.label(base)}")
    return ev[BATCHED], ev[SOLO], source


def grade(lab: Lab, *, strict: bool = False) -> tuple[list[Grade], dict[str, Evidence]]:
    """Grade every differing setting; returns the grades and the combined A-vs-B evidence per mode."""
    toggles = list(lab.toggles.values())
    combined = {mode: lab.evidence(lab.all, mode) for mode in (BATCHED, SOLO)}
    by_path: dict[str, Grade] = {}
    g0 = frozenset(t.path for t in toggles if t.graded == "R0")
    g1 = frozenset(t.path for t in toggles if t.graded == "R1")
    both = (BATCHED, SOLO)

    def assign(paths: Iterable[str], batched: Evidence | None, solo: Evidence | None, source: str) -> None:
        for p in paths:
            by_path[p] = Grade(lab.toggles[p], batched, solo, source)

    # R0 group: identical batched and solo.
    clean0 = g0
    if g0:
        if g0 == lab.all:
            assign(g0, combined[BATCHED], combined[SOLO], "A vs B")
        else:
            bad: list[str] = []
            for mode in both:
                bad += [p for p in _isolate(lab, g0 - set(bad), mode, strict, frozenset()) if p not in bad]
            clean0 = g0 - set(bad)
            for p in bad:
                assign([p], *_own_grade(lab, frozenset({p}), both, "alone"))
            if clean0:
                assign(clean0, *_own_grade(lab, clean0, both, f"R0 group ({len(clean0)})"))
    # R1 group: identical solo (with the clean R0 settings applied as well).
    if g1:
        group = clean0 | g1
        if group == lab.all:
            assign(g1, combined[BATCHED], combined[SOLO], "A vs B")
        else:
            bad = _isolate(lab, g1, SOLO, strict, clean0)
            for p in bad:
                assign([p], *_own_grade(lab, frozenset({p}), (SOLO,), "alone"))
            ok = g1 - set(bad)
            if ok:
                what = f"R0+R1 group ({len(clean0 | ok)})"
                assign(ok, *_own_grade(lab, clean0 | ok, (SOLO,), what))
    for t in toggles:
        if t.path not in by_path:
            by_path[t.path] = Grade(t, combined[BATCHED], combined[SOLO], "A vs B")
    grades = [by_path[t.path] for t in toggles]
    for g in grades:
        g.verdict, g.reason = _judge(g.toggle.graded, g.batched, g.solo, strict)
        if g.toggle.device_check and g.toggle.graded != g.toggle.declared:
            g.reason += f"; declared {g.toggle.declared} only where a device check passes (graded R3 here)"
        elif g.toggle.device_check:
            g.reason += f"; the engine's startup check on this device gave {g.toggle.graded}"
    return grades, combined


# Accuracy ------------------------------------------------------------------------------------------------
ONE_POINT_RULE = (
    "one-point rule (ExactLoop §5.8): ship an R3 change only if its accuracy is at most one point below "
    "the reference on the point estimate; a decision rule, not a hypothesis test"
)


@dataclass
class AccuracyResult:
    path: str
    weights: str
    n: int
    a_correct: int
    b_correct: int
    diff_points: float  # (B - A) in percentage points
    se_points: float  # paired standard error
    sequences_differ: int
    batch: int | None = None  # scheduler.max_num_seqs of the accuracy runs
    by_setting: list[SettingAccuracy] = field(default_factory=list)  # when several R3 settings fail together

    @property
    def a_acc(self) -> float:
        return 100.0 * self.a_correct / max(1, self.n)

    @property
    def b_acc(self) -> float:
        return 100.0 * self.b_correct / max(1, self.n)

    @property
    def ci95(self) -> tuple[float, float]:
        return self.diff_points - 1.96 * self.se_points, self.diff_points + 1.96 * self.se_points

    @property
    def holds(self) -> bool:
        return self.diff_points >= -1.0 - 1e-9

    @property
    def note(self) -> str:
        lo, hi = self.ci95
        verdict = "within" if self.holds else "misses"
        extra = ""
        if self.holds and lo < -1.0:
            extra = f"; the 95% interval reaches {lo:+.2f}, so a one-point loss is not excluded"
        if not self.holds and hi >= -1.0:
            extra = f"; the 95% interval [{lo:+.2f}, {hi:+.2f}] overlaps the rule (too few questions to tell)"
        return (
            f"{self.diff_points:+.2f} points (s.e. {self.se_points:.2f}): {verdict} the one-point rule{extra}"
        )

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.ci95
        return {
            "file": self.path,
            "weights": self.weights,
            "n": self.n,
            "a_correct": self.a_correct,
            "b_correct": self.b_correct,
            "a_accuracy": self.a_acc,
            "b_accuracy": self.b_acc,
            "difference_points": self.diff_points,
            "paired_se_points": self.se_points,
            "ci95_points": [lo, hi],
            "sequences_differ": self.sequences_differ,
            "batch": self.batch,
            "rule": ONE_POINT_RULE,
            "holds": self.holds,
            "note": self.note,
            "by_setting": [x.to_dict() for x in self.by_setting],
        }


@dataclass
class SettingAccuracy:
    """One R3 setting's own accuracy check: A + what it needs (`baseline`) vs that + the setting."""

    path: str
    settings: list[str]  # B's side: the setting and the settings it needs
    baseline: list[str]  # A's side (empty: A itself)
    result: AccuracyResult

    def to_dict(self) -> dict[str, Any]:
        out = self.result.to_dict()
        del out["by_setting"], out["rule"]
        return {"setting": self.path, "settings": self.settings, "baseline": self.baseline, **out}


def accuracy_check(
    factory: EngineFactory,
    cfg_a: EngineConfig,
    cfg_b: EngineConfig,
    items,
    tokenizer,
    *,
    path: str,
    weights: str,
    runs: dict[str, Any] | None = None,
) -> AccuracyResult:
    """Exact-match accuracy of both arms on `items` (greedy, stop at EOS), paired difference B - A.

    Like the paper's full-split checks, the questions run batched: when the arms share their batch size
    (scheduler.max_num_seqs, R1), both run with at least EVAL_BATCH rows. `runs` caches the runs by
    configuration across calls (A is run once for every setting checked on its own)."""
    cfg_a, cfg_b = copy.deepcopy(cfg_a), copy.deepcopy(cfg_b)
    batch = cfg_a.scheduler.max_num_seqs
    if batch == cfg_b.scheduler.max_num_seqs:
        batch = max(batch, EVAL_BATCH)
        cfg_a.scheduler.max_num_seqs = cfg_b.scheduler.max_num_seqs = batch
    runs = {} if runs is None else runs
    accs, texts = [], []
    for cfg in (cfg_a, cfg_b):
        key = json.dumps(config_to_dict(cfg), sort_keys=True, default=str)
        if key not in runs:
            runs[key] = with_engine(factory, cfg, lambda engine: exact_match(engine, tokenizer, items))
        acc, out = runs[key]
        accs.append(acc)
        texts.append(out)
    mean, se = paired_difference(accs[0], accs[1])
    differ = sum(x != y for x, y in zip(*texts))
    return AccuracyResult(
        path,
        weights,
        accs[0].n,
        sum(accs[0].correct),
        sum(accs[1].correct),
        100 * mean,
        100 * se,
        differ,
        batch,
    )


def accuracy_by_setting(
    factory: EngineFactory,
    cfg_a: EngineConfig,
    toggles: list[Toggle],
    items,
    tokenizer,
    *,
    path: str,
    weights: str,
    runs: dict[str, Any],
) -> list[SettingAccuracy]:
    """Each R3 setting's own accuracy check, on top of the settings it needs (see Lab.baseline): which
    of several R3 settings that miss the rule together misses it by itself."""
    lab = Lab(cfg_a, toggles, factory, [], 1)  # for its configurations only
    out = []
    for t in toggles:
        if t.graded != "R3":
            continue
        full = lab.closure(frozenset({t.path}))
        if full is None:
            continue
        base = lab.baseline(frozenset({t.path}), full)
        res = accuracy_check(
            factory,
            lab.config(base),
            lab.config(full),
            items,
            tokenizer,
            path=path,
            weights=weights,
            runs=runs,
        )
        out.append(SettingAccuracy(t.path, sorted(full), sorted(base), res))
    return out


def apply_accuracy(grades: list[Grade], acc: AccuracyResult | None) -> None:
    """R3 settings are graded by the one-point rule: all together (the accuracy run A vs B), or each by
    its own check when the group missed the rule (`accuracy_by_setting`)."""
    own = {x.path: x for x in acc.by_setting} if acc is not None else {}
    for g in grades:
        if g.toggle.graded != "R3":
            continue
        if acc is None:
            g.verdict = UNCHECKED
            continue
        x = own.get(g.toggle.path)
        res, where = (acc, "A vs B") if x is None else (x.result, "on its own")
        if x is not None and x.baseline:
            where += f" (on A+{','.join(x.baseline)})"
        g.verdict = HOLDS if res.holds else VIOLATED
        g.reason = f"accuracy {where}: {res.note}"


def inactive_reason(path: str, inactive: dict[str, str]) -> str | None:
    """Why `path` has no effect on this device (`engine.inactive_settings` names a setting or a section)."""
    for setting, why in inactive.items():
        if path == setting or path.startswith(setting + "."):
            return why
    return None


def mark_untested(grades: list[Grade], inactive: dict[str, str]) -> None:
    """A differing setting the engine reports inactive on this device is untested, whatever its runs gave."""
    for g in grades:
        why = inactive_reason(g.toggle.path, inactive)
        if why is not None:
            g.verdict = UNTESTED
            g.reason = f"no effect here ({why}): its {g.toggle.declared} claim is untested"


@dataclass
class DiffResult:
    toggles: list[Toggle]
    requests: list[RequestDiff]  # batched A vs B
    solo_requests: list[RequestDiff]
    combined: dict[str, Evidence]
    grades: list[Grade]
    accuracy: AccuracyResult | None = None
    runs: int = 0
    elapsed_s: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def violations(self) -> list[Grade]:
        return [g for g in self.grades if g.verdict == VIOLATED]


def diff(lab: Lab, *, strict: bool = False) -> DiffResult:
    t0 = time.perf_counter()
    grades, combined = grade(lab, strict=strict)
    return DiffResult(
        list(lab.toggles.values()),
        lab.compare(lab.all, BATCHED),
        lab.compare(lab.all, SOLO),
        combined,
        grades,
        runs=lab.runs,
        elapsed_s=time.perf_counter() - t0,
    )
