"""`looptrace diff A B`: run two recipes on the same requests, compare every token stream, and grade each
differing setting against the exactness rung it declares (exit 1 when a claim is violated)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from looptrace.analysis.diff_render import to_csv, to_text
from looptrace.cli.common import (
    EXIT_CHECK_FAILED,
    EXIT_CODES_HELP,
    dumps,
    err_console,
    fail,
    friendly_errors,
    interrupt_exit,
)
from looptrace.cli.options import (
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    OutputOpt,
    SeedOpt,
    ThreadsOpt,
    WeightsOpt,
)
from looptrace.cli.output import check_output_path, command_inputs, infer_format, write_output

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace diff base exactloop --model ouro               # grade every setting ExactLoop changes
  looptrace diff base --b-set exit.policy=fixed            # one recipe, two variants (R0 claim)
  looptrace diff base --b-set scheduler.max_num_seqs=2 -c 4 # R1: may move batched, not at batch 1
  looptrace diff base --b-set debug.perturb=prefill:1:core0:mlp --b-set exit.policy=fixed --bisect
  looptrace diff base --b-set debug.perturb=recurrent:2:core1:mlp --localize r0
  looptrace diff base --b-set exit.threshold=0.5 --accuracy eval.jsonl --weights ./tiny-ouro

[bold]GRADING[/]  R0 must give identical tokens batched and at batch 1; R1 identical at batch 1; R2 is
reported; R3 is graded by the one-point rule on --accuracy (exact match; the built-in evaluation set of the
preset when one is shipped). A setting whose rung needs a device check (kernels.fused_projections) takes
the engine's startup check on this device (R0 where fused and separate GEMMs are bitwise equal for the
model's shapes, else R3). A setting with no effect on the device (CUDA graphs on a CPU) is UNTESTED.
A violated claim prints red and exits 1. --strict also requires bitwise-identical logits.

[bold]WORKLOAD[/]  --num-requests random prompts (or --prompts FILE.jsonl, in file order), submitted in the
same order to both arms with at most -c outstanding; greedy decoding.
""" + EXIT_CODES_HELP.replace("0 ok,", "0 ok (every claim holds), 1 a claim is violated,")

SetsOpt = list[str] | None


def _set_opt(flag: str, arm: str):
    return typer.Option(flag, help=f"Override a setting of recipe {arm}: section.key=value (repeatable).")


def diff(
    recipe_a: Annotated[str, typer.Argument(help="Recipe A (name in recipes/ or a YAML path).")] = "base",
    recipe_b: Annotated[
        str | None, typer.Argument(help="Recipe B (default: recipe A).", show_default=False)
    ] = None,
    model: ModelOpt = None,
    a_sets: Annotated[SetsOpt, _set_opt("--a-set", "A")] = None,
    b_sets: Annotated[SetsOpt, _set_opt("--b-set", "B")] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help="Requests outstanding at once (the batch window).")
    ] = 4,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens (random ids).")] = 16,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 8,
    num_requests: Annotated[int | None, typer.Option(help="Requests in all (default -c).")] = None,
    prompts: Annotated[Path | None, typer.Option(help="JSONL prompts instead of random ones.")] = None,
    bisect: Annotated[
        bool, typer.Option("--bisect", help="Find the setting(s) that make the arms diverge.")
    ] = False,
    localize: Annotated[
        str | None,
        typer.Option(
            help="Replay request ID (e.g. r0) alone with per-op capture; name the first op that differs."
        ),
    ] = None,
    accuracy: Annotated[
        Path | None,
        typer.Option(help='Exact-match set, JSONL {"prompt", "answer"} (default: the built-in set, if any).'),
    ] = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="R0/R1 also need bitwise-identical logits.")
    ] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    progress: Annotated[bool, typer.Option(help="Show progress on stderr (when it is a terminal).")] = True,
) -> None:
    """Run recipes A and B on identical requests; compare token streams and grade each differing setting's
    exactness rung (R0-R3)."""
    with interrupt_exit():
        fmt = infer_format(fmt, output)
        with friendly_errors(), _memory_errors():
            inputs = command_inputs(prompts, recipe_a, weights) + [(accuracy, "--accuracy")]
            inputs += [(Path(r), "recipe B") for r in (recipe_b,) if r and Path(r).is_file()]
            check_output_path(output, inputs=inputs)
            from looptrace.analysis.diff_run import DiffRequest, execute, prepare

            req = DiffRequest(
                recipe_a=recipe_a,
                recipe_b=recipe_b,
                model=model,
                a_sets=list(a_sets or []),
                b_sets=list(b_sets or []),
                concurrency=concurrency,
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                num_requests=num_requests,
                prompts=prompts,
                accuracy=accuracy,
                bisect=bisect,
                localize=localize,
                strict=strict,
                device=device,
                dtype=dtype,
                weights=weights,
                seed=seed,
                threads=threads,
            )
            setup = prepare(req)
        show = progress and err_console.is_terminal
        # A workload the device cannot hold shows while running.
        with friendly_errors(), _memory_errors(), _progress(show, len(setup.items)) as on_progress:
            data, ok = execute(setup, req, on_progress)
        text = render(data, fmt)
        with friendly_errors():
            write_output(text, output, Console(width=140))
        if not ok:
            raise typer.Exit(EXIT_CHECK_FAILED)


@contextmanager
def _memory_errors() -> Iterator[None]:
    """Out of device (or host) memory anywhere in the runs: one line naming what to change, exit 2."""
    import torch

    try:
        yield
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        what = text.split(" GPU ")[0].rstrip(".")[:200]  # "CUDA out of memory. Tried to allocate 2.00 GiB"
        raise fail(
            f"out of memory ({what}): lower -c, --prompt-len or --max-tokens, or the KV pool's share "
            "(--a-set/--b-set kv.gpu_memory_utilization=0.5)"
        ) from None


@contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[str, int, int], None]]:
    """A transient progress bar on stderr fed by the runs' (what, done, total) calls, or nothing."""
    if not show:
        yield lambda what, done, total: None
        return
    bar = RichProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )
    task = bar.add_task("starting", total=total)
    with bar:
        yield lambda what, done, total: bar.update(task, description=what, completed=done, total=total)


def render(data: dict[str, Any], fmt: OutputFormat) -> str:
    if fmt == OutputFormat.json:
        return dumps(data)
    return to_csv(data) if fmt == OutputFormat.csv else to_text(data)
