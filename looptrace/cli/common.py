"""What every engine-driving command shares: options, engine construction, errors, run headers."""

from __future__ import annotations

import enum
import json
import math
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

import looptrace

err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_NO_ENV = 0, 1, 2, 3


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"
    csv = "csv"


class UsageError(ValueError):
    """Bad input detected by the CLI itself."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print one line to stderr and return the Exit to raise (`raise fail(...) from None`)."""
    err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
    return typer.Exit(code=code)


@contextmanager
def friendly_errors() -> Iterator[None]:
    """Turn our input errors into one line + exit code 2; an unavailable device into exit code 3."""
    from looptrace.engine.llm_engine import EngineInputError
    from looptrace.engine.model_config import UnknownModelError
    from looptrace.drive.workloads import WorkloadError
    from looptrace.recipes import RecipeError

    bad_input: tuple[type[Exception], ...] = (
        UsageError,
        EngineInputError,
        UnknownModelError,
        WorkloadError,
        RecipeError,
        FileNotFoundError,
    )
    try:
        from looptrace.engine.checkpoint import CheckpointError

        bad_input += (CheckpointError,)
    except ImportError:  # pragma: no cover
        pass
    try:
        yield
    except bad_input as exc:
        raise fail(str(exc)) from None
    except NoDeviceError as exc:
        raise fail(str(exc), EXIT_NO_ENV) from None


class NoDeviceError(RuntimeError):
    pass


# Shared options ------------------------------------------------------------------------------------------
ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Family (ouro, huginn, olmo: tiny preset on CPU, real shape on CUDA) or a preset name "
        "(ouro-1.4b, ouro-2.6b, huginn-0125, olmo-retrofit-1b, ouro-tiny, huginn-tiny, olmo-retrofit-tiny).",
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
FormatOpt = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")]
OutputOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Also write the output to this file.", show_default=False),
]
ThreadsOpt = Annotated[int, typer.Option(help="CPU threads for torch (1 is fastest for tiny models).")]

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device '{device}': expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise NoDeviceError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device '{device}': expected auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype: str, device):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UsageError(f"--dtype '{dtype}': expected auto, bf16, fp16 or fp32")
    return getattr(torch, DTYPES[dtype])


def peek_spec(model: str, device: str, weights: Path | None):
    """The model's shape before building anything (workloads need the vocab size)."""
    from looptrace.engine.model_config import resolve_preset

    if weights is not None:
        from looptrace.engine.checkpoint import read_spec

        return read_spec(weights)
    return resolve_preset(model, resolve_device(device).type)


@dataclass
class EngineSetup:
    engine: Any  # LLMEngine
    recipe: Any  # Recipe
    requested_model: str
    weights: Path | None


def build_engine(
    *,
    model: str,
    recipe: str,
    sets: list[str] | None,
    device: str,
    dtype: str,
    weights: Path | None,
    seed: int,
    threads: int,
    max_model_len: int | None = None,
) -> EngineSetup:
    """Recipe + overrides -> EngineConfig; preset or checkpoint -> model; both -> LLMEngine."""
    import torch

    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.engine.model_config import resolve_preset
    from looptrace.recipes import load_recipe

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    overrides = list(sets or [])
    rec = load_recipe(recipe, overrides)
    if rec.config.scheduler.max_model_len is None and max_model_len is not None:
        # Size the decode tables to the workload instead of the model's 4k-64k positions.
        block = rec.config.kv.block_size
        rec.config.scheduler.max_model_len = math.ceil(max_model_len / block) * block
    if weights is not None:
        from looptrace.engine.checkpoint import load_checkpoint

        spec, net = load_checkpoint(weights, dev, dt)
        engine = LLMEngine(net, rec.config, device=dev, dtype=dt, seed=seed)
    else:
        spec = resolve_preset(model, dev.type)
        engine = LLMEngine.from_spec(spec, rec.config, device=dev, dtype=dt, seed=seed)
    return EngineSetup(engine, rec, model, weights)


def versions() -> dict[str, str]:
    import torch

    out = {
        "looptrace": looptrace.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def device_name(engine) -> str:
    import torch

    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} thread(s))"


def run_header(setup: EngineSetup) -> dict[str, Any]:
    """Metadata every report carries: what ran, where, with which toggles, and how to pick another."""
    from looptrace.engine.config import config_to_dict
    from looptrace.engine.model_config import FAMILY_PRESETS

    e = setup.engine
    header = {
        "tool": "looptrace",
        "model_preset": e.spec.name,
        "family": e.spec.family,
        "weights": str(setup.weights) if setup.weights else "random (seeded)",
        "loops": e.max_loops,
        "device": device_name(e),
        "dtype": str(e.dtype).replace("torch.", ""),
        "recipe": setup.recipe.name,
        "recipe_source": setup.recipe.source,
        "overrides": setup.recipe.overrides,
        "config": config_to_dict(e.cfg),
        "versions": versions(),
        "command": " ".join(["looptrace", *sys.argv[1:]]),
    }
    family = setup.requested_model.lower()
    if family in FAMILY_PRESETS:
        cpu, cuda = FAMILY_PRESETS[family]
        other = cuda if e.spec.name == cpu else cpu
        header["preset_note"] = (
            f"'{family}' resolved to {e.spec.name} on {e.device.type}; pick another with --model {other} "
            f"(or any preset, or --weights DIR)"
        )
    else:
        header["preset_note"] = f"preset {e.spec.name}; families: ouro, huginn, olmo"
    return header


def check_output_path(output: Path | None) -> None:
    """Fail before any work when --output cannot be written."""
    if output is not None and not output.parent.is_dir():
        raise UsageError(f"--output {output}: directory {output.parent} does not exist")


def write_output(text: str, output: Path | None, console: Console) -> None:
    """Print to stdout and, with --output, write the same text (written whole, after success)."""
    if output is not None:
        tmp = output.with_name(output.name + ".partial")
        tmp.write_text(text)
        tmp.replace(output)
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
