"""Initial recurrent state for Huginn / OLMo (Ouro starts from the embedding and uses none of this)."""

from __future__ import annotations

import torch

from looptrace.engine.model_config import ModelSpec


class SequentialNoise:
    """Base engine: each prompt row and each decoded token gets `trunc_normal_(std σ, ±3σ)` · embed_scale
    from the request's own generator, one call per run of consecutive rows of one request. Draws follow
    processing order, so a cached prefix or another chunk size shifts every later token's noise."""

    name = "sequential"
    uses_generator = True

    def __init__(self, spec: ModelSpec) -> None:
        self.std, self.scale = spec.state_init_std, spec.embed_scale

    def draw(self, rows: int, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        x = torch.empty((rows, like.shape[-1]), dtype=like.dtype, device=like.device)
        torch.nn.init.trunc_normal_(x, 0.0, self.std, -3 * self.std, 3 * self.std, generator=generator)
        return x * self.scale


class ZeroState:
    """Deterministic zero initial state (LoopDuet serving; oracle comparisons)."""

    name = "zeros"
    uses_generator = False

    def __init__(self, spec: ModelSpec) -> None:
        pass

    def draw(self, rows: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.zeros((rows, like.shape[-1]), dtype=like.dtype, device=like.device)


NOISE = {"sequential": SequentialNoise, "zeros": ZeroState}
