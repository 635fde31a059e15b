"""Loop inference without lt ranges (`looptrace.probes.loops`).

The must-show: traces of our own engine (Ouro, Huginn and OLMo-retrofit tiny on CPU, recorded by
`profile_engine` as `looptrace profile --trace` does), every lt.* range stripped, op categories from the
stripped trace's CPU ops (`categories`, as `trace analyze` does for foreign traces): the stage, loop, layer
and role of every leaf op equal the ranges', exactly. A loop's range holds everything our engine's step does
for that loop (its state gather and metadata, the pass, its state write and gate readback); without the
ranges, the host pause between two engine steps shows where one loop's bookkeeping ends and the next's
begins.

The same traces through `analyze` and `looptrace trace analyze` (the stripped file, CPU mode): the op ×
layer × loop and stage tables equal profile's cell by cell, in JSON too; the hints pass through.

Then: no false loops on plain transformers (a real Hugging Face trace, synthetic steps and whole traces,
alternating layer types, MoE experts), module layer indices (vLLM paths), and the CLI hints.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from looptrace.cli.trace_cmd import trace_app
from looptrace.engine.config import EngineConfig
from looptrace.engine.llm_engine import LLMEngine
from looptrace.probes import categories as cats
from looptrace.probes import classify as cl
from looptrace.probes import counters as C
from looptrace.probes import session
from looptrace.probes.counters import Context
from looptrace.probes.events import TraceEvent, load_chrome_trace
from looptrace.probes.forwards import find_forwards
from looptrace.probes.loops import detect_loops, infer_loops
from looptrace.probes.opstats import ancestry_chains, kernel_op
from looptrace.probes.report import render_report, to_dict
from looptrace.probes.session import ProfileConfig, profile_engine

CLI = typer.Typer()
CLI.add_typer(trace_app, name="trace")
runner = CliRunner()
QWEN_TRACE = Path("/work/shared/traces/h100_qwen1.5_0.5b/trace.json.gz")
DECODE_TOKENS = 3

# --- our engine, lt ranges stripped -------------------------------------------------------------------


class Stripped:
    """Leaf CPU ops of one recorded trace in launch order: the truth from its lt ranges, and what a trace
    without them says (category from the CPU ops, kernel name)."""

    def __init__(self, engine: LLMEngine, events: list[TraceEvent], path: Path) -> None:
        self.engine, self.path = engine, path  # path: the trace as `profile --trace` writes it
        bare = [e for e in events if not (e.cat == C.ANNOTATION_CAT and e.name.startswith(C.PREFIX))]
        self.events, self.bare = events, bare
        self.leaves = sorted(cl.leaf_cpu_ops(bare), key=lambda e: e.ts)
        positions = [((e.pid, e.tid), e.ts) for e in self.leaves]
        self.truth = _truth(events, positions)
        chains = ancestry_chains(bare, positions)
        self.contexts = [Context(op=kernel_op(e.name, ch).category) for e, ch in zip(self.leaves, chains)]
        self.names = [e.name for e in self.leaves]
        self.loop0 = sum(1 for e in events if e.cat == C.ANNOTATION_CAT and e.name == C.loop_name(0))


def _truth(events: list[TraceEvent], positions: list[tuple]) -> list[Context]:
    """Context of each op from the lt ranges of its thread (what `profile` attributes by)."""
    ranges = sorted(
        (e for e in events if e.cat == C.ANNOTATION_CAT and e.name.startswith(C.PREFIX)),
        key=lambda r: (r.ts, -r.dur),
    )
    threads = {p[0] for p in positions}
    assert len(threads) == 1, "the tiny engines run on one host thread"
    chains = C.enclosing_chains([r for r in ranges if (r.pid, r.tid) in threads], [t for _, t in positions])
    return [C.context_of(chain) for chain in chains]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """preset -> Stripped, for a short decode window and a prefill window (the profile path), recorded
    with the ops' shapes (`record_shapes=True`, as users record foreign traces: the forwards' rows)."""
    cache: dict[str, Stripped] = {}
    activities = session._activities

    def get(preset: str) -> Stripped:
        if preset not in cache:
            engine = LLMEngine.from_preset(preset, EngineConfig(), device="cpu")
            steps = DECODE_TOKENS * (engine.max_loops + 2)  # prelude + one step per loop + coda, per token
            cfg = ProfileConfig(concurrency=1, prompt_len=16, decode_steps=steps, warmup_tokens=1)
            path = tmp_path_factory.mktemp(preset) / "trace.json"
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(session, "_activities", lambda e: activities(e) | {"record_shapes": True})
                result = profile_engine(engine, cfg, trace_path=path)
            cache[preset] = Stripped(engine, result.trace.events, path)
        return cache[preset]

    return get


PRESETS = ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"]


def contexts_of(ctxs: list[Context]) -> list[tuple]:
    return [(c.stage, c.loop, c.layer, c.role) for c in ctxs]


@pytest.mark.parametrize("preset", PRESETS)
def test_stripped_trace_loops_agree_with_profile(preset, recorded):
    """The whole trace as one sequence: the loops and layers of every op are the ranges', exactly; the
    bookkeeping between two loops (a step's state gather and metadata, the last step's state write and
    gate readback) goes to its loop by the host pause between the engine's steps."""
    run = recorded(preset)
    spec, loops = run.engine.spec, run.engine.max_loops
    found = detect_loops([run.contexts], names=[run.names], times=[[e.ts for e in run.leaves]])
    assert (found.loops, found.layers_per_loop) == (loops, spec.n_core), found.how
    # One chain per forward of the recurrent block: each decode token, and the prefill step.
    assert found.chains == run.loop0, found.how
    assert found.how == (
        f"repeated op pattern: {spec.n_core} layers × {loops} loops ({run.loop0} chains of passes in 1 step)"
    )
    inferred = found.steps[0]
    truth = [(t.loop, t.layer, t.role) for t in run.truth]
    assert [(i.loop, i.layer, i.role) for i in inferred] == truth
    in_loops = sum(t.loop is not None for t in run.truth)
    assert in_loops == IN_LOOPS[preset] and in_loops > 0.7 * len(truth)  # OLMo: 72 %, prelude and coda


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"])
def test_stripped_trace_forwards_give_profiles_tokens_and_structure(preset, recorded, analyzed):
    """Without the lt ranges, the forwards (lm-head GEMM, embedding lookup, rows from its ids) give the
    tokens `profile` counts in each of its windows (its lt.tokens/<n> markers), and the structure its
    ranges give."""
    run = recorded(preset)
    found, forwards = find_forwards(run.bare)
    assert found is not None and found.vocab == run.engine.spec.vocab_size
    annotations = [e for e in run.events if e.cat == C.ANNOTATION_CAT]
    for phase, expected in (("decode", DECODE_TOKENS), ("prefill", 16)):
        [window] = [e for e in annotations if e.name == C.window_name(phase)]
        marked = sum(
            int(e.name[len(C.TOKENS_PREFIX) :])
            for e in annotations
            if e.name.startswith(C.TOKENS_PREFIX) and window.ts <= e.ts < window.end
        )
        inside = [f for f in forwards if window.ts <= f.event.ts < window.end]
        assert {f.phase for f in inside} == {phase}
        tokens = sum(f.output_tokens if phase == "decode" else f.prompt_tokens for f in inside)
        assert tokens == marked == expected
    # Every forward of the trace: the windows' and the warm-up token's (outside both windows).
    assert [f.phase for f in forwards].count("decode") == DECODE_TOKENS + 1
    _, original, bare, _ = analyzed(preset)
    spec, profiled, inferred = run.engine.spec, original.structure, bare.structure
    assert (profiled.prelude_layers, profiled.layers_per_loop, profiled.loops, profiled.coda_layers) == (
        spec.n_prelude, spec.n_core, run.engine.max_loops, spec.n_coda,
    )  # fmt: skip
    assert dataclasses.replace(inferred, source="ranges", coverage=0) == dataclasses.replace(
        profiled, coverage=0
    )
    assert inferred.source == "inferred" and inferred.coverage >= 0.95


def by_forwards(run: Stripped) -> list[Context]:
    """Contexts of the leaf ops inferred as `analyze` does on a trace without ranges: one sequence per
    forward (`forwards`), a prefill forward flagged as such."""
    _, forwards = find_forwards(run.bare)
    groups = C.group_by_step([e.ts for e in run.leaves], forwards)
    order = sorted(groups)
    found = detect_loops(
        [[run.contexts[i] for i in groups[j]] for j in order],
        names=[[run.names[i] for i in groups[j]] for j in order],
        prefill=[j >= 0 and forwards[j].phase == "prefill" for j in order],
        times=[[run.leaves[i].ts for i in groups[j]] for j in order],
    )
    out = list(run.contexts)
    for j, inferred in zip(order, found.steps, strict=True):
        for i, c in zip(groups[j], inferred, strict=True):
            out[i] = c
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_forwards_give_every_op_profiles_context(preset, recorded):
    """One sequence per forward, as `analyze` does on a trace without ranges: every op of the trace gets
    the stage, loop, layer and role profile's ranges give it: prelude, the loops (a prefill forward's
    prelude and loops stage prefill, as our engine's prefill step), coda, sampling; the ops before the
    first forward prepare it."""
    run = recorded(preset)
    inferred = by_forwards(run)
    wrong = [(n, t, i) for n, t, i in zip(run.names, contexts_of(run.truth), contexts_of(inferred)) if t != i]
    assert wrong == []
    stages = Counter(t.stage for t in run.truth)
    assert set(stages) == {"prelude", "recurrent", "coda", "sample", "prefill"}, stages


@pytest.mark.parametrize("preset", PRESETS)
def test_categories_only(preset, recorded):
    """Without kernel names (categories alone) the loops and layers are still the ranges': the host
    pauses between the engine's steps place the ops that a category alone cannot (Huginn's adapter
    concat opening each loop looks like a copy closing the previous one)."""
    run = recorded(preset)
    inferred = infer_loops([run.contexts], times=[[e.ts for e in run.leaves]])[0]
    assert [(i.loop, i.layer, i.role) for i in inferred] == [(t.loop, t.layer, t.role) for t in run.truth]


# --- the same traces through `analyze` and `trace analyze`: the op × layer × loop table ----------------

# Ops inside lt.loop ranges of the recorded window (what `profile` attributes to a loop).
IN_LOOPS = {"ouro-tiny": 4913, "huginn-tiny": 8944, "olmo-retrofit-tiny": 6696}


def strip_ranges(src: Path, dst: Path) -> Path:
    """The trace file with every lt.* user_annotation removed: what a trace of another engine lacks."""
    data = json.loads(src.read_text())
    data["traceEvents"] = [
        e
        for e in data["traceEvents"]
        if not (e.get("cat") == C.ANNOTATION_CAT and str(e.get("name", "")).startswith(C.PREFIX))
    ]
    dst.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def analyzed(recorded, tmp_path_factory):
    """preset -> (Stripped, analysis of the whole recorded trace, of the stripped file, stripped path)."""
    cache: dict[str, tuple[Stripped, C.Analysis, C.Analysis, Path]] = {}

    def get(preset: str) -> tuple[Stripped, C.Analysis, C.Analysis, Path]:
        if preset not in cache:
            run = recorded(preset)
            stripped = strip_ranges(run.path, tmp_path_factory.mktemp(preset) / "stripped.json")
            original = C.analyze(load_chrome_trace(run.path), window="all")
            bare = C.analyze(load_chrome_trace(stripped), tokens=original.counters.tokens)
            cache[preset] = (run, original, bare, stripped)
        return cache[preset]

    return get


def per_loop(stats: list[C.GroupStat]) -> Counter:
    """Kernels per loop ("0", ...; NONE) of a by_loop table, summed over ops."""
    out: Counter = Counter()
    for s in stats:
        out[s.key[1]] += s.kernels
    return out


def cells(stats: list[C.GroupStat], layered: bool) -> Counter:
    """Kernels per (layer, loop) of a by_op_layer_loop table, summed over ops; layered: rows with a layer
    only, else the rows without one."""
    out: Counter = Counter()
    for s in stats:
        if (s.key[1] != C.NONE) == layered:
            out[s.key[1:]] += s.kernels
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_analyze_stripped_trace_loop_table(preset, analyzed):
    """`analyze` on the stripped trace file (CPU mode: leaf cpu_ops) finds the loops and gives the op ×
    layer × loop table of `profile` (analyze of the trace with its ranges), cell by cell."""
    run, original, bare, _ = analyzed(preset)
    spec, loops = run.engine.spec, run.engine.max_loops
    # One sequence per forward (lm-head GEMM, embedding lookup: `forwards`), one chain in each.
    how = f"{spec.n_core} layers × {loops} loops ({run.loop0} chains of passes in {run.loop0} steps)"
    assert f"loops inferred from the kernel pattern: repeated op pattern: {how}" in bare.notes
    assert bare.counters.kernels == original.counters.kernels and bare.breakdown.has_loops
    profiled, inferred = per_loop(original.breakdown.by_loop), per_loop(bare.breakdown.by_loop)
    assert sum(n for loop, n in profiled.items() if loop != C.NONE) == IN_LOOPS[preset]
    assert inferred == profiled
    # Every (layer, loop) cell: the same kernels as profile's (its ops are lt.op kinds, ours categories,
    # so cells are compared summed over ops) ...
    for layered in (True, False):
        assert cells(bare.breakdown.by_op_layer_loop, layered) == cells(
            original.breakdown.by_op_layer_loop, layered
        )
    assert len(cells(bare.breakdown.by_op_layer_loop, True)) >= spec.n_core * loops
    # ... and per category: the categories of the same ops under the ranges' (layer, loop).
    truth = Counter(
        (c.op, t.layer or C.NONE, C.NONE if t.loop is None else str(t.loop))
        for c, t in zip(run.contexts, run.truth, strict=True)
    )
    assert Counter({s.key: s.kernels for s in bare.breakdown.by_op_layer_loop}) == truth
    # And per stage, as profile's ranges give them.
    assert {s.key: s.kernels for s in bare.breakdown.by_stage} == {
        s.key: s.kernels for s in original.breakdown.by_stage
    }


def test_trace_analyze_cli_loop_table(analyzed, tmp_path):
    """The CLI on the stripped Ouro trace: JSON by_loop / by_op_layer_loop rows as `analyze` gives them,
    loops as ints; the table report shows the op × loop table (profile's too); --loops passes through."""
    run, original, bare, stripped = analyzed("ouro-tiny")
    tokens = str(original.counters.tokens)
    result = runner.invoke(CLI, ["trace", "analyze", str(stripped), "--format", "json", "--tokens", tokens])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["breakdown"]
    want = to_dict(bare, {})["breakdown"]
    assert got["by_loop"] == want["by_loop"] and got["by_op_layer_loop"] == want["by_op_layer_loop"]
    assert {r["loop"] for r in got["by_loop"]} == {0, 1, 2, 3, None}
    row = next(r for r in got["by_op_layer_loop"] if r["layer"] == "core0" and r["loop"] == 0)
    assert row["op"] == "elementwise" and row["kernels"] > 0
    for analysis in (original, bare):
        buf = io.StringIO()
        render_report(analysis, {}, Console(file=buf, width=160, color_system=None))
        assert "Kernels by op and loop" in buf.getvalue()
    # A hint of another shape keeps no chain: no loops, no op × loop table.
    result = runner.invoke(CLI, ["trace", "analyze", str(stripped), "--format", "json", "--loops", "3"])
    assert result.exit_code == 0, result.output
    assert {r["loop"] for r in json.loads(result.stdout)["breakdown"]["by_loop"]} == {None}


def test_analyze_loop_hints(analyzed):
    _, _, bare, stripped = analyzed("ouro-tiny")
    trace = load_chrome_trace(stripped)
    hinted = C.analyze(trace, tokens=bare.counters.tokens, loops=4, layers_per_loop=4)
    assert hinted.breakdown.by_op_layer_loop == bare.breakdown.by_op_layer_loop
    assert not C.analyze(trace, layers_per_loop=3).breakdown.has_loops
    with pytest.raises(ValueError, match="loops must be >= 1"):
        C.analyze(trace, loops=0)
    for flag in ("--loops", "--layers-per-loop"):
        result = runner.invoke(CLI, ["trace", "analyze", str(stripped), flag, "0"])
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output


# --- plain transformers: no loops --------------------------------------------------------------------------


@pytest.mark.skipif(not QWEN_TRACE.exists(), reason="shared traces not present")
def test_hugging_face_trace_has_no_loops():
    """Qwen1.5-0.5B on an H100 (eager HF): 24 layers with module indices, plus 10 layers of the step
    queued before the trace began. No loops with or without the indices, names or not."""
    trace = load_chrome_trace(QWEN_TRACE)
    kernels = [e for e in trace.events if cl.is_kernel(e)]
    calls = {e.correlation: e for e in trace.events if cl.is_api_call(e) and e.correlation is not None}
    kernels = sorted((e for e in kernels if e.correlation in calls), key=lambda e: calls[e.correlation].ts)
    positions = [
        ((calls[e.correlation].pid, calls[e.correlation].tid), calls[e.correlation].ts) for e in kernels
    ]
    ops = [kernel_op(e.name, ch) for e, ch in zip(kernels, ancestry_chains(trace.events, positions))]
    assert Counter(o.layer for o in ops if o.layer is not None) == {i: 42 for i in range(24)}
    with_index = [
        Context(op=o.category, layer=f"layer{o.layer}" if o.layer is not None else None) for o in ops
    ]
    bare = [Context(op=o.category) for o in ops]
    for ctxs in (with_index, bare):
        for names in (None, [[e.name for e in kernels]]):
            found = detect_loops([ctxs], names=names)
            assert (found.found, found.how) == (False, None)
            assert all(a is b for a, b in zip(found.steps[0], ctxs))


SHARED = QWEN_TRACE.parent.parent
FOREIGN = [
    SHARED / "h100_qwen1.5_0.5b/trace.json.gz",
    SHARED / "sglang_prefilldecode/sglang_Qwen3-8B_prefilldecode.json.gz",
    SHARED / "vllm_decode_full/graph_execution.json.gz",  # gpt-oss: MoE, alternating attention
]


@pytest.mark.parametrize("path", FOREIGN, ids=lambda p: p.parent.name)
def test_foreign_traces_get_no_loop_stage(path):
    """Through `analyze` (which calls `infer_loops` on traces without lt ranges): no kernel of these
    plain models lands in a recurrent stage."""
    if not path.exists():
        pytest.skip("shared traces not present")
    analysis = C.analyze(load_chrome_trace(path))
    assert [s.key for s in analysis.breakdown.by_stage] == [(C.NONE,)]
    # No op × loop table: one by_loop row per op, outside loops; every row of the op × layer × loop
    # table outside loops too.
    b = analysis.breakdown
    assert not b.has_loops and [s.key for s in b.by_loop] == [(s.key[0], C.NONE) for s in b.by_op]
    assert {s.key[2] for s in b.by_op_layer_loop} == {C.NONE}


# --- synthetic steps ---------------------------------------------------------------------------------------

LAYER = [cats.RMSNORM, cats.GEMM, cats.ROPE, cats.KV_WRITE, cats.ATTENTION, cats.GEMM, cats.RMSNORM]
LAYER += [cats.GEMM, cats.ACTIVATION, cats.GEMM]


def ops(*cats_: str, layer: str | None = None) -> list[Context]:
    return [Context(op=c, layer=layer) for c in cats_]


def layers(n: int, indexed: bool, body: list[str] = LAYER, first: int = 0) -> list[Context]:
    return [c for i in range(first, first + n) for c in ops(*body, layer=f"layer{i}" if indexed else None)]


def ouro_step(loops: int, n: int, indexed: bool) -> list[Context]:
    """vLLM's Ouro: embed, loops × (n layers + the loop's norm), then head and sampling."""
    step = ops(cats.COPY)
    for _ in range(loops):
        step += layers(n, indexed) + ops(cats.RMSNORM)
    return step + ops(cats.GEMM, cats.SAMPLING)


@pytest.mark.parametrize("indexed", [True, False])
def test_vllm_ouro_step(indexed):
    step = ouro_step(4, 3, indexed)
    found = detect_loops([step, step])
    source = "module layer indices" if indexed else "repeated op pattern"
    assert found.how == f"{source}: 3 layers × 4 loops (2 chains of passes in 2 steps)"
    got = found.steps[0]
    per_loop = 3 * len(LAYER) + 1
    assert [c.loop for c in got] == [None] + [r for r in range(4) for _ in range(per_loop)] + [None, None]
    assert [c.stage for c in got] == ["prelude"] + ["recurrent"] * 4 * per_loop + ["coda", "sample"]
    first = got[1 : 1 + per_loop]
    assert [c.layer for c in first] == [f"core{i}" for i in range(3) for _ in LAYER] + [None]
    assert {c.role for c in first[:-1]} == {"core"} and first[-1].role == C.NONE
    assert [c.op for c in got] == [c.op for c in step]  # categories kept


def test_vllm_ouro_with_one_index_per_loop_and_layer():
    """vLLM's Ouro keeps one attention layer (and KV cache) per (loop, layer), named with index loop × L +
    layer: the indices never repeat, one long run; the op pattern still gives the loops."""
    n, loops = 3, 4
    step = ops(cats.COPY)
    for r in range(loops):
        step += layers(n, True, first=r * n) + ops(cats.RMSNORM)
    step += ops(cats.GEMM, cats.SAMPLING)
    found = detect_loops([step, step])
    assert found.how == f"repeated op pattern: {n} layers × {loops} loops (2 chains of passes in 2 steps)"
    per_loop = n * len(LAYER) + 1
    got = found.steps[0]
    assert [c.loop for c in got[1:-2]] == [r for r in range(loops) for _ in range(per_loop)]
    assert [c.layer for c in got[1 : 1 + per_loop]] == [f"core{i}" for i in range(n) for _ in LAYER] + [None]


@pytest.mark.parametrize("indexed", [False, True])
def test_huginn_like_step_prelude_adapter_coda(indexed):
    """Prelude layers, an adapter (concat + GEMM) opening every loop, coda layers with norms around.
    Indexed as Kineto numbers module instances: prelude 0-1, core 2-5, coda 6-7."""
    adapter = ops(cats.COPY, cats.GEMM)
    step = ops(cats.COPY) + layers(2, indexed) + ops(cats.ELEMENTWISE)
    for _ in range(3):
        step += adapter + layers(4, indexed, first=2)
    step += ops(cats.RMSNORM) + layers(2, indexed, first=6) + ops(cats.RMSNORM, cats.GEMM, cats.SAMPLING)
    found = detect_loops([step])
    source = "module layer indices" if indexed else "repeated op pattern"
    assert found.how == f"{source}: 4 layers × 3 loops (1 chain of passes in 1 step)"
    got = found.steps[0]
    n = len(LAYER)
    start = 1 + 2 * n + 1
    per_loop = 2 + 4 * n
    loops = [r for r in range(3) for _ in range(per_loop)]
    assert [c.loop for c in got] == [None] * start + loops + [None] * (len(step) - start - 3 * per_loop)
    assert [c.layer for c in got[start : start + per_loop]] == [None] * 2 + [
        f"core{i}" for i in range(4) for _ in LAYER
    ]
    assert [c.layer for c in got[1 : 1 + 2 * n]] == [f"prelude{i}" for i in range(2) for _ in LAYER]
    assert {c.stage for c in got[:start]} == {"prelude"}
    coda = got[start + 3 * per_loop :]
    assert [c.layer for c in coda[1 : 1 + 2 * n]] == [f"coda{i}" for i in range(2) for _ in LAYER]
    assert [c.stage for c in coda] == ["coda"] * (len(coda) - 1) + ["sample"]


def plain_tokens(tokens: int, n: int, indexed: bool, sampling: str = cats.SAMPLING) -> list[Context]:
    """A plain transformer's forwards one after another: embed, n layers, norm, head, sampling."""
    out: list[Context] = []
    for _ in range(tokens):
        out += ops(cats.COPY) + layers(n, indexed) + ops(cats.RMSNORM, cats.GEMM, sampling)
    return out


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("tokens", [1, 5])
def test_plain_transformer_unchanged(indexed, tokens):
    step = plain_tokens(tokens, 6, indexed)
    found = detect_loops([step])
    assert not found.found and found.steps[0] == step and all(a is b for a, b in zip(found.steps[0], step))


def test_plain_whole_trace_without_sampling_op_looks_looped():
    """The limit of structure alone: successive forwards with nothing that samples between them are
    indistinguishable from loops (pass one step per sequence, as step annotations give)."""
    step = plain_tokens(5, 6, False, sampling=cats.REDUCE)
    assert detect_loops([step]).loops == 5


def test_alternating_layer_types_are_not_loops():
    """Sliding/full attention or dense/MoE layers alternating: two-layer repeats, but the edge layers of
    each 'block' are not copies of the layer period."""
    moe_layer = LAYER[:7] + [cats.MOE_ROUTING, cats.MOE, cats.MOE]
    body = [c for _ in range(6) for c in LAYER + moe_layer]
    step = ops(cats.COPY) + ops(*body) + ops(cats.RMSNORM, cats.GEMM, cats.SAMPLING)
    assert not detect_loops([step]).found


def test_moe_experts_inside_layers_are_not_loops():
    """Eager MoE: each layer runs its experts one after another (repeated GEMMs, no attention)."""
    experts = [cats.GEMM, cats.ACTIVATION, cats.GEMM] * 8
    step = (
        ops(cats.COPY) + layers(12, False, LAYER[:7] + experts) + ops(cats.RMSNORM, cats.GEMM, cats.SAMPLING)
    )
    assert not detect_loops([step]).found


# --- hints -----------------------------------------------------------------------------------------------


def back_to_back(loops: int, n: int) -> list[Context]:
    """Loops with no per-loop op: n × loops identical layers, like a deeper plain model."""
    return ops(cats.COPY) + layers(n * loops, False) + ops(cats.RMSNORM, cats.GEMM, cats.SAMPLING)


ONE = "(1 chain of passes in 1 step)"


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        ({}, None),
        ({"layers_per_loop": 3}, f"hint --layers-per-loop 3: 3 layers × 4 loops {ONE}"),
        ({"loops": 4}, f"hint --loops 4: 3 layers × 4 loops {ONE}"),
        ({"layers_per_loop": 5}, None),  # 12 layers do not split into loops of 5
        (
            {"loops": 3, "layers_per_loop": 4},
            f"hint --layers-per-loop 4, --loops 3: 4 layers × 3 loops {ONE}",
        ),
    ],
)
def test_hints_split_back_to_back_loops(hint, expected):
    step = back_to_back(4, 3)
    found = detect_loops([step], **hint)
    assert found.how == expected
    if expected:
        per = hint.get("layers_per_loop", 3)
        got = found.steps[0]
        assert [c.loop for c in got[1 : 1 + per * len(LAYER)]] == [0] * per * len(LAYER)
        assert got[-1].stage == "sample" and got[1].layer == "core0"


def test_hint_filters_detected_chains():
    step = ouro_step(4, 3, False)
    assert detect_loops([step], layers_per_loop=3).loops == 4
    assert not detect_loops([step], layers_per_loop=2).found
    assert not detect_loops([step], loops=3).found


def test_bad_arguments():
    with pytest.raises(ValueError, match="layers_per_loop must be >= 1"):
        detect_loops([[]], layers_per_loop=0)
    with pytest.raises(ValueError, match="one sequence per step"):
        detect_loops([[]], names=[])
    with pytest.raises(ValueError, match="one to one"):
        detect_loops([ops(cats.GEMM)], names=[["a", "b"]])
    assert detect_loops([]).steps == [] and detect_loops([[]]).steps == [[]]
