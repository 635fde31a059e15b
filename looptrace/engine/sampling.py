"""Token sampling: greedy, or temperature / top-k / top-p with each request's own generator."""

from __future__ import annotations

import torch

from looptrace.engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> token ids [R] on the logits' device."""
    if all(r.params.greedy for r in requests):
        return logits.argmax(dim=-1)
    out = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    for i, req in enumerate(requests):
        row = logits[i].float()
        if req.params.greedy:
            out[i] = row.argmax()
        else:
            out[i] = _sample_row(row, req)
    return out


def _sample_row(row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return torch.multinomial(probs, 1, generator=req.generator)[0]
