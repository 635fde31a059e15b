"""Recipes: base.yaml = EngineConfig defaults; `--set` parsing; one-line errors naming file/--set and key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from looptrace.engine.config import EngineConfig, KVConfig, SchedulerConfig, config_to_dict
from looptrace.recipes import RECIPE_DIR, RecipeError, config_from_overrides, load_recipe

BASE = str(RECIPE_DIR / "base.yaml")


def error(name: str = "base", overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(name, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# --- base.yaml ------------------------------------------------------------------------------------------
def test_base_recipe_is_the_engine_defaults() -> None:
    rec = load_recipe("base")
    assert (rec.name, rec.source, rec.overrides) == ("base", BASE, [])
    assert rec.description
    assert config_to_dict(rec.config) == config_to_dict(EngineConfig())


def test_every_key_in_base_yaml_is_a_default() -> None:
    data = yaml.safe_load(Path(BASE).read_text())
    defaults = config_to_dict(EngineConfig())
    for section, value in data.items():
        if section in ("name", "description"):
            continue
        if isinstance(value, dict):
            for key, v in value.items():
                assert v == defaults[section][key], f"{section}.{key}"
        else:
            assert value == defaults[section], section


# --- --set parsing --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "item, path, value",
    [
        ("scheduler.max_num_seqs=32", ("scheduler", "max_num_seqs"), 32),
        ("kv.prefix_caching=false", ("kv", "prefix_caching"), False),
        ("cuda_graphs.enabled=no", ("cuda_graphs", "enabled"), False),  # YAML 1.1 booleans
        ("exit.max_loops=null", ("exit", "max_loops"), None),
        ("scheduler.max_model_len=", ("scheduler", "max_model_len"), None),  # empty value = null
        ("cuda_graphs.capture_sizes=[1, 2, 4]", ("cuda_graphs", "capture_sizes"), [1, 2, 4]),
        ("kv.gpu_memory_utilization=0.5", ("kv", "gpu_memory_utilization"), 0.5),
        ("kv.layout=shared", ("kv", "layout"), "shared"),
        ("noise=zeros", ("noise",), "zeros"),
        (" exit.min_loops =3", ("exit", "min_loops"), 3),
    ],
)
def test_set_values_are_parsed_as_yaml(item, path, value) -> None:
    rec = load_recipe("base", [item])
    node = rec.config
    for part in path:
        node = getattr(node, part)
    assert node == value
    assert rec.overrides == [item]
    assert config_from_overrides([item]) == rec.config  # no recipe file: defaults + --set


def test_later_set_wins() -> None:
    cfg = load_recipe("base", ["scheduler.max_num_seqs=4", "scheduler.max_num_seqs=16"]).config
    assert cfg.scheduler.max_num_seqs == 16


def test_unknown_key_lists_the_expected_keys() -> None:
    msg = error("base", ["scheduler.max_num_seq=3"])
    assert msg.startswith("--set: unknown key 'scheduler.max_num_seq'")
    assert all(name in msg for name in names(SchedulerConfig))


def test_unknown_section_lists_the_sections() -> None:
    msg = error("base", ["bogus=1"])
    assert "unknown key 'bogus'" in msg and all(name in msg for name in names(EngineConfig))
    msg = error("base", ["kv.bogus.deep=1"])  # nested unknown section
    assert "unknown key 'kv.bogus'" in msg and all(name in msg for name in names(KVConfig))


@pytest.mark.parametrize("item", ["bogus.key=1", "kv.bogus.deep=1", "cuda_graphs.capture_sizes=[1, x]"])
def test_nested_set_errors_are_attributed_to_set(item) -> None:
    assert error("base", [item]).startswith("--set: ")


@pytest.mark.parametrize(
    "item, needles",
    [
        ("kv.block_size=0", ["--set: kv.block_size:", "greater than or equal to 1", "(got 0)"]),
        ("exit.threshold=2", ["--set: exit.threshold:", "less than or equal to 1", "(got 2)"]),
        ("exit.threshold=0", ["--set: exit.threshold:", "greater than 0"]),
        ("kv.gpu_memory_utilization=1.5", ["--set: kv.gpu_memory_utilization:", "less than or equal to 1"]),
        ("kv.layout=plane", ["--set: kv.layout:", "'planes', 'shared' or 'packed'", "'plane'"]),
        ("scheduler.max_num_seqs=abc", ["--set: scheduler.max_num_seqs:", "valid integer"]),
        ("scheduler.max_num_seqs=3.5", ["--set: scheduler.max_num_seqs:", "fractional"]),
        ("kv.prefix_caching=maybe", ["--set: kv.prefix_caching:", "valid boolean"]),
        ("kv=3", ["--set: kv:", "dictionary"]),
        ("kv.layout.x=1", ["--set kv.layout.x:", "'layout' is a value, not a section"]),
        ("scheduler.max_num_seqs", ["--set 'scheduler.max_num_seqs':", "section.key=value"]),
        ("=3", ["--set '=3':", "section.key=value"]),
    ],
)
def test_bad_set_values_name_the_key_path(item, needles) -> None:
    msg = error("base", [item])
    for needle in needles:
        assert needle in msg, msg


def test_bool_is_not_an_int() -> None:
    error("base", ["scheduler.max_num_seqs=true"])


# --- recipe files ---------------------------------------------------------------------------------------
def test_recipe_path_loads_and_keeps_defaults(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("description: shared KV\nkv:\n  layout: shared\n")
    rec = load_recipe(str(path), ["scheduler.max_num_seqs=2"])
    assert (rec.name, rec.source, rec.description) == ("mine", str(path), "shared KV")
    assert rec.config.kv.layout == "shared" and rec.config.kv.block_size == 16
    assert rec.config.scheduler.max_num_seqs == 2


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_empty_recipe_file_is_an_error(tmp_path, text) -> None:
    """An empty file is more likely a mistake than a wish for the defaults (those are `--recipe base`)."""
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    msg = error(str(path))
    assert msg.startswith(f"{path}:") and "empty" in msg, msg


def test_a_folder_named_like_a_shipped_recipe_does_not_shadow_it(tmp_path, monkeypatch) -> None:
    """`looptrace profile` (recipe `base`) in a directory holding a `base/` folder, or `diff base fast`
    beside a `fast` file, still reads the shipped recipes; `./base` names the folder."""
    (tmp_path / "base").mkdir()
    (tmp_path / "fast").write_text("not a recipe")
    monkeypatch.chdir(tmp_path)
    assert load_recipe("base").source == str(RECIPE_DIR / "base.yaml")
    assert load_recipe("fast").source == str(RECIPE_DIR / "fast.yaml")
    assert "is a directory" in error("./base")


def test_recipe_path_that_is_a_directory_says_so(tmp_path) -> None:
    folder = tmp_path / "recipes.yaml"
    folder.mkdir()
    assert error(str(folder)) == f"recipe path {folder} is a directory: expected a .yaml file"
    assert "is a directory" in error(str(tmp_path))


@pytest.mark.parametrize(
    "text, needles",
    [
        ("kv:\n  layot: shared\n", ["unknown key 'kv.layot'", "layout, block_size"]),
        ("kv: {block_size: 0}\n", ["kv.block_size:", "greater than or equal to 1"]),
        ("exit:\n  threshold: 2\n", ["exit.threshold:", "less than or equal to 1"]),
        ("name: x\nkv:\n  layout: [planes\n  block_size: 16\n", ["line 4", "invalid YAML"]),
        ("- kv\n- scheduler\n", ["expected a mapping of settings, got list"]),
        ("just a string\n", ["expected a mapping of settings, got str"]),
    ],
    ids=["unknown key", "block_size=0", "threshold=2", "syntax error", "list", "scalar"],
)
def test_bad_recipe_file_names_the_file(tmp_path, text, needles) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    msg = error(str(path))
    assert msg.startswith(f"{path}:"), msg
    for needle in needles:
        assert needle in msg, msg


def test_missing_recipe_path_and_unknown_name(tmp_path) -> None:
    missing = tmp_path / "nope.yaml"
    assert error(str(missing)) == f"recipe file {missing} does not exist"
    msg = error("nosuch")
    assert msg.startswith("unknown recipe 'nosuch'") and "base" in msg and ".yaml path" in msg


# --- extends --------------------------------------------------------------------------------------------
def test_fast_extends_exactloop_and_lists_only_its_own_settings() -> None:
    text = yaml.safe_load((RECIPE_DIR / "fast.yaml").read_text())
    assert text["extends"] == "exactloop" and set(text) == {"name", "description", "extends", "kernels"}
    fast, exactloop = (
        config_to_dict(load_recipe("fast").config),
        config_to_dict(load_recipe("exactloop").config),
    )
    assert {k: v for k, v in fast.items() if k != "kernels"} == {
        k: v for k, v in exactloop.items() if k != "kernels"
    }
    own = {k: v for k, v in fast["kernels"].items() if v != exactloop["kernels"][k]}
    assert own == {k: v for k, v in text["kernels"].items() if v != exactloop["kernels"][k]} and own
    assert load_recipe("fast").name == "fast"


def test_extends_merges_by_key_and_set_applies_last(tmp_path) -> None:
    parent = tmp_path / "parent.yaml"
    parent.write_text("name: parent\nkv: {layout: packed, block_size: 32}\nscheduler: {max_num_seqs: 4}\n")
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {parent}\nkv: {{block_size: 64}}\n")
    recipe = load_recipe(str(child), ["scheduler.max_num_seqs=2"])
    assert recipe.name == "child"  # the parent's name is not inherited
    assert (recipe.config.kv.layout, recipe.config.kv.block_size) == ("packed", 64)
    assert recipe.config.scheduler.max_num_seqs == 2


def test_an_extends_circle_or_a_bad_parent_is_one_line(tmp_path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"extends: {b}\n")
    b.write_text(f"extends: {a}\n")
    assert "a circle" in error(str(a))
    a.write_text("extends: [exactloop]\n")
    assert "extends: expected a recipe name" in error(str(a))
    a.write_text("extends: no-such-recipe\n")
    assert "unknown recipe 'no-such-recipe'" in error(str(a))
