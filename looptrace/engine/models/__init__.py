"""Model families. `build_model(spec)` picks the class for the spec's family."""

from __future__ import annotations

from looptrace.engine.model_config import ModelSpec
from looptrace.engine.models.base import LoopedModel
from looptrace.engine.models.huginn import HuginnForCausalLM
from looptrace.engine.models.olmo import OlmoRetrofitForCausalLM
from looptrace.engine.models.ouro import OuroForCausalLM

FAMILIES: dict[str, type[LoopedModel]] = {
    "ouro": OuroForCausalLM,
    "huginn": HuginnForCausalLM,
    "olmo": OlmoRetrofitForCausalLM,
}


def build_model(spec: ModelSpec) -> LoopedModel:
    """Constructs the module tree (on the current default device; use a `meta`/`cuda` device context)."""
    return FAMILIES[spec.family](spec)


__all__ = ["FAMILIES", "LoopedModel", "build_model"]
