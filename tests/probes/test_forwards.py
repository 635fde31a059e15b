"""Forward passes found in traces without step annotations (`looptrace.probes.forwards`).

Small synthetic traces built op by op as Kineto writes them with `record_shapes=True` (a `generate` of a
plain model: embedding lookup, layers of QKV GEMM + SDPA + out GEMM, lm-head GEMM, argmax): batched
decode, `logits_to_keep`, no embedding op, module events, a single forward, and traces that are not a
model's forwards. The real Hugging Face traces of looped models are in test_structure.py.
"""

from __future__ import annotations

import pytest

from looptrace.probes.events import TraceEvent
from looptrace.probes.forwards import find_forwards, gemm_rows_cols
from looptrace.probes.steps import DECODE, FORWARD_GRAMMAR, PREFILL, describe, step_tokens

VOCAB, HIDDEN, HEADS, HEAD_DIM = 1000, 64, 4, 16


class Recorder:
    """Appends cpu_op events on one thread, one after another (1 µs apart)."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.t = 0.0

    def op(self, name: str, dims: list, dur: float = 5.0, cat: str = "cpu_op") -> TraceEvent:
        e = TraceEvent(cat, name, self.t, dur, 1, 1, {"Input Dims": dims})
        self.events.append(e)
        self.t += dur + 1.0
        return e

    def span(self, name: str, start: float, cat: str = "python_function") -> None:
        self.events.append(TraceEvent(cat, name, start, self.t - start, 1, 1, {}))


def forward(
    rec: Recorder,
    batch: int,
    new: int,
    cached: int,
    layers: int = 2,
    embed: bool = True,
    keep_last: bool = False,
    module: str | None = None,
) -> None:
    """One forward of `batch` sequences of `new` tokens over `cached` earlier ones, then argmax."""
    start = rec.t
    if embed:
        rec.op("aten::embedding", [[VOCAB, HIDDEN], [batch, new], [], [], []])
    x = [batch, new, HIDDEN]
    for _ in range(layers):
        rec.op("aten::linear", [x, [3 * HIDDEN, HIDDEN], []])
        q, k = [batch, HEADS, new, HEAD_DIM], [batch, HEADS, cached + new, HEAD_DIM]
        rec.op("aten::scaled_dot_product_attention", [q, k, k, [], [], [], [], []])
        rec.op("aten::linear", [x, [HIDDEN, HIDDEN], []])
    rec.op("aten::linear", [[batch, 1 if keep_last else new, HIDDEN], [VOCAB, HIDDEN], []])
    if module:
        rec.span(module, start)
    rec.op("aten::argmax", [[batch, VOCAB], [], []])


def generate(prompt: int, tokens: int, batch: int = 1, **kw) -> list[TraceEvent]:
    """A prefill of `prompt` tokens per sequence, then `tokens` - 1 decode forwards."""
    rec = Recorder()
    rec.op("aten::ones", [[], [], [], [], []])  # generate's set-up, before the first forward
    forward(rec, batch, prompt, 0, **kw)
    for i in range(1, tokens):
        forward(rec, batch, 1, prompt + i - 1, **kw)
    return rec.events


def summary(events: list[TraceEvent]) -> tuple[list[tuple[str, int]], set[str]]:
    found, steps = find_forwards(events)
    assert found is not None and found.vocab == VOCAB
    assert all(s.grammar == FORWARD_GRAMMAR for s in steps)
    return [(s.phase, s.rows) for s in steps], {f.started_by for f in found.forwards}


def test_greedy_decode_of_one_sequence():
    phases, started = summary(generate(prompt=12, tokens=4))
    assert phases == [(PREFILL, 12), (DECODE, 1), (DECODE, 1), (DECODE, 1)]
    assert started == {"embedding"}


def test_steps_cover_sampling_and_tokens_count_as_vllm_steps_do():
    events = generate(prompt=12, tokens=4)
    found, steps = find_forwards(events)
    argmaxes = [e for e in events if e.name == "aten::argmax"]
    # Each forward's step runs from its embedding lookup to the next one: its argmax is inside.
    for s, sample in zip(steps, argmaxes, strict=True):
        assert s.event.ts <= sample.ts < s.event.end
    assert steps[0].event.ts > events[0].ts  # generate's set-up belongs to no forward
    totals = step_tokens(steps)
    assert (totals.prompt_tokens, totals.output_tokens, totals.tokens) == (12, 3, 3)
    assert describe(totals, FORWARD_GRAMMAR).startswith(
        "forward passes (no step annotations): 3 output tokens (decode rows) in 4 forward(s)"
    )


def test_batched_decode_rows_are_the_batch():
    phases, _ = summary(generate(prompt=10, tokens=3, batch=4))
    assert phases == [(PREFILL, 40), (DECODE, 4), (DECODE, 4)]


def test_lm_head_of_the_last_row_only():
    """`logits_to_keep`: the prefill's lm-head computes one row; its rows come from the embedding."""
    phases, _ = summary(generate(prompt=10, tokens=3, batch=2, keep_last=True))
    assert phases == [(PREFILL, 20), (DECODE, 2), (DECODE, 2)]


def test_without_embedding_op_rows_from_the_first_gemm():
    """`inputs_embeds` (no lookup): forwards start after the previous lm-head, rows from the QKV GEMM;
    the vocabulary is then the widest GEMM output."""
    phases, started = summary(generate(prompt=8, tokens=3, embed=False))
    assert phases == [(PREFILL, 8), (DECODE, 1), (DECODE, 1)]
    assert started == {"previous lm-head"}


def test_module_events_start_the_forwards():
    events = generate(prompt=8, tokens=3, module="nn.Module: LoopedForCausalLM_0")
    phases, started = summary(events)
    assert phases == [(PREFILL, 8), (DECODE, 1), (DECODE, 1)] and started == {"module event"}
    modules = sorted(e.ts for e in events if e.cat == "python_function")
    assert [s.event.ts for s in find_forwards(events)[1]] == modules


@pytest.mark.parametrize(
    ("prompt", "tokens", "batch", "expected"),
    [
        (12, 1, 1, [(PREFILL, 12)]),  # one prefill forward alone
        (1, 1, 1, [(PREFILL, 1)]),  # one token, no cache read: still a prefill
    ],
)
def test_single_forward(prompt, tokens, batch, expected):
    assert summary(generate(prompt, tokens, batch))[0] == expected


def test_decode_only_trace_reads_the_cache():
    """Every forward computes the same rows: SDPA's query of one position against a longer key says
    decode."""
    rec = Recorder()
    for i in range(3):
        forward(rec, 2, 1, 20 + i)
    assert summary(rec.events)[0] == [(DECODE, 2)] * 3


def test_profiler_started_inside_a_forward():
    """The first lm-head has no attention call before it: the tail of a forward the profiler joined
    midway, no step of its own."""
    events = generate(prompt=8, tokens=3)
    first_head = next(i for i, e in enumerate(events) if e.args["Input Dims"][1:2] == [[VOCAB, HIDDEN]])
    joined = events[first_head - 1 :]  # the prefill's out projection, lm-head and argmax
    phases, _ = summary(joined)
    assert phases == [(DECODE, 1), (DECODE, 1)]


def test_not_a_model_forward():
    rec = Recorder()
    assert find_forwards([]) == (None, [])
    rec.op("aten::linear", [[4, HIDDEN], [VOCAB, HIDDEN], []])
    rec.op("aten::linear", [[4, HIDDEN], [VOCAB, HIDDEN], []])  # two "lm-heads", no attention between
    assert find_forwards(rec.events) == (None, [])
    shapeless = [TraceEvent("cpu_op", "aten::mm", 0.0, 1.0, 1, 1, {})]
    assert find_forwards(shapeless) == (None, [])


@pytest.mark.parametrize(
    ("name", "dims", "expected"),
    [
        ("aten::linear", [[2, 7, 64], [1000, 64], []], (14, 1000)),
        ("aten::mm", [[14, 64], [64, 1000]], (14, 1000)),
        ("aten::addmm", [[1000], [14, 64], [64, 1000], [], []], (14, 1000)),
        ("aten::matmul", [[2, 7, 64], [64, 1000]], (14, 1000)),
        ("aten::bmm", [[2, 7, 64], [2, 64, 1000]], (14, 1000)),
        ("aten::mm", [[14, 64]], None),
        ("aten::mm", "not a list", None),
    ],
)
def test_gemm_rows_cols(name, dims, expected):
    assert gemm_rows_cols(TraceEvent("cpu_op", name, 0.0, 1.0, args={"Input Dims": dims})) == expected
