"""`looptrace serve`: OpenAI-compatible server with Prometheus /metrics (FastAPI + uvicorn, lazy imports)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from rich.markup import escape

from looptrace.cli import common as c
from looptrace.cli import options as o

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # = looptrace.serve.plumbing's (not imported: no serve extra needed)
DEFAULT_DRAIN_TIMEOUT_S = 10.0  # = looptrace.serve.server's
DEFAULT_BODY_TIMEOUT_S = 30.0  # = looptrace.serve.plumbing's

EPILOG = """\
[bold]EXAMPLES[/]

  looptrace serve --model ouro --recipe base                 # http://127.0.0.1:8000
  looptrace serve --model ouro --tui                         # with the live dashboard in this terminal
  looptrace serve --model ouro --tui --probe-interval 5      # + live profiler windows (they pause serving)
  looptrace serve --model ouro-1.4b --weights ./Ouro-1.4B --host 0.0.0.0 --port 9000
  curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"model": "ouro", "prompt": "Hello", "max_tokens": 8}'
  looptrace top http://127.0.0.1:8000                        # attach the dashboard from another terminal
  LOOPTRACE_API_KEY=s3cret looptrace serve --model ouro --host 0.0.0.0   # all but /health need the key

[bold]ENDPOINTS[/]  POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /version, GET|HEAD /health, /metrics
(Prometheus, `looptrace:` prefix), /v1/stats and /v1/stats/stream (SSE, the dashboard's).

[bold]LIMITS[/]  A request queues at most 256 sequences (prompts x n); concurrent requests are admitted in
turn. Bodies over --max-body-bytes: 413; no body bytes for --body-timeout seconds: 408. Every error is
the OpenAI JSON error shape with a 4xx status (malformed HTTP included).

[bold]ROBUSTNESS[/]  A request that fails inside the engine fails alone (500, or an error event in its
stream). SIGTERM/SIGINT drain: no new requests, running ones finish for up to --drain-timeout seconds,
then end with an error event and [DONE]; exit 0. If the engine thread dies, /health and every request
answer 503 and the process exits 1 (for a supervisor to restart it).

Exit codes: 0 ok (also after a SIGTERM/SIGINT drain), 1 the engine died, 2 bad input (port in use,
unknown recipe, ...), 3 environment missing.
"""


HostOpt = o.opt(str, parser=o.host_name, help="Interface to bind (loopback unless told otherwise).")
PortOpt = o.opt(int, help="TCP port (0: any free port).")
TuiOpt = o.opt(bool, "--tui", help="Run the live dashboard in this terminal.")
MaxModelLenOpt = o.opt(int, help="Longest prompt + completion (tokens) a request may need.")
ServedNameOpt = o.opt(str | None, help="Model id clients send (default: the --model value).")
ProbeIntervalOpt = o.opt(
    float,
    help="Seconds between live profiler windows (0: off). A window pauses serving while the profiler stops "
    "(about 0.3 s on CPU for ouro-tiny): off by default.",
)
ApiKeyOpt = o.opt(
    str | None,
    envvar="LOOPTRACE_API_KEY",
    help="Require `Authorization: Bearer KEY` on every path but /health (401 otherwise).",
)
MaxBodyOpt = o.opt(int, help="Largest request body accepted (bytes); larger: 413.")
BodyTimeoutOpt = o.opt(float, help="A client that sends no body bytes this long (seconds) gets 408, closed.")
RequestTimeoutOpt = o.opt(float, help="Abort a request (and free its KV) after this many seconds (0: never).")
DrainTimeoutOpt = o.opt(
    float, help="On SIGTERM/SIGINT: seconds running requests may finish before they are ended."
)


def serve(
    model: o.ModelOpt = None,
    recipe: o.RecipeOpt = "base",
    sets: o.SetOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    tui: TuiOpt = False,
    max_model_len: MaxModelLenOpt = 2048,
    served_model_name: ServedNameOpt = None,
    probe_interval: ProbeIntervalOpt = 0.0,
    api_key: ApiKeyOpt = None,
    max_body_bytes: MaxBodyOpt = DEFAULT_MAX_BODY_BYTES,
    body_timeout: BodyTimeoutOpt = DEFAULT_BODY_TIMEOUT_S,
    request_timeout: RequestTimeoutOpt = 0.0,
    drain_timeout: DrainTimeoutOpt = DEFAULT_DRAIN_TIMEOUT_S,
    device: o.DeviceOpt = "auto",
    dtype: o.DtypeOpt = "auto",
    weights: o.WeightsOpt = None,
    seed: o.SeedOpt = 0,
    threads: o.ThreadsOpt = 1,
) -> None:
    """Serve a looped model over an OpenAI-compatible HTTP API, with Prometheus metrics and a stats stream."""
    _serve(SimpleNamespace(**locals()))  # every option, by name


def _serve(a: SimpleNamespace) -> None:
    if a.tui and not sys.stdout.isatty():  # the dashboard would write escape codes into a pipe or file
        raise c.fail("--tui needs a terminal, but stdout is not one (serve without --tui; `looptrace top`)")
    c.require_extra("serve", "fastapi", "prometheus_client", "sse_starlette", "uvicorn")
    # deferred: FastAPI, uvicorn and the engine load when the server starts: `looptrace --help` stays light
    from looptrace.serve.launch import ServeRequest, launch

    options = (
        "host port served_model_name probe_interval api_key max_body_bytes body_timeout request_timeout "
        "drain_timeout"
    )
    request = ServeRequest(c.build_request(a, max_model_len=a.max_model_len), **c.pick(a, options))
    with c.friendly_errors():
        started = launch(request)
    server = started.server
    server.notify = lambda msg: c.err_console.print(msg, markup=False, highlight=False, soft_wrap=True)
    if a.tui:
        _serve_with_dashboard(server)
    else:
        _serve_headless(a, server, started.setup, started.model_name)


def _serve_headless(a: SimpleNamespace, server, setup, name: str) -> None:
    auth = "  API key required (all but /health)" if a.api_key else ""
    spec, recipe = escape(setup.engine.spec.name), escape(setup.recipe.name)
    c.err_console.print(  # the names are the user's text: escaped, shown as typed
        f"[bold]looptrace serve[/] {spec} (recipe {recipe}) on {escape(server.url)}  "
        f"model id '{escape(name)}'{auth}  [dim](Ctrl-C to stop)[/]",
        highlight=False,
        soft_wrap=True,
    )
    report = server.run()
    server.notify(report.line(a.drain_timeout))
    if report.exit_code:
        msg = f"the engine died ({report.engine_error}); exiting so a supervisor can restart the server"
        raise c.fail(msg, c.EXIT_CHECK_FAILED)


def _serve_with_dashboard(server) -> None:
    try:
        # deferred: Textual, an optional extra, only for --tui
        from looptrace.tui.app import LooptraceTop
        from looptrace.tui.sources import InProcessSource
    except ImportError as exc:
        server.loop.stop()
        raise c.missing_extra("serve", exc) from None
    server.start()
    try:
        LooptraceTop(InProcessSource(server.loop.snapshot, label=f"{server.url} (in-process)")).run()
    finally:
        server.stop()
