"""Recurrent OLMo-2 retrofit (McLeish et al.), 4/6/4: OLMo-2 post-norm blocks with q/k norm over the full
projected width, rotate-half RoPE, adapter over cat(state, embedding), no norm before the coda, ln_f after
it, untied head. Layer names follow the raven-style converter (`transformer.*`, `norm_1`, `norm_2`)."""

from __future__ import annotations

import torch

from looptrace.engine.models.raven_blocks import PostNormBlock, RavenLoopedModel


class OlmoRetrofitForCausalLM(RavenLoopedModel):
    block_cls = PostNormBlock

    def coda_input(self, state: torch.Tensor) -> torch.Tensor:
        return state  # the core's output feeds the coda directly (no norm before it)
