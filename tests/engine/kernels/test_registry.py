"""The kernel registry (`looptrace.engine.kernels.registry`) as data: one entry per `kernels.*` setting, each
with a way to act (a module variant `assemble` installs, or a launch-plan field or wrapper), requirements
that name something the plan can check and come after what they require, a family requirement exactly where
an entry covers only some families, kernel modules that exist, and `entry` of a name that is no setting.
How the plan resolves the entries and what `assemble` installs: tests/engine/test_assemble.py."""

from __future__ import annotations

import dataclasses
import re

import pytest

from looptrace.engine.assemble import VARIANTS
from looptrace.engine.config import KernelConfig
from looptrace.engine.kernels import registry
from tests.helpers import ROOT

# Settings that install no module variant: a launch plan field, or a wrapper (l2_prefetch).
NO_VARIANT = {"kernels.pdl", "kernels.gemv_preload", "kernels.attn_prefetch", "kernels.l2_prefetch"}
KERNELS_DIR = ROOT / "looptrace" / "engine" / "kernels"


def test_every_kernel_setting_has_one_registry_entry_and_a_way_to_act():
    fields = {f"kernels.{f.name}" for f in dataclasses.fields(KernelConfig)}
    assert set(registry.BY_SETTING) == fields and len(registry.ENTRIES) == len(fields)
    assert set(VARIANTS) | NO_VARIANT == fields
    for entry in registry.ENTRIES:  # a required setting is resolved before the settings that need it
        earlier = {e.setting for e in registry.ENTRIES[: registry.ENTRIES.index(entry)]}
        needs = {r.name for r in entry.requires if r.name.startswith("kernels.")}
        assert needs <= earlier, entry.setting


def test_every_requirement_names_a_device_check_the_family_or_a_setting():
    known = {registry.CUDA_TRITON, registry.PDL, registry.NO_PERTURB, registry.FAMILY} | set(
        registry.BY_SETTING
    )
    unknown = [(e.setting, r.name) for e in registry.ENTRIES for r in e.requires if r.name not in known]
    assert unknown == []


def test_a_family_requirement_stands_exactly_where_an_entry_covers_only_some_families():
    """Without the requirement a narrower entry would act on any family; with it, an entry for every family
    would declare a check that can never fail."""
    for entry in registry.ENTRIES:
        assert set(entry.families) <= set(registry.ALL_FAMILIES), entry.setting
        checks_family = any(r.name == registry.FAMILY for r in entry.requires)
        assert checks_family == (entry.families != registry.ALL_FAMILIES), entry.setting


def test_the_kernel_modules_named_exist():
    """`module` is documentation; it names modules of engine/kernels/ (a parenthesised part names a
    function of it, or says no kernel of ours runs)."""
    missing = []
    for entry in registry.ENTRIES:
        for name in re.sub(r"\([^)]*\)", "", entry.module).replace(",", " ").split():
            if not ((KERNELS_DIR / f"{name}.py").is_file() or (KERNELS_DIR / name / "__init__.py").is_file()):
                missing.append((entry.setting, name))
    assert missing == []


def test_entry_gives_a_settings_entry_and_raises_key_error_for_a_name_that_is_no_setting():
    assert registry.entry("kernels.attention") is registry.BY_SETTING["kernels.attention"]
    assert registry.entry("kernels.attention").value == "triton"
    with pytest.raises(KeyError, match="'kernels.exactly'"):
        registry.entry("kernels.exactly")
