"""Wiring: engine -> EngineLoop (+ live probe, metrics) -> FastAPI app -> uvicorn on a socket we bind first.

Binding before uvicorn starts turns "port in use" into a clean error, and lets tests bind port 0 and know
the port before the server runs (connections wait in the listen backlog until uvicorn accepts).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any

from looptrace.serve.engine_loop import EngineLoop


class BindError(OSError):
    pass


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
class Server:
    """A running (or ready) server: `start()` serves on a thread, `run()` in the calling thread."""

    app: Any
    loop: EngineLoop
    sock: socket.socket
    uvicorn_server: Any = None
    thread: threading.Thread | None = None

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
        import uvicorn

        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            lifespan="off",
            ws="none",
        )
        self.uvicorn_server = uvicorn.Server(config)
        return self.uvicorn_server

    def run(self) -> None:
        """Serve until interrupted (uvicorn handles SIGINT/SIGTERM), then stop the engine thread."""
        server = self._config()
        try:
            server.run(sockets=[self.sock])
        finally:
            self.loop.stop()
            self.sock.close()

    def start(self) -> Server:
        server = self._config()
        self.thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self.sock]}, name="looptrace-http", daemon=True
        )
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.loop.stop()
        self.sock.close()


def build_server(
    engine: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "looptrace",
    aliases: tuple[str, ...] = (),
    tokenizer: Any = None,
    probe_interval: float | None = 5.0,
    info: dict[str, Any] | None = None,
    sock: socket.socket | None = None,
) -> Server:
    """Everything but the serving itself; the engine thread is started. Raises BindError."""
    from looptrace.engine.tokenizer import ByteTokenizer
    from looptrace.serve.app import create_app
    from looptrace.serve.live_probe import LiveProbe
    from looptrace.serve.metrics import ServerMetrics

    sock = sock or bind_socket(host, port)
    probe = LiveProbe(engine, interval_s=probe_interval) if probe_interval else None
    holder: dict[str, EngineLoop] = {}
    metrics = ServerMetrics(model_name, lambda: holder["loop"].snapshot())
    loop = EngineLoop(engine, model_name=model_name, metrics=metrics, probe=probe, info=info)
    holder["loop"] = loop
    app = create_app(
        loop, tokenizer=tokenizer or ByteTokenizer(), metrics=metrics, model_name=model_name, aliases=aliases
    )
    loop.start()
    return Server(app, loop, sock)
