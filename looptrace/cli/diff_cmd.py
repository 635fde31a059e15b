"""`looptrace diff A B`: run two recipes on the same requests, compare every token stream, and grade each
differing setting against the exactness rung it declares (exit 1 when a claim is violated)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import MofNCompleteColumn, TextColumn

from looptrace.cli import common as c
from looptrace.cli import options as o
from looptrace.cli.output import check_output, command_inputs, infer_format, recipe_input, write_output

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
""" + c.EXIT_CODES_HELP.replace("0 ok,", "0 ok (every claim holds), 1 a claim is violated,")

RecipeAArg = o.arg(str, help="Recipe A (name in recipes/ or a YAML path).")
RecipeBArg = o.arg(str | None, help="Recipe B (default: recipe A).")
ASetsOpt = o.opt(
    list[str] | None, "--a-set", help="Override a setting of recipe A: section.key=value (repeatable)."
)
BSetsOpt = o.opt(
    list[str] | None, "--b-set", help="Override a setting of recipe B: section.key=value (repeatable)."
)
ConcurrencyOpt = o.opt(int, "--concurrency", "-c", help="Requests outstanding at once (the batch window).")
NumRequestsOpt = o.opt(int | None, help="Requests in all (default -c).")
PromptsOpt = o.opt(Path | None, help="JSONL prompts instead of random ones.")
BisectOpt = o.opt(bool, "--bisect", help="Find the setting(s) that make the arms diverge.")
LocalizeOpt = o.opt(
    str | None, help="Replay request ID (e.g. r0) alone with per-op capture; name the first op that differs."
)
AccuracyOpt = o.opt(
    Path | None, help='Exact-match set, JSONL {"prompt", "answer"} (default: the built-in set, if any).'
)
StrictOpt = o.opt(bool, "--strict", help="R0/R1 also need bitwise-identical logits.")


def diff(
    recipe_a: RecipeAArg = "base",
    recipe_b: RecipeBArg = None,
    model: o.ModelOpt = None,
    a_sets: ASetsOpt = None,
    b_sets: BSetsOpt = None,
    concurrency: ConcurrencyOpt = 4,
    prompt_len: o.PromptLenOpt = 16,
    max_tokens: o.MaxTokensOpt = 8,
    num_requests: NumRequestsOpt = None,
    prompts: PromptsOpt = None,
    bisect: BisectOpt = False,
    localize: LocalizeOpt = None,
    accuracy: AccuracyOpt = None,
    strict: StrictOpt = False,
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    weights: o.WeightsOpt = None,
    seed: o.SeedOpt = 0,
    threads: o.ThreadsOpt = 1,
    fmt: o.FormatOpt = None,
    output: o.OutputOpt = None,
    progress: o.ProgressOpt = True,
) -> None:
    """Run recipes A and B on identical requests; compare token streams and grade each differing setting's
    exactness rung (R0-R3)."""
    with c.interrupt_exit():
        from looptrace.analysis.diff_run import DiffRequest

        _diff(DiffRequest(**c.fields_of(DiffRequest, locals())), infer_format(fmt, output), output, progress)


def _diff(req, fmt: o.OutputFormat, output: Path | None, progress: bool) -> None:
    from looptrace.analysis.diff_render import render
    from looptrace.analysis.diff_run import execute, prepare

    inputs = command_inputs(req.prompts, req.recipe_a, req.weights) + [(req.accuracy, "--accuracy")]
    inputs.append(recipe_input(req.recipe_b, "recipe B"))
    with c.friendly_errors(), _memory_errors():
        check_output(output, inputs=inputs)
        setup = prepare(req)
    # A workload the device cannot hold shows while running.
    show = progress and c.err_console.is_terminal
    with c.friendly_errors(), _memory_errors(), _progress(show, len(setup.items)) as on_progress:
        data, ok = execute(setup, req, on_progress)
    with c.friendly_errors():
        write_output(render(data, fmt), output, Console(width=140), fmt, lambda: render(data, "table"))
    if not ok:
        raise typer.Exit(c.EXIT_CHECK_FAILED)


@contextmanager
def _memory_errors() -> Iterator[None]:
    """Out of device (or host) memory anywhere in the runs: one line naming what to change, exit 2."""
    import torch

    try:
        yield
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        what = text.split(" GPU ")[0].rstrip(".")[:200]  # "CUDA out of memory. Tried to allocate 2.00 GiB"
        raise c.fail(
            f"out of memory ({what}): lower -c, --prompt-len or --max-tokens, or the KV pool's share "
            "(--a-set/--b-set kv.gpu_memory_utilization=0.5)"
        ) from None


@contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[str, int, int], None]]:
    """A transient progress bar on stderr fed by the runs' (what, done, total) calls, or nothing."""
    if not show:
        yield lambda what, done, total: None
        return
    with c.progress_bar(c.err_console, MofNCompleteColumn(), TextColumn("requests")) as bar:
        task = bar.add_task("starting", total=total)
        yield lambda what, done, total: bar.update(task, description=what, completed=done, total=total)
