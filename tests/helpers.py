"""The engine builders and the one recorder the tests share (and a runner for interpreted Triton).

    engine = build_engine("huginn-tiny", scheduler__max_num_seqs=2, kv__layout="shared")
    rec = Recorder(hidden=True); engine.attach(rec)

`build_engine` is the engine tests' builder (`LLMEngine.from_preset`, the ground floor): `section__key=value`
sets one setting of EngineConfig (`noise=...` a top-level one). Tests default to `noise="zeros"`, a
deterministic initial state, so the dense oracle can replay them. Tests of what the commands and the server
do build through `looptrace.build.build`, as they do: `build_setup` (one engine) and `diff_factory` (the
engines of `looptrace diff`'s arms, on one loaded model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from looptrace.build import BuildRequest, EngineSetup, build, engine_factory, load, place
from looptrace.engine import EngineConfig, LLMEngine, Observer
from looptrace.engine.config import GraphConfig, validate_config
from looptrace.engine.cuda_graphs import GraphCache, _Entry

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str) -> Any:
    """Runs `code` in a child Python under Triton's interpreter (TRITON_INTERPRET=1 must be set before
    Triton decorates the kernels, so never in the test process); the code prints one line `RESULT <json>`,
    returned parsed."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def interpreted_checks(module: str) -> dict:
    """`module._cpu_checks()` (a dict of check name -> [ok, detail]) under Triton's interpreter."""
    return run_interpreted(
        "import json, torch; torch.set_num_threads(1)\n"
        f"from {module} import _cpu_checks\n"
        "print('RESULT ' + json.dumps(_cpu_checks()))\n"
    )


def interpreted_results_fixture(module: str):
    """A module-scoped fixture giving `interpreted_checks(module)`, skipped where Triton is not installed
    (each kernel test file binds it as `cpu_results`)."""

    @pytest.fixture(scope="module")
    def cpu_results() -> dict:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton not importable")
        return interpreted_checks(module)

    return cpu_results


def tickets_left_zero() -> list:
    """[ok, detail] of the check that every split-combine ticket counter is back at zero (`scratch`)."""
    from looptrace.engine.kernels import scratch

    counters = [int(t.abs().sum()) for bufs in scratch._TICKETS.values() for t in bufs]
    return [all(c == 0 for c in counters), counters]


def build_config(noise: str = "zeros", **settings: Any) -> EngineConfig:
    cfg = EngineConfig(noise=noise)
    for key, value in settings.items():
        section, _, name = key.partition("__")
        if name:
            setattr(getattr(cfg, section), name, value)
        else:
            setattr(cfg, section, value)
    return validate_config(cfg)


def build_engine(
    preset: str = "ouro-tiny",
    *,
    seed: int = 0,
    device: str = "cpu",
    spec=None,
    observers: tuple[Observer, ...] = (),
    **settings: Any,
) -> LLMEngine:
    cfg = build_config(**settings)
    if spec is not None:
        engine = LLMEngine.from_spec(spec, cfg, device=device, seed=seed)
    else:
        engine = LLMEngine.from_preset(preset, cfg, device=device, seed=seed)
    for observer in observers:
        engine.attach(observer)
    return engine


def build_setup(model: str = "ouro-tiny", *sets: str, recipe: str = "base", **fields: Any) -> EngineSetup:
    """An engine built as the commands and the server build theirs (`looptrace.build.build`): `recipe` and
    `sets` on CPU, with a tiny preset's seeded random weights unless `random_weights=False` (its packaged
    checkpoint) or `weights=DIR` say otherwise; `fields`: any other BuildRequest field."""
    defaults: dict[str, Any] = {"device": "cpu", "random_weights": True}
    return build(BuildRequest(model=model, recipe=recipe, sets=sets, **(defaults | fields)))


def diff_factory(model: str = "ouro", **fields: Any):
    """EngineConfig -> a fresh engine on its own copy of one loaded model, as `looptrace diff` builds its
    arms (`looptrace.build.load` + `engine_factory`); CPU and seeded random weights unless `fields` say
    otherwise."""
    request = BuildRequest(model=model, **({"device": "cpu", "random_weights": True} | fields))
    placement = place(request)
    _, _, net = load(request, placement)
    return engine_factory(net, placement.device, placement.dtype, request.seed)


class Recorder(Observer):
    """Everything an engine reports: step begins/ends, request events and (hidden=True) the state after
    every loop, by (request id, position, loop)."""

    def __init__(self, hidden: bool = False) -> None:
        self.wants_hidden = hidden
        self.steps = []  # StepInfo
        self.results = []  # StepResult
        self.events = []  # RequestEvent
        self.states: dict[tuple[str, int, int], torch.Tensor] = {}

    def on_step_begin(self, info) -> None:
        self.steps.append(info)

    def on_step_end(self, result) -> None:
        self.results.append(result)

    def on_request_event(self, event) -> None:
        self.events.append(event)

    def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden) -> None:
        for rid, pos, row in zip(request_ids, positions, hidden, strict=True):
            self.states[(rid, pos, loop_index)] = row.clone()

    @property
    def stages(self) -> list[str]:
        return [s.stage for s in self.steps]

    def kinds(self, kind: str) -> list[str]:
        return [e.request_id for e in self.events if e.kind == kind]


def drain(engine: LLMEngine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("engine did not drain")


class _Replay:
    """A stand-in CUDA graph: replay re-runs the body on the static buffers, which is what a replay of the
    captured body computes."""

    def __init__(self, fn, static, out) -> None:
        self.fn, self.static, self.out = fn, static, out

    def replay(self) -> None:
        for dst, src in zip(self.out, self.fn(*self.static)):
            dst.copy_(src)


def stand_in_graphs(name: str, fn, cfg: GraphConfig | None = None) -> GraphCache:
    """A GraphCache that runs on CPU: capture keeps static buffers, replay re-runs `fn` on them; the cache's
    bookkeeping (keys, LRU, counters, fallbacks) is the real one."""
    cache = GraphCache(name, fn, cfg or GraphConfig(max_graphs=64, eviction="lru"), pool=None)

    def capture(inputs):
        static = tuple(x.clone() for x in inputs)
        out = tuple(o.clone() for o in fn(*static))
        cache.counters.captures += 1
        return _Entry(_Replay(fn, static, out), static, out)  # type: ignore[arg-type]

    cache._capture = capture  # type: ignore[method-assign]
    return cache


@contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server running `handler` on a free loopback port, in a thread; yields its base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
