"""Token sampling: greedy, or temperature / top-k / top-p with each request's own generator; logit bias and
presence / frequency / repetition penalties (vLLM semantics) for the requests that ask; the sampled tokens'
logprobs for the requests that ask. A request that asks for none of these samples exactly as before."""

from __future__ import annotations

from collections import Counter

import torch

from looptrace.engine.request import LogprobRecord, Request


def sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> token ids [R] on the logits' device."""
    if not any(r.params.needs_sampler for r in requests):
        return logits.argmax(dim=-1)
    out = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    for i, req in enumerate(requests):
        row = logits[i].float()
        if req.params.processes_logits:
            row = process_logits(row, req)
        if req.params.greedy:
            out[i] = row.argmax()
        else:
            out[i] = _sample_row(row, req)
    return out


def process_logits(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Logit bias, then the repetition penalty (prompt and output tokens), then presence and frequency
    penalties (output tokens). row: [V] float32; returns a new tensor. Bounded parameters (SamplingParams
    .check) keep finite logits finite."""
    p, dev = req.params, row.device
    row = row.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev))
    outputs = [t for t in req.outputs if t >= 0]  # async decode placeholders (-1) are never penalised
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt) | set(outputs)), dtype=torch.long, device=dev)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and outputs:
        counts = Counter(outputs)
        ids = torch.tensor(list(counts), dtype=torch.long, device=dev)
        n = torch.tensor(list(counts.values()), dtype=row.dtype, device=dev)
        row.index_add_(0, ids, -(p.frequency_penalty * n + p.presence_penalty))
    return row


def _sample_row(row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.params
    row = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p; the first token always stays (a top_p below
        # float32's smallest value, e.g. 1e-300, rounds to 0 and would otherwise drop every token)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return torch.multinomial(probs, 1, generator=req.generator)[0]


def record_logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> None:
    """For the rows whose request asks for logprobs: log-softmax of the raw logits (float32), the sampled
    token's value and the top k, kept on the device in `request.logprob_records` until the token is read.
    Nothing runs when no row asks."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None].long())[:, 0]
    k = max(requests[i].params.logprobs or 0 for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs or 0
        requests[i].logprob_records.append(LogprobRecord(chosen[j], top_v[j, :n], top_i[j, :n]))
