"""Hugging Face checkpoint directories: config mapping, save/load round trips, strict loading errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.checkpoint import (
    INDEX_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    config_from_spec,
    load_checkpoint,
    save_checkpoint,
    spec_from_config,
)
from looptrace.engine.model_config import PRESETS
from looptrace.engine.models import LoopedModel
from looptrace.engine.weights import create_model, init_random

TINY = ["ouro-tiny", "huginn-tiny", "olmo-retrofit-tiny"]
CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5], [300, 7, 42]]


def make_model(preset: str, seed: int = 0) -> LoopedModel:
    model = create_model(PRESETS[preset], CPU, torch.float32)
    init_random(model, seed)
    return model


def run_engine(model: LoopedModel) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens for PROMPTS plus every logits tensor the head produced along the way."""
    engine = LLMEngine(model, EngineConfig(noise="zeros"), device=CPU, dtype=torch.float32)
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    try:
        tokens = engine.generate(PROMPTS, SamplingParams(max_tokens=5))
    finally:
        hook.remove()
    return tokens, logits


def assert_same_weights(a: LoopedModel, b: LoopedModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def saved_ouro(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ouro")
    save_checkpoint(make_model("ouro-tiny"), path)
    return path


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint with its tensors passed through `edit(dict)`."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(dst / WEIGHTS_FILE))
    return dst


# Round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", TINY)
def test_round_trip_weights_tokens_and_logits(preset, tmp_path):
    original = make_model(preset, seed=5)
    save_checkpoint(original, tmp_path)
    spec, loaded = load_checkpoint(tmp_path, CPU, torch.float32, name=preset)
    assert spec == PRESETS[preset]
    assert_same_weights(original, loaded)
    names = set(load_file(str(tmp_path / WEIGHTS_FILE)))
    assert ("lm_head.weight" in names) == (not spec.tie_embeddings)
    if spec.tie_embeddings:  # still one shared tensor after loading
        assert loaded.lm_head.weight is loaded.transformer.wte.weight

    hidden = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(original.head(hidden), loaded.head(hidden))
    tokens_a, logits_a = run_engine(original)
    tokens_b, logits_b = run_engine(loaded)
    assert tokens_a == tokens_b
    assert all(len(t) == 5 for t in tokens_a)
    assert len(logits_a) == len(logits_b) > 0
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b, strict=True))


def test_sharded_round_trip(tmp_path):
    original = make_model("huginn-tiny", seed=2)
    save_checkpoint(original, tmp_path, max_shard_bytes=64 * 1024)
    assert not (tmp_path / WEIGHTS_FILE).exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    expected = {k: v for k, v in original.state_dict().items() if k != "lm_head.weight"}  # tied head
    assert set(index["weight_map"]) == set(expected)
    total = 0
    for shard in shards:
        tensors = load_file(str(tmp_path / shard))
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total == sum(t.numel() * 4 for t in expected.values())

    _, loaded = load_checkpoint(tmp_path)
    assert_same_weights(original, loaded)
    # Re-saving as one file replaces the shards (they must not shadow or confuse a later load).
    save_checkpoint(loaded, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHTS_FILE]


def test_load_casts_to_dtype(saved_ouro):
    _, model = load_checkpoint(saved_ouro, CPU, torch.bfloat16)
    ref = make_model("ouro-tiny").state_dict()
    for name, t in model.state_dict().items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, ref[name].to(torch.bfloat16)), name


def test_recomputed_rope_tables_are_skipped(saved_ouro, tmp_path):
    def add_tables(t):
        t["model.rotary_emb.inv_freq"] = torch.ones(8)
        t["freqs_cis"] = torch.ones(4096, 8, 2)

    _, model = load_checkpoint(rewrite(saved_ouro, tmp_path / "x", add_tables))
    assert_same_weights(model, make_model("ouro-tiny"))


# Strict loading ---------------------------------------------------------------------------------------------
def test_one_error_lists_missing_unexpected_and_misshaped(saved_ouro, tmp_path):
    def edit(t):
        del t["model.norm.weight"]
        t["foo"] = torch.zeros(3)
        t["lm_head.weight"] = torch.zeros(10, 4)

    path = rewrite(saved_ouro, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    msg = str(err.value)
    assert msg == (
        f"checkpoint {path}: 1 missing (model.norm.weight), 1 unexpected (foo), "
        "1 mis-shaped (lm_head.weight: file [10, 4], model [512, 64])"
    )


def test_long_lists_are_truncated(saved_ouro, tmp_path):
    dropped = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(3) for p in ("gate", "up", "down")]

    def edit(t):
        for name in dropped:
            del t[name]

    with pytest.raises(CheckpointError, match=r"9 missing \([^)]*, and 4 more\)$"):
        load_checkpoint(rewrite(saved_ouro, tmp_path / "bad", edit))


def test_tied_head_in_file_must_equal_embedding(tmp_path):
    src = tmp_path / "src"
    save_checkpoint(make_model("huginn-tiny"), src)
    copy_embedding = lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"].clone()})  # noqa: E731
    same = rewrite(src, tmp_path / "same", copy_embedding)
    load_checkpoint(same)  # an exact copy is accepted
    other = rewrite(src, tmp_path / "other", lambda t: t.update({"lm_head.weight": torch.zeros(512, 64)}))
    with pytest.raises(CheckpointError, match=r"1 conflicting \(lm_head.weight: differs from tied"):
        load_checkpoint(other)


def test_path_errors(tmp_path, saved_ouro):
    with pytest.raises(CheckpointError, match="directory not found"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text((saved_ouro / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}: no model.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard model-00001-of-00002.safetensors .* not found"):
        load_checkpoint(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="bad shard name"):
        load_checkpoint(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_checkpoint(tmp_path)


def test_config_errors_name_file_and_key(tmp_path):
    config = config_from_spec(PRESETS["huginn-tiny"])
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported model_type 'llama'"):
        load_checkpoint(tmp_path)
    del config["n_embd"]
    with pytest.raises(CheckpointError, match=r"^/x/config\.json: missing required key 'n_embd'$"):
        spec_from_config(config, "x", source="/x/config.json")
    with pytest.raises(CheckpointError, match="missing required key 'model_type'"):
        spec_from_config({"hidden_size": 4}, "x")
    with pytest.raises(CheckpointError, match="key 'hidden_size' must be an integer"):
        spec_from_config({**config_from_spec(PRESETS["ouro-tiny"]), "hidden_size": "64"}, "x")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        load_checkpoint(tmp_path)


# Config mapping ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_round_trip(preset):
    spec = PRESETS[preset]
    config = json.loads(json.dumps(config_from_spec(spec)))  # through JSON, as on disk
    assert spec_from_config(config, preset) == spec


def test_public_huginn_config_parses(tmp_path):
    # The public key names (models.md section 5), including keys the loader ignores.
    (tmp_path / "config.json").write_text("""{
      "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
      "activation_checkpoint_impl": "per-iteration", "architecture_class_name": "RecurrentGPT",
      "bias": false, "block_class_name": "SandwichBlock", "block_size": 4096,
      "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509,
      "effective_expected_depth": 132, "head_dim": 96, "init_orthogonal": false, "init_strategy": "takase",
      "init_values": {"embed_scale": 72.6636084983398, "embedding": 0.008703882797784892,
                      "out_proj": 0.0007575421706783153, "std": 0.008703882797784892},
      "injection_type": "linear", "intermediate_size": 17920, "mean_backprop_depth": 8,
      "mean_recurrence": 32, "mlp_class_name": "GatedMLP", "n_embd": 5280, "n_heads": 55, "n_layers": 8,
      "n_layers_in_coda": 2, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
      "nonlin_name": "SiLU", "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-06,
      "num_key_value_heads": 55, "padded_vocab_size": 65536, "padding_multiple": 4096, "qk_bias": true,
      "rope_base": 50000, "sampling_scheme": "poisson-lognormal-filling", "state_init": "like-init",
      "test_time_noise": 0, "test_time_noise_type": "fixed", "tie_embeddings": true,
      "torch_dtype": "bfloat16", "transformers_version": "4.44.2", "vocab_size": 65536
    }""")
    spec = spec_from_config(json.loads((tmp_path / "config.json").read_text()), "huginn-0125")
    assert (spec.family, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        "huginn",
        5280,
        55,
        55,
        96,
    )
    assert (spec.n_prelude, spec.n_core, spec.n_coda, spec.default_loops) == (2, 4, 2, 32)
    assert (spec.vocab_size, spec.rope_theta, spec.max_position) == (65536, 50000.0, 4096)
    assert spec.tie_embeddings and spec.qk_bias and not spec.qk_norm
    assert spec.embed_scale == math.sqrt(5280)
    # Everything but the stop set equals the preset (the extra stops come from generation_config.json).
    assert spec.eos_token_ids == (65505,)
    assert replace(spec, eos_token_ids=PRESETS["huginn-0125"].eos_token_ids) == PRESETS["huginn-0125"]
    generation = {"eos_token_id": [65504, 65505, 65508]}
    config = json.loads((tmp_path / "config.json").read_text())
    merged = spec_from_config(config, "h", generation_config=generation)
    assert merged.eos_token_ids == (65505, 65504, 65508)


def test_public_ouro_config_parses():
    config = {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 65536,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    }
    assert spec_from_config(config, "ouro-1.4b") == PRESETS["ouro-1.4b"]  # head_dim defaults to 2048 / 16
    with pytest.raises(CheckpointError, match="unsupported rope_scaling"):
        spec_from_config({**config, "rope_scaling": {"type": "yarn"}}, "x")


def test_olmo_retrofit_recognised_without_flag(tmp_path):
    """The retrofit converter writes no q/k-norm key: its q_norm tensors identify it."""
    src = tmp_path / "src"
    original = make_model("olmo-retrofit-tiny", seed=1)
    save_checkpoint(original, src)
    config = json.loads((src / "config.json").read_text())
    del config["qk_norm"]
    (src / "config.json").write_text(json.dumps(config))
    spec, loaded = load_checkpoint(src, name="olmo-retrofit-tiny")
    assert spec == PRESETS["olmo-retrofit-tiny"]
    assert_same_weights(original, loaded)
    assert spec_from_config(config, "x").family == "huginn"  # without the tensors: plain raven


def test_tied_ouro_round_trip(tmp_path):
    """Regression: Ouro ignored tie_embeddings, so a tied model's separately initialised head was lost on
    save (the file holds only the embedding) and the loaded model computed other logits."""
    spec = replace(PRESETS["ouro-tiny"], tie_embeddings=True)
    model = create_model(spec, torch.device("cpu"), torch.float32)
    init_random(model, 5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(model, tmp_path)
    _, loaded = load_checkpoint(tmp_path)
    h = torch.randn(3, spec.hidden_size)
    assert torch.equal(model.head(h), loaded.head(h))
