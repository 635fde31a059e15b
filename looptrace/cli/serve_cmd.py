"""`looptrace serve`: OpenAI-compatible server with Prometheus /metrics (FastAPI + uvicorn, lazy imports)."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from looptrace.cli.common import (
    EXIT_CHECK_FAILED,
    EXIT_NO_ENV,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    RecipeOpt,
    SeedOpt,
    SetOpt,
    ThreadsOpt,
    UsageError,
    WeightsOpt,
    build_engine,
    err_console,
    fail,
    friendly_errors,
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


def serve(
    model: ModelOpt = None,
    recipe: RecipeOpt = "base",
    sets: SetOpt = None,
    host: Annotated[
        str, typer.Option(help="Interface to bind (loopback unless told otherwise).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).")] = 8000,
    tui: Annotated[bool, typer.Option("--tui", help="Run the live dashboard in this terminal.")] = False,
    max_model_len: Annotated[
        int, typer.Option(help="Longest prompt + completion (tokens) a request may need.")
    ] = 2048,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id clients send (default: the --model value).")
    ] = None,
    probe_interval: Annotated[
        float,
        typer.Option(
            help="Seconds between live profiler windows (0: off). A window pauses serving while the "
            "profiler stops (about 0.3 s on CPU for ouro-tiny): off by default."
        ),
    ] = 0.0,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LOOPTRACE_API_KEY",
            help="Require `Authorization: Bearer KEY` on /v1/* (401 otherwise); /health, /metrics open.",
        ),
    ] = None,
    max_body_bytes: Annotated[
        int, typer.Option(help="Largest request body accepted (bytes); larger: 413.")
    ] = DEFAULT_MAX_BODY_BYTES,
    request_timeout: Annotated[
        float, typer.Option(help="Abort a request (and free its KV) after this many seconds (0: never).")
    ] = 0.0,
    drain_timeout: Annotated[
        float,
        typer.Option(help="On SIGTERM/SIGINT: seconds running requests may finish before they are ended."),
    ] = DEFAULT_DRAIN_TIMEOUT_S,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = None,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = 1,
) -> None:
    """Serve a looped model over an OpenAI-compatible HTTP API, with Prometheus metrics and a stats stream."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise _missing_extra(exc) from None
    from looptrace.serve.server import BindError, bind_socket, build_server

    with friendly_errors():
        if not 0 <= port <= 65535:
            raise UsageError(f"--port {port}: expected 0..65535")
        if max_model_len < 2:
            raise UsageError(f"--max-model-len {max_model_len}: expected at least 2")
        if not (math.isfinite(probe_interval) and probe_interval >= 0):
            raise UsageError(f"--probe-interval {probe_interval}: expected a number >= 0")
        _check_serving_options(api_key, max_body_bytes, request_timeout, drain_timeout)
        try:
            sock = bind_socket(host, port)  # before the engine: a busy port fails fast
        except BindError as exc:
            raise UsageError(str(exc)) from None
        try:
            setup = build_engine(
                model=model,
                recipe=recipe,
                sets=sets,
                device=device,
                dtype=dtype,
                weights=weights,
                seed=seed,
                threads=threads,
                max_model_len=max_model_len,
            )
        except BaseException:
            sock.close()
            raise
    engine = setup.engine
    from looptrace.engine.tokenizer import load_tokenizer

    name = served_model_name or model or engine.spec.family
    aliases = tuple(a for a in (engine.spec.name,) if a != name)
    info = {"recipe": setup.recipe.name, "preset": engine.spec.name, "device": str(engine.device)}
    server = build_server(
        engine,
        model_name=name,
        aliases=aliases,
        tokenizer=load_tokenizer(weights),
        probe_interval=probe_interval or None,
        info=info,
        sock=sock,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        request_timeout=request_timeout or None,
        drain_timeout=drain_timeout,
    )
    server.notify = lambda msg: err_console.print(msg, markup=False, highlight=False, soft_wrap=True)
    if not tui:
        auth = "  API key required on /v1/*" if api_key else ""
        err_console.print(
            f"[bold]looptrace serve[/] {engine.spec.name} (recipe {setup.recipe.name}) on {server.url}  "
            f"model id '{name}'{auth}  [dim](Ctrl-C to stop)[/]",
            highlight=False,
            soft_wrap=True,
        )
        report = server.run()
        server.notify(report.line(drain_timeout))
        if report.exit_code:
            msg = f"the engine died ({report.engine_error}); exiting so a supervisor can restart the server"
            raise fail(msg, EXIT_CHECK_FAILED)
        return
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
