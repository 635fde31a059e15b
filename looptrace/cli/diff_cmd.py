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
  looptrace diff http://host:8000 http://host:8001 --expect noise  # two served deployments
  looptrace diff exactloop http://host:8000 --model ouro --batch-probe  # our recipe vs a server
  looptrace diff http://host:8000 http://host:8001 --reference ouro-1.4b --reference-device cuda

[bold]GRADING[/]  R0 must give identical tokens batched and at batch 1; R1 identical at batch 1; R2 is
reported; R3 is graded by the one-point rule on --accuracy (exact match; the built-in evaluation set of the
preset when one is shipped). A setting whose rung needs a device check (kernels.fused_projections) takes
the engine's startup check on this device (R0 where fused and separate GEMMs are bitwise equal for the
model's shapes, else R3). A setting with no effect on the device (CUDA graphs on a CPU) is UNTESTED.
A violated claim prints red and exits 1. --strict also requires bitwise-identical logits.

[bold]WORKLOAD[/]  --num-requests random prompts (or --prompts FILE.jsonl, in file order), submitted in the
same order to both arms with at most -c outstanding; greedy decoding.

[bold]ENDPOINTS[/]  An arm that is a URL is an OpenAI-compatible server (vLLM, looptrace serve); a recipe arm
is then served in-process. Each request is a token-id prompt to /v1/completions with logprobs; the report
gives per request the first divergent position, both tokens, their logprobs and each arm's margin there.
A divergence is "changed-within-noise" when both margins are within --noise-margin (default: a rule of
thumb for --served-dtype), else "changed-beyond-noise"; sampled streams (--temperature > 0) that agree in
their top-k logprobs are "same-distribution". --expect identical|noise states the claim (exit 1 if broken).
--reference MODEL_OR_WEIGHTS scores both arms' streams with our engine (float32 on the CPU by default) and
names per divergence the arm whose token the reference ranks lower, or a near tie within the bfloat16 noise
it measures on the same streams; the claim and the exit code do not change.
""" + c.EXIT_CODES_HELP.replace("0 ok,", "0 ok (every claim holds), 1 a claim is violated,")

RecipeAArg = o.arg(str, help="Recipe A (name in recipes/ or a YAML path) or an endpoint URL.")
RecipeBArg = o.arg(str | None, help="Recipe B or an endpoint URL (default: arm A).")
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
ServedModelOpt = o.opt(str | None, help="Endpoints: the model id to request (default: /v1/models' first).")
ExpectOpt = o.opt(str | None, help="Endpoints: the claim, identical or noise (exit 1 when broken).")
NoiseMarginOpt = o.opt(float | None, help="Endpoints: near-tie margin in nats (default: per --served-dtype).")
ServedDtypeOpt = o.opt(
    str | None, help="Endpoints: dtype the servers run (bfloat16, float16, float32; default: bfloat16)."
)
TemperatureOpt = o.opt(float, help="Endpoints: 0 greedy, else sampled with --seed.")
TopLogprobsOpt = o.opt(int, help="Endpoints: alternatives per position (logprobs=k).")
TimeoutOpt = o.opt(float, help="Endpoints: seconds per request.")
RetriesOpt = o.opt(int, help="Endpoints: retries after a timeout, a dropped connection or a 5xx.")
ApiKeyOpt = o.opt(
    str | None,
    envvar="OPENAI_API_KEY",
    show_envvar=False,
    help="Endpoints: bearer token (or $OPENAI_API_KEY).",
)
BatchProbeOpt = o.opt(bool, "--batch-probe", help="Endpoints: also send each prompt alone and in a crowd.")
ReferenceOpt = o.opt(
    str | None,
    help="Endpoints: a model preset or checkpoint directory that judges each divergence (teacher-forced).",
)
ReferenceDtypeOpt = o.opt(str, help="Endpoints: the reference's dtype (float32, float16, bfloat16).")
ReferenceDeviceOpt = o.opt(str, help="Endpoints: where the reference runs (cpu or cuda).")


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
    served_model: ServedModelOpt = None,
    expect: ExpectOpt = None,
    noise_margin: NoiseMarginOpt = None,
    served_dtype: ServedDtypeOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_logprobs: TopLogprobsOpt = 5,
    timeout: TimeoutOpt = 60.0,
    retries: RetriesOpt = 1,
    batch_probe: BatchProbeOpt = False,
    api_key: ApiKeyOpt = None,
    reference: ReferenceOpt = None,
    reference_dtype: ReferenceDtypeOpt = "float32",
    reference_device: ReferenceDeviceOpt = "cpu",
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
        if any(str(arm).startswith(("http://", "https://")) for arm in (recipe_a, recipe_b) if arm):
            _endpoint_diff(locals(), infer_format(fmt, output), output, progress)
            return
        _no_endpoint_options(locals())
        # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
        from looptrace.analysis.diff_run import DiffRequest

        _diff(DiffRequest(**c.fields_of(DiffRequest, locals())), infer_format(fmt, output), output, progress)


def _diff(req, fmt: o.OutputFormat, output: Path | None, progress: bool) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
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


def _endpoint_diff(options: dict, fmt: o.OutputFormat, output: Path | None, progress: bool) -> None:
    """An arm is a URL: both arms through the OpenAI API (a recipe arm served in-process)."""
    c.require_extra("diff", "httpx", *(() if _all_urls(options) else ("fastapi", "uvicorn", "sse_starlette")))
    for flag in ("bisect", "localize", "strict"):
        if options[flag]:
            raise c.fail(f"--{flag} needs two recipes (it replays our engine); an arm here is an endpoint")
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.analysis.endpoint_arm import EndpointError
    from looptrace.analysis.endpoint_diff import EndpointDiffInputError, EndpointDiffRequest, execute
    from looptrace.analysis.endpoint_diff_render import render

    req = EndpointDiffRequest(
        arm_a=options["recipe_a"], arm_b=options["recipe_b"], **c.fields_of(EndpointDiffRequest, options)
    )
    inputs = [(req.prompts, "--prompts"), (req.accuracy, "--accuracy")]
    show = progress and c.err_console.is_terminal
    with c.friendly_errors(), _memory_errors():
        check_output(output, inputs=inputs)
        try:
            with _progress(show, 2) as on_progress:
                data, ok = execute(req, on_progress)
        except (EndpointError, EndpointDiffInputError) as exc:
            raise c.fail(str(exc)) from None
        write_output(render(data, fmt), output, Console(width=140))
    if not ok:
        raise typer.Exit(c.EXIT_CHECK_FAILED)


# The endpoint options and their defaults: given with two recipes, they would do nothing.
ENDPOINT_DEFAULTS = {
    "served_model": None,
    "expect": None,
    "noise_margin": None,
    "served_dtype": None,
    "temperature": 0.0,
    "top_logprobs": 5,
    "timeout": 60.0,
    "retries": 1,
    "batch_probe": False,
    "reference": None,
    "reference_dtype": "float32",
    "reference_device": "cpu",
}


def _no_endpoint_options(options: dict) -> None:
    for name, default in ENDPOINT_DEFAULTS.items():
        if options[name] != default:
            flag = "--" + name.replace("_", "-")
            raise c.fail(
                f"{flag} applies when an arm is an endpoint (http://...); both arms here are recipes"
            )


def _all_urls(options: dict) -> bool:
    arms = [options["recipe_a"], options["recipe_b"] or options["recipe_a"]]
    return all(str(a).startswith(("http://", "https://")) for a in arms)


@contextmanager
def _memory_errors() -> Iterator[None]:
    """Out of device (or host) memory anywhere in the runs: one line naming what to change, exit 2."""
    # deferred: torch: commands that build no engine never load it
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
