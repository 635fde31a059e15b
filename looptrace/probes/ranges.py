"""NVTX ranges (domain `looptrace`) plus matching `record_function` markers around engine work.

Kineto does not record NVTX, so every range is emitted twice: an NVTX push/pop (seen by Nsight Systems)
and a `torch.profiler.record_function` (a `user_annotation` in Kineto traces, what `counters.py` reads).
Names follow the convention in `counters.py`: `lt.step#N`, `lt.stage/<stage>`, `lt.loop/<i>`,
`lt.layer/<role><i>`, `lt.op/<kind>`, and inside each decode step an `lt.kv/<n>` marker (the live KV
positions its rows attend to).

Levels: `step` (step + stage), `loop` (+ loop), `layer` (+ layer), `op` (+ op). Steps, stages and loops
come from the engine's observer hooks; layers and ops from PyTorch module hooks on modules that carry an
`op_kind`. Detaching removes every hook, so an engine without probes makes no hook calls at all.
"""

from __future__ import annotations

from typing import Any

import torch

from looptrace.engine.hooks import Observer, StepInfo, StepResult
from looptrace.probes import counters as names

LEVELS = ("step", "loop", "layer", "op")
# Module op kinds that get an lt.op range; `layer` modules get lt.layer ranges instead.
OP_KINDS = (
    "norm",
    "rope",
    "attention",
    "paged_attention",
    "mlp",
    "gate",
    "adapter",
    "embed",
    "head",
    "sample",
    "state_init",
    "kv_copy",
    "metadata",
    "readback",
    "persistent_loop",
)


class _Nvtx:
    """NVTX push/pop in the `looptrace` domain; falls back to torch.cuda.nvtx, else does nothing."""

    def __init__(self) -> None:
        self.domain = None
        self.torch_nvtx = None
        try:
            # deferred: optional (NVTX ranges on CUDA)
            import nvtx

            self.domain = nvtx.get_domain("looptrace")
            self._attrs: dict[str, Any] = {}
        except Exception:  # noqa: BLE001 - the nvtx package is optional at run time
            if torch.cuda.is_available():
                self.torch_nvtx = torch.cuda.nvtx

    def push(self, name: str) -> None:
        if self.domain is not None:
            attrs = self._attrs.get(name)
            if attrs is None:
                attrs = self._attrs[name] = self.domain.get_event_attributes(message=name)
            self.domain.push_range(attrs)
        elif self.torch_nvtx is not None:
            self.torch_nvtx.range_push(name)

    def pop(self) -> None:
        if self.domain is not None:
            self.domain.pop_range()
        elif self.torch_nvtx is not None:
            self.torch_nvtx.range_pop()


class RangeProbe(Observer):
    """Attach with `probe.attach(engine)`, remove with `probe.detach()`."""

    def __init__(self, level: str = "op", nvtx: bool = True) -> None:
        if level not in LEVELS:
            raise ValueError(f"probe level '{level}': expected one of {', '.join(LEVELS)}")
        self.level = LEVELS.index(level)
        self.nvtx = _Nvtx() if nvtx else None
        self.engine = None
        self._handles: list[Any] = []
        self._stack: list[Any] = []  # open record_function handles, innermost last

    # Range primitives ---------------------------------------------------------------------------------
    def push(self, name: str) -> None:
        self._stack.append(torch.ops.profiler._record_function_enter_new(name, None))
        if self.nvtx is not None:
            self.nvtx.push(name)

    def pop(self) -> None:
        if self.nvtx is not None:
            self.nvtx.pop()
        torch.ops.profiler._record_function_exit(self._stack.pop())

    # Engine hooks ---------------------------------------------------------------------------------------
    def on_step_begin(self, info: StepInfo) -> None:
        self.push(names.step_name(info.step))
        self.push(names.stage_name(info.stage))
        if info.stage != "prefill" and self.engine is not None:
            self._mark_live_keys(info.context_tokens)

    def _mark_live_keys(self, context_tokens: list[int]) -> None:
        """An `lt.kv/<n>` marker: the KV positions the step's decode rows attend to (each row's context,
        prompt + tokens so far), what attention over a padded key length is measured against."""
        live = sum(context_tokens)
        if live:
            self.push(names.kv_name(live))
            self.pop()

    def on_step_end(self, result: StepResult) -> None:
        self.pop()
        self.pop()

    def on_loop_begin(self, stage: str, loop_index: int) -> None:
        if self.level >= 1:
            self.push(names.loop_name(loop_index) if loop_index >= 0 else names.LOOP_PREFIX + "mixed")

    def on_loop_end(self, stage: str, loop_index: int) -> None:
        if self.level >= 1:
            self.pop()

    # Module hooks ---------------------------------------------------------------------------------------
    def attach(self, engine) -> RangeProbe:
        self.engine = engine
        engine.attach(self)
        for _, module in engine.observable_modules():
            kind = getattr(module, "op_kind", None)
            if kind == "layer" and self.level >= 2:
                name = names.layer_name(module.layer_role, module.layer_index)
                self._hook(module, name)
            elif kind in OP_KINDS and self.level >= 3:
                self._hook(module, names.op_name(kind), sample=kind == "sample")
        return self

    def _hook(self, module: torch.nn.Module, name: str, sample: bool = False) -> None:
        def before(_module, _args):
            if sample:  # sampling is its own stage inside the coda step
                self.push(names.stage_name("sample"))
            self.push(name)

        def after(_module, _args, _out):
            self.pop()
            if sample:
                self.pop()

        self._handles.append(module.register_forward_pre_hook(before))
        self._handles.append(module.register_forward_hook(after))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.engine is not None:
            self.engine.detach(self)
            self.engine = None
