"""Every file a command reads (prompts, eval sets, recipes, saved reports, traces) is opened and parsed here.

Rules (the twin of looptrace.output_files, the same for every command):

- only a regular file is read: a fifo would block the command forever, a device (`/dev/zero`) would be
  read without end, a directory cannot be; each is refused before the first byte is read, by name;
- text is UTF-8; a leading byte-order mark is dropped and CRLF line ends are read as LF (files saved on
  Windows are ordinary input); other bytes are one error naming the offset;
- JSON and YAML are parsed with limits the rest of the code can rely on: nesting at most MAX_NESTING
  deep (deeper input overflows Python's recursion), no integer of more than Python's 4,300 digits, no
  lone surrogate in a string (it cannot be written out as UTF-8 again), no duplicate YAML keys (the
  later one would silently win);
- every problem is an `InputError`: one line naming the file (and line), the commands' exit code 2.

This module imports nothing from looptrace: every floor may use it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import zlib
from pathlib import Path
from typing import Any

import yaml

MAX_NESTING = 64  # JSON/YAML containers inside containers; recipes and reports need 4, traces about 3
MAX_TEXT_BYTES = 1 << 30  # prompts, eval sets, reports: read whole into memory
MAX_RECIPE_BYTES = 1 << 20

_KINDS = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
)
# A \uD800-\uDFFF escape: only then can json.loads produce a lone surrogate (raw ones are not UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")  # the same on text: no encoded copy of a trace


PACKAGE_DIR = Path(__file__).resolve().parent


def recipe_dir() -> Path:
    """Where `--recipe NAME` looks: a source checkout reads the top-level `recipes/`; an installed wheel
    carries them as the data package `looptrace/recipe_files/` (mapped from `recipes/` by setup.py)."""
    root = PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file() and (root / "recipes").is_dir():
        return root / "recipes"
    return PACKAGE_DIR / "recipe_files"


def recipe_file(name_or_path: str) -> Path:
    """The file `--recipe NAME_OR_PATH` reads: a shipped recipe's bare name is that recipe
    (recipes/NAME.yaml), even where the working directory holds a folder or file of that name (a `fast/`
    of results must not shadow `fast`); else a .yaml/.yml or existing path as given; else
    recipes/NAME.yaml (whether it exists or not: looptrace.recipes names the problem)."""
    path = Path(name_or_path)
    shipped = recipe_dir() / f"{name_or_path}.yaml"
    if path.name == name_or_path and not path.suffix and shipped.is_file():
        return shipped
    if path.suffix in (".yaml", ".yml") or os.path.lexists(path):
        return path
    return shipped


def package_data_dirs() -> tuple[Path, ...]:
    """The directories of inputs that come with looptrace: the recipes and the packaged tiny checkpoints
    and evaluation sets (looptrace/assets). Commands read them without being told, so no output may
    land there (looptrace.output_files)."""
    return (recipe_dir(), PACKAGE_DIR / "recipe_files", PACKAGE_DIR / "assets")


class InputError(ValueError):
    """An input file that cannot be used (the commands' exit code 2); the message is one line."""


def check_regular_file(path: Path | str, what: str = "") -> os.stat_result:
    """The file's stat when `path` is a regular file (a symlink to one counts); InputError otherwise.
    `what` prefixes the message, e.g. "--prompts"."""
    where = f"{what} {path}".strip()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{where}: is a directory; expected a file")
    for test, kind in _KINDS:
        if test(st.st_mode):
            raise InputError(f"{where}: is a {kind}, not a regular file (inputs are read whole)")
    return st


def read_bytes(path: Path | str, what: str = "", limit: int = MAX_TEXT_BYTES) -> bytes:
    """A regular file's bytes, gunzipped when its name ends in .gz; at most `limit` bytes (decompressed)."""
    where = f"{what} {path}".strip()
    st = check_regular_file(path, what)
    gzipped = os.fspath(path).endswith(".gz")
    if not gzipped and st.st_size > limit:
        raise InputError(f"{where}: {st.st_size} bytes is more than the {limit}-byte limit")
    try:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if gzipped else raw
            data = stream.read(limit + 1)
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, a bad or truncated gzip
        detail = " ".join(str(getattr(exc, "strerror", None) or exc).split())
        raise InputError(f"{where}: cannot read it ({detail})") from None
    if len(data) > limit:
        raise InputError(f"{where}: more than the {limit}-byte limit (decompressed)")
    return data


def decode_text(data: bytes, where: str) -> str:
    """UTF-8 text without a byte-order mark, CRLF (and lone CR) line ends read as LF."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def read_text(path: Path | str, what: str = "", limit: int = MAX_TEXT_BYTES) -> str:
    """A regular UTF-8 text file (see `decode_text`), at most `limit` bytes."""
    return decode_text(read_bytes(path, what, limit), f"{what} {path}".strip())


def check_tree(value: Any, where: str) -> None:
    """InputError when `value` (parsed JSON/YAML) nests deeper than MAX_NESTING or holds a string with a
    lone surrogate. Iterative, and each container is visited once (YAML aliases share them)."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_string(node, where)
            continue
        if not isinstance(node, (dict, list)) or id(node) in seen:
            continue
        seen.add(id(node))
        if depth >= MAX_NESTING:
            raise InputError(f"{where}: nested more than {MAX_NESTING} levels deep")
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)


def _check_string(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InputError(
            f"{where}: a string holds a lone surrogate \\u{code:04x} (not valid Unicode)"
        ) from None


def parse_json(data: str | bytes, where: str, *, check: bool = True) -> Any:
    """Parsed JSON within the limits of the module docstring. `check=False` (large traces) skips the
    full walk: nesting past Python's recursion limit is still an error, and the string check runs only
    when the text holds a surrogate escape."""
    try:
        value = json.loads(data)
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno}, column {exc.colno}" if exc.lineno > 1 else f"column {exc.colno}"
        raise InputError(f"{where}: invalid JSON ({exc.msg} at {at})") from None
    except RecursionError:
        raise InputError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of more than 4,300 digits, raw lone surrogates in bytes
        raise InputError(f"{where}: invalid JSON ({_first_sentence(exc)})") from None
    if check:
        check_tree(value, where)
    elif (_SURROGATE_ESCAPE_TEXT if isinstance(data, str) else _SURROGATE_ESCAPE).search(data):
        _check_strings_only(value, where)
    return value


def _check_strings_only(value: Any, where: str) -> None:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            _check_string(node, where)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _first_sentence(exc: Exception) -> str:
    return " ".join(str(exc).split(";")[0].split())


def read_json(path: Path | str, what: str = "", limit: int = MAX_TEXT_BYTES) -> Any:
    """A JSON file (gzipped when named .gz) within the limits of the module docstring."""
    where = f"{what} {path}".strip()
    return parse_json(decode_text(read_bytes(path, what, limit), where), where)


def iter_jsonl(path: Path | str, what: str = "", limit: int = MAX_TEXT_BYTES):
    """(line number, parsed value) of each non-blank line of a JSONL file (a byte-order mark and CRLF
    line ends accepted); errors name FILE:LINE."""
    where = f"{what} {path}".strip()
    data = read_bytes(path, what, limit).removeprefix(b"\xef\xbb\xbf")
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{where}:{lineno}: not valid UTF-8") from None
        yield lineno, parse_json(line, f"{where}:{lineno}")


def load_yaml(text: str, where: str) -> Any:
    """Parsed YAML (safe subset) within the limits of the module docstring; duplicate keys refused."""
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f" line {mark.line + 1}:" if mark else ""
        raise InputError(f"{where}:{line} invalid YAML ({exc.problem or exc.context})") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{where}: invalid YAML ({_first_sentence(exc)})") from None
    except RecursionError:
        raise InputError(f"{where}: invalid YAML (nested too deeply)") from None
    except (ValueError, OverflowError) as exc:  # an integer of more than 4,300 digits, a huge float
        raise InputError(f"{where}: invalid YAML ({_first_sentence(exc)})") from None
    check_tree(value, where)
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: list = []
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep)
