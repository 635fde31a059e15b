"""`looptrace profile`: what does one generated token cost, and where does it go?"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from looptrace.cli.common import (
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
    dumps,
    err_console,
    friendly_errors,
    run_header,
    write_output,
)

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace profile --model ouro                          # ouro-tiny on CPU (leaf ATen ops), ouro-1.4b on GPU
  looptrace profile --model ouro-1.4b -c 32 --set scheduler.max_num_seqs=32
  looptrace profile --model huginn --trace huginn.json    # also write a Chrome trace (open in Perfetto)
  looptrace profile --model ouro --compare base base --b-set cuda_graphs.enabled=false
  looptrace profile --model ouro --level layer --format json -o ouro.json

[bold]WHAT IS MEASURED[/]  A decode window (whole tokens, after warm-up and graph capture) and a prefill
window (a fresh burst until every request has its first token), under torch.profiler. Counters are per
output token (decode) or per prompt token (prefill). On CPU, "kernels" are leaf ATen ops.

Exit codes: 0 ok, 2 bad input, 3 environment missing.
"""

LEVELS = ("step", "loop", "layer", "op")


def profile(
    model: ModelOpt = "ouro",
    recipe: RecipeOpt = "base",
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
    fmt: FormatOpt = OutputFormat.table,
    output: OutputOpt = None,
) -> None:
    """Count kernels, launches, graph replays and fallbacks, copies, syncs and time per generated token,
    attributed to model op x layer x loop x stage (the ExactLoop paper's Table A4, automated)."""
    from looptrace.probes.session import ProfileConfig

    with friendly_errors():
        if level not in LEVELS:
            raise UsageError(f"--level '{level}': expected one of {', '.join(LEVELS)}")
        if concurrency < 1 or prompt_len < 1 or (decode_steps is not None and decode_steps < 1):
            raise UsageError("--concurrency, --prompt-len and --decode-steps must be >= 1")
        if trace is not None and not trace.parent.exists():
            raise UsageError(f"--trace {trace}: directory {trace.parent} does not exist")
        check_output_path(output)
        cfg = ProfileConfig(concurrency, prompt_len, decode_steps, level=level, seed=seed)
        common = dict(model=model, device=device, dtype=dtype, weights=weights, seed=seed, threads=threads)
        if compare is None:
            if a_set or b_set:
                raise UsageError("--a-set/--b-set only apply with --compare A B")
            side = _profile_one(recipe, list(sets or []), cfg, common, trace)
            data = {"schema": "looptrace.profile/1", **_jsonable(side)}
            text = render_single(side, fmt)
        else:
            from looptrace.recipes import load_recipe

            base = list(sets or [])
            for name, extra in zip(compare, (a_set, b_set)):  # both sides valid before any profiling
                load_recipe(name, base + list(extra or []))
            sides = [
                _profile_one(name, base + list(extra or []), cfg, common, trace if i == 0 else None)
                for i, (name, extra) in enumerate(zip(compare, (a_set, b_set)))
            ]
            data = {
                "schema": "looptrace.compare/1",
                "a": _jsonable(sides[0]),
                "b": _jsonable(sides[1]),
                "decode_comparison": _comparison(sides),
            }
            text = render_compare(sides, fmt)
    write_output(
        text if fmt == OutputFormat.table else (dumps(data) if fmt == OutputFormat.json else text),
        output,
        Console(width=140),
    )


def _profile_one(recipe: str, sets: list[str], cfg, common: dict, trace: Path | None) -> dict[str, Any]:
    from looptrace.probes.report import to_dict
    from looptrace.probes.session import profile_engine

    max_len = cfg.prompt_len + 64 + (cfg.decode_steps or 0)
    setup = build_engine(recipe=recipe, sets=sets, max_model_len=max_len, **common)
    header = run_header(setup)
    label = setup.recipe.name + (" + " + ", ".join(sets) if sets else "")
    with err_console.status(f"profiling {setup.engine.spec.name} ({label})") as status:
        result = profile_engine(
            setup.engine, cfg, trace_path=trace, progress=lambda msg: status.update(f"{label}: {msg}")
        )
    _release(setup)
    header["label"] = label
    header["concurrency"] = cfg.concurrency
    header["prompt_len"] = cfg.prompt_len
    header["level"] = cfg.level
    if trace is not None:
        header["trace"] = str(trace)
    windows = {}
    for name, run in result.windows.items():
        analysis = result.analyses[name]
        windows[name] = {
            "engine": vars(run),
            "analysis": analysis,
            "report": to_dict(analysis, {}),
        }
    return {
        "header": header,
        "windows": windows,
        "raw_profiler_counts": result.raw_counts,
        "trace_counts": result.trace_counts,
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


def _comparison(sides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from looptrace.probes.report import compare_rows

    a, b = (s["windows"]["decode"]["analysis"].counters for s in sides)
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
    from looptrace.probes.report import counters_table, report_renderables, to_csv

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
    prefill = side["windows"]["prefill"]["analysis"]
    console.print(
        counters_table(
            [(side["header"]["label"], prefill.counters)], title="Prefill window, per prompt token"
        )
    )
    from looptrace.probes.report import group_table

    console.print(group_table("Prefill kernels by op", ["op"], prefill.breakdown.by_op, prefill.counters))
    raw, ours = side["raw_profiler_counts"], side["trace_counts"]
    checks = ", ".join(f"{k} {raw[k]}/{ours[k]}" + ("" if raw[k] == ours[k] else " (differ)") for k in raw)
    console.print(f"cross-check, whole profiler session, profiler events / exported trace events: {checks}")
    return console.export_text().rstrip()


def _flat(header: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in header.items() if not isinstance(v, (dict, list))}


def _display_header(side: dict[str, Any]) -> dict[str, Any]:
    h = side["header"]
    decode = side["windows"]["decode"]["engine"]
    keep = {
        "model": f"{h['model_preset']} ({h['family']}, {h['loops']} loops, weights {h['weights']})",
        "device": f"{h['device']}  dtype {h['dtype']}",
        "versions": ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
        "recipe": h["label"],
        "window": f"decode: {decode['steps']} steps, {decode['tokens']} tokens "
        f"at concurrency {h['concurrency']}"
        f" (prompt {h['prompt_len']})",
        "ranges": h["level"],
        "note": h["preset_note"],
    }
    if "trace" in h:
        keep["trace"] = h["trace"]
    return keep


def render_compare(sides: list[dict[str, Any]], fmt: OutputFormat) -> str:
    from looptrace.probes.report import compare_table, counters_table

    if fmt == OutputFormat.json:
        return ""
    labels = tuple(s["header"]["label"] for s in sides)
    if labels[0] == labels[1]:
        labels = (f"A: {labels[0]}", f"B: {labels[1]}")
    if fmt == OutputFormat.csv:
        lines = ["counter,a_per_token,b_per_token,ratio_b_over_a"]
        for r in _comparison(sides):
            ratio = r["ratio"] if r["ratio"] is not None else ""
            lines.append(f"{r['counter']},{r['a_per_token']},{r['b_per_token']},{ratio}")
        return "\n".join(lines)
    console = Console(width=140, record=True, file=io.StringIO(), force_terminal=False)
    a, b = (s["windows"]["decode"]["analysis"].counters for s in sides)
    console.print(counters_table([(labels[0], a), (labels[1], b)], title="Decode window, per output token"))
    console.print(compare_table(a, b, labels))
    for s, label in zip(sides, labels):
        t = _engine_table(s)
        t.title = f"Engine counters: {label}"
        console.print(t)
    return console.export_text().rstrip()
