"""`looptrace serve` bad input: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import signal
import socket

import httpx
import pytest
from typer.testing import CliRunner

from looptrace.cli.main import app
from tests.serve.conftest import Proc

runner = CliRunner()


def _run(args):
    result = runner.invoke(app, args)
    return result.exit_code, result.output


def test_port_in_use_is_exit_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out = _run(["serve", "--model", "ouro", "--device", "cpu", "--port", str(port)])
    assert code == 2
    assert "address already in use" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_unknown_recipe_is_exit_2():
    code, out = _run(
        ["serve", "--model", "ouro", "--device", "cpu", "--port", "0", "--recipe", "no-such-recipe"]
    )
    assert code == 2 and "no-such-recipe" in out and "Traceback" not in out


def test_bad_port_is_exit_2():
    code, out = _run(["serve", "--port", "70000"])
    assert code == 2 and "--port" in out


def _serve(*args: str):
    return _run(["serve", "--model", "ouro", "--device", "cpu", "--port", "0", *args])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-model-len", "200000"], "--max-model-len 200000: ouro-tiny has 4096 positions at most"),
        (["--api-key", "s3cret\n"], "--api-key"),
        (["--api-key", "clé"], "--api-key"),
        (["--served-model-name", ""], "--served-model-name"),
        (["--served-model-name", "  "], "--served-model-name"),
        (["--threads", "100000"], "--threads"),  # bounded by the shared option (torch crashed)
        (["--threads", "0"], "--threads"),
        (["--body-timeout", "0"], "--body-timeout"),
        (["--tui"], "--tui needs a terminal"),  # CliRunner's stdout is not a TTY
    ],
    ids=["max-model-len", "key-newline", "key-non-ascii", "name-empty", "name-blank", "threads-huge",
         "threads-0", "body-timeout-0", "tui-no-tty"],
)  # fmt: skip
def test_bad_serve_options_are_one_line_exit_2(args, needle):
    """Each used to be accepted (clamped, unusable, SIGSEGV, escape codes into a pipe)."""
    code, out = _serve(*args)
    assert code == 2 and needle in out and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_help_lists_every_endpoint():
    code, out = _run(["serve", "--help"])
    assert code == 0
    for endpoint in ("/tokenize", "/detokenize", "/version", "/v1/models/{id}", "/health", "/metrics"):
        assert endpoint in out, endpoint


@pytest.mark.parametrize("name", ["[/]", "[red]x[/]"])
def test_a_served_model_name_with_markup_is_shown_and_served_as_typed(name):
    """'[/]' crashed serve at start (MarkupError); '[red]x[/]' was shown as a red 'x'."""
    srv = Proc("--probe-interval", "0", "--served-model-name", name)
    try:
        assert f"model id '{name}'" in srv.stderr
        r = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == name
        srv.p.send_signal(signal.SIGTERM)
        assert srv.wait() == 0
    finally:
        srv.wait(1)
