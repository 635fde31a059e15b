"""bench/token_ablation.py's named variants stay the recipes they are named after (the timing needs CUDA)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from looptrace.recipes import load_recipe

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    pytest.importorskip("triton")  # the GEMV's tile table lives in a Triton module
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("token_ablation", BENCH / "token_ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered first, for its dataclasses
    try:
        spec.loader.exec_module(module)  # puts bench/ on sys.path for synthetic_token
        yield module
    finally:
        sys.path[:] = saved
        sys.modules.pop(spec.name, None)


def kernel_forms(variant) -> dict:
    """The recipe toggles a variant of the synthetic token stands for."""
    return {
        "gemv": variant.gemv,
        "pdl": variant.pdl,
        "gemv_preload": variant.gemv and variant.pdl,  # `capture_variant`'s dependent_launches
        "attn_prefetch": variant.attn_prefetch,
        "attn_slots": variant.key_slots,
        "gemv_silu_out": variant.silu_out,
        "gemv_norm_out": variant.norm_out,
        "gemv_rope_out": variant.rope == "fold",
        "rope_kv_write": variant.rope in ("fold", "launch"),
    }


@pytest.mark.parametrize(("name", "recipe"), [("fast full rope-out", "fast"), ("exact rope", "exactloop")])
def test_variant_runs_what_its_recipe_runs(ablation, name, recipe):
    variant = ablation.variants()[name]
    kernels = load_recipe(recipe).config.kernels
    assert kernel_forms(variant) == {key: getattr(kernels, key) for key in kernel_forms(variant)}
    assert variant.one_pass and not variant.tiles and not variant.skip  # the engine's norm and tile table


def test_each_family_is_compared_with_its_plain_arm(ablation):
    """`bitwise` compares a variant with its family's first arm: that must be the arm without the change."""
    firsts: dict[str, str] = {}
    for name, variant in ablation.variants().items():
        if variant.family:
            firsts.setdefault(variant.family, name)
    assert firsts["fast full"] == "fast full"
    assert firsts["fast full rope"] == "fast full rope"  # launch first, then the fold, R0: the same bits
    assert firsts["exact"] == "exact steps" and firsts["exact rope"] == "exact rope"
