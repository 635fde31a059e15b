"""The shape of one `looptrace.stats/1` snapshot, as far as the dashboard reads it (pydantic models).

Every source's snapshot is checked here before the dashboard draws it, so a malformed one (a replay file
edited by hand, a server of another version) is one line naming the field, not a crash inside a widget:
`check_snapshot` raises `SnapshotError("requests: expected an object, got 'abc'")`. Sections may be null
(the panels say "n/a"); keys the dashboard does not read are allowed and not checked. Numbers must be
finite: a NaN latency has no place on a chart.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Number = float | None


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class Latency(_Section):
    p50: Number = None
    p99: Number = None
    n: int = 0


class RequestRow(_Section):
    id: str | int = "?"
    stage: str = "?"
    loop: int = 0
    max_loops: int | None = None
    tokens: int = 0
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    age_s: float = 0.0


class Requests(_Section):
    running: int = 0
    waiting: int = 0
    rows: list[RequestRow] | None = Field(None, alias="list")  # `list` would shadow the builtin


class Tokens(_Section):
    prompt_total: Number = None
    generation_total: Number = None


class Engine(_Section):
    steps_per_token: Number = None
    submissions_per_token: Number = None


class Plane(_Section):
    plane: int | str
    live_slots: float
    dead_slots: float


class KV(_Section):
    usage: Number = None
    num_blocks: int | None = None
    request_blocks: int | None = None
    cached_blocks: int | None = None
    free_blocks: int | None = None
    planes: list[Plane] | None = None


class GraphCache(_Section):
    graphs: int = 0
    replays: int = 0
    captures: int = 0
    evictions: int = 0
    fallbacks: int = 0
    fallback_reasons: dict[str, int] | None = None


class Graphs(_Section):
    caches: dict[str, GraphCache] | None = None


class Prefix(_Section):
    hit_rate: Number = None
    hit_tokens: Number = None
    query_tokens: Number = None


class Probe(_Section):
    note: str | None = None
    error: str | None = None
    mode: str | None = None
    per_token: dict[str, Number] | None = None
    fallback_reasons: dict[str, int] | None = None


class Snapshot(_Section):
    time: Number = None
    requests: Requests | None = None
    tokens: Tokens | None = None
    latency: dict[str, Latency | None] | None = None
    engine: Engine | None = None
    kv: KV | None = None
    graphs: Graphs | None = None
    prefix: Prefix | None = None
    prefill_depth: Number = None
    probe: Probe | None = None


class SnapshotError(ValueError):
    """A snapshot the dashboard cannot draw; the message names the first bad field."""


_EXPECTED = {  # pydantic's error types, said the way the rest of looptrace's errors say them
    "dict_type": "an object",
    "model_type": "an object",
    "list_type": "a list",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
}


_UNION_MEMBERS = {"str", "int", "float", "none"}


def check_snapshot(snapshot: Any) -> None:
    """Raise SnapshotError naming the first field of `snapshot` the dashboard cannot draw."""
    if not isinstance(snapshot, dict):
        raise SnapshotError(f"expected a snapshot object, got {_short(snapshot)}")
    try:
        Snapshot.model_validate(snapshot)
    except ValidationError as exc:
        error = exc.errors()[0]
        # a union adds its member's name to the path (`id.str`): the path is the snapshot's keys only
        path = "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"] if p not in _UNION_MEMBERS
        )
        where = path.lstrip(".") or "snapshot"
        if error["type"] == "missing":
            raise SnapshotError(f"{where}: missing") from None
        expected = _EXPECTED.get(error["type"], error["msg"].lower())
        raise SnapshotError(f"{where}: expected {expected}, got {_short(error['input'])}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
