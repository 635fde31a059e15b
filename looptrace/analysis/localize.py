"""`looptrace diff --localize`: replay one request alone under both arms, capture every op's output, and
name the first place (token · stage · loop · layer · op) whose output differs, with its ulp distance."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from looptrace.analysis.diff import with_engine
from looptrace.engine.config import EngineConfig
from looptrace.engine.hooks import Observer, RequestEvent
from looptrace.engine.perturb import NONE, OpInfo, OpTracker, float_tensors
from looptrace.engine.request import SamplingParams

Key = tuple[int, str, str, str, str, int]  # token, stage, loop, layer, op, occurrence


@dataclass
class OpRecord:
    key: Key
    kind: str
    module: str
    outputs: list[torch.Tensor]


class _Capture(Observer):
    def __init__(self) -> None:
        self.tokens = 0
        self.records: list[OpRecord] = []
        self.counts: dict[tuple, int] = {}

    def on_request_event(self, event: RequestEvent) -> None:
        if event.kind in ("first_token", "token"):
            self.tokens += 1

    def on_op(self, tracker: OpTracker, info: OpInfo, out: Any) -> None:
        tensors = float_tensors(out)
        if not tensors:
            return None
        in_layer = tracker.layer != NONE
        loop = NONE if tracker.loop is None else str(tracker.loop)
        base = (self.tokens, tracker.stage or "?", loop, tracker.layer, info.label(in_layer))
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        self.records.append(
            OpRecord((*base, n), info.kind, info.name, [t.detach().to("cpu").clone() for t in tensors])
        )
        return None


def capture(engine, prompt: list[int], max_tokens: int, request_id: str) -> tuple[list[OpRecord], list[int]]:
    cap = _Capture()
    engine.attach(cap)
    tracker = OpTracker(cap.on_op).attach(engine)
    try:
        engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens), request_id=request_id)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        tracker.detach()
        engine.detach(cap)
    return cap.records, list(engine.request_view(request_id).outputs)


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits as integers whose order and differences follow the floats (adjacent floats differ by 1)."""
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    i = t.contiguous().view(width).to(torch.int64)
    mag = i & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(i < 0, -mag, mag)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((ordered_bits(a) - ordered_bits(b)).abs().max().item()) if a.numel() else 0


def place_text(key: Key) -> str:
    tok, stage, loop, layer, op, occ = key
    return f"token {tok} · {stage} · loop {loop} · {layer} · {op}" + (f" (call {occ + 1})" if occ else "")


@dataclass
class Localization:
    request: str
    max_tokens: int
    ops_compared: int
    a_tokens: list[int]
    b_tokens: list[int]
    first: OpRecord | None = None
    problem: str | None = None  # "values" | "shape" | "missing in B"
    max_ulp: int | None = None
    max_abs: float | None = None
    elements_differ: int | None = None
    elements: int | None = None
    ops_differ: int = 0

    @property
    def found(self) -> bool:
        return self.first is not None

    @property
    def place(self) -> str:
        return place_text(self.first.key) if self.first else ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request": self.request,
            "max_tokens": self.max_tokens,
            "ops_compared": self.ops_compared,
            "a_tokens": self.a_tokens,
            "b_tokens": self.b_tokens,
            "found": self.found,
        }
        if self.first is not None:
            tok, stage, loop, layer, op, occ = self.first.key
            out.update(
                token=tok,
                stage=stage,
                loop=loop,
                layer=layer,
                op=op,
                call=occ + 1,
                op_kind=self.first.kind,
                module=self.first.module,
                place=self.place,
                problem=self.problem,
                max_ulp=self.max_ulp,
                max_abs=self.max_abs,
                elements_differ=self.elements_differ,
                elements=self.elements,
                ops_differ=self.ops_differ,
            )
        return out


def localize(
    factory: Callable[[EngineConfig], Any],
    cfg_a: EngineConfig,
    cfg_b: EngineConfig,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
) -> Localization:
    runs = [
        with_engine(factory, cfg, lambda engine: capture(engine, prompt, max_tokens, request_id))
        for cfg in (cfg_a, cfg_b)
    ]
    (rec_a, tok_a), (rec_b, tok_b) = runs
    by_key = {r.key: r for r in rec_b}
    result = Localization(request_id, max_tokens, 0, tok_a, tok_b)
    for ra in rec_a:
        rb = by_key.get(ra.key)
        result.ops_compared += 1
        if rb is None:
            problem = "missing in B"
        elif [t.shape for t in ra.outputs] != [t.shape for t in rb.outputs] or [
            t.dtype for t in ra.outputs
        ] != [t.dtype for t in rb.outputs]:
            problem = "shape"
        elif all(torch.equal(x, y) for x, y in zip(ra.outputs, rb.outputs)):
            continue
        else:
            problem = "values"
        result.ops_differ += 1
        if result.first is not None:
            continue
        result.first, result.problem = ra, problem
        if problem == "values":
            pairs = list(zip(ra.outputs, rb.outputs))
            result.max_ulp = max(ulp_distance(x, y) for x, y in pairs)
            result.max_abs = max(float((x.double() - y.double()).abs().max()) for x, y in pairs)
            result.elements_differ = sum(int((x != y).sum()) for x, y in pairs)
            result.elements = sum(x.numel() for x, _ in pairs)
    return result
