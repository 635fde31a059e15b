"""Server plumbing around the routes: a request body limit with a read timeout and API-key auth (pure ASGI
middlewares, so they answer before FastAPI reads or parses anything), JSON bodies parsed and validated off
the event loop, and uvicorn's HTTP protocol answering malformed HTTP with the JSON error shape.

Everything here answers with the OpenAI error shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, get_origin

import h11
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0  # a client that sends no body bytes for this long gets a 408 and is closed
DRAIN_POLL_S = 0.25  # a body read checks this often whether a shutdown began (then: 503, no more waiting)
VALIDATE_CHUNK = 500  # list items validated per pydantic call (one call holds the GIL throughout)
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only then can a parsed string hold a lone one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def error_bytes(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_error(
    send: Send, status: int, message: str, type_: str, code: str | None = None, close: bool = False
) -> None:
    """The JSON error response; `close`: and close the connection (its request body was not read)."""
    body = error_bytes(message, type_, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, but a request that is not valid HTTP (a bad chunk size, `Content-Length:
    -1`, headers over the size limit) gets the JSON error shape instead of uvicorn's `text/plain` body.
    The connection is closed after it, as uvicorn closes it."""

    def send_400_response(self, msg: str) -> None:
        body = error_bytes(f"malformed HTTP request: {msg}", "invalid_request_error", "bad_http_request")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class BodyLimit:
    """413 for a request body over `max_bytes`: at once from Content-Length, else while it arrives. 408 for
    a client that stops sending its body for `timeout` seconds (uvicorn has no body read timeout: a stalled
    upload held its connection forever), 503 at once when a shutdown begins mid-body (it would otherwise
    hold the drain open and be cancelled with a traceback). The body is buffered here (FastAPI would buffer
    it anyway) and replayed to the app; later `receive` calls (disconnect detection) go to the server."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        timeout: float = DEFAULT_BODY_TIMEOUT_S,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.app, self.max_bytes, self.timeout, self.draining = app, max_bytes, timeout, draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(send, f"{declared} bytes")
        chunks, size = [], 0
        while True:
            message = await self._next_chunk(receive)
            if isinstance(message, tuple):  # (status, message, code): timed out, or a shutdown began
                status, why, code = message
                return await send_error(send, status, why, "invalid_request_error", code, close=True)
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send, f"more than {self.max_bytes} bytes")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _next_chunk(self, receive: Receive) -> Message | tuple[int, str, str]:
        """The next body message, or the error to answer when none comes in time or the server drains.
        The wait is sliced so that a drain is noticed within DRAIN_POLL_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        task = asyncio.ensure_future(receive())
        try:
            while True:
                left = deadline - loop.time()
                done, _ = await asyncio.wait({task}, timeout=max(0.0, min(left, DRAIN_POLL_S)))
                if done:
                    return task.result()
                if self.draining():
                    return 503, "the server is shutting down", "unavailable"
                if loop.time() >= deadline:
                    why = f"no request body bytes for {self.timeout:g} s (--body-timeout)"
                    return 408, why, "request_timeout"
        finally:
            if not task.done():
                task.cancel()

    async def _too_large(self, send: Send, size: str) -> None:
        message = (
            f"request body of {size} exceeds the server's limit of {self.max_bytes} bytes (--max-body-bytes)"
        )
        await send_error(send, 413, message, "invalid_request_error", "request_too_large", close=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class ApiKeyAuth:
    """`Authorization: Bearer <key>` required on every path but /health (a load balancer's probe): the
    completions, /tokenize and /detokenize (model work), /metrics and the dashboard's /v1/stats* (`looptrace
    top` sends LOOPTRACE_API_KEY). The scheme is case-insensitive (RFC 9110); a constant-time comparison."""

    OPEN_PATHS: frozenset[str] = frozenset({"/health"})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and scope.get("path", "") not in self.OPEN_PATHS
        )
        if guarded and not self._authorized(_header(scope, b"authorization")):
            return await send_error(
                send, 401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
            )
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def _header(scope: Scope, name: bytes) -> bytes:
    return next((v for k, v in scope.get("headers", ()) if k == name), b"")


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the request body parsed and validated as `model` in a worker thread, long
    lists in chunks. FastAPI's own body parameter does it on the event loop, and pydantic holds the GIL
    for a whole call: 200k chat messages froze every client for seconds. Errors are FastAPI's
    RequestValidationError, shaped as FastAPI shapes them, so the 400s read the same."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        return await asyncio.to_thread(_parse, model, raw)

    return parse


def _parse(model: type[M], raw: bytes) -> M:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" at character {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
        raise _invalid_json(f"{getattr(exc, 'msg', None) or exc}{where}") from None
    except RecursionError:  # the C parser recurses per level: ~1,000 deep is its limit, not a server bug
        raise _invalid_json("nested too deeply") from None
    except ValueError as exc:  # an integer literal over Python's 4,300-digit conversion limit
        raise _invalid_json(str(exc).split(";")[0]) from None
    if SURROGATE_ESCAPE.search(raw):  # rare: walk the strings only when the body escapes a surrogate
        where = _lone_surrogate(data)
        if where is not None:
            msg = "a string holds a lone UTF-16 surrogate (not a Unicode character)"
            err = {"type": "string_unicode", "loc": ("body", *where), "msg": msg}
            raise RequestValidationError([err])
    try:
        if isinstance(data, dict):
            data = _long_lists_in_chunks(model, data)
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(_in_body(exc.errors(include_url=False))) from None
    except RecursionError:  # pragma: no cover - json.loads refuses such depth first
        raise _invalid_json("nested too deeply") from None


def _invalid_json(why: str) -> RequestValidationError:
    """The error of an unparsable body; `loc` names no field (a byte offset is no parameter)."""
    error = {"type": "json_invalid", "loc": ("body",), "msg": why, "ctx": {"error": why}}
    return RequestValidationError([error])


def _lone_surrogate(data: Any) -> tuple[str | int, ...] | None:
    """The location of the first string (key or value) holding a lone surrogate, else None. Iterative: the
    body may be nested as deep as json.loads allows."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return loc
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    return loc
                stack.append(((*loc, key), item))
        elif isinstance(value, list):
            stack.extend(((*loc, i), item) for i, item in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _long_lists_in_chunks(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Validate the items of each long `list[X]` field VALIDATE_CHUNK at a time (between chunks the event
    loop gets the GIL back); the model then takes the validated items as they are."""
    for name, field in model.model_fields.items():
        value = data.get(name)
        if not (
            isinstance(value, list) and len(value) > VALIDATE_CHUNK and get_origin(field.annotation) is list
        ):
            continue
        adapter, items = TypeAdapter(field.annotation), []
        for start in range(0, len(value), VALIDATE_CHUNK):
            try:
                items += adapter.validate_python(value[start : start + VALIDATE_CHUNK], strict=True)
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                for e in errors:
                    e["loc"] = (name, e["loc"][0] + start, *e["loc"][1:]) if e["loc"] else (name,)
                raise RequestValidationError(_in_body(errors)) from None
        data = {**data, name: items}
    return data


def _in_body(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**e, "loc": ("body", *e["loc"])} for e in errors]
