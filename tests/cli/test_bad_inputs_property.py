"""The property behind tests/cli/test_bad_inputs.py: for every command and every option, argument and input
file, a generated bad value (Rich markup, a lone surrogate, control characters, huge, negative or NaN
numbers, a file nested 100,000 deep or holding a 5,000-digit number, a fifo, a device, a directory, a
path on a full disk, looptrace's own recipes and checkpoints) ends the command with exit code 0 or 2,
without a traceback or a boxed error, and leaves every input file as it was and no temp file behind.

In-process (CliRunner) and bounded: a fixed number of examples, each command's work made tiny (one
request of a few tokens, training and serving stubbed), so the whole test runs in well under a minute."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from looptrace.assets import ASSETS_DIR
from looptrace.cli.main import app
from looptrace.input_files import recipe_dir
from tests.cli.test_bad_inputs import COMMANDS, _hints, _kind

runner = CliRunner()
FAST = ["--max-tokens", "2", "-c", "1", "--prompt-len", "4", "--no-progress"]
TRACE = '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": TS, "dur": 1}]}'
DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "9" * 5000

# Each command with arguments that keep its work tiny; POS_<name> stands for a positional argument.
BASE = {
    "run": FAST,
    "profile": ["--prompt-len", "4", "--decode-steps", "2", "-c", "1"],
    "depth": ["--no-progress", "--limit", "1", "--accuracy-by-depth", "1"],
    "diff": ["POS_recipe_a", "--b-set", "scheduler.max_num_seqs=2", *FAST],
    "bench": ["--cell", "ouro-tiny:4/2@1", "--runs", "2", "--no-progress"],
    "train-tiny": ["--family", "ouro"],
    "serve": ["--port", "0"],
    "top": ["--once", "POS_url"],
    "trace analyze": ["POS_trace"],
    "trace compare": ["POS_a", "POS_b"],
}
FILES = {  # name: content (bytes); every one is an input some option reads, or tries to
    "deep.json": DEEP.encode(),
    "digits.json": ('{"traceEvents": [], "n": ' + DIGITS + "}").encode(),
    "nan_ts.json": TRACE.replace("TS", "NaN").encode(),
    "trace.json": TRACE.replace("TS", "0").encode(),
    "surrogate.jsonl": b'{"prompt": "1+1=", "answer": "\\ud800", "prompt_token_ids": [1]}\n',
    "bom_crlf.jsonl": b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\r\n',
    "digits.jsonl": ('{"prompt_token_ids": [1], "max_tokens": ' + DIGITS + "}\n").encode(),
    "deep.yaml": ("kv: " + "[" * 5000 + "]" * 5000 + "\n").encode(),
    "dup.yaml": b"scheduler:\n  max_num_seqs: 2\n  max_num_seqs: 4\n",
    "binary.yaml": b"\xff\xfe\x00\x01",
    "empty.json": b"",
}
PIECES = [
    "[/]",
    "[bold]",
    "[red]x[/]",
    "\ud800",
    "\udcff",
    "\u2028",
    "\x1b[31m",
    "\t",
    "名前",
    "",
    "=",
    ",",
    "@",
]
OUTPUTS = {"--output", "--trace", "--plot", "--record", "--screenshot", "--out"}  # written, not read
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e308", "-1e308", DIGITS, "99999999999999999999", "1e-320"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The files, a fifo, a full filesystem where one can be mounted, and the commands' stubs."""
    root = tmp_path_factory.mktemp("property")
    for name, data in FILES.items():
        (root / name).write_bytes(data)
    (root / "a-dir").mkdir()
    fifo = root / "pipe.json"
    os.mkfifo(fifo)
    paths = [str(root / n) for n in FILES] + [
        str(fifo),
        "/dev/zero",
        str(root / "a-dir"),
        str(root / "out.json/"),
    ]
    paths += [
        str(root / "[b]x.json"),
        str(recipe_dir() / "base.yaml"),
        str(ASSETS_DIR / "ouro-tiny" / "config.json"),
    ]
    full = root / "full"
    full.mkdir()
    mounted = not subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True
    ).returncode
    if mounted:
        fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
        os.close(fd)
        paths.append(str(full / "out.json"))
    release = threading.Timer(
        30, lambda: os.close(os.open(fifo, os.O_WRONLY))
    )  # a read of it fails, not hangs
    release.daemon = True
    release.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("looptrace.cli.train_cmd._train", _fake_train)
        mp.setattr("looptrace.cli.serve_cmd._serve_headless", lambda *args: None)
        mp.setattr("looptrace.cli.serve_cmd._serve_with_dashboard", lambda *args: None)
        mp.chdir(root)
        yield root, paths
    release.cancel()
    if mounted:
        subprocess.run(["umount", "-l", str(full)], check=False)


def _fake_train(family, target, steps, seed, threads):
    (target / "train_meta.json").write_text("{}")
    return {"wall_time_s": 0.0, "dense_exact_by_depth": {}}


def _targets() -> list[tuple[str, str, str, str]]:
    """(command, option or POS_argument, kind, Click's parameter name) for every value-taking parameter."""
    out = []
    for path, cmd in COMMANDS.items():
        hints = _hints(cmd)
        for p in cmd.params:
            if p.nargs != 1 or p.name not in hints or p.name in ("port", "family"):
                continue
            long = next((o for o in p.opts if o.startswith("--")), None)
            kind = _kind(hints[p.name], long) or "string"
            out.append((path, long or f"POS_{p.name}", kind, p.name))
    return out


TARGETS = _targets()
DEFAULTS = {"POS_recipe_a": "base", "POS_url": "http://127.0.0.1:9", "POS_trace": "trace.json"}
DEFAULTS |= {"POS_a": "trace.json", "POS_b": "trace.json"}


def _snapshot(paths: list[str]) -> dict[str, str]:
    """Hash of every regular input file (the package's recipes and checkpoint included)."""
    files = [Path(p) for p in paths] + sorted(recipe_dir().glob("*.yaml")) + sorted(ASSETS_DIR.glob("*/*"))
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def _temp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".looptrace-*")] + [str(p) for p in ASSETS_DIR.rglob(".looptrace-*")]


def test_targets_cover_every_command_and_input() -> None:
    assert {path for path, *_ in TARGETS} == set(BASE)
    kinds = {(path, option): kind for path, option, kind, _ in TARGETS}
    for option in (
        ("run", "--prompts"),
        ("run", "--recipe"),
        ("trace analyze", "POS_trace"),
        ("bench", "--from"),
    ):
        assert option in kinds, option
    assert kinds["depth", "--prompts"] == kinds["diff", "--accuracy"] == kinds["top", "--replay"] == "path"


# 100 examples take about 30 s on 2 cores; LOOPTRACE_PROPERTY_EXAMPLES=1000 searches longer.
@settings(
    max_examples=int(os.environ.get("LOOPTRACE_PROPERTY_EXAMPLES", 100)),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_bad_values_exit_0_or_2_cleanly_and_keep_every_input(world, data) -> None:
    root, paths = world
    path, option, kind, _ = data.draw(st.sampled_from(TARGETS), label="target")
    if kind == "path":
        value = data.draw(st.sampled_from(paths), label="path")
    elif kind == "number":
        value = data.draw(st.sampled_from(NUMBERS), label="number")
    else:
        value = data.draw(
            st.lists(st.sampled_from(PIECES + NUMBERS[:3]), min_size=1, max_size=3).map("".join)
        )
    args = [*path.split()]
    for arg in BASE[path]:
        args.append(value if arg == option else DEFAULTS.get(arg, arg))
    if not option.startswith("POS_"):
        args += [f"{option}={value}"]
    for name, content in FILES.items():  # as made: an earlier example may have written its output there
        (root / name).write_bytes(content)
    inputs = [str(root / "trace.json")] if path.startswith("trace") else []  # the trace commands' default
    inputs += [value] if kind == "path" and option not in OUTPUTS else []
    before = _snapshot(inputs)
    result = runner.invoke(app, args)
    report = (args[:8], result.exit_code, result.output[-2000:], repr(result.exception))
    assert result.exit_code in (0, 2), report
    assert result.exception is None or isinstance(result.exception, SystemExit), report
    assert "Traceback" not in result.output and "╭" not in result.stderr, report  # no traceback, no error box
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert lines and lines[-1].startswith("error: "), report
    assert _snapshot(inputs) == before, report
    assert _temp_files(root) == [], report
