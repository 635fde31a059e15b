"""Engine configuration is validated where it is built: the Python API gives the same one-line errors as
the CLI's recipes, cross-field rules included, and every setting declares its exactness rung."""

from __future__ import annotations

import pytest

from looptrace.engine import EngineConfig, EngineInputError, LLMEngine
from looptrace.engine.config import (
    RUNGS,
    ConfigError,
    GraphConfig,
    KVConfig,
    SchedulerConfig,
    config_differences,
    setting_paths,
    toggle_rung,
)


@pytest.mark.parametrize(
    "build, needles",
    [
        (lambda: EngineConfig(noise="bogus"), ["noise", "'bogus'", "sequential"]),
        (lambda: KVConfig(block_size=0), ["block_size", "greater than or equal to 1", "0"]),
        (lambda: GraphConfig(max_graphs=0, eviction="lru"), ["cuda_graphs.eviction=lru", "max_graphs >= 1"]),
        (lambda: SchedulerConfig(max_num_seqs=True), ["max_num_seqs", "boolean"]),
        (lambda: SchedulerConfig(prefill_share=True), ["prefill_share", "loop_fusion"]),
        (lambda: KVConfig(layout="plane"), ["layout", "'planes', 'shared' or 'packed'", "'plane'"]),
        (lambda: GraphConfig(capture_sizes=[1, 999]), ["capture_sizes", "999"]),
    ],
)
def test_bad_values_raise_one_line_at_construction(build, needles):
    with pytest.raises(ConfigError) as info:
        build()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_unknown_keyword_is_rejected():
    with pytest.raises((ConfigError, TypeError)):
        KVConfig(bogus=1)  # type: ignore[call-arg]


def test_mutated_config_is_checked_when_the_engine_is_built():
    cfg = EngineConfig()
    cfg.kv.block_size = 0
    with pytest.raises(EngineInputError, match="block_size"):
        LLMEngine.from_preset("ouro-tiny", cfg, device="cpu")


def test_every_setting_declares_a_rung():
    for path in setting_paths(EngineConfig()):
        assert toggle_rung(path, "a", "b") in RUNGS, path


def test_rungs_grade_value_changes():
    assert toggle_rung("kv.layout", "planes", "packed") == "R0"
    assert toggle_rung("kv.layout", "planes", "shared") == "R3"
    assert toggle_rung("noise", "sequential", "position_keyed") == "R2"
    assert toggle_rung("scheduler.loop_fusion", False, True) == "R1"
    assert toggle_rung("scheduler.max_num_seqs", 8, 8) == "R0"
    a, b = EngineConfig(), EngineConfig(kv=KVConfig(layout="packed"))
    assert config_differences(a, b) == {"kv.layout": ("planes", "packed")}
