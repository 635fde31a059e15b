"""`looptrace run`: serve a workload on the reference engine and print vLLM-style serving metrics."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer
from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn

from looptrace.build import build, check_seed, run_header
from looptrace.cli import common as c
from looptrace.cli import options as o
from looptrace.cli.output import check_output, command_inputs, infer_format, write_output
from looptrace.drive.run_workload import (
    WorkloadKind,
    check_fits,
    check_workload_memory,
    make_workload,
    resolve_workload,
    workload_max_len,
)

SCHEMA = "looptrace.run/1"

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace run --model ouro                                   # tiny Ouro on CPU, real shape on CUDA
  looptrace run --model huginn --workload burst -c 8 --prompt-len 64 --max-tokens 32
  looptrace run --model ouro-1.4b --set scheduler.max_num_seqs=32 -c 32 --format json -o run.json
  looptrace run --model ouro --workload poisson --rate 4 --num-requests 32
  looptrace run --model ouro --workload sessions --sessions 4 --turns 3
  looptrace run --model ouro --workload jsonl --prompts prompts.jsonl --weights ./Ouro-1.4B

[bold]JSONL PROMPTS[/]  (--prompts FILE, which implies --workload jsonl) one JSON object per line, blank
lines skipped:

  {"prompt": "Write a haiku about loops.", "max_tokens": 64}
  {"prompt_token_ids": [1, 2, 3], "arrival": 0.5}

  Exactly one of prompt (text: tokenized by tokenizer.json of --weights DIR, else as UTF-8 bytes) or
  prompt_token_ids (a non-empty list of ids within the model's vocabulary). Optional: max_tokens (default
  --max-tokens), arrival (seconds from the start, 0 to 1e7, default 0). Other keys are ignored; errors
  name FILE:LINE.

[bold]OUTPUT[/]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format is
given. The file is written whole and atomically, a symlink is written through, and a directory or a
device is refused before the run. Ctrl-C stops the run and reports what was measured so far.

[bold]LEARN MORE[/]  recipes/base.yaml lists every setting --set can change.
""" + c.EXIT_CODES_HELP.replace("missing", "missing (e.g. --device cuda without CUDA)")


WorkloadOpt = o.opt(
    WorkloadKind | None,
    help="Arrival pattern (default: burst; jsonl when --prompts is given).",
)
ConcurrencyOpt = o.opt(int, "--concurrency", "-c", help="Requests in the burst.")
RateOpt = o.opt(float | None, help="Poisson arrivals per second.")
NumRequestsOpt = o.opt(int | None, help="Poisson: number of requests (default -c).")
SessionsOpt = o.opt(int, help="Sessions workload: concurrent sessions.")
TurnsOpt = o.opt(int, help="Sessions workload: turns per session.")
TurnPromptLenOpt = o.opt(int, help="Sessions workload: new user tokens per turn.")
PromptsOpt = o.opt(Path | None, help="JSONL prompts file (implies --workload jsonl).")
TemperatureOpt = o.opt(float, help="0 = greedy.")
TopKOpt = o.opt(int, help="0 = off.")
TopPOpt = o.opt(float)


def run(
    model: o.ModelOpt = None,
    recipe: o.RecipeOpt = "base",
    sets: o.SetOpt = None,
    workload: WorkloadOpt = None,
    concurrency: ConcurrencyOpt = 8,
    prompt_len: o.PromptLenOpt = 64,
    max_tokens: o.MaxTokensOpt = 32,
    rate: RateOpt = None,
    num_requests: NumRequestsOpt = None,
    sessions: SessionsOpt = 4,
    turns: TurnsOpt = 3,
    turn_prompt_len: TurnPromptLenOpt = 16,
    prompts: PromptsOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    weights: o.WeightsOpt = None,
    seed: o.SeedOpt = 0,
    threads: o.ThreadsOpt = 1,
    fmt: o.FormatOpt = None,
    output: o.OutputOpt = None,
    progress: o.ProgressOpt = True,
) -> None:
    """Serve a workload on the reference engine; print throughput, TTFT/TPOT/ITL/E2EL, engine steps per
    token, KV capacity and CUDA-graph counters."""
    with c.interrupt_exit():  # Ctrl-C outside the serving loop: exit 130, no traceback
        _run(SimpleNamespace(**locals()))  # every option, by name


def _run(a: SimpleNamespace) -> None:
    from looptrace.drive.benchmark import run_workload
    from looptrace.drive.metrics import summarize
    from looptrace.drive.run_report import render
    from looptrace.engine.request import SamplingParams

    fmt = infer_format(a.fmt, a.output)
    progress = a.progress and c.err_console.is_terminal  # a pipe or a log file gets no bar remnants
    setup, wl = _prepare(a, progress)
    header = run_header(setup)
    header["workload"] = wl.describe()
    rows = setup.engine.cfg.scheduler.max_num_seqs
    if a.concurrency > rows:
        c.note(
            f"batches hold at most {rows} rows (scheduler.max_num_seqs); "
            f"pass --set scheduler.max_num_seqs={a.concurrency} to batch all {a.concurrency} requests"
        )
    seed = a.seed if a.temperature else None
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=seed)
    record = _run_with_progress(run_workload, setup.engine, wl, params, progress)
    metrics = summarize(record)
    rejected = [r for r in record.requests if r.finish_reason == "rejected"]
    if rejected:
        c.note(f"{len(rejected)} request(s) rejected: {rejected[0].error}")
    data = report_data(header, setup.engine, metrics)
    if record.interrupted:
        c.note(
            f"reporting what was measured so far ({metrics.tokens_sampled} tokens, "
            f"{metrics.completed} request(s) completed, {metrics.interrupted_requests} in flight)",
            "interrupted",
        )
    text = render(data, fmt)
    with c.friendly_errors():
        write_output(text, a.output, Console(width=120), fmt, lambda: render(data, "table"))
    if header["weights"] == "random (seeded)":
        c.note("these were seeded random weights: pass a trained checkpoint with --weights DIR", "next")
    if record.interrupted:
        raise typer.Exit(c.EXIT_INTERRUPTED)


def _prepare(a: SimpleNamespace, progress: bool):
    """Check the options, draw the workload and build an engine sized to it: (EngineSetup, workload)."""
    with c.friendly_errors():
        kind = resolve_workload(a.workload, a.prompts, a.rate, a.num_requests)
        check_output(a.output, inputs=command_inputs(a.prompts, a.recipe, a.weights))
        check_seed(a.seed)
        if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
            raise c.UsageError("sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        with c.spinner(progress, "preparing the workload and the engine"):
            request = c.build_request(a)
            resolved = request.resolve_model()
            workload = c.pick(a, "concurrency prompt_len max_tokens rate num_requests sessions turns")
            workload |= c.pick(a, "turn_prompt_len prompts seed")
            wl = make_workload(kind, **workload, vocab_size=resolved.spec.vocab_size, tokenizer_dir=a.weights)
            check_workload_memory(kind, wl)
            setup = build(replace(request, max_model_len=workload_max_len(wl)), resolved)
            check_fits(wl, setup.engine.max_model_len)
    return setup, wl


def _run_with_progress(run_workload, engine, wl, params, show: bool):
    if not show:
        return run_workload(engine, wl, params=params)
    columns = (MofNCompleteColumn(), TextColumn("requests"), TextColumn("{task.fields[tokens]} tokens"))
    with c.progress_bar(c.err_console, *columns) as bar:
        task = bar.add_task("serving", total=wl.total_requests(), tokens=0)

        def on_progress(done: int, total: int, tokens: int) -> None:
            bar.update(task, completed=done, total=total, tokens=tokens)

        return run_workload(engine, wl, params=params, on_progress=on_progress)


def report_data(header: dict[str, Any], engine, metrics) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "header": header,
        "metrics": metrics.to_dict(raw=False),
        "engine": {
            "steps": engine.stats.steps,
            "submissions": engine.stats.submissions,
            "steps_by_stage": engine.stats.steps_by_stage,
            "output_tokens": engine.stats.output_tokens,
        },
        "kv": engine.kv_summary() | {"prefix_cache": engine.snapshot().prefix.counters()},
        "cuda_graphs": engine.graph_counters(),
    }
