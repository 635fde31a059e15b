"""When a token leaves the loop. Prefill is always full depth; these policies govern decode loops."""

from __future__ import annotations

import math

from looptrace.engine.config import ExitConfig
from looptrace.engine.request import Request


class FixedDepth:
    """Every token runs `max_loops` (Ouro's released threshold 1.0; Huginn's only mode)."""

    needs_gate = False

    def __init__(self, cfg: ExitConfig, max_loops: int) -> None:
        self.max_loops = max_loops

    def after_loop(self, req: Request, gate_logit: float | None) -> bool:
        return req.loops_done >= self.max_loops


class ThresholdExit:
    """Ouro's cumulative exit probability: remaining *= 1 - sigmoid(gate) each loop; exit once
    1 - remaining >= threshold after at least `min_loops` (vllm-rlt `ouro` policy)."""

    needs_gate = True

    def __init__(self, cfg: ExitConfig, max_loops: int) -> None:
        self.max_loops, self.threshold, self.min_loops = max_loops, cfg.threshold, cfg.min_loops

    def after_loop(self, req: Request, gate_logit: float | None) -> bool:
        assert gate_logit is not None
        req.remaining_probability *= 1.0 - 1.0 / (1.0 + math.exp(-gate_logit))
        if req.loops_done >= self.max_loops:
            return True
        exited = 1.0 - req.remaining_probability
        return self.threshold < 1.0 and req.loops_done >= self.min_loops and exited >= self.threshold


EXIT_POLICIES = {"fixed": FixedDepth, "threshold": ThresholdExit}
