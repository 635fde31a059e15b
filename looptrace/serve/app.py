"""The FastAPI app: OpenAI-compatible completions and chat, /v1/models, /health, /metrics and the stats
stream. Handlers never touch the engine: they tokenize, validate, `EngineLoop.submit()` and then read the
request's events from an asyncio queue the engine thread feeds. A client that disconnects (streaming or
not) gets its request aborted, which frees its KV blocks before the next engine step.

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` with a 4xx status for
bad requests (malformed JSON, invalid fields, unknown model, prompt too long); nothing a client sends can
stop the server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from looptrace.engine.request import SamplingParams
from looptrace.serve import openai_schema as oa
from looptrace.serve.engine_loop import Accepted, EngineLoop, Failed, Rejected, TokenEvent
from looptrace.serve.metrics import ServerMetrics

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


class _Job:
    """One request in flight: its queue of engine events and its bookkeeping."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, body: oa._Request, prompt: list[int]) -> None:
        self.loop, self.body, self.prompt = loop, body, prompt
        self.queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        self.text = TextStream(tokenizer, body.stop_list())
        self.request_id = ""
        self.done = False
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []

        def sink(event) -> None:
            aloop.call_soon_threadsafe(self.queue.put_nowait, event)

        self.sink = sink

    def params(self) -> SamplingParams:
        b = self.body
        return SamplingParams(
            max_tokens=b.output_budget(),
            temperature=b.temperature,
            top_k=b.top_k,
            top_p=b.top_p,
            seed=b.seed,
            ignore_eos=b.ignore_eos,
        )

    async def start(self, prefix: str) -> None:
        rid = self.loop.new_request_id(prefix)
        self.loop.submit(self.prompt, self.params(), self.sink, request_id=rid)
        try:
            event = await self.queue.get()
        except asyncio.CancelledError:
            self.loop.abort(rid)
            raise
        if isinstance(event, Rejected):
            raise APIError(400, event.message, param="prompt")
        if isinstance(event, Failed):
            raise APIError(500, event.message, "server_error")
        assert isinstance(event, Accepted)
        self.request_id = event.request_id

    async def next_delta(self) -> tuple[str, list[int]]:
        """Text and token ids of the next engine event; sets `done`/`finish_reason` at the end."""
        event = await self.queue.get()
        if isinstance(event, Failed):
            self.done, self.finish_reason = True, "error"
            raise APIError(500, event.message, "server_error")
        assert isinstance(event, TokenEvent)
        self.token_ids.append(event.token_id)
        text = self.text.add(event.token_id)
        if self.text.stopped:
            self.done, self.finish_reason = True, "stop"
            self.loop.abort(self.request_id, "stop")  # the engine may still be generating: free it now
        elif event.finished:
            self.done, self.finish_reason = True, event.finish_reason or "length"
            text += self.text.flush()
        return text, [event.token_id]

    def cancel(self) -> None:
        if self.request_id and not self.done:
            self.done = True
            self.loop.abort(self.request_id, "abort")

    def usage(self) -> oa.Usage:
        n = len(self.token_ids)
        return oa.Usage(
            prompt_tokens=len(self.prompt), completion_tokens=n, total_tokens=len(self.prompt) + n
        )


def create_app(
    loop: EngineLoop,
    *,
    tokenizer: Any,
    metrics: ServerMetrics,
    model_name: str,
    aliases: tuple[str, ...] = (),
    stats_interval: float = 0.5,
) -> FastAPI:
    app = FastAPI(title="looptrace serve", version="1", docs_url=None, redoc_url=None)
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
        if first.get("type") == "json_invalid":
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

    def check_prompt(ids: list[int], body: oa._Request) -> None:
        if not ids:
            raise APIError(400, "prompt is empty: at least one token is needed", param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} outside the vocabulary [0, {vocab})", param="prompt")
        need = len(ids) + body.output_budget() - 1
        if need > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested {need} "
                f"tokens ({len(ids)} in the prompt, {body.output_budget()} for the completion).",
                param="max_tokens" if len(ids) <= max_len else "prompt",
                code="context_length_exceeded",
            )

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
                async for data in gen:
                    yield {"data": data}
            except APIError as exc:  # the response has started: report in-stream, as OpenAI does
                body = oa.ErrorResponse(error=oa.ErrorBody(message=exc.message, type=exc.type, code=exc.code))
                yield {"data": body.model_dump_json()}
            else:
                yield {"data": "[DONE]"}
            finally:
                job.cancel()  # a disconnect cancels this generator: abort the request, free its KV

        return EventSourceResponse(events(), ping=15, sep="\n")

    # Routes -------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not loop.alive:
            return error_response(503, "engine thread is not running", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        cards = [oa.ModelCard(id=n, max_model_len=max_len) for n in [model_name, *aliases]]
        return oa.ModelList(data=cards).model_dump()

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
            while True:
                yield {"event": "stats", "data": json.dumps(loop.snapshot())}
                await asyncio.sleep(interval)  # the stream's cadence, not synchronisation

        return EventSourceResponse(gen(), ping=15, sep="\n")

    @app.post("/v1/completions")
    async def completions(body: oa.CompletionRequest, request: Request):
        check_model(body.model)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (got a list of several)", param="prompt")
            p = p[0]
        # Special tokens on, as vLLM encodes a completion prompt: the tokenizer adds BOS where its model
        # expects one (the trained tiny checkpoints do; a chat template writes its own).
        ids = tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        check_prompt(ids, body)
        job = _Job(loop, tokenizer, body, ids)
        await job.start("cmpl")
        created, rid = int(time.time()), job.request_id
        echo = tokenizer.decode(ids) if body.echo else ""
        want_ids = body.return_token_ids

        if body.stream:
            usage_wanted = bool((body.stream_options or {}).get("include_usage"))

            async def chunks():
                first = True
                while not job.done:
                    text, toks = await job.next_delta()
                    if first and echo:
                        text, first = echo + text, False
                    choice = oa.CompletionChoice(
                        text=text,
                        finish_reason=job.finish_reason if job.done else None,
                        token_ids=toks if want_ids else None,
                    )
                    yield oa.CompletionResponse(
                        id=rid, created=created, model=body.model, choices=[choice]
                    ).model_dump_json()
                if usage_wanted:
                    yield oa.CompletionResponse(
                        id=rid, created=created, model=body.model, choices=[], usage=job.usage()
                    ).model_dump_json()

            return sse(chunks(), job)

        async def collect():
            text = ""
            while not job.done:
                delta, _ = await job.next_delta()
                text += delta
            choice = oa.CompletionChoice(
                text=echo + text,
                finish_reason=job.finish_reason,
                token_ids=job.token_ids if want_ids else None,
            )
            resp = oa.CompletionResponse(
                id=rid, created=created, model=body.model, choices=[choice], usage=job.usage()
            )
            return JSONResponse(resp.model_dump())

        return await run_blocking(request, job, collect)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oa.ChatCompletionRequest, request: Request):
        check_model(body.model)
        ids = tokenizer.encode(chat_prompt(body.messages))
        check_prompt(ids, body)
        job = _Job(loop, tokenizer, body, ids)
        await job.start("chatcmpl")
        created, rid = int(time.time()), job.request_id
        want_ids = body.return_token_ids

        if body.stream:
            usage_wanted = bool((body.stream_options or {}).get("include_usage"))

            async def chunks():
                head = oa.ChatChunkChoice(delta=oa.ChatDelta(role="assistant", content=""))
                yield oa.ChatCompletionChunk(
                    id=rid, created=created, model=body.model, choices=[head]
                ).model_dump_json()
                while not job.done:
                    text, toks = await job.next_delta()
                    choice = oa.ChatChunkChoice(
                        delta=oa.ChatDelta(content=text),
                        finish_reason=job.finish_reason if job.done else None,
                        token_ids=toks if want_ids else None,
                    )
                    yield oa.ChatCompletionChunk(
                        id=rid, created=created, model=body.model, choices=[choice]
                    ).model_dump_json()
                if usage_wanted:
                    yield oa.ChatCompletionChunk(
                        id=rid, created=created, model=body.model, choices=[], usage=job.usage()
                    ).model_dump_json()

            return sse(chunks(), job)

        async def collect():
            text = ""
            while not job.done:
                delta, _ = await job.next_delta()
                text += delta
            choice = oa.ChatChoice(
                message=oa.ChatMessageOut(content=text),
                finish_reason=job.finish_reason,
                token_ids=job.token_ids if want_ids else None,
            )
            resp = oa.ChatCompletionResponse(
                id=rid, created=created, model=body.model, choices=[choice], usage=job.usage()
            )
            return JSONResponse(resp.model_dump())

        return await run_blocking(request, job, collect)

    return app
