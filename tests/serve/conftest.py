"""A real server on 127.0.0.1 (uvicorn on a thread, port chosen by the OS) around a tiny Ouro on CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "serve_load.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_load", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_engine(max_num_seqs: int = 8, max_model_len: int = 256):
    """The tiny Ouro with seeded random weights, built as `looptrace serve` builds it (recipe base)."""
    from tests.helpers import build_setup

    sets = (f"scheduler.max_num_seqs={max_num_seqs}", f"scheduler.max_model_len={max_model_len}")
    return build_setup("ouro", *sets).engine


@pytest.fixture(scope="module")
def server():
    from looptrace.serve.server import build_server

    srv = build_server(make_engine(), port=0, model_name="ouro", aliases=("ouro-tiny",), probe_interval=1.0)
    srv.start()
    yield srv
    srv.stop()


class Proc:
    """`looptrace serve` in a subprocess (optionally after `patch`, Python run first); its URL from stderr."""

    def __init__(self, *args: str, patch: str = "", env: dict | None = None) -> None:
        argv = ["looptrace", "serve", "--model", "ouro", "--device", "cpu", "--port", "0", *args]
        code = f"{patch}\nimport sys\nsys.argv = {argv!r}\nfrom looptrace.cli.main import main\nmain()\n"
        self.p = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.url_found = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.url_found.wait(120):
            self.p.kill()
            raise AssertionError("server did not start: " + "".join(self.lines))

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if m and not self.url:
                self.url = m.group(1)
                self.url_found.set()

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


def stalled_upload(url: str, declared: int = 100, sent: int = 10) -> socket.socket:
    """A raw connection that declares a `declared`-byte body, sends `sent` bytes of it and stalls."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + b"{" * sent)
    return sock


def read_response(sock: socket.socket, timeout: float) -> tuple[bytes, bytes]:
    """(status line + headers, body) read until the server closes the connection; raises on timeout."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body
