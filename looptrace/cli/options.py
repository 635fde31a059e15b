"""Typer option types every command shares (`model: ModelOpt = None`), so that one option reads and
behaves the same in every command."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"
    csv = "csv"


ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Family (ouro, huginn, olmo: tiny preset on CPU, real shape on CUDA) or a preset name "
        "(ouro-1.4b, ouro-2.6b, huginn-0125, olmo-retrofit-1b, ouro-tiny, huginn-tiny, olmo-retrofit-tiny). "
        "Default: ouro; with --weights, the checkpoint's family (a contradicting --model is an error).",
        show_default=False,
    ),
]
RecipeOpt = Annotated[str, typer.Option("--recipe", "-r", help="Recipe name in recipes/ or a YAML path.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Override a recipe setting: section.key=value (repeatable).", show_default=False
    ),
]
DeviceOpt = Annotated[str, typer.Option(help="auto (CUDA if present), cpu, cuda, cuda:N.")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32.")]
WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        help="Local Hugging Face checkpoint directory (config.json + *.safetensors).",
        show_default=False,
    ),
]
SeedOpt = Annotated[int, typer.Option(help="Seed for random weights, prompts and sampling.")]
FormatOpt = Annotated[
    OutputFormat | None,
    typer.Option(
        "--format",
        "-f",
        help="Output format. Default: from the --output suffix (.json, .csv), else table.",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Also write the output to this file (whole, atomically; a symlink is written through; "
        "directories and devices are refused).",
        show_default=False,
    ),
]
ThreadsOpt = Annotated[int, typer.Option(help="CPU threads for torch (1 is fastest for tiny models).")]

RandomWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--random-weights",
        help="Tiny presets on CPU: use seeded random weights instead of the packaged trained checkpoint.",
    ),
]
