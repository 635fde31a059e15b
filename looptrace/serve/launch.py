"""`looptrace serve` up to its first request: the options checked, the port bound (a busy one fails before
the engine is built), the engine built through `looptrace.build`, the HTTP server over it with its engine
thread started. No CLI here: bad input is a one-line `ServeOptionError` or the build's own error (the CLI:
exit code 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from looptrace.build import BuildRequest, EngineSetup, build
from looptrace.engine.tokenizer import load_tokenizer
from looptrace.serve.plumbing import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from looptrace.serve.server import (
    DEFAULT_DRAIN_TIMEOUT_S,
    BindError,
    ServeOptionError,
    Server,
    bind_socket,
    build_server,
    check_options,
)


@dataclass(frozen=True)
class ServeRequest:
    """What `looptrace serve` was asked: the engine (its `max_model_len` is the longest prompt + completion
    a request may need) and the server's options."""

    build: BuildRequest
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # the model id clients send (None: --model, else the family)
    probe_interval: float = 0.0  # seconds between live profiler windows; 0: off
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    request_timeout: float = 0.0  # 0: never
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S


@dataclass
class Launched:
    """The server (engine thread running, HTTP not yet), the engine it serves and the id clients send."""

    server: Server
    setup: EngineSetup
    model_name: str


def launch(request: ServeRequest) -> Launched:
    """Check the options, bind the port, build the engine, put the server over it."""
    check_options(
        port=request.port,
        max_model_len=request.build.max_model_len,
        probe_interval=request.probe_interval,
        api_key=request.api_key,
        max_body_bytes=request.max_body_bytes,
        request_timeout=request.request_timeout,
        drain_timeout=request.drain_timeout,
        body_timeout=request.body_timeout,
        served_model_name=request.served_model_name,
    )
    try:
        sock = bind_socket(request.host, request.port)  # before the engine: a busy port fails fast
    except BindError as exc:
        raise ServeOptionError(str(exc)) from None  # --host/--port name an address that cannot be used
    try:
        setup = _engine(request.build)
    except BaseException:
        sock.close()
        raise
    name = request.served_model_name or request.build.model or setup.engine.spec.family
    return Launched(_server(request, setup, sock, name), setup, name)


def _engine(request: BuildRequest) -> EngineSetup:
    """The engine for requests of up to `max_model_len` positions, which the model must have."""
    model = request.resolve_model()
    if request.max_model_len > model.spec.max_position:  # the build would clamp it silently
        raise ServeOptionError(
            f"--max-model-len {request.max_model_len}: {model.spec.name} has {model.spec.max_position} "
            "positions at most"
        )
    return build(request, model)


def _server(request: ServeRequest, setup: EngineSetup, sock: Any, name: str) -> Server:
    engine = setup.engine
    aliases = tuple(x for x in (engine.spec.name,) if x != name)
    info = {"recipe": setup.recipe.name, "preset": engine.spec.name, "device": str(engine.device)}
    return build_server(
        engine,
        model_name=name,
        aliases=aliases,
        tokenizer=load_tokenizer(request.build.weights),
        probe_interval=request.probe_interval or None,
        info=info,
        sock=sock,
        api_key=request.api_key,
        max_body_bytes=request.max_body_bytes,
        body_timeout=request.body_timeout,
        request_timeout=request.request_timeout or None,
        drain_timeout=request.drain_timeout,
    )
