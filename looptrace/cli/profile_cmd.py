"""`looptrace profile`: what does one generated token cost, and where does it go?"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
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
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    UsageError,
    WeightsOpt,
    build_engine,
    check_seed,
    command_inputs,
    dumps,
    err_console,
    friendly_errors,
    interrupt_exit,
    note,
    run_header,
    spinner,
    write_output,
)
from looptrace.cli.output import atomic_path, check_outputs, infer_format

EPILOG = (
    """\
[bold]EXAMPLES[/]

  looptrace profile --model ouro                          # ouro-tiny on CPU (leaf ATen ops), ouro-1.4b on GPU
  looptrace profile --model ouro-1.4b -c 32 --set scheduler.max_num_seqs=32
  looptrace profile --model huginn --trace huginn.json    # also write a Chrome trace (open in Perfetto)
  looptrace profile --model ouro --compare base base --b-set cuda_graphs.enabled=false
  looptrace profile --model ouro --level layer --format json -o ouro.json

[bold]WHAT IS MEASURED[/]  A decode window (whole tokens, after warm-up and graph capture) and a prefill
window (a fresh burst until every request has its first token), under torch.profiler. Counters are per
output token (decode) or per prompt token (prefill). On CPU, "kernels" are leaf ATen ops. The --trace
file carries lt.tokens/<n> markers, so `looptrace trace analyze` of it reports the same tokens.

[bold]OUTPUT[/]  -o FILE: the format follows the suffix (.json, .csv, else table) unless --format is
given. -o and --trace are checked before profiling and written whole and atomically; a symlink is
written through; a directory or a device is refused. Ctrl-C reports the windows that finished.

"""
    + EXIT_CODES_HELP
)

LEVELS = ("step", "loop", "layer", "op")


def profile(
    model: ModelOpt = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            "--recipe",
            "-r",
            help="Recipe name in recipes/ or a YAML path (default: base).",
            show_default=False,
        ),
    ] = None,
    sets: SetOpt = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Requests decoding together.")] = 1,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens per request (random ids).")] = 64,
    decode_steps: Annotated[
        int | None, typer.Option(help="Engine steps in the decode window (default: ~8 tokens per request).")
    ] = None,
    level: Annotated[str, typer.Option(help="Range granularity: step, loop, layer or op.")] = "op",
    trace: Annotated[Path | None, typer.Option("--trace", help="Write the Chrome trace here.")] = None,
    compare: Annotated[
        tuple[str, str] | None,
        typer.Option(
            help="Profile two recipes on the same workload and compare: --compare A B.", show_default=False
        ),
    ] = None,
    a_set: Annotated[
        list[str] | None, typer.Option("--a-set", help="Override for side A of --compare.")
    ] = None,
    b_set: Annotated[
        list[str] | None, typer.Option("--b-set", help="Override for side B of --compare.")
    ] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
    fmt: FormatOpt = None,
    output: OutputOpt = None,
    roofline_device: Annotated[
        str | None,
        typer.Option(
            "--roofline-device",
            help="Device peaks for the roofline columns (h200, h100-sxm, mi300x, ...); default: the GPU's "
            "name from the trace, none on CPU.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Count kernels, launches, graph replays and fallbacks, copies, syncs and time per generated token,
    attributed to model op x layer x loop x stage (the ExactLoop paper's Table A4, automated)."""
    from looptrace.probes.session import ProfileConfig

    with interrupt_exit("interrupted before any window finished: no report written"):
        fmt = infer_format(fmt, output)
        with friendly_errors():
            if level not in LEVELS:
                raise UsageError(f"--level '{level}': expected one of {', '.join(LEVELS)}")
            if concurrency < 1 or prompt_len < 1 or (decode_steps is not None and decode_steps < 1):
                raise UsageError("--concurrency, --prompt-len and --decode-steps must be >= 1")
            _check_prompts_memory(concurrency, prompt_len)
            if compare is not None and recipe is not None:  # --compare names both recipes
                raise UsageError(f"--recipe {recipe} and --compare A B: give one (--compare sets both sides)")
            recipe = recipe or "base"
            inputs = command_inputs(None, recipe, weights) + [(Path(r), "--compare") for r in compare or ()]
            check_outputs((output, "--output"), (trace, "--trace"), inputs=inputs)
            check_seed(seed)
            if compare is None and (a_set or b_set):
                raise UsageError("--a-set/--b-set only apply with --compare A B")
            cfg = ProfileConfig(concurrency, prompt_len, decode_steps, level=level, seed=seed)
            common = dict(
                model=model, device=device, dtype=dtype, weights=weights, seed=seed, threads=threads
            )
            runs = [(recipe, list(sets or []))]
            if compare is not None:
                from looptrace.recipes import load_recipe

                base = list(sets or [])
                runs = [(name, base + list(extra or [])) for name, extra in zip(compare, (a_set, b_set))]
                for name, overrides in runs:  # both sides valid before any profiling
                    load_recipe(name, overrides)
            if roofline_device is not None:
                from looptrace.probes.roofline import device_for

                try:
                    device_for(None, roofline_device)
                except ValueError as exc:
                    raise UsageError(f"--roofline-device: {exc}") from None
            sides, interrupted = _profile_sides(runs, cfg, common, trace, roofline_device)
        data, text = _report(sides, fmt, compare is not None)
        if interrupted:
            data["interrupted"] = True
            done = ", ".join(f"{s['header']['label']}: {'+'.join(s['windows'])}" for s in sides)
            note(f"reporting the windows that finished ({done})", "interrupted")
        with friendly_errors():
            write_output(text if fmt != OutputFormat.json else dumps(data), output, Console(width=140))
        if interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)


def _check_prompts_memory(concurrency: int, prompt_len: int) -> None:
    """The windows' random prompts within host memory, before any engine (issue #23: huge -c hung)."""
    from looptrace.engine.budget import check_memory, workload_needs

    check_memory(workload_needs(concurrency, prompt_len, "--concurrency / --prompt-len"), "cpu")


def _profile_sides(
    runs: list[tuple[str, list[str]]], cfg, common: dict, trace: Path | None, peak: str | None = None
) -> tuple[list[dict[str, Any]], bool]:
    """Profile each (recipe, overrides); the first side writes --trace. A Ctrl-C keeps the sides (and
    windows) that finished and skips the rest; with nothing finished it propagates."""
    sides: list[dict[str, Any]] = []
    for i, (name, overrides) in enumerate(runs):
        try:
            if i == 0 and trace is not None:
                with atomic_path(trace, "--trace") as tmp:
                    side = _profile_one(name, overrides, cfg, common, tmp, peak)
                side["header"]["trace"] = str(trace)
            else:
                side = _profile_one(name, overrides, cfg, common, None, peak)
        except KeyboardInterrupt:
            if not sides:
                raise
            return sides, True
        sides.append(side)
        if side["interrupted"]:
            return sides, True
    return sides, False


def _report(sides: list[dict[str, Any]], fmt: OutputFormat, compare: bool) -> tuple[dict[str, Any], str]:
    """(JSON data, rendered text). A --compare cut short by Ctrl-C before side B's decode window
    finished reports side A alone."""
    if compare and len(sides) == 2 and all("decode" in s["windows"] for s in sides):
        data = {
            "schema": "looptrace.compare/1",
            "a": _jsonable(sides[0]),
            "b": _jsonable(sides[1]),
            "decode_comparison": _comparison(sides),
            "prefill_comparison": _comparison(sides, "prefill"),
        }
        return data, render_compare(sides, fmt)
    return {"schema": "looptrace.profile/1", **_jsonable(sides[0])}, render_single(sides[0], fmt)


def _profile_one(
    recipe: str, sets: list[str], cfg, common: dict, trace: Path | None, peak: str | None = None
) -> dict[str, Any]:
    from looptrace.probes.report import to_dict
    from looptrace.probes.roofline_report import profile_roofline
    from looptrace.probes.session import plan, profile_engine

    max_len = cfg.prompt_len + 64 + (cfg.decode_steps or 0)
    setup = build_engine(recipe=recipe, sets=sets, max_model_len=max_len, **common)
    plan(setup.engine, cfg)  # a prompt that cannot fit fails here, before any profiling
    header = run_header(setup)
    label = setup.recipe.name + (" + " + ", ".join(sets) if sets else "")
    with spinner(err_console.is_terminal, f"profiling {setup.engine.spec.name} ({label})") as status:
        say = (lambda msg: status.update(f"{label}: {msg}")) if status is not None else None
        result = profile_engine(setup.engine, cfg, trace_path=trace, progress=say)
    roofline = profile_roofline(setup.engine, result, peak)  # needs the engine's modules: before release
    _release(setup)
    header["label"] = label
    header["concurrency"] = cfg.concurrency
    header["prompt_len"] = cfg.prompt_len
    header["level"] = cfg.level
    windows = {}
    for name, run in result.windows.items():
        analysis = result.analyses[name]
        windows[name] = {
            "engine": vars(run),
            "analysis": analysis,
            "report": to_dict(analysis, {}),
        }
    if roofline is not None:
        windows["decode"]["report"]["roofline"] = roofline
    return {
        "header": header,
        "windows": windows,
        "raw_profiler_counts": result.raw_counts,
        "trace_counts": result.trace_counts,
        "interrupted": result.interrupted,
    }


def _release(setup) -> None:
    """Free the engine's KV pool before the next side of a --compare sizes its own from free memory."""
    import gc

    import torch

    setup.engine = None
    gc.collect()  # the engine holds reference cycles (scheduler/block-manager callbacks)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _jsonable(side: dict[str, Any]) -> dict[str, Any]:
    """The side without live objects: header, per-window engine counters and the report dicts."""
    windows = {name: {"engine": w["engine"], **w["report"]} for name, w in side["windows"].items()}
    return {k: v for k, v in side.items() if k != "windows"} | {"windows": windows}


def _comparison(sides: list[dict[str, Any]], window: str = "decode") -> list[dict[str, Any]] | None:
    """Per-counter B vs A rows of one window (None: a side lacks it, e.g. after a Ctrl-C there)."""
    from looptrace.probes.report import compare_rows

    if not all(window in s["windows"] for s in sides):
        return None
    a, b = (s["windows"][window]["analysis"].counters for s in sides)
    return compare_rows(a, b)


# Rendering ------------------------------------------------------------------------------------------------
def _engine_table(side: dict[str, Any]) -> Table:
    t = Table(title="Engine counters in each window", title_justify="left")
    for col in (
        "window",
        "tokens",
        "steps",
        "submissions",
        "steps/tok",
        "graph replays",
        "graph captures",
        "eager fallbacks",
        "fallback reasons",
    ):
        t.add_column(col, justify="left" if col in ("window", "fallback reasons") else "right")
    for name, w in side["windows"].items():
        run = w["engine"]
        g = run["graph"]
        replays = sum(v["replays"] for v in g.values())
        captures = sum(v["captures"] for v in g.values())
        fallbacks = sum(v["fallbacks"] for v in g.values())
        reasons = ", ".join(f"{k}: {n}" for v in g.values() for k, n in v["fallback_reasons"].items()) or "-"
        style = "bold yellow" if fallbacks else None
        t.add_row(
            f"{name} (per {run['token_unit']})",
            f"{run['tokens']}",
            f"{run['steps']}",
            f"{run['submissions']}",
            f"{run['steps'] / max(run['tokens'], 1):.2f}",
            str(replays) if g else "n/a (no graphs)",
            str(captures) if g else "-",
            str(fallbacks) if g else "-",
            reasons,
            style=style,
        )
    return t


def render_single(side: dict[str, Any], fmt: OutputFormat) -> str:
    from looptrace.probes.report import counters_table, group_table, report_renderables, to_csv

    if fmt == OutputFormat.csv:
        return "\n".join(
            to_csv(w["analysis"], {"window": name, **_flat(side["header"])})
            for name, w in side["windows"].items()
        )
    if fmt == OutputFormat.json:
        return ""
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    decode = side["windows"]["decode"]["analysis"]
    for item in report_renderables(decode, _display_header(side)):
        console.print(item)
    console.print(_engine_table(side))
    _print_roofline(console, side)
    if "prefill" in side["windows"]:  # absent after a Ctrl-C in the prefill window
        prefill = side["windows"]["prefill"]["analysis"]
        console.print(
            counters_table(
                [(escape(side["header"]["label"]), prefill.counters)],
                title="Prefill window, per prompt token",
            )
        )
        console.print(group_table("Prefill kernels by op", ["op"], prefill.breakdown.by_op, prefill.counters))
    raw, ours = side["raw_profiler_counts"], side["trace_counts"]
    checks = ", ".join(f"{k} {raw[k]}/{ours[k]}" + ("" if raw[k] == ours[k] else " (differ)") for k in raw)
    console.print(f"cross-check, whole profiler session, profiler events / exported trace events: {checks}")
    return console.export_text().rstrip()


def _flat(header: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in header.items() if not isinstance(v, (dict, list))}


def _display_header(side: dict[str, Any], recipe: str | None = None) -> dict[str, Any]:
    h = side["header"]
    decode = side["windows"]["decode"]["engine"]
    keep = {
        "model": f"{h['model_preset']} ({h['family']}, {h['loops']} loops, weights {h['weights']})",
        "device": f"{h['device']}  dtype {h['dtype']}",
        "versions": ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
        "recipe": recipe or h["label"],
        "window": f"decode: {decode['steps']} steps, {decode['tokens']} tokens "
        f"at concurrency {h['concurrency']}"
        f" (prompt {h['prompt_len']})",
        "ranges": h["level"],
        "note": h["preset_note"],
    }
    if "trace" in h:
        keep["trace"] = h["trace"]
    return {k: escape(str(v)) for k, v in keep.items()}  # paths and recipe names, not markup


def render_compare(sides: list[dict[str, Any]], fmt: OutputFormat) -> str:
    from looptrace.probes.report import (
        compare_table,
        counters_table,
        header_table,
        kernels_table,
        op_compare_table,
        timeline_table,
    )

    if fmt == OutputFormat.json:
        return ""
    labels = tuple(escape(s["header"]["label"]) for s in sides)
    if labels[0] == labels[1]:
        labels = (f"A: {labels[0]}", f"B: {labels[1]}")
    if fmt == OutputFormat.csv:
        lines = ["window,counter,a_per_token,b_per_token,ratio_b_over_a"]
        for window in ("decode", "prefill"):
            for r in _comparison(sides, window) or []:
                ratio = r["ratio"] if r["ratio"] is not None else ""
                lines.append(f"{window},{r['counter']},{r['a_per_token']},{r['b_per_token']},{ratio}")
        return "\n".join(lines)
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    # Model, device and versions are shared by both sides (one --model/--device); the window is side A's.
    console.print(
        header_table(
            _display_header(
                sides[0], f"A: {sides[0]['header']['label']}  vs  B: {sides[1]['header']['label']}"
            )
        )
    )
    console.print()
    for window, unit in (("decode", "output"), ("prefill", "prompt")):
        if window == "prefill" and _comparison(sides, "prefill") is None:
            continue  # absent after a Ctrl-C in the prefill window
        xa, xb = (s["windows"][window]["analysis"] for s in sides)
        a, b = xa.counters, xb.counters
        title = f"{window.capitalize()} window, per {unit} token"
        console.print(counters_table([(labels[0], a), (labels[1], b)], title=title))
        timeline = timeline_table([(labels[0], a), (labels[1], b)], title=title)
        if timeline is not None:
            console.print(timeline)
        console.print(
            compare_table(
                a, b, labels, title="per token" if window == "decode" else "prefill, per prompt token"
            )
        )
        console.print(op_compare_table(xa, xb, labels, title=f"{title}: kernels by op"))
        if window == "decode":  # replayed kernels carry no op range: their names say where the time goes
            for x, label in ((xa, labels[0]), (xb, labels[1])):
                console.print(
                    kernels_table(f"Decode top kernels by total time: {label}", x.top_by_time, x.counters)
                )
    for s, label in zip(sides, labels):
        t = _engine_table(s)
        t.title = f"Engine counters: {label}"
        console.print(t)
    for s, label in zip(sides, labels):
        _print_roofline(console, s, f"Decode roofline per op: {label}")
    return console.export_text().rstrip()


def _print_roofline(console: Console, side: dict[str, Any], title: str = "Decode roofline per op") -> None:
    block = side["windows"].get("decode", {}).get("report", {}).get("roofline")
    if block:
        from looptrace.probes.roofline_report import roofline_table

        console.print(roofline_table(block, title))
