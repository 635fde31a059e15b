"""LoopDuet split depth (S, P): the queue-age controller that picks P before each engine step.

P = round(P_max - z (P_max - P_min)), z = clip((q - q_low) / (q_high - q_low), 0, 1), where q is the age in
seconds of the oldest admitted request still waiting for its first token (time in service included; 0 when
there is none). Python's round (half to even): the paper does not state its rounding mode.
"""

from __future__ import annotations


def queue_age_p(q: float, p_max: int, p_min: int, q_low: float = 0.25, q_high: float = 1.0) -> int:
    if p_min > p_max:
        raise ValueError(f"need P_min <= P_max, got {p_min} > {p_max}")
    if q_high <= q_low:
        raise ValueError(f"need q_high > q_low, got {q_high} <= {q_low}")
    z = min(max((q - q_low) / (q_high - q_low), 0.0), 1.0)
    return int(round(p_max - z * (p_max - p_min)))
