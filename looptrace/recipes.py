"""Recipes: YAML files naming a set of engine toggles, validated against `EngineConfig`.

    name: base
    description: ...
    kv: {layout: planes, block_size: 16}
    scheduler: {max_num_seqs: 8}

`--recipe NAME` reads `recipes/NAME.yaml`; `--recipe PATH` reads that file; `--set section.key=value`
overrides one setting (the value is parsed as YAML: `32`, `true`, `null`, `[1, 2]`). Every problem is one
line naming the file (or `--set`), the key path and what was expected. Numeric bounds come from each
field's metadata (`ge`/`gt`/`le`), which pydantic applies to dataclass fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from looptrace.engine.config import EngineConfig

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
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
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist")
        return path
    candidate = RECIPE_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise RecipeError(
            f"unknown recipe '{name_or_path}': expected one of {', '.join(available())} or a .yaml path"
        )
    return candidate


def load_recipe(name_or_path: str = "base", overrides: list[str] | None = None) -> Recipe:
    path = resolve_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}:{where} invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    overrides = list(overrides or [])
    for item in overrides:
        apply_override(data, item)
    config = build_config({k: v for k, v in data.items() if k not in META_KEYS}, str(path), overrides)
    return Recipe(
        str(data.get("name", path.stem)), str(data.get("description", "")), config, str(path), overrides
    )


def apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected section.key=value, e.g. scheduler.max_num_seqs=32")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_config(data: dict[str, Any], source: str, overrides: list[str] | None = None) -> EngineConfig:
    _reject_bools(EngineConfig, data, "", source, overrides or [])
    try:
        config = TypeAdapter(EngineConfig).validate_python(data, strict=False)
    except ValidationError as exc:
        raise RecipeError(_one_line(exc, source, overrides)) from None
    return config


def _one_line(exc: ValidationError, source: str, overrides: list[str] | None) -> str:
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"])
    origin = source
    if overrides and any(_related(o.split("=", 1)[0].strip(), path) for o in overrides):
        origin = "--set"
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        section = _section_for(err["loc"][:-1])
        expected = ", ".join(f.name for f in dataclasses.fields(section)) if section else ""
        msg = f"{origin}: unknown key '{path}' (expected one of: {expected})"
    else:
        msg = f"{origin}: {path}: {err['msg']} (got {err.get('input')!r})"
    more = len(exc.errors()) - 1
    return msg + (f" [+{more} more]" if more else "")


def _related(key: str, path: str) -> bool:
    """An override `key` explains an error at `path` if one is a prefix of the other (`bogus.key` makes
    `bogus` unknown; `capture_sizes=[1, x]` fails at `capture_sizes.1`)."""
    return key == path or key.startswith(path + ".") or path.startswith(key + ".")


def _reject_bools(obj_cls: type, data: Any, path: str, source: str, overrides: list[str]) -> None:
    """pydantic's lax mode reads `true` as 1 for an int field; a bool is only accepted for bool fields."""
    if not isinstance(data, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(obj_cls)}
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            continue
        if dataclasses.is_dataclass(f.default_factory) if callable(f.default_factory) else False:
            _reject_bools(f.default_factory, value, f"{path}{key}.", source, overrides)  # type: ignore[arg-type]
        elif isinstance(value, bool) and "bool" not in str(f.type):
            where = path + key
            origin = (
                "--set" if any(_related(o.split("=", 1)[0].strip(), where) for o in overrides) else source
            )
            raise RecipeError(f"{origin}: {where}: expected {f.type}, got a boolean ({value!r})")


def _section_for(loc) -> type | None:
    cls: type = EngineConfig
    for part in loc:
        field = {f.name: f for f in dataclasses.fields(cls)}.get(str(part))
        if field is None or not isinstance(field.default_factory, type):  # type: ignore[arg-type]
            return None
        cls = field.default_factory  # type: ignore[assignment]
    return cls


def config_from_overrides(overrides: list[str]) -> EngineConfig:
    """An EngineConfig from defaults plus `--set` items (no recipe file)."""
    data: dict = {}
    for item in overrides:
        apply_override(data, item)
    return build_config(data, "--set", overrides)
