"""`looptrace depth`'s experiment: engines at each depth, exact match by depth, the state-distance analysis
and its validation (serving (S, S) vs (S, P), the queue-age controller under a Poisson burst).

The math lives in looptrace.analysis.depth and evaluation in looptrace.train.evaluate; this module runs
them on engines and fills a report dict as it goes, so that a Ctrl-C (which propagates) leaves the parts
already measured for the caller to write. Bad input is a one-line `DepthInputError`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from looptrace import assets
from looptrace.analysis import depth as D
from looptrace.build import (
    BuildRequest,
    EngineSetup,
    ResolvedModel,
    build,
    resolve_device,
    resolve_dtype,
    run_header,
)
from looptrace.drive.workloads import BurstWorkload, WorkItem
from looptrace.engine import budget
from looptrace.engine.config import LOOPS_MAX
from looptrace.engine.hooks import Observer
from looptrace.engine.request import SamplingParams
from looptrace.engine.tokenizer import load_tokenizer
from looptrace.recipes import load_recipe
from looptrace.train.evaluate import (
    answer_budget,
    encode_prompt,
    exact_match,
    generate_texts,
    paired_difference,
    read_items,
)

BATCH = 64  # rows per engine step: the whole evaluation set decodes together


class Phases(Protocol):
    """Where the caller shows progress: the number of phases, then each phase as it starts."""

    def plan(self, total: int) -> None: ...

    def start(self, what: str, done: int) -> None: ...


@dataclass(frozen=True)
class DepthEngines:
    """What every engine of the experiment shares: the user's build request (model, recipe, overrides,
    device) and its model, resolved once."""

    request: BuildRequest
    model: ResolvedModel

    def recipe_sets(self, loops: int | None, extra: tuple[str, ...] = ()) -> list[str]:
        """The experiment's settings at `loops`, then `extra`, then the user's --set (which wins)."""
        sets = [
            f"scheduler.max_num_seqs={BATCH}",
            "scheduler.max_num_batched_tokens=2048",
            "kv.prefix_caching=false",
        ]
        if loops is not None:
            sets += [f"exit.max_loops={loops}", f"exit.min_loops={min(2, loops)}"]  # min_loops <= max_loops
        return sets + list(extra) + list(self.request.sets)

    def build(self, loops: int | None, extra: tuple[str, ...] = ()) -> EngineSetup:
        return build(replace(self.request, sets=tuple(self.recipe_sets(loops, extra))), self.model)


@dataclass(frozen=True)
class ValidateShape:
    """--validate's throughput workload: a burst of `requests` prompts, best of `repeats` timed runs."""

    prompt_len: int
    answer_len: int
    requests: int
    repeats: int


@dataclass(frozen=True)
class DepthRequest:
    """The analysis: reference depth S_ref, decoding depth S, reported P, threshold tau, validation."""

    engines: DepthEngines
    items: list  # train.evaluate items: prompt and (optional) answer
    s_ref: int | None
    s: int | None
    p: int | None
    tau: float
    use_generated: bool
    validate: ValidateShape | None


def check_loops(tau: float, **loops: int | None) -> None:
    """tau in (0, 1); --s-ref / --s / --p are loop counts: named in the error, not as the exit.* setting."""
    D.check_tau(tau)
    for name, value in loops.items():
        if value is not None and not 1 <= value <= LOOPS_MAX:
            raise D.DepthInputError(
                f"--{name.replace('_', '-')} {value}: expected a loop count from 1 to {LOOPS_MAX}"
            )


def check_sizes(limit: int, shape: ValidateShape) -> None:
    if limit < 0:
        raise D.DepthInputError(f"--limit must be >= 0, got {limit}")
    if min(shape.prompt_len, shape.answer_len, shape.requests, shape.repeats) < 1:
        raise D.DepthInputError(
            "--val-prompt-len, --val-answer-len, --val-requests and --repeats must be >= 1"
        )


def parse_depths(text: str) -> list[int]:
    """--accuracy-by-depth: comma-separated loop counts."""
    try:  # every item a number: `1,,2` is a typo, not a list of two
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise D.DepthInputError(f"--accuracy-by-depth '{text}': expected comma-separated integers") from None
    if not out or min(out) < 1 or max(out) > LOOPS_MAX:
        raise D.DepthInputError(f"--accuracy-by-depth '{text}': expected loop counts from 1 to {LOOPS_MAX}")
    return out


def load_items(prompts: Path | None, limit: int, *, need_answer: bool) -> list:
    """The prompts file (default: the built-in evaluation set), its first `limit` items (0: all)."""
    path = prompts
    if path is None:
        path = assets.default_eval_set()
        if path is None:
            raise D.DepthInputError("no built-in evaluation set is installed; pass --prompts FILE.jsonl")
    items = read_items(path, need_answer=need_answer)
    return items[:limit] if limit else items


def check_memory(engines: DepthEngines, depths: list[int], option: str, items: list) -> None:
    """Before any engine: the KV pool (one plane per loop) and, for the analysis, the captured loop states
    (float64, every position x loop) at each depth must fit; the error names `option`."""
    # deferred: torch loads with the engine, not with this module
    import torch

    dev = resolve_device(engines.request.device)
    elt = torch.empty((), dtype=resolve_dtype(engines.request.dtype, dev)).element_size()
    spec = engines.model.spec
    positions = sum(len(it.prompt) + len(it.answer or "") + 32 for it in items)  # ~1 token per character
    for d in depths or [spec.default_loops]:
        cfg = load_recipe(engines.request.recipe, engines.recipe_sets(d)).config
        needs = [
            budget.Need(n.what, n.nbytes, option, n.host) if n.what == "KV pool" else n
            for n in budget.engine_needs(spec, cfg, elt, dev)
        ]
        if option == "--s-ref":
            needs.append(
                budget.Need("captured loop states", positions * d * spec.hidden_size * 8, "--s-ref", True)
            )
        budget.check_memory(needs, dev, context=f"{option} {d}")


def _tokenizer(setup: EngineSetup):
    return load_tokenizer(setup.weights)


def run_accuracy(engines: DepthEngines, items: list, depths: list[int], report: dict, phases: Phases) -> None:
    """report["accuracy_by_depth"]: exact match at each depth, one engine per depth."""
    phases.plan(len(depths))
    rows = report.setdefault("accuracy_by_depth", [])
    for i, d in enumerate(depths):
        phases.start(f"exact match at {d} loops ({len(items)} prompts)", i)
        setup = engines.build(d)
        report.setdefault("header", run_header(setup))
        acc, _ = exact_match(setup.engine, _tokenizer(setup), items)
        rows.append(
            {"loops": d, "exact_match": round(acc.value, 4), "stderr": round(acc.stderr, 4), "n": acc.n}
        )


def run_depth(request: DepthRequest, report: dict, phases: Phases) -> None:
    """The analysis into `report`, then (with --validate) report["validate"], filled part by part."""
    shape = request.validate
    phases.plan(2 + (2 * shape.repeats + 3 if shape else 0))
    report.update(run_analysis(request, phases))
    if shape:
        report["validate"] = {"interrupted": True}  # cleared once every part is done
        run_validation(request.engines, request.items, report, shape, phases)


@dataclass
class _Replay:
    """What the analysis measured on the reference engine."""

    prompt_ids: list[list[int]]
    outputs: list  # generated token ids per prompt
    trajectories: list  # (loop states, token roles) per prompt
    timer: D.StepTimer


def run_analysis(request: DepthRequest, phases: Phases) -> dict[str, Any]:
    """q90 of the state distance by role at each P, the recommended (S, P), R_layer and Amdahl."""
    setup = request.engines.build(request.s_ref)
    s_ref = setup.engine.max_loops
    s = s_ref if request.s is None else request.s
    D.check_cell(s, request.p if request.p is not None else 1, s_ref)
    replay = _generate_and_replay(setup, request, s_ref, phases)
    table = D.q90_table(replay.trajectories, s_ref)
    rec_p = D.recommend(table, s, request.tau)
    items = request.items
    recorded = not request.use_generated and all(it.answer is not None for it in items)
    return {
        "header": run_header(setup),
        "prompts": len(items),
        "answers": "recorded" if recorded else "generated",
        "s_ref": s_ref,
        "S": s,
        "tau": request.tau,
        "tokens_by_role": table.counts,
        "q90": table.rows(),
        "q90_at_S": [{"P": q, **{r: D._num(table.get(r, s, q)) for r in D.ROLES}} for q in range(1, s)],
        "recommended": {"S": s, "P": rec_p, "split": rec_p < s},
        "layer_model": _layer_model(setup.engine, replay, s, rec_p if request.p is None else request.p),
    }


def _generate_and_replay(setup: EngineSetup, request: DepthRequest, s_ref: int, phases: Phases) -> _Replay:
    """1. Generate at S_ref, timed by stage (the prefill fraction f of Eq. 4). 2. Replay prompt + answer
    once at S_ref, capturing every loop's state at every position."""
    engine, tok, items = setup.engine, _tokenizer(setup), request.items
    phases.start(f"generating at S_ref={s_ref} ({len(items)} prompts)", 0)
    timer = D.StepTimer()
    engine.attach(timer)
    budget = answer_budget(tok, items) if all(it.answer is not None for it in items) else 32
    texts, outs = generate_texts(engine, tok, [it.prompt for it in items], budget)
    engine.detach(timer)
    phases.start(f"replaying at S_ref={s_ref}: every loop's state", 1)
    capture = D.StateCapture()
    engine.attach(capture)
    prompt_ids = [encode_prompt(tok, it.prompt) for it in items]
    use_recorded = not request.use_generated
    answers = [it.answer if it.answer is not None and use_recorded else t for it, t in zip(items, texts)]
    answer_ids = [list(tok.encode(a)) for a in answers]
    rids = [
        engine.add_request(pi + ai, SamplingParams(max_tokens=1, seed=0))
        for pi, ai in zip(prompt_ids, answer_ids)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    engine.detach(capture)
    trajs = [
        (capture.trajectory(rid, len(pi) + len(ai), s_ref), D.roles_for(len(pi), len(ai)))
        for rid, pi, ai in zip(rids, prompt_ids, answer_ids)
    ]
    return _Replay(prompt_ids, outs, trajs, timer)


def _layer_model(engine, replay: _Replay, s: int, p: int) -> dict[str, Any]:
    """R_layer (Eq. 3) and R_prefill at (S, P) for the measured lengths; Amdahl (Eq. 4) with f."""
    spec, chunk = engine.spec, engine.snapshot().limits.prefill_chunk_size
    L = float(np.mean([len(x) for x in replay.prompt_ids]))
    Dlen = float(np.mean([len(o) for o in replay.outputs]))
    M = float(np.mean([math.ceil(len(x) / chunk) for x in replay.prompt_ids]))
    abc = (spec.n_prelude, spec.n_core, spec.n_coda)
    r_pre = D.r_prefill(L, s, p, *abc, chunks=M)
    f = replay.timer.prefill_fraction
    return {
        "P": p,
        "mean_prompt_len_L": round(L, 3),
        "mean_output_len_D": round(Dlen, 3),
        "mean_chunks_M": round(M, 3),
        "layers_prelude_core_coda": list(abc),
        "R_layer": round(D.r_layer(L, Dlen, s, p, *abc, chunks=M), 4),
        "R_prefill": round(r_pre, 4),
        "prefill_time_fraction_f": round(f, 4),
        "step_time_by_stage_s": {k: round(v, 4) for k, v in replay.timer.by_stage.items()},
        "R_time_amdahl": round(D.amdahl(f, r_pre), 4),
    }


class _Validation:
    """Engines at (S, S) and (S, P) with kv.layout=shared, and timed runs that stop on a Ctrl-C."""

    def __init__(self, engines: DepthEngines, s: int, p: int) -> None:
        self.engines, self.s, self.p = engines, s, p
        self.labels = {s: f"({s},{s})", p: f"({s},{p})"}

    def build(self, depth_p: int, extra: tuple[str, ...] = ()) -> EngineSetup:
        return self.engines.build(self.s, ("kv.layout=shared", f"depth.prefill_loops={depth_p}", *extra))

    @staticmethod
    def timed(setup: EngineSetup, workload):
        # deferred: loads torch
        from looptrace.drive.benchmark import run_workload

        rec = run_workload(setup.engine, workload)
        if rec.interrupted:  # run_workload keeps a Ctrl-C's partial record: stop here, keep what is done
            raise KeyboardInterrupt
        return rec


def run_validation(engines: DepthEngines, items: list, report: dict, shape: ValidateShape, phases) -> None:
    """Fill report["validate"] part by part (a Ctrl-C keeps the parts done); `interrupted` is set last."""
    s, p = report["S"], report["layer_model"]["P"]
    if p >= s:
        raise D.DepthInputError(f"--validate needs P < S; the analysis gives (S, P) = ({s}, {p}) (pass --p)")
    v = report["validate"]
    workload = {
        "prompt_len": shape.prompt_len,
        "answer_len": shape.answer_len,
        "requests": shape.requests,
        "repeats": shape.repeats,
    }
    v.update(S=s, P=p, workload=workload)
    val = _Validation(engines, s, p)
    best = _timed_runs(val, shape, v, phases)
    setup = val.build(s)
    v.update(_throughput(val, best, setup, shape))
    v["eval_exact_match"] = _eval_accuracy(val, setup, items, 2 + 2 * shape.repeats, phases)
    phases.start("--validate: queue-age controller, Poisson + burst", 4 + 2 * shape.repeats)
    v["controller"] = _controller(val, shape.answer_len)
    v["interrupted"] = False


def _timed_runs(val: _Validation, shape: ValidateShape, v: dict, phases: Phases) -> dict[int, Any]:
    """Alternate timed runs at (S, S) and (S, P); the best run of each (v["timed_runs_s"]: all of them)."""
    s, p = val.s, val.p
    wl = BurstWorkload(
        shape.requests,
        shape.prompt_len,
        shape.answer_len,
        seed=1,
        vocab_size=512,
        token_low=32,
        token_high=127,
    )
    runs: dict[int, list] = {s: [], p: []}
    v["timed_runs_s"] = {val.labels[s]: [], val.labels[p]: []}
    for r in range(shape.repeats):
        for depth_p in (s, p):
            label = val.labels[depth_p]
            phases.start(
                f"--validate: timed run {r + 1}/{shape.repeats} at {label}", 2 + 2 * r + (depth_p == p)
            )
            runs[depth_p].append(val.timed(val.build(depth_p), wl))
            v["timed_runs_s"][label].append(round(runs[depth_p][-1].duration, 4))
    return {k: min(x, key=lambda r: r.duration) for k, x in runs.items()}


def _throughput(val: _Validation, best: dict[int, Any], setup: EngineSetup, shape: ValidateShape) -> dict:
    """Throughput ratio of the best runs against R_layer, median TTFT and token agreement."""
    s, p, (ss, sp) = val.s, val.p, (val.labels[val.s], val.labels[val.p])
    thr = {k: len(r.requests) / r.duration for k, r in best.items()}
    ttft = {k: statistics.median(x.ttft for x in r.requests) for k, r in best.items()}
    pairs = zip(best[s].requests, best[p].requests)
    agree = [a == b for ra, rb in pairs for a, b in zip(ra.token_ids, rb.token_ids)]
    spec, chunk = setup.engine.spec, setup.engine.snapshot().limits.prefill_chunk_size
    abc = (spec.n_prelude, spec.n_core, spec.n_coda)
    chunks = math.ceil(shape.prompt_len / chunk)
    r_layer = D.r_layer(shape.prompt_len, shape.answer_len, s, p, *abc, chunks=chunks)
    return {
        "throughput_req_s": {ss: round(thr[s], 4), sp: round(thr[p], 4)},
        "speedup": round(thr[p] / thr[s], 4),
        "R_layer": round(r_layer, 4),
        "fraction_of_R_layer": round(thr[p] / thr[s] / r_layer, 4),
        "median_ttft_s": {ss: round(ttft[s], 4), sp: round(ttft[p], 4)},
        "token_agreement": round(sum(agree) / max(1, len(agree)), 4),
    }


def _eval_accuracy(val: _Validation, setup: EngineSetup, items: list, done: int, phases: Phases) -> dict:
    """Exact match at (S, S) and (S, P) on the evaluation set, with the paired difference and its SE."""
    ss, sp = val.labels[val.s], val.labels[val.p]
    tok = _tokenizer(setup)
    phases.start(f"--validate: exact match at {ss} ({len(items)} prompts)", done)
    acc_s, _ = exact_match(setup.engine, tok, items)
    phases.start(f"--validate: exact match at {sp} ({len(items)} prompts)", done + 1)
    acc_p, _ = exact_match(val.build(val.p).engine, tok, items)
    diff, se = paired_difference(acc_s, acc_p)
    return {
        ss: round(acc_s.value, 4),
        sp: round(acc_p.value, 4),
        "difference": round(diff, 4),
        "paired_se": round(se, 4),
        "n": acc_s.n,
    }


class PoissonBurst:
    """Poisson background arrivals plus one burst (the controller demo); prompts of printable ASCII ids."""

    def __init__(self, rate, n, burst_at, burst_n, prompt_len, max_tokens, seed=0):
        rng = np.random.default_rng(seed)
        arrivals = [float(t) for t in np.cumsum(rng.exponential(1 / rate, n))] + [burst_at] * burst_n
        self.items = [
            WorkItem([int(x) for x in rng.integers(32, 127, prompt_len)], max_tokens, t)
            for t in sorted(arrivals)
        ]
        self.label = f"Poisson {rate} req/s x {n} + burst of {burst_n} at t={burst_at} s, prompt {prompt_len}"

    def total_requests(self) -> int:
        return len(self.items)

    def initial_items(self):
        return list(self.items)

    def next_items(self, item, outputs, now):
        return []


def _controller(val: _Validation, answer_len: int) -> dict[str, Any]:
    """The queue-age controller under Poisson arrivals with a burst: P per step over time."""

    class DepthLog(Observer):
        def __init__(self) -> None:
            self.events = []

        def on_depth(self, event) -> None:
            self.events.append(event)

    s, p_min = val.s, max(1, val.p // 2)
    ctrl = ("depth.controller=queue_age", f"depth.p_max={s}", f"depth.p_min={p_min}")
    ctrl += ("scheduler.max_num_batched_tokens=128",)  # the base budget: ~2 prompts per prefill step
    setup = val.build(s, ctrl)
    log = DepthLog()
    setup.engine.attach(log)
    burst = PoissonBurst(rate=2.0, n=10, burst_at=2.0, burst_n=6, prompt_len=64, max_tokens=answer_len)
    t0 = val.timed(setup, burst).start_time
    timeline = [  # P acts on prefill steps: one point per prefill step
        (round(e.time - t0, 3), e.prefill_loops, round(e.queue_age_s or 0.0, 3))
        for e in log.events
        if e.stage == "prefill"
    ]
    ps = [x[1] for x in timeline]
    low = min(ps) if ps else None
    return {
        "p_max": s,
        "p_min": p_min,
        "workload": burst.label,
        "p_first": ps[0] if ps else None,
        "p_lowest": low,
        "p_last": ps[-1] if ps else None,
        "recovered": bool(ps) and ps[-1] > low,
        "timeline_s_p_q": timeline,
    }
