"""Wiring: engine -> EngineLoop (+ live probe, metrics) -> FastAPI app -> uvicorn on a socket we bind first.

Binding before uvicorn starts turns "port in use" into a clean error, and lets tests bind port 0 and know
the port before the server runs (connections wait in the listen backlog until uvicorn accepts).

Shutdown. SIGTERM or SIGINT (our handlers, not uvicorn's: uvicorn re-raises the signal after its
shutdown, which made SIGTERM exit 143) starts a drain: uvicorn stops accepting and closes idle
connections, the engine loop refuses new requests with 503 and lets running ones finish for
`drain_timeout` seconds, then ends the rest with an error event and `[DONE]`; uvicorn waits for those
responses (DRAIN_GRACE_S more), the engine thread stops, `run()` returns exit code 0. A second signal
ends the running requests at once (still with their final events); a third forces uvicorn out.
sse-starlette's own shutdown handling, which cancels every stream mid-flight, is turned off.

Engine death. If the engine thread dies, every request gets a 503 at once and /health is 503; after
DEAD_LINGER_S (so health checks see it) uvicorn shuts down and `run()` returns exit code 1, for a
supervisor to restart the server.
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from looptrace.engine.tokenizer import ByteTokenizer
from looptrace.serve.engine_loop import EngineLoop
from looptrace.serve.live_probe import LiveProbe
from looptrace.serve.plumbing import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, JsonErrorH11Protocol

DEFAULT_DRAIN_TIMEOUT_S = 10.0
DRAIN_GRACE_S = 5.0  # past the drain deadline: time to send the final error events before uvicorn cancels
DEAD_LINGER_S = 1.0  # after the engine died: keep answering 503 this long, then exit


class BindError(OSError):
    pass


class ServeOptionError(ValueError):
    """A server option out of range (one line naming the `looptrace serve` flag)."""


def check_options(
    *,
    port: int,
    max_model_len: int,
    probe_interval: float,
    api_key: str | None,
    max_body_bytes: int,
    request_timeout: float,
    drain_timeout: float,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    served_model_name: str | None = None,
) -> None:
    """`looptrace serve`'s options, before the port is bound and the engine built (errors name the flag)."""
    if not 0 <= port <= 65535:
        raise ServeOptionError(f"--port {port}: expected 0..65535")
    if max_model_len < 2:
        raise ServeOptionError(f"--max-model-len {max_model_len}: expected at least 2")
    if not (math.isfinite(probe_interval) and probe_interval >= 0):
        raise ServeOptionError(f"--probe-interval {probe_interval}: expected a number >= 0")
    if api_key is not None and not api_key.strip():
        raise ServeOptionError("--api-key (or LOOPTRACE_API_KEY): empty")
    if api_key is not None and not all("!" <= ch <= "~" for ch in api_key):
        # A client sends it in an HTTP header: a line break or non-ASCII character could never match.
        raise ServeOptionError(
            "--api-key (or LOOPTRACE_API_KEY): expected printable ASCII without spaces or line breaks"
        )
    if served_model_name is not None and not served_model_name.strip():
        raise ServeOptionError("--served-model-name: empty (clients send it as `model`)")
    if max_body_bytes < 1024:
        raise ServeOptionError(f"--max-body-bytes {max_body_bytes}: expected at least 1024")
    for name, value in (("--request-timeout", request_timeout), ("--drain-timeout", drain_timeout)):
        if not (math.isfinite(value) and value >= 0):
            raise ServeOptionError(f"{name} {value}: expected a number of seconds >= 0")
    if not (math.isfinite(body_timeout) and body_timeout > 0):
        raise ServeOptionError(f"--body-timeout {body_timeout}: expected a number of seconds > 0")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "address already in use" if exc.errno in (98, 48, 10048) else exc.strerror or str(exc)
        raise BindError(f"cannot listen on {host}:{port}: {why}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class ShutdownReport:
    signals: list[str]
    engine_error: str | None  # set when the engine died (exit code 1)
    in_flight: int  # requests queued or running when the drain began
    ended_at_deadline: int  # of those, ended with an error event at the drain timeout
    request_blocks_at_exit: int | None  # KV blocks still held by requests after the engine stopped

    @property
    def exit_code(self) -> int:
        return 1 if self.engine_error else 0

    def line(self, drain_timeout: float) -> str:
        how = f"on {'+'.join(self.signals)}" if self.signals else "on request"
        return (
            f"looptrace serve stopped {how}: {self.in_flight} request(s) in flight, "
            f"{self.ended_at_deadline} ended at the drain timeout ({drain_timeout:g} s); "
            f"KV blocks held by requests at exit: {self.request_blocks_at_exit}"
        )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Server:
    """A running (or ready) server: `start()` serves on a thread, `run()` in the calling thread."""

    app: Any
    loop: EngineLoop
    sock: socket.socket
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    exit_on_dead: bool = True  # engine death shuts the HTTP side down too (the CLI then exits 1)
    notify: Callable[[str], None] = _stderr
    uvicorn_server: Any = None
    thread: threading.Thread | None = None
    signals: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loop.on_dead = self._on_dead

    @property
    def host(self) -> str:
        return self.sock.getsockname()[0]

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _config(self):
        config = uvicorn.Config(
            self.app,
            http=JsonErrorH11Protocol,  # malformed HTTP answered with the JSON error shape
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=self.drain_timeout + DRAIN_GRACE_S,
            lifespan="off",
            ws="none",
        )
        self.uvicorn_server = _uvicorn_server(config, self._on_signal)
        return self.uvicorn_server

    def _on_signal(self, sig: int) -> None:
        """Runs in the main thread between bytecodes: set flags only."""
        self.signals.append(signal.Signals(sig).name)
        server = self.uvicorn_server
        if len(self.signals) == 1:
            self.loop.begin_drain(self.drain_timeout)
            self.notify(f"looptrace serve: {self.signals[0]}: draining for up to {self.drain_timeout:g} s")
        elif len(self.signals) == 2:
            self.loop.begin_drain(0.0)  # end the running requests now, still with their final events
        else:
            server.force_exit = True
        server.should_exit = True

    def _on_dead(self, exc: BaseException) -> None:
        """On the engine thread, as it dies."""
        self.notify(f"looptrace serve: the engine died ({type(exc).__name__}: {exc}); every request gets 503")
        if self.exit_on_dead:
            timer = threading.Timer(DEAD_LINGER_S, self._shut)
            timer.daemon = True
            timer.start()

    def _shut(self) -> None:
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True

    def run(self) -> ShutdownReport:
        """Serve until a signal (a drained shutdown) or the engine's death, then stop the engine thread."""
        server = self._config()
        try:
            server.run(sockets=[self.sock])
        finally:
            self.loop.stop()
            self.sock.close()
            gc.unfreeze()  # the startup heap frozen by `build`
        return self.report()

    def report(self) -> ShutdownReport:
        d = self.loop.drain
        error = self.loop.status() if self.loop.dead else None
        return ShutdownReport(
            list(self.signals), error, d.in_flight, d.ended_at_deadline, d.request_blocks_at_exit
        )

    def start(self) -> Server:
        server = self._config()
        self.thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self.sock]}, name="looptrace-http", daemon=True
        )
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0, drain_timeout: float = 0.0) -> ShutdownReport:
        """Drain (running requests end with an error event after `drain_timeout`), stop HTTP and engine."""
        self.loop.begin_drain(drain_timeout)
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.loop.stop()
        gc.unfreeze()  # the startup heap frozen by `build`
        self.sock.close()
        return self.report()


def _uvicorn_server(config: Any, on_signal: Callable[[int], None]) -> Any:
    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's version re-raises the signal once served (SIGTERM: exit 143); a drain exits 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handlers = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in handlers.items():
                    signal.signal(s, handler)

        def _signal(self, sig: int, _frame: Any) -> None:
            on_signal(sig)

    return _Server(config)


def build_server(
    engine: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "looptrace",
    aliases: tuple[str, ...] = (),
    tokenizer: Any = None,
    probe_interval: float | None = None,  # seconds between live-probe windows; None: no probe
    info: dict[str, Any] | None = None,
    sock: socket.socket | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    request_timeout: float | None = None,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    exit_on_dead: bool = True,
) -> Server:
    """Everything but the serving itself; the engine thread is started. Raises BindError."""
    # deferred: sse-starlette and prometheus_client load when a server is built, not for its option checks
    from sse_starlette.sse import AppStatus

    from looptrace.serve.app import create_app
    from looptrace.serve.metrics import ServerMetrics

    # Our drain ends every stream with its final events; sse-starlette's would cancel them mid-flight.
    AppStatus.disable_automatic_graceful_drain()
    sock = sock or bind_socket(host, port)
    probe = LiveProbe(engine, interval_s=probe_interval) if probe_interval else None
    holder: dict[str, EngineLoop] = {}
    metrics = ServerMetrics(model_name, lambda: holder["loop"].snapshot())
    loop = EngineLoop(
        engine,
        model_name=model_name,
        metrics=metrics,
        probe=probe,
        info=info,
        request_timeout=request_timeout,
    )
    holder["loop"] = loop
    app = create_app(
        loop,
        tokenizer=tokenizer or ByteTokenizer(),
        metrics=metrics,
        model_name=model_name,
        aliases=aliases,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
    )
    server = Server(app, loop, sock, drain_timeout=drain_timeout, exit_on_dead=exit_on_dead)
    # The startup heap (engine, weights, compiled kernels) lives as long as the server: out of the cyclic
    # collector's reach, whose full passes over it paused engine steps for ~170 ms on the H200
    # (bench/results/h200/ttft-spikes/; `looptrace bench` freezes it per run the same way).
    gc.collect()
    gc.freeze()
    loop.start()
    return server
