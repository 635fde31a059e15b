"""Huginn-0125 (raven): prelude 2 / core 4 / coda 2, embedding scale sqrt(n_embd), sandwich blocks with
post-add norms, fused Wqkv with qk_bias, interleaved RoPE in fp32, adapter over cat(state, embedding),
tied head, ln_f -> coda -> ln_f. The initial state is trunc-normal noise drawn by the runner (noise.py)."""

from __future__ import annotations

from looptrace.engine.models.raven_blocks import RavenLoopedModel, SandwichBlock


class HuginnForCausalLM(RavenLoopedModel):
    block_cls = SandwichBlock
