"""The reference serving engine for looped models. Imports nothing from probes, tui or cli.

The names below load on first use (PEP 562): importing `looptrace.engine`, or a torch-free module of it
(`config`, `model_config`, `request`, `hooks`, `tokenizer`, `budget`), loads no torch, so a command's
option parsing and `looptrace --help` stay light; `LLMEngine` and `EnginePlan` bring torch in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from looptrace.engine.config import EngineConfig
    from looptrace.engine.hooks import Observer, RequestEvent, StepInfo, StepResult
    from looptrace.engine.llm_engine import LLMEngine
    from looptrace.engine.model_config import PRESETS, ModelSpec, resolve_preset
    from looptrace.engine.plan import EnginePlan
    from looptrace.engine.request import EngineInputError, SamplingParams, TokenOutput

# public name -> the module that defines it
_HOMES = {
    "EngineConfig": "config",
    "Observer": "hooks",
    "RequestEvent": "hooks",
    "StepInfo": "hooks",
    "StepResult": "hooks",
    "LLMEngine": "llm_engine",
    "PRESETS": "model_config",
    "ModelSpec": "model_config",
    "resolve_preset": "model_config",
    "EnginePlan": "plan",
    "EngineInputError": "request",
    "SamplingParams": "request",
    "TokenOutput": "request",
}

__all__ = [
    "PRESETS",
    "EngineConfig",
    "EngineInputError",
    "EnginePlan",
    "LLMEngine",
    "ModelSpec",
    "Observer",
    "RequestEvent",
    "SamplingParams",
    "StepInfo",
    "StepResult",
    "TokenOutput",
    "resolve_preset",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
