"""Typer option types every command shares (`model: ModelOpt = None`), so that one option reads and
behaves the same in every command."""

from __future__ import annotations

import enum
import ipaddress
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import typer


def opt(kind: Any, *names: str, **settings: Any) -> Any:
    """`Annotated[kind, typer.Option(*names, **settings)]`: an option type, on one line where it fits.
    A float option takes finite numbers only (`nan` and `inf` are refused as any bad value is)."""
    if _is_float(kind) and "parser" not in settings:
        settings["parser"] = finite_float
    return Annotated[kind, typer.Option(*names, **settings)]


def _is_float(kind: Any) -> bool:
    return kind is float or (
        typing.get_origin(kind) in (typing.Union, types.UnionType) and float in typing.get_args(kind)
    )


def finite_float(text: str) -> float:
    """A float option's value: Python's float syntax, finite (nan or inf would slip past every bound)."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


def output_path(text: str) -> Path:
    """A file to write, as typed: `out.json/` names a directory (pathlib would drop the slash and write
    `out.json`), and '' names nothing."""
    if not text:
        raise typer.BadParameter("expected a file path, got ''")
    if text.endswith(("/", "/.")):  # what pathlib drops; `.` and `x/..` survive for output_files to refuse
        raise typer.BadParameter(f"{text!r} is a directory path; expected a file path")
    return Path(text)


def non_empty(text: str) -> str:
    """A name that must name something: '' would silently mean the default, and a lone surrogate (bytes
    that were not UTF-8 on the command line) names nothing a model list or a resolver knows."""
    if not text.strip():
        raise typer.BadParameter(f"expected a name, got {text!r}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise typer.BadParameter(f"{ascii(text)} is not valid UTF-8 text") from None
    return text


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*")


def host_name(text: str) -> str:
    """An interface to bind: an IP address or an ASCII host name (`[/]` or a line separator would reach
    the resolver and fail there with a TypeError)."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(text):
        raise typer.BadParameter(f"{ascii(text)} is neither an IP address nor a host name")
    return text


# Threads: torch starts this many workers, and 100000 of them crash the process (SIGSEGV) instead of
# failing; more threads than cores never speeds a torch op up, so four times the cores is plenty.
MAX_THREADS = 4 * (os.cpu_count() or 1)


def arg(kind: Any, **settings: Any) -> Any:
    """`Annotated[kind, typer.Argument(**settings)]`."""
    return Annotated[kind, typer.Argument(**settings)]


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"
    csv = "csv"


ModelOpt = opt(
    str | None,
    "--model",
    "-m",
    parser=non_empty,
    help="Family (ouro, huginn, olmo: tiny preset on CPU, real shape on CUDA) or a preset name (ouro-1.4b, "
    "ouro-2.6b, huginn-0125, olmo-retrofit-1b, ouro-tiny, huginn-tiny, olmo-retrofit-tiny). Default: ouro; "
    "with --weights, the checkpoint's family (a contradicting --model is an error).",
)
RecipeOpt = opt(str, "--recipe", "-r", help="Recipe name in recipes/ or a YAML path.")
SetOpt = opt(
    list[str] | None,
    "--set",
    help="Override a recipe setting: section.key=value (repeatable).",
)
DeviceOpt = opt(str, help="auto (CUDA if present), cpu, cuda, cuda:N.")
DtypeOpt = opt(str, help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32.")
WeightsOpt = opt(
    Path | None,
    "--weights",
    help="Local Hugging Face checkpoint directory (config.json + *.safetensors).",
)
SeedOpt = opt(int, help="Seed for random weights, prompts and sampling.")
FormatOpt = opt(
    OutputFormat | None,
    "--format",
    "-f",
    help="Output format. Default: from the --output suffix (.json, .csv), else table.",
)
OutputOpt = opt(
    Path | None,
    "--output",
    "-o",
    parser=output_path,
    help="Also write the output to this file (whole, atomically; a symlink is written through; directories "
    "and devices are refused).",
)


def thread_count(text: str) -> int:
    """--threads: 1 to MAX_THREADS."""
    try:
        value = int(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_THREADS:
        raise typer.BadParameter(f"{value} is not from 1 to {MAX_THREADS} (4 x the CPU count)")
    return value


ThreadsOpt = opt(
    int,
    parser=thread_count,
    help="CPU threads for torch (1 is fastest for tiny models; at most 4 x the CPU count).",
)
RandomWeightsOpt = opt(
    bool,
    "--random-weights",
    help="Tiny presets on CPU: use seeded random weights instead of the packaged trained checkpoint.",
)
ProgressOpt = opt(bool, help="Show progress on stderr (when it is a terminal).")
PromptLenOpt = opt(int, help="Prompt tokens (random ids).")
MaxTokensOpt = opt(int, help="Output tokens per request.")
