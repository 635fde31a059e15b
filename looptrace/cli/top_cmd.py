"""`looptrace top`: the live dashboard on a looptrace server, a vLLM Prometheus endpoint or a replay."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.console import Console

from looptrace.cli.common import EXIT_NO_ENV, UsageError, fail, friendly_errors, require_extra
from looptrace.cli.options import OutputFormat, arg, opt
from looptrace.cli.output import check_output

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace top                                        # the server at http://127.0.0.1:8000
  looptrace top http://10.0.0.5:9000 --record s.jsonl  # record every snapshot while watching
  looptrace top --replay s.jsonl --speed 4             # replay a recording at 4x speed
  looptrace top --prometheus http://vllm-host:8000/metrics   # any vLLM server's metrics
  looptrace top --once                                 # one snapshot as a table (scripts, CI logs)
  looptrace top --once --format json                   # the same snapshot as JSON
  looptrace top --diff diff.json                       # with a diff result for the `d` screen

[bold]KEYS[/]  q quit, ? help, p pause, r record, s sort, d diff screen, Tab next panel.

A server started with --api-key wants the same key in the LOOPTRACE_API_KEY environment variable.

Exit codes: 0 ok, 2 bad input (unreachable URL, refused key, malformed snapshot or replay file),
3 environment missing.
"""

DEFAULT_URL = "http://127.0.0.1:8000"


UrlArg = arg(str | None, help="looptrace server URL.", show_default=DEFAULT_URL)
PrometheusOpt = opt(
    str | None, help="Watch a Prometheus endpoint (vLLM's /metrics) instead of a looptrace server."
)
ReplayOpt = opt(Path | None, help="Replay a session recorded with --record.")
SpeedOpt = opt(float, help="Replay speed factor (0: as fast as possible).")
RecordOpt = opt(Path | None, help="Record every snapshot to this JSONL file.")
OnceOpt = opt(bool, "--once", help="Print one snapshot (a table, or --format json) and exit.")
OnceFormatOpt = opt(
    OutputFormat | None, "--format", "-f", help="--once: table or json.", show_default="table"
)
DiffOpt = opt(Path | None, help="A diff result JSON for the diff screen (d).")
IntervalOpt = opt(float, help="Seconds between snapshots (--once: between its two, for tokens/s).")
ScreenshotOpt = opt(Path | None, help="Save an SVG screenshot after a few snapshots and exit.", hidden=True)


def top(
    url: UrlArg = None,
    prometheus: PrometheusOpt = None,
    replay: ReplayOpt = None,
    speed: SpeedOpt = 1.0,
    record: RecordOpt = None,
    once: OnceOpt = False,
    diff: DiffOpt = None,
    interval: IntervalOpt = 1.0,
    fmt: OnceFormatOpt = None,
    screenshot: ScreenshotOpt = None,
) -> None:
    """Live dashboard: throughput, TTFT/TPOT, requests by stage and loop, per-token probe counters, KV pool,
    CUDA graphs, prefix cache and prefill depth."""
    require_extra("top", "httpx", "prometheus_client")
    with friendly_errors():
        if len([x for x in (url, prometheus, replay) if x is not None]) > 1:
            raise UsageError("give one of URL, --prometheus URL or --replay FILE")
        _check_numbers(interval, speed)
        if fmt is not None and not once:
            raise UsageError("--format applies to --once (the dashboard draws, it prints nothing)")
        if fmt == OutputFormat.csv:
            raise UsageError("--format csv: top --once prints a table or json")
        for path, opt in ((record, "--record"), (screenshot, "--screenshot")):
            check_output(path, opt, [(replay, "--replay"), (diff, "--diff")])  # writable, not an input
        diff_requests = _load_diff(diff)
        source, first = _source(url, prometheus, replay)
    if once:
        _print_once(source, first, interval, replay is not None, record, fmt or OutputFormat.table)
        return
    _dashboard(source, interval, speed, record, diff_requests, screenshot)


def _check_numbers(interval: float, speed: float) -> None:
    """NaN passes every comparison (`nan <= 0` is False): say finite first."""
    if not (math.isfinite(interval) and interval > 0):
        raise UsageError(f"--interval {interval}: expected a finite number of seconds > 0")
    if not (math.isfinite(speed) and speed >= 0):
        raise UsageError(f"--speed {speed}: expected a finite factor >= 0 (0: as fast as possible)")


def _load_diff(diff: Path | None):
    if diff is None:
        return None
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.tui.diff_data import DiffDataError, load_diff

    try:
        return load_diff(diff)
    except DiffDataError as exc:
        raise UsageError(str(exc)) from None


def _source(url: str | None, prometheus: str | None, replay: Path | None):
    """The source to watch and its first snapshot (unreachable or wrong endpoint: fail here, in one line)."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.tui.sources import (
        LooptraceSource,
        PrometheusSource,
        ReplayError,
        ReplaySource,
        SourceError,
    )

    try:
        if replay is not None:
            source = ReplaySource(replay)
        elif prometheus is not None:
            source = PrometheusSource(prometheus)
        else:
            source = LooptraceSource(url or DEFAULT_URL)
        return source, source.fetch()
    except (ReplayError, SourceError) as exc:
        raise UsageError(str(exc)) from None


def _print_once(source, first: dict, interval: float, replayed: bool, record, fmt: OutputFormat) -> None:
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.tui.once import snapshot_table

    with friendly_errors():
        last, throughput = _once(source, first, interval, replayed, record)
    if fmt == OutputFormat.json:
        document = {"source": source.label, "output_tokens_per_s": throughput, "snapshot": last}
        print(json.dumps(document, indent=2))
        return
    Console(width=110).print(snapshot_table(last, source.label, throughput))


def _dashboard(source, interval: float, speed: float, record, diff_requests, screenshot: Path | None) -> None:
    try:
        # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
        from looptrace.tui.app import LooptraceTop
    except ImportError as exc:
        raise fail(
            f"`looptrace top` needs textual ({exc.name} is missing): pip install textual", EXIT_NO_ENV
        ) from None
    app = LooptraceTop(
        source, interval=interval, speed=speed, record_path=record, diff=diff_requests, screenshot=screenshot
    )
    if screenshot is not None:
        app.run(headless=True, size=(140, 44))
    else:
        app.run()


def _once(
    source, first: dict, interval: float, replayed: bool, record: Path | None
) -> tuple[dict, float | None]:
    """The snapshot to print and the output tokens/s between two snapshots: the replay's last two frames,
    or a live source fetched again `interval` seconds after the first (one snapshot holds only totals).
    With --record, every snapshot read goes to the session file too."""
    # deferred: the command's implementation loads when it runs: `looptrace --help` stays light
    from looptrace.tui.model import DashboardModel
    from looptrace.tui.sources import Recorder, SourceError

    model = DashboardModel()
    recorder = Recorder(record, source.label) if record is not None else None
    try:
        if replayed:
            for t, snap in source.frames:
                model.ingest(snap)
                if recorder is not None:
                    recorder.write(snap, now=t)  # the replay's own times
        else:
            model.ingest(first)
            if recorder is not None:
                recorder.write(first)
            time.sleep(interval)
            try:
                second = source.fetch()
            except SourceError as exc:
                raise UsageError(str(exc)) from None
            model.ingest(second)
            if recorder is not None:
                recorder.write(second)
    finally:
        if recorder is not None:
            recorder.close()
    return model.latest or first, model.throughput[-1] if model.throughput else None
