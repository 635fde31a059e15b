"""Hugging Face checkpoint directories: config.json <-> ModelSpec, safetensors <-> module weights.

A checkpoint directory holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`); `generation_config.json` is read for extra stop ids when present. Nothing
else is read: modeling `.py` files shipped with remote-code checkpoints are never imported or executed.
Our module trees use the public tensor names, so loading is a name-for-name copy, checked strictly.

config.json keys, per family (shared/reference/models.md section 5):

- Ouro (`model_type: "ouro"`): vocab_size, hidden_size, intermediate_size, num_hidden_layers,
  num_attention_heads (required); num_key_value_heads, head_dim, max_position_embeddings, rope_theta,
  rms_norm_eps, tie_word_embeddings, total_ut_steps, early_exit_threshold (OuroConfig defaults when
  absent); rope_scaling must be null and hidden_act silu.
- Huginn (`model_type: "huginn_raven"`): n_embd, n_heads, n_layers_in_prelude, n_layers_in_recurrent_block,
  n_layers_in_coda, intermediate_size, padded_vocab_size (falls back to vocab_size) (required);
  num_key_value_heads, head_dim, block_size, rope_base, norm_eps, qk_bias, tie_embeddings, mean_recurrence,
  init_values.std, init_values.embed_scale (RavenConfig defaults when absent); n_layers must equal the sum
  and `bias` must be false.
- OLMo retrofit: the same raven keys (its converter clones a Huginn-style config). The retrofit's exact
  key names are uncertain (models.md marks them so, and its converter writes no q/k-norm flag), so it is
  recognised by `qk_norm: true`, by "olmo" in `architectures`, or by `attn.q_norm.weight` tensors in the
  weights. It reads `rope_theta` before `rope_base` and `max_position_embeddings` before `block_size` (its
  RoPE is transformers' Olmo2RotaryEmbedding) and defaults to qk_bias false, untied, embed_scale 1.0.
  We write qk_norm, rope_base + rope_theta and block_size + max_position_embeddings.

All families: bos_token_id, eos_token_id (int or list) and pad_token_id when present.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from looptrace.engine.model_config import ModelSpec
from looptrace.engine.models import LoopedModel
from looptrace.engine.weights import create_model

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
OURO_TYPE = "ouro"
RAVEN_TYPE = "huginn_raven"
HEAD_KEY = "lm_head.weight"
_EMBED_KEY: dict[str, str] = {
    "ouro": "model.embed_tokens.weight",
    "huginn": "transformer.wte.weight",
    "olmo": "transformer.wte.weight",
}
_LIST_LIMIT = 5
_REQUIRED = object()


class CheckpointError(ValueError):
    """A checkpoint directory we cannot load: bad path, bad config, or weights that do not fit the model."""


# config.json -> ModelSpec ---------------------------------------------------------------------------------
class _Config:
    """Typed reads from a config dict; every error names the file and the key."""

    def __init__(self, data: dict, source: str) -> None:
        self.data, self.source = data, source

    def error(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {msg}")

    def raw(self, *keys: str, default: Any = _REQUIRED) -> Any:
        """The first present key of `keys` (aliases, preferred first)."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        if default is _REQUIRED:
            raise self.error(f"missing required key '{keys[0]}'")
        return default

    def integer(self, *keys: str, default: Any = _REQUIRED) -> int:
        value = self.raw(*keys, default=default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"key '{keys[0]}' must be an integer, got {value!r}")
        return value

    def number(self, *keys: str, default: Any = _REQUIRED) -> float:
        value = self.raw(*keys, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(f"key '{keys[0]}' must be a number, got {value!r}")
        return float(value)

    def flag(self, *keys: str, default: Any = _REQUIRED) -> bool:
        value = self.raw(*keys, default=default)
        if not isinstance(value, bool):
            raise self.error(f"key '{keys[0]}' must be true or false, got {value!r}")
        return value

    def expect(self, key: str, allowed: tuple) -> None:
        if self.data.get(key) not in allowed:
            raise self.error(f"unsupported {key} {self.data[key]!r} (supported: {allowed})")


def _token_ids(value: Any, cfg: _Config, key: str) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise cfg.error(f"key '{key}' must be an integer or a list of integers, got {value!r}")
    return tuple(ids)


def _special_tokens(cfg: _Config, generation: dict | None) -> dict:
    """bos/pad from config.json (generation_config.json as fallback); eos = union of both, config first."""
    gen = _Config(generation or {}, GENERATION_FILE)
    eos = _token_ids(cfg.data.get("eos_token_id"), cfg, "eos_token_id")
    extra = _token_ids(gen.data.get("eos_token_id"), gen, "eos_token_id")
    out: dict[str, Any] = {"eos_token_ids": tuple(dict.fromkeys(eos + extra))}
    for key in ("bos_token_id", "pad_token_id"):
        source = cfg if cfg.data.get(key) is not None else gen
        if source.data.get(key) is not None:
            out[key] = source.integer(key)
    return out


def _head_dim(cfg: _Config, hidden: int, heads: int, key: str) -> int:
    if cfg.data.get("head_dim") is None and (heads <= 0 or hidden % heads):
        raise cfg.error(f"'{key}' {hidden} is not divisible by the head count {heads}; set head_dim")
    return cfg.integer("head_dim", default=hidden // max(heads, 1))


def _ouro_spec(cfg: _Config, name: str, tokens: dict) -> ModelSpec:
    cfg.expect("rope_scaling", (None,))
    cfg.expect("hidden_act", (None, "silu"))
    hidden, heads = cfg.integer("hidden_size"), cfg.integer("num_attention_heads")
    return ModelSpec(
        name=name,
        family="ouro",
        vocab_size=cfg.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=cfg.integer("intermediate_size"),
        num_heads=heads,
        num_kv_heads=cfg.integer("num_key_value_heads", default=heads),
        head_dim=_head_dim(cfg, hidden, heads, "hidden_size"),
        n_prelude=0,
        n_core=cfg.integer("num_hidden_layers"),
        n_coda=0,
        default_loops=cfg.integer("total_ut_steps", default=4),
        # OuroConfig class defaults (models.md section 1) fill keys a config.json leaves out.
        rope_theta=cfg.number("rope_theta", default=10000.0),
        max_position=cfg.integer("max_position_embeddings", default=32768),
        rms_norm_eps=cfg.number("rms_norm_eps", default=1e-6),
        tie_embeddings=cfg.flag("tie_word_embeddings", default=False),
        exit_threshold=cfg.number("early_exit_threshold", default=1.0),
        **tokens,
    )


def _is_olmo(cfg: _Config, tensor_names: Iterable[str] | None) -> bool:
    if cfg.data.get("qk_norm") is not None:  # an explicit flag wins (our writer sets it)
        return cfg.flag("qk_norm")
    archs = cfg.data.get("architectures") or []
    if any("olmo" in str(a).lower() for a in archs):
        return True
    # The retrofit converter writes no flag, but its modeling code always has q/k norms.
    return any(n.endswith(".attn.q_norm.weight") for n in tensor_names or ())


def _raven_spec(cfg: _Config, name: str, tokens: dict, olmo: bool) -> ModelSpec:
    if cfg.data.get("bias"):
        raise cfg.error("unsupported bias true (raven linears have no bias)")
    cfg.expect("injection_type", (None, "linear"))
    hidden, heads = cfg.integer("n_embd"), cfg.integer("n_heads")
    layer_keys = ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
    layers = [cfg.integer(k) for k in layer_keys]
    total = cfg.integer("n_layers", default=sum(layers))
    if total != sum(layers):
        raise cfg.error(f"key 'n_layers' is {total}, not prelude + core + coda = {sum(layers)}")
    init = cfg.raw("init_values", default={})
    if not isinstance(init, dict):
        raise cfg.error(f"key 'init_values' must be an object, got {init!r}")
    init_cfg = _Config(init, f"{cfg.source} init_values")
    rope_keys = ("rope_base", "rope_theta")
    pos_keys = ("block_size", "max_position_embeddings")
    if olmo:  # transformers' Olmo2RotaryEmbedding reads the HF names
        rope_keys, pos_keys = rope_keys[::-1], pos_keys[::-1]
    return ModelSpec(
        name=name,
        family="olmo" if olmo else "huginn",
        vocab_size=cfg.integer("padded_vocab_size", "vocab_size"),
        hidden_size=hidden,
        intermediate_size=cfg.integer("intermediate_size"),
        num_heads=heads,
        num_kv_heads=cfg.integer("num_key_value_heads", default=heads),
        head_dim=_head_dim(cfg, hidden, heads, "n_embd"),
        n_prelude=layers[0],
        n_core=layers[1],
        n_coda=layers[2],
        default_loops=cfg.integer("mean_recurrence", default=32),
        rope_theta=cfg.number(*rope_keys, default=50000.0),
        max_position=cfg.integer(*pos_keys, default=4096),
        rms_norm_eps=cfg.number("norm_eps", default=1e-6),
        tie_embeddings=cfg.flag("tie_embeddings", "tie_word_embeddings", default=not olmo),
        embed_scale=init_cfg.number("embed_scale", default=1.0 if olmo else math.sqrt(hidden)),
        qk_bias=cfg.flag("qk_bias", default=not olmo),
        qk_norm=olmo,
        state_init_std=init_cfg.number("std", default=math.sqrt(2 / (5 * hidden))),
        **tokens,
    )


def spec_from_config(
    config: dict,
    name: str,
    *,
    source: str = CONFIG_FILE,
    generation_config: dict | None = None,
    tensor_names: Iterable[str] | None = None,
) -> ModelSpec:
    """Map a Hugging Face config.json dict to a ModelSpec.

    `source` names the file in error messages; `generation_config` adds its eos ids; `tensor_names` (the
    checkpoint's tensors) lets an unflagged raven config be recognised as the OLMo retrofit.
    """
    cfg = _Config(config if isinstance(config, dict) else {}, source)
    if not isinstance(config, dict):
        raise cfg.error(f"expected a JSON object, got {type(config).__name__}")
    model_type = cfg.raw("model_type")
    tokens = _special_tokens(cfg, generation_config)
    if model_type == OURO_TYPE:
        return _ouro_spec(cfg, name, tokens)
    if model_type == RAVEN_TYPE:
        return _raven_spec(cfg, name, tokens, _is_olmo(cfg, tensor_names))
    raise cfg.error(f"unsupported model_type {model_type!r} (expected '{OURO_TYPE}' or '{RAVEN_TYPE}')")


# ModelSpec -> config.json ---------------------------------------------------------------------------------
def _token_keys(spec: ModelSpec) -> dict:
    out: dict[str, Any] = {}
    if spec.bos_token_id is not None:
        out["bos_token_id"] = spec.bos_token_id
    if spec.eos_token_ids:
        ids = list(spec.eos_token_ids)
        out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if spec.pad_token_id is not None:
        out["pad_token_id"] = spec.pad_token_id
    return out


def _ouro_config(spec: ModelSpec) -> dict:
    if spec.n_prelude or spec.n_coda or spec.embed_scale != 1.0 or spec.qk_bias or spec.qk_norm:
        raise CheckpointError(
            f"spec {spec.name}: an Ouro config.json cannot express prelude/coda layers, "
            "an embedding scale or q/k extras"
        )
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": OURO_TYPE,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.n_core,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "total_ut_steps": spec.default_loops,
        "early_exit_threshold": spec.exit_threshold,
        **_token_keys(spec),
    }


def _raven_config(spec: ModelSpec) -> dict:
    config = {
        "architectures": ["RavenForCausalLM"],
        "model_type": RAVEN_TYPE,
        "n_embd": spec.hidden_size,
        "n_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "n_layers": spec.num_layers,
        "n_layers_in_prelude": spec.n_prelude,
        "n_layers_in_recurrent_block": spec.n_core,
        "n_layers_in_coda": spec.n_coda,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "padded_vocab_size": spec.vocab_size,
        "block_size": spec.max_position,
        "rope_base": spec.rope_theta,
        "norm_eps": spec.rms_norm_eps,
        "qk_bias": spec.qk_bias,
        "bias": False,
        "tie_embeddings": spec.tie_embeddings,
        "injection_type": "linear",
        "state_init": "like-init",
        "mean_recurrence": spec.default_loops,
        "init_values": {"std": spec.state_init_std, "embed_scale": spec.embed_scale},
        **_token_keys(spec),
    }
    if spec.family == "olmo":
        config.update(qk_norm=True, rope_theta=spec.rope_theta, max_position_embeddings=spec.max_position)
    return config


def config_from_spec(spec: ModelSpec) -> dict:
    """The config.json dict for `spec`, with the public key names (inverse of `spec_from_config`)."""
    return _ouro_config(spec) if spec.family == "ouro" else _raven_config(spec)


# Files -----------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable JSON ({exc})") from None


def _weight_files(root: Path) -> list[Path]:
    """model.safetensors (preferred, as transformers does) or the shards named by the index file."""
    if (root / WEIGHTS_FILE).is_file():
        return [root / WEIGHTS_FILE]
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        raise CheckpointError(f"checkpoint {root}: no {WEIGHTS_FILE} or {INDEX_FILE}")
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: missing or empty key 'weight_map'")
    shards = []
    for shard in sorted(set(weight_map.values()), key=str):
        # Only plain file names inside the checkpoint: an index must not point elsewhere on disk.
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(f"{index_path}: bad shard name {shard!r} in 'weight_map'")
        if not (root / shard).is_file():
            raise CheckpointError(f"checkpoint {root}: shard {shard} listed in {INDEX_FILE} not found")
        shards.append(root / shard)
    return shards


def _tensor_names(files: Sequence[Path]) -> list[str]:
    names: list[str] = []
    for path in files:
        with _open(path) as f:
            names.extend(f.keys())
    return names


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def _recomputed(name: str) -> bool:
    """RoPE tables some checkpoints store; our modules recompute them."""
    return name == "freqs_cis" or name.endswith((".freqs_cis", "rotary_emb.inv_freq"))


def _listing(items: Sequence[str]) -> str:
    shown = list(items[:_LIST_LIMIT])
    if len(items) > _LIST_LIMIT:
        shown.append(f"and {len(items) - _LIST_LIMIT} more")
    return ", ".join(shown)


class _LoadReport:
    """Collects every mismatch so one error lists them all."""

    def __init__(self) -> None:
        self.groups: dict[str, list[str]] = {
            "missing": [],
            "unexpected": [],
            "mis-shaped": [],
            "duplicated": [],
            "conflicting": [],
        }

    def add(self, kind: str, item: str) -> None:
        self.groups[kind].append(item)

    def raise_if_any(self, root: Path) -> None:
        parts = [f"{len(v)} {k} ({_listing(v)})" for k, v in self.groups.items() if v]
        if parts:
            raise CheckpointError(f"checkpoint {root}: " + ", ".join(parts))


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@torch.no_grad()
def _copy_weights(model: LoopedModel, files: Sequence[Path], root: Path) -> None:
    spec = model.spec
    targets = model.state_dict()  # detached views sharing the parameters' storage
    tied, embed_key = spec.tie_embeddings, _EMBED_KEY[spec.family]
    expected = set(targets) - ({HEAD_KEY} if tied else set())
    report, seen, file_head = _LoadReport(), set(), None
    for path in files:
        with _open(path) as f:
            names = f.keys()
            for name in names:
                if _recomputed(name):
                    continue
                if name in seen:
                    report.add("duplicated", name)
                    continue
                seen.add(name)
                if tied and name == HEAD_KEY:
                    file_head = f.get_tensor(name)  # checked against the tied embedding below
                    continue
                if name not in expected:
                    report.add("unexpected", name)
                    continue
                shape, target = f.get_slice(name).get_shape(), targets[name]
                if tuple(shape) != tuple(target.shape):
                    report.add("mis-shaped", f"{name}: file {_shape(shape)}, model {_shape(target.shape)}")
                    continue
                target.copy_(f.get_tensor(name))  # casts to the model dtype and moves to its device
    for name in sorted(expected - seen):
        report.add("missing", name)
    if tied and embed_key in seen:
        _tie_head(targets, embed_key, file_head, report)
    report.raise_if_any(root)


def _tie_head(targets: dict, embed_key: str, file_head: torch.Tensor | None, report: _LoadReport) -> None:
    embed, head = targets[embed_key], targets[HEAD_KEY]
    # A tied file may still carry lm_head.weight (e.g. saved untied); accept it only as an exact copy.
    same = file_head is None or (
        tuple(file_head.shape) == tuple(embed.shape) and torch.equal(file_head.to(embed), embed)
    )
    if not same:
        report.add("conflicting", f"{HEAD_KEY}: differs from tied {embed_key}")
    if head.data_ptr() != embed.data_ptr():  # a module that keeps a separate head parameter
        head.copy_(embed)


def read_spec(directory: str | os.PathLike, *, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a checkpoint directory (config.json, generation_config.json; for an unflagged
    OLMo retrofit also the tensor names of the safetensors headers)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {root}: directory not found")
    config = _read_json(root / CONFIG_FILE)
    generation = _read_json(root / GENERATION_FILE) if (root / GENERATION_FILE).is_file() else None

    def parse(tensor_names: list[str] | None) -> ModelSpec:
        return spec_from_config(
            config,
            name or root.resolve().name,
            source=str(root / CONFIG_FILE),
            generation_config=generation if isinstance(generation, dict) else None,
            tensor_names=tensor_names,
        )

    spec = parse(None)
    if spec.family == "huginn":  # an unflagged OLMo retrofit shows itself by its q_norm tensors
        spec = parse(_tensor_names(_weight_files(root)))
    return spec


def load_checkpoint(
    directory: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    name: str | None = None,
) -> tuple[ModelSpec, LoopedModel]:
    """Read config.json + safetensors weights (single file or shards) into a model on `device` in `dtype`.

    The spec is named `name`, else after the directory.
    Strict: any missing, unexpected, mis-shaped, duplicated or conflicting tensor fails the load with one
    CheckpointError listing them. Tensors are read one at a time (peak host memory = the largest tensor).
    """
    root = Path(directory)
    spec = read_spec(root, name=name)  # a bad config fails before any weight file is touched
    files = _weight_files(root)
    model = create_model(spec, torch.device(device), dtype)
    _copy_weights(model, files, root)
    return spec, model


def _tensors_to_save(model: LoopedModel) -> dict[str, torch.Tensor]:
    tensors = model.state_dict()
    if model.spec.tie_embeddings:
        tensors.pop(HEAD_KEY, None)  # the public tied checkpoints carry only the embedding
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy packing in state-dict order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _remove_stale_weights(root: Path) -> None:
    """Old weight files of the other layout would shadow or confuse the new ones on load."""
    for path in [root / WEIGHTS_FILE, root / INDEX_FILE, *root.glob("model-*-of-*.safetensors")]:
        if path.is_file():
            path.unlink()


def save_checkpoint(
    model: LoopedModel, directory: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> Path:
    """Write config.json + model.safetensors, or shards + index when `max_shard_bytes` is given.

    Existing weight files of ours in `directory` are replaced. Returns the directory.
    """
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tensors = _tensors_to_save(model)
    config = config_from_spec(model.spec)
    if tensors:
        config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _remove_stale_weights(root)
    meta = {"format": "pt"}  # transformers expects this safetensors metadata
    if max_shard_bytes is None:
        save_file(tensors, str(root / WEIGHTS_FILE), metadata=meta)
        return root
    shards = _shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return root
