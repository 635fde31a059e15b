"""Server plumbing around the routes: a request body limit and API-key auth (pure ASGI middlewares, so they
answer before FastAPI reads or parses anything), and JSON bodies parsed and validated off the event loop.

Both middlewares answer with the OpenAI error shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, get_origin

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
VALIDATE_CHUNK = 500  # list items validated per pydantic call (one call holds the GIL throughout)


async def send_error(send: Send, status: int, message: str, type_: str, code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimit:
    """413 for a request body over `max_bytes`: at once from Content-Length, else while it arrives. The
    body is buffered here (FastAPI would buffer it anyway) and replayed to the app; later `receive` calls
    (disconnect detection) go to the server as before."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(send, f"{declared} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
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

    async def _too_large(self, send: Send, size: str) -> None:
        message = (
            f"request body of {size} exceeds the server's limit of {self.max_bytes} bytes (--max-body-bytes)"
        )
        await send_error(send, 413, message, "invalid_request_error", "request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class ApiKeyAuth:
    """`Authorization: Bearer <key>` required on every `/v1/*` path (the dashboard's `/v1/stats*` too:
    `looptrace top` sends LOOPTRACE_API_KEY); /health, /metrics and the rest stay open, as vLLM leaves
    everything outside /v1 open. A constant-time comparison."""

    OPEN_PREFIXES: tuple[str, ...] = ()  # every /v1 path is guarded, as the issue and vLLM ask

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and (path == "/v1" or path.startswith("/v1/"))
            and not path.startswith(self.OPEN_PREFIXES)
        )
        if guarded and not hmac.compare_digest(_header(scope, b"authorization"), self.key):
            return await send_error(
                send, 401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
            )
        await self.app(scope, receive, send)


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
        pos, msg = getattr(exc, "pos", 0), getattr(exc, "msg", str(exc))
        err = {
            "type": "json_invalid",
            "loc": ("body", pos),
            "msg": "JSON decode error",
            "ctx": {"error": msg},
        }
        raise RequestValidationError([err]) from None
    try:
        if isinstance(data, dict):
            data = _long_lists_in_chunks(model, data)
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(_in_body(exc.errors(include_url=False))) from None


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
                items += adapter.validate_python(value[start : start + VALIDATE_CHUNK])
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                for e in errors:
                    e["loc"] = (name, e["loc"][0] + start, *e["loc"][1:]) if e["loc"] else (name,)
                raise RequestValidationError(_in_body(errors)) from None
        data = {**data, name: items}
    return data


def _in_body(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**e, "loc": ("body", *e["loc"])} for e in errors]
