"""`ring_clock`: the persistent loop's launch split by stage from every program's clock stamps.

CPU: the anatomy of hand-written stamps (walls, work, waits, releases, the tail; shares that add up to the
launch), the forward hook that keeps each timed launch's stamps and clears the op's clock afterwards, and
the roofline's loop row split into stage rows that add up to it.
GPU (Hopper): `looptrace profile`'s path on `fast` at Ouro-1.4B's shapes clocks the ring's launches, and
the roofline's stage rows add up to the loop's measured row.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from looptrace.probes.ring_clock import TAIL, _clocked, anatomy, run_clocked
from looptrace.probes.roofline import DEVICES
from looptrace.probes.roofline_report import (
    RooflineRow,
    Shapes,
    call_cost,
    loop_stage_costs,
    roofline_rows,
    split_loop_rows,
    window_ring,
)

STAGES = ("qkv", "attention", "o", "gate_up", "down")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _stamps(arrive_us: list[list[float]], leave_us: list[list[float]], start: list[float], end: list[float]):
    """int64 ns stamps `[programs, 2 + 10 L]` from per-program lists of arrivals and departures (µs), one
    entry per (layer, stage) in order."""
    programs = len(start)
    t = torch.zeros(programs, 2 + 2 * len(arrive_us[0]), dtype=torch.int64)
    for p in range(programs):
        t[p, 0] = int(start[p] * 1e3)
        for i, (a, b) in enumerate(zip(arrive_us[p], leave_us[p], strict=True)):
            t[p, 1 + 2 * i], t[p, 2 + 2 * i] = int(a * 1e3), int(b * 1e3)
        t[p, -1] = int(end[p] * 1e3)
    return t


def test_anatomy_of_hand_written_stamps():
    """Two programs, one layer: program 0 reaches each stage's end 1 µs after leaving the stage before,
    program 1 3 µs; both leave 0.5 µs after program 1 arrives. Then the tail: 2 µs."""
    arrive, leave = [[], []], [[], []]
    t = 0.0
    for _ in STAGES:
        arrive[0].append(t + 1)
        arrive[1].append(t + 3)
        t += 3.5
        leave[0].append(t)
        leave[1].append(t)
    stamps = _stamps(arrive, leave, [0.0, 0.0], [t + 2, t + 2])
    a = anatomy("loop", [stamps, stamps.clone()], STAGES)
    assert (a.layers, a.programs, a.launches) == (1, 2, 2)
    assert [s.stage for s in a.stages] == list(STAGES)
    for s in a.stages:
        assert s.wall_us == pytest.approx(3.5)
        assert (s.work_mean_us, s.work_max_us) == (pytest.approx(2.0), pytest.approx(3.0))
        assert s.wait_mean_us == pytest.approx(1.5)  # (2.5 + 0.5) / 2
        assert s.release_us == pytest.approx(0.5)
    assert a.tail_us == pytest.approx(2.0) and a.loop_us == pytest.approx(5 * 3.5 + 2)
    shares = a.shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["qkv"] == pytest.approx(3.5 / 19.5) and shares[TAIL] == pytest.approx(2 / 19.5)


def test_anatomy_takes_medians_over_layers():
    """Three layers whose q/k/v stage takes 1, 2 and 9 µs: the median layer's 2 µs, not the mean."""
    qkv_walls = [1.0, 2.0, 9.0]
    arrive, leave, t = [[]], [[]], 0.0
    for wall in qkv_walls:
        for stage in STAGES:
            t += wall if stage == "qkv" else 1.0
            arrive[0].append(t)
            leave[0].append(t)
    a = anatomy("loop", [_stamps(arrive, leave, [0.0], [t])], STAGES)
    walls = {s.stage: s.wall_us for s in a.stages}
    assert walls["qkv"] == pytest.approx(2.0) and walls["down"] == pytest.approx(1.0)
    assert a.tail_us == pytest.approx(0.0) and a.loop_us == pytest.approx(t)
    assert sum(a.shares().values()) == pytest.approx(1.0)


def test_anatomy_refuses_no_launch():
    with pytest.raises(ValueError, match="no timed launch"):
        anatomy("loop", [], STAGES)


class _ClockedOp(nn.Module):
    """Writes its clock like the ring does when set (the last stamp last), or nothing when it is None."""

    op_kind = "persistent_loop"
    stages = STAGES
    stage_clock: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, take: bool) -> torch.Tensor:
        if take and self.stage_clock is not None:
            self.stage_clock.copy_(torch.arange(self.stage_clock.numel()).view_as(self.stage_clock) + 1)
        return x


def test_clocked_keeps_each_launch_and_restores_the_untimed_op():
    op = _ClockedOp()
    found: dict[str, list[torch.Tensor]] = {"op": []}
    clock = torch.zeros(2, 12, dtype=torch.int64)
    with _clocked("op", op, clock, found):
        assert op.stage_clock is clock
        op(torch.ones(1), take=True)
        op(torch.ones(1), take=False)  # a loop the ring did not take: the clock stays at zero
    assert op.stage_clock is None and not op._forward_hooks
    assert len(found["op"]) == 2
    assert int(found["op"][0][-1, -1]) == 24 and not bool(found["op"][1].any())
    assert not bool(clock.any())  # cleared after each launch: a later launch cannot pass off stale stamps


class _Loop(nn.Module):
    op_kind = "persistent_loop"

    def __init__(self, layers: int = 2, hidden: int = 8, inter: int = 16) -> None:
        super().__init__()
        self.layers, self.hidden, self.inter = layers, hidden, inter

    def weight_tensors(self):
        L, h, i = self.layers, self.hidden, self.inter
        z = torch.zeros
        return z(L, 3 * h, h), z(L, h, h), z(L, 2 * i, h), z(L, h, i), z(L, 2, h), z(h)


SHAPES = Shapes(
    rows=1, context=100, act_bytes=4, kv_bytes=4, num_heads=2, num_kv_heads=1, head_dim=4, hidden=8
)


def test_stage_costs_add_up_to_the_loop_call():
    loop = _Loop()
    stages = loop_stage_costs(loop, SHAPES)
    assert list(stages) == [*STAGES, TAIL]
    whole = call_cost("persistent_loop", loop, SHAPES)
    assert sum(c.bytes for c in stages.values()) == pytest.approx(whole.bytes)
    assert sum(c.flops for c in stages.values()) == pytest.approx(whole.flops)
    assert stages["gate_up"].bytes == 2 * 32 * 8 * 4  # the weights, every layer
    assert stages["attention"].bytes == 2 * call_cost("paged_attention", loop, SHAPES).bytes


def _split(us_per_token: float | None):
    loop = _Loop()
    stamps = _stamps([[1.0, 3.0, 4.0, 8.0, 10.0]], [[2.0, 3.5, 5.0, 9.0, 11.0]], [0.0], [12.0])
    a = anatomy("runner.loop", [stamps], STAGES)
    device = DEVICES["h100-sxm"]
    costs = {("persistent_loop", "-"): call_cost("persistent_loop", loop, SHAPES)}
    by_op = [] if us_per_token is None else [("persistent_loop", "-", us_per_token), ("head", "-", 5.0)]
    rows = roofline_rows(by_op, costs, {("persistent_loop", "-"): 4.0}, 1, device, "fp32")
    split = split_loop_rows(rows, a.shares(), loop_stage_costs(loop, SHAPES), device, "fp32")
    return rows, split, a


def test_the_loop_row_splits_into_stage_rows_that_add_up_to_it():
    rows, split, a = _split(120.0)
    (loop,) = [r for r in rows if r.op == "persistent_loop"]
    stage_rows = [r for r in split if r.op.startswith("persistent_loop.")]
    assert [r.op for r in stage_rows] == [f"persistent_loop.{s}" for s in (*STAGES, TAIL)]
    assert [r.op for r in split if not r.op.startswith("persistent_loop")] == ["head"]
    assert sum(r.gpu_us_per_token for r in stage_rows) == pytest.approx(loop.gpu_us_per_token)
    assert sum(r.bytes_per_call for r in stage_rows) == pytest.approx(loop.bytes_per_call)
    assert all(r.calls_per_token == 4.0 for r in stage_rows)
    gate_up = next(r for r in stage_rows if r.op == "persistent_loop.gate_up")
    assert gate_up.gpu_us_per_token == pytest.approx(120.0 * 4.0 / 12.0)  # 4 of the launch's 12 µs
    assert gate_up.pct_of_peak is not None and gate_up.floor_us_per_call > 0


def test_an_unmeasured_loop_row_splits_into_floors_only():
    rows, split, _ = _split(None)
    stage_rows = [r for r in split if r.op.startswith("persistent_loop.")]
    assert len(stage_rows) == 6 and all(r.gpu_us_per_token is None for r in stage_rows)
    assert all(r.floor_us_per_call is not None for r in stage_rows)


def test_rows_without_a_loop_stay_as_they_were():
    rows = [RooflineRow("head", "-", 1.0, 2.0, 2.0, 1.0, 1.0, 1.0, None, None, None, None)]
    assert split_loop_rows(rows, {"qkv": 1.0}, {}, None, None) == rows


def test_a_window_without_the_loop_keeps_no_anatomy():
    """The clocks time every captured body that takes the ring; at 8 rows the window runs none of them (a
    profile of `fast` at C = 8 printed a one-row body's stage table under a window without the loop)."""
    rows, _, a = _split(120.0)
    assert window_ring(rows, [a]) == [a]
    without = [r for r in rows if r.op != "persistent_loop"]
    assert [r.op for r in without] == ["head"]
    assert window_ring(without, [a]) == ()


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
def test_profile_of_fast_at_two_rows_shows_no_ring_clock():
    """Two requests decode together, so the ring takes no loop of the window: no stage rows, no anatomy,
    even though a one-row body (the engine's warm-up request) took the ring and was clocked."""
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.engine.model_config import resolve_preset, with_overrides
    from looptrace.probes.roofline_report import profile_roofline
    from looptrace.probes.session import ProfileConfig, profile_engine
    from looptrace.recipes import load_recipe

    spec = with_overrides(resolve_preset("ouro-1.4b", "cuda"), n_core=4)
    sets = ["kv.prefix_caching=false", "scheduler.max_model_len=512", "kv.num_blocks=1024"]
    engine = LLMEngine.from_spec(spec, load_recipe("fast", sets).config, device="cuda", seed=1)
    engine.generate([[3 + j for j in range(40)]], SamplingParams(max_tokens=4))  # a one-row body
    result = profile_engine(engine, ProfileConfig(concurrency=2, prompt_len=64, decode_steps=8))
    assert result.ring_clock  # the one-row body was clocked ...
    block = profile_roofline(engine, result)
    assert not [r for r in block["rows"] if r["op"].startswith("persistent_loop")]
    assert block["ring_clock"] == []  # ... but describes nothing in this window
    routes = engine.snapshot().loop_routes  # and the snapshot says which rows the ring took
    assert routes[1] == "one launch per loop (TMA ring)"
    assert routes[2] == "layer by layer (2 rows: the ring takes one)"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA ring: Hopper only")
def test_profile_of_fast_clocks_the_ring_and_splits_its_row():
    """`profile_engine` on `fast` (ring on) at Ouro-1.4B's shapes, 4 layers: one clocked op with 4 layers,
    every stage's wall above zero, shares adding up to 1, and roofline stage rows adding up to the loop's
    row; the timed launches leave the engine's tokens as they were."""
    from looptrace.engine import LLMEngine, SamplingParams
    from looptrace.engine.model_config import resolve_preset, with_overrides
    from looptrace.probes.roofline_report import profile_roofline
    from looptrace.probes.session import ProfileConfig, profile_engine
    from looptrace.recipes import load_recipe

    spec = with_overrides(resolve_preset("ouro-1.4b", "cuda"), n_core=4)
    sets = ["kv.prefix_caching=false", "scheduler.max_model_len=512", "kv.num_blocks=1024"]
    engine = LLMEngine.from_spec(spec, load_recipe("fast", sets).config, device="cuda", seed=1)
    params = SamplingParams(max_tokens=8)
    before = engine.generate([[3 + j for j in range(40)]], params)
    result = profile_engine(engine, ProfileConfig(concurrency=1, prompt_len=64, decode_steps=16))
    (a,) = result.ring_clock
    assert a.layers == 4 and a.launches >= 4
    assert all(s.wall_us > 0 for s in a.stages) and sum(a.shares().values()) == pytest.approx(1.0)
    block = profile_roofline(engine, result)
    stage_rows = [r for r in block["rows"] if r["op"].startswith("persistent_loop.")]
    assert len(stage_rows) == 6 and not [r for r in block["rows"] if r["op"] == "persistent_loop"]
    assert all(r["gpu_us_per_token"] and r["pct_of_peak"] for r in stage_rows)
    assert block["ring_clock"][0]["stages"][0]["stage"] == "qkv"
    assert engine.generate([[3 + j for j in range(40)]], params) == before


def test_only_the_bodies_that_took_the_ring_run_again():
    """`run_clocked`: every body once; the two whose run wrote a clock four times more (a body through the
    chained path leaves a zero clock: not repeated)."""
    found: dict[str, list[torch.Tensor]] = {"op": []}
    runs = dict.fromkeys(("ring", "chained", "ring 2", "other"), 0)

    def body(name: str, written: bool):
        def thunk() -> None:
            runs[name] += 1
            found["op"].append(torch.full((2, 12), int(written), dtype=torch.int64))

        return thunk

    bodies = [body("ring", True), body("chained", False), body("ring 2", True), body("other", False)]
    assert run_clocked(bodies, found, repeats=5) == 2
    assert runs == {"ring": 5, "chained": 1, "ring 2": 5, "other": 1}
    assert len(found["op"]) == 10 and all(bool(t.all()) for t in found["op"])  # the zero clocks dropped
