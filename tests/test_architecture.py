"""The house's rules, checked on the source with `ast` (bench/house_metrics.py): no import circles, no
upward arrows between floors, no `getattr(` into engine objects and no reads of an engine's config, request
records or parts outside engine/, an engine that imports no client package, no engine built outside
build.py and engine/, no function-level import without its `# deferred:` reason, and a torch-free
`import looptrace.engine` (in a child process); and in the engine: the plan is the only reader of the
`kernels` settings, model forwards test no kernel switches (only their variants' fallbacks), and no launch
flag is a module global; in the kernel wing: no kernel file takes a private name of another, and
`kernels/__init__.py` forwards nothing; the engine and the runner stay small, and a static walk from
`LLMEngine.step` reaches the runner's stages.
LOOPTRACE_HOUSE_ROOT=DIR checks another checkout instead of this one."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_house_metrics() -> ModuleType:
    """bench/ is not a package: load the analysis by path (registered first, for its dataclasses)."""
    spec = importlib.util.spec_from_file_location("house_metrics", REPO / "bench" / "house_metrics.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hm = _load_house_metrics()


@pytest.fixture(scope="module")
def house():
    root = Path(os.environ.get("LOOPTRACE_HOUSE_ROOT", REPO))
    modules = hm.load_modules(root)
    edges = hm.import_edges(modules)
    floors, _ = hm.module_floors(modules, edges)
    return modules, edges, floors


def _listing(rows: list[dict]) -> str:
    return "\n".join(str(row) for row in rows)


def test_no_import_circles(house):
    modules, edges, _ = house
    circles = hm.import_circles(modules, edges)
    assert circles == [], "import circles:\n" + _listing(circles)


def test_no_upward_arrows(house):
    _, edges, floors = house
    arrows = hm.upward_arrows(edges, floors)
    assert arrows == [], "imports from a lower floor to a higher one:\n" + _listing(arrows)


def test_no_getattr_into_engine_objects_outside_engine(house):
    modules, _, _ = house
    hits = hm.getattr_hits(modules)
    assert hits == [], "getattr( into engine objects:\n" + _listing(hits)


def test_only_build_constructs_engines(house):
    modules, _, _ = house
    hits = hm.engine_constructions(modules)
    assert hits == [], "engines constructed outside build.py and engine/:\n" + _listing(hits)


def test_no_reaches_into_engine_internals_outside_engine(house):
    """Clients read `engine.snapshot()` (limits, queues, requests) and `engine.request_view(id)`, not the
    engine's config, request records, runner, block manager or private attributes."""
    modules, _, _ = house
    reaches = hm.engine_reaches(modules)
    assert reaches == [], "reaches into engine internals:\n" + _listing(reaches)


def test_engine_imports_no_client_package(house):
    modules, edges, _ = house
    imports = hm.client_imports_of_engine(modules, edges)
    assert imports == [], "the engine imports client code:\n" + _listing(imports)


# Family constants of the model architecture (Huginn norms before its coda, OLMo does not): not switches.
ARCHITECTURE_CONSTANTS = {"norm_before_coda"}


def test_only_the_plan_reads_the_kernel_settings(house):
    modules, _, _ = house
    reads = [h for h in hm.kernel_setting_reads(modules) if h["rel"] != hm.PLAN_FILE]
    assert reads == [], "reads of cfg.kernels outside engine/plan.py:\n" + _listing(reads)


def test_model_forwards_test_no_kernel_switches(house):
    modules, _, _ = house
    sites = hm.toggle_branch_sites(modules)["toggles"]
    switches = [h for h in sites if h["reason"].removeprefix("reads self.") not in ARCHITECTURE_CONSTANTS]
    assert switches == [], "switch tests in engine/models or layers.py:\n" + _listing(switches)


def test_no_launch_flag_is_a_module_global(house):
    modules, _, _ = house
    flags = [h for h in hm.launch_globals(modules) if "launch_mode.py" in h["where"]]
    assert flags == [], "module globals rebound in launch_mode.py:\n" + _listing(flags)


def test_kernel_files_take_no_private_names_of_each_other(house):
    modules, _, _ = house
    hits = hm.private_kernel_imports(modules)
    assert hits == [], "private names taken across engine/kernels/ files:\n" + _listing(hits)


def test_the_kernels_package_forwards_nothing(house):
    """Callers import the kernel module they use; the package's own module holds no forwarder to one."""
    modules, _, _ = house
    forwarders = hm.kernel_wing(modules)["forwarders"]
    assert forwarders == [], f"forwarders in kernels/__init__.py: {forwarders}"


# The engine reads as a loop: a short step over small parts (bench/house_metrics.py measured 59 methods and
# a 33-line step before the lifecycle and the decode modes moved out; `request_view`, the public read of
# one request's outputs, took the place of num_running/num_waiting, which `snapshot().queues` covers).
MAX_ENGINE_METHODS = 25
MAX_STEP_LINES = 25


def test_the_engine_reads_as_a_loop(house):
    modules, _, _ = house
    size = hm.class_sizes(modules)["LLMEngine"]
    assert size["methods"] <= MAX_ENGINE_METHODS and size["step_lines"] <= MAX_STEP_LINES, size


# The runner keeps the stage entry points and delegates its roles (prefill paths, traversals, graphs) to
# collaborators in runner_*.py (bench/house_metrics.py measured 39 methods in 613 lines before the split).
MAX_RUNNER_METHODS = 25
RUNNER_STAGES = ("prefill", "prelude", "recurrent", "recurrent_fused", "whole_token", "coda")
RUNNER_STAGES += ("finalize_exits", "rollback")


def test_the_runner_keeps_to_its_stage_entry_points(house):
    modules, _, _ = house
    size = hm.class_sizes(modules)["ModelRunner"]
    assert size["methods"] <= MAX_RUNNER_METHODS, size


def _classes(modules, rel: str) -> dict[str, ast.ClassDef]:
    tree = next(m.tree for m in modules.values() if m.rel == rel)
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _self_calls(function: ast.FunctionDef) -> set[tuple[str, ...]]:
    """Calls in `function` of `self.<method>` and `self.<attr>.<method>` (`self.<attr>[k].<method>` too)."""
    out = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value.value if isinstance(node.func.value, ast.Subscript) else node.func.value
            if isinstance(owner, ast.Name) and owner.id == "self":
                out.add((node.func.attr,))
            elif (
                isinstance(owner, ast.Attribute)
                and isinstance(owner.value, ast.Name)
                and owner.value.id == "self"
            ):
                out.add((owner.attr, node.func.attr))
    return out


def test_a_static_walk_from_the_engine_step_reaches_the_runner_stages(house):
    """LLMEngine.step calls its stage runs (`self.stage_runs[...]`, `self.decode`): every method of that
    name in decode_modes.py, and the `self.<method>` they call, is followed to its `self.runner.<stage>`."""
    modules, _, _ = house
    step = next(
        f
        for f in _classes(modules, "looptrace/engine/llm_engine.py")["LLMEngine"].body
        if getattr(f, "name", "") == "step"
    )
    stage_runs = {call[-1] for call in _self_calls(step) if call[0] in ("stage_runs", "decode")}
    functions = [f for c in _classes(modules, "looptrace/engine/decode_modes.py").values() for f in c.body]
    functions = [f for f in functions if isinstance(f, ast.FunctionDef)]
    reached, todo, seen = set(), set(stage_runs), set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for call in set().union(*(_self_calls(f) for f in functions if f.name == name)):
            if call[0] == "runner":
                reached.add(call[1])
            elif len(call) == 1 and call[0] not in seen:
                todo.add(call[0])
    runner = _classes(modules, "looptrace/engine/runner.py")["ModelRunner"]
    defined = {f.name for f in runner.body if isinstance(f, ast.FunctionDef)}
    assert stage_runs >= {"run", "settle", "drain"} and sorted(reached) == sorted(RUNNER_STAGES)
    assert set(RUNNER_STAGES) <= defined


def test_the_request_lifecycle_is_a_table_of_handlers(house):
    modules, _, _ = house
    switches = [h for h in hm.event_switches(modules) if h["events"] > 1]
    assert not switches, "\n".join(
        f"{h['where']}: {h['function']} branches on {h['events']} events" for h in switches
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "looptrace" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_rules_catch_what_they_name(tmp_path):
    """On a made-up package: one circle (lazy), one upward arrow (engine -> probes, also a client import),
    one kernel importing layers, two getattr hits (an engine object; a request attribute) and one
    caught exception that is not an engine object."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/layers.py": "",
            "engine/request.py": "class Request:\n    def __init__(self):\n        self.loops_done = 0\n",
            "engine/kernels/__init__.py": "from looptrace.engine import layers\n",
            "engine/runner.py": "def f():\n    from looptrace.probes import hooks\n",
            "probes/__init__.py": "",
            "probes/hooks.py": "import looptrace.probes.steps\n",
            "probes/steps.py": "def g():\n    import looptrace.probes.hooks\n",
            "serve/app.py": (
                "def h(engine, r):\n"
                "    try:\n        pass\n    except ValueError as e:\n        getattr(e, 'pos', 0)\n"
                "    return getattr(engine, 'stats', None), getattr(r, 'loops_done', 0)\n"
            ),
        },
    )
    modules = hm.load_modules(tmp_path)
    edges = hm.import_edges(modules)
    floors, _ = hm.module_floors(modules, edges)
    circles = hm.import_circles(modules, edges)
    assert [c["modules"] for c in circles] == [["looptrace.probes.hooks", "looptrace.probes.steps"]]
    assert not circles[0]["survives_eager_only"]
    arrows = {(a["src"], a["dst"]) for a in hm.upward_arrows(edges, floors)}
    assert arrows == {
        ("looptrace.engine.runner", "looptrace.probes.hooks"),
        ("looptrace.engine.kernels", "looptrace.engine.layers"),
    }
    assert [e["dst"] for e in hm.client_imports_of_engine(modules, edges)] == ["looptrace.probes.hooks"]
    hits = [h["where"] for h in hm.getattr_hits(modules)]
    assert hits == ["looptrace/serve/app.py:6", "looptrace/serve/app.py:6"]


def test_the_construction_rule_catches_an_engine_built_outside_build(tmp_path):
    """On a made-up package: an engine built by a client (directly and through a constructor) is caught;
    one built by build.py or inside engine/ is not."""
    build = (
        "from looptrace.engine.llm_engine import LLMEngine\n\n\n"
        "def build(net, cfg):\n    return LLMEngine(net, cfg)\n"
    )
    engine = "class LLMEngine:\n    @classmethod\n    def from_preset(cls, n):\n        return cls()\n"
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "build.py": build,
            "engine/__init__.py": "",
            "engine/llm_engine.py": engine,
            "engine/perturb.py": "def f(LLMEngine):\n    return LLMEngine.from_spec(None)\n",
            "serve/app.py": (
                "from looptrace.engine.llm_engine import LLMEngine as E\n\n\n"
                "def make(net, cfg):\n    return LLMEngine(net, cfg), E.from_preset('ouro')\n"
            ),
        },
    )
    hits = [(h["where"], h["reason"]) for h in hm.engine_constructions(hm.load_modules(tmp_path))]
    assert hits == [("looptrace/serve/app.py:5", "LLMEngine("), ("looptrace/serve/app.py:5", ".from_preset(")]


def test_the_reach_rule_catches_config_and_request_reads(tmp_path):
    """On a made-up package: a client reading an engine's `cfg` (twice) and `requests` (two forms) is
    caught; a run record's `requests`, a recipe config's `scheduler` and the engine's own reads are not."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/llm_engine.py": "def f(self):\n    return self.cfg.scheduler, self.requests['a']\n",
            "probes/session.py": (
                "def g(engine, setup, e, record, cfg):\n"
                "    a = engine.cfg.scheduler.max_num_seqs\n"
                "    b = setup.engine.requests['x'].outputs\n"
                "    c = e.cfg\n"
                "    d = 'x' in engine.requests\n"
                "    return a, b, c, d, record.requests[0], cfg.scheduler.max_num_seqs\n"
            ),
        },
    )
    hits = [(h["where"], h["reason"]) for h in hm.engine_reaches(hm.load_modules(tmp_path))]
    assert hits == [
        ("looptrace/probes/session.py:2", "engine.cfg of an engine object"),
        ("looptrace/probes/session.py:3", "engine.requests of an engine object"),
        ("looptrace/probes/session.py:4", "e.cfg of an engine object"),
        ("looptrace/probes/session.py:5", "engine.requests of an engine object"),
    ]


def test_every_function_level_import_says_why_it_is_deferred(house):
    """An import inside a function defers a heavy or optional package (torch, Triton, FastAPI, Textual,
    plotting, the command implementations `looptrace --help` does not need); one without such a reason
    belongs at the top of its module."""
    modules, _, _ = house
    silent = [h for h in hm.function_level_imports(modules) if h["reason"] is None]
    assert silent == [], "function-level imports without a `# deferred: why` comment:\n" + _listing(silent)


def test_the_deferred_import_rule_reads_the_reason_of_a_group(tmp_path):
    """On a made-up module: a reason on the import's line, one above a group of imports (across the blank
    line between third-party and first-party ones), and an import after code that gives none; imports at
    module level are not counted."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "probes/x.py": (
                "import json\n\n\n"
                "def f():\n"
                "    import torch  # deferred: torch\n"
                "    # deferred: FastAPI\n"
                "    import fastapi\n\n"
                "    from looptrace.serve import app\n"
                "    x = 1\n"
                "    from looptrace import build\n"
                "    return torch, fastapi, app, x, build, json\n"
            ),
        },
    )
    rows = [
        (h["where"], h["module"], h["reason"]) for h in hm.function_level_imports(hm.load_modules(tmp_path))
    ]
    assert rows == [
        ("looptrace/probes/x.py:5", "torch", "torch"),
        ("looptrace/probes/x.py:7", "fastapi", "FastAPI"),
        ("looptrace/probes/x.py:9", "looptrace.serve", "FastAPI"),
        ("looptrace/probes/x.py:11", "looptrace", None),
    ]


# The engine package and its torch-free modules: what a command's option parsing may import.
TORCH_FREE_ENGINE_MODULES = (
    "looptrace.engine",
    "looptrace.engine.config",
    "looptrace.engine.model_config",
    "looptrace.engine.request",
    "looptrace.engine.hooks",
    "looptrace.engine.tokenizer",
    "looptrace.engine.budget",
)
_LOADED_HEAVY = "import sys, {module}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"


def _heavy_modules_after(statement: str) -> str:
    """The heavy packages loaded by `statement` in a fresh interpreter on this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", statement], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.parametrize("module", TORCH_FREE_ENGINE_MODULES)
def test_importing_a_torch_free_engine_module_loads_no_torch(module):
    assert _heavy_modules_after(_LOADED_HEAVY.format(module=module)) == "[]"


def test_the_engine_package_loads_torch_only_for_the_names_that_need_it():
    """`from looptrace.engine import SamplingParams` stays light; `LLMEngine` brings torch in."""
    light = (
        "import sys; from looptrace.engine import SamplingParams, EngineConfig; print('torch' in sys.modules)"
    )
    heavy = "import sys; from looptrace.engine import LLMEngine; print('torch' in sys.modules)"
    assert (_heavy_modules_after(light), _heavy_modules_after(heavy)) == ("False", "True")


def test_the_engine_rules_catch_what_they_name(tmp_path):
    """On a made-up engine: a kernel setting read outside the plan, a switch tested in a model forward
    (beside a variant's fallback, which is not one), and a launch flag flipped through `global`."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/plan.py": "def resolve(cfg):\n    return cfg.kernels.exact\n",
            "engine/runner.py": "def run(self):\n    return self.cfg.kernels.gemv\n",
            "engine/layers.py": (
                "class Norm:\n    exact = False\n\n    def forward(self, x):\n"
                "        if self.exact:\n            return x\n"
                "        if exact_kernels_on(x.shape[0]):\n            return x\n        return x\n"
            ),
            "engine/kernels/launch_mode.py": "_on = False\n\n\ndef enter():\n    global _on\n    _on = 1\n",
        },
    )
    modules = hm.load_modules(tmp_path)
    reads = [h["where"] for h in hm.kernel_setting_reads(modules) if h["rel"] != hm.PLAN_FILE]
    assert reads == ["looptrace/engine/runner.py:2"]
    sites = hm.toggle_branch_sites(modules)
    assert [h["where"] for h in sites["toggles"]] == ["looptrace/engine/layers.py:5"]
    assert [h["where"] for h in sites["fallbacks"]] == ["looptrace/engine/layers.py:7"]
    assert [h["reason"] for h in hm.launch_globals(modules)] == ["global _on"]


def test_the_kernel_rules_catch_what_they_name(tmp_path):
    """On a made-up kernel wing: three private names taken (an imported `_h`, a private module `_c`, a
    read of `a._h`) and two forwarders (one behind a guard) beside a function that does its own work."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/kernels/__init__.py": (
                "def f(x):\n    from looptrace.engine.kernels import a\n\n    return a.f(x)\n\n\n"
                "def g(x):\n    if x is None:\n        return False\n"
                "    from . import a\n\n    return a.f(x)\n\n\n"
                "def own(x):\n    return x > 1\n"
            ),
            "engine/kernels/a.py": "def _h():\n    pass\n\n\ndef f(x):\n    return x\n",
            "engine/kernels/_c.py": "",
            "engine/kernels/b.py": (
                "from .a import _h\nfrom looptrace.engine.kernels import _c, a\n"
                "from looptrace.engine.kernels.a import f\n"
                "\n\ndef g():\n    return a._h(), _h, _c, f\n"
            ),
        },
    )
    modules = hm.load_modules(tmp_path)
    hits = [(h["where"], h["reason"]) for h in hm.private_kernel_imports(modules)]
    assert hits == [
        ("looptrace/engine/kernels/b.py:1", "imports looptrace.engine.kernels.a._h"),
        ("looptrace/engine/kernels/b.py:2", "imports looptrace.engine.kernels._c"),
        ("looptrace/engine/kernels/b.py:7", "reads a._h"),
    ]
    wing = hm.kernel_wing(modules)
    assert wing["facade_functions"] == ["f", "g", "own"] and wing["forwarders"] == ["f", "g"]


def test_the_event_switch_rule_catches_a_switch(tmp_path):
    """On a made-up engine: a function comparing a request's event with two Event values is a switch of
    two; a table lookup is none."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/llm_engine.py": (
                "def advance(req, event):\n    if event == Event.A:\n        return 1\n"
                "    elif event is Event.B:\n        return 2\n\n\n"
                "def advance_by_table(req, event):\n    return HANDLERS[event](req)\n"
            ),
        },
    )
    hits = hm.event_switches(hm.load_modules(tmp_path))
    assert [(h["where"], h["events"]) for h in hits] == [("looptrace/engine/llm_engine.py:1", 2)]
