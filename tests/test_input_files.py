"""looptrace.input_files: regular files only, UTF-8 with a BOM or CRLF accepted, JSON/YAML within the nesting,
digit, surrogate and duplicate-key limits; every problem one line naming the file."""

from __future__ import annotations

import gzip
import os
import threading

import pytest

from looptrace import input_files as inp
from looptrace.input_files import InputError


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(InputError) as err:
        call(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture
def fifo(tmp_path):
    """A fifo; should a reader block on it anyway, a writer opens it after 20 s: the test fails, not hangs."""
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    release = threading.Timer(20, lambda: os.close(os.open(path, os.O_WRONLY)))
    release.daemon = True
    release.start()
    yield path
    release.cancel()


def test_non_regular_files_are_refused_before_reading(fifo, tmp_path) -> None:
    assert (
        one_line_error(inp.read_bytes, fifo, "--prompts")
        == f"--prompts {fifo}: is a fifo, not a regular file (inputs are read whole)"
    )
    assert "is a character device" in one_line_error(inp.read_json, "/dev/zero")
    assert "is a directory" in one_line_error(inp.read_text, tmp_path)
    assert one_line_error(inp.read_text, tmp_path / "none") == f"{tmp_path / 'none'}: no such file"


def test_bom_and_crlf_are_ordinary_text(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n\r\n{"a": "x\\r"}\r\n')
    assert list(inp.iter_jsonl(path)) == [(1, {"a": 1}), (3, {"a": "x\r"})]
    path.write_bytes(b"\xef\xbb\xbfname: x\r\nkv: {}\r\n")
    assert inp.load_yaml(inp.read_text(path), str(path)) == {"name": "x", "kv": {}}


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("[" * 65 + "]" * 65, "nested more than 64 levels deep"),
        ('{"n": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),
        ('{"s": "\\ud800"}', "lone surrogate \\ud800"),
        ('{"s": [1, 2}', "invalid JSON (Expecting ',' delimiter at column 12)"),
    ],
)
def test_json_limits(tmp_path, text, needle) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    message = one_line_error(inp.read_json, path, "--from")
    assert message.startswith(f"--from {path}: ") and needle in message, message


def test_json_within_limits_and_surrogate_pairs(tmp_path) -> None:
    assert (
        inp.parse_json('{"s": "\\ud83d\\ude00", "d": ' + "[" * 63 + "]" * 63 + "}", "x")["s"] == "\U0001f600"
    )
    assert inp.parse_json(b"[1]", "x", check=False) == [1]
    assert "lone surrogate" in one_line_error(inp.parse_json, b'["\\udc00"]', "t", check=False)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a: 1\nb: 2\na: 3\n", "line 3: invalid YAML (duplicate key 'a')"),
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
        ("a: " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
        ('a: "\\ud800"\n', "lone surrogate"),
        ("a: [1\n", "invalid YAML"),
    ],
)
def test_yaml_limits(text, needle) -> None:
    message = one_line_error(inp.load_yaml, text, "r.yaml")
    assert message.startswith("r.yaml:") and needle in message, message


def test_yaml_aliases_are_walked_once() -> None:
    """A billion-laughs document is a few shared lists: the walk must not expand it."""
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    laughs += "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}" + f", *{chr(97 + i)}" * 9 + "]\n" for i in range(9)
    )
    assert len(inp.load_yaml(laughs, "r.yaml")) == 10


def test_binary_and_bad_gzip(tmp_path) -> None:
    binary = tmp_path / "r.yaml"
    binary.write_bytes(b"\x00\xff\xfe binary")
    assert "not UTF-8 text (byte 0xff at offset 1)" in one_line_error(inp.read_text, binary)
    bad = tmp_path / "t.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": []}')[:-6])  # truncated
    assert "cannot read it" in one_line_error(inp.read_json, bad)
    corrupt = tmp_path / "c.json.gz"
    data = bytearray(gzip.compress(b'{"traceEvents": []}' * 50))
    data[20:30] = b"\xff" * 10
    corrupt.write_bytes(bytes(data))
    assert "cannot read it" in one_line_error(inp.read_json, corrupt)


def test_size_limit(tmp_path) -> None:
    path = tmp_path / "big.json"
    path.write_text("[" + "1," * 100 + "1]")
    assert "limit" in one_line_error(inp.read_json, path, limit=50)
    packed = tmp_path / "big.json.gz"
    packed.write_bytes(gzip.compress(b"[" + b"0," * 10_000 + b"0]"))
    assert "limit (decompressed)" in one_line_error(inp.read_json, packed, limit=1000)


def test_recipe_file_and_package_data_dirs(tmp_path) -> None:
    assert inp.recipe_file("base") == inp.recipe_dir() / "base.yaml"
    assert inp.recipe_file("my.yaml") == inp.Path("my.yaml")
    assert inp.recipe_dir() in inp.package_data_dirs()
    assert inp.PACKAGE_DIR / "assets" in inp.package_data_dirs()
