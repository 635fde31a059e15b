"""Engine steps and their tokens, read from the serving engine's own step annotations (user_annotation).

Grammars (as vLLM V1 and SGLang write them; checked on the traces in `../shared/traces/`):

  vLLM   `execute_<n>_context_<c>(sq<Q>sk<K>sqsq<..>sqsk<..>)_generation_<g>(sq<Q>sk<K>sqsq<..>sqsk<..>)`
         n = scheduled tokens; c / g = context (prefill) / generation (decode) requests; inside each group
         `sq` = its query tokens (prompt tokens prefilled / tokens decoded) and `sk` = the keys they read.
         SGLang writes the same name around its own step.
  vLLM, older `execute_context_<c>(<q>)_generation_<g>(<q>)`, as `Worker.annotate_profile` in vLLM's
         v1/worker/gpu_worker.py writes it: c / g = context / generation requests, each followed by its
         group's scheduled tokens in brackets. A group may hold a second number, `(<q>_<k>)`: read as the
         group's query tokens and the keys they read (the `sq`/`sk` pair of the newer grammar).
  SGLang `step[EXTEND bs=<b> toks=<t>]` (prefill of t prompt tokens) and `step[DECODE bs=<b>]` (b tokens).
  older  `execute_model`, `gpu_model_runner...`: steps without token counts.

Prompt tokens of a step = its context rows' query tokens; output tokens = its generation rows' query
tokens (one per decode row, more under speculative decoding). When two step annotations nest on one
thread (SGLang writes both grammars around one step), the outer one is the step; an inner one only fills
in counts the outer lacks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from looptrace.probes.events import TraceEvent

ANNOTATION_CAT = "user_annotation"
VLLM_STEP = "execute_"  # prefix of the vLLM grammar (also the marker name reported)
SGLANG_STEP = "step["
OLD_STEP_MARKERS = ("execute_model", "gpu_model_runner")

_GROUP = r"\(sq(\d+)sk(\d+)sqsq\d+sqsk(\d+)\)"
_VLLM_RE = re.compile(rf"^execute_(\d+)_context_(\d+){_GROUP}_generation_(\d+){_GROUP}$")
_OLD_GROUP = r"\((\d+)(?:_(\d+))?\)"
_VLLM_OLD_RE = re.compile(rf"^execute_context_(\d+){_OLD_GROUP}_generation_(\d+){_OLD_GROUP}$")
_SGLANG_RE = re.compile(r"^step\[(EXTEND|DECODE|MIXED|IDLE)\b([^\]]*)\]$")
_KV_RE = re.compile(r"(\w+)=(\d+)")

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
FORWARD_GRAMMAR = "forward"  # steps found from the model's forward passes (`forwards`), not annotations


@dataclass(frozen=True)
class Step:
    """One engine step: its host range and its tokens (None where the annotation does not say)."""

    event: TraceEvent
    grammar: str  # "vllm" | "sglang"
    prompt_tokens: int | None
    output_tokens: int | None
    rows: int | None = None
    # keys (KV-cache positions) read by the context / generation rows, where the annotation says
    prompt_keys: int | None = None
    output_keys: int | None = None
    pairs: int | None = None  # (query, key) pairs attention computes in the step (`sqsk` summed)

    @property
    def keys(self) -> int | None:
        """KV positions the step's rows read (their context lengths summed), where the annotation says."""
        if self.prompt_keys is None and self.output_keys is None:
            return None
        if (self.prompt_keys is None and self.prompt_tokens) or (
            self.output_keys is None and self.output_tokens
        ):
            return None  # one group's keys are missing
        return (self.prompt_keys or 0) + (self.output_keys or 0)

    @property
    def phase(self) -> str:
        prompt, output = self.prompt_tokens or 0, self.output_tokens or 0
        if prompt and output:
            return MIXED
        return PREFILL if prompt else DECODE


def parse_step(e: TraceEvent) -> Step | None:
    """The step an annotation names, or None if its name follows neither grammar."""
    m = _VLLM_RE.match(e.name)
    if m:
        ctx_rows, ctx_q, gen_rows, gen_q = int(m[2]), int(m[3]), int(m[6]), int(m[7])
        pairs = int(m[5]) + int(m[9])
        return Step(e, "vllm", ctx_q, gen_q, ctx_rows + gen_rows, int(m[4]), int(m[8]), pairs)
    m = _VLLM_OLD_RE.match(e.name)
    if m:
        ctx_rows, ctx_q, gen_rows, gen_q = int(m[1]), int(m[2]), int(m[4]), int(m[5])
        ctx_k, gen_k = (int(k) if k is not None else None for k in (m[3], m[6]))
        # a generation row's one query meets each of its keys once; a context group's pairs are unknown
        one_query = gen_k is not None and gen_q == gen_rows
        pairs = gen_k if one_query and ctx_q == 0 else None
        return Step(e, "vllm", ctx_q, gen_q, ctx_rows + gen_rows, ctx_k, gen_k, pairs)
    m = _SGLANG_RE.match(e.name)
    if m:
        fields = {k: int(v) for k, v in _KV_RE.findall(m[2])}
        rows = fields.get("bs")
        if m[1] == "DECODE":
            return Step(e, "sglang", 0, rows, rows)
        if m[1] == "EXTEND":
            return Step(e, "sglang", fields.get("toks"), 0, rows)
        return Step(e, "sglang", fields.get("toks"), None, rows)
    return None


def engine_steps(events: Iterable[TraceEvent]) -> list[Step]:
    """Outermost engine step annotations (rule in the module docstring), in time order."""
    parsed = sorted(
        (s for e in events if e.cat == ANNOTATION_CAT and (s := parse_step(e)) is not None),
        key=lambda s: (s.event.ts, -s.event.dur),
    )
    out: list[Step] = []
    for s in parsed:
        outer = next((o for o in reversed(out) if _contains(o.event, s.event)), None)
        if outer is None:
            out.append(s)
        elif outer.prompt_tokens is None or outer.output_tokens is None:
            i = out.index(outer)
            out[i] = Step(
                outer.event,
                outer.grammar,
                outer.prompt_tokens if outer.prompt_tokens is not None else s.prompt_tokens,
                outer.output_tokens if outer.output_tokens is not None else s.output_tokens,
                outer.rows or s.rows,
                outer.prompt_keys if outer.prompt_keys is not None else s.prompt_keys,
                outer.output_keys if outer.output_keys is not None else s.output_keys,
                outer.pairs if outer.pairs is not None else s.pairs,
            )
    return out


def _contains(outer: TraceEvent, inner: TraceEvent) -> bool:
    same_thread = (outer.pid, outer.tid) == (inner.pid, inner.tid)
    return same_thread and outer.ts <= inner.ts and inner.end <= outer.end


@dataclass(frozen=True)
class StepTokens:
    """Token totals of the steps in a window."""

    steps: int
    prompt_tokens: int
    output_tokens: int
    phases: dict[str, int]  # phase -> steps

    @property
    def tokens(self) -> int:
        """The per-token divisor: output tokens when the window decodes, else prompt tokens."""
        return self.output_tokens or self.prompt_tokens


def step_tokens(steps: Sequence[Step]) -> StepTokens:
    phases: dict[str, int] = {}
    for s in steps:
        phases[s.phase] = phases.get(s.phase, 0) + 1
    return StepTokens(
        len(steps),
        sum(s.prompt_tokens or 0 for s in steps),
        sum(s.output_tokens or 0 for s in steps),
        phases,
    )


def describe(t: StepTokens, grammar: str) -> str:
    """The tokens_source text: where the divisor came from."""
    engine = {"vllm": "execute_…_context_…_generation_…", "sglang": "step[…]"}.get(grammar, grammar)
    unit = "output tokens (generation rows)" if t.output_tokens else "prompt tokens (context rows)"
    counts = ", ".join(f"{n} {phase}" for phase, n in sorted(t.phases.items()))
    if grammar == FORWARD_GRAMMAR:
        unit = "output tokens (decode rows)" if t.output_tokens else "prompt tokens (prefill rows)"
        return (
            f"forward passes (no step annotations): {t.tokens:,} {unit} in {t.steps} forward(s) "
            f"({counts}); prompt {t.prompt_tokens:,}, output {t.output_tokens:,}"
        )
    return (
        f"{engine} step annotations: {t.tokens:,} {unit} in {t.steps} step(s) ({counts}); "
        f"prompt {t.prompt_tokens:,}, output {t.output_tokens:,}"
    )
