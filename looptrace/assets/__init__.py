"""Packaged data: tiny *trained* checkpoints (`<preset>/`: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, eval.jsonl, train_meta.json), written by `looptrace train-tiny`."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
EVAL_FILE = "eval.jsonl"


def shipped_weights(preset: str) -> Path | None:
    """The packaged trained checkpoint of a tiny preset, or None when there is none."""
    root = ASSETS_DIR / preset
    if (root / "config.json").is_file() and (root / "model.safetensors").is_file():
        return root
    return None


def shipped_presets() -> list[str]:
    return sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir() and shipped_weights(p.name))


def default_eval_set(preset: str | None = None) -> Path | None:
    """The built-in evaluation set (JSONL `{"prompt", "answer"}`): the preset's own, else any shipped one
    (every tiny preset is trained on the same task)."""
    candidates = [preset] if preset else []
    candidates += shipped_presets()
    for name in candidates:
        root = shipped_weights(name)
        if root is not None and (root / EVAL_FILE).is_file():
            return root / EVAL_FILE
    return None
