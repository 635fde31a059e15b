"""The FastAPI app: OpenAI-compatible completions and chat, /v1/models, /health, /metrics and the stats
stream. Handlers never touch the engine: they tokenize, validate, `EngineLoop.submit()` and then read the
request's events from an asyncio queue the engine thread feeds. A client that disconnects (streaming or
not) gets its request aborted, which frees its KV blocks before the next engine step.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a 4xx status for
bad requests (malformed JSON, invalid fields, unknown model, prompt too long); nothing a client sends can
stop the server.

One request must not hurt the others: a request queues at most `max_sequences` sequences (prompts x n),
the engine loop admits the sequences of concurrent requests in turn (engine_loop.py), and every piece of
work that grows with a request's size (parsing, tokenizing, serializing a long token list) runs off the
event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from looptrace import __version__
from looptrace.engine.request import PromptLogprob, SamplingParams, SamplingParamsError, derive_seed
from looptrace.serve import openai_schema as oa
from looptrace.serve.engine_loop import Accepted, EngineLoop, Failed, TokenEvent
from looptrace.serve.metrics import ServerMetrics
from looptrace.serve.plumbing import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ApiKeyAuth,
    BodyLimit,
    json_body,
)

log = logging.getLogger("looptrace.serve")
DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often to check whether the client is still there


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    body = oa.ErrorResponse(error=oa.ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def chat_prompt(messages: list[oa.ChatMessage]) -> str:
    """A plain template for models without one of their own: `<|role|>` headers, then the assistant's."""
    parts = [f"<|{m.role}|>\n{m.text()}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


class TextStream:
    """Token ids -> text deltas, honouring stop strings: text that could still become a stop string, and a
    trailing incomplete UTF-8 character, are held back until they resolve (or the request ends)."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids)
        for stop in self.stops:
            idx = self.text.find(stop, max(0, self.sent - len(stop)))
            if idx >= 0:
                self.stopped = True
                self.text = self.text[:idx]
                return self._emit(len(self.text))
        safe = len(self.text) - self.hold
        while safe > self.sent and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return self._emit(safe)

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out


def stream_error(exc: Exception, job: _Job) -> str:
    """The OpenAI error body for an exception after a stream started (a bug: logged, that stream alone)."""
    if not isinstance(exc, APIError):
        log.error("stream of %s failed", job.request_id or "a request", exc_info=exc)
        exc = APIError(500, f"{type(exc).__name__}: {exc}", "server_error")
    body = oa.ErrorBody(message=exc.message, type=exc.type, code=exc.code)
    return oa.ErrorResponse(error=body).model_dump_json()


@dataclass
class _Delta:
    """What one engine event adds to a choice: text (may be "" while held back), its token and, when asked,
    (token, logprob, top [(token, logprob)]) and the token's offset in the choice's text."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    offsets: list[int]
    finish_reason: str | None = None  # set on the choice's last delta
    prompt_logprobs: list[PromptLogprob] | None = None  # on the choice's first delta, when asked


JSON_SLICE = 50_000  # token ids serialized per slice (the GIL is released between slices)


def tokenize_json(ids: list[int], max_len: int) -> bytes:
    """/tokenize's body `{"count", "max_model_len", "tokens"}`, the ids joined slice by slice."""
    parts = [f'{{"count": {len(ids)}, "max_model_len": {max_len}, "tokens": ['.encode()]
    for start in range(0, len(ids), JSON_SLICE):
        if start:
            parts.append(b", ")
        parts.append(", ".join(map(str, ids[start : start + JSON_SLICE])).encode())
    parts.append(b"]}")
    return b"".join(parts)


class _Job:
    """One sequence in flight (one choice): its queue of engine events and its bookkeeping."""

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Any,
        body: oa._Request,
        prompt: list[int],
        params: SamplingParams,
        index: int = 0,
    ) -> None:
        self.loop, self.body, self.prompt, self.sampling, self.index = loop, body, prompt, params, index
        self.queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        self.text = TextStream(tokenizer, body.stop_list())
        self.request_id = ""
        self.done = False
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.offsets: list[int] = []
        self.prompt_logprobs: list[PromptLogprob] | None = None

        def sink(event) -> None:
            aloop.call_soon_threadsafe(self.queue.put_nowait, event)

        self.sink = sink

    async def start(self, prefix: str, group: str) -> None:
        rid = self.loop.new_request_id(prefix)
        self.loop.submit(self.prompt, self.sampling, self.sink, request_id=rid, group=group)
        try:
            event = await self.queue.get()
        except asyncio.CancelledError:
            self.loop.abort(rid)
            raise
        if isinstance(event, Failed):  # 500 engine error, 503 dead/shutting down, 408 timeout
            raise APIError(event.status, event.message, event.type, code=event.code)
        assert isinstance(event, Accepted)
        self.request_id = event.request_id

    async def next_delta(self) -> _Delta:
        """The next engine event as a delta; sets `done`/`finish_reason` at the end."""
        event = await self.queue.get()
        if isinstance(event, Failed):
            self.done, self.finish_reason = True, "error"
            raise APIError(event.status, event.message, event.type, code=event.code)
        assert isinstance(event, TokenEvent)
        offset = len(self.text.text)
        self.token_ids.append(event.token_id)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        lps = []
        if event.logprob is not None:
            lps = [(event.token_id, event.logprob, event.top_logprobs or [])]
            self.logprobs += lps
            self.offsets.append(offset)
        text = await asyncio.to_thread(self.text.add, event.token_id)  # detokenizing: off the event loop
        if self.text.stopped:
            self.done, self.finish_reason = True, "stop"
            self.loop.abort(self.request_id, "stop")  # the engine may still be generating: free it now
        elif event.finished:
            self.done, self.finish_reason = True, event.finish_reason or "length"
            text += self.text.flush()
        reason = self.finish_reason if self.done else None
        return _Delta(text, [event.token_id], lps, [offset] if lps else [], reason, event.prompt_logprobs)

    def cancel(self) -> None:
        if self.request_id and not self.done:
            self.done = True
            self.loop.abort(self.request_id, "abort")

    def usage(self) -> oa.Usage:
        return usage([self])


def sampling_params(
    body: oa._Request, max_tokens: int, index: int, stop_ids: list[int] | None
) -> SamplingParams:
    """The engine's parameters for choice `index` (seeded: seed + index, see derive_seed)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=max(body.top_k, 0),  # -1 = off (vLLM) is 0 here
        top_p=body.top_p,
        seed=None if body.seed is None else derive_seed(body.seed, index),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.token_bias(),
        stop_token_ids=stop_ids,
        logprobs=body.logprobs_k(),
        prompt_logprobs=body.prompt_logprobs_k(),
    )


def usage(jobs: list[_Job]) -> oa.Usage:
    """Prompt tokens once per prompt (choices of one prompt share it), completion tokens of every choice."""
    prompt = sum(len(j.prompt) for j in jobs if j.index % max(j.body.n, 1) == 0)
    completion = sum(len(j.token_ids) for j in jobs)
    return oa.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Group:
    """The choices of one HTTP request: cancelled together (a disconnect, the end of a stream)."""

    def __init__(self, jobs: list[_Job]) -> None:
        self.jobs = jobs
        self.request_id = jobs[0].request_id if jobs else ""

    def cancel(self) -> None:
        for j in self.jobs:
            j.cancel()


async def start_all(jobs: list[_Job], prefix: str) -> None:
    """Submit every choice as one group (the engine loop admits groups in turn); if one is refused, abort
    the others and raise its error."""
    group = jobs[0].loop.new_request_id(f"{prefix}-group") if jobs else ""
    results = await asyncio.gather(*(j.start(prefix, group) for j in jobs), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for j in jobs:
            j.cancel()
        raise errors[0]


async def interleave(jobs: list[_Job]) -> AsyncIterator[tuple[_Job, _Delta]]:
    """Deltas of every job as they arrive (n > 1 and batched prompts stream their choices interleaved)."""
    if len(jobs) == 1:  # the common case: no task per job
        job = jobs[0]
        while not job.done:
            yield job, await job.next_delta()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job: _Job) -> None:
        try:
            while not job.done:
                merged.put_nowait((job, await job.next_delta()))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer (an error event, a 500)
            merged.put_nowait((job, exc))

    tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
    try:
        left = len(jobs)
        while left:
            job, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            yield job, item
            left -= item.finish_reason is not None
    finally:
        for t in tasks:
            t.cancel()


def create_app(
    loop: EngineLoop,
    *,
    tokenizer: Any,
    metrics: ServerMetrics,
    model_name: str,
    aliases: tuple[str, ...] = (),
    stats_interval: float = 0.5,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    max_sequences: int = oa.MAX_SEQUENCES_PER_REQUEST,
) -> FastAPI:
    app = FastAPI(title="looptrace serve", version="1", docs_url=None, redoc_url=None)
    app.add_middleware(
        BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout, draining=lambda: loop.draining
    )
    if api_key:  # added last = outermost: a request without the key is refused before its body is read
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    engine = loop.engine
    vocab = int(engine.spec.vocab_size)
    max_len = int(engine.max_model_len)
    names = {model_name, *aliases}

    # Errors -------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":  # no field to name: `loc` is empty
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        else:
            where = ".".join(loc) or "body"
            msg = f"{where}: {first.get('msg', 'invalid value')}"
            if len(errs) > 1:
                msg += f" (and {len(errs) - 1} more error(s))"
        return error_response(400, msg, "invalid_request_error", ".".join(loc) or None, first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception):  # pragma: no cover - a bug, reported not fatal
        return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")

    # Helpers ------------------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name not in names:
            raise APIError(
                404, f"The model `{name}` does not exist; this server has {sorted(names)}", param="model",
                code="model_not_found",
            )  # fmt: skip

    def check_prompt(ids: list[int], budget: int, field: str = "prompt") -> None:
        """`field`: what the client sent the prompt as (`prompt`, or chat's `messages`)."""
        if not ids:
            raise APIError(400, f"{field} is empty: at least one token is needed", param=field)
        # The length first: the vocabulary scan below then never walks millions of ids on the event loop.
        need = len(ids) + budget - 1
        if need > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested {need} "
                f"tokens ({len(ids)} in the prompt, {budget} for the completion).",
                param="max_tokens" if len(ids) <= max_len else field,
                code="context_length_exceeded",
            )
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} outside the vocabulary [0, {vocab})", param="prompt")

    def check_supported(body: oa._Request) -> None:
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        bad_stop = next((t for t in body.stop_token_ids or () if t >= vocab), None)
        if bad_stop is not None:
            raise APIError(
                400, f"stop token id {bad_stop} outside the vocabulary [0, {vocab})", param="stop_token_ids"
            )

    def check_sequences(prompts: int, n: int) -> None:
        """Before any tokenizing: a request's prompts x n is bounded (each is a sequence in the engine)."""
        if prompts * n > max_sequences:
            raise APIError(
                400,
                f"{prompts} prompt(s) x n={n} = {prompts * n} sequences; at most {max_sequences} per request",
                param="n" if n > 1 else "prompt",
                code="too_many_sequences",
            )

    def make_jobs(body: oa._Request, prompts: list[list[int]], budgets: list[int]) -> list[_Job]:
        """n choices per prompt, index = prompt * n + choice; parameters checked as the engine will."""
        try:
            bias = body.token_bias()
        except ValueError as exc:
            raise APIError(400, str(exc), param="logit_bias") from None
        jobs = []
        for i, (ids, budget) in enumerate(zip(prompts, budgets)):
            for j in range(body.n):
                sp = sampling_params(body, budget, j, body.stop_token_ids)
                sp.logit_bias = bias
                try:
                    sp.check(vocab)
                except SamplingParamsError as exc:
                    raise APIError(400, str(exc), param=exc.param) from None
                jobs.append(_Job(loop, tokenizer, body, ids, sp, index=i * body.n + j))
        return jobs

    def token_text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    def completion_logprobs(d: _Delta | _Job, base: int = 0) -> oa.CompletionLogprobs:
        out = oa.CompletionLogprobs()
        for (t, lp, top), off in zip(d.logprobs, d.offsets):
            out.tokens.append(token_text(t))
            out.token_logprobs.append(lp)
            alts: dict[str, float] = {}
            for i, v in [*top, (t, lp)]:  # the sampled token is always listed (OpenAI, vLLM)
                alts.setdefault(token_text(i), v)  # ids sharing a text: the likelier one's value
            out.top_logprobs.append(alts)
            out.text_offset.append(base + off)
        return out

    def prompt_logprobs_out(scored: list[PromptLogprob]) -> list[dict[str, oa.PromptTokenLogprob] | None]:
        """vLLM's shape: None for position 0, then token id -> {logprob, rank, decoded_token}."""
        out: list[dict[str, oa.PromptTokenLogprob] | None] = [None]
        for p in scored:
            entry = {
                str(p.token_id): oa.PromptTokenLogprob(
                    logprob=p.logprob, rank=p.rank, decoded_token=token_text(p.token_id)
                )
            }
            for rank, (t, v) in enumerate(p.top_logprobs, 1):
                entry.setdefault(
                    str(t), oa.PromptTokenLogprob(logprob=v, rank=rank, decoded_token=token_text(t))
                )
            out.append(entry)
        return out

    def echoed_logprobs(ids: list[int], scored: list[PromptLogprob], k: int) -> oa.CompletionLogprobs:
        """The prompt's part of the legacy logprobs with echo: no value for the first token (OpenAI)."""
        out = oa.CompletionLogprobs(tokens=[token_text(ids[0])], token_logprobs=[None], top_logprobs=[None])
        out.text_offset.append(0)
        for p in scored:
            out.text_offset.append(out.text_offset[-1] + len(out.tokens[-1]))
            out.tokens.append(token_text(p.token_id))
            out.token_logprobs.append(p.logprob)
            alts: dict[str, float] = {}
            for t, v in [*p.top_logprobs[:k], (p.token_id, p.logprob)]:  # as `completion_logprobs`
                alts.setdefault(token_text(t), v)
            out.top_logprobs.append(alts)
        return out

    def merged_logprobs(first: oa.CompletionLogprobs, then: oa.CompletionLogprobs) -> oa.CompletionLogprobs:
        return oa.CompletionLogprobs(
            tokens=first.tokens + then.tokens,
            token_logprobs=first.token_logprobs + then.token_logprobs,
            top_logprobs=first.top_logprobs + then.top_logprobs,
            text_offset=first.text_offset + then.text_offset,
        )

    def chat_logprobs(d: _Delta | _Job) -> oa.ChatLogprobs:
        def entry(t: int, lp: float) -> dict:
            text = token_text(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = [
            oa.ChatTokenLogprob(**entry(t, lp), top_logprobs=[oa.TopLogprob(**entry(i, v)) for i, v in top])
            for t, lp, top in d.logprobs
        ]
        return oa.ChatLogprobs(content=content)

    async def run_blocking(request: Request, job: _Job, collect) -> Any:
        """Await `collect()`; abort the job when the client goes away first."""
        task = asyncio.ensure_future(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    job.cancel()
                    return Response(status_code=499)
        finally:
            if not task.done():
                task.cancel()
            job.cancel()

    def sse(gen: AsyncIterator[str], job: _Job) -> EventSourceResponse:
        async def events():
            try:
                try:
                    async for data in gen:
                        yield {"data": data}
                except Exception as exc:  # noqa: BLE001 - the response has started: report in-stream
                    yield {"data": stream_error(exc, job)}
                yield {"data": "[DONE]"}  # after an error event too: every stream ends the same way
            finally:
                job.cancel()  # a disconnect cancels this generator: abort the request, free its KV

        return EventSourceResponse(events(), ping=15, sep="\n")

    # Routes -------------------------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if loop.dead or not loop.alive:
            return error_response(503, f"the engine is not running ({loop.status()})", "server_error")
        if loop.draining:
            return error_response(503, "the server is shutting down", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        cards = [oa.ModelCard(id=n, max_model_len=max_len) for n in [model_name, *aliases]]
        return oa.ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str):
        check_model(model_id)
        return oa.ModelCard(id=model_id, max_model_len=max_len).model_dump()

    @app.get("/version")
    async def version():
        return oa.VersionResponse(version=__version__).model_dump()

    @app.post("/tokenize")
    async def tokenize(body: Annotated[oa.TokenizeRequest, Depends(json_body(oa.TokenizeRequest))]):
        if body.model is not None:
            check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:  # as the chat endpoint encodes them
            special = bool(body.add_special_tokens) if body.add_special_tokens is not None else False
            ids = await run_in_threadpool(tokenizer.encode, chat_prompt(body.messages), special)
        else:  # as the completions endpoint encodes a prompt
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await run_in_threadpool(tokenizer.encode, body.prompt, special)
        # Millions of ids for a multi-megabyte prompt: serialized in a worker thread, in slices (one
        # json.dumps of them all held the GIL, and so every other client, for seconds).
        return Response(await asyncio.to_thread(tokenize_json, ids, max_len), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: Annotated[oa.DetokenizeRequest, Depends(json_body(oa.DetokenizeRequest))]):
        if body.model is not None:
            check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} outside the vocabulary [0, {vocab})", param="tokens")
        text = await run_in_threadpool(tokenizer.decode, body.tokens)
        return oa.DetokenizeResponse(prompt=text).model_dump()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats():
        return loop.snapshot()

    @app.get("/v1/stats/stream")
    async def stats_stream(interval: float = stats_interval):
        interval = min(10.0, max(0.05, interval))

        async def gen():
            while not loop.draining:  # a shutdown ends the stream (it would hold the drain open)
                yield {"event": "stats", "data": json.dumps(loop.snapshot())}
                await asyncio.sleep(interval)  # the stream's cadence, not synchronisation

        return EventSourceResponse(gen(), ping=15, sep="\n")

    @app.post("/v1/completions")
    async def completions(
        body: Annotated[oa.CompletionRequest, Depends(json_body(oa.CompletionRequest))], request: Request
    ):
        check_model(body.model)
        check_supported(body)
        check_sequences(len(body.prompts()), body.n)
        # Special tokens on, as vLLM encodes a completion prompt: the tokenizer adds BOS where its model
        # expects one (the trained tiny checkpoints do; a chat template writes its own).
        prompts = [
            await run_in_threadpool(tokenizer.encode, p, True) if isinstance(p, str) else list(p)
            for p in body.prompts()
        ]
        budget = body.output_budget()
        for ids in prompts:
            check_prompt(ids, budget)
        jobs = make_jobs(body, prompts, [budget] * len(prompts))
        await start_all(jobs, "cmpl")
        group = _Group(jobs)
        created, rid = int(time.time()), jobs[0].request_id
        echo = [tokenizer.decode(ids) if body.echo else "" for ids in prompts]
        want_ids, want_lp = body.return_token_ids, body.logprobs is not None

        def choice(job: _Job, text: str, d: _Delta | _Job, reason: str | None) -> oa.CompletionChoice:
            scored, prompt = d.prompt_logprobs, prompts[job.index // body.n]
            lp = completion_logprobs(d, len(echo[job.index // body.n])) if want_lp else None
            if lp is not None and body.echo and scored is not None:  # the prompt's entries first
                lp = merged_logprobs(echoed_logprobs(prompt, scored, body.logprobs or 0), lp)
            return oa.CompletionChoice(
                index=job.index,
                text=text,
                finish_reason=reason,
                logprobs=lp,
                token_ids=d.token_ids if want_ids else None,
                prompt_logprobs=prompt_logprobs_out(scored)
                if body.prompt_logprobs is not None and scored is not None
                else None,
            )

        if body.stream:
            usage_wanted = bool((body.stream_options or {}).get("include_usage"))

            async def chunks():
                started: set[int] = set()
                async for job, d in interleave(jobs):
                    text = d.text
                    if job.index not in started:
                        started.add(job.index)
                        text = echo[job.index // body.n] + text
                    yield oa.CompletionResponse(
                        id=rid,
                        created=created,
                        model=body.model,
                        choices=[choice(job, text, d, d.finish_reason)],
                    ).model_dump_json()
                if usage_wanted:
                    yield oa.CompletionResponse(
                        id=rid, created=created, model=body.model, choices=[], usage=usage(jobs)
                    ).model_dump_json()

            return sse(chunks(), group)

        async def collect():
            texts = {j.index: "" for j in jobs}
            async for job, d in interleave(jobs):
                texts[job.index] += d.text
            choices = [choice(j, echo[j.index // body.n] + texts[j.index], j, j.finish_reason) for j in jobs]
            resp = oa.CompletionResponse(
                id=rid, created=created, model=body.model, choices=choices, usage=usage(jobs)
            )
            return JSONResponse(resp.model_dump())

        return await run_blocking(request, group, collect)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: Annotated[oa.ChatCompletionRequest, Depends(json_body(oa.ChatCompletionRequest))],
        request: Request,
    ):
        check_model(body.model)
        check_supported(body)
        check_sequences(1, body.n)
        ids = await run_in_threadpool(lambda: tokenizer.encode(chat_prompt(body.messages)))  # template too
        budget = body.output_budget(default=max(1, max_len - len(ids)))  # vLLM: the rest of the context
        check_prompt(ids, budget, "messages")
        jobs = make_jobs(body, [ids], [budget])
        await start_all(jobs, "chatcmpl")
        group = _Group(jobs)
        created, rid = int(time.time()), jobs[0].request_id
        want_ids, want_lp = body.return_token_ids, body.logprobs

        if body.stream:
            usage_wanted = bool((body.stream_options or {}).get("include_usage"))

            async def chunks():
                for job in jobs:
                    head = oa.ChatChunkChoice(
                        index=job.index, delta=oa.ChatDelta(role="assistant", content="")
                    )
                    yield oa.ChatCompletionChunk(
                        id=rid, created=created, model=body.model, choices=[head]
                    ).model_dump_json()
                async for job, d in interleave(jobs):
                    c = oa.ChatChunkChoice(
                        index=job.index,
                        delta=oa.ChatDelta(content=d.text),
                        finish_reason=d.finish_reason,
                        logprobs=chat_logprobs(d) if want_lp else None,
                        token_ids=d.token_ids if want_ids else None,
                    )
                    yield oa.ChatCompletionChunk(
                        id=rid, created=created, model=body.model, choices=[c]
                    ).model_dump_json()
                if usage_wanted:
                    yield oa.ChatCompletionChunk(
                        id=rid, created=created, model=body.model, choices=[], usage=usage(jobs)
                    ).model_dump_json()

            return sse(chunks(), group)

        async def collect():
            texts = {j.index: "" for j in jobs}
            async for job, d in interleave(jobs):
                texts[job.index] += d.text
            choices = [
                oa.ChatChoice(
                    index=j.index,
                    message=oa.ChatMessageOut(content=texts[j.index]),
                    finish_reason=j.finish_reason,
                    logprobs=chat_logprobs(j) if want_lp else None,
                    token_ids=j.token_ids if want_ids else None,
                )
                for j in jobs
            ]
            resp = oa.ChatCompletionResponse(
                id=rid, created=created, model=body.model, choices=choices, usage=usage(jobs)
            )
            return JSONResponse(resp.model_dump())

        return await run_blocking(request, group, collect)

    return app
