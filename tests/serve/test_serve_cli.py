"""`looptrace serve` bad input: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import socket

from typer.testing import CliRunner

from looptrace.cli.main import app

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
