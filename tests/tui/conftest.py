from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

pytest.importorskip("textual")

from tests.helpers import loopback_server  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
SESSION = FIXTURES / "session.jsonl"
DIFF = {
    "requests": [
        {"id": "same", "a_tokens": [5, 6, 7, 8], "b_tokens": [5, 6, 7, 8], "first_divergence": None},
        {
            "id": "req-1",
            "a_tokens": [1, 2, 3, 4, 5, 6],
            "b_tokens": [1, 2, 3, 9, 5, 6],
            "first_divergence": 3,
        },
        {"id": "short", "a_tokens": [1, 2], "b_tokens": [1, 2, 3]},
    ]
}


@pytest.fixture
def vllm_endpoint():
    """A loopback HTTP server that answers /metrics with recorded vLLM scrapes, one after the other
    (the last one repeats)."""
    scrapes = [(FIXTURES / f"vllm_metrics_{i}.txt").read_bytes() for i in (1, 2)]
    served = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = scrapes[min(served["n"], len(scrapes) - 1)]
            served["n"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with loopback_server(Handler) as base:
        yield f"{base}/metrics", served


@pytest.fixture
def stats_endpoint():
    """A loopback HTTP server whose /v1/stats answers what the test sets: `answer["status"]` and the JSON
    `answer["body"]` (a refused key, a malformed snapshot)."""
    answer = {"status": 200, "body": {}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answer["body"]).encode()
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with loopback_server(Handler) as base:
        yield base, answer


def session_variant(tmp_path: Path, name: str, change) -> Path:
    """The recorded session with `change(snapshot)` applied to every frame, as a new session file."""
    lines = SESSION.read_text().splitlines()
    frames = [json.loads(line) for line in lines[1:]]
    for frame in frames:
        change(frame["snapshot"])
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join([lines[0], *map(json.dumps, frames)]) + "\n")
    return path
