"""Every file a command writes (`--output`, `--trace`, `--plot`) goes through this module.

Rules (the same for every command: `run`, `profile --trace`, `trace analyze`, `bench --plot`, ...):

- checked before any work: a directory, a device, a fifo or a socket is refused, and so is a path whose
  directory is missing or does not accept new files (probed by creating and removing a temp file);
- written whole: into a hidden temp directory in the target's directory, then `os.replace` onto the target,
  so a reader never sees half a file and a failure, a full disk or Ctrl-C leaves the old file (or none)
  and no temp file; a directory output (`train-tiny --out`) is filled beside the target and swapped in;
- a symlink is written *through* to its target, like shell redirection: the link itself stays;
- a replaced file keeps its permission bits (and owner, when running as root); a new one gets the umask;
- never inside looptrace's own data (the recipes, the packaged tiny checkpoints and evaluation sets),
  which commands read without being told: `profile -o recipes/base.yaml` would break every later run;
- never one of the command's inputs: `check_output(path, inputs=[...])` refuses an output that is the same
  file as an input through any path, symlink or hard link (`trace analyze t.json -o t.json` would have
  replaced the trace with its analysis).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Union

from looptrace.input_files import package_data_dirs

_KINDS = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
)


class OutputError(ValueError):
    """An output path that cannot be written (the commands' exit code 2)."""


# An input of the command: a path, or (path, what it is, e.g. "--from"); None entries are skipped.
Input = Union[Path, str, tuple[Union[Path, str, None], str], None]


def same_file(a: Path | str, b: Path | str) -> bool:
    """`a` and `b` name one file (any path, symlink or hard link); for a missing file, the same target."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_not_input(path: Path, option: str, inputs: Iterable[Input]) -> None:
    """OutputError when `path` is one of `inputs`: writing it would destroy what the command reads."""
    for item in inputs:
        src, what = item if isinstance(item, tuple) else (item, "input")
        if src is not None and same_file(path, src):
            raise OutputError(
                f"{option} {path}: is the {what} file {src}; writing it would replace the input "
                "(choose another output path)"
            )


def _shown(path: Path, target: Path) -> str:
    return str(path) if target == Path(os.path.abspath(path)) else f"{path} (-> {target})"


def _check_given_parent(path: Path | str, option: str) -> None:
    """The path as given must name a file in a directory: realpath would turn `file/`, `file/.` and
    `file/../x` into `file` or a sibling, which the shell (and open) refuse with ENOTDIR."""
    text = os.fspath(path)
    if text.endswith(("/", "/.", "/..")) or text in (".", ".."):
        raise OutputError(f"{option} {path}: is a directory; expected a file path")
    parent = os.path.dirname(text) or "."
    try:
        is_dir = stat.S_ISDIR(os.stat(parent).st_mode)
    except FileNotFoundError:
        return  # the resolved checks below name the missing directory
    except OSError as exc:
        raise OutputError(f"{option} {path}: {parent} is not a directory ({exc.strerror})") from None
    if not is_dir:
        raise OutputError(f"{option} {path}: {parent} is not a directory")


def _check_target(path: Path, option: str) -> Path:
    """Refuse what can never be replaced by a regular file; return the resolved target."""
    _check_given_parent(path, option)
    target = Path(os.path.realpath(path))  # symlinks followed (a dangling one: the file it names)
    where = f"{option} {_shown(path, target)}"
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # the parent checks below say which
        st = None
    except OSError as exc:
        raise OutputError(f"{where}: cannot access it ({exc.strerror})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{where}: is a directory; expected a file path")
        for test, kind in _KINDS:
            if test(st.st_mode):
                raise OutputError(
                    f"{where}: is a {kind}, not a regular file; output files are written whole and "
                    "atomically, so devices and pipes are refused (print to stdout and redirect instead)"
                )
        if not os.access(target, os.W_OK):
            raise OutputError(f"{where}: file is not writable")
    _check_not_package_data(target, where)
    parent = target.parent
    if not parent.exists():
        raise OutputError(f"{where}: directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{where}: {parent} is not a directory")
    return target


def _check_not_package_data(target: Path, where: str) -> None:
    for data_dir in package_data_dirs():
        if target.is_relative_to(data_dir.resolve()):
            raise OutputError(
                f"{where}: is inside looptrace's own data ({data_dir}), which commands read as their "
                "defaults; choose a path outside it"
            )


def _mkstemp(target: Path, where: str) -> Path:
    # The target's name is the suffix, so `.json.gz` still selects gzip for writers that look at it.
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".looptrace-", suffix=f".{target.name}")
    except OSError as exc:
        raise OutputError(f"{where}: cannot create files in {target.parent} ({exc.strerror})") from None
    os.close(fd)
    return Path(tmp)


def check_output(path: Path | None, option: str = "--output", inputs: Iterable[Input] = ()) -> Path | None:
    """Fail (OutputError, exit 2) before any work when `path` could not be written or is one of the
    command's `inputs`; None passes."""
    if path is None:
        return None
    target = _check_target(path, option)
    check_not_input(path, option, inputs)
    _mkstemp(target, f"{option} {_shown(path, target)}").unlink()
    return target


def check_outputs(*items: tuple[Path | None, str], inputs: Iterable[Input] = ()) -> None:
    """`check_output` for each (path, option), and no two options naming the same file."""
    inputs = list(inputs)
    seen: dict[Path, str] = {}
    for path, option in items:
        target = check_output(path, option, inputs)
        if target is None:
            continue
        if target in seen:
            raise OutputError(f"{seen[target]} and {option} name the same file {path}")
        seen[target] = option


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _adopt_metadata(tmp: Path, target: Path) -> None:
    """Give the temp file the mode (and, as root, the owner) that the written file should end up with."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        os.chmod(tmp, 0o666 & ~_umask())
        return
    os.chmod(tmp, stat.S_IMODE(st.st_mode))
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):  # e.g. a filesystem without ownership: the content matters more
            os.chown(tmp, st.st_uid, st.st_gid)


# A write that fails for lack of room (or a read-only or broken disk) is the output's fault, not a bug.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def _disk_error(exc: BaseException, where: str) -> OutputError | None:
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return OutputError(f"{where}: cannot write ({exc.strerror}); nothing was written")
    if isinstance(exc, Exception) and "No space left on device" in str(exc):  # e.g. safetensors' own error
        return OutputError(f"{where}: cannot write (No space left on device); nothing was written")
    return None


@contextmanager
def atomic_path(path: Path, option: str = "--output") -> Iterator[Path]:
    """Yield a temp path next to `path`'s (resolved) target; on success it replaces the target, on any
    exception (Ctrl-C included) it is removed. The temp path lies in a private hidden directory, so that
    files a writer stages beside it (torch's profiler writes `<path>.tmp` first) go with it; a full disk
    is an OutputError naming the option."""
    target = _check_target(path, option)  # again: the path may have changed during the work
    where = f"{option} {_shown(path, target)}"
    staging = _mkdtemp(target.parent, where)
    tmp = staging / target.name  # the target's name: `.json.gz` still selects gzip for writers that look
    try:
        tmp.touch()
        yield tmp
        _adopt_metadata(tmp, target)
        os.replace(tmp, target)
    except BaseException as exc:
        if (error := _disk_error(exc, where)) is not None:
            raise error from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _mkdtemp(parent: Path, where: str) -> Path:
    try:
        return Path(tempfile.mkdtemp(dir=parent, prefix=".looptrace-"))
    except OSError as exc:
        raise OutputError(f"{where}: cannot create files in {parent} ({exc.strerror})") from None


def atomic_write_text(path: Path, text: str, option: str = "--output") -> None:
    """Write `text` (UTF-8) to `path` by the rules in the module docstring."""
    with atomic_path(path, option) as tmp:
        try:
            tmp.write_text(text, encoding="utf-8")
        except OSError as exc:  # e.g. disk full: one line, and the temp file goes
            raise OutputError(f"{option} {path}: cannot write ({exc.strerror})") from None


@contextmanager
def output_dir(target: Path, option: str, marker: str, writer: str) -> Iterator[Path]:
    """A directory the command fills, checked before the work: new, empty, or holding `marker` (an
    earlier `writer` wrote it; it is replaced). The command fills the yielded staging directory (hidden,
    beside the target), which replaces the target only on success; on any exception, Ctrl-C and a full
    disk included, it goes, and so do the parent directories created here: the target is as before."""
    if target.exists() and not target.is_dir():
        raise OutputError(f"{option} {target}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not (target / marker).is_file():
        raise OutputError(
            f"{option} {target}: directory holds other files (no {marker} of an earlier {writer}); "
            "choose a new or empty directory"
        )
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    staging = None
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".looptrace-{target.name}-"))
        except OSError as exc:
            raise OutputError(f"{option} {target}: cannot write there ({exc.strerror or exc})") from None
        yield staging
        if not (staging / marker).is_file():  # the writer's last file: without it the directory is partial
            raise OutputError(
                f"{option} {target}: the {writer} wrote no {marker}; the directory is left as it was"
            )
        _swap_in(staging, target)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for path in created:  # innermost first
            with contextlib.suppress(OSError):
                path.rmdir()
        if (error := _disk_error(exc, f"{option} {target}")) is not None:
            raise error from None
        raise


def _swap_in(staging: Path, target: Path) -> None:
    """Put the filled staging directory where `target` is (a new name, or an earlier run's directory)."""
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp made it private; a directory gets the umask
    if not target.exists():
        os.rename(staging, target)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".looptrace-{target.name}-old-"))
    os.rename(target, old / "dir")
    os.rename(staging, target)
    shutil.rmtree(old, ignore_errors=True)
