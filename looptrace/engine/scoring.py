"""Teacher-forced scoring: the logprob of every prompt token given the tokens before it, from the engine's
normal prefill (full depth for every position, as prefill runs them), for the requests whose
`SamplingParams.prompt_logprobs` asks.

The runner calls `score_prefill_state` after a prefill chunk's loops (families without coda layers: the
head reads the loop state) or `score_coda_hidden` on the coda output of the chunk's non-final rows
(Huginn/OLMo). Nothing runs when no row asks. A request that asks is never served from the prefix cache
(`fresh_prefix_salt`): cached positions would have no logits.

`score(engine, prompt_ids, continuation_ids, top_k)` is the public entry (an idle `LLMEngine`): the
prompt and the continuation as one prefill; per continuation token its logprob, the argmax there and the
top k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from looptrace.engine.request import (
    EngineInputError,
    PromptLogprob,
    PromptLogprobRecord,
    Request,
    SamplingParams,
    TokenOutput,
)

if TYPE_CHECKING:
    from looptrace.engine.models import LoopedModel
    from looptrace.engine.runner_parts import Row


class Engine(Protocol):
    """What `score` needs of `LLMEngine` (which imports this module, through the runner)."""

    def add_request(self, prompt: list[int], params: SamplingParams | None = None) -> str: ...
    def step(self) -> list[TokenOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def forget(self, request_id: str) -> None: ...


def _scored_rows(rows: list[Row]) -> list[int]:
    """Rows whose request asks and whose next token is a prompt token (the last prompt position's next
    token is the first output, scored by `logprobs`)."""
    return [
        i
        for i, r in enumerate(rows)
        if r.request.params.prompt_logprobs is not None and r.pos + 1 < len(r.request.prompt)
    ]


def score_prefill_state(model: LoopedModel, rows: list[Row], state: torch.Tensor) -> None:
    """After a prefill chunk's loops, for families whose coda has no layers (the head reads the state)."""
    if model.has_coda_layers:
        return  # scored on the coda output (`score_coda_hidden`), which the coda KV fill computes anyway
    picked = _scored_rows(rows)
    if picked:
        index = torch.tensor(picked, dtype=torch.long, device=state.device)
        hidden = model.coda_hidden(state.index_select(0, index), None)
        _record(model.head(hidden), [rows[i] for i in picked])


def score_coda_hidden(model: LoopedModel, rows: list[Row], hidden: torch.Tensor) -> None:
    """The coda output of a chunk's non-final prompt rows (Huginn/OLMo's coda KV fill)."""
    picked = _scored_rows(rows)
    if picked:
        index = torch.tensor(picked, dtype=torch.long, device=hidden.device)
        _record(model.head(hidden.index_select(0, index)), [rows[i] for i in picked])


def _record(logits: torch.Tensor, rows: list[Row]) -> None:
    """Log-softmax of the raw logits in float32 (as `sampling.record_logprobs`), kept on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.tensor([r.request.prompt[r.pos + 1] for r in rows], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, nxt[:, None])[:, 0]
    best, best_id = lp.max(dim=-1)
    rank = (lp > chosen[:, None]).sum(dim=-1) + 1
    k = max(r.request.params.prompt_logprobs or 0 for r in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    for j, r in enumerate(rows):
        n = r.request.params.prompt_logprobs or 0
        r.request.prompt_logprob_records[r.pos + 1] = PromptLogprobRecord(
            chosen[j], best_id[j], best[j], rank[j], top_v[j, :n], top_i[j, :n]
        )


def read_prompt_logprobs(req: Request) -> list[PromptLogprob]:
    """The request's prompt scores on the host, position 1 onwards (read once, with its first token)."""
    out = []
    for pos in sorted(req.prompt_logprob_records):
        rec = req.prompt_logprob_records[pos]
        top = list(zip(rec.top_ids.tolist(), rec.top_values.tolist()))
        out.append(
            PromptLogprob(
                pos,
                req.prompt[pos],
                float(rec.token),
                int(rec.argmax_id),
                float(rec.argmax),
                int(rec.rank),
                top,
            )
        )
    req.prompt_logprob_records.clear()
    return out


def fresh_prefix_salt(req: Request) -> bytes:
    """A prefix-cache key chain of its own for a request that scores its prompt (no cached positions)."""
    if req.params.prompt_logprobs is None:
        return req.prefix_salt
    return req.prefix_salt + f"prompt-logprobs-{req.seq}".encode()


def score(
    engine: Engine, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 0
) -> list[PromptLogprob]:
    """Teacher-forced scores of `continuation_ids` after `prompt_ids` (one per continuation token, its
    `position` counted in the joined sequence): one prefill of both on an idle engine."""
    if not prompt_ids:
        raise EngineInputError("scoring needs at least one prompt token (the first token has no context)")
    if engine.has_unfinished_requests():
        raise EngineInputError("scoring runs on an idle engine (requests are in flight)")
    params = SamplingParams(max_tokens=1, prompt_logprobs=top_k)
    request_id = engine.add_request(list(prompt_ids) + list(continuation_ids), params)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.prompt_logprobs is not None:
                first = out
    engine.forget(request_id)
    if first is None:
        raise EngineInputError(f"request {request_id} ended without its prompt scores")
    return [p for p in first.prompt_logprobs if p.position >= len(prompt_ids)]
