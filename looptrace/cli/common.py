"""What every engine-driving command shares: options, engine construction, errors, run headers."""

from __future__ import annotations

import enum
import json
import math
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

import looptrace

err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_NO_ENV = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_CODES_HELP = "Exit codes: 0 ok, 2 bad input, 3 environment missing, 130 interrupted (Ctrl-C)."
SEED_MAX = 2**64 - 1  # torch.manual_seed's range; numpy takes any non-negative int


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"
    csv = "csv"


class UsageError(ValueError):
    """Bad input detected by the CLI itself."""


def one_line(text: str) -> str:
    """`text` on one line: line breaks and other unprintable characters (a user's path or value may hold
    any) written as escapes, so an error stays one line and cannot drive the terminal."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print `error: message` on one line to stderr and return the Exit to raise (`raise fail(...) from
    None`). The message is plain text, never Rich markup: it quotes user paths and values such as
    'my[/]recipe.yaml' (the one place every error goes through, so none needs escaping)."""
    err_console.print(Text("error: ", style="bold red") + Text(one_line(message)), soft_wrap=True)
    return typer.Exit(code=code)


def note(message: str, label: str = "note") -> None:
    """A `note:` (or `interrupted:`, ...) line on stderr; the message is plain text, as in `fail`."""
    err_console.print(Text(f"{label}: ", style="yellow") + Text(one_line(message)), soft_wrap=True)


# Input errors by (module, class): matched only once their module is loaded (an exception of a module
# never imported cannot have been raised), so commands that need no engine never import torch for this.
_BAD_INPUT = (
    ("looptrace.drive.workloads", "WorkloadError"),
    ("looptrace.engine.llm_engine", "EngineInputError"),
    ("looptrace.engine.model_config", "UnknownModelError"),
    ("looptrace.engine.checkpoint", "CheckpointError"),
    ("looptrace.engine.tokenizer", "TokenizerError"),
    ("looptrace.engine.budget", "BudgetError"),
    ("looptrace.engine.config", "ConfigError"),
    ("looptrace.probes.session", "ProfileInputError"),
    ("looptrace.recipes", "RecipeError"),
)


def _bad_input_types() -> tuple[type[BaseException], ...]:
    found = [getattr(sys.modules[mod], name, None) for mod, name in _BAD_INPUT if mod in sys.modules]
    return (UsageError, FileNotFoundError, *(t for t in found if isinstance(t, type)))


@contextmanager
def friendly_errors() -> Iterator[None]:
    """Turn our input errors into one line + exit code 2; an unavailable device into exit code 3."""
    try:
        yield
    except NoDeviceError as exc:
        raise fail(str(exc), EXIT_NO_ENV) from None
    except Exception as exc:
        if isinstance(exc, _bad_input_types()):
            raise fail(str(exc)) from None
        raise


class NoDeviceError(RuntimeError):
    pass


@contextmanager
def interrupt_exit(what: str = "interrupted") -> Iterator[None]:
    """Ctrl-C anywhere in a command: one line on stderr and exit code 130, no traceback."""
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(Text(one_line(what), style="yellow"), soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def spinner(show: bool, text: str):
    """A transient Rich spinner on stderr (drawn only when stderr is a terminal), or nothing."""
    return err_console.status(text) if show else nullcontext()


def check_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        raise UsageError(f"--seed {seed}: expected an integer from 0 to 2**64-1")


# Shared options ------------------------------------------------------------------------------------------
DEFAULT_MODEL = "ouro"
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


def model_family(model: str) -> str:
    """Family of a --model value (a family or a preset name); UnknownModelError otherwise."""
    from looptrace.engine.model_config import FAMILY_PRESETS, PRESETS, resolve_preset

    key = model.lower()
    if key in FAMILY_PRESETS:
        return key
    if key in PRESETS:
        return PRESETS[key].family
    return resolve_preset(model, "cpu").family  # raises the one-line UnknownModelError


def checkpoint_spec(model: str | None, weights: Path):
    """The checkpoint's spec; an explicit --model of another family is an error, not silently ignored."""
    from looptrace.engine.checkpoint import read_spec

    spec = read_spec(weights)
    if model is not None:
        family = model_family(model)
        if family != spec.family:
            raise UsageError(
                f"--model {model} is a {family} model but --weights {weights} holds a {spec.family} "
                f"checkpoint (config.json); pass --model {spec.family} or leave --model out"
            )
    return spec


def peek_spec(model: str | None, device: str, weights: Path | None):
    """The model's shape before building anything (workloads need the vocab size)."""
    from looptrace.engine.model_config import resolve_preset

    if weights is not None:
        return checkpoint_spec(model, weights)
    return resolve_preset(model or DEFAULT_MODEL, resolve_device(device).type)


@dataclass
class EngineSetup:
    engine: Any  # LLMEngine
    recipe: Any  # Recipe
    requested_model: str | None  # None: the default (or the checkpoint's family with --weights)
    weights: Path | None
    shipped_weights: bool = False  # `weights` is the packaged checkpoint of a tiny preset, not --weights


def build_engine(
    *,
    model: str | None,
    recipe: str,
    sets: list[str] | None,
    device: str,
    dtype: str,
    weights: Path | None,
    seed: int,
    threads: int,
    max_model_len: int | None = None,
    random_weights: bool = False,
) -> EngineSetup:
    """Recipe + overrides -> EngineConfig; preset or checkpoint -> model; both -> LLMEngine.

    On CPU a tiny preset with a packaged trained checkpoint (looptrace/assets/<preset>) loads it unless
    `random_weights` (--random-weights) asks for the seeded random init."""
    import torch

    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.engine.model_config import resolve_preset
    from looptrace.recipes import load_recipe

    check_seed(seed)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    overrides = list(sets or [])
    rec = load_recipe(recipe, overrides)
    # A contradicting --model (and a broken tokenizer.json, read later by serve and run) fails before
    # the weights load.
    spec = checkpoint_spec(model, weights) if weights is not None else None
    spec = spec or resolve_preset(model or DEFAULT_MODEL, dev.type)
    if rec.config.scheduler.max_model_len is None and max_model_len is not None:
        # Size the decode tables to the workload instead of the model's 4k-64k positions (a workload
        # longer than the model is reported by the caller's fit check, against the real context).
        block = rec.config.kv.block_size
        need = min(max_model_len, spec.max_position)
        rec.config.scheduler.max_model_len = math.ceil(need / block) * block
    check_engine_memory(spec, rec.config, dev, dt)
    if weights is not None:
        from looptrace.engine.checkpoint import load_checkpoint
        from looptrace.engine.tokenizer import load_tokenizer

        load_tokenizer(weights)
        spec, net = load_checkpoint(weights, dev, dt)
        engine = LLMEngine(net, rec.config, device=dev, dtype=dt, seed=seed)
    else:
        shipped = None if random_weights else _shipped_weights(spec.name)
        if shipped is not None:  # issue #9: a tiny preset defaults to its trained checkpoint (any device)
            from looptrace.engine.checkpoint import load_checkpoint

            spec, net = load_checkpoint(shipped, dev, dt, name=spec.name)
            engine = LLMEngine(net, rec.config, device=dev, dtype=dt, seed=seed)
            return EngineSetup(engine, rec, model, shipped, shipped_weights=True)
        engine = LLMEngine.from_spec(spec, rec.config, device=dev, dtype=dt, seed=seed)
    return EngineSetup(engine, rec, model, weights)


def check_engine_memory(spec, config, device, dtype, *, context: str = "") -> None:
    """BudgetError (one line, exit 2) when the engine these settings build cannot fit in memory."""
    import torch

    from looptrace.engine.budget import check_memory, engine_needs

    elt = torch.empty((), dtype=dtype).element_size()
    check_memory(engine_needs(spec, config, elt, device), device, context=context)


def _shipped_weights(preset: str) -> Path | None:
    from looptrace.assets import shipped_weights

    return shipped_weights(preset)


RandomWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--random-weights",
        help="Tiny presets on CPU: use seeded random weights instead of the packaged trained checkpoint.",
    ),
]


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
    family = (setup.requested_model or DEFAULT_MODEL).lower()
    if setup.weights is not None and not setup.shipped_weights:
        header["preset_note"] = (
            f"{e.spec.family} checkpoint {setup.weights} (shape from its config.json); "
            f"random weights: --model {e.spec.family} without --weights"
        )
    elif family in FAMILY_PRESETS:
        cpu, cuda = FAMILY_PRESETS[family]
        other = cuda if e.spec.name == cpu else cpu
        header["preset_note"] = (
            f"'{family}' resolved to {e.spec.name} on {e.device.type}; pick another with --model {other} "
            f"(or any preset, or --weights DIR)"
        )
    else:
        header["preset_note"] = f"preset {e.spec.name}; families: ouro, huginn, olmo"
    return header


def check_output_path(output: Path | None, option: str = "--output", inputs=()) -> None:
    """Fail before any work when --output cannot be written or is one of `inputs` (rules and the form of
    `inputs`: looptrace/cli/output.py)."""
    from looptrace.cli.output import check_output

    check_output(output, option, inputs)


def command_inputs(prompts: Path | None, recipe: str, weights: Path | None) -> list:
    """Files the command reads, which --output must not replace: the prompts, a recipe given as a file
    and the checkpoint's files."""
    inputs: list = [(prompts, "--prompts")]
    if Path(recipe).is_file():
        inputs.append((Path(recipe), "--recipe"))
    if weights is not None and weights.is_dir():
        inputs += [(f, "--weights") for f in sorted(weights.iterdir()) if f.is_file()]
    return inputs


def write_output(text: str, output: Path | None, console: Console) -> None:
    """Print to stdout and, with --output, write the same text (whole and atomically, after success)."""
    if output is not None:
        from looptrace.cli.output import atomic_write_text

        atomic_write_text(output, text + "\n")
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
