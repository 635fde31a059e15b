"""Weights: deterministic seeded init on the target device and dtype.

(Hugging Face checkpoint loading and saving live in `checkpoint.py`.)
"""

from __future__ import annotations

import contextlib

import torch

from looptrace.engine.model_config import ModelSpec
from looptrace.engine.models import LoopedModel, build_model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def create_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> LoopedModel:
    """Module tree directly on `device` in `dtype` (no fp32 CPU detour for real shapes)."""
    with torch.device(device), _default_dtype(dtype):
        model = build_model(spec)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random(model: LoopedModel, seed: int = 0) -> None:
    """Seeded init, drawn on the model's device: N(0, 0.02) matrices and biases, norm weights 1 + N(0, 0.1)
    (not exactly 1, so a swapped norm cannot hide in tests). Same seed + device => same weights."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        else:
            p.copy_(0.02 * noise)
