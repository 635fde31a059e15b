"""`looptrace diff A B`: run two recipes on the same requests, compare every token stream, and grade each
differing setting against the exactness rung it declares (exit 1 when a claim is violated)."""

from __future__ import annotations

import copy
import csv
import io
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from looptrace.cli.common import (
    DEFAULT_MODEL,
    EXIT_CHECK_FAILED,
    EXIT_CODES_HELP,
    DeviceOpt,
    DtypeOpt,
    FormatOpt,
    ModelOpt,
    OutputFormat,
    OutputOpt,
    SeedOpt,
    ThreadsOpt,
    UsageError,
    WeightsOpt,
    check_output_path,
    check_seed,
    command_inputs,
    device_name,
    dumps,
    err_console,
    fail,
    friendly_errors,
    interrupt_exit,
    resolve_device,
    resolve_dtype,
    versions,
    write_output,
)
from looptrace.cli.output import infer_format

SCHEMA = "looptrace.diff/1"
MAX_REQUEST_ROWS = 24

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
            setup = _prepare(
                recipe_a,
                recipe_b,
                model,
                a_sets,
                b_sets,
                concurrency,
                prompt_len,
                max_tokens,
                num_requests,
                prompts,
                accuracy,
                localize,
                device,
                dtype,
                weights,
                seed,
                threads,
            )
        with friendly_errors(), _memory_errors():  # a workload the device cannot hold shows while running
            data, ok = _execute(setup, bisect=bisect, localize=localize, strict=strict, progress=progress)
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


# Preparation ---------------------------------------------------------------------------------------------
def _prepare(
    recipe_a,
    recipe_b,
    model,
    a_sets,
    b_sets,
    concurrency,
    prompt_len,
    max_tokens,
    num_requests,
    prompts,
    accuracy,
    localize,
    device,
    dtype,
    weights,
    seed,
    threads,
) -> dict[str, Any]:
    import torch

    from looptrace.analysis.diff import differing_toggles

    check_seed(seed)
    for name, value in (("-c", concurrency), ("--prompt-len", prompt_len), ("--max-tokens", max_tokens)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if num_requests is not None and num_requests < 1:
        raise UsageError(f"--num-requests must be >= 1, got {num_requests}")
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    rec_a = _load(recipe_a, a_sets, "--a-set")
    rec_b = _load(recipe_b or recipe_a, b_sets, "--b-set")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    toggles = differing_toggles(rec_a.config, rec_b.config, dev.type)
    if not toggles:
        raise UsageError(
            f"recipes A ({_arm_text(rec_a)}) and B ({_arm_text(rec_b)}) differ in no setting: nothing to "
            "compare (change B with --b-set section.key=value)"
        )
    _check_perturb(rec_a.config, rec_b.config)
    if weights is None:  # a tiny preset's trained checkpoint (any device), as every command uses
        weights = _shipped(model, dev.type)
    spec, net = _load_model(model, weights, dev, dt, seed)
    items = _items(prompts, weights, spec, concurrency, num_requests, prompt_len, max_tokens, seed)
    acc = _accuracy_plan(accuracy, toggles, spec, weights)
    if localize is not None:
        _find_item(items, localize)
    longest = max(len(i.prompt) + i.max_tokens for i in items)
    cfg_a, cfg_b = copy.deepcopy(rec_a.config), copy.deepcopy(rec_b.config)
    for cfg in (cfg_a, cfg_b):  # size the decode tables to the workload, the same way in both arms
        if cfg.scheduler.max_model_len is None:
            block = cfg.kv.block_size
            cfg.scheduler.max_model_len = math.ceil(longest / block) * block
    factory = _factory(net, dev, dt, seed, PoolNeed(min(concurrency, len(items)), longest))
    checked: dict[str, str] = {}
    inactive: dict[str, str] = {}
    for arm, cfg, rec in (("A", cfg_a, rec_a), ("B", cfg_b, rec_b)):
        arm_checked, arm_inactive = _preflight(factory, cfg, arm, rec)
        checked.update(arm_checked)
        inactive.update(arm_inactive)
    toggles = differing_toggles(rec_a.config, rec_b.config, dev.type, checked)
    for it in items:
        if len(it.prompt) + it.max_tokens - 1 > spec.max_position:
            raise UsageError(
                f"request {it.id}: prompt {len(it.prompt)} + max_tokens {it.max_tokens} exceeds the model"
            )
    return dict(
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
        inactive=inactive,  # settings without effect on this device: graded "untested"
        window=concurrency,
        accuracy=acc,
        weights=weights,
        seed=seed,
        workload=_workload_text(items, prompts, concurrency, seed),
    )


def _load(recipe: str, sets, flag: str):
    from looptrace.recipes import RecipeError, load_recipe

    try:
        return load_recipe(recipe, list(sets or []))
    except RecipeError as exc:
        msg = str(exc)
        raise RecipeError(flag + msg[len("--set") :] if msg.startswith("--set") else msg) from None


def _arm_text(rec) -> str:
    return rec.name + (" + " + ", ".join(rec.overrides) if rec.overrides else "")


def _check_perturb(*cfgs) -> None:
    from looptrace.engine.perturb import PerturbSpecError, parse_place

    for cfg in cfgs:
        if cfg.debug.perturb:
            try:
                parse_place(cfg.debug.perturb)
            except PerturbSpecError as exc:
                raise UsageError(str(exc)) from None


def _shipped(model, device_type: str) -> Path | None:
    from looptrace.assets import shipped_weights
    from looptrace.engine.model_config import UnknownModelError, resolve_preset

    try:
        return shipped_weights(resolve_preset(model or DEFAULT_MODEL, device_type).name)
    except UnknownModelError:
        return None  # reported by _load_model with the usual message


def _load_model(model, weights, dev, dt, seed):
    from looptrace.cli.common import checkpoint_spec
    from looptrace.engine.model_config import resolve_preset
    from looptrace.engine.weights import create_model, init_random

    if weights is not None:
        from looptrace.engine.checkpoint import load_checkpoint

        checkpoint_spec(model, weights)
        return load_checkpoint(weights, dev, dt)
    spec = resolve_preset(model or DEFAULT_MODEL, dev.type)
    net = create_model(spec, dev, dt)
    init_random(net, seed)
    return spec, net


DIFF_POOL_TOKENS = 8192  # KV positions per engine on CUDA at most: the diff workloads and the eval set fit
GIB = 1 << 30


@dataclass(frozen=True)
class PoolNeed:
    """KV positions a run needs at once: `window` requests of `longest` tokens (the batches must be the
    same in both arms, so every request of a window must fit)."""

    window: int
    longest: int


def _factory(net, dev, dt, seed, need: PoolNeed | None = None):
    """Each run gets a fresh engine on its own copy of the same weights (an engine may hook its model).
    `analysis.diff.with_engine` frees each one before the next is built."""
    from looptrace.analysis.diff import free_memory
    from looptrace.engine.llm_engine import LLMEngine

    def make(cfg):
        cfg = copy.deepcopy(cfg)
        free_memory()  # whatever an earlier run left: the pool is sized on what is alive now
        model = copy.deepcopy(net)
        if dev.type == "cuda" and cfg.kv.num_blocks is None:
            cfg.kv.num_blocks = _cuda_pool_blocks(net.spec, cfg, dev, dt, need)
        return LLMEngine(model, cfg, device=dev, dtype=dt, seed=seed)

    return make


def _cuda_pool_blocks(spec, cfg, dev, dt, need: PoolNeed | None) -> int:
    """The engine's own rule (free memory less (1 - kv.gpu_memory_utilization) x total and 1 GiB) measured
    with only this engine's weights alive, capped at DIFF_POOL_TOKENS positions; a workload that does not
    fit is a one-line error naming the settings to change."""
    import torch

    from looptrace.engine.kv_cache import LAYOUTS

    kv = cfg.kv
    per_page = LAYOUTS[kv.layout](spec, cfg.exit.max_loops or spec.default_loops).blocks_per_page
    elt = torch.empty((), dtype=dt).element_size()
    block_bytes = 2 * spec.num_layers * kv.block_size * spec.num_kv_heads * spec.head_dim * elt
    free, total = torch.cuda.mem_get_info(dev)
    budget = free - (1 - kv.gpu_memory_utilization) * total - GIB
    fits = max(0, int(budget // block_bytes)) // per_page * per_page
    cap = -(-DIFF_POOL_TOKENS // kv.block_size) * per_page
    if need is not None:
        pages = need.window * -(-need.longest // kv.block_size)
        needed = pages * per_page + kv.watermark_blocks
        if fits < needed:
            raise UsageError(
                f"the KV pool ({kv.layout} layout) needs {needed * block_bytes / GIB:.2f} GiB for "
                f"{need.window} request(s) of {need.longest} tokens, but kv.gpu_memory_utilization="
                f"{kv.gpu_memory_utilization:g} leaves {max(0.0, budget) / GIB:.2f} GiB "
                f"({free / GIB:.1f} of {total / GIB:.1f} GiB free): raise kv.gpu_memory_utilization "
                "(--a-set/--b-set) or lower -c, --prompt-len or --max-tokens"
            )
    return max(per_page, min(cap, fits))


def _preflight(factory, cfg, arm: str, rec) -> tuple[dict[str, str], dict[str, str]]:
    """Build the arm once so that a setting the engine does not implement yet fails before any run;
    returns the rungs the engine's startup checks decided on this device (`engine.checked_rungs`) and
    the settings that have no effect on it (`engine.inactive_settings`)."""
    from looptrace.analysis.diff import with_engine

    def facts(engine) -> tuple[dict[str, str], dict[str, str]]:
        return dict(getattr(engine, "checked_rungs", {})), dict(getattr(engine, "inactive_settings", {}))

    try:
        return with_engine(factory, cfg, facts)
    except (KeyError, NotImplementedError) as exc:
        what = exc.args[0] if exc.args else type(exc).__name__
        raise UsageError(
            f"recipe {arm} ({_arm_text(rec)}): the engine does not implement a setting yet "
            f"({type(exc).__name__}: {what})"
        ) from None


def _items(prompts, weights, spec, concurrency, num_requests, prompt_len, max_tokens, seed):
    from looptrace.analysis.diff import DiffItem
    from looptrace.drive import workloads as w

    if prompts is not None:
        from looptrace.engine.tokenizer import load_tokenizer

        wl = w.JsonlWorkload(path=prompts, tokenizer=load_tokenizer(weights), default_max_tokens=max_tokens)
        raw = sorted(wl.initial_items(), key=lambda i: i.arrival)  # arrival order (stable)
        bad = [t for i in raw for t in i.prompt if t >= spec.vocab_size]
        if bad:
            raise UsageError(f"{prompts}: token id {bad[0]} outside the vocabulary [0, {spec.vocab_size})")
    else:
        n = num_requests if num_requests is not None else concurrency
        raw = w.BurstWorkload(
            concurrency=n, prompt_len=prompt_len, max_tokens=max_tokens, seed=seed, vocab_size=spec.vocab_size
        ).initial_items()
    return [DiffItem(f"r{i}", list(it.prompt), it.max_tokens) for i, it in enumerate(raw)]


def _workload_text(items, prompts, window, seed) -> str:
    src = (
        str(prompts)
        if prompts is not None
        else f"random prompts of {len(items[0].prompt)} tokens, seed {seed}"
    )
    return f"{len(items)} requests ({src}), {items[0].max_tokens} output tokens, window {window}, greedy"


def _find_item(items, request: str):
    key = request if request.startswith("r") else f"r{request}"
    for it in items:
        if it.id == key:
            return it
    raise UsageError(f"--localize {request}: no such request (expected r0..r{len(items) - 1})")


def _accuracy_plan(accuracy: Path | None, toggles, spec, weights) -> dict[str, Any] | None:
    """Which evaluation set and weights the accuracy check uses, read and validated now."""
    from looptrace.assets import default_eval_set, shipped_weights
    from looptrace.train.evaluate import EvalSetError, read_items

    path = accuracy
    eval_weights = weights if weights is not None else shipped_weights(spec.name)
    if path is None:
        # The built-in set is for the trained tiny models: only with the preset's own (or given) weights.
        if not any(t.graded == "R3" for t in toggles) or eval_weights is None:
            return None
        path = default_eval_set(spec.name)
        if path is None:
            return None
    try:
        items = read_items(Path(path), need_answer=True)
    except EvalSetError as exc:
        raise UsageError(f"--accuracy {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--accuracy {path}: cannot read it ({exc})") from None
    return {"path": str(path), "items": items, "weights": eval_weights, "explicit": accuracy is not None}


# Execution -----------------------------------------------------------------------------------------------
def _execute(s: dict[str, Any], *, bisect: bool, localize: str | None, strict: bool, progress: bool):
    from looptrace.analysis import diff as d

    t0 = time.perf_counter()
    s["strict"] = strict
    show = progress and err_console.is_terminal
    bar = _progress_bar() if show else None
    task = bar.add_task("starting", total=len(s["items"])) if bar else None

    def on_progress(what: str, done: int, total: int) -> None:
        if bar is not None:
            bar.update(task, description=what, completed=done, total=total)

    lab = d.Lab(
        s["cfg_a"],
        s["toggles"],
        s["factory"],
        s["items"],
        s["window"],
        dtype=s["dtype"],
        progress=on_progress,
    )
    extras: dict[str, Any] = {}
    if bar is not None:
        bar.start()
    try:
        result = d.diff(lab, strict=strict)
        if bisect:
            from looptrace.analysis.bisect import bisect as run_bisect

            extras["bisect"] = run_bisect(lab).to_dict()
        if localize is not None:
            extras["localize"] = _localize(s, result, localize, on_progress)
        acc = None
        if s["accuracy"] is not None:
            on_progress("accuracy", 0, 2)
            acc = _accuracy(s)
        d.apply_accuracy(result.grades, acc)
        extras["perturb"] = _perturb_report(lab.perturb_hits())
        d.mark_untested(result.grades, {**s["inactive"], **_never_fired(extras["perturb"])})
        result.accuracy = acc
    finally:
        if bar is not None:
            bar.stop()
    result.runs, result.elapsed_s = lab.runs, time.perf_counter() - t0
    data = report_data(s, result, extras)
    return data, not result.violations


def _perturb_report(hits: dict[str, dict[str, int]]) -> list[dict[str, Any]] | None:
    """Each debug.perturb place of the runs: how many runs had it and how often it fired."""
    return [{"place": place, **h} for place, h in sorted(hits.items())] or None


def _never_fired(report: list[dict[str, Any]] | None) -> dict[str, str]:
    """debug.perturb is untested when no place of it ever fired: the runs were A's arithmetic."""
    if not report or any(p["hits"] for p in report):
        return {}
    places = ", ".join(p["place"] for p in report)
    return {"debug.perturb": f"{places} never fired: no op output matched it"}


def _progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def _localize(s, result, request: str, on_progress) -> dict[str, Any]:
    from looptrace.analysis.localize import localize

    item = _find_item(s["items"], request)
    rows = [r for r in (*result.requests, *result.solo_requests) if r.id == item.id]
    if all(r.identical and r.logits_identical is not False for r in rows):
        # Nothing differs to localize: say so instead of replaying (a replay would blame batch-mates).
        return {"request": item.id, "found": False, "diverged": False, "max_tokens": item.max_tokens}
    fds = [r.first_divergence for r in rows]
    fds = [f for f in fds if f is not None]
    max_tokens = min(item.max_tokens, min(fds) + 1) if fds else item.max_tokens
    on_progress(f"localize {item.id}", 0, 1)
    loc = localize(s["factory"], s["cfg_a"], s["cfg_b"], item.id, item.prompt, max_tokens)
    on_progress(f"localize {item.id}", 1, 1)
    return {**loc.to_dict(), "diverged": True}


def _accuracy(s):
    from looptrace.analysis.diff import accuracy_by_setting, accuracy_check
    from looptrace.engine.tokenizer import load_tokenizer

    plan = s["accuracy"]
    if plan["weights"] is not None and plan["weights"] == s["weights"]:
        net = s["net"]  # the diff's own checkpoint: no second copy on the device
        label = str(plan["weights"])
    elif plan["weights"] is not None:
        from looptrace.engine.checkpoint import load_checkpoint

        _, net = load_checkpoint(plan["weights"], s["device"], s["dtype"])
        label = str(plan["weights"])
    else:
        net = s["net"]  # the diff's own (random) weights
        label = "random (seeded): accuracy is meaningless without trained --weights"
    factory = _factory(net, s["device"], s["dtype"], s["seed"])
    tok = load_tokenizer(plan["weights"])
    cfg_a, cfg_b = s["rec_a"].config, s["rec_b"].config
    runs: dict[str, Any] = {}
    where = dict(path=plan["path"], weights=label, runs=runs)
    acc = accuracy_check(factory, cfg_a, cfg_b, plan["items"], tok, **where)
    if not acc.holds and sum(t.graded == "R3" for t in s["toggles"]) > 1:  # which one misses the rule?
        acc.by_setting = accuracy_by_setting(factory, cfg_a, s["toggles"], plan["items"], tok, **where)
    return acc


# Report --------------------------------------------------------------------------------------------------
def report_data(s: dict[str, Any], result, extras: dict[str, Any]) -> dict[str, Any]:
    from looptrace.analysis import diff as d
    from looptrace.analysis.diff import max_rung
    from looptrace.engine.config import config_to_dict

    spec, dev = s["spec"], s["device"]
    engine_like = type("E", (), {"device": dev})()
    header = {
        "tool": "looptrace",
        "command": "diff",
        "model_preset": spec.name,
        "family": spec.family,
        "loops": spec.default_loops,
        "weights": str(s["weights"]) if s["weights"] else "random (seeded)",
        "device": device_name(engine_like),
        "dtype": str(s["dtype"]).replace("torch.", ""),
        "versions": versions(),
        "recipes": {
            arm: {
                "name": rec.name,
                "source": rec.source,
                "overrides": rec.overrides,
                "config": config_to_dict(cfg),
            }
            for arm, rec, cfg in (("a", s["rec_a"], s["rec_a"].config), ("b", s["rec_b"], s["rec_b"].config))
        },
        "differing_toggles": [t.to_dict() for t in result.toggles],
        "claimed_rung": max_rung(t.graded for t in result.toggles),
        "workload": s["workload"],
        "seed": s["seed"],
        "strict": s.get("strict", False),
    }
    viol = [g.toggle.path for g in result.violations]
    untested = [g.toggle.path for g in result.grades if g.verdict == d.UNTESTED]
    return {
        "schema": SCHEMA,
        "header": header,
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


STYLE = {
    "holds": "green",
    "violated": "bold red",
    "reported": "cyan",
    "unchecked": "yellow",
    "untested": "yellow",
}


def render(data: dict[str, Any], fmt: OutputFormat) -> str:
    if fmt == OutputFormat.json:
        return dumps(data)
    if fmt == OutputFormat.csv:
        return _csv(data)
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    console.print(Group(*renderables(data)))
    return console.export_text().rstrip()


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _ev(ev: dict | None) -> str:
    if not ev:
        return "-"
    text = f"{ev['identical']}/{ev['total']}"
    if ev.get("logits_identical") is not None:
        text += f" (logits {ev['logits_identical']})"
    return text


def _m(m: dict | None) -> str:
    if not m:
        return "-"
    return f"{m['margin']:.3g}" + (" near-tie" if m["near_tie"] else "")


def renderables(data: dict[str, Any]) -> list:
    h, sm = data["header"], data["summary"]
    ra, rb = h["recipes"]["a"], h["recipes"]["b"]

    def arm(r):
        return r["name"] + (" + " + ", ".join(r["overrides"]) if r["overrides"] else "")

    head = (
        f"A [bold]{arm(ra)}[/]  vs  B [bold]{arm(rb)}[/]   claimed rung {h['claimed_rung']}\n"
        f"[bold]{h['model_preset']}[/] ({h['family']}, {h['loops']} loops, weights: {h['weights']})  "
        f"device {h['device']}  dtype {h['dtype']}\nworkload {h['workload']}"
    )
    out: list = [Panel(head, title="looptrace diff", expand=False)]
    t = Table(title="Settings that differ (graded)", title_justify="left")
    for col in (
        "setting",
        "A",
        "B",
        "claimed",
        "graded",
        "batched ident.",
        "batch-1 ident.",
        "evidence",
        "verdict",
    ):
        t.add_column(col)
    for g in data["toggles"]:
        style = STYLE.get(g["verdict"])
        t.add_row(
            g["path"],
            _fmt(g["a"]),
            _fmt(g["b"]),
            g["declared_rung"],
            g["graded_rung"],
            _ev(g["batched"]),
            _ev(g["solo"]),
            g["evidence"],
            f"[{style}]{g['verdict'].upper()}[/]",
        )
    out.append(t)
    for g in data["toggles"]:
        if g["verdict"] != "holds" or g["device_check"]:
            style = STYLE.get(g["verdict"], "")
            out.append(f"  [{style}]{g['path']}[/]: {g['reason']}")
    out.append(
        f"A vs B: {sm['identical_batched']}/{sm['requests']} identical batched, {sm['identical_solo']}/"
        f"{sm['requests']} at batch 1; bitwise logits {_fmt(sm['logits_identical_batched'])} / "
        f"{_fmt(sm['logits_identical_solo'])}; {sm['runs']} runs, {sm['elapsed_s']:.1f} s in all"
    )
    out.append(_requests_table(data["requests"], "Requests, batched (A vs B)"))
    if any(not r["identical"] for r in data["solo_requests"]):
        out.append(_requests_table(data["solo_requests"], "Requests, batch 1 (A vs B)"))
    if data.get("bisect") is not None:
        b = data["bisect"]
        if b["criterion"] == "none":
            out.append("[bold]bisect[/]: A and B are identical (tokens and logits): nothing to bisect")
        else:
            bases = b.get("baselines") or [[] for _ in b["causes"]]
            causes = "; ".join(
                "{" + ", ".join(c) + "}" + (f" (on A+{','.join(base)})" if base else "")
                for c, base in zip(b["causes"], bases)
            )
            causes = causes or "none found"
            out.append(
                f"[bold]bisect[/] ({b['criterion']} diverge, {len(b['tested'])} subsets run): "
                f"[bold red]{causes}[/]"
            )
    for p in data.get("perturb") or []:
        if not p["hits"]:
            out.append(
                f"[yellow]debug.perturb {p['place']} never fired[/] (0 outputs bumped in {p['runs']} "
                "run(s)): no op output matched that stage, loop and layer"
            )
    if data.get("localize") is not None:
        out.append(_localize_text(data["localize"]))
    if data.get("accuracy") is not None:
        a = data["accuracy"]
        style = "green" if a["holds"] else "bold red"
        out.append(
            f"[bold]accuracy[/] ({a['file']}, {a['n']} questions, weights {a['weights']}): "
            f"A {a['a_accuracy']:.2f}% B {a['b_accuracy']:.2f}%  [{style}]{a['note']}[/]  "
            f"({a['sequences_differ']} answers differ)"
        )
        for x in a.get("by_setting") or []:
            style = "green" if x["holds"] else "bold red"
            on = f" on A+{','.join(x['baseline'])}" if x["baseline"] else ""
            out.append(
                f"  {x['setting']} on its own{on}: A {x['a_accuracy']:.2f}% B {x['b_accuracy']:.2f}%  "
                f"[{style}]{x['note']}[/]"
            )
    v = data["verdict"]
    if v["ok"]:
        out.append(_holds_text(data["toggles"]))
    else:
        out.append(f"[bold red]{len(v['violations'])} claim(s) violated: {', '.join(v['violations'])}[/]")
    return out


def _holds_text(toggles: list[dict]) -> str:
    """No claim violated: say which claims were not put to the test at all."""
    count = {kind: sum(g["verdict"] == kind for g in toggles) for kind in ("untested", "unchecked")}
    notes = []
    if count["untested"]:
        notes.append(f"{count['untested']} setting(s) untested: no effect here")
    if count["unchecked"]:
        notes.append(f"{count['unchecked']} R3 setting(s) unchecked: no --accuracy set")
    if not notes:
        return "[bold green]every claim holds[/]"
    return f"[bold green]every tested claim holds[/] ({'; '.join(notes)})"


def _requests_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in (
        "id",
        "identical",
        "common prefix",
        "first div.",
        "A tok",
        "B tok",
        "A margin",
        "B margin",
        "logits",
    ):
        t.add_column(col)
    shown = [r for r in rows if not r["identical"]][:MAX_REQUEST_ROWS] or rows[:MAX_REQUEST_ROWS]
    for r in shown:
        fd = r["first_divergence"]
        at = r["a_tokens"][fd] if fd is not None and fd < len(r["a_tokens"]) else "-"
        bt = r["b_tokens"][fd] if fd is not None and fd < len(r["b_tokens"]) else "-"
        t.add_row(
            r["id"],
            "yes" if r["identical"] else "[red]no[/]",
            str(r["common_prefix"]),
            _fmt(fd),
            str(at),
            str(bt),
            _m(r["margins"]["a"]),
            _m(r["margins"]["b"]),
            {True: "bitwise", False: "differ", None: "-"}[r["logits_identical"]],
        )
    hidden = len(rows) - len(shown)
    if hidden:
        t.caption = f"{hidden} identical or further request(s) not shown; all are in --format json"
    return t


def _localize_text(loc: dict[str, Any]) -> str:
    if not loc.get("diverged", True):
        return (
            f"[bold]localize {loc['request']}[/]: no divergence to localize (A and B give {loc['request']} "
            "identical tokens and bitwise-identical logits, batched and at batch 1)"
        )
    if not loc["found"]:
        return (
            f"[bold]localize {loc['request']}[/]: alone, no op output differs ({loc['ops_compared']} ops "
            f"compared, {loc['max_tokens']} tokens): the divergence needs batch-mates (batch composition, R1)"
        )
    detail = (
        f"max {loc['max_ulp']} ulp, {loc['elements_differ']}/{loc['elements']} elements, max |diff| "
        f"{loc['max_abs']:.3g}"
        if loc["problem"] == "values"
        else loc["problem"]
    )
    return (
        f"[bold]localize {loc['request']}[/]: first differing op [bold red]{loc['place']}[/] "
        f"({loc['module']}, {loc['op_kind']}): {detail}; {loc['ops_differ']}/{loc['ops_compared']} op "
        "outputs differ from there on"
    )


def _csv(data: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        [
            "kind",
            "name",
            "mode",
            "identical",
            "common_prefix",
            "first_divergence",
            "a",
            "b",
            "claimed",
            "graded",
            "verdict",
            "detail",
        ]
    )
    for g in data["toggles"]:
        for mode in ("batched", "solo"):
            ev = g[mode]
            w.writerow(
                [
                    "setting",
                    g["path"],
                    mode,
                    f"{ev['identical']}/{ev['total']}" if ev else "",
                    "",
                    "",
                    _fmt(g["a"]),
                    _fmt(g["b"]),
                    g["declared_rung"],
                    g["graded_rung"],
                    g["verdict"],
                    g["reason"],
                ]
            )
    for mode, rows in (("batched", data["requests"]), ("solo", data["solo_requests"])):
        for r in rows:
            ma, mb = r["margins"]["a"], r["margins"]["b"]
            w.writerow(
                [
                    "request",
                    r["id"],
                    mode,
                    _fmt(r["identical"]),
                    r["common_prefix"],
                    "" if r["first_divergence"] is None else r["first_divergence"],
                    " ".join(map(str, r["a_tokens"])),
                    " ".join(map(str, r["b_tokens"])),
                    "",
                    "",
                    "",
                    f"margins a={ma['margin'] if ma else ''} b={mb['margin'] if mb else ''}",
                ]
            )
    return buf.getvalue().rstrip()
