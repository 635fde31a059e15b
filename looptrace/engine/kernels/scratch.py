"""Persistent zeroed int32 counters for the kernels that combine split partials by "last program to
finish" (paged attention's segments, the GEMV's K splits). A leaf module: imports torch only.

A launch takes `tickets(device, count)`, each program of a split group adds 1 to its group's counter and the
one that draws the last ticket combines and writes the counter back to 0, so the buffer is zero again when
the launch ends and needs no memset before the next. Kernels launched one after the other on one stream
never overlap, which is what makes one shared buffer safe (concurrent launches on two streams would not be).
"""

from __future__ import annotations

import torch

_TICKETS: dict[torch.device, list[torch.Tensor]] = {}  # every buffer ever handed out stays alive (graphs)


def tickets(device: torch.device, count: int) -> torch.Tensor:
    """`count` zeroed int32 counters on `device`; the kernels leave them zero again. A buffer is never freed
    (captured graphs keep using its address); a new, larger one is made outside capture, or inside a capture
    for that graph alone (then its zeroing is captured too)."""
    buffers = _TICKETS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= count:
        return buffers[-1]
    fresh = torch.zeros(
        max(count, 2 * buffers[-1].numel() if buffers else 0), dtype=torch.int32, device=device
    )
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh  # graph-pool memory: not kept for later launches
    buffers.append(fresh)
    return fresh
