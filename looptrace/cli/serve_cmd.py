"""`looptrace serve`: OpenAI-compatible server with Prometheus /metrics (FastAPI + uvicorn, lazy imports)."""

from __future__ import annotations

from typing import Annotated

import typer

from looptrace.cli.common import (
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

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace serve --model ouro --recipe base                 # http://127.0.0.1:8000
  looptrace serve --model ouro --tui                         # with the live dashboard in this terminal
  looptrace serve --model ouro-1.4b --weights ./Ouro-1.4B --host 0.0.0.0 --port 9000
  curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"model": "ouro", "prompt": "Hello", "max_tokens": 8}'
  looptrace top http://127.0.0.1:8000                        # attach the dashboard from another terminal

[bold]ENDPOINTS[/]  POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
/health, /metrics (Prometheus, `looptrace:` prefix), /v1/stats and /v1/stats/stream (SSE, the dashboard's).

Exit codes: 0 ok, 2 bad input (port in use, unknown recipe, ...), 3 environment missing.
"""


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
        float, typer.Option(help="Seconds between live profiler windows (0: off).")
    ] = 5.0,
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
        if probe_interval < 0:
            raise UsageError(f"--probe-interval {probe_interval}: expected >= 0")
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
    )
    if not tui:
        err_console.print(
            f"[bold]looptrace serve[/] {engine.spec.name} (recipe {setup.recipe.name}) on {server.url}  "
            f"model id '{name}'  [dim](Ctrl-C to stop)[/]"
        )
        server.run()
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
