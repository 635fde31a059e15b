"""The packaged tiny trained checkpoints: size, loading through the engine's checkpoint loader, exact-match
accuracy measured through the engine, the CLI default (trained weights on CPU, --random-weights opts out),
and the dense training forward agreeing with the engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from looptrace.assets import default_eval_set, shipped_weights
from looptrace.engine.checkpoint import load_checkpoint
from looptrace.engine.config import EngineConfig
from looptrace.engine.llm_engine import LLMEngine
from looptrace.engine.tokenizer import ByteTokenizer, load_tokenizer
from looptrace.train.evaluate import exact_match, read_items
from tests.helpers import build_setup

# Exact match through the engine at the trained depth on the first 64 items of the built-in eval set. The
# README's full-set figures (500 items, `looptrace depth --accuracy-by-depth`): ouro-tiny 99.6 % at 4 loops,
# huginn-tiny 98.0 % at 8; both score 64/64 on this subset. Floors leave a few points for float drift.
FLOORS = {"ouro-tiny": 0.95, "huginn-tiny": 0.93}
PRESETS = sorted(FLOORS)


def _engine(preset: str, loops: int | None = None) -> tuple[LLMEngine, object]:
    root = shipped_weights(preset)
    assert root is not None, f"looptrace/assets/{preset} missing (`looptrace train-tiny --replace-shipped`)"
    sets = ("scheduler.max_num_seqs=64", "scheduler.max_num_batched_tokens=1024")
    sets += () if loops is None else (f"exit.max_loops={loops}",)
    setup = build_setup(preset, *sets, random_weights=False)  # the packaged checkpoint, as commands load it
    assert setup.weights == root
    return setup.engine, load_tokenizer(root)


@pytest.mark.parametrize("preset", PRESETS)
def test_shipped_files_small_and_complete(preset):
    root = shipped_weights(preset)
    assert root is not None
    names = {p.name for p in root.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "eval.jsonl"} <= names
    model_bytes = sum(
        (root / n).stat().st_size for n in ("config.json", "model.safetensors", "tokenizer.json")
    )
    assert model_bytes <= 5 * 1024 * 1024


@pytest.mark.parametrize("preset", PRESETS)
def test_shipped_accuracy_through_engine(preset):
    torch.set_num_threads(1)
    engine, tok = _engine(preset)
    items = read_items(default_eval_set(preset), need_answer=True)[:64]
    acc, _ = exact_match(engine, tok, items)
    assert acc.value >= FLOORS[preset], f"{preset}: exact match {acc.value:.3f} < {FLOORS[preset]}"


def test_tokenizer_matches_byte_ids():
    root = shipped_weights("huginn-tiny")
    tok, byte = load_tokenizer(root), ByteTokenizer()
    for it in read_items(root / "eval.jsonl")[:20]:
        assert tok.encode(it.prompt) == byte.encode(it.prompt)
        assert tok.decode(tok.encode(it.answer) + [257]) == it.answer
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)


def test_cli_default_weights_and_opt_out():
    from looptrace.build import BuildRequest, build, run_header

    trained = build(BuildRequest(model="huginn", device="cpu"))
    assert trained.weights == shipped_weights("huginn-tiny")
    assert run_header(trained)["weights"] == str(shipped_weights("huginn-tiny"))
    assert trained.engine.spec.name == "huginn-tiny"
    rand = build(BuildRequest(model="huginn", device="cpu", random_weights=True))
    assert rand.weights is None and run_header(rand)["weights"].startswith("random")
    # The Python API keeps seeded random weights (the engine test-suite relies on them).
    api = LLMEngine.from_preset("huginn-tiny", EngineConfig(), device="cpu")
    w = "transformer.wte.weight"
    assert not torch.equal(api.model.state_dict()[w], trained.engine.model.state_dict()[w])
    assert torch.equal(api.model.state_dict()[w], rand.engine.model.state_dict()[w])


@torch.no_grad()
def test_dense_training_forward_agrees_with_engine():
    """Ouro (no initial-state noise): greedy decoding with the dense forward == the engine's tokens."""
    from looptrace.engine.model_config import PRESETS as SPECS
    from looptrace.engine.models import build_model
    from looptrace.engine.request import SamplingParams
    from looptrace.engine.weights import init_random
    from looptrace.train.dense import forward_loops, make_dense

    spec = SPECS["ouro-tiny"]
    dense = make_dense(build_model(spec).eval())
    init_random(dense, 3)
    engine = LLMEngine.from_spec(spec, EngineConfig(), device="cpu", seed=0)
    engine.model.load_state_dict(dense.state_dict())
    prompts = [[256, 49, 50, 43, 51, 52, 61], [256, 57, 57, 43, 48, 49, 61]]
    got = engine.generate(prompts, SamplingParams(max_tokens=4))
    for prompt, out in zip(prompts, got):
        seq = list(prompt)
        for _ in range(4):
            (logits,), _ = forward_loops(dense, torch.tensor([seq]), spec.default_loops)
            seq.append(int(logits[0, -1].argmax()))
        assert seq[len(prompt) :] == out


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("LOOPTRACE_SLOW"), reason="retrains a model (minutes): LOOPTRACE_SLOW=1"
)
@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_train_tiny_reproduces_shipped_accuracy(family, tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli.main import app

    res = CliRunner().invoke(
        app, ["train-tiny", "--family", family, "--out", str(tmp_path), "--threads", "1"]
    )
    assert res.exit_code == 0, res.output
    preset = f"{family}-tiny"
    shipped = json.loads((shipped_weights(preset) / "train_meta.json").read_text())
    fresh = json.loads((Path(tmp_path) / "train_meta.json").read_text())
    loops = str(LLMEngine.from_preset(preset, EngineConfig(), device="cpu").max_loops)
    assert abs(fresh["dense_exact_by_depth"][loops] - shipped["dense_exact_by_depth"][loops]) <= 0.05


def test_train_tiny_cli_writes_a_loadable_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli.main import app

    # --threads 1: the command's default (2) beside another pytest worker on 2 cores made this test take
    # minutes of thread contention for 2 optimizer steps
    args = ["train-tiny", "--family", "ouro", "--out", str(tmp_path), "--steps", "2", "--threads", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    spec, _ = load_checkpoint(tmp_path, "cpu", torch.float32)
    assert spec.family == "ouro" and spec.eos_token_ids == (257,)
    meta = json.loads((tmp_path / "train_meta.json").read_text())
    assert meta["train_config"]["steps"] == 2 and len(read_items(tmp_path / "eval.jsonl")) == 500
    bad = CliRunner().invoke(app, ["train-tiny", "--family", "ouro", "--out", str(tmp_path), "--steps", "0"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
