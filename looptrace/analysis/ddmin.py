"""Delta debugging (Zeller & Hildebrandt's ddmin): a 1-minimal subset of items that makes a check fail."""

from __future__ import annotations

from collections.abc import Callable

Outcome = bool | None  # True: fails (diverges); False: passes; None: unresolved (invalid combination)


def _split(items: list[str], n: int) -> list[list[str]]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


def ddmin(items: list[str], fails: Callable[[frozenset[str]], Outcome]) -> list[str]:
    """A 1-minimal subset of `items` for which `fails` is True (`fails(frozenset(items))` must be True).
    Unresolved outcomes count as passing."""
    current, n = list(items), 2
    while len(current) >= 2:
        chunks = _split(current, min(n, len(current)))
        reduced = False
        for chunk in chunks:
            if fails(frozenset(chunk)) is True:
                current, n, reduced = chunk, 2, True
                break
        if not reduced and len(chunks) > 2:
            for chunk in chunks:
                comp = [x for x in current if x not in chunk]
                if fails(frozenset(comp)) is True:
                    current, n, reduced = comp, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current
