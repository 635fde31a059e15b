"""`bisect`: which of B's settings, applied to A, make the runs diverge (delta debugging over the
differing settings, `ddmin`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from looptrace.analysis.ddmin import Outcome, ddmin
from looptrace.analysis.diff import evidence


@dataclass
class BisectResult:
    criterion: str  # "tokens" | "logits" | "none"
    causes: list[list[str]]  # each a minimal set of settings that makes its baseline diverge
    # per cause: the settings it needs, applied on both sides of its runs (empty: against A itself)
    baselines: list[list[str]] = field(default_factory=list)
    tested: list[dict[str, Any]] = field(default_factory=list)  # every subset run: settings, diverges

    def to_dict(self) -> dict[str, Any]:
        return {
            "criterion": self.criterion,
            "causes": self.causes,
            "baselines": self.baselines,
            "tested": self.tested,
        }


def bisect(lab, mode: str = "batched") -> BisectResult:
    """Find the settings of B that make A's `mode` runs diverge from A's: by tokens when A and B differ in
    tokens, else by bitwise logits (a one-ulp change rarely flips a greedy token but always shows there).

    A subset that needs other settings to be valid (its closure) is run against those settings alone
    (`Lab.baseline`), so it is blamed for its own effect only, not for what the settings it needs do."""
    ev = evidence(lab.compare(lab.all, mode))
    if not ev.tokens_ok:
        criterion = "tokens"
    elif ev.logits_ok is False:
        criterion = "logits"
    else:
        return BisectResult("none", [])
    result = BisectResult(criterion, [])
    seen: dict[tuple[frozenset[str], frozenset[str]], Outcome] = {}

    def fails(subset: frozenset[str]) -> Outcome:
        full = lab.closure(subset)
        if full is None or not full:
            return None if full is None else False
        base = lab.baseline(subset, full)
        if (full, base) not in seen:
            e = evidence(lab.compare(full, mode, base))
            seen[full, base] = not e.tokens_ok if criterion == "tokens" else e.logits_ok is False
            entry: dict[str, Any] = {"settings": sorted(full), "diverges": seen[full, base]}
            if base:
                entry["baseline"] = sorted(base)
            result.tested.append(entry)
        return seen[full, base]

    rest = set(lab.all)
    while rest and fails(frozenset(rest)) is True:
        found = frozenset(ddmin(sorted(rest), fails))
        full = lab.closure(found) or found
        result.causes.append(sorted(found))
        result.baselines.append(sorted(lab.baseline(found, full)))
        rest -= found
    return result
