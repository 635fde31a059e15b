"""Typer option types every command shares (`model: ModelOpt = None`), so that one option reads and
behaves the same in every command."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer


def opt(kind: Any, *names: str, **settings: Any) -> Any:
    """`Annotated[kind, typer.Option(*names, **settings)]`: an option type, on one line where it fits."""
    return Annotated[kind, typer.Option(*names, **settings)]


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
    help="Also write the output to this file (whole, atomically; a symlink is written through; directories "
    "and devices are refused).",
)
ThreadsOpt = opt(int, help="CPU threads for torch (1 is fastest for tiny models).")
RandomWeightsOpt = opt(
    bool,
    "--random-weights",
    help="Tiny presets on CPU: use seeded random weights instead of the packaged trained checkpoint.",
)
ProgressOpt = opt(bool, help="Show progress on stderr (when it is a terminal).")
PromptLenOpt = opt(int, help="Prompt tokens (random ids).")
MaxTokensOpt = opt(int, help="Output tokens per request.")
