"""`looptrace run`: serve a workload on the reference engine and print vLLM-style serving metrics."""

from __future__ import annotations

import csv
import enum
import io
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from looptrace.cli.common import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    OutputOpt,
    RecipeOpt,
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    UsageError,
    WeightsOpt,
    build_engine,
    check_output_path,
    check_seed,
    command_inputs,
    dumps,
    err_console,
    friendly_errors,
    interrupt_exit,
    note,
    peek_spec,
    run_header,
    spinner,
    write_output,
)
from looptrace.cli.output import infer_format

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
""" + EXIT_CODES_HELP.replace("missing", "missing (e.g. --device cuda without CUDA)")


class WorkloadKind(str, enum.Enum):
    burst = "burst"
    poisson = "poisson"
    sessions = "sessions"
    jsonl = "jsonl"


def make_workload(
    kind: WorkloadKind,
    *,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    rate: float | None,
    num_requests: int | None,
    sessions: int,
    turns: int,
    turn_prompt_len: int,
    prompts: Path | None,
    seed: int,
    vocab_size: int,
    tokenizer_dir: Path | None,
):
    """CLI options -> a Workload; the workload validates its own numbers (one-line WorkloadError)."""
    from looptrace.drive import workloads as w

    if kind == WorkloadKind.burst:
        return w.BurstWorkload(
            concurrency=concurrency,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            seed=seed,
            vocab_size=vocab_size,
        )
    if kind == WorkloadKind.poisson:
        if rate is None:
            raise UsageError("--workload poisson needs --rate (requests per second)")
        return w.PoissonWorkload(
            rate=rate,
            num_requests=concurrency if num_requests is None else num_requests,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            seed=seed,
            vocab_size=vocab_size,
        )
    if kind == WorkloadKind.sessions:
        return w.SessionWorkload(
            num_sessions=sessions,
            turns=turns,
            first_prompt_len=prompt_len,
            turn_prompt_len=turn_prompt_len,
            max_tokens=max_tokens,
            seed=seed,
            vocab_size=vocab_size,
        )
    if prompts is None:
        raise UsageError("--workload jsonl needs --prompts FILE")
    from looptrace.engine.tokenizer import load_tokenizer

    return w.JsonlWorkload(
        path=prompts,
        tokenizer=load_tokenizer(tokenizer_dir),
        default_max_tokens=max_tokens,
        vocab_size=vocab_size,
    )


def resolve_workload(
    kind: WorkloadKind | None, prompts: Path | None, rate: float | None, num_requests: int | None
) -> WorkloadKind:
    """--prompts FILE alone implies --workload jsonl; an option of another workload than the one chosen
    is an error (it would be silently ignored)."""
    kind = kind or (WorkloadKind.jsonl if prompts is not None else WorkloadKind.burst)
    if prompts is not None and kind != WorkloadKind.jsonl:
        raise UsageError(f"--prompts FILE is for --workload jsonl, not --workload {kind.value}")
    for flag, value in (("--rate", rate), ("--num-requests", num_requests)):
        if value is not None and kind != WorkloadKind.poisson:
            raise UsageError(f"{flag} is for --workload poisson, not --workload {kind.value}")
    return kind


def check_workload_memory(kind: WorkloadKind, wl) -> None:
    """The prompts a synthetic workload draws, within host memory (before they are drawn)."""
    from looptrace.engine.budget import check_memory, workload_needs

    if kind == WorkloadKind.burst:
        requests, tokens, setting = wl.concurrency, wl.prompt_len, "--concurrency / --prompt-len"
    elif kind == WorkloadKind.poisson:
        requests, tokens, setting = wl.num_requests, wl.prompt_len, "--num-requests / --prompt-len"
    elif kind == WorkloadKind.sessions:
        requests, tokens = wl.num_sessions, wl.max_prompt_len()
        setting = "--sessions / --turns / --prompt-len"
    else:
        return  # a JSONL file is already in memory
    check_memory(workload_needs(requests, tokens, setting), "cpu")


def workload_max_len(workload) -> int:
    """Longest prompt + output any item of the workload can need (sizes the engine's decode tables)."""
    if hasattr(workload, "max_prompt_len"):
        longest = workload.max_prompt_len()
    else:
        longest = max((len(i.prompt) for i in workload.initial_items()), default=1)
    most = max((i.max_tokens for i in workload.initial_items()), default=1)
    return longest + max(most, getattr(workload, "max_tokens", 0))


def run(
    model: ModelOpt = None,
    recipe: RecipeOpt = "base",
    sets: SetOpt = None,
    workload: Annotated[
        WorkloadKind | None,
        typer.Option(
            help="Arrival pattern (default: burst; jsonl when --prompts is given).", show_default=False
        ),
    ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Requests in the burst.")] = 8,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens (random ids).")] = 64,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 32,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals per second.")] = None,
    num_requests: Annotated[
        int | None, typer.Option(help="Poisson: number of requests (default -c).")
    ] = None,
    sessions: Annotated[int, typer.Option(help="Sessions workload: concurrent sessions.")] = 4,
    turns: Annotated[int, typer.Option(help="Sessions workload: turns per session.")] = 3,
    turn_prompt_len: Annotated[int, typer.Option(help="Sessions workload: new user tokens per turn.")] = 16,
    prompts: Annotated[
        Path | None, typer.Option(help="JSONL prompts file (implies --workload jsonl).")
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    progress: Annotated[bool, typer.Option(help="Show progress on stderr (when it is a terminal).")] = True,
) -> None:
    """Serve a workload on the reference engine; print throughput, TTFT/TPOT/ITL/E2EL, engine steps per
    token, KV capacity and CUDA-graph counters."""
    from looptrace.drive.benchmark import run_workload
    from looptrace.drive.metrics import summarize
    from looptrace.engine.request import SamplingParams

    with interrupt_exit():  # Ctrl-C outside the serving loop: exit 130, no traceback
        fmt = infer_format(fmt, output)
        progress = progress and err_console.is_terminal  # a pipe or a log file gets no bar remnants
        with friendly_errors():
            kind = resolve_workload(workload, prompts, rate, num_requests)
            check_output_path(output, inputs=command_inputs(prompts, recipe, weights))
            check_seed(seed)
            if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
                raise UsageError("sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
            with spinner(progress, "preparing the workload and the engine"):
                spec = peek_spec(model, device, weights)
                wl = make_workload(
                    kind,
                    concurrency=concurrency,
                    prompt_len=prompt_len,
                    max_tokens=max_tokens,
                    rate=rate,
                    num_requests=num_requests,
                    sessions=sessions,
                    turns=turns,
                    turn_prompt_len=turn_prompt_len,
                    prompts=prompts,
                    seed=seed,
                    vocab_size=spec.vocab_size,
                    tokenizer_dir=weights,
                )
                check_workload_memory(kind, wl)
                setup = build_engine(
                    model=model,
                    recipe=recipe,
                    sets=sets,
                    device=device,
                    dtype=dtype,
                    weights=weights,
                    seed=seed,
                    threads=threads,
                    max_model_len=workload_max_len(wl),
                )
                check_fits(wl, setup.engine.max_model_len)
        header = run_header(setup)
        header["workload"] = wl.describe()
        for text in _notes(setup, concurrency):
            note(text)
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed if temperature else None
        )
        record = _run_with_progress(run_workload, setup.engine, wl, params, progress)
        metrics = summarize(record)
        rejected = [r for r in record.requests if r.finish_reason == "rejected"]
        if rejected:
            note(f"{len(rejected)} request(s) rejected: {rejected[0].error}")
        data = report_data(header, setup.engine, metrics)
        if record.interrupted:
            note(
                f"reporting what was measured so far ({metrics.tokens_sampled} tokens, "
                f"{metrics.completed} request(s) completed, {metrics.interrupted_requests} in flight)",
                "interrupted",
            )
        text = render(data, fmt)
        with friendly_errors():
            write_output(text, output, Console(width=120))
        if record.interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)


def check_fits(workload, max_len: int) -> None:
    """Every request known up front must fit the context (later session turns are checked as they come)."""
    for item in workload.initial_items():
        need = len(item.prompt) + item.max_tokens - 1
        if need > max_len:
            raise UsageError(
                f"prompt of {len(item.prompt)} tokens + max_tokens {item.max_tokens} needs {need} KV "
                f"positions; max context is {max_len}"
            )


def _notes(setup, concurrency: int) -> list[str]:
    cfg = setup.engine.cfg.scheduler
    out = []
    if concurrency > cfg.max_num_seqs:
        out.append(
            f"batches hold at most {cfg.max_num_seqs} rows (scheduler.max_num_seqs); "
            f"pass --set scheduler.max_num_seqs={concurrency} to batch all {concurrency} requests"
        )
    return out


def _run_with_progress(run_workload, engine, wl, params, show: bool):
    if not show:
        return run_workload(engine, wl, params=params)
    columns = (
        TextColumn("[bold]serving"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TextColumn("{task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("run", total=wl.total_requests(), tokens=0)

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
        "kv": engine.kv_summary() | {"prefix_cache": dict(engine.blocks.stats)},
        "cuda_graphs": engine.graph_counters(),
    }


# Rendering ------------------------------------------------------------------------------------------------
def render(data: dict[str, Any], fmt: OutputFormat) -> str:
    if fmt == OutputFormat.json:
        return dumps(data)
    if fmt == OutputFormat.csv:
        return _csv(data)
    console = Console(width=120, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*summary_renderables(data)))
    return console.export_text().rstrip()


def _csv(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["section", "metric", "value"])
    for section in ("metrics", "engine", "kv"):
        for key, value in data[section].items():
            if not isinstance(value, (dict, list)):
                writer.writerow([section, key, value])
    for name, counters in data["cuda_graphs"].items():
        for key, value in counters.items():
            writer.writerow([f"cuda_graphs.{name}", key, value])
    return buf.getvalue().rstrip()


def _workload_text(workload: Any) -> str:
    """`burst (concurrency 8, prompt_len 64, ...)` from the header's workload dict."""
    if not isinstance(workload, dict):
        return str(workload or "")
    items = ", ".join(f"{k} {v}" for k, v in workload.items() if k != "kind" and v is not None)
    return f"{workload.get('kind', '?')} ({items})"


def summary_renderables(data: dict[str, Any]) -> list:
    h, m, e, kv = data["header"], data["metrics"], data["engine"], data["kv"]
    q = {k: escape(str(v)) for k, v in h.items() if isinstance(v, (str, int))}  # paths, names: not markup
    head = (
        f"[bold]{q['model_preset']}[/] ({q['family']}, {q['loops']} loops, weights: {q['weights']})  "
        f"device {q['device']}  dtype {q['dtype']}\nrecipe [bold]{q['recipe']}[/]"
        + (f" + {escape(', '.join(h['overrides']))}" if h["overrides"] else "")
        + f"   workload {escape(_workload_text(h.get('workload')))}\n[dim]{q['preset_note']}[/]"
    )
    out: list = [Panel(head, title="looptrace run", expand=False)]
    if m.get("interrupted"):
        out.append(
            f"[bold yellow]INTERRUPTED[/]: {m['interrupted_requests']} request(s) in flight were stopped "
            f"(incomplete, not failed), {m['unsubmitted_requests']} never submitted; latency and throughput "
            "cover the completed requests"
        )

    t = Table(title="Serving", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("Completed / failed requests", f"{m['completed']} / {m['failed']}"),
        (
            "Output tokens: completed requests / all sampled",
            f"{m['total_output_tokens']} / {m['tokens_sampled']}",
        ),
        ("Duration (s)", f"{m['duration']:.2f}"),
        ("Output throughput (tok/s)", f"{m['output_throughput']:.1f}"),
        ("Total throughput (tok/s)", f"{m['total_token_throughput']:.1f}"),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Engine steps / output token", f"{m['steps_per_output_token']:.2f}"),
        ("Submissions / output token", f"{m['submissions_per_output_token']:.2f}"),
        ("Peak KV usage", f"{100 * m['peak_kv_usage']:.1f} %"),
    ]
    for r in rows:
        t.add_row(*r)
    out.append(t)

    lat = Table(title="Latency (ms)", title_justify="left")
    lat.add_column("metric")
    for col in ("Mean", "P50", "P90", "P99"):
        lat.add_column(col, justify="right")
    names = {"ttft": "TTFT", "tpot": "TPOT (excl. 1st token)", "itl": "ITL", "e2el": "E2EL"}
    for key, label in names.items():
        lat.add_row(label, *(f"{m[f'{p}_{key}_ms']:.2f}" for p in ("mean", "median", "p90", "p99")))
    out.append(lat)

    eng = Table(title="Engine and KV", title_justify="left")
    eng.add_column("item")
    eng.add_column("value", justify="right")
    eng.add_row("Steps by stage", ", ".join(f"{k} {v}" for k, v in sorted(e["steps_by_stage"].items())))
    eng.add_row("KV layout / planes", f"{kv['layout']} / {kv['planes']}")
    eng.add_row("KV pool capacity (tokens)", f"{kv['capacity_tokens']:,}")
    eng.add_row(
        "KV slots per token: reserved / live / dead",
        f"{kv['reserved_slots_per_token']} / {kv['live_slots_per_token']} / {kv['dead_slots_per_token']}",
    )
    eng.add_row(
        "KV bytes per token: reserved / live",
        f"{kv['reserved_bytes_per_token']:,} / {kv['live_bytes_per_token']:,}",
    )
    pc = kv["prefix_cache"]
    if kv["prefix_caching"]:
        eng.add_row(
            "Prefix cache hit tokens / queried", f"{pc['prefix_hit_tokens']} / {pc['prefix_query_tokens']}"
        )
    out.append(eng)

    if data["cuda_graphs"]:
        g = Table(title="CUDA graphs", title_justify="left")
        for col in ("graph", "captures", "replays", "fallbacks", "reasons"):
            g.add_column(col, justify="right" if col in ("captures", "replays", "fallbacks") else "left")
        for name, c in data["cuda_graphs"].items():
            reasons = ", ".join(f"{k} {v}" for k, v in c["fallback_reasons"].items()) or "-"
            style = "bold yellow" if c["fallbacks"] else None
            g.add_row(name, str(c["captures"]), str(c["replays"]), str(c["fallbacks"]), reasons, style=style)
        out.append(g)
    return out
