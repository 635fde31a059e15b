"""The reference serving engine for looped models. Imports nothing from probes, tui or cli."""

from looptrace.engine.config import EngineConfig
from looptrace.engine.hooks import Observer, RequestEvent, StepInfo, StepResult
from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.model_config import PRESETS, ModelSpec, resolve_preset
from looptrace.engine.plan import EnginePlan
from looptrace.engine.request import EngineInputError, SamplingParams, TokenOutput

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
