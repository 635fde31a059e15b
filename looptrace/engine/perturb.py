"""`debug.perturb`: add one ulp to the output of one op at one place (a test aid for `looptrace diff`).

A place is `stage:loop:layer:op`, e.g. `prefill:1:core0:mlp`:

- stage: `prefill`, `prelude`, `recurrent`, `coda`, or `*` (any);
- loop: the 0-based loop index, `-` for work outside a loop (prelude layers, coda layers, head), `*` any;
- layer: `core0`, `prelude1`, `coda0` (a plain number means a core layer), `-` for ops outside any layer
  (Ouro's loop norm, the adapter, the head), `*` any;
- op: the op module's path inside its layer (`mlp`, `attn`, `attn.paged`, `input_layernorm_2`), or its full
  name outside layers (`model.norm`, `lm_head`), or its `op_kind` when that names one op of the layer
  (`mlp`, `attention`, `rope`).

The matching output gets `torch.nextafter(x, +inf)` on every floating element, or `debug.perturb_ulps`
times that step (in a recurrent step whose rows sit at different loops, only the rows at the named loop).
`OpTracker` is the shared machinery: an engine Observer that knows the current stage and loop, plus PyTorch
module hooks that know the current layer and call back on every op output; `looptrace diff --localize`
uses it to capture per-op outputs.

The engine installs a perturbation when built with the setting (`LLMEngine.__init__`); nothing is
registered otherwise. On CUDA it needs `cuda_graphs.enabled=false` (a captured graph would bake in the
place it matched at capture time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from looptrace.engine.hooks import Observer, StepInfo, StepResult
from looptrace.engine.request import EngineInputError

STAGES = ("prefill", "prelude", "recurrent", "coda")
ANY, NONE = "*", "-"
SKIP_KINDS = ("layer", "metadata", "sample", "kv_copy")  # containers, non-tensor or integer outputs


class PerturbSpecError(ValueError):
    """A malformed `debug.perturb` place; one line."""


@dataclass(frozen=True)
class Place:
    stage: str  # a stage or "*"
    loop: int | str  # int, "-" (outside a loop) or "*"
    layer: str  # "core0", "-", "*"
    op: str

    def __str__(self) -> str:
        return f"{self.stage}:{self.loop}:{self.layer}:{self.op}"


def parse_place(text: str) -> Place:
    parts = str(text).strip().split(":")
    if len(parts) != 4 or not all(p.strip() for p in parts):
        raise PerturbSpecError(
            f"debug.perturb '{text}': expected 4 fields stage, loop, layer, op joined by colons, "
            "e.g. prefill:1:core0:mlp"
        )
    stage, loop, layer, op = (p.strip() for p in parts)
    if stage not in (*STAGES, ANY):
        raise PerturbSpecError(
            f"debug.perturb '{text}': stage '{stage}' is not one of {', '.join(STAGES)}, *"
        )
    if loop not in (ANY, NONE):
        if not loop.isdigit():
            raise PerturbSpecError(f"debug.perturb '{text}': loop '{loop}' must be an integer >= 0, - or *")
        loop = int(loop)
    if layer.isdigit():
        layer = f"core{int(layer)}"
    elif layer not in (ANY, NONE) and not (
        layer.rstrip("0123456789") in ("prelude", "core", "coda") and layer[-1:].isdigit()
    ):
        raise PerturbSpecError(
            f"debug.perturb '{text}': layer '{layer}' must be like core0, prelude1, coda0, a number, - or *"
        )
    return Place(stage, loop, layer, op)


@dataclass
class OpInfo:
    """One hooked op module: where it lives in the model."""

    name: str  # qualified module name
    kind: str  # op_kind
    layer_path: str | None  # qualified name of the enclosing layer module, if the op is inside one
    relative: str | None  # path inside that layer

    def label(self, in_layer: bool) -> str:
        """The op's name in reports: its path inside the layer, its kind when a shared module is called
        inside a layer (RoPE), else its full name."""
        if self.relative is not None:
            return self.relative
        return self.kind if in_layer else self.name


OpCallback = Callable[["OpTracker", OpInfo, Any], Any]


class OpTracker(Observer):
    """Knows where the engine is (stage, loop, layer) while ops run, and calls `on_op(tracker, info,
    output)` after every op module; a non-None return replaces the op's output."""

    def __init__(self, on_op: OpCallback) -> None:
        self.on_op = on_op
        self.engine = None
        self.stage: str | None = None
        self.loop: int | None = None  # -1: a recurrent batch whose rows run different loops
        self.row_loops: list[int] = []
        self.layers: list[str] = []
        self.handles: list[Any] = []

    # Engine hooks -------------------------------------------------------------------------------------
    def on_step_begin(self, info: StepInfo) -> None:
        self.stage, self.loop, self.row_loops, self.layers = info.stage, None, list(info.loop_indices), []

    def on_step_end(self, result: StepResult) -> None:
        self.stage, self.loop = None, None

    def on_loop_begin(self, stage: str, loop_index: int) -> None:
        self.loop = loop_index

    def on_loop_end(self, stage: str, loop_index: int) -> None:
        self.loop = None

    @property
    def layer(self) -> str:
        return self.layers[-1] if self.layers else NONE

    # Module hooks -------------------------------------------------------------------------------------
    def attach(self, engine) -> OpTracker:
        self.engine = engine
        engine.attach(self)
        for info, module in op_modules(engine):
            if info.kind == "layer":
                tag = f"{module.layer_role}{module.layer_index}"
                self.handles.append(module.register_forward_pre_hook(self._push(tag)))
                self.handles.append(module.register_forward_hook(self._pop))
            elif info.kind not in SKIP_KINDS:
                self.handles.append(module.register_forward_hook(self._op(info)))
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.engine is not None:
            self.engine.detach(self)
            self.engine = None

    def _push(self, tag: str):
        def hook(_module, _args):
            self.layers.append(tag)

        return hook

    def _pop(self, _module, _args, _out) -> None:
        if self.layers:
            self.layers.pop()

    def _op(self, info: OpInfo):
        def hook(_module, _args, out):
            if self.stage is None:  # not inside a step of this tracker's engine
                return None
            return self.on_op(self, info, out)

        return hook


def op_modules(engine) -> list[tuple[OpInfo, torch.nn.Module]]:
    """Every module with an `op_kind` (layers included), with its enclosing layer."""
    mods = [(n, m) for n, m in engine.observable_modules() if getattr(m, "op_kind", None)]
    layer_paths = [n for n, m in mods if m.op_kind == "layer"]
    out = []
    for name, module in mods:
        parent = None
        if module.op_kind != "layer":
            parent = max((p for p in layer_paths if name.startswith(p + ".")), key=len, default=None)
        rel = name[len(parent) + 1 :] if parent else None
        out.append((OpInfo(name, module.op_kind, parent, rel), module))
    return out


def float_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return []


def bump(t: torch.Tensor, rows: torch.Tensor | None = None, ulps: int = 1) -> torch.Tensor:
    """`ulps` ulps toward +inf on every element (or on the selected rows only)."""
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    if ulps > 1:  # each element's own ulp, scaled: the change stays relative to the value's size
        up = t + (up - t) * ulps
    if rows is None:
        return up
    mask = rows.view(-1, *([1] * (t.dim() - 1)))
    return torch.where(mask, up, t)


class Perturbation:
    """The installed `debug.perturb`: an OpTracker whose callback bumps the named op's output."""

    def __init__(self, engine, place: Place, ulps: int = 1) -> None:
        self.place, self.ulps, self.hits = place, ulps, 0  # hits: outputs bumped (0: the place never fired)
        self._check_op(engine)
        self._check_reachable(engine)
        self.tracker = OpTracker(self._maybe_bump).attach(engine)

    def _check_reachable(self, engine) -> None:
        """A loop or layer this engine never runs would never fire: refuse it up front."""
        p = self.place
        loops = getattr(engine, "max_loops", None)
        if isinstance(p.loop, int) and loops is not None and p.loop >= loops:
            raise PerturbSpecError(
                f"debug.perturb '{p}': loop {p.loop} never runs (this engine runs loops 0..{loops - 1})"
            )
        if p.layer in (ANY, NONE):
            return
        layers = {f"{m.layer_role}{m.layer_index}" for info, m in op_modules(engine) if info.kind == "layer"}
        if p.layer not in layers:
            role = p.layer.rstrip("0123456789")
            have = sorted(
                (x for x in layers if x.rstrip("0123456789") == role), key=lambda x: int(x[len(role) :])
            )
            where = f"{have[0]}..{have[-1]}" if have else f"no {role} layers"
            raise PerturbSpecError(
                f"debug.perturb '{p}': layer {p.layer} does not exist in this model ({where})"
            )

    def _check_op(self, engine) -> None:
        """The op must name something, and only one op per layer (or one op outside layers)."""
        per_scope: dict[str | None, list[str]] = {}
        for info, _ in op_modules(engine):
            if info.kind in SKIP_KINDS:
                continue
            names = {info.kind, info.relative or info.name}
            if self.place.op in names:
                per_scope.setdefault(info.layer_path, []).append(info.relative or info.name)
        if not per_scope:
            raise PerturbSpecError(
                f"debug.perturb '{self.place}': no op named '{self.place.op}' in this model"
            )
        for scope, found in per_scope.items():
            if len(found) > 1:
                where = f"layer {scope}" if scope else "outside layers"
                raise PerturbSpecError(
                    f"debug.perturb '{self.place}': op '{self.place.op}' matches {len(found)} ops in {where} "
                    f"({', '.join(found)}): name one"
                )

    def _maybe_bump(self, tracker: OpTracker, info: OpInfo, out: Any) -> Any:
        p = self.place
        if p.stage != ANY and tracker.stage != p.stage:
            return None
        if p.layer != ANY and tracker.layer != p.layer:
            return None
        in_layer = tracker.layer != NONE
        if p.op not in (info.kind, info.label(in_layer), info.relative or info.name):
            return None
        rows = None
        if p.loop == NONE:
            if tracker.loop is not None:
                return None
        elif p.loop != ANY:
            if tracker.loop == -1:  # mixed-depth recurrent batch: only the rows at the named loop
                rows = torch.tensor([li == p.loop for li in tracker.row_loops], device=_device(out))
                if not bool(rows.any()):
                    return None
            elif tracker.loop != p.loop:
                return None
        self.hits += 1
        if isinstance(out, torch.Tensor):
            return bump(out, rows, self.ulps) if out.is_floating_point() else None
        if isinstance(out, tuple):
            return tuple(
                bump(t, rows, self.ulps) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in out
            )
        return None

    def remove(self) -> None:
        self.tracker.detach()


def _device(out: Any) -> torch.device:
    ts = float_tensors(out)
    return ts[0].device if ts else torch.device("cpu")


def install_perturbation(engine, spec: str | None, ulps: int = 1) -> Perturbation | None:
    """Called by `LLMEngine.__init__`; raises the engine's one-line input error for a bad place."""
    if not spec:
        return None
    try:
        if engine.device.type == "cuda" and engine.cfg.cuda_graphs.enabled:
            raise PerturbSpecError("debug.perturb needs cuda_graphs.enabled=false on CUDA")
        return Perturbation(engine, parse_place(spec), ulps)
    except PerturbSpecError as exc:
        raise EngineInputError(str(exc)) from None
