"""Output files of every command (`run -o`, `profile -o`, `profile --trace`, `trace analyze -o`): checked
before any work, written whole through symlinks, never onto directories or devices, nothing left behind."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from looptrace.cli.main import app
from looptrace.cli.options import OutputFormat
from looptrace.cli.output import OutputError, atomic_path, atomic_write_text, check_output, infer_format

runner = CliRunner()


class WorkStarted(Exception):
    """Raised by the first step of a command's real work: the output check must come before it."""


def _boom(*_args, **_kwargs):
    raise WorkStarted


@pytest.fixture
def no_work(monkeypatch):
    """Every command fails loudly (exit 1, WorkStarted) if it gets past its argument checks."""
    monkeypatch.setattr("looptrace.drive.run_request.make_workload", _boom)
    monkeypatch.setattr("looptrace.probes.profile_run.build", _boom)
    monkeypatch.setattr("looptrace.probes.events.load_chrome_trace", _boom)  # read as events.X


def command(writer: str, target: Path, trace_in: Path) -> list[str]:
    return {
        "run -o": ["run", "--no-progress", "-o", str(target)],
        "profile -o": ["profile", "-o", str(target)],
        "profile --trace": ["profile", "--trace", str(target)],
        "trace analyze -o": ["trace", "analyze", str(trace_in), "-o", str(target)],
    }[writer]


WRITERS = ("run -o", "profile -o", "profile --trace", "trace analyze -o")


def snapshot(root: Path) -> dict[str, object]:
    """Every path under root: kind and content (files), link target (symlinks)."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_file():
                out[str(p)] = ("file", p.read_bytes())
            else:
                out[str(p)] = ("dir" if p.is_dir() else "other", None)
    return out


def assert_one_line_exit_2(result, *needles: str) -> str:
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- the property: bad targets fail before the work, and leave the file system as it was ----------------
def char_device(root: Path) -> tuple[Path, str]:
    """A private twin of /dev/null (char 1:3), so that a regression can never replace the real one. Without
    the right to mknod (not root), a fifo stands in: also not a regular file."""
    node = root / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        os.mkfifo(node)
        return node, "fifo"
    return node, "character device"


def make_bad_target(kind: str, root: Path) -> tuple[Path, str]:
    """A path of the given kind under root (plus what the error line must say)."""
    if kind == "empty dir":
        (root / "d").mkdir()
        return root / "d", "is a directory"
    if kind == "non-empty dir":
        (root / "d").mkdir()
        (root / "d" / "keep.txt").write_text("keep")
        return root / "d", "is a directory"
    if kind == "cwd":
        return Path(str(root) + "/."), "is a directory"
    if kind == "char device":
        return char_device(root)
    if kind == "fifo":
        os.mkfifo(root / "fifo")
        return root / "fifo", "fifo"
    if kind == "missing dir":
        return root / "nope" / "x.json", "does not exist"
    if kind == "file as dir":
        (root / "f").write_text("x")
        return root / "f" / "x.json", "not a directory"
    if kind == "/proc":
        return Path("/proc/looptrace_x.json"), "cannot create files in /proc"
    if kind == "read-only file":
        if os.geteuid() == 0:  # root writes 0444 files (so does its shell): use a file it cannot replace
            return Path("/proc/version"), "cannot create files in /proc"
        (root / "ro.json").write_text("old")
        os.chmod(root / "ro.json", 0o444)
        return root / "ro.json", "not writable"
    raise AssertionError(kind)


BAD_KINDS = (
    "empty dir",
    "non-empty dir",
    "cwd",
    "char device",
    "fifo",
    "missing dir",
    "file as dir",
    "/proc",
    "read-only file",
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    writer=st.sampled_from(WRITERS),
    kind=st.sampled_from(BAD_KINDS),
    via_symlink=st.booleans(),
)
def test_bad_output_targets_fail_before_work(no_work, writer: str, kind: str, via_symlink: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trace_in = root / "in.json"
        trace_in.write_text("{}")
        target, why = make_bad_target(kind, root)
        if via_symlink:  # a link to a bad target is as bad as the target: it is written through
            (root / "link").symlink_to(target)
            target = root / "link"
        before = snapshot(root)
        result = runner.invoke(app, command(writer, target, trace_in))
        option = writer.split()[-1].replace("-o", "--output")
        assert_one_line_exit_2(result, option, why)
        assert snapshot(root) == before  # nothing created, replaced or left behind
        if kind == "char device":
            mode = os.stat(root / "null").st_mode
            assert stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)  # still the node, not a file


# --- symlinks are written through, like shell redirection ------------------------------------------------
@pytest.mark.parametrize("dangling", [False, True])
def test_atomic_write_through_symlink(tmp_path, dangling) -> None:
    real = tmp_path / "real.json"
    if not dangling:
        real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    check_output(link)
    atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


def test_replaced_file_keeps_its_mode_and_new_file_gets_umask(tmp_path) -> None:
    old = tmp_path / "old.txt"
    old.write_text("x")
    os.chmod(old, 0o640)
    atomic_write_text(old, "y")
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o640 and old.read_text() == "y"
    mask = os.umask(0o022)
    os.umask(mask)
    new = tmp_path / "new.txt"
    atomic_write_text(new, "z")
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o666 & ~mask  # not mkstemp's 0600


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_failure_or_ctrl_c_leaves_old_file_and_no_temp(tmp_path, exc) -> None:
    target = tmp_path / "t.json.gz"
    target.write_text("old")
    with pytest.raises(exc), atomic_path(target) as tmp:
        # in a private hidden directory beside the target (a writer's side files go with it), same name
        assert tmp.parent.parent == tmp_path and tmp.parent.name.startswith(".looptrace-")
        assert tmp.name == "t.json.gz"
        tmp.write_text("half")
        raise exc
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json.gz"]


def test_write_error_is_one_line_output_error(tmp_path, monkeypatch) -> None:
    def full(self, *_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputError, match="No space left on device"):
        atomic_write_text(tmp_path / "x.json", "data")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_same_file_for_output_and_trace_is_refused(no_work, tmp_path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "same.json")
    result = runner.invoke(
        app, ["profile", "-o", str(tmp_path / "same.json"), "--trace", str(tmp_path / "link")]
    )
    assert_one_line_exit_2(result, "--output and --trace name the same file")


def test_trace_analyze_writes_through_symlink(decode_trace, tmp_path) -> None:
    real, link = tmp_path / "report.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    result = runner.invoke(app, ["trace", "analyze", str(decode_trace), "-o", str(link)])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and json.loads(real.read_text())["schema"] == "looptrace.profile/1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "report.json"]


# --- format from the suffix -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt, name, expected",
    [
        (None, "x.json", OutputFormat.json),
        (None, "X.JSON", OutputFormat.json),
        (None, "x.csv", OutputFormat.csv),
        (None, "x.txt", OutputFormat.table),
        (None, None, OutputFormat.table),
        (OutputFormat.table, "x.json", OutputFormat.table),  # an explicit --format wins
    ],
)
def test_infer_format(fmt, name, expected) -> None:
    assert infer_format(fmt, Path(name) if name else None) is expected


@pytest.mark.parametrize(
    "suffix, first", [(".json", "{"), (".csv", "section,key,metric,value"), (".txt", "")]
)
def test_trace_analyze_format_from_suffix(decode_trace, tmp_path, suffix, first) -> None:
    target = tmp_path / f"report{suffix}"
    result = runner.invoke(app, ["trace", "analyze", str(decode_trace), "-o", str(target)])
    assert result.exit_code == 0, result.output
    text = target.read_text()
    if suffix == ".json":
        assert json.loads(text)["schema"] == "looptrace.profile/1"
    elif suffix == ".csv":
        assert text.splitlines()[0] == first
    else:
        assert "Per-token counters" in text


@pytest.fixture
def decode_trace(tmp_path_factory) -> Path:
    from tests.probes.conftest import KinetoTrace

    kt = KinetoTrace()
    with kt.range("lt.window/decode"):
        for step in range(2):
            with kt.range(f"lt.step#{step}"):
                kt.cpu_op("aten::mm", kt.tick(), 1.0)
    return kt.write(tmp_path_factory.mktemp("trace") / "decode.json")
