"""The house's figures, measured from the code and its import graph.

    python bench/house_metrics.py [--root DIR] [--json] [--trace] [--trace-cuda] [--out FILE.json]

Static part (pure `ast`, nothing of the package is imported):

- Module import graph of `DIR/looptrace`, imports inside functions included (kind "lazy"), imports under
  `if TYPE_CHECKING:` included (kind "typing"), everything else "eager". `from a.b import c` points at
  `a.b.c` when that is a module, else at `a.b`. A parent package's `__init__` is not an implied edge (that
  would make every package with an `__init__` that imports its children a circle).
- Floors: engine (`looptrace/engine/**`) = 0; `looptrace/recipes.py`, `looptrace/build.py` and the other
  top-level modules = 1, except a top-level module that the engine imports, which sits on the engine's
  floor (0); the client packages drive, probes, analysis, serve, tui, train = 2; cli and
  `looptrace/__main__.py` (the CLI's entry point) = 3; `looptrace/assets` (shipped checkpoints) = 1. A
  package not named here counts as a client (2) and
  is listed under "unassigned".
- Upward arrows: an import from a lower floor to a higher one; inside the engine, `engine/kernels/*`
  importing `engine/layers.py` or `engine/models/*`.
- Circles: strongly connected components of size > 1 of the module graph (all kinds of edges), each with
  the edges inside it, and whether it survives with eager edges only.
- `getattr(` into engine objects outside `engine/`, a heuristic, so every hit is printed with file:line:
  a `getattr(obj, "name", ...)` call is a hit when a name in `obj`'s name/attribute chain, split on "_",
  has a part among ENGINE_WORDS (engine, runner, blocks, layout, scheduler, request, req, e) -- a name
  bound by `except ... as e` in the same function does not count -- or when "name" is a known engine
  attribute: an attribute, method or field that classes under `engine/` define and that no class or
  function outside `engine/` defines (so generic names like "config" do not count).
- Reaches into engine internals outside `engine/`: attribute chains with `engine.runner`, `engine.blocks`,
  `.scheduler.` (scheduler in the middle of a chain), `.cfg` or `.requests` right after a part that
  mentions the engine (`engine.cfg.scheduler.max_num_seqs`, `setup.engine.requests[i]`: clients read
  `snapshot()` and `request_view(id)`), or a private `._x` attribute after a part that mentions the engine
  (ENGINE_WORDS as above).
- Engines constructed outside `build.py` and `engine/`: calls of `LLMEngine(...)` or of its constructors
  (`.from_preset(`, `.from_spec(`, `.from_checkpoint(`); `build.build` is the one builder.
- Branch sites on recipe settings in `engine/llm_engine.py` and `engine/runner.py`: tests of `if`, `while`,
  ternaries and comprehension filters, and `and`/`or` expressions outside them, that read a recipe
  setting: a chain with `<section>.<field>` of EngineConfig (sections and fields parsed from the engine's
  config module), a chain where a part containing "cfg"/"config" is followed by a section or field, a
  local alias or `self.<attr>` assigned from such a read (a direct read or a boolean expression over
  one), or `self.<bool field name>`.
- The engine's kernels: reads of the recipe's `kernels` section (`cfg.kernels`, `self.cfg.kernels`, ...)
  and where they are (the plan should be the only reader); branch tests in `engine/models/` and
  `engine/layers.py` that read a switch on `self` (a class-level boolean, or an attribute a method other
  than `__init__` assigns), apart from a variant's fallback (a test calling `exact_kernels_on` or a
  `*_fusable` check); module globals rebound through `global` in `engine/`; methods and lines of
  `LLMEngine` and `ModelRunner`, lines of `LLMEngine.step`; function-level imports (lazy edges).
- Function-level import statements of any package (not only looptrace's), each with its `# deferred: why`
  comment (on the import, or on a comment line of the run of imports right above it); one that names no
  reason is listed as such.
- The kernel wing (`engine/kernels/`): lines per file; private cross-imports (a kernel file importing a
  sibling's private name, `from .x import _y`, a private sibling module `_x`, or reading `x._y` of a sibling
  module it imported); the functions of `kernels/__init__.py` and, of them, the forwarders (a body of
  imports and one call returned or made, after at most `if ...: return <constant>` guards).
- Branches on request events: per engine function, the `Event.NAME` values compared (`==`, `is`); the
  request lifecycle is a table of handlers, so the largest should stay at most 1.
- Lines per package, functions over 40 lines in cli/, the five longest functions per package.
- Duplicated regions: lines normalised (stripped, inner whitespace collapsed; blank, comment and import
  lines dropped), windows of 6 normalised lines hashed, matching windows extended to maximal regions; each
  copy after the first is one region; the 10 largest are listed.

CUDA part (`--trace-cuda`, on a machine with a GPU): the files called during one decode step of
recipe `fast` on ouro-tiny (one request, after the warm-up steps that capture its graphs).

Dynamic part (`--trace`): in a subprocess with PYTHONPATH=DIR (so the package under DIR is the one
traced), `sys.setprofile` records which looptrace source files had functions called during (a)
`looptrace diff base exactloop --device cpu` and (b) `looptrace run --device cpu -c 1` (one request, the
engine built the way `run` builds it); both go through the CLI's `main()`. For (b) the files called while
an `LLMEngine.add_request`/`step` frame is on the stack are reported apart ("engine path"). Module and class
bodies run by an import are not function calls: they are counted apart as files imported. A climb is a
call whose nearest looptrace caller sits on a lower floor than the callee (e.g. the engine calling a probe's
hook); climbs are counted and listed per (caller file, callee file).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = "looptrace"
CLIENT_PACKAGES = ("drive", "probes", "analysis", "serve", "tui", "train")
FIXED_FLOORS = {"engine": 0, "recipes": 1, "build": 1, "assets": 1, "cli": 3, "__main__": 3}
FIXED_FLOORS.update({name: 2 for name in CLIENT_PACKAGES})
FLOOR_NAMES = {0: "engine", 1: "core", 2: "client", 3: "cli"}
ENGINE_WORDS = frozenset({"engine", "runner", "blocks", "layout", "scheduler", "request", "req", "e"})
BRANCH_FILES = ("looptrace/engine/llm_engine.py", "looptrace/engine/runner.py")
LONG_FUNCTION_LINES = 40
DUPLICATE_WINDOW = 6
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- modules


@dataclass
class Module:
    name: str  # dotted: looptrace.engine.runner
    rel: str  # looptrace/engine/runner.py
    is_package: bool
    tree: ast.Module
    text: str

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    @property
    def package(self) -> str:
        """The first part under looptrace ("engine", "recipes"); "looptrace" for the package's __init__."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else PACKAGE

    @property
    def in_engine(self) -> bool:
        return self.package == "engine"


def load_modules(root: Path) -> dict[str, Module]:
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel[: -len(".py")].split("/")
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = path.read_text(encoding="utf-8")
        modules[name] = Module(name, rel, is_package, ast.parse(text, rel), text)
    return modules


# ----------------------------------------------------------------------------------------- import graph


@dataclass(frozen=True)
class ImportEdge:
    src: str
    dst: str
    line: int
    kind: str  # "eager" | "lazy" (inside a function) | "typing" (under TYPE_CHECKING)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: Module, known: set[str]) -> None:
        self.module, self.known = module, known
        self.function_depth = 0
        self.typing_depth = 0
        self.edges: list[ImportEdge] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def generic_visit(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):  # imports are statements: skip the expressions
            if not isinstance(child, ast.expr):
                self.visit(child)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.typing_depth += 1
        for stmt in node.body:
            self.visit(stmt)
        self.typing_depth -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node)
        for alias in node.names:
            child = f"{base}.{alias.name}"
            self._add(child if child in self.known else base, node.lineno)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.module.name.split(".")
        package = parts if self.module.is_package else parts[:-1]
        base = package[: len(package) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _add(self, name: str, line: int) -> None:
        while name not in self.known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name not in self.known or name == self.module.name:
            return
        kind = "typing" if self.typing_depth else "lazy" if self.function_depth else "eager"
        self.edges.append(ImportEdge(self.module.name, name, line, kind))


def import_edges(modules: dict[str, Module]) -> list[ImportEdge]:
    known = set(modules)
    edges: dict[ImportEdge, None] = {}  # `from a import (b, c)` is one edge, in file order
    for module in modules.values():
        collector = _ImportCollector(module, known)
        collector.visit(module.tree)
        edges.update(dict.fromkeys(collector.edges))
    return list(edges)


# ----------------------------------------------------------------------------------------------- floors


def module_floors(modules: dict[str, Module], edges: list[ImportEdge]) -> tuple[dict[str, int], list[str]]:
    """Floor of every module, and the packages that no rule names (counted as clients)."""
    engine_imports = {e.dst for e in edges if modules[e.src].in_engine and not modules[e.dst].in_engine}
    floors, unassigned = {}, set()
    for name, module in modules.items():
        top = module.package
        top_level_module = name.count(".") <= 1 and not (module.is_package and name != PACKAGE)
        if top in FIXED_FLOORS:
            floors[name] = FIXED_FLOORS[top]
        elif top_level_module:
            floors[name] = 0 if name in engine_imports else 1
        else:
            floors[name] = 2
            unassigned.add(top)
    return floors, sorted(unassigned)


def upward_arrows(edges: list[ImportEdge], floors: dict[str, int]) -> list[dict]:
    arrows = []
    for edge in edges:
        reason = None
        if floors[edge.src] < floors[edge.dst]:
            reason = f"floor {floors[edge.src]} -> {floors[edge.dst]}"
        elif edge.src.startswith("looptrace.engine.kernels") and (
            edge.dst == "looptrace.engine.layers" or edge.dst.startswith("looptrace.engine.models")
        ):
            reason = "engine kernels -> layers/models"
        if reason:
            arrows.append({**asdict(edge), "reason": reason})
    return arrows


# ---------------------------------------------------------------------------------------------- circles


def strongly_connected(nodes: list[str], graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of size > 1, each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(nodes) + 100))
    for node in nodes:
        if node not in index:
            visit(node)
    return sorted(components, key=lambda c: (-len(c), c))


def _graph(edges: list[ImportEdge], kinds: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        if edge.kind in kinds:
            graph[edge.src].add(edge.dst)
    return graph


def import_circles(modules: dict[str, Module], edges: list[ImportEdge]) -> list[dict]:
    nodes = sorted(modules)
    eager = strongly_connected(nodes, _graph(edges, {"eager"}))
    circles = []
    for component in strongly_connected(nodes, _graph(edges, {"eager", "lazy", "typing"})):
        members = set(component)
        inside = [asdict(e) for e in edges if e.src in members and e.dst in members]
        eager_only = any(members >= set(c) for c in eager)
        circles.append({"modules": component, "edges": inside, "survives_eager_only": eager_only})
    return circles


# ---------------------------------------------------------------------------------------- engine reaches


def attribute_chain(node: ast.AST) -> list[str]:
    """`a.b().c[0].d` -> ["a", "b", "()", "c", "[]", "d"]; [] for anything else at the root."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return attribute_chain(node.value) + [node.attr]
    if isinstance(node, ast.Call):
        return attribute_chain(node.func) + ["()"]
    if isinstance(node, ast.Subscript):
        return attribute_chain(node.value) + ["[]"]
    return []


def mentions_engine(names: list[str], exception_names: frozenset[str] = frozenset()) -> bool:
    return any(
        part in ENGINE_WORDS
        for name in names
        if name not in exception_names
        for part in name.split("_")
        if part
    )


def _defined_names(tree: ast.Module, classes_only: bool) -> set[str]:
    """Methods, class fields and `self.x =` attributes of classes (and, unless classes_only, functions)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
        elif not classes_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return names


def engine_attribute_names(modules: dict[str, Module], candidates: set[str]) -> set[str]:
    """Which of `candidates` are engine attributes; only files whose text holds a candidate are parsed."""
    inside, outside = set(), set()
    for module in modules.values():
        if not any(name in module.text for name in candidates):
            continue
        if module.in_engine:
            inside |= _defined_names(module.tree, classes_only=True)
        else:
            outside |= _defined_names(module.tree, classes_only=False)
    return {n for n in (inside - outside) & candidates if not (n.startswith("__") and n.endswith("__"))}


def _exception_names(function: ast.AST) -> frozenset[str]:
    return frozenset(
        node.name for node in ast.walk(function) if isinstance(node, ast.ExceptHandler) and node.name
    )


def _scopes(tree: ast.Module) -> Iterator[tuple[ast.AST, frozenset[str]]]:
    """Every node, with the `except ... as NAME` names of its innermost function (module level: none)."""
    stack: list[tuple[ast.AST, frozenset[str]]] = [(tree, frozenset())]
    while stack:
        node, names = stack.pop()
        yield node, names
        for child in ast.iter_child_nodes(node):
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.append((child, _exception_names(child) if is_function else names))


def _is_getattr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
    )


def _attribute_string(call: ast.Call) -> str | None:
    name = call.args[1]
    return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def _getattr_reason(call: ast.Call, known: set[str], exception_names: frozenset[str]) -> str | None:
    chain = attribute_chain(call.args[0])
    if chain[:1] and chain[0] in exception_names:  # a caught exception, not an engine object
        return None
    if mentions_engine(chain):
        return f"object {'.'.join(chain)} mentions the engine"
    name = _attribute_string(call)
    return f"{name!r} is an engine attribute" if name in known else None


def _hit(module: Module, node: ast.AST, reason: str) -> dict:
    text = module.lines[node.lineno - 1].strip()
    return {"where": f"{module.rel}:{node.lineno}", "reason": reason, "code": text}


def getattr_hits(modules: dict[str, Module]) -> list[dict]:
    calls = [
        (module, node, exception_names)
        for module in modules.values()
        if not module.in_engine and "getattr(" in module.text
        for node, exception_names in _scopes(module.tree)
        if _is_getattr(node)
    ]
    known = engine_attribute_names(modules, {_attribute_string(c) for _, c, _ in calls} - {None})
    hits = []
    for module, call, exception_names in calls:
        reason = _getattr_reason(call, known, exception_names)
        if reason:
            hits.append(_hit(module, call, reason))
    return sorted(hits, key=lambda h: _where_key(h["where"]))


def _where_key(where: str) -> tuple[str, int]:
    path, line = where.rsplit(":", 1)
    return path, int(line)


# An engine's attributes that clients read through `snapshot()` / `request_view()` instead: its config
# (`snapshot().limits`) and its request records (`request_view(id)`).
ENGINE_PRIVATE_READS = ("cfg", "requests")


def _reach_reason(chain: list[str]) -> str | None:
    for i, part in enumerate(chain[1:], 1):
        before = chain[i - 1]
        if before == "engine" and part in ("runner", "blocks"):
            return f"engine.{part}"
        if part in ENGINE_PRIVATE_READS and mentions_engine([before]):
            return f"{before}.{part} of an engine object"
        if part == "scheduler" and i < len(chain) - 1 and not _names_config(before):
            return ".scheduler."  # the Scheduler object; `cfg.scheduler.x` is a recipe setting
        private = part.startswith("_") and not part.startswith("__")
        if private and mentions_engine(chain[:i]):
            return f"private {part} of an engine object"
    return None


def _names_config(name: str) -> bool:
    return "cfg" in name.lower() or "config" in name.lower()


def engine_reaches(modules: dict[str, Module]) -> list[dict]:
    hits = []
    for module in modules.values():
        if module.in_engine:
            continue
        inner = set()  # Attribute nodes that are the value of another: only the outermost chain counts
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute):
                for sub in ast.walk(node.value):
                    inner.add(id(sub))
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = attribute_chain(node)
                reason = _reach_reason(chain)
                if reason:
                    hits.append({**_hit(module, node, reason), "chain": ".".join(chain)})
    return sorted(hits, key=lambda h: _where_key(h["where"]))


ENGINE_CLASS = "LLMEngine"
ENGINE_CONSTRUCTORS = ("from_preset", "from_spec", "from_checkpoint")  # LLMEngine's classmethods
BUILD_FILE = "looptrace/build.py"


def engine_constructions(modules: dict[str, Module]) -> list[dict]:
    """Engines built outside `build.py` and engine/: a call of `LLMEngine(...)` or of one of its
    constructors (`X.from_preset(...)`, `X.from_spec(...)`, `X.from_checkpoint(...)`). Every command, the
    server and the clients build through `build.build`, so each is built one way."""
    hits = []
    for module in modules.values():
        if module.in_engine or module.rel == BUILD_FILE:
            continue
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == ENGINE_CLASS:
                hits.append(_hit(module, node, f"{ENGINE_CLASS}("))
            elif isinstance(func, ast.Attribute) and func.attr in ENGINE_CONSTRUCTORS:
                hits.append(_hit(module, node, f".{func.attr}("))
    return sorted(hits, key=lambda h: _where_key(h["where"]))


# ------------------------------------------------------------------------------------- recipe branches


@dataclass
class ConfigSchema:
    sections: dict[str, set[str]]  # EngineConfig field -> the fields of its section dataclass
    top_fields: set[str]  # EngineConfig fields that are plain settings (noise)
    bool_fields: set[str]  # every field annotated `bool`

    @property
    def all_fields(self) -> set[str]:
        return set(self.sections) | self.top_fields | {f for s in self.sections.values() for f in s}


def _class_fields(node: ast.ClassDef) -> dict[str, str]:
    return {
        item.target.id: ast.unparse(item.annotation)
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }


def config_schema(modules: dict[str, Module]) -> ConfigSchema:
    """Sections and fields of EngineConfig, wherever in engine/ it is defined."""
    classes = {
        node.name: _class_fields(node)
        for module in modules.values()
        if module.in_engine
        for node in ast.walk(module.tree)
        if isinstance(node, ast.ClassDef)
    }
    top = classes.get("EngineConfig", {})
    sections = {name: set(classes[kind]) for name, kind in top.items() if kind in classes}
    bools = {f for fields in classes.values() for f, kind in fields.items() if kind == "bool"}
    return ConfigSchema(sections, set(top) - set(sections), bools)


class _RecipeReads:
    """Which expressions of one file read a recipe setting (see the module docstring)."""

    def __init__(self, schema: ConfigSchema, tree: ast.Module) -> None:
        self.schema = schema
        self.toggles: set[str] = set()  # "self.x" or a local name derived from a setting
        for _ in range(3):  # derived toggles of derived toggles
            self._collect_toggles(tree)

    def chain_reads(self, chain: list[str]) -> bool:
        sections, fields = self.schema.sections, self.schema.all_fields
        for i, part in enumerate(chain[:-1]):
            nxt = chain[i + 1]
            if part in sections and nxt in sections[part]:
                return True
            if _names_config(part) and nxt in fields:
                return True
        head = ".".join(chain[:2]) if chain[:1] == ["self"] else chain[0] if chain else ""
        bool_attr = chain[:1] == ["self"] and len(chain) > 1 and chain[1] in self.schema.bool_fields
        return head in self.toggles or bool_attr

    def reads(self, expr: ast.AST) -> list[str]:
        found = []
        for node in ast.walk(expr):
            if isinstance(node, (ast.Attribute, ast.Name)):
                chain = attribute_chain(node)
                if chain and self.chain_reads(chain):
                    found.append(".".join(chain))
        # `cfg.kernels` is part of `cfg.kernels.exact`: name the longest chain only
        return sorted({f for f in found if not any(g.startswith(f + ".") for g in found)})

    def _collect_toggles(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target, value = node.targets[0], node.value
            direct = isinstance(value, (ast.Attribute, ast.Name)) and self.chain_reads(attribute_chain(value))
            # `x or default` picks a value, not a toggle: only `and`, comparisons and `not` derive one
            boolean = _is_boolean(value) and self.reads(value)
            if direct or boolean:
                chain = attribute_chain(target)
                if chain[:1] == ["self"] and len(chain) == 2 or len(chain) == 1:
                    self.toggles.add(".".join(chain))


def _is_boolean(value: ast.expr) -> bool:
    if isinstance(value, ast.BoolOp):
        return isinstance(value.op, ast.And)
    return isinstance(value, ast.Compare) or (
        isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not)
    )


def _branch_tests(tree: ast.Module) -> list[ast.expr]:
    """Tests of if/while/ternary/comprehension filters, then and/or expressions outside any test."""
    tests: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    covered = {id(sub) for test in tests for sub in ast.walk(test)}
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and id(node) not in covered:
            tests.append(node)
            covered |= {id(sub) for sub in ast.walk(node)}
    return tests


def recipe_branch_sites(modules: dict[str, Module]) -> dict[str, list[dict]]:
    schema = config_schema(modules)
    by_rel = {m.rel: m for m in modules.values()}
    sites: dict[str, list[dict]] = {}
    for rel in BRANCH_FILES:
        module = by_rel.get(rel)
        if module is None:
            continue
        reads = _RecipeReads(schema, module.tree)
        hits = []
        for test in _branch_tests(module.tree):
            names = reads.reads(test)
            if names:
                hits.append({**_hit(module, test, ", ".join(names)), "line": test.lineno})
        sites[rel] = [
            {k: v for k, v in h.items() if k != "line"} for h in sorted(hits, key=lambda h: h["line"])
        ]
    return sites


# --------------------------------------------------------------------------------- the engine's kernels

PLAN_FILE = "looptrace/engine/plan.py"
MODEL_FILES_PREFIX = ("looptrace/engine/models/", "looptrace/engine/layers.py")
FALLBACK_CALLS = ("exact_kernels_on",)  # a variant's own scope test (row count, capture); also `*_fusable`
GOD_CLASSES = {"LLMEngine": "looptrace/engine/llm_engine.py", "ModelRunner": "looptrace/engine/runner.py"}


def kernel_setting_reads(modules: dict[str, Module]) -> list[dict]:
    """Reads of the recipe's `kernels` section: an attribute `kernels` right after a name or attribute that
    names a config (`cfg.kernels`, `self.cfg.kernels`, `config.kernels`), anywhere in the package."""
    hits = []
    for module in sorted(modules.values(), key=lambda m: m.rel):
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute) and node.attr == "kernels":
                chain = attribute_chain(node.value)
                if chain and _names_config(chain[-1]):
                    hits.append(
                        {**_hit(module, node, "reads " + ".".join([*chain, "kernels"])), "rel": module.rel}
                    )
    return hits


def _toggle_names(module: Module) -> set[str]:
    """Switches a model module may carry: class-level booleans (`exact = False`) and attributes that a
    method other than `__init__` assigns on `self` (set from outside, e.g. by `fuse_projections`)."""
    names: set[str] = set()
    for cls in [n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef)]:
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and isinstance(getattr(stmt.value, "value", None), bool):
                names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
            if isinstance(stmt, ast.FunctionDef) and stmt.name != "__init__":
                for node in ast.walk(stmt):
                    if isinstance(node, (ast.Assign, ast.AugAssign)):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        for t in targets:
                            if isinstance(t, ast.Attribute) and attribute_chain(t.value) == ["self"]:
                                names.add(t.attr)
    return names


def toggle_branch_sites(modules: dict[str, Module]) -> dict[str, list[dict]]:
    """Branch tests in `engine/models/` and `engine/layers.py` that read a switch on `self` (see
    `_toggle_names`, gathered over all those files: `self.exact`, `self.paged.triton`, `self.qkv is not
    None`), apart from the variants' fallbacks: tests that call `exact_kernels_on` (the exact kernels' scope)
    or a `*_fusable` check (the shapes a fused kernel takes)."""
    files = [m for m in modules.values() if m.rel.startswith(MODEL_FILES_PREFIX)]
    toggles = set().union(*(_toggle_names(m) for m in files)) if files else set()
    # PendingNorm.h: the residual stream a consumer records; private names: caches built on first use
    toggles = {name for name in toggles if name != "h" and not name.startswith("_")}
    out: dict[str, list[dict]] = {"toggles": [], "fallbacks": []}
    for module in sorted(files, key=lambda m: m.rel):
        for test in _branch_tests(module.tree):
            calls = {
                attribute_chain(n.func)[-1:] and attribute_chain(n.func)[-1]
                for n in ast.walk(test)
                if isinstance(n, ast.Call)
            }
            passed = {
                id(sub)
                for n in ast.walk(test)
                if isinstance(n, ast.Call)
                for a in n.args
                for sub in ast.walk(a)
            }  # an argument of a call is data, not a switch tested
            read = sorted(
                n.attr
                for n in ast.walk(test)
                if isinstance(n, ast.Attribute) and id(n) not in passed
                if attribute_chain(n)[:1] == ["self"] and n.attr in toggles
            )
            if read:  # a switch read, whatever else the test does
                out["toggles"].append(_hit(module, test, "reads self." + ", self.".join(read)))
            elif calls & set(FALLBACK_CALLS) or any(c.endswith("_fusable") for c in calls if c):
                out["fallbacks"].append(_hit(module, test, "variant fallback"))
    return out


def launch_globals(modules: dict[str, Module]) -> list[dict]:
    """Module-level names rebound through a `global` statement inside a function of `engine/` (process
    state flipped at run time, such as a launch mode)."""
    hits = []
    for module in sorted(modules.values(), key=lambda m: m.rel):
        if not module.in_engine:
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Global):
                hits.extend(_hit(module, node, f"global {name}") for name in node.names)
    return hits


def class_sizes(modules: dict[str, Module]) -> dict[str, dict]:
    """Methods and lines of the engine's two big classes, and the lines of `LLMEngine.step`."""
    by_rel = {m.rel: m for m in modules.values()}
    out = {}
    for name, rel in GOD_CLASSES.items():
        module = by_rel.get(rel)
        cls = module and next(
            (n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef) and n.name == name), None
        )
        if cls is None:
            continue
        methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        out[name] = {"methods": len(methods), "lines": cls.end_lineno - cls.lineno + 1}
        step = next((m for m in methods if m.name == "step"), None)
        if step is not None:
            out[name]["step_lines"] = step.end_lineno - step.lineno + 1
    return out


# ---------------------------------------------------------------------------------- function-level imports

DEFERRED_MARK = "# deferred:"


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


def _deferred_reason(module: Module, node: ast.stmt, import_lines: set[int]) -> str | None:
    """The `# deferred: why` on the import's own lines, or on a comment line of the run of imports,
    comments and blank lines right above it (one reason covers a group of imports)."""
    lines = module.lines
    for number in range(node.lineno, node.end_lineno + 1):
        if DEFERRED_MARK in lines[number - 1]:
            return lines[number - 1].split(DEFERRED_MARK, 1)[1].strip()
    number = node.lineno - 1
    while number >= 1 and _in_import_run(lines[number - 1], number, import_lines):
        if DEFERRED_MARK in lines[number - 1]:
            return lines[number - 1].split(DEFERRED_MARK, 1)[1].strip()
        number -= 1
    return None


def _in_import_run(text: str, number: int, import_lines: set[int]) -> bool:
    """An import, a comment or a blank line (isort parts a group of imports by package kind)."""
    return number in import_lines or not text.strip() or text.strip().startswith("#")


def function_level_imports(modules: dict[str, Module]) -> list[dict]:
    """Every `import` / `from ... import` statement inside a function (of any package, not only looptrace's)
    with the reason it is deferred (`# deferred: ...`, None if it gives none)."""
    out = []
    for module in modules.values():
        nodes = _function_imports(module.tree)
        import_lines = {n for node in nodes for n in range(node.lineno, node.end_lineno + 1)}
        for node in nodes:
            target = (
                node.names[0].name if isinstance(node, ast.Import) else "." * node.level + (node.module or "")
            )
            out.append(
                {
                    "where": f"{module.rel}:{node.lineno}",
                    "module": target,
                    "reason": _deferred_reason(module, node, import_lines),
                }
            )
    return sorted(out, key=lambda h: _where_key(h["where"]))


# ------------------------------------------------------------------------------------ the kernel wing

KERNELS = "looptrace.engine.kernels"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _kernel_module_of_import(module: Module, node: ast.ImportFrom) -> str:
    """The dotted module an `ImportFrom` in a kernel file names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def private_kernel_imports(modules: dict[str, Module]) -> list[dict]:
    """Each place a file under engine/kernels/ takes a private name of another kernel file: `from x import
    _y`, an import of a private module `_x`, or an attribute read `x._y` of a kernel module it imported."""
    hits = []
    for module in sorted(modules.values(), key=lambda m: m.rel):
        if not module.name.startswith(KERNELS):
            continue
        kernel_aliases: set[str] = set()  # local names bound to another kernel module
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                source = _kernel_module_of_import(module, node)
                if not source.startswith(KERNELS) or source == module.name:
                    continue
                if any(_is_private(part) for part in source.split(".")):
                    hits.append(_hit(module, node, f"imports from private module {source}"))
                for alias in node.names:
                    if _is_private(alias.name):
                        hits.append(_hit(module, node, f"imports {source}.{alias.name}"))
                    if f"{source}.{alias.name}" in modules:
                        kernel_aliases.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(KERNELS) and alias.name != module.name:
                        if any(_is_private(part) for part in alias.name.split(".")):
                            hits.append(_hit(module, node, f"imports private module {alias.name}"))
                        if alias.asname:
                            kernel_aliases.add(alias.asname)
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in kernel_aliases
                and _is_private(node.attr)
            ):
                hits.append(_hit(module, node, f"reads {node.value.id}.{node.attr}"))
    return hits


def _is_forwarder(function: ast.FunctionDef) -> bool:
    """A body of imports and one call (returned or made), after at most `if ...: return <constant>`
    guards; the docstring aside."""
    body = [n for n in function.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    while body and isinstance(body[0], ast.If) and not body[0].orelse:
        guard = body[0].body
        returns_constant = isinstance(guard[0], ast.Return) and isinstance(guard[0].value, ast.Constant)
        if len(guard) != 1 or not returns_constant:
            break
        body = body[1:]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    if not imports or not rest or isinstance(rest[-1], (ast.Import, ast.ImportFrom)):
        return False
    calls = [n for n in rest if isinstance(n, (ast.Return, ast.Expr)) and isinstance(n.value, ast.Call)]
    return len(rest) == len(calls) == 1


def kernel_wing(modules: dict[str, Module]) -> dict:
    """Lines per file of engine/kernels/, private cross-imports between its files, and the functions of
    its `__init__.py` with the forwarders among them."""
    wing = sorted((m for m in modules.values() if m.name.startswith(KERNELS)), key=lambda m: m.rel)
    files = {m.rel: len(m.lines) for m in wing}
    init = modules.get(KERNELS)
    functions = [n for n in init.tree.body if isinstance(n, ast.FunctionDef)] if init else []
    return {
        "lines": files,
        "private_imports": private_kernel_imports(modules),
        "facade_functions": [f.name for f in functions],
        "forwarders": [f.name for f in functions if _is_forwarder(f)],
    }


def event_switches(modules: dict[str, Module]) -> list[dict]:
    """Functions of the engine that branch on a request event: each `x == Event.NAME` (or `is`, `!=`)
    comparison is one branch; one entry per function with any, largest first. The request lifecycle as a
    table of handlers (engine/request_events.py) has none; the old `_advance` switch had 12."""
    out = []
    for module in modules.values():
        if not module.in_engine:
            continue
        for fn in ast.walk(module.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            events = {
                side.attr
                for node in ast.walk(fn)
                if isinstance(node, ast.Compare)
                for side in (node.left, *node.comparators)
                if isinstance(side, ast.Attribute)
                and isinstance(side.value, ast.Name)
                and side.value.id == "Event"
            }
            if events:
                out.append({"where": f"{module.rel}:{fn.lineno}", "function": fn.name, "events": len(events)})
    return sorted(out, key=lambda h: -h["events"])


# ------------------------------------------------------------------------------------ size and repeats


def lines_per_package(modules: dict[str, Module]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for module in modules.values():
        counts[module.package] += len(module.lines)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def functions(modules: dict[str, Module]) -> list[dict]:
    found = []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                found.append(
                    {
                        "where": f"{module.rel}:{node.lineno}",
                        "name": node.name,
                        "lines": length,
                        "package": module.package,
                    }
                )
    return sorted(found, key=lambda f: (-f["lines"], f["where"]))


def _normalised_lines(module: Module) -> list[tuple[int, str]]:
    import_lines = {
        line
        for node in ast.walk(module.tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for line in range(node.lineno, node.end_lineno + 1)
    }
    kept = []
    for number, text in enumerate(module.lines, 1):
        norm = " ".join(text.split())
        if norm and not norm.startswith("#") and number not in import_lines:
            kept.append((number, norm))
    return kept


def duplicated_regions(modules: dict[str, Module], top: int = 10) -> tuple[int, list[dict]]:
    files = {m.rel: _normalised_lines(m) for m in modules.values()}
    windows = {
        rel: [
            hash(tuple(t for _, t in lines[i : i + DUPLICATE_WINDOW]))
            for i in range(len(lines) - DUPLICATE_WINDOW + 1)
        ]
        for rel, lines in files.items()
    }
    places: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for rel, hashes in windows.items():
        for i, h in enumerate(hashes):
            places[h].append((rel, i))
    covered: set[tuple[str, int, str, int]] = set()
    regions = []
    for spots in places.values():
        first = spots[0]
        for other in spots[1:]:
            if (*first, *other) not in covered:
                regions.append(_extend_region(first, other, windows, files, covered))
    regions = [r for r in regions if r is not None]
    regions.sort(key=lambda r: -r["lines"])
    return len(regions), regions[:top]


def _extend_region(a, b, windows, files, covered) -> dict | None:
    (fa, ia), (fb, ib) = a, b
    if fa == fb and abs(ia - ib) < DUPLICATE_WINDOW:  # a run of repeated lines overlapping itself
        return None
    wa, wb = windows[fa], windows[fb]
    while ia > 0 and ib > 0 and wa[ia - 1] == wb[ib - 1]:
        ia, ib = ia - 1, ib - 1
    length = 0
    while ia + length < len(wa) and ib + length < len(wb) and wa[ia + length] == wb[ib + length]:
        covered.add((fa, ia + length, fb, ib + length))
        length += 1
    last = length + DUPLICATE_WINDOW - 2

    def span(rel: str, start: int) -> str:
        return f"{rel}:{files[rel][start][0]}-{files[rel][start + last][0]}"

    return {"lines": last + 1, "first": span(fa, ia), "copy": span(fb, ib)}


# ---------------------------------------------------------------------------------------------- analysis


def analyse(root: Path) -> dict:
    modules = load_modules(root)
    edges = import_edges(modules)
    floors, unassigned = module_floors(modules, edges)
    all_functions = functions(modules)
    duplicates, largest = duplicated_regions(modules)
    branch_sites = recipe_branch_sites(modules)
    kernel_reads = kernel_setting_reads(modules)
    return {
        "root": str(root),
        "modules": len(modules),
        "lines": lines_per_package(modules),
        "import_edges": {kind: sum(e.kind == kind for e in edges) for kind in ("eager", "lazy", "typing")},
        "lazy_imports": [asdict(e) for e in edges if e.kind == "lazy"],
        "floors": floors,
        "unassigned_packages": unassigned,
        "circles": import_circles(modules, edges),
        "upward_arrows": upward_arrows(edges, floors),
        "engine_imports_clients": client_imports_of_engine(modules, edges),
        "getattr_into_engine": getattr_hits(modules),
        "engine_reaches": engine_reaches(modules),
        "engine_constructions": engine_constructions(modules),
        "recipe_branch_sites": branch_sites,
        "kernel_setting_reads": kernel_reads,
        "toggle_branch_sites": toggle_branch_sites(modules),
        "launch_globals": launch_globals(modules),
        "kernel_wing": kernel_wing(modules),
        "class_sizes": class_sizes(modules),
        "event_switches": event_switches(modules),
        "function_level_imports": function_level_imports(modules),
        "cli_functions_over_40": [
            f for f in all_functions if f["package"] == "cli" and f["lines"] > LONG_FUNCTION_LINES
        ],
        "longest_functions": longest_per_package(all_functions),
        "duplicated_regions": duplicates,
        "largest_duplicates": largest,
    }


def client_imports_of_engine(modules: dict[str, Module], edges: list[ImportEdge]) -> list[dict]:
    """Engine modules importing anything outside engine/ but a floor-0 top-level module (= upward)."""
    clients = set(CLIENT_PACKAGES) | {"cli", "__main__"}
    return [asdict(e) for e in edges if modules[e.src].in_engine and modules[e.dst].package in clients]


def longest_per_package(all_functions: list[dict], per_package: int = 5) -> dict[str, list[dict]]:
    longest: dict[str, list[dict]] = defaultdict(list)
    for function in all_functions:  # already longest first
        if len(longest[function["package"]]) < per_package:
            longest[function["package"]].append(function)
    return dict(longest)


# ------------------------------------------------------------------------------------------------ trace

TRACE_COMMANDS = {
    "diff": ["diff", "base", "exactloop", "--device", "cpu"],
    "run": [
        "run",
        "--device",
        "cpu",
        "-c",
        "1",
        "--prompt-len",
        "8",
        "--max-tokens",
        "4",
        "--format",
        "json",
    ],
}
CO_NEWLOCALS = 0x2  # inspect.CO_NEWLOCALS: set on functions, lambdas and comprehensions only
ENGINE_GATES = ("add_request", "step")  # LLMEngine methods that bound "the engine path" of a request


class CallRecorder:
    """A `sys.setprofile` hook: calls per looptrace file, per (nearest looptrace caller, callee) file pair,
    and the files called while an LLMEngine gate method is on the stack."""

    def __init__(self, package_dir: Path) -> None:
        self.prefix = str(package_dir.resolve()) + os.sep
        self.root = str(package_dir.resolve().parent) + os.sep
        self.files: dict[object, str] = {}  # code object -> relative path, "" outside the package
        self.calls: Counter[str] = Counter()
        self.imported: Counter[str] = Counter()  # module bodies run (imports), not function calls
        self.engine_path: Counter[str] = Counter()
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.inside_gate = 0

    def _file(self, code) -> str:
        rel = self.files.get(code)
        if rel is None:
            name = code.co_filename
            rel = name[len(self.root) :].replace(os.sep, "/") if name.startswith(self.prefix) else ""
            self.files[code] = rel
        return rel

    def _is_gate(self, code, rel: str) -> bool:
        return rel == "looptrace/engine/llm_engine.py" and code.co_name in ENGINE_GATES

    def __call__(self, frame, event: str, arg) -> None:
        if event != "call" and event != "return":
            return
        code = frame.f_code
        rel = self._file(code)
        if not rel:
            return
        if event == "return":
            self.inside_gate -= self._is_gate(code, rel)
            return
        if not code.co_flags & CO_NEWLOCALS:  # a module or class body: an import, not a call
            self.imported[rel] += code.co_name == "<module>"
            return
        self.inside_gate += self._is_gate(code, rel)
        self.calls[rel] += 1
        if self.inside_gate:
            self.engine_path[rel] += 1
        caller = self._looptrace_caller(frame.f_back)
        if caller and caller != rel:
            self.pairs[(caller, rel)] += 1

    def _looptrace_caller(self, frame) -> str:
        for _ in range(32):  # through torch's module __call__ and the like
            if frame is None:
                return ""
            rel = self._file(frame.f_code)
            if rel:
                return rel
            frame = frame.f_back
        return ""


def trace_child(kind: str, root: Path) -> dict:
    """Runs one CLI command under the recorder (in the subprocess that --trace starts)."""
    import threading

    import looptrace
    from looptrace.cli.main import main

    package_dir = Path(looptrace.__file__).resolve().parent
    if package_dir != (root / PACKAGE).resolve():
        raise SystemExit(f"traced {package_dir}, not the package under {root}")
    recorder = CallRecorder(package_dir)
    sys.argv = ["looptrace", *TRACE_COMMANDS[kind]]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        threading.setprofile(recorder)
        sys.setprofile(recorder)
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    return {
        "command": "looptrace " + " ".join(TRACE_COMMANDS[kind]),
        "exit_code": code,
        "output_tail": (out.getvalue() + err.getvalue())[-600:],
        "calls": dict(recorder.calls),
        "imported": sorted(recorder.imported),
        "engine_path": dict(recorder.engine_path),
        "pairs": [[a, b, n] for (a, b), n in recorder.pairs.items()],
    }


FAST_STEP_WARMUP = 12  # steps before the traced one: prefill, first tokens, every graph of one row captured


def trace_fast_step(root: Path) -> dict:
    """The files called during one decode step of recipe `fast` on CUDA (ouro-tiny, one request, after
    FAST_STEP_WARMUP steps, so the step replays its whole-token graph as a decode step does)."""
    import looptrace
    from looptrace.build import BuildRequest, build
    from looptrace.engine import SamplingParams

    package_dir = Path(looptrace.__file__).resolve().parent
    if package_dir != (root / PACKAGE).resolve():
        raise SystemExit(f"traced {package_dir}, not the package under {root}")
    sets = ("scheduler.max_model_len=256", "kv.num_blocks=2048")
    request = BuildRequest(
        model="ouro-tiny", random_weights=True, recipe="fast", sets=sets, device="cuda", seed=1
    )
    engine = build(request).engine
    engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=64))
    for _ in range(FAST_STEP_WARMUP):
        engine.step()
    recorder = CallRecorder(package_dir)
    sys.setprofile(recorder)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return {
        "command": "LLMEngine.step() of fast, ouro-tiny, CUDA, one decode row",
        "calls": dict(recorder.calls),
    }


def _floor_of_file(rel: str, floors: dict[str, int]) -> int:
    parts = rel[: -len(".py")].split("/")
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return floors.get(name, 2)


def run_trace(root: Path, floors: dict[str, int]) -> dict:
    traces = {}
    for kind in TRACE_COMMANDS:
        raw = _trace_subprocess(kind, root)
        climbs = [
            {"caller": a, "callee": b, "calls": n}
            for a, b, n in raw.pop("pairs")
            if _floor_of_file(a, floors) < _floor_of_file(b, floors)
        ]
        climbs.sort(key=lambda c: -c["calls"])
        raw["files"] = sorted(raw["calls"])
        raw["engine_path_files"] = sorted(raw["engine_path"])
        raw["climbs"] = sum(c["calls"] for c in climbs)
        raw["climb_pairs"] = climbs
        traces[kind] = raw
    return traces


def _trace_subprocess(kind: str, root: Path, cuda: bool = False) -> dict:
    # the package under `root` first; what the path held before (installed dependencies) after it
    paths = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "trace.json"
        command = [sys.executable, __file__, "--root", str(root), "--trace-child", kind, "--out", str(out)]
        done = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"trace of {kind} failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------------------------- report


def summary(result: dict) -> dict[str, int]:
    """The issue's figures, one number each."""
    figures = {
        "lines looptrace/cli": result["lines"].get("cli", 0),
        "lines looptrace (all)": sum(result["lines"].values()),
        "import circles": len(result["circles"]),
        "upward arrows": len(result["upward_arrows"]),
        "engine imports of client packages": len(result["engine_imports_clients"]),
        "getattr( into engine objects outside engine/": len(result["getattr_into_engine"]),
        "reaches into engine internals outside engine/": len(result["engine_reaches"]),
        "  of them reads of an engine's .cfg / .requests": sum(
            h["reason"].endswith(" of an engine object") for h in result["engine_reaches"]
        ),
        "engines constructed outside build.py and engine/": len(result["engine_constructions"]),
        "cli functions over 40 lines": len(result["cli_functions_over_40"]),
        "duplicated regions (6+ lines)": result["duplicated_regions"],
    }
    for rel, sites in result["recipe_branch_sites"].items():
        figures[f"recipe branch sites {rel.removeprefix('looptrace/')}"] = len(sites)
    reads = result["kernel_setting_reads"]
    figures["reads of cfg.kernels in engine/ outside plan.py"] = sum(
        h["rel"].startswith("looptrace/engine/") and h["rel"] != PLAN_FILE for h in reads
    )
    figures["reads of cfg.kernels outside engine/"] = sum(
        not h["rel"].startswith("looptrace/engine/") for h in reads
    )
    figures["toggle branch sites in engine/models + layers.py"] = len(
        result["toggle_branch_sites"]["toggles"]
    )
    figures["variant fallback sites (exact_kernels_on, *_fusable)"] = len(
        result["toggle_branch_sites"]["fallbacks"]
    )
    figures["module globals rebound in engine/ (global)"] = len(result["launch_globals"])
    figures["  of them in engine/kernels/launch_mode.py"] = sum(
        h["where"].startswith("looptrace/engine/kernels/launch_mode.py") for h in result["launch_globals"]
    )
    for name, size in result["class_sizes"].items():
        figures[f"{name} methods"] = size["methods"]
        figures[f"{name} lines"] = size["lines"]
        if "step_lines" in size:
            figures[f"{name}.step lines"] = size["step_lines"]
    switches = result["event_switches"]
    figures["largest branch on request events (events)"] = max((h["events"] for h in switches), default=0)
    figures["function-level imports (lazy edges)"] = result["import_edges"]["lazy"]
    deferred = result["function_level_imports"]
    figures["function-level import statements (any package)"] = len(deferred)
    figures["  of them without a # deferred: reason"] = sum(h["reason"] is None for h in deferred)
    wing = result["kernel_wing"]
    figures["lines engine/kernels (all files)"] = sum(wing["lines"].values())
    figures["files in engine/kernels"] = len(wing["lines"])
    figures["lines of the largest file in engine/kernels"] = max(wing["lines"].values(), default=0)
    figures["private cross-imports between kernel files"] = len(wing["private_imports"])
    figures["functions in kernels/__init__.py"] = len(wing["facade_functions"])
    figures["  of them forwarders"] = len(wing["forwarders"])
    if "fast_step" in result:
        figures["files crossed: one fast decode step (CUDA)"] = len(result["fast_step"]["calls"])
    for kind, trace in result.get("trace", {}).items():
        figures[f"files crossed: {kind}"] = len(trace["files"])
        if kind == "run":
            figures["files crossed: one request, engine path"] = len(trace["engine_path_files"])
        figures[f"climbs to a higher floor: {kind}"] = trace["climbs"]
    return figures


def _section(title: str, rows: list[str]) -> list[str]:
    return ["", f"## {title} ({len(rows)})", *[f"  {row}" for row in rows]]


def _edge_row(e: dict) -> str:
    return f"{e['src']} -> {e['dst']}  (line {e['line']}, {e['kind']})"


def render_text(result: dict) -> str:
    lines = [f"# house metrics of {result['root']} ({result['modules']} modules)", ""]
    width = max(len(k) for k in summary(result))
    lines += [f"{name:<{width}}  {value:>6}" for name, value in summary(result).items()]
    lines += ["", "## lines per package", *[f"  {p:<12} {n:>6}" for p, n in result["lines"].items()]]
    if result["unassigned_packages"]:
        lines += _section("unassigned packages (counted as clients)", result["unassigned_packages"])
    for circle in result["circles"]:
        eager = "survives eager-only" if circle["survives_eager_only"] else "only through lazy/typing imports"
        lines += _section(
            f"circle {', '.join(circle['modules'])} [{eager}]", [_edge_row(e) for e in circle["edges"]]
        )
    lines += _section("upward arrows", [f"{_edge_row(e)}: {e['reason']}" for e in result["upward_arrows"]])
    lines += _section("getattr( into engine objects", [_hit_row(h) for h in result["getattr_into_engine"]])
    lines += _section("reaches into engine internals", [_hit_row(h) for h in result["engine_reaches"]])
    lines += _section(
        "engines constructed outside build.py and engine/",
        [_hit_row(h) for h in result["engine_constructions"]],
    )
    for rel, sites in result["recipe_branch_sites"].items():
        lines += _section(f"recipe branch sites in {rel}", [_hit_row(h) for h in sites])
    lines += _section("reads of cfg.kernels", [_hit_row(h) for h in result["kernel_setting_reads"]])
    toggles = result["toggle_branch_sites"]
    lines += _section(
        "toggle branch sites in engine/models + layers.py", [_hit_row(h) for h in toggles["toggles"]]
    )
    lines += _section("variant fallback sites", [_hit_row(h) for h in toggles["fallbacks"]])
    lines += _section("module globals rebound in engine/", [_hit_row(h) for h in result["launch_globals"]])
    wing = result["kernel_wing"]
    lines += _section("lines per file in engine/kernels", [f"{n:>6}  {r}" for r, n in wing["lines"].items()])
    private = [_hit_row(h) for h in wing["private_imports"]]
    lines += _section("private cross-imports between kernel files", private)
    lines += _section("forwarders in kernels/__init__.py", wing["forwarders"])
    lines += _section(
        "cli functions over 40 lines", [_function_row(f) for f in result["cli_functions_over_40"]]
    )
    for package, longest in result["longest_functions"].items():
        lines += _section(f"longest functions in {package}", [_function_row(f) for f in longest])
    duplicates = [f"{d['lines']} lines: {d['first']} = {d['copy']}" for d in result["largest_duplicates"]]
    lines += _section(f"largest of {result['duplicated_regions']} duplicated regions", duplicates)
    lines += _section("lazy imports", [_edge_row(e) for e in result["lazy_imports"]])
    lines += _section(
        "function-level imports and why they are deferred",
        [
            f"{h['where']}: {h['module']}  | {h['reason'] or 'NO REASON GIVEN'}"
            for h in result["function_level_imports"]
        ],
    )
    for kind, trace in result.get("trace", {}).items():
        lines += _trace_rows(kind, trace)
    if "fast_step" in result:
        calls = result["fast_step"]["calls"]
        lines += _section(
            "files crossed by one fast decode step (CUDA)",
            [f"{n:>8} calls  {f}" for f, n in sorted(calls.items())],
        )
    return "\n".join(lines) + "\n"


def _hit_row(hit: dict) -> str:
    return f"{hit['where']}: {hit['reason']}  | {hit['code']}"


def _function_row(function: dict) -> str:
    return f"{function['lines']:>4}  {function['name']}  {function['where']}"


def _trace_rows(kind: str, trace: dict) -> list[str]:
    rows = [
        f"exit code {trace['exit_code']}; {len(trace['imported'])} files imported",
        *[f"{n:>8} calls  {f}" for f, n in sorted(trace["calls"].items())],
    ]
    lines = _section(f"trace {kind}: `{trace['command']}`, files crossed", rows)
    if kind == "run":
        lines += _section("trace run: files on the engine path of the request", trace["engine_path_files"])
    climbs = [f"{c['calls']:>8}  {c['caller']} -> {c['callee']}" for c in trace["climb_pairs"]]
    return lines + _section(f"trace {kind}: climbs to a higher floor, {trace['climbs']} calls", climbs)


# ------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository holding looptrace/")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the text report")
    parser.add_argument("--trace", action="store_true", help="also trace `diff` and one `run` request")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--trace-cuda", action="store_true", help="also trace one `fast` decode step on CUDA")
    parser.add_argument(
        "--trace-child", choices=[*sorted(TRACE_COMMANDS), "fast_step"], help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = args.root.resolve()
    if args.trace_child:
        child = (
            trace_fast_step(root) if args.trace_child == "fast_step" else trace_child(args.trace_child, root)
        )
        args.out.write_text(json.dumps(child))
        return
    result = analyse(root)
    if args.trace:
        result["trace"] = run_trace(root, result["floors"])
    if args.trace_cuda:
        result["fast_step"] = _trace_subprocess("fast_step", root, cuda=True)
    result["summary"] = summary(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1) if args.json else render_text(result), end="")


if __name__ == "__main__":
    main()
