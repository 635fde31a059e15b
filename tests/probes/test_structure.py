"""Steps, tokens and loop structure of looped models decoded by their public Hugging Face code
(`../shared/traces/hf_looped/`, its README gives the truth): no annotations, no module events; steps
from the forwards (`forwards`), loops from the op pattern of each forward (`loops`), summarised in the
report's `structure` (`structure`). Plus `structure_of` on its own.

Huginn-0125 on an H100 (61k kernels): 1 prefill forward of 48 prompt tokens, 7 decode forwards; prelude
2 layers, core 4 layers × 32 loops, coda 2. A tiny Ouro on CPU (leaf ATen ops): 1 prefill of 12, 3
decode; 2 layers × 4 loops, no prelude or coda.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from looptrace.cli.trace_cmd import trace_app
from looptrace.probes import counters as C
from looptrace.probes.compare import token_unit
from looptrace.probes.context import NONE, Context
from looptrace.probes.events import Trace, load_chrome_trace
from looptrace.probes.report import render_report, to_dict
from looptrace.probes.structure import Structure, structure_of

HF_LOOPED = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "hf_looped"
HUGINN = HF_LOOPED / "huginn-0125_h100_public_decode.json.gz"
OURO = HF_LOOPED / "ouro-tiny_cpu_public_decode.json.gz"
needs_traces = pytest.mark.skipif(not HF_LOOPED.is_dir(), reason=f"shared traces not present at {HF_LOOPED}")

CLI = typer.Typer()
CLI.add_typer(trace_app, name="trace")
runner = CliRunner()

# README truth: (prefill steps, prompt tokens), (decode steps, output tokens), structure.
TRUTH = {
    "huginn": ((1, 48), (7, 7), (2, 4, 32, 2)),
    "ouro": ((1, 12), (3, 3), (0, 2, 4, 0)),
}


@pytest.fixture(scope="module")
def loaded():
    """name -> the loaded trace (Huginn's takes seconds: loaded once per module)."""
    cache: dict[str, Trace] = {}

    def get(name: str) -> Trace:
        if name not in cache:
            cache[name] = load_chrome_trace(HUGINN if name == "huginn" else OURO)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def analysed(loaded):
    cache: dict[str, C.Analysis] = {}

    def get(name: str) -> C.Analysis:
        if name not in cache:
            cache[name] = C.analyze(loaded(name))
        return cache[name]

    return get


@needs_traces
@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_steps_and_tokens_from_the_forwards(name, analysed):
    a = analysed(name)
    (prefill_steps, prompt), (decode_steps, output), _ = TRUTH[name]
    phases = {p.phase: (p.steps, p.tokens, p.unit) for p in a.phases}
    assert phases == {
        "prefill": (prefill_steps, prompt, "prompt token"),
        "decode": (decode_steps, output, "output token"),
    }
    c = a.counters
    assert (c.tokens, c.steps, a.step_marker) == (output, decode_steps, "forward")
    assert c.window == f"decode forwards ×{decode_steps} (no lt.window/decode range)"
    assert a.tokens_source.startswith(f"forward passes (no step annotations): {output} output tokens")
    # The window is the decode forwards: per-token values are decode per output token, the phase row's.
    decode = next(p for p in a.phases if p.phase == "decode")
    assert c.gpu_us == pytest.approx(decode.gpu_us)


@needs_traces
@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_structure_of_the_loops(name, analysed):
    a = analysed(name)
    prelude, per_loop, loops, coda = TRUTH[name][2]
    s = a.structure
    assert (s.prelude_layers, s.layers_per_loop, s.loops, s.coda_layers, s.source) == (
        prelude, per_loop, loops, coda, "inferred",
    )  # fmt: skip
    assert s.coverage >= 0.95
    decode_steps = TRUTH[name][1][0]
    assert f"{per_loop} layers × {loops} loops ({decode_steps} chains of passes in {decode_steps} steps)" in (
        " ".join(a.notes)
    )
    # Every loop runs the same kernels in every forward: per decode token, each (layer, loop) cell of the
    # core has the same kernels and every core layer runs in every loop.
    cells = Counter()
    for g in a.breakdown.by_op_layer_loop:
        _, layer, loop = g.key
        if layer.startswith("core"):
            cells[(layer, loop)] += g.kernels
    assert len(cells) == per_loop * loops and len(set(cells.values())) == 1
    assert next(iter(cells.values())) % decode_steps == 0
    # Prelude and coda layers run outside the loops; the per-loop ops (Huginn's adapter, Ouro's loop
    # norm and exit gate) are in a loop but no layer.
    layers = {g.key[1] for g in a.breakdown.by_op_layer_loop if g.key[2] == NONE and g.key[1] != NONE}
    assert layers == {f"prelude{i}" for i in range(prelude)} | {f"coda{i}" for i in range(coda)}
    per_loop_ops = sum(
        g.kernels for g in a.breakdown.by_op_layer_loop if g.key[1] == NONE and g.key[2] != NONE
    )
    assert per_loop_ops > 0 and per_loop_ops % (loops * decode_steps) == 0


FIXTURES = Path(__file__).parent / "fixtures"  # see its README: public Ouro code, recorded on CPU


@pytest.mark.parametrize(
    ("name", "phases", "structure"),
    [
        # Two sequences per forward: the prefill's rows are 2 × 12 prompt tokens, each decode forward's 2.
        ("ouro-l2r3-b2", {"prefill": (1, 24), "decode": (2, 4)}, (0, 2, 3, 0, "inferred")),
        # with_modules / with_stack: module events open the forwards and give the layers.
        ("ouro-l2r3-modules", {"prefill": (1, 12), "decode": (1, 1)}, (0, 2, 3, 0, "module paths")),
        # Huginn's coda layers on CPU: the second runs after ops the first lacks (a block of its own), and
        # its layers' input ops differ from the core's by one: still coda0, coda1.
        ("huginn-tiny", {"prefill": (1, 10), "decode": (1, 1)}, (2, 4, 3, 2, "inferred")),
    ],
)
def test_public_code_traces(name, phases, structure):
    a = C.analyze(load_chrome_trace(FIXTURES / f"{name}_cpu_public_decode.json.gz"))
    assert {p.phase: (p.steps, p.tokens) for p in a.phases} == phases
    assert a.counters.tokens == phases["decode"][1]
    s = a.structure
    assert (s.prelude_layers, s.layers_per_loop, s.loops, s.coda_layers, s.source) == structure
    assert s.coverage >= 0.95


@needs_traces
def test_huginn_hints_keep_the_structure(loaded, analysed):
    hinted = C.analyze(loaded("huginn"), loops=32, layers_per_loop=4)
    assert hinted.structure == analysed("huginn").structure
    assert hinted.breakdown.by_op_layer_loop == analysed("huginn").breakdown.by_op_layer_loop


@needs_traces
def test_cli_json_and_table_report_the_structure():
    result = runner.invoke(CLI, ["trace", "analyze", str(OURO), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {k: v for k, v in data["structure"].items() if k != "coverage"} == {
        "prelude_layers": 0, "layers_per_loop": 2, "loops": 4, "coda_layers": 0, "source": "inferred",
    }  # fmt: skip
    assert (data["tokens"], data["steps"], token_unit(data)) == (3, 3, "output token")
    assert [(p["phase"], p["steps"], p["tokens"]) for p in data["phases"]] == [
        ("prefill", 1, 12),
        ("decode", 3, 3),
    ]
    result = runner.invoke(CLI, ["trace", "analyze", str(OURO), "--window", "prefill", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["tokens"], data["window"]) == (12, "prefill forwards ×1 (no lt.window/prefill range)")
    assert data["structure"]["loops"] == 4
    assert token_unit(data) == "prompt token"  # the window is the prefill forwards (phases cover both)
    buf = io.StringIO()
    render_report(C.analyze(load_chrome_trace(OURO)), {}, Console(file=buf, width=160, color_system=None))
    assert "Loop structure: 2 layers × 4 loops (inferred; " in buf.getvalue()


@needs_traces
def test_plain_models_have_no_structure():
    """The other shared traces (vLLM, SGLang, Hugging Face Qwen): no loops, structure null."""
    traces = HF_LOOPED.parent
    for path in (
        traces / "h100_qwen1.5_0.5b" / "trace.json.gz",
        traces / "sglang_prefilldecode" / "sglang_Qwen3-8B_prefilldecode.json.gz",
        traces / "vllm_decode_full" / "graph_execution.json.gz",
    ):
        a = C.analyze(load_chrome_trace(path))
        assert a.structure is None and to_dict(a, {})["structure"] is None


# --- structure_of --------------------------------------------------------------------------------------


def test_structure_of_contexts():
    prelude = [Context("prelude", None, "prelude0", "prelude")]
    loops = [Context("recurrent", r, f"core{j}", "core") for r in range(3) for j in range(2)]
    between = [Context("recurrent", None, None)]  # between loops: recurrent, no loop
    coda = [Context("coda", None, "coda0", "coda"), Context("sample")]
    contexts = prelude + loops + between + coda + [Context()]
    durations = [1.0] * len(contexts)
    s = structure_of(contexts, durations, "ranges")
    assert s == Structure(1, 2, 3, 1, "ranges", coverage=(len(contexts) - 2) / len(contexts))
    assert structure_of(prelude + coda, [1.0, 1.0, 1.0], "inferred") is None
