"""The interface every looped family implements (the model never schedules).

`prelude(tokens, ctx)` embeds tokens (Huginn/OLMo: and runs the prelude layers) and returns the injection
vector (None for Ouro). `core(state, inject, ctx)` runs exactly one loop and returns the new state and the
exit-gate logit (None when the family has no gate). `coda_hidden(state, ctx)` runs what follows the loop up
to the head (Huginn/OLMo: coda layers and norms), `head(hidden)` gives logits.
"""

from __future__ import annotations

import torch
from torch import nn

from looptrace.engine.layers import AttnContext
from looptrace.engine.model_config import ModelSpec


class LoopedModel(nn.Module):
    spec: ModelSpec

    def first_state(self, embedded: torch.Tensor) -> torch.Tensor | None:
        """Initial loop input when the family derives it from the embedding (Ouro); None = noise/zeros."""
        return None

    def prelude(
        self, tokens: torch.Tensor, ctx: AttnContext | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (embedded-or-prelude output, injection vector or None)."""
        raise NotImplementedError

    def core(
        self, state: torch.Tensor, inject: torch.Tensor | None, ctx: AttnContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def coda_hidden(self, state: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        return state

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def has_coda_layers(self) -> bool:
        return self.spec.n_coda > 0

    @property
    def rope(self) -> nn.Module:
        raise NotImplementedError
