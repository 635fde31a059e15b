"""The README's example commands run from a clean clone: every file a `looptrace` example reads ships with
the repository or is written by an earlier command of the same example, and every option it names exists.

A code block that shows what a command printed on data that is not shipped (other tools' traces) is
preceded by the line `<!-- recorded on data not shipped -->` and is left out; placeholders in capitals
(`TRACE.json`, `FILE`) are not files.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.main import get_command

from looptrace.cli.main import app

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
NOT_SHIPPED = "<!-- recorded on data not shipped -->"
# options whose value is a file the command writes, not one it reads
WRITES = {"-o", "--output", "--trace", "--record", "--out", "--plot", "--screenshot"}


def example_blocks() -> list[tuple[int, list[str]]]:
    """(first line number, command lines) of each fenced block, a `\\` continuation joined."""
    blocks, lines = [], README.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        skip = i > 0 and lines[i - 1].strip() == NOT_SHIPPED
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if not skip:
            blocks.append((start + 1, _commands(body)))
    return [(n, cmds) for n, cmds in blocks if cmds]


def _commands(body: list[str]) -> list[str]:
    commands, current = [], ""
    for line in body:
        text = current + line.strip()
        if text.endswith("\\"):
            current = text[:-1] + " "
            continue
        current = ""
        text = text.removeprefix("$ ")
        if re.match(r"(pip install .* && )?looptrace |head -\d+ \S+ > \S+$", text):
            commands.append(text.split("&& ")[-1] if text.startswith("pip") else text)
    return commands


def _argv(command: str) -> list[str]:
    return shlex.split(command.split("  #")[0], comments=True)


def _subcommand(argv: list[str]):
    """The (sub)command `argv` runs and its remaining words."""
    command, rest = get_command(app), argv[1:]
    while hasattr(command, "commands") and rest and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    return command, rest


def _is_placeholder(word: str) -> bool:
    return bool(re.search(r"[A-Z]{2,}", Path(word).name)) or "[" in word or "<" in word or "|" in word


def _is_path(word: str) -> bool:
    if word.startswith("-") or "://" in word or "@" in word:  # an option, a URL, a bench cell
        return False
    return bool("/" in word or re.search(r"\.(json|jsonl|gz|yaml|csv|svg)$", word))


BLOCKS = example_blocks()


def test_the_readme_has_examples() -> None:
    assert sum(len(cmds) for _, cmds in BLOCKS) >= 30


@pytest.mark.parametrize("line, commands", BLOCKS, ids=[f"line {n}" for n, _ in BLOCKS])
def test_example_reads_only_what_a_clean_clone_has(line: int, commands: list[str]) -> None:
    written: set[str] = set()
    for command in commands:
        argv = _argv(command)
        if argv[0] == "head":  # `head -3 SRC > DST`: a file made from a shipped one
            words = command.split(">")
            assert (REPO / _argv(words[0])[-1]).is_file(), command
            written.add(words[1].strip())
            continue
        cmd, rest = _subcommand(argv)
        names = {name for p in cmd.params for name in (*p.opts, *p.secondary_opts)}
        outputs = {rest[i + 1] for i, word in enumerate(rest[:-1]) if word in WRITES}
        for word in rest:
            option = word.split("=")[0]
            if option.startswith("-") and not option.lstrip("-").isdigit():
                assert option in names or "[" in command, f"line {line}: {command}: no option {option}"
            if _is_path(word) and word not in outputs and not _is_placeholder(word):
                inside = not word.startswith("../") and (REPO / word).exists()  # a clean clone has no ../
                assert word in written or inside, f"line {line}: {command}: {word} missing"
        written |= outputs
