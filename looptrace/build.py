"""The one place an engine is built: `build(BuildRequest) -> EngineSetup` for every command, the server
and the clients (--model/--weights -> a resolved model, recipe + overrides -> config, both -> LLMEngine);
`place` + `load` + `engine_factory` for `looptrace diff`'s engines on one loaded model; plus the metadata
every report carries about what was built.

No CLI here (no typer, no rich): errors are plain exceptions (`BuildInputError`, `NoDeviceError` and the
engine's own input errors) that the CLI maps to exit codes. torch is imported inside the functions so that
importing this module stays cheap for commands that never build an engine.
"""

from __future__ import annotations

import copy
import gc
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import looptrace

if TYPE_CHECKING:  # the engine package imports torch: only at call time here
    from looptrace.engine.budget import PoolNeed

DEFAULT_MODEL = "ouro"
SEED_MAX = 2**64 - 1  # torch.manual_seed's range; numpy takes any non-negative int
POOL_CAP_TOKENS = 8192  # KV positions per factory engine on CUDA at most: diff workloads and eval sets fit
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


class BuildInputError(ValueError):
    """A bad device, dtype, seed, thread count or model choice (the CLI: one line, exit code 2)."""


class NoDeviceError(RuntimeError):
    """The requested device is not available on this machine (the CLI: exit code 3)."""


def check_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        raise BuildInputError(f"--seed {seed}: expected an integer from 0 to 2**64-1")


def resolve_device(device: Any):
    """torch.device of a --device value (auto, cpu, cuda, cuda:N) or of a torch.device."""
    # deferred: torch: commands that build no engine never load it
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BuildInputError(f"--device '{device}': expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise NoDeviceError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise BuildInputError(f"--device '{device}': expected auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype: Any, device):
    """torch.dtype of a --dtype value (auto, bf16, fp16, fp32 or a long name) or of a torch.dtype."""
    # deferred: torch: commands that build no engine never load it
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise BuildInputError(f"--dtype '{dtype}': expected auto, bf16, fp16 or fp32")
    return getattr(torch, DTYPES[dtype])


def set_threads(threads: int, device) -> None:
    """Validate --threads and apply it to torch on CPU (1 is fastest for tiny models)."""
    # deferred: torch: commands that build no engine never load it
    import torch

    if threads < 1:
        raise BuildInputError(f"--threads must be >= 1, got {threads}")
    if device.type == "cpu":
        torch.set_num_threads(threads)


def model_family(model: str) -> str:
    """Family of a --model value (a family or a preset name); UnknownModelError otherwise."""
    # deferred: the engine's modules load when a command runs: `looptrace --help` stays light
    from looptrace.engine.model_config import FAMILY_PRESETS, PRESETS, resolve_preset

    key = model.lower()
    if key in FAMILY_PRESETS:
        return key
    if key in PRESETS:
        return PRESETS[key].family
    return resolve_preset(model, "cpu").family  # raises the one-line UnknownModelError


def checkpoint_spec(model: str | None, weights: Path):
    """The checkpoint's spec; an explicit --model of another family is an error, not silently ignored."""
    # deferred: loads torch
    from looptrace.engine.checkpoint import read_spec

    spec = read_spec(weights)
    if model is not None:
        family = model_family(model)
        if family != spec.family:
            raise BuildInputError(
                f"--model {model} is a {family} model but --weights {weights} holds a {spec.family} "
                f"checkpoint (config.json); pass --model {spec.family} or leave --model out"
            )
    return spec


@dataclass(frozen=True)
class ResolvedModel:
    """What --model and --weights name, resolved once: the shape and the checkpoint (if any) to load."""

    spec: Any  # ModelSpec: from the checkpoint's config.json, else the preset
    requested: str | None  # --model as given; None: the default, or the checkpoint's family
    weights: Path | None  # checkpoint to load: --weights, or a tiny preset's packaged one; None: random
    shipped: bool = False  # `weights` is the packaged checkpoint of a tiny preset, not --weights

    @property
    def family(self) -> str:
        return self.spec.family


def resolve_model(
    model: str | None, device: Any, weights: Path | None, *, random_weights: bool = False
) -> ResolvedModel:
    """--model/--weights -> spec + checkpoint (a contradicting --model is a BuildInputError)."""
    if weights is not None:
        return ResolvedModel(checkpoint_spec(model, weights), model, weights)
    return preset_model(model, resolve_device(device).type, random_weights=random_weights)


def preset_model(model: str | None, device_type: str, *, random_weights: bool = False) -> ResolvedModel:
    """The preset --model names on `device_type`. A tiny preset with a packaged trained checkpoint
    (looptrace/assets/<preset>) loads it on any device unless `random_weights` asks for the
    seeded random init."""
    # deferred: the engine's modules and the assets' directory load when a command runs: `looptrace --help`
    # stays light
    from looptrace.assets import shipped_weights
    from looptrace.engine.model_config import resolve_preset

    spec = resolve_preset(model or DEFAULT_MODEL, device_type)
    shipped = None if random_weights else shipped_weights(spec.name)
    return ResolvedModel(spec, model, shipped, shipped=shipped is not None)


def load_model(model: ResolvedModel, device, dtype, seed: int):
    """(spec, nn.Module) on `device`: the checkpoint's weights, else the preset's seeded random init."""
    # deferred: loads torch
    from looptrace.engine.weights import create_model, init_random

    if model.weights is not None:
        from looptrace.engine.checkpoint import load_checkpoint  # deferred: loads torch

        name = model.spec.name if model.shipped else None  # a packaged checkpoint keeps the preset's name
        return load_checkpoint(model.weights, device, dtype, name=name)
    net = create_model(model.spec, device, dtype)
    init_random(net, seed)
    return model.spec, net


def fit_max_model_len(config, tokens: int) -> None:
    """Size the decode tables to a workload of `tokens` positions instead of the model's 4k-64k, unless the
    recipe sets them."""
    if config.scheduler.max_model_len is None:
        block = config.kv.block_size
        config.scheduler.max_model_len = math.ceil(tokens / block) * block


def check_engine_memory(spec, config, device, dtype, *, context: str = "") -> None:
    """BudgetError (one line, exit 2) when the engine these settings build cannot fit in memory."""
    # deferred: torch: commands that build no engine never load it
    import torch

    from looptrace.engine.budget import check_memory, engine_needs

    elt = torch.empty((), dtype=dtype).element_size()
    check_memory(engine_needs(spec, config, elt, device), device, context=context)


@dataclass(frozen=True)
class BuildRequest:
    """What an engine is built from: every command's --model, --weights, --recipe, --set, --device,
    --dtype, --seed and --threads, and the longest request it must hold. A frozen value, so that a command
    that builds several engines keeps one request and `dataclasses.replace`s what differs."""

    model: str | None = None  # a family or preset name; None: the default, or the checkpoint's family
    weights: Path | None = None  # a checkpoint directory; None: the preset (a tiny one's packaged weights)
    random_weights: bool = False  # a tiny preset's seeded random init instead of its packaged checkpoint
    recipe: str = "base"  # a recipe name or a YAML path
    sets: tuple[str, ...] = ()  # section.key=value overrides, applied in order after the recipe
    device: Any = "auto"  # auto, cpu, cuda, cuda:N or a torch.device
    dtype: Any = "auto"  # auto, bf16, fp16, fp32 (or their long names) or a torch.dtype
    seed: int = 0
    threads: int = 1  # torch threads on CPU
    max_model_len: int | None = None  # size the decode tables to this many positions (None: the recipe's)

    def resolve_model(self) -> ResolvedModel:
        return resolve_model(self.model, self.device, self.weights, random_weights=self.random_weights)


@dataclass(frozen=True)
class Placement:
    """Where the engine runs, checked: the torch device and dtype (threads applied on CPU)."""

    device: Any  # torch.device
    dtype: Any  # torch.dtype


def place(request: BuildRequest) -> Placement:
    """Check the request's seed, device, dtype and threads (in that order) and apply --threads."""
    check_seed(request.seed)
    device = resolve_device(request.device)
    dtype = resolve_dtype(request.dtype, device)
    set_threads(request.threads, device)
    return Placement(device, dtype)


@dataclass
class EngineSetup:
    engine: Any  # LLMEngine
    recipe: Any  # Recipe
    model: ResolvedModel

    @property
    def weights(self) -> Path | None:
        return self.model.weights


def build(request: BuildRequest, model: ResolvedModel | None = None) -> EngineSetup:
    """The one engine builder: placement checked, recipe + overrides -> EngineConfig, its memory checked
    before anything is allocated, the resolved model's weights -> nn.Module, both -> LLMEngine.

    `model`: the request's model, already resolved by a caller that needed its spec first (a workload's
    vocabulary, a context limit); None: resolved here."""
    # deferred: pydantic and YAML (recipes, the engine's config): `looptrace --help` stays light
    from looptrace.recipes import load_recipe

    placement = place(request)
    recipe = load_recipe(request.recipe, list(request.sets))
    model = model or request.resolve_model()
    if request.max_model_len is not None:  # a workload longer than the model is the caller's fit check
        fit_max_model_len(recipe.config, min(request.max_model_len, model.spec.max_position))
    check_engine_memory(model.spec, recipe.config, placement.device, placement.dtype)
    if model.weights is not None and not model.shipped:
        from looptrace.engine.tokenizer import load_tokenizer  # deferred: only for a checkpoint's tokenizer

        load_tokenizer(model.weights)  # a broken tokenizer.json (read later by serve, run) fails first
    _, net = load_model(model, placement.device, placement.dtype, request.seed)
    return EngineSetup(new_engine(net, recipe.config, placement, request.seed), recipe, model)


def new_engine(net, config, placement: Placement, seed: int):
    """The engine constructor every builder here ends in (the only LLMEngine call outside engine/)."""
    # deferred: loads torch
    from looptrace.engine.llm_engine import LLMEngine

    return LLMEngine(net, config, device=placement.device, dtype=placement.dtype, seed=seed)


def free_memory() -> None:
    """Collect the engines just dropped and give their CUDA blocks back, so that one engine is alive at a
    time and the next one's KV pool is sized on what is really free. The collector is needed: a CUDA
    engine's graph caches hold bound methods of its runner (a reference cycle refcounting never frees)."""
    # deferred: torch: commands that build no engine never load it
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def engine_factory(
    net, device, dtype, seed: int, need: PoolNeed | None = None, *, cap_tokens: int = POOL_CAP_TOKENS
) -> Callable[[Any], Any]:
    """EngineConfig -> a fresh LLMEngine on its own copy of `net` (an engine may hook its model), for
    commands that build many engines of one model one at a time (`looptrace diff`'s arms, bisect, localize
    and accuracy runs: configs that differ one setting at a time, on weights loaded once by `load`). On
    CUDA a pool the config does not size is sized on the memory alive when the engine is built, capped
    at `cap_tokens` positions; a `need` that does not fit is a BudgetError."""
    # deferred: the engine's modules load when a command runs: `looptrace --help` stays light
    from looptrace.engine.budget import cuda_pool_blocks

    placement = Placement(device, dtype)

    def make(cfg):
        cfg = copy.deepcopy(cfg)
        free_memory()  # whatever an earlier engine left: the pool is sized on what is alive now
        model = copy.deepcopy(net)
        if device.type == "cuda" and cfg.kv.num_blocks is None:
            elt = dtype.itemsize
            cfg.kv.num_blocks = cuda_pool_blocks(net.spec, cfg, elt, device, need, cap_tokens)
        return new_engine(model, cfg, placement, seed)

    return make


def load(request: BuildRequest, placement: Placement, model: ResolvedModel | None = None):
    """(resolved model, spec, nn.Module): the request's model and its weights on the placement, loaded
    once for an `engine_factory` (None: resolved from the request)."""
    model = model or resolve_model(
        request.model, placement.device, request.weights, random_weights=request.random_weights
    )
    spec, net = load_model(model, placement.device, placement.dtype, request.seed)
    return model, spec, net


def versions() -> dict[str, str]:
    # deferred: torch: commands that build no engine never load it
    import torch

    out = {
        "looptrace": looptrace.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    try:
        import triton  # deferred: Triton is optional (CUDA only)

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def device_name(device) -> str:
    # deferred: torch: commands that build no engine never load it
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} thread(s))"


def run_header(setup: EngineSetup) -> dict[str, Any]:
    """Metadata every report carries: what ran, where, with which toggles, and how to pick another."""
    # deferred: pydantic (the engine's config): `looptrace --help` stays light
    from looptrace.engine.config import config_to_dict

    e = setup.engine
    return {
        "tool": "looptrace",
        "model_preset": e.spec.name,
        "family": e.spec.family,
        "weights": str(setup.weights) if setup.weights else "random (seeded)",
        "loops": e.max_loops,
        "device": device_name(e.device),
        "dtype": str(e.dtype).replace("torch.", ""),
        "recipe": setup.recipe.name,
        "recipe_source": setup.recipe.source,
        "overrides": setup.recipe.overrides,
        "config": config_to_dict(setup.recipe.config),  # the config the engine was built from
        "versions": versions(),
        "command": " ".join(["looptrace", *sys.argv[1:]]),
        "preset_note": _preset_note(setup.model, e.spec, e.device.type),
    }


def _other_weights(family: str) -> str:
    """What `--model FAMILY` without --weights gives: on CPU a family with a packaged tiny checkpoint
    loads it (trained weights, not random ones)."""
    # deferred: the engine's modules and the assets' directory load when a command runs: `looptrace --help`
    # stays light
    from looptrace.assets import shipped_weights
    from looptrace.engine.model_config import FAMILY_PRESETS

    cpu_preset = FAMILY_PRESETS.get(family, (None, None))[0]
    if cpu_preset is not None and shipped_weights(cpu_preset) is not None:
        return f"without --weights, --model {family} loads the packaged trained {cpu_preset} on CPU"
    return f"random weights: --model {family} without --weights"


def _preset_note(model: ResolvedModel, spec, device_type: str) -> str:
    """How the model was picked and how to pick another."""
    # deferred: the engine's modules load when a command runs: `looptrace --help` stays light
    from looptrace.engine.model_config import FAMILY_PRESETS

    family = (model.requested or DEFAULT_MODEL).lower()
    if model.weights is not None and not model.shipped:
        where = f"{spec.family} checkpoint {model.weights} (shape from its config.json)"
        return f"{where}; {_other_weights(spec.family)}"
    if family in FAMILY_PRESETS:
        cpu, cuda = FAMILY_PRESETS[family]
        other = cuda if spec.name == cpu else cpu
        return (
            f"'{family}' resolved to {spec.name} on {device_type}; pick another with --model {other} "
            f"(or any preset, or --weights DIR)"
        )
    return f"preset {spec.name}; families: ouro, huginn, olmo"
