"""One finding: a cost in a trace window, where it sits, the change that removes it and its saving.

A leaf module: `findings` (the kinds read from the timeline) and `findings_kv` (attention over dead KV
slots) both return these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MIN_SAVING_PCT = 5.0  # a finding whose saving is under this share of its base is left out


@dataclass
class Finding:
    kind: str  # host_gaps | loop_sync | unfused_norm | fusable_launch | dead_kv
    cost: str  # what it costs, in words with the measured figures
    cost_us_per_token: float
    cost_pct_of_wall: float
    where: str
    evidence: str
    remedy: str
    saving_us_per_token: float
    saving_pct_of_wall: float
    estimate: str  # how the saving was estimated

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
