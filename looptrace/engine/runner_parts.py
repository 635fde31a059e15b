"""The runner's leaf helpers: small op modules a probe may hook (sampler, gate readback, state init, plane
copy), the host->device staging ring, in-flight and blocking host reads, and the row record. None of them
knows a stage; `ModelRunner` (runner.py) composes them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from looptrace.engine.kv_cache import KVPool
from looptrace.engine.request import Request
from looptrace.engine.sampling import sample


class Sampler(nn.Module):
    op_kind = "sample"

    def forward(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        return sample(logits, requests)


class GateReadback(nn.Module):
    """The exit gate's logits read back to the host after a recurrent step (the `gate` exit policy): one
    device->host copy and one blocking sync per step on CUDA, as in the base engine."""

    op_kind = "readback"

    def forward(self, gate_logits: torch.Tensor, defer: bool = False) -> list[float] | PendingRead:
        """The logits as a host list (blocking), or with `defer` a PendingRead read later."""
        if not gate_logits.is_cuda:  # the same copy to a host buffer, so CPU profiles count it too
            values = gate_logits.detach().to("cpu", torch.float32, copy=True).reshape(-1).tolist()
            return PendingRead(values=values) if defer else values
        host = torch.empty(gate_logits.numel(), dtype=torch.float32, pin_memory=True)
        host.copy_(gate_logits.float().reshape(-1), non_blocking=True)
        if defer:
            event = torch.cuda.Event()
            event.record()
            return PendingRead(host=host, event=event)
        torch.cuda.current_stream().synchronize()
        return host.tolist()


@dataclass
class PendingRead:
    """Values on their way to the host (async gate readback, async decode): read after the next
    submission, when the GPU has usually finished the step that made them."""

    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    values: list | None = None

    @classmethod
    def start(cls, values: torch.Tensor) -> PendingRead:
        """A non-blocking copy into pinned memory (CUDA), or the values at once (CPU)."""
        if not values.is_cuda:
            return cls(values=values.tolist())
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host=host, event=event)

    def result(self) -> list:
        if self.values is None:
            if not self.event.query():  # usually done: the GPU has moved on to the next step
                self.event.synchronize()
            self.values = self.host.tolist()
        return self.values


class StateInit(nn.Module):
    """Initial recurrent state for Huginn/OLMo rows. `runs` lists the rows in order as runs of one request:
    `(request, first position, rows)` (or `(request, rows)` where the positions are unknown). The noise
    implementation decides what it uses: `sequential` one draw per run from the request's generator (in
    processing order), `position_keyed` the request's seed and the positions (computed on the device)."""

    op_kind = "state_init"

    def __init__(self, noise) -> None:
        super().__init__()
        self.noise = noise
        self.staging: HostStaging | None = None  # its own ring: per-row keys go up without a blocking copy

    def forward(self, like: torch.Tensor, runs: list[tuple]) -> torch.Tensor:
        runs = [r if len(r) == 3 else (r[0], None, r[1]) for r in runs]
        if self.staging is None:
            self.staging = HostStaging(like.device)
        return self.noise.initial_state(like, runs, self.staging.to_device)


class PlaneCopy(nn.Module):
    """Early exit: copy one token slot (all core layers) from the exit plane into every deeper plane."""

    op_kind = "kv_copy"

    def __init__(self, pool: KVPool) -> None:
        super().__init__()
        self.pool = pool

    def forward(self, copies: torch.Tensor) -> None:  # [n, 4]: src entry, src offset, dst entry, dst offset
        self.pool.copy_slots(copies)


class HostStaging:
    """A ring of pinned host buffers for non-blocking H2D copies; an event per buffer guards reuse."""

    def __init__(self, device: torch.device, ring: int = 8) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * ring
        self.events: list[torch.cuda.Event | None] = [None] * ring
        self.i = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if not self.cuda:
            return host
        i, self.i = self.i, (self.i + 1) % len(self.buffers)
        buf, ev = self.buffers[i], self.events[i]
        if ev is not None and not ev.query():  # query first: a complete copy needs no blocking call
            ev.synchronize()
        if buf is None or buf.numel() < host.numel():
            buf = torch.empty(max(host.numel(), 4096), dtype=host.dtype, pin_memory=True)
            self.buffers[i] = buf
        staged = buf[: host.numel()].view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev
        return out


@dataclass
class Row:
    request: Request
    pos: int
    token: int = 0


def tokens_to_host(tokens: torch.Tensor) -> list[int]:
    """The sampled tokens as a host list: on CUDA through pinned memory, the step's one blocking read."""
    if tokens.device.type != "cuda":
        return tokens.tolist()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    torch.cuda.current_stream().synchronize()  # the step's one blocking read: the sampled tokens
    return host.tolist()
