"""When a token leaves the loop. Prefill is always full depth; these policies govern decode loops.

A policy is a pure decision: given the loops done so far, the probability mass still in the loop and the
gate logit of the loop just run, it says whether the token exits and what mass remains. The engine applies
the result to the request (`LLMEngine._advance`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from looptrace.engine.config import ExitConfig


@dataclass(frozen=True)
class ExitDecision:
    exited: bool
    remaining_probability: float


class FixedDepth:
    """Every token runs `max_loops`; nothing is read back (Huginn's only mode)."""

    needs_gate = False
    can_exit_early = False

    def __init__(self, cfg: ExitConfig, max_loops: int) -> None:
        self.max_loops = max_loops

    def decide(self, loops_done: int, remaining: float, gate_logit: float | None) -> ExitDecision:
        return ExitDecision(loops_done >= self.max_loops, remaining)


class GateExit:
    """The base engine's default (vllm-rlt `ouro` policy): Ouro's exit gate evaluated after every loop, its
    logit read back to the host. remaining *= 1 - sigmoid(gate); exit once 1 - remaining >= threshold after
    at least `min_loops`. At the released threshold 1.0 no token exits early, but the readback still costs a
    device->host copy and a sync per recurrent step, as in the engine being characterised."""

    needs_gate = True

    def __init__(self, cfg: ExitConfig, max_loops: int) -> None:
        self.max_loops, self.threshold, self.min_loops = max_loops, cfg.threshold, cfg.min_loops
        self.can_exit_early = cfg.threshold < 1.0

    def decide(self, loops_done: int, remaining: float, gate_logit: float | None) -> ExitDecision:
        assert gate_logit is not None
        remaining *= 1.0 - 1.0 / (1.0 + math.exp(-gate_logit))
        if loops_done >= self.max_loops:
            return ExitDecision(True, remaining)
        exited = 1.0 - remaining
        early = self.threshold < 1.0 and loops_done >= self.min_loops and exited >= self.threshold
        return ExitDecision(early, remaining)


def make_exit_policy(cfg: ExitConfig, max_loops: int, has_gate: bool) -> FixedDepth | GateExit:
    """`gate` on a model without an exit gate (Huginn, OLMo) runs every token to max_loops."""
    if cfg.policy == "gate" and has_gate:
        return GateExit(cfg, max_loops)
    return FixedDepth(cfg, max_loops)


EXIT_POLICIES = {"fixed": FixedDepth, "gate": GateExit}
