"""`looptrace run`: serve a workload on the reference engine and print vLLM-style serving metrics.

Thin: the run lives in looptrace.drive.run_request, its text in looptrace.drive.run_report."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import typer
from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn

from looptrace.cli import common as c
from looptrace.cli import options as o
from looptrace.cli.output import check_output, command_inputs, infer_format, write_output
from looptrace.drive.run_workload import WorkloadKind, resolve_workload

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
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive import run_request as R
    from looptrace.drive.run_report import render

    fmt = infer_format(a.fmt, a.output)
    progress = a.progress and c.err_console.is_terminal  # a pipe or a log file gets no bar remnants
    request = _request(a)
    with c.friendly_errors():
        R.check(request)
        with c.spinner(progress, "preparing the workload and the engine"):
            run = R.prepare(request)
    if (line := R.batch_note(run, request)) is not None:
        c.note(line)
    with _progress(progress, run.workload) as on_progress:
        result = R.execute(run, request, on_progress)
    for line, label in result.notes():
        c.note(line, label)
    text = render(result.data, fmt)
    with c.friendly_errors():
        write_output(text, a.output, Console(width=120), fmt, lambda: render(result.data, "table"))
    if result.data["header"]["weights"] == "random (seeded)":
        c.note("these were seeded random weights: pass a trained checkpoint with --weights DIR", "next")
    if result.interrupted:
        raise typer.Exit(c.EXIT_INTERRUPTED)


def _request(a: SimpleNamespace):
    """The options as a RunRequest: the workload's kind resolved and the output checked before any work."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.drive.run_request import RunRequest

    with c.friendly_errors():
        kind = resolve_workload(a.workload, a.prompts, a.rate, a.num_requests)
        check_output(a.output, inputs=command_inputs(a.prompts, a.recipe, a.weights))
    options = "concurrency prompt_len max_tokens rate num_requests sessions turns turn_prompt_len prompts"
    sampling = c.pick(a, "temperature top_k top_p")
    return RunRequest(c.build_request(a), kind, **c.pick(a, options), **sampling)


@contextmanager
def _progress(show: bool, workload):
    """A progress bar on stderr while the workload is served: yields its callback, or None."""
    if not show:
        yield None
        return
    columns = (MofNCompleteColumn(), TextColumn("requests"), TextColumn("{task.fields[tokens]} tokens"))
    with c.progress_bar(c.err_console, *columns) as bar:
        task = bar.add_task("serving", total=workload.total_requests(), tokens=0)

        def on_progress(done: int, total: int, tokens: int) -> None:
            bar.update(task, completed=done, total=total, tokens=tokens)

        yield on_progress
