"""Model shapes: one dataclass describes all three looped families, plus the named presets.

A *family name* (`ouro`, `huginn`, `olmo`) resolves to the tiny preset on CPU and to the real shape on CUDA.
Real shapes follow the public configs (shared/reference/models.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

Family = Literal["ouro", "huginn", "olmo"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: Family
    vocab_size: int  # embedding / head rows (Huginn: padded vocab)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    n_prelude: int  # layers run once before the loop (Ouro: 0)
    n_core: int  # the looped block
    n_coda: int  # layers run once after the loop (Ouro: 0)
    default_loops: int  # total_ut_steps (Ouro) / mean_recurrence (Huginn, OLMo)
    rope_theta: float
    max_position: int
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    embed_scale: float = 1.0
    qk_bias: bool = False  # Huginn: additive q/k bias before RoPE
    qk_norm: bool = False  # OLMo-2: RMSNorm over projected q and k
    state_init_std: float = 0.0  # trunc-normal std of the initial recurrent state (times embed_scale)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    exit_threshold: float = 1.0  # Ouro early_exit_threshold from config.json

    @property
    def num_layers(self) -> int:
        """Physical layers that own KV (prelude + core + coda)."""
        return self.n_prelude + self.n_core + self.n_coda

    @property
    def core_layer_ids(self) -> range:
        return range(self.n_prelude, self.n_prelude + self.n_core)

    @property
    def has_injection(self) -> bool:
        """Huginn and OLMo re-inject the prelude output through an adapter every loop."""
        return self.family != "ouro"

    @property
    def rope_style(self) -> Literal["half", "interleaved"]:
        return "interleaved" if self.family == "huginn" else "half"

    @property
    def kv_bytes_per_slot_bf16(self) -> int:
        """One layer's K and V for one token in bf16."""
        return 2 * self.num_kv_heads * self.head_dim * 2


def _ouro(name: str, layers: int, **kw) -> ModelSpec:
    base = dict(
        name=name,
        family="ouro",
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        n_prelude=0,
        n_core=layers,
        n_coda=0,
        default_loops=4,
        rope_theta=1e6,
        max_position=65536,
        bos_token_id=0,
        eos_token_ids=(0,),
    )
    base.update(kw)
    return ModelSpec(**base)


PRESETS: dict[str, ModelSpec] = {
    "ouro-1.4b": _ouro("ouro-1.4b", 24),
    "ouro-2.6b": _ouro("ouro-2.6b", 48),
    "huginn-0125": ModelSpec(
        name="huginn-0125",
        family="huginn",
        vocab_size=65536,
        hidden_size=5280,
        intermediate_size=17920,
        num_heads=55,
        num_kv_heads=55,
        head_dim=96,
        n_prelude=2,
        n_core=4,
        n_coda=2,
        default_loops=32,
        rope_theta=50000.0,
        max_position=4096,
        tie_embeddings=True,
        embed_scale=math.sqrt(5280),
        qk_bias=True,
        state_init_std=math.sqrt(2 / (5 * 5280)),
        bos_token_id=65504,
        eos_token_ids=(65504, 65505, 65508),
        pad_token_id=65509,
    ),
    "olmo-retrofit-1b": ModelSpec(
        name="olmo-retrofit-1b",
        family="olmo",
        vocab_size=100352,
        hidden_size=2048,
        intermediate_size=8192,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        n_prelude=4,
        n_core=6,
        n_coda=4,
        default_loops=4,
        rope_theta=500000.0,
        max_position=4096,
        qk_norm=True,
        state_init_std=0.008703882797784892,
        eos_token_ids=(100257,),
        pad_token_id=100277,
    ),
    # Tiny presets: same structure (layer roles, norms, RoPE style, injection), CPU-sized widths.
    # Vocab 512 covers the byte-level tokenizer (256 bytes + specials).
    "ouro-tiny": _ouro(
        "ouro-tiny",
        4,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        max_position=4096,
        bos_token_id=None,
        eos_token_ids=(),
    ),
    "huginn-tiny": ModelSpec(
        name="huginn-tiny",
        family="huginn",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        n_prelude=2,
        n_core=4,
        n_coda=2,
        default_loops=8,
        rope_theta=50000.0,
        max_position=4096,
        tie_embeddings=True,
        embed_scale=math.sqrt(64),
        qk_bias=True,
        state_init_std=math.sqrt(2 / (5 * 64)),
    ),
    "olmo-retrofit-tiny": ModelSpec(
        name="olmo-retrofit-tiny",
        family="olmo",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        n_prelude=4,
        n_core=6,
        n_coda=4,
        default_loops=4,
        rope_theta=500000.0,
        max_position=4096,
        qk_norm=True,
        state_init_std=0.008703882797784892,
    ),
}

FAMILY_PRESETS: dict[str, tuple[str, str]] = {
    # family: (CPU preset, CUDA preset)
    "ouro": ("ouro-tiny", "ouro-1.4b"),
    "huginn": ("huginn-tiny", "huginn-0125"),
    "olmo": ("olmo-retrofit-tiny", "olmo-retrofit-1b"),
}


class UnknownModelError(ValueError):
    pass


def resolve_preset(name: str, device_type: str) -> ModelSpec:
    """`ouro` -> ouro-tiny on CPU / ouro-1.4b on CUDA; a preset name resolves to itself."""
    key = name.lower()
    if key in FAMILY_PRESETS:
        cpu, cuda = FAMILY_PRESETS[key]
        return PRESETS[cuda if device_type == "cuda" else cpu]
    if key in PRESETS:
        return PRESETS[key]
    choices = ", ".join(list(FAMILY_PRESETS) + list(PRESETS))
    raise UnknownModelError(f"unknown model '{name}': expected one of {choices}")


def with_overrides(spec: ModelSpec, **kw) -> ModelSpec:
    return replace(spec, **kw)
