"""`noise: position_keyed` (ExactLoop, exactness.md §7, R2): Huginn's initial state = f(seed, position,
channel) through a staged SplitMix64 hash, a 24-bit uniform and the inverse normal CDF onto the ±3σ
truncated normal. Checked: the SplitMix64 test vectors and the device hash against a pure-Python reference,
the distribution, and independence of chunk size, prefix-cache hits and batch-mates (the last one is in
test_sampling_noise.py next to the sequential coupling it removes)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.model_config import PRESETS
from looptrace.engine.noise import (
    MASK64,
    PositionKeyedNoise,
    SequentialNoise,
    keyed_hash,
    keyed_hash_py,
    seed_key,
    splitmix64,
)
from tests.oracle import HiddenRecorder


def test_splitmix64_test_vectors():
    assert splitmix64(1234567, 5) == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def _as_i64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def test_device_hash_equals_the_python_reference():
    """int64 tensor ops (wrapping products, masked logical shifts) give the uint64 bits of the reference,
    for seeds and positions that set the top bit."""
    seeds = [0, 1, 1234567, (1 << 63) + 5, MASK64]
    positions = [0, 1, 7, 4095, (1 << 31) + 7, (1 << 62) + 3]
    channels = 37
    for seed in seeds:
        keys = torch.full((len(positions),), _as_i64(seed_key(seed)), dtype=torch.int64)
        got = keyed_hash(keys, torch.tensor(positions, dtype=torch.int64), channels)
        want = [[_as_i64(keyed_hash_py(seed, p, c)) for c in range(channels)] for p in positions]
        assert torch.equal(got, torch.tensor(want, dtype=torch.int64))


def test_values_follow_the_inverse_cdf_of_the_24_bit_uniform():
    spec = PRESETS["huginn-tiny"]
    noise = PositionKeyedNoise(spec)
    seed, positions = 99, [0, 3, 1000]
    keys = torch.full((3,), _as_i64(seed_key(seed)), dtype=torch.int64)
    got = noise.values(keys, torch.tensor(positions), 16, torch.float64)
    lo, hi = statistics.NormalDist().cdf(-3), statistics.NormalDist().cdf(3)
    for i, p in enumerate(positions):
        for c in range(16):
            k = keyed_hash_py(seed, p, c) >> 40
            u = (2 * k + 1) * 2.0**-25
            x = statistics.NormalDist().inv_cdf(lo + u * (hi - lo))
            want = x * spec.state_init_std * spec.embed_scale
            assert math.isclose(got[i, c].item(), want, rel_tol=1e-9, abs_tol=1e-12)


def test_distribution_is_the_truncated_normal():
    """Mean ~ 0, std ~ 0.9866 σ·scale (the ±3σ truncated normal), every value within ±3σ·scale, tails
    reached; the sequential draws have the same moments."""
    spec = PRESETS["huginn-0125"]  # σ = sqrt(2 / (5 * 5280)), scale = sqrt(5280)
    noise = PositionKeyedNoise(spec)
    rows = 64
    keys = torch.full((rows,), _as_i64(seed_key(7)), dtype=torch.int64)
    x = noise.values(keys, torch.arange(rows), spec.hidden_size, torch.float32).double()  # 337,920 values
    unit = spec.state_init_std * spec.embed_scale
    truncated_std = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / (1 - 2 * 0.0013498980316301))
    assert abs(truncated_std - 0.9866) < 1e-4
    assert abs(x.mean().item()) < 0.01 * unit
    assert abs(x.std().item() / unit - truncated_std) < 0.005
    assert x.abs().max().item() <= 3 * unit * (1 + 1e-6)
    assert x.abs().max().item() > 2.9 * unit  # the tails are there
    seq = SequentialNoise(spec).draw(rows, torch.empty(1, spec.hidden_size), torch.Generator().manual_seed(7))
    assert abs(seq.double().std().item() / unit - truncated_std) < 0.005


def test_noise_is_independent_of_draw_order_and_grouping():
    """One call for rows of two requests = separate calls in the other order; a run split anywhere."""
    spec = PRESETS["huginn-tiny"]
    noise = PositionKeyedNoise(spec)

    class Req:
        def __init__(self, seed):
            self.noise_seed = seed

    a, b = Req(5), Req(6)
    like = torch.empty(1, spec.hidden_size)
    to_dev = torch.from_numpy
    both = noise.initial_state(like, [(a, 0, 10), (b, 3, 4)], to_dev)
    split = torch.cat(
        [noise.initial_state(like, r, to_dev) for r in ([(b, 3, 4)], [(a, 0, 2)], [(a, 2, 7)], [(a, 9, 1)])]
    )
    assert torch.equal(both, split[[*range(4, 14), *range(4)]])
    assert not torch.equal(both[:4], both[10:])  # other seed, other noise
    with pytest.raises(ValueError, match="first position"):
        noise.initial_state(like, [(a, None, 1)], to_dev)


# --- engine level -------------------------------------------------------------------------------------------
def _huginn(layout="planes", chunk=128, noise="position_keyed", publication="per_plane"):
    cfg = EngineConfig(noise=noise)
    cfg.kv.layout, cfg.kv.block_size, cfg.kv.prefix_publication = layout, 4, publication
    cfg.scheduler.prefill_chunk_size = chunk
    engine = LLMEngine.from_preset("huginn-tiny", cfg, device="cpu", seed=1)
    rec = HiddenRecorder()
    engine.attach(rec)
    noise_at: dict[tuple[str, int], torch.Tensor] = {}

    def hook(mod, inp, out):
        row = 0
        for req, start, n in inp[1]:
            noise_at.update({(req.request_id, start + k): out[row + k].clone() for k in range(n)})
            row += n

    engine.runner.ops.state_init.register_forward_hook(hook)
    return engine, rec, noise_at


def _run(engine, prompt, rid, seed=11, max_tokens=4):
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0), rid)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.requests[rid]


PROMPT = [(11 + 7 * i) % 500 + 3 for i in range(21)]


def _same(rec_a, rec_b, rid_a, rid_b, atol=1e-5) -> bool:
    keys = [k for k in rec_a.states if k[0] == rid_a]
    assert keys
    return all(
        torch.allclose(rec_a.states[k], rec_b.states[(rid_b, *k[1:])], atol=atol, rtol=atol) for k in keys
    )


def test_chunk_size_does_not_change_the_noise_or_the_tokens():
    runs = {}
    for chunk in (2, 8, 128):
        engine, rec, noise_at = _huginn(chunk=chunk)
        req = _run(engine, PROMPT, "r")
        runs[chunk] = (req.outputs, rec, noise_at)
    out2, rec2, n2 = runs[2]
    for chunk in (8, 128):
        out, rec, n = runs[chunk]
        assert n.keys() == n2.keys() and all(torch.equal(n[k], n2[k]) for k in n2)  # bitwise, by position
        assert out == out2
        assert _same(rec, rec2, "r", "r")  # GEMM row counts differ per chunk: equal up to rounding


@pytest.mark.parametrize("layout", ["planes", "packed"])
def test_cached_prefix_gives_the_cold_run(layout):
    """Per-plane publication lets Huginn pages publish; a hit skips their prefill rows and their noise
    draws. Position-keyed: the suffix gets the cold run's noise bitwise and the cold run's tokens. The noise
    seed salts the prefix key, so a prefix published under another seed (other noise in its KV) never hits;
    unseeded requests share the engine's seed, so they share prefixes."""
    prompt = PROMPT[:8] + [400, 401, 402, 403, 404, 405]
    cold_engine, cold_rec, cold_noise = _huginn(layout)
    cold = _run(cold_engine, prompt, "cold")
    engine, rec, noise_at = _huginn(layout)
    _run(engine, PROMPT[:13], "warm")  # same seed (11); publishes the 3 full pages of PROMPT[:12]
    req = _run(engine, prompt, "hit")
    assert req.num_cached == 8 and engine.blocks.stats["prefix_hit_tokens"] == 8
    assert all(torch.equal(noise_at[("hit", p)], cold_noise[("cold", p)]) for p in range(8, len(prompt) + 3))
    assert ("hit", 0) not in noise_at  # no prefill (and no draw) for the cached positions
    assert req.outputs == cold.outputs
    assert _same(rec, cold_rec, "hit", "cold")  # suffix GEMMs see fewer rows: equal up to rounding
    # published under another seed: its KV holds other noise, so the salted key does not match
    other, other_rec, _ = _huginn(layout)
    _run(other, PROMPT[:13], "warm", seed=5)
    assert _run(other, prompt, "miss").num_cached == 0
    assert _same(other_rec, cold_rec, "miss", "cold")  # a cold run again
    # unseeded requests share the engine's noise seed, and so the prefix
    shared, _, _ = _huginn(layout)
    for rid, p in (("u1", PROMPT[:13]), ("u2", prompt)):
        shared.add_request(p, SamplingParams(max_tokens=2), rid)
        while shared.has_unfinished_requests():
            shared.step()
    assert shared.requests["u2"].noise_seed == shared.seed and shared.requests["u2"].num_cached == 8
    if layout == "planes":  # the base (sequential) noise shifts on a hit: other draws for the suffix
        s_cold_engine, _, s_cold_noise = _huginn(layout, noise="sequential")
        _run(s_cold_engine, prompt, "cold")
        s_engine, _, s_noise = _huginn(layout, noise="sequential")
        _run(s_engine, PROMPT[:13], "warm")
        _run(s_engine, prompt, "hit")
        assert not torch.equal(s_noise[("hit", 8)], s_cold_noise[("cold", 8)])


def test_keys_are_staged_once_per_call():
    """One [rows, 2] int64 array per call (seed key, position) goes to the device; nothing is read back."""
    spec = PRESETS["huginn-tiny"]
    staged = []

    class Req:
        noise_seed = 3

    def to_dev(a: np.ndarray) -> torch.Tensor:
        staged.append(a.copy())
        return torch.from_numpy(a)

    PositionKeyedNoise(spec).initial_state(torch.empty(1, spec.hidden_size), [(Req, 4, 3)], to_dev)
    assert len(staged) == 1 and staged[0].shape == (3, 2) and staged[0][:, 1].tolist() == [4, 5, 6]
    assert staged[0][0, 0] == _as_i64(seed_key(3))
