"""`looptrace serve`: OpenAI-compatible server with Prometheus /metrics (FastAPI + uvicorn, lazy imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from looptrace.build import build_engine, resolve_model
from looptrace.cli.common import (
    EXIT_CHECK_FAILED,
    EXIT_NO_ENV,
    UsageError,
    err_console,
    fail,
    friendly_errors,
)
from looptrace.cli.options import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    RecipeOpt,
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    WeightsOpt,
)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # = looptrace.serve.plumbing's (not imported: no serve extra needed)
DEFAULT_DRAIN_TIMEOUT_S = 10.0  # = looptrace.serve.server's

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace serve --model ouro --recipe base                 # http://127.0.0.1:8000
  looptrace serve --model ouro --tui                         # with the live dashboard in this terminal
  looptrace serve --model ouro --tui --probe-interval 5      # + live profiler windows (they pause serving)
  looptrace serve --model ouro-1.4b --weights ./Ouro-1.4B --host 0.0.0.0 --port 9000
  curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"model": "ouro", "prompt": "Hello", "max_tokens": 8}'
  looptrace top http://127.0.0.1:8000                        # attach the dashboard from another terminal
  LOOPTRACE_API_KEY=s3cret looptrace serve --model ouro --host 0.0.0.0   # /v1/* then needs the key

[bold]ENDPOINTS[/]  POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
/health, /metrics (Prometheus, `looptrace:` prefix), /v1/stats and /v1/stats/stream (SSE, the dashboard's).

[bold]ROBUSTNESS[/]  A request that fails inside the engine fails alone (500, or an error event in its
stream). SIGTERM/SIGINT drain: no new requests, running ones finish for up to --drain-timeout seconds,
then end with an error event and [DONE]; exit 0. If the engine thread dies, /health and every request
answer 503 and the process exits 1 (for a supervisor to restart it).

Exit codes: 0 ok (also after a SIGTERM/SIGINT drain), 1 the engine died, 2 bad input (port in use,
unknown recipe, ...), 3 environment missing.
"""


def _check_serving_options(
    api_key: str | None, max_body_bytes: int, request_timeout: float, drain_timeout: float
) -> None:
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key (or LOOPTRACE_API_KEY): empty")
    if max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes {max_body_bytes}: expected at least 1024")
    for name, value in (("--request-timeout", request_timeout), ("--drain-timeout", drain_timeout)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{name} {value}: expected a number of seconds >= 0")


def _missing_extra(exc: ImportError) -> typer.Exit:
    return fail(
        f"`looptrace serve` needs the serve extra ({exc.name} is missing): pip install 'looptrace[serve]'",
        EXIT_NO_ENV,
    )


HostOpt = Annotated[str, typer.Option(help="Interface to bind (loopback unless told otherwise).")]
PortOpt = Annotated[int, typer.Option(help="TCP port (0: any free port).")]
TuiOpt = Annotated[bool, typer.Option("--tui", help="Run the live dashboard in this terminal.")]
MaxModelLenOpt = Annotated[int, typer.Option(help="Longest prompt + completion (tokens) a request may need.")]
ServedNameOpt = Annotated[
    str | None, typer.Option(help="Model id clients send (default: the --model value).")
]
ProbeIntervalOpt = Annotated[
    float,
    typer.Option(
        help="Seconds between live profiler windows (0: off). A window pauses serving while the "
        "profiler stops (about 0.3 s on CPU for ouro-tiny): off by default."
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        envvar="LOOPTRACE_API_KEY",
        help="Require `Authorization: Bearer KEY` on /v1/* (401 otherwise); /health, /metrics open.",
    ),
]
MaxBodyOpt = Annotated[int, typer.Option(help="Largest request body accepted (bytes); larger: 413.")]
RequestTimeoutOpt = Annotated[
    float, typer.Option(help="Abort a request (and free its KV) after this many seconds (0: never).")
]
DrainTimeoutOpt = Annotated[
    float, typer.Option(help="On SIGTERM/SIGINT: seconds running requests may finish before they are ended.")
]


def serve(
    model: ModelOpt = None,
    recipe: RecipeOpt = "base",
    sets: SetOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    tui: TuiOpt = False,
    max_model_len: MaxModelLenOpt = 2048,
    served_model_name: ServedNameOpt = None,
    probe_interval: ProbeIntervalOpt = 0.0,
    api_key: ApiKeyOpt = None,
    max_body_bytes: MaxBodyOpt = DEFAULT_MAX_BODY_BYTES,
    request_timeout: RequestTimeoutOpt = 0.0,
    drain_timeout: DrainTimeoutOpt = DEFAULT_DRAIN_TIMEOUT_S,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
) -> None:
    """Serve a looped model over an OpenAI-compatible HTTP API, with Prometheus metrics and a stats stream."""
    _serve(_ServeArgs(**locals()))  # every option, by name (the dataclass lists the same fields)


@dataclass(frozen=True)
class _ServeArgs:
    model: str | None
    recipe: str
    sets: list[str] | None
    host: str
    port: int
    tui: bool
    max_model_len: int
    served_model_name: str | None
    probe_interval: float
    api_key: str | None
    max_body_bytes: int
    request_timeout: float
    drain_timeout: float
    device: str
    dtype: str
    weights: Path | None
    seed: int
    threads: int


def _serve(a: _ServeArgs) -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise _missing_extra(exc) from None
    setup, sock = _engine_and_socket(a)
    server, name = _server(a, setup, sock)
    server.notify = lambda msg: err_console.print(msg, markup=False, highlight=False, soft_wrap=True)
    if a.tui:
        _serve_with_dashboard(server)
    else:
        _serve_headless(a, server, setup, name)


def _engine_and_socket(a: _ServeArgs):
    """Check the options, bind the port (a busy one fails fast), then build the engine."""
    from looptrace.serve.server import BindError, bind_socket

    with friendly_errors():
        if not 0 <= a.port <= 65535:
            raise UsageError(f"--port {a.port}: expected 0..65535")
        if a.max_model_len < 2:
            raise UsageError(f"--max-model-len {a.max_model_len}: expected at least 2")
        if not (math.isfinite(a.probe_interval) and a.probe_interval >= 0):
            raise UsageError(f"--probe-interval {a.probe_interval}: expected a number >= 0")
        _check_serving_options(a.api_key, a.max_body_bytes, a.request_timeout, a.drain_timeout)
        try:
            sock = bind_socket(a.host, a.port)  # before the engine: a busy port fails fast
        except BindError as exc:
            raise UsageError(str(exc)) from None
        try:
            setup = build_engine(
                resolve_model(a.model, a.device, a.weights),
                recipe=a.recipe,
                sets=a.sets,
                device=a.device,
                dtype=a.dtype,
                seed=a.seed,
                threads=a.threads,
                max_model_len=a.max_model_len,
            )
        except BaseException:
            sock.close()
            raise
    return setup, sock


def _server(a: _ServeArgs, setup, sock):
    """The HTTP server over the engine, and the model id clients send."""
    from looptrace.engine.tokenizer import load_tokenizer
    from looptrace.serve.server import build_server

    engine = setup.engine
    name = a.served_model_name or a.model or engine.spec.family
    aliases = tuple(x for x in (engine.spec.name,) if x != name)
    info = {"recipe": setup.recipe.name, "preset": engine.spec.name, "device": str(engine.device)}
    server = build_server(
        engine,
        model_name=name,
        aliases=aliases,
        tokenizer=load_tokenizer(a.weights),
        probe_interval=a.probe_interval or None,
        info=info,
        sock=sock,
        api_key=a.api_key,
        max_body_bytes=a.max_body_bytes,
        request_timeout=a.request_timeout or None,
        drain_timeout=a.drain_timeout,
    )
    return server, name


def _serve_headless(a: _ServeArgs, server, setup, name: str) -> None:
    auth = "  API key required on /v1/*" if a.api_key else ""
    err_console.print(
        f"[bold]looptrace serve[/] {setup.engine.spec.name} (recipe {setup.recipe.name}) on {server.url}  "
        f"model id '{name}'{auth}  [dim](Ctrl-C to stop)[/]",
        highlight=False,
        soft_wrap=True,
    )
    report = server.run()
    server.notify(report.line(a.drain_timeout))
    if report.exit_code:
        msg = f"the engine died ({report.engine_error}); exiting so a supervisor can restart the server"
        raise fail(msg, EXIT_CHECK_FAILED)


def _serve_with_dashboard(server) -> None:
    try:
        from looptrace.tui.app import LooptraceTop
        from looptrace.tui.sources import InProcessSource
    except ImportError as exc:
        server.loop.stop()
        raise _missing_extra(exc) from None
    server.start()
    try:
        LooptraceTop(InProcessSource(server.loop.snapshot, label=f"{server.url} (in-process)")).run()
    finally:
        server.stop()
