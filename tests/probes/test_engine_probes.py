"""Acceptance: RangeProbe + profile_engine on the tiny presets (CPU, fp32, greedy).

Per-token op counts are exact and explained: each op kind issues (leaf ops per call) × (calls per token),
the per-call factor measured once per op kind on a single module call, the calls written analytically
from the ModelSpec. Counts scale linearly with the loop count; probes off make no hook calls; the chrome
trace is valid JSON with the looptrace markers; the profiler's own event counts match our loader's.

Huginn/OLMo use `noise="zeros"`: the default sequential noise draws with `torch.nn.init.trunc_normal_`,
which is rejection sampling on torch >= 2.12 (data-dependent op count and a host read per draw).
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
import torch
from torch.nn.modules import module as nn_module

from looptrace.engine.config import EngineConfig, ExitConfig
from looptrace.engine.hooks import HookDispatcher
from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.model_config import PRESETS as PRESETS_BY_NAME
from looptrace.engine.request import Request, SamplingParams
from looptrace.probes import ranges
from looptrace.probes.classify import leaf_cpu_ops
from looptrace.probes.events import trace_from_profiler
from looptrace.probes.ranges import RangeProbe
from looptrace.probes.session import ProfileConfig, default_decode_steps, profile_engine

PRESETS = ("ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny")
PROMPT_LEN = 16
HOOK_METHODS = ("step_begin", "step_end", "request_event", "loop_begin", "loop_end", "loop_hidden")


def make_engine(preset: str, loops: int | None = None) -> LLMEngine:
    return LLMEngine.from_preset(
        preset, EngineConfig(noise="zeros", exit=ExitConfig(max_loops=loops)), device="cpu"
    )


# --- analytic calls per token (decode: one prelude, L recurrent and one coda step per token) -------------


def calls_per_token(spec, loops: int) -> dict[str, int]:
    P, C, D, L = spec.n_prelude, spec.n_core, spec.n_coda, loops
    if spec.family == "ouro":  # every layer looped; the final norm closes each loop; gate after each loop
        return {
            "norm": 4 * C * L + L,
            "rope": C * L,
            "attention": C * L,
            "paged_attention": C * L,
            "mlp": C * L,
            "gate": L,
            "readback": L,  # the gate policy (base default) reads the gate logits back every loop
            "metadata": L,
            "embed": 1,
            "head": 1,
            "sample": 1,
        }
    blocks = P + C * L + D  # prelude layers once, core layers every loop, coda layers once
    block_norms = 4 if spec.family == "huginn" else 2  # sandwich (norm_1..4) vs OLMo post-norms
    qk_norms = 2 if spec.qk_norm else 0  # OLMo: q_norm + k_norm in every attention
    ln_f = 2 if spec.family == "huginn" else 1  # Huginn: ln_f -> coda -> ln_f; OLMo: coda -> ln_f
    return {
        "norm": (block_norms + qk_norms) * blocks + ln_f,
        "rope": blocks,
        "attention": blocks,
        "paged_attention": blocks,
        "mlp": blocks,
        "adapter": L,
        "metadata": L + 2,  # one per traversal: every loop, the prelude layers, the coda layers
        "state_init": 1,
        "embed": 1,
        "head": 1,
        "sample": 1,
    }


def other_per_token(spec, loops: int, leaf: dict[str, int], async_gate: bool = False) -> dict[str, int]:
    """Kernels outside every lt.op range, by layer role: 2 residual adds per block, plus the runner's
    carried-state glue outside layers (prelude: state/inject writes, Huginn's embed scale; each loop:
    state/inject reads, Raven's cat before the adapter, state write, and with the async gate readback the
    pre-loop state kept for a rollback; coda: state read)."""
    L = loops
    out = {"core": 2 * leaf["add"] * spec.n_core * L}
    rd, wr = leaf["index_select"], leaf["index_copy_"]
    if spec.family == "ouro":
        out["-"] = wr + L * (rd + wr + (wr if async_gate else 0)) + rd
        return out
    out |= {"prelude": 2 * leaf["add"] * spec.n_prelude, "coda": 2 * leaf["add"] * spec.n_coda}
    scale = leaf["mul"] if spec.embed_scale != 1.0 else 0
    out["-"] = scale + 2 * wr + L * (2 * rd + leaf["cat"] + wr) + rd
    return out


# --- independent measurement: leaf ATen ops of one module call ------------------------------------------


def _leaves_per_range(events, names) -> dict[str, int]:
    leaves = sorted(e.ts for e in leaf_cpu_ops(events))
    return {
        e.name: bisect.bisect_left(leaves, e.end) - bisect.bisect_left(leaves, e.ts)
        for e in events
        if e.cat == "user_annotation" and e.name in names
    }


def measure_leaf_ops(preset: str) -> dict[str, int]:
    """Each op kind called once at decode shapes (1 row) on a fresh engine's modules, each call in its own
    record_function range of one torch.profiler session; attention's own count excludes its children."""
    eng = make_engine(preset)
    spec, model, runner = eng.spec, eng.model, eng.runner
    h, nh, kvh, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    first: dict[str, torch.nn.Module] = {}
    for _, m in eng.observable_modules():
        first.setdefault(getattr(m, "op_kind", None), m)
    attn, rope = first["attention"], model.rope
    pos, bs = PROMPT_LEN + 1, eng.cfg.kv.block_size
    raw = torch.tensor([[0, pos, pos + 1, 1, pos % bs, 7, 0, 1]])  # slot pos ctx block offset token table
    meta = lambda: runner.metadata(raw, rope, eng.dtype, eng.pool.k_cache, eng.pool.v_cache)
    ctx = meta()
    # inputs are made before profiling: a call's range holds nothing but the call
    x, q, k, v = torch.randn(1, h), torch.randn(1, nh, d), torch.randn(1, kvh, d), torch.randn(1, kvh, d)
    x2, qw, kw, logits = (
        torch.randn(1, 2 * h),
        torch.randn(1, nh * d),
        torch.randn(1, kvh * d),
        torch.randn(1, spec.vocab_size),
    )
    req, slots = Request([1], SamplingParams()), torch.tensor([0])
    calls = {
        "norm": lambda: first["norm"](x),
        "rope": lambda: rope(q, k, ctx.cos, ctx.sin),
        "paged_attention": lambda: attn.paged(q, k, v, ctx),
        "attention": lambda: attn(x, ctx),
        "mlp": lambda: first["mlp"](x),
        "metadata": meta,
        "embed": lambda: first["embed"](raw[:, 5]),
        "head": lambda: first["head"](x),
        "sample": lambda: runner.ops.sampler(logits, [req]),
        # engine glue outside op ranges
        "add": lambda: x + x,
        "mul": lambda: x * 2.0,
        "cat": lambda: torch.cat([x, x], dim=-1),
        "index_select": lambda: runner.state_pool.index_select(0, slots),
        "index_copy_": lambda: runner.state_pool.index_copy_(0, slots, x),
    }
    if spec.family == "ouro":
        calls["gate"] = lambda: first["gate"](x)
        calls["readback"] = lambda: runner.ops.gate_readback(x[:, 0])
    else:
        calls["adapter"] = lambda: first["adapter"](x2)
        calls["state_init"] = lambda: runner.ops.state_init(x, [(req, 1)])
    if spec.qk_norm:
        calls["q_norm"] = lambda: attn.q_norm(qw)
        calls["k_norm"] = lambda: attn.k_norm(kw)
    with torch.inference_mode():
        for fn in calls.values():  # warm-up: lazy initialisation stays out of the measurement
            fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for name, fn in calls.items():
                with torch.profiler.record_function(f"measure/{name}"):
                    fn()
    counts = {
        n.removeprefix("measure/"): c
        for n, c in _leaves_per_range(
            trace_from_profiler(prof).events, {f"measure/{n}" for n in calls}
        ).items()
    }
    children = ("rope", "paged_attention", "q_norm", "k_norm")  # op ranges nested inside attention
    counts["attention"] -= sum(counts.get(c, 0) for c in children)
    return counts


def per_call_counts(trace, window: str) -> dict[str, Counter]:
    """Op kind -> Counter(leaf ops issued by one lt.op range instance, innermost range owning its leaves)."""
    win = next(e for e in trace.events if e.name == window)
    same = lambda e: (e.pid, e.tid) == (win.pid, win.tid)
    leaves = sorted(e.ts for e in leaf_cpu_ops(trace.events) if same(e))
    inside = lambda r: bisect.bisect_left(leaves, r.end) - bisect.bisect_left(leaves, r.ts)
    ops = sorted(
        (
            e
            for e in trace.events
            if e.cat == "user_annotation"
            and e.name.startswith("lt.op/")
            and same(e)
            and win.ts <= e.ts < win.end
        ),
        key=lambda e: (e.ts, -e.dur),
    )
    own = {id(r): inside(r) for r in ops}
    stack: list = []
    for r in ops:
        while stack and stack[-1].end <= r.ts:
            stack.pop()
        if stack:
            own[id(stack[-1])] -= inside(r)
        stack.append(r)
    out: dict[str, Counter] = defaultdict(Counter)
    for r in ops:
        out[r.name.removeprefix("lt.op/")][own[id(r)]] += 1
    return out


# --- shared runs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "trace.json"


@pytest.fixture(scope="module")
def profiled(trace_file):
    """(preset, loops) -> (engine, ProfileResult). Ouro at its default depth runs the default window and
    writes the chrome trace; every other run is a 2-token decode window."""
    cache: dict = {}

    def get(preset: str, loops: int | None = None):
        if (preset, loops) not in cache:
            eng = make_engine(preset, loops)
            default = preset == "ouro-tiny" and loops is None
            steps = None if default else 2 * (eng.max_loops + 2)
            cfg = ProfileConfig(concurrency=1, prompt_len=PROMPT_LEN, decode_steps=steps, level="op")
            cache[preset, loops] = eng, profile_engine(eng, cfg, trace_path=trace_file if default else None)
        return cache[preset, loops]

    return get


@pytest.fixture(scope="module")
def leaf_ops():
    cache: dict = {}

    def get(preset: str) -> dict[str, int]:
        if preset not in cache:
            cache[preset] = measure_leaf_ops(preset)
        return cache[preset]

    return get


def groups(stats) -> dict:
    return {s.key if len(s.key) > 1 else s.key[0]: s.kernels for s in stats}


# --- 1. analytic counts per family ----------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_op_counts_match_analytic_formula(preset, profiled, leaf_ops):
    eng, result = profiled(preset)
    leaf = leaf_ops(preset)
    analysis, tokens = result.analyses["decode"], result.windows["decode"].tokens
    calls = calls_per_token(eng.spec, eng.max_loops)
    by_op = groups(analysis.breakdown.by_op)
    # an op with no leaf ATen op (the gate readback on CPU: a host list of a host tensor) owns no kernel
    assert set(by_op) == {op for op in calls if leaf[op]} | {"other"}
    for op, n in calls.items():
        assert by_op.get(op, 0) == leaf[op] * n * tokens, op
    # every lt.op range instance of a kind issues the same number of leaf ops (the measured one)
    instances = per_call_counts(result.trace, "lt.window/decode")
    assert instances == {op: Counter({leaf[op]: n * tokens}) for op, n in calls.items()}
    # what no op range owns: residual adds in layers, the runner's carried-state glue outside them
    other = {role: n for (op, role), n in groups(analysis.breakdown.by_op_role).items() if op == "other"}
    expected = other_per_token(eng.spec, eng.max_loops, leaf, eng.async_gate)
    assert other == {role: n * tokens for role, n in expected.items()}
    assert sum(by_op.values()) == analysis.counters.kernels
    assert not any("avg" in f for f in analysis.breakdown.formulas)  # every op factors evenly


def test_ouro_norm_formula_line(profiled, leaf_ops):
    eng, result = profiled("ouro-tiny")
    k, C, L = leaf_ops("ouro-tiny")["norm"], eng.spec.n_core, eng.max_loops
    analysis = result.analyses["decode"]
    per_token = k * (4 * C * L + L)
    share = 100 * per_token * analysis.counters.tokens / analysis.counters.kernels
    want = (
        f"norm: {k} kernels × 4 norm calls × {C} layers × {L} loops"
        f" + {k} kernels × 1 norm call × {L} loops = {per_token:,} kernels/token ({share:.0f} %)"
    )
    assert (C, L) == (4, 4)
    assert want in analysis.breakdown.formulas


# --- 2. linear scaling with loops -----------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "loops"), [("ouro-tiny", 2), ("huginn-tiny", 4)])
def test_counts_scale_linearly_with_loops(preset, loops, profiled):
    per_token = {}
    for n in (loops, 2 * loops):
        eng, result = profiled(preset, None if n == PRESETS_BY_NAME[preset].default_loops else n)
        assert eng.max_loops == n
        a = result.analyses["decode"]
        per_token[n] = {
            key: Fraction(v, a.counters.tokens)
            for stats in (a.breakdown.by_stage, a.breakdown.by_op_role)
            for key, v in groups(stats).items()
        }
        per_token[n]["total"] = Fraction(a.counters.kernels, a.counters.tokens)
    short, long = per_token[loops], per_token[2 * loops]
    assert set(short) == set(long)
    in_loop = {k for k in short if k == "recurrent" or k[1:] == ("core",)}
    in_loop |= {("gate", "-"), ("adapter", "-")} & set(short)
    outside = {"prelude", "coda", "sample"} | {k for k in short if k[1:] in {("prelude",), ("coda",)}}
    outside |= {(op, "-") for op in ("embed", "head", "sample", "state_init")} & set(short)
    assert len(in_loop) >= 6 and len(outside) >= 5
    for key in in_loop:
        assert long[key] == 2 * short[key], key
    for key in outside:
        assert long[key] == short[key], key
    assert long["total"] - short["total"] == short["recurrent"]  # total = overhead + loops × per-loop cost


# --- 3. probes off costs nothing ------------------------------------------------------------------------


@pytest.fixture
def hook_calls(monkeypatch):
    calls: Counter = Counter()
    for name in HOOK_METHODS:
        original = getattr(HookDispatcher, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(HookDispatcher, name, counting)
    return calls


def hooked(eng: LLMEngine) -> list[str]:
    return [n for n, m in eng.observable_modules() if m._forward_hooks or m._forward_pre_hooks]


@pytest.mark.parametrize("preset", PRESETS)
def test_probes_off_make_no_hook_calls(preset, hook_calls):
    eng = make_engine(preset)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    eng.generate(prompts, SamplingParams(max_tokens=3))
    assert sum(hook_calls.values()) == 0
    assert hooked(eng) == []
    assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks

    probe = RangeProbe("op").attach(eng)
    wanted = {
        n for n, m in eng.observable_modules() if getattr(m, "op_kind", None) in (*ranges.OP_KINDS, "layer")
    }
    assert set(hooked(eng)) == wanted and len(wanted) > 10
    assert all(
        len(m._forward_hooks) == len(m._forward_pre_hooks) == 1
        for n, m in eng.observable_modules()
        if n in wanted
    )
    steps0, stages0 = eng.stats.steps, dict(eng.stats.steps_by_stage)
    eng.generate(prompts, SamplingParams(max_tokens=3))
    steps = eng.stats.steps - steps0
    stage = lambda s: eng.stats.steps_by_stage.get(s, 0) - stages0.get(s, 0)
    loops = eng.max_loops * stage("prefill") + stage("recurrent")
    events = len(prompts) * (3 + 3)  # arrived, admitted, first_token, 2 × token, finished
    # no loop_hidden: RangeProbe does not want hidden states
    assert dict(hook_calls) == {
        "step_begin": steps,
        "step_end": steps,
        "loop_begin": loops,
        "loop_end": loops,
        "request_event": events,
    }
    probe.detach()
    assert hooked(eng) == [] and not eng.hooks.active and eng.hooks.observers == []
    hook_calls.clear()
    eng.generate(prompts[:1], SamplingParams(max_tokens=2))
    assert sum(hook_calls.values()) == 0


# --- 4. chrome trace ------------------------------------------------------------------------------------


def test_chrome_trace_is_valid_json_with_markers(profiled, trace_file):
    eng, _ = profiled("ouro-tiny")
    with trace_file.open() as fh:
        data = json.load(fh)
    assert isinstance(data["traceEvents"], list)
    names = {e["name"] for e in data["traceEvents"] if e.get("cat") == "user_annotation"}
    for want in (
        "lt.window/decode",
        "lt.window/prefill",
        "lt.stage/recurrent",
        "lt.loop/0",
        "lt.layer/core0",
        "lt.op/norm",
    ):
        assert want in names, want
    assert any(n.startswith("lt.step#") for n in names)
    assert {n for n in names if n.startswith("lt.stage/")} == {
        f"lt.stage/{s}" for s in ("prefill", "prelude", "recurrent", "coda", "sample")
    }
    assert {n for n in names if n.startswith("lt.op/")} == {
        f"lt.op/{op}" for op in calls_per_token(eng.spec, 4)
    }
    assert {n for n in names if n.startswith(("lt.loop/", "lt.layer/"))} == {
        *(f"lt.loop/{i}" for i in range(4)),
        *(f"lt.layer/core{i}" for i in range(4)),
    }


# --- 5. cross-check: profiler's own event list vs our loader --------------------------------------------


def test_raw_counts_match_trace_counts(profiled):
    _, result = profiled("ouro-tiny")
    assert result.raw_counts == result.trace_counts
    assert result.raw_counts["cpu_op"] > 1000 and result.raw_counts["user_annotation"] > 100


# --- 6. engine window counters --------------------------------------------------------------------------


def test_window_counters(profiled):
    eng, result = profiled("ouro-tiny")
    decode, prefill = result.windows["decode"], result.windows["prefill"]
    per_token = eng.max_loops + 2  # prelude + 4 recurrent + coda
    assert per_token == 6
    tokens = default_decode_steps(eng, 1) // per_token
    assert (decode.tokens, decode.steps, decode.submissions) == (tokens, 6 * tokens, 6 * tokens)
    assert decode.steps_by_stage == {"prelude": tokens, "recurrent": eng.max_loops * tokens, "coda": tokens}
    assert (prefill.tokens, prefill.steps, prefill.submissions) == (PROMPT_LEN, 2, 2)
    assert prefill.steps_by_stage == {"prefill": 1, "coda": 1}
    assert decode.graph == prefill.graph == {}
    a = result.analyses["decode"].counters
    assert (a.tokens, a.steps, a.submissions, a.mode) == (tokens, decode.steps, decode.submissions, "cpu")


# --- decode windows of the faster recipes ----------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, per_token",
    [({}, 6), ({"loop_fusion": True}, 3), ({"loop_fusion": True, "whole_token": True}, 1)],
)
def test_decode_window_is_sized_by_the_recipes_steps_per_token(settings, per_token):
    # The window was sized for loops + 2 steps per token; under whole-token decode the requests finished
    # before it ended and the window stepped an idle engine forever (`profile --recipe exactloop` hung on
    # the H200 and on CPU).
    from looptrace.engine.config import SchedulerConfig
    from looptrace.probes import session

    eng = LLMEngine.from_preset(
        "ouro-tiny",
        EngineConfig(noise="zeros", scheduler=SchedulerConfig(**settings)),
        device=torch.device("cpu"),
    )
    assert session.steps_per_token(eng) == per_token
    result = profile_engine(eng, ProfileConfig(concurrency=1, prompt_len=PROMPT_LEN, level="step"))
    window = result.windows["decode"]
    assert window.tokens == 8 and window.steps == 8 * per_token


def test_decode_window_ends_when_every_request_has_finished(monkeypatch):
    # A window planned longer than the requests last (here: sized for 50 steps per token) stops at the
    # step where the last request finishes instead of stepping an idle engine.
    from looptrace.probes import session

    eng = make_engine("ouro-tiny", None)
    monkeypatch.setattr(session, "steps_per_token", lambda engine: 50)
    result = profile_engine(eng, ProfileConfig(concurrency=1, prompt_len=PROMPT_LEN, level="step"))
    window = result.windows["decode"]
    assert 0 < window.tokens < window.steps < 400 and not eng.has_unfinished_requests()
