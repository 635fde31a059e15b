"""Recipes: YAML files naming a set of engine toggles, validated against `EngineConfig`.

    name: base
    description: ...
    kv: {layout: planes, block_size: 16}
    scheduler: {max_num_seqs: 8}

A recipe may say `extends: NAME` (or a .yaml path): the parent's settings, with this file's merged over
them key by key within each section; `name` and `description` are this file's own.

`--recipe NAME` reads `recipes/NAME.yaml`; `--recipe PATH` reads that file; `--set section.key=value`
overrides one setting (the value is parsed as YAML: `32`, `true`, `null`, `[1, 2]`). Every problem is one
line naming the file (or `--set`), the key path and what was expected. Numeric bounds come from each
field's metadata (`ge`/`gt`/`le`), which pydantic applies to dataclass fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from looptrace.engine import config as engine_config
from looptrace.engine.config import ConfigError, EngineConfig
from looptrace.input_files import (
    MAX_RECIPE_BYTES,
    InputError,
    check_regular_file,
    check_tree,
    load_yaml,
    read_text,
    recipe_dir,
    recipe_file,
)

RECIPE_DIR = recipe_dir()  # recipes/ of a checkout, looptrace/recipe_files/ of a wheel
META_KEYS = ("name", "description")


class RecipeError(ValueError):
    pass


@dataclass
class Recipe:
    name: str
    description: str
    config: EngineConfig
    source: str  # file path, or "<default>"
    overrides: list[str]


def available() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def resolve_path(name_or_path: str) -> Path:
    """The recipe file a name (`recipes/NAME.yaml`) or a path names; a path must be a regular file."""
    path = Path(name_or_path)
    if recipe_file(name_or_path) == path:  # a path (not a name in recipes/)
        if path.is_dir():
            raise RecipeError(f"recipe path {path} is a directory: expected a .yaml file")
        if not path.exists():
            raise RecipeError(f"recipe file {path} does not exist")
        try:  # a fifo would block the read forever, a device never end it
            check_regular_file(path, "recipe file")
        except InputError as exc:
            raise RecipeError(str(exc)) from None
        return path
    candidate = RECIPE_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise RecipeError(
            f"unknown recipe '{name_or_path}': expected one of {', '.join(available())} or a .yaml path"
        )
    return candidate


def load_recipe(name_or_path: str = "base", overrides: list[str] | None = None) -> Recipe:
    path = resolve_path(name_or_path)
    data = _extended(_read_mapping(path), path)
    overrides = list(overrides or [])
    for item in overrides:
        apply_override(data, item)
    config = build_config({k: v for k, v in data.items() if k not in META_KEYS}, str(path), overrides)
    return Recipe(
        str(data.get("name", path.stem)), str(data.get("description", "")), config, str(path), overrides
    )


def _read_mapping(path: Path) -> dict:
    try:
        data = load_yaml(read_text(path, "recipe", MAX_RECIPE_BYTES), str(path))
    except InputError as exc:
        raise RecipeError(str(exc)) from None
    if data is None:
        raise RecipeError(f"{path}: the recipe is empty: expected a mapping of settings (name, kv, ...)")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _extended(data: dict, path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """`extends: PARENT`: the parent's settings (its own `extends` first), this file's sections merged over
    them key by key; name and description stay this file's."""
    parent_name = data.pop("extends", None)
    if parent_name is None:
        return data
    if not isinstance(parent_name, str):
        raise RecipeError(f"{path}: extends: expected a recipe name or a .yaml path, got {parent_name!r}")
    parent_path = resolve_path(parent_name)
    if parent_path.resolve() in (*seen, path.resolve()):
        raise RecipeError(f"{path}: extends: {parent_name} extends this recipe again (a circle)")
    parent = _extended(_read_mapping(parent_path), parent_path, (*seen, path.resolve()))
    merged = {k: v for k, v in parent.items() if k not in META_KEYS}
    for key, value in data.items():
        inherited = merged.get(key)
        merged[key] = (
            {**inherited, **value} if isinstance(value, dict) and isinstance(inherited, dict) else value
        )
    return merged


def apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected section.key=value, e.g. scheduler.max_num_seqs=32")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: the text itself (the schema check names the key if it wants another type)
    except (RecursionError, ValueError, OverflowError) as exc:  # 5,000 brackets, a 5,000-digit integer
        raise RecipeError(f"--set {item!r}: cannot read the value ({type(exc).__name__})") from None
    try:
        check_tree(value, f"--set {key.strip()}")
    except InputError as exc:
        raise RecipeError(str(exc)) from None
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_config(data: dict[str, Any], source: str, overrides: list[str] | None = None) -> EngineConfig:
    try:
        return engine_config.build_config(data)
    except ConfigError as exc:
        raise RecipeError(f"{_origin(str(exc), source, overrides or [])}: {exc}") from None


def _origin(message: str, source: str, overrides: list[str]) -> str:
    """`--set` when an override explains the error (its key path is a prefix of the failing one, or the
    other way round: `bogus.key` makes `bogus` unknown; `capture_sizes=[1, x]` fails at `capture_sizes.1`),
    else the recipe file."""
    words = message.replace("'", " ").replace("=", " ").replace(":", " ").split()
    paths = [w for w in words if "." in w or w.isidentifier()]
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if any(key == p or key.startswith(p + ".") or p.startswith(key + ".") for p in paths):
            return "--set"
    return source


def config_from_overrides(overrides: list[str]) -> EngineConfig:
    """An EngineConfig from defaults plus `--set` items (no recipe file)."""
    data: dict = {}
    for item in overrides:
        apply_override(data, item)
    return build_config(data, "--set", overrides)
