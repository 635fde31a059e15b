"""A real server on 127.0.0.1 (uvicorn on a thread, port chosen by the OS) around a tiny Ouro on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve_load.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_load", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_engine(max_num_seqs: int = 8, max_model_len: int = 256):
    """Configured in code, so the tests do not depend on a recipe file."""
    from looptrace.engine.config import EngineConfig
    from looptrace.engine.llm_engine import LLMEngine

    cfg = EngineConfig()
    cfg.scheduler.max_num_seqs = max_num_seqs
    cfg.scheduler.max_model_len = max_model_len
    return LLMEngine.from_preset("ouro", cfg, device="cpu", seed=0)


@pytest.fixture(scope="module")
def server():
    from looptrace.serve.server import build_server

    srv = build_server(make_engine(), port=0, model_name="ouro", aliases=("ouro-tiny",), probe_interval=1.0)
    srv.start()
    yield srv
    srv.stop()
