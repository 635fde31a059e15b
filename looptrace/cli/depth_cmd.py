"""`looptrace depth`: LoopDuet state-distance analysis, the (S, P) recommendation, R_layer and Amdahl.

Thin: the math lives in looptrace.analysis.depth, evaluation in looptrace.train.evaluate.
"""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from looptrace.cli.common import (
    EXIT_INTERRUPTED,
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    OutputFormat,
    OutputOpt,
    RandomWeightsOpt,
    RecipeOpt,
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    UsageError,
    WeightsOpt,
    build_engine,
    check_output_path,
    command_inputs,
    dumps,
    err_console,
    fail,
    friendly_errors,
    run_header,
    write_output,
)
from looptrace.cli.output import infer_format

EPILOG = """
[bold]EXAMPLES[/bold]

  looptrace depth --model huginn                       # built-in eval set, S_ref = the model's loops
  looptrace depth --model huginn --s-ref 16 --tau 0.24 --format json -o depth.json
  looptrace depth --model huginn --accuracy-by-depth 1,2,4,8,16 --limit 500

[bold]EXIT CODES[/bold]  0 ok · 2 bad input (tau outside (0, 1), P > S, prompts without 'prompt'/'answer')
"""

DepthListOpt = Annotated[
    str | None,
    typer.Option(
        "--accuracy-by-depth",
        help="Comma-separated loop counts: report exact-match accuracy at each depth (no analysis).",
        show_default=False,
    ),
]


def _loops_max() -> int:
    from looptrace.engine.config import LOOPS_MAX

    return LOOPS_MAX


def _depths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--accuracy-by-depth '{text}': expected comma-separated integers") from None
    if not out or min(out) < 1 or max(out) > _loops_max():
        raise UsageError(f"--accuracy-by-depth '{text}': expected loop counts from 1 to {_loops_max()}")
    return out


def _check_loops(**options: int | None) -> None:
    """--s-ref / --s / --p are loop counts: named in the error, not as the exit.* setting they become."""
    for name, value in options.items():
        if value is not None and not 1 <= value <= _loops_max():
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value}: expected a loop count from 1 to {_loops_max()}")


def _check_memory(model: str, depths: list[int], option: str, items, common: dict[str, Any]) -> None:
    """Before any engine: the KV pool (one plane per loop) and, for the analysis, the captured loop states
    (float64, every position x loop) at each depth must fit; the error names `option`."""
    import torch

    from looptrace.cli.common import peek_spec, resolve_device, resolve_dtype
    from looptrace.engine.budget import Need, check_memory, engine_needs
    from looptrace.recipes import load_recipe

    dev = resolve_device(common["device"])
    elt = torch.empty((), dtype=resolve_dtype(common["dtype"], dev)).element_size()
    spec = peek_spec(model, common["device"], common["weights"])
    positions = sum(len(it.prompt) + len(it.answer or "") + 32 for it in items)  # ~1 token per character
    for d in depths or [spec.default_loops]:
        cfg = load_recipe(common["recipe"], _engine_sets(d, common, batch=64)).config
        needs = [
            Need(n.what, n.nbytes, option, n.host) if n.what == "KV pool" else n
            for n in engine_needs(spec, cfg, elt, dev)
        ]
        if option == "--s-ref":
            needs.append(Need("captured loop states", positions * d * spec.hidden_size * 8, "--s-ref", True))
        check_memory(needs, dev, context=f"{option} {d}")


class _Phases:
    """Rich progress on stderr (drawn only on a terminal): the phase running, phases done, elapsed time."""

    def __init__(self, show: bool) -> None:
        self.bar = None
        if show:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=err_console,
                transient=True,
            )
            self.task = self.bar.add_task("starting", total=None)

    def plan(self, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, total=total, completed=0)

    def start(self, what: str, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done)

    def __enter__(self) -> _Phases:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def depth(
    model: Annotated[
        str, typer.Option("--model", "-m", help="Family or preset (huginn -> huginn-tiny on CPU).")
    ] = "huginn",
    prompts: Annotated[
        Path | None,
        typer.Option(help='JSONL of {"prompt": ..., "answer": ...}; default: the built-in evaluation set.'),
    ] = None,
    s_ref: Annotated[
        int | None, typer.Option("--s-ref", help="Reference depth (default: the model's loops).")
    ] = None,
    s: Annotated[
        int | None, typer.Option("--s", help="Decoding depth S of the recommendation (default S_ref).")
    ] = None,
    p: Annotated[
        int | None, typer.Option("--p", help="Report R_layer / Amdahl at this P (default: recommended).")
    ] = None,
    tau: Annotated[float, typer.Option(help="Prompt-token q90 threshold, in (0, 1).")] = 0.24,
    limit: Annotated[int, typer.Option(help="Use the first N prompts (0 = all).")] = 64,
    use_generated: Annotated[
        bool,
        typer.Option("--use-generated", help="Replay the generated answers even where 'answer' is given."),
    ] = False,
    accuracy_by_depth: DepthListOpt = None,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate",
            help="Serve (S, S) and (S, P) (kv.layout=shared): throughput ratio vs R_layer, TTFT, token "
            "agreement, eval accuracy with paired SE; plus a Poisson+burst run of the queue-age controller.",
        ),
    ] = False,
    val_prompt_len: Annotated[
        int, typer.Option(help="--validate: prompt tokens of the throughput workload.")
    ] = 192,
    val_answer_len: Annotated[int, typer.Option(help="--validate: output tokens per request.")] = 4,
    val_requests: Annotated[int, typer.Option(help="--validate: requests in the throughput burst.")] = 4,
    repeats: Annotated[int, typer.Option(help="--validate: timed runs per depth (best kept).")] = 2,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    recipe: RecipeOpt = "base",
    sets: SetOpt = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    progress: Annotated[bool, typer.Option(help="Show progress on stderr (when it is a terminal).")] = True,
) -> None:
    """State distance per loop (q90 by token role), recommended (S, P), R_layer (Eq. 3), Amdahl (Eq. 4)."""
    from looptrace.analysis import depth as D
    from looptrace.train.evaluate import EvalSetError

    fmt = infer_format(fmt, output)
    report: dict[str, Any] = {}  # filled as the work goes: a Ctrl-C writes what was measured
    try:
        with friendly_errors(), _Phases(progress and err_console.is_terminal) as phases:
            try:
                D.check_tau(tau)
                _check_loops(s_ref=s_ref, s=s, p=p)
                check_output_path(output, inputs=command_inputs(prompts, recipe, weights))
                if limit < 0:
                    raise UsageError(f"--limit must be >= 0, got {limit}")
                if min(val_prompt_len, val_answer_len, val_requests, repeats) < 1:
                    raise UsageError(
                        "--val-prompt-len, --val-answer-len, --val-requests and --repeats must be >= 1"
                    )
                common = dict(
                    recipe=recipe,
                    sets=sets,
                    device=device,
                    dtype=dtype,
                    weights=weights,
                    seed=seed,
                    threads=threads,
                    random_weights=random_weights,
                )
                items = _items(prompts, limit, need_answer=accuracy_by_depth is not None, model=model)
                if accuracy_by_depth is not None:
                    depths = _depths(accuracy_by_depth)
                    _check_memory(model, depths, "--accuracy-by-depth", items, common)
                    _accuracy(model, items, depths, common, report, phases)
                else:
                    _check_memory(model, [s_ref] if s_ref else [], "--s-ref", items, common)
                    phases.plan(2 + (2 * repeats + 3 if validate else 0))
                    report.update(_analysis(D, model, items, s_ref, s, p, tau, use_generated, common, phases))
                    if validate:
                        shape = (val_prompt_len, val_answer_len, val_requests, repeats)
                        report["validate"] = {"interrupted": True}
                        _validate(D, model, items, report, shape, common, phases)
            except (D.DepthInputError, EvalSetError) as exc:
                raise fail(str(exc)) from None
    except KeyboardInterrupt:
        _interrupted(report, fmt, output, by_depth=accuracy_by_depth is not None)
    if accuracy_by_depth is not None:
        _emit_accuracy(report, fmt, output)
    else:
        _emit(report, fmt, output)


def _interrupted(report: dict[str, Any], fmt: OutputFormat, output: Path | None, *, by_depth: bool):
    """Ctrl-C: write what was measured (the analysis, the --validate parts done, the depths), exit 130."""
    from rich.text import Text

    done = report.get("accuracy_by_depth") if by_depth else report.get("q90")
    if done:
        report["interrupted"] = True
        (_emit_accuracy if by_depth else _emit)(report, fmt, output)
        what = "interrupted: wrote what was measured before the Ctrl-C"
    else:
        what = "interrupted: nothing was measured yet"
    err_console.print(Text(what, style="yellow"), soft_wrap=True)
    raise typer.Exit(EXIT_INTERRUPTED)


# Work -------------------------------------------------------------------------------------------------------
def _items(prompts: Path | None, limit: int, *, need_answer: bool, model: str):
    from looptrace.assets import default_eval_set
    from looptrace.train.evaluate import read_items

    path = prompts
    if path is None:
        path = default_eval_set()
        if path is None:
            raise UsageError("no built-in evaluation set is installed; pass --prompts FILE.jsonl")
    items = read_items(path, need_answer=need_answer)
    return items[:limit] if limit else items


def _engine_sets(loops: int | None, common: dict[str, Any], batch: int) -> list[str]:
    sets = [
        f"scheduler.max_num_seqs={batch}",
        "scheduler.max_num_batched_tokens=2048",
        "kv.prefix_caching=false",
    ]
    if loops is not None:
        sets += [f"exit.max_loops={loops}", f"exit.min_loops={min(2, loops)}"]  # min_loops <= max_loops
    return sets + list(common["sets"] or [])  # the user's --set wins


def _engine(model: str, loops: int | None, common: dict[str, Any], batch: int):
    return build_engine(model=model, **{**common, "sets": _engine_sets(loops, common, batch)})


def _tokenizer(setup):
    from looptrace.engine.tokenizer import load_tokenizer

    return load_tokenizer(setup.weights)


def _accuracy(model: str, items, depths: list[int], common: dict[str, Any], report: dict, phases) -> None:
    from looptrace.train.evaluate import exact_match

    phases.plan(len(depths))
    rows = report.setdefault("accuracy_by_depth", [])
    for i, d in enumerate(depths):
        phases.start(f"exact match at {d} loops ({len(items)} prompts)", i)
        setup = _engine(model, d, common, batch=64)
        report.setdefault("header", run_header(setup))
        acc, _ = exact_match(setup.engine, _tokenizer(setup), items)
        rows.append(
            {"loops": d, "exact_match": round(acc.value, 4), "stderr": round(acc.stderr, 4), "n": acc.n}
        )


def _analysis(D, model, items, s_ref, s, p, tau, use_generated, common, phases) -> dict:
    import numpy as np

    from looptrace.engine.request import SamplingParams
    from looptrace.train.evaluate import answer_budget, encode_prompt, generate_texts

    setup = _engine(model, s_ref, common, batch=64)
    engine, tok = setup.engine, _tokenizer(setup)
    s_ref = engine.max_loops
    s = s_ref if s is None else s
    D.check_cell(s, p if p is not None else 1, s_ref)
    # 1. Generate at the reference depth (timed by stage: the prefill fraction f of Eq. 4).
    phases.start(f"generating at S_ref={s_ref} ({len(items)} prompts)", 0)
    timer = D.StepTimer()
    engine.attach(timer)
    budget = answer_budget(tok, items) if all(it.answer is not None for it in items) else 32
    texts, outs = generate_texts(engine, tok, [it.prompt for it in items], budget)
    engine.detach(timer)
    # 2. Replay prompt + answer once at S_ref, capturing every loop's state at every position.
    phases.start(f"replaying at S_ref={s_ref}: every loop's state", 1)
    capture = D.StateCapture()
    engine.attach(capture)
    prompt_ids = [encode_prompt(tok, it.prompt) for it in items]
    answers = [it.answer if it.answer is not None and not use_generated else t for it, t in zip(items, texts)]
    answer_ids = [list(tok.encode(a)) for a in answers]
    rids = [
        engine.add_request(pi + ai, SamplingParams(max_tokens=1, seed=0))
        for pi, ai in zip(prompt_ids, answer_ids)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    engine.detach(capture)
    trajs = []
    for rid, pi, ai in zip(rids, prompt_ids, answer_ids):
        trajs.append((capture.trajectory(rid, len(pi) + len(ai), s_ref), D.roles_for(len(pi), len(ai))))
    table = D.q90_table(trajs, s_ref)
    rec_p = D.recommend(table, s, tau)
    use_p = rec_p if p is None else p
    spec, cfg = engine.spec, engine.cfg
    L = float(np.mean([len(x) for x in prompt_ids]))
    Dlen = float(np.mean([len(o) for o in outs]))
    M = float(np.mean([math.ceil(len(x) / cfg.scheduler.prefill_chunk_size) for x in prompt_ids]))
    abc = (spec.n_prelude, spec.n_core, spec.n_coda)
    r_layer = D.r_layer(L, Dlen, s, use_p, *abc, chunks=M)
    r_pre = D.r_prefill(L, s, use_p, *abc, chunks=M)
    f = timer.prefill_fraction
    return {
        "header": run_header(setup),
        "prompts": len(items),
        "answers": "recorded"
        if not use_generated and all(it.answer is not None for it in items)
        else "generated",
        "s_ref": s_ref,
        "S": s,
        "tau": tau,
        "tokens_by_role": table.counts,
        "q90": table.rows(),
        "q90_at_S": [{"P": q, **{r: D._num(table.get(r, s, q)) for r in D.ROLES}} for q in range(1, s)],
        "recommended": {"S": s, "P": rec_p, "split": rec_p < s},
        "layer_model": {
            "P": use_p,
            "mean_prompt_len_L": round(L, 3),
            "mean_output_len_D": round(Dlen, 3),
            "mean_chunks_M": round(M, 3),
            "layers_prelude_core_coda": list(abc),
            "R_layer": round(r_layer, 4),
            "R_prefill": round(r_pre, 4),
            "prefill_time_fraction_f": round(f, 4),
            "step_time_by_stage_s": {k: round(v, 4) for k, v in timer.by_stage.items()},
            "R_time_amdahl": round(D.amdahl(f, r_pre), 4),
        },
    }


class _PoissonBurst:
    """Poisson background arrivals plus one burst (the controller demo); prompts of printable ASCII ids."""

    def __init__(self, rate, n, burst_at, burst_n, prompt_len, max_tokens, seed=0):
        import numpy as np

        from looptrace.drive.workloads import WorkItem

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


def _validate(D, model, items, report, shape, common, phases) -> None:
    """Fill report["validate"] part by part (a Ctrl-C keeps the parts done); `interrupted` is set last."""
    import statistics

    from looptrace.drive.benchmark import run_workload
    from looptrace.drive.workloads import BurstWorkload
    from looptrace.train.evaluate import exact_match, paired_difference

    prompt_len, answer_len, n_req, repeats = shape
    s, p = report["S"], report["layer_model"]["P"]
    if p >= s:
        raise UsageError(f"--validate needs P < S; the analysis gives (S, P) = ({s}, {p}) (pass --p)")
    v = report["validate"]
    v.update(
        S=s,
        P=p,
        workload={"prompt_len": prompt_len, "answer_len": answer_len, "requests": n_req, "repeats": repeats},
    )
    ss, sp = f"({s},{s})", f"({s},{p})"

    def engine(depth_p: int, extra=()):
        sets = ["kv.layout=shared", f"depth.prefill_loops={depth_p}", *extra, *(common["sets"] or [])]
        return _engine(model, s, {**common, "sets": sets}, batch=64)

    def timed(setup, workload):
        rec = run_workload(setup.engine, workload)
        if rec.interrupted:  # run_workload keeps a Ctrl-C's partial record: stop here, keep what is done
            raise KeyboardInterrupt
        return rec

    wl = BurstWorkload(n_req, prompt_len, answer_len, seed=1, vocab_size=512, token_low=32, token_high=127)
    runs: dict[int, list] = {s: [], p: []}
    v["timed_runs_s"] = {ss: [], sp: []}
    for r in range(repeats):
        for depth_p, label in ((s, ss), (p, sp)):
            phases.start(f"--validate: timed run {r + 1}/{repeats} at {label}", 2 + 2 * r + (depth_p == p))
            runs[depth_p].append(timed(engine(depth_p), wl))
            v["timed_runs_s"][label].append(round(runs[depth_p][-1].duration, 4))
    best = {k: min(x, key=lambda r: r.duration) for k, x in runs.items()}
    thr = {k: len(r.requests) / r.duration for k, r in best.items()}
    ttft = {k: statistics.median(x.ttft for x in r.requests) for k, r in best.items()}
    pairs = zip(best[s].requests, best[p].requests)
    agree = [a == b for ra, rb in pairs for a, b in zip(ra.token_ids, rb.token_ids)]
    setup = engine(s)
    spec, chunk = setup.engine.spec, setup.engine.cfg.scheduler.prefill_chunk_size
    abc = (spec.n_prelude, spec.n_core, spec.n_coda)
    r_layer = D.r_layer(prompt_len, answer_len, s, p, *abc, chunks=math.ceil(prompt_len / chunk))
    v.update(
        throughput_req_s={ss: round(thr[s], 4), sp: round(thr[p], 4)},
        speedup=round(thr[p] / thr[s], 4),
        R_layer=round(r_layer, 4),
        fraction_of_R_layer=round(thr[p] / thr[s] / r_layer, 4),
        median_ttft_s={ss: round(ttft[s], 4), sp: round(ttft[p], 4)},
        token_agreement=round(sum(agree) / max(1, len(agree)), 4),
    )
    tok = _tokenizer(setup)
    phases.start(f"--validate: exact match at {ss} ({len(items)} prompts)", 2 + 2 * repeats)
    acc_s, _ = exact_match(setup.engine, tok, items)
    phases.start(f"--validate: exact match at {sp} ({len(items)} prompts)", 3 + 2 * repeats)
    acc_p, _ = exact_match(engine(p).engine, tok, items)
    diff, se = paired_difference(acc_s, acc_p)
    v["eval_exact_match"] = {
        ss: round(acc_s.value, 4),
        sp: round(acc_p.value, 4),
        "difference": round(diff, 4),
        "paired_se": round(se, 4),
        "n": acc_s.n,
    }
    phases.start("--validate: queue-age controller, Poisson + burst", 4 + 2 * repeats)
    v["controller"] = _controller(model, s, p, answer_len, engine, timed)
    v["interrupted"] = False


def _controller(model, s: int, p: int, answer_len: int, engine, timed) -> dict[str, Any]:
    """The queue-age controller under Poisson arrivals with a burst: P per step over time."""
    from looptrace.engine.hooks import Observer

    class DepthLog(Observer):
        def __init__(self) -> None:
            self.events = []

        def on_depth(self, event) -> None:
            self.events.append(event)

    p_min = max(1, p // 2)
    ctrl = ["depth.controller=queue_age", f"depth.p_max={s}", f"depth.p_min={p_min}"]
    ctrl.append("scheduler.max_num_batched_tokens=128")  # the base budget: ~2 prompts per prefill step
    setup_c = engine(s, ctrl)
    log = DepthLog()
    setup_c.engine.attach(log)
    burst = _PoissonBurst(rate=2.0, n=10, burst_at=2.0, burst_n=6, prompt_len=64, max_tokens=answer_len)
    rec_c = timed(setup_c, burst)
    t0 = rec_c.start_time
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


# Output -----------------------------------------------------------------------------------------------------
def _plot(report: dict) -> str:
    import plotext as plt

    from looptrace.analysis.depth import PAPER_DECODE_TAU, ROLE_LABELS, ROLES

    rows = report["q90_at_S"]
    xs = [r["P"] for r in rows]
    plt.clear_figure()
    plt.plot_size(78, 20)
    plt.theme("clear")
    for role, marker in zip(ROLES, ("dot", "x", "+")):
        pts = [(x, r[role]) for x, r in zip(xs, rows) if r[role] is not None]
        if pts:
            plt.plot([a for a, _ in pts], [b for _, b in pts], label=ROLE_LABELS[role], marker=marker)
    plt.horizontal_line(report["tau"])
    plt.horizontal_line(PAPER_DECODE_TAU)
    plt.title(f"q90 of d(P; S={report['S']}) vs prefill loops P  (lines: tau={report['tau']}, decode 0.11)")
    plt.xlabel("P (loops)")
    plt.xticks(xs)
    return re.sub(r"\x1b\[[0-9;]*m", "", plt.build())  # plain text: files and pipes get no ANSI codes


def _emit(report: dict, fmt: OutputFormat, output: Path | None) -> None:
    console = Console(highlight=False)
    if fmt == OutputFormat.json:
        write_output(dumps(report), output, console)
        return
    if fmt == OutputFormat.csv:
        buf = io.StringIO()
        w = csv.DictWriter(
            buf, fieldnames=["S", "P", "prompt", "final_prefill", "decode"], lineterminator="\n"
        )
        w.writeheader()
        w.writerows(report["q90"])
        write_output(buf.getvalue().rstrip("\n"), output, console)
        return
    h, lm, rec = report["header"], report["layer_model"], report["recommended"]
    lines = [
        f"{h['model_preset']} ({h['family']}), weights: {h['weights']}; {report['prompts']} prompts, "
        f"{report['answers']} answers replayed at S_ref={report['s_ref']}",
        f"tokens by role: {report['tokens_by_role']}",
        "",
        f"q90 of d_i(P; S={report['S']}) = ||h^P - h^S|| / ||h^S||",
        f"{'P':>3} {'prompt':>10} {'final':>10} {'decode':>10}",
    ]
    for r in report["q90_at_S"]:
        cells = " ".join(
            f"{'-' if r[k] is None else format(r[k], '.4f'):>10}"
            for k in ("prompt", "final_prefill", "decode")
        )
        lines.append(f"{r['P']:>3} {cells}")
    split = (
        f"(S, P) = ({rec['S']}, {rec['P']})"
        if rec["split"]
        else f"no P < S meets tau: run ({rec['S']}, {rec['S']})"
    )
    lines += [
        "",
        f"recommended: {split}  (smallest P with prompt-token q90 <= tau={report['tau']})",
        f"R_layer (Eq. 3) at P={lm['P']}: {lm['R_layer']:.3f}  (L={lm['mean_prompt_len_L']}, "
        f"D={lm['mean_output_len_D']}, M={lm['mean_chunks_M']}, "
        f"layers a/b/c={lm['layers_prelude_core_coda']})",
        f"prefill time fraction f={lm['prefill_time_fraction_f']:.3f} (engine step events), "
        f"prefill layer ratio r={lm['R_prefill']:.3f} -> Amdahl R_time (Eq. 4, eps=0) = "
        f"{lm['R_time_amdahl']:.3f}",
        "",
        _plot(report),
    ]
    if "validate" in report:
        lines += _validate_lines(report["validate"])
    write_output("\n".join(lines), output, console)


def _emit_accuracy(report: dict, fmt: OutputFormat, output: Path | None) -> None:
    console = Console(highlight=False)
    rows = report["accuracy_by_depth"]
    if fmt == OutputFormat.json:
        write_output(dumps(report), output, console)
        return
    if fmt == OutputFormat.csv:
        text = "loops,exact_match,stderr,n\n" + "\n".join(
            f"{r['loops']},{r['exact_match']},{r['stderr']},{r['n']}" for r in rows
        )
        write_output(text, output, console)
        return
    h = report["header"]
    lines = [
        f"{h['model_preset']} ({h['family']}), weights: {h['weights']}",
        f"{'loops':>5} {'exact match':>12} {'± se':>8} {'n':>5}",
    ]
    lines += [
        f"{r['loops']:>5} {r['exact_match'] * 100:>11.1f}% {r['stderr'] * 100:>7.1f} {r['n']:>5}"
        for r in rows
    ]
    write_output("\n".join(lines), output, console)


def _validate_lines(v: dict) -> list[str]:
    import plotext as plt

    if "S" not in v:
        return ["", "--validate: interrupted before its first run"]
    s, p, w = v["S"], v["P"], v["workload"]
    ss, sp = f"({s},{s})", f"({s},{p})"
    lines = [
        "",
        f"--validate: kv.layout=shared, burst of {w['requests']} x {w['prompt_len']}-token prompts, "
        f"{w['answer_len']} output tokens, best of {w['repeats']}",
    ]
    if v.get("interrupted"):
        runs = v.get("timed_runs_s") or {}
        lines.append(
            "  interrupted: timed runs done "
            + ", ".join(f"{k} {len(x)}/{w['repeats']}" for k, x in runs.items())
            + "; the parts below are the ones that finished"
        )
    if "throughput_req_s" in v:
        lines += [
            f"  throughput {ss} {v['throughput_req_s'][ss]:.3f} req/s, "
            f"{sp} {v['throughput_req_s'][sp]:.3f} req/s: speedup {v['speedup']:.3f}x vs R_layer "
            f"{v['R_layer']:.3f} ({v['fraction_of_R_layer'] * 100:.0f}%)",
            f"  median TTFT {ss} {v['median_ttft_s'][ss]:.3f} s, {sp} {v['median_ttft_s'][sp]:.3f} s; "
            f"token agreement {v['token_agreement'] * 100:.1f}%",
        ]
    acc = v.get("eval_exact_match")
    if acc:
        lines.append(
            f"  eval exact match {ss} {acc[ss] * 100:.1f}%, {sp} {acc[sp] * 100:.1f}%: difference "
            f"{acc['difference'] * 100:+.1f} +- {acc['paired_se'] * 100:.1f} pts (paired SE, n={acc['n']})"
        )
    c = v.get("controller")
    if c:
        lines.append(
            f"  controller (P_max={c['p_max']}, P_min={c['p_min']}), {c['workload']}: P first "
            f"{c['p_first']}, lowest {c['p_lowest']}, last {c['p_last']} (recovered: {c['recovered']})"
        )
    if c and c["timeline_s_p_q"]:
        plt.clear_figure()
        plt.plot_size(78, 12)
        plt.theme("clear")
        timeline = c["timeline_s_p_q"]
        plt.scatter([t for t, _, _ in timeline], [q for _, q, _ in timeline], marker="dot")
        plt.title("queue-age controller: P at each prefill step vs time (s)")
        lines.append(re.sub(r"\x1b\[[0-9;]*m", "", plt.build()))
    return lines
