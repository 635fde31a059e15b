"""Initial recurrent state for Huginn / OLMo (Ouro starts from the embedding and uses none of this).

Each implementation takes `initial_state(like, runs, to_device)`: `runs` = `(request, first position, rows)`
for consecutive rows of one request, in row order (first position None where unknown); `to_device` stages a
small host array onto `like`'s device without a blocking copy. The result has one row per run row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from looptrace.engine.model_config import ModelSpec

Runs = list[tuple[object, int | None, int]]


class SequentialNoise:
    """Base engine: each prompt row and each decoded token gets `trunc_normal_(std σ, ±3σ)` · embed_scale
    from the request's own generator, one call per run of consecutive rows of one request. Draws follow
    processing order, so a cached prefix or another chunk size shifts every later token's noise — and so
    does a batch-mate: it takes part of the step's token budget, which splits this request's prompt into
    other chunks (other draw sizes, other numbers)."""

    name = "sequential"
    uses_generator = True  # the engine gives every request a seeded generator

    def __init__(self, spec: ModelSpec) -> None:
        self.std, self.scale = spec.state_init_std, spec.embed_scale

    def draw(self, rows: int, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        x = torch.empty((rows, like.shape[-1]), dtype=like.dtype, device=like.device)
        torch.nn.init.trunc_normal_(x, 0.0, self.std, -3 * self.std, 3 * self.std, generator=generator)
        return x * self.scale

    def initial_state(self, like: torch.Tensor, runs: Runs, to_device: Callable) -> torch.Tensor:
        parts = [self.draw(n, like, req.generator) for req, _, n in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ZeroState:
    """Deterministic zero initial state (LoopDuet serving; oracle comparisons)."""

    name = "zeros"
    uses_generator = False

    def __init__(self, spec: ModelSpec) -> None:
        pass

    def draw(self, rows: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.zeros((rows, like.shape[-1]), dtype=like.dtype, device=like.device)

    def initial_state(self, like: torch.Tensor, runs: Runs, to_device: Callable) -> torch.Tensor:
        return self.draw(sum(n for _, _, n in runs), like, None)


# ---------------------------------------------------------------------------------------------------------
# Position-keyed noise (ExactLoop; exactness.md §7)
# ---------------------------------------------------------------------------------------------------------
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64 increment: the seed stage
POSITION_STEP = 0xD1B54A32D192ED03  # position stage (odd: (pos + 1) * step is injective mod 2^64)
CHANNEL_STEP = 0x8CB92BA72F3D8DD7  # channel stage (odd)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64 finalizer multipliers


def _mix64_py(z: int) -> int:
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def splitmix64(seed: int, n: int) -> list[int]:
    """The first n outputs of SplitMix64 from `seed` (pure Python, the reference of the test vectors)."""
    out, state = [], seed & MASK64
    for _ in range(n):
        state = (state + GOLDEN) & MASK64
        out.append(_mix64_py(state))
    return out


def seed_key(seed: int) -> int:
    """Stage 1 (host, once per request): the first SplitMix64 output of the seed."""
    return splitmix64(seed, 1)[0]


def keyed_hash_py(seed: int, position: int, channel: int) -> int:
    """Pure-Python reference of the full staged hash (seed -> position -> channel), a uint64."""
    b = _mix64_py((seed_key(seed) + (position + 1) * POSITION_STEP) & MASK64)
    return _mix64_py((b + (channel + 1) * CHANNEL_STEP) & MASK64)


def _i64(u: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic on signed ints)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on int64 tensors. Products wrap mod 2^64 (two's complement), so the low 64 bits
    equal the uint64 product; checked against the pure-Python reference in the tests."""
    z = (z ^ _shr(z, 30)) * _i64(MIX1)
    z = (z ^ _shr(z, 27)) * _i64(MIX2)
    return z ^ _shr(z, 31)


def keyed_hash(seed_keys: torch.Tensor, positions: torch.Tensor, channels: int) -> torch.Tensor:
    """[R] int64 stage-1 keys and positions -> [R, channels] int64 hashes (the uint64 bits), on the
    tensors' device with integer ops only."""
    b = _mix64(seed_keys + (positions + 1) * _i64(POSITION_STEP))
    ch = torch.arange(1, channels + 1, dtype=torch.int64, device=positions.device) * _i64(CHANNEL_STEP)
    return _mix64(b[:, None] + ch[None, :])


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


class PositionKeyedNoise:
    """ExactLoop position-keyed initial state: noise = f(seed, position, channel). A staged SplitMix64 hash
    (seed, then position, then channel, each stage with its own constant) -> 24-bit uniform
    u = (2k + 1) · 2^-25 with k = h >> 40 -> inverse normal CDF onto the ±3σ truncated normal:
    p = Φ(-3) + u·(Φ(3) − Φ(-3)), x = σ·Φ⁻¹(p) (fp64, `torch.special.ndtri`) -> times embed_scale, the same
    σ and scale as `sequential`. Independent of draw order, chunk size, batch-mates and cache hits; computed
    on the device from one small staged [rows, 2] int64 array (no blocking read). Same distribution as
    `sequential`, other numbers (R2). The seed is `request.noise_seed`: the request's `params.seed`, else
    the engine's seed, shared by every unseeded request so that equal prompts have equal prompt states and
    a cached prefix equals a cold run. Nothing is drawn from the request generator, so sampling streams do
    not depend on the noise either."""

    name = "position_keyed"
    uses_generator = False  # keyed by `request.noise_seed`; nothing is drawn
    keyed_by_seed = True
    LOW, HIGH = _phi(-3.0), _phi(3.0)

    def __init__(self, spec: ModelSpec) -> None:
        self.std, self.scale = spec.state_init_std, spec.embed_scale

    @staticmethod
    def request_seed(req) -> int:
        return req.noise_seed

    def initial_state(self, like: torch.Tensor, runs: Runs, to_device: Callable) -> torch.Tensor:
        rows = sum(n for _, _, n in runs)
        keys = np.empty((rows, 2), dtype=np.int64)
        i = 0
        for req, start, n in runs:
            if start is None:
                raise ValueError("position_keyed noise needs each run's first position")
            keys[i : i + n, 0] = _i64(seed_key(self.request_seed(req)))
            keys[i : i + n, 1] = np.arange(start, start + n, dtype=np.int64)
            i += n
        dev = to_device(keys)
        return self.values(dev[:, 0], dev[:, 1], like.shape[-1], like.dtype)

    def values(
        self, seed_keys: torch.Tensor, positions: torch.Tensor, channels: int, dtype: torch.dtype
    ) -> torch.Tensor:
        k = _shr(keyed_hash(seed_keys, positions, channels), 40)  # 24 bits
        u = (2 * k + 1).double() * 2.0**-25  # exact in fp64, in (0, 1)
        p = self.LOW + u * (self.HIGH - self.LOW)
        x = torch.special.ndtri(p).clamp_(-3.0, 3.0) * self.std
        return x.to(dtype) * self.scale


NOISE = {"sequential": SequentialNoise, "position_keyed": PositionKeyedNoise, "zeros": ZeroState}
