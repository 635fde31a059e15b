"""An arm of `looptrace diff` that is an OpenAI-compatible server (vLLM, `looptrace serve`), seen only
through HTTP: the model id from /v1/models, then one /v1/completions request per prompt with token-id
prompts, `logprobs` (the legacy completions field: per position the token's logprob and the top-k
alternatives, keyed by token text) and `return_token_ids` (vLLM's extension: the sampled ids), so that
streams are compared as token ids, never as re-tokenized text.

A recipe arm is served the same way: `served_recipe()` builds our engine for the recipe and serves it
in-process on 127.0.0.1 (a port the OS picks), so both arms go through the same API and the same client.

Every request is answered or fails on its own: a timeout, a dropped connection or a 5xx is retried
(`retries` times), a 4xx is not; what is left is recorded on the request (`Served.error`), never raised.
Only an endpoint that cannot be used at all (unreachable, no such model) is an `EndpointError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from looptrace.build import BuildRequest, build, device_name
from looptrace.engine.tokenizer import load_tokenizer

DEFAULT_TIMEOUT_S = 60.0
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # worth a second try; other 4xx are our request


class EndpointError(ValueError):
    """An endpoint that cannot be used at all (the CLI: one line, exit 2)."""


def is_endpoint(arm: str | None) -> bool:
    return bool(arm) and arm.startswith(("http://", "https://"))


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, without /v1
    model: str  # the model id sent in every request
    label: str  # what the report calls it: the URL, or "recipe base (in-process)"


@dataclass(frozen=True)
class PromptItem:
    id: str  # r0, r1, ...
    prompt: list[int]  # token ids: both arms get exactly these
    max_tokens: int


@dataclass(frozen=True)
class Sampling:
    """What every request asks for; greedy unless `temperature` > 0 (then `seed` makes it repeatable)."""

    max_tokens: int = 8
    temperature: float = 0.0
    seed: int | None = None
    top_logprobs: int = 5  # alternatives per position (vLLM allows up to its --max-logprobs, default 20)
    ignore_eos: bool = True  # same length on both arms, so that later positions can be compared

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Position:
    """One served token: what it was, its logprob and the top-k alternatives (text -> logprob). This is
    the record a reference judge (teacher-forced scoring by our engine) would re-score position by
    position."""

    token_id: int
    text: str
    logprob: float | None
    top: dict[str, float] = field(default_factory=dict)


@dataclass
class Served:
    """One request's answer from one arm: its positions, or the error that ended it."""

    id: str
    positions: list[Position] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [p.token_id for p in self.positions]


# Discovery -----------------------------------------------------------------------------------------------
def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def discover(
    url: str, served_model: str | None, *, timeout: float = 10.0, api_key: str | None = None
) -> Endpoint:
    """The endpoint with its model id: `served_model` when given (it must be listed), else the first model
    /v1/models lists. Unreachable, not OpenAI-compatible or without that model: EndpointError."""
    root = base_url(url)
    try:
        resp = httpx.get(f"{root}/v1/models", timeout=timeout, headers=_headers(api_key))
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: cannot reach the endpoint ({_why(exc)})") from None
    if resp.status_code != 200:
        raise EndpointError(f"{url}: GET /v1/models answered HTTP {resp.status_code} ({_error_text(resp)})")
    try:
        ids = [str(m["id"]) for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(f"{url}: GET /v1/models is not an OpenAI model list") from None
    if not ids:
        raise EndpointError(f"{url}: /v1/models lists no model")
    if served_model is not None and served_model not in ids:
        raise EndpointError(f"{url}: no model '{served_model}' (it serves {', '.join(ids)})")
    return Endpoint(root, served_model or ids[0], root)


def tokenize(
    ep: Endpoint,
    text: str,
    *,
    add_special_tokens: bool = True,
    timeout: float = 10.0,
    api_key: str | None = None,
) -> list[int]:
    """The endpoint's own tokenization of `text` (vLLM's and looptrace's /tokenize)."""
    body = {"model": ep.model, "prompt": text, "add_special_tokens": add_special_tokens}
    try:
        resp = httpx.post(f"{ep.url}/tokenize", json=body, timeout=timeout, headers=_headers(api_key))
    except httpx.HTTPError as exc:
        raise EndpointError(f"{ep.label}: cannot reach the endpoint ({_why(exc)})") from None
    if resp.status_code != 200:
        raise EndpointError(
            f"{ep.label}: POST /tokenize answered HTTP {resp.status_code} ({_error_text(resp)})"
        )
    return [int(t) for t in resp.json()["tokens"]]


# Requests ------------------------------------------------------------------------------------------------
def run_arm(
    ep: Endpoint,
    items: list[PromptItem],
    sampling: Sampling,
    *,
    concurrency: int,
    timeout: float = DEFAULT_TIMEOUT_S,
    retries: int = 1,
    api_key: str | None = None,
) -> list[Served]:
    """Every item through `ep`, in item order, at most `concurrency` outstanding; one `Served` per item."""
    return asyncio.run(_run_arm(ep, items, sampling, concurrency, timeout, retries, api_key))


async def _run_arm(ep, items, sampling, concurrency, timeout, retries, api_key) -> list[Served]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=_headers(api_key)) as client:

        async def one(item: PromptItem) -> Served:
            async with gate:
                return await _complete(client, ep, item, sampling, retries)

        return list(await asyncio.gather(*(one(it) for it in items)))


def request_body(ep: Endpoint, item: PromptItem, sampling: Sampling) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": ep.model,
        "prompt": item.prompt,  # token ids (OpenAI and vLLM accept a list of ints)
        "max_tokens": item.max_tokens,
        "temperature": sampling.temperature,
        "logprobs": sampling.top_logprobs,
        "return_token_ids": True,
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


async def _complete(client, ep: Endpoint, item: PromptItem, sampling: Sampling, retries: int) -> Served:
    out = Served(item.id)
    body = request_body(ep, item, sampling)
    for attempt in range(1, retries + 2):
        out.attempts = attempt
        try:
            resp = await client.post(f"{ep.url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            out.error = _why(exc)
            continue
        if resp.status_code == 200:
            return _parse_choice(out, resp)
        out.error = f"HTTP {resp.status_code}: {_error_text(resp)}"
        if resp.status_code not in RETRY_STATUS:
            break
    if out.attempts > 1:
        out.error = f"{out.error} (after {out.attempts} attempts)"
    return out


def _parse_choice(out: Served, resp: httpx.Response) -> Served:
    """The first choice's token ids and logprobs; a body without them is the request's error."""
    try:
        choice = resp.json()["choices"][0]
        ids, lp = choice.get("token_ids"), choice.get("logprobs")
        if ids is None:
            out.error = "the response has no token_ids (the server ignores return_token_ids)"
            return out
        if lp is None or len(lp["tokens"]) != len(ids):
            out.error = "the response has no per-token logprobs"
            return out
        tops = lp.get("top_logprobs") or [None] * len(ids)
        out.positions = [
            Position(int(t), str(text), _float(v), dict(top or {}))
            for t, text, v, top in zip(ids, lp["tokens"], lp["token_logprobs"], tops)
        ]
        out.text = str(choice.get("text") or "")
        out.finish_reason = choice.get("finish_reason")
        out.error = None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        out.error = f"unreadable response ({type(exc).__name__}: {exc})"
    return out


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _why(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _error_text(resp: httpx.Response) -> str:
    """The OpenAI error message when there is one, else the start of the body."""
    try:
        return str(resp.json()["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return " ".join(resp.text.split())[:200] or "empty body"


# A recipe as an arm --------------------------------------------------------------------------------------
@contextmanager
def served_recipe(
    recipe: str,
    sets: list[str] | None,
    *,
    model: str | None,
    device: str = "auto",
    dtype: str = "auto",
    weights=None,
    seed: int = 0,
    threads: int = 1,
    max_model_len: int = 2048,
) -> Iterator[tuple[Endpoint, dict[str, Any]]]:
    """Our engine for `recipe` behind `looptrace serve`'s app on 127.0.0.1 (an OS-chosen port), for as
    long as the block runs: (the endpoint, facts about it: preset, device, dtype)."""
    # deferred: FastAPI and uvicorn, only for a recipe arm served in-process
    from looptrace.serve.server import build_server

    request = BuildRequest(
        model=model,
        weights=weights,
        recipe=recipe,
        sets=tuple(sets or ()),
        device=device,
        dtype=dtype,
        seed=seed,
        threads=threads,
        max_model_len=max_model_len,
    )
    resolved = request.resolve_model()
    setup = build(request, resolved)
    engine = setup.engine
    name = engine.spec.family
    tok = load_tokenizer(resolved.weights)  # the checkpoint's own tokenizer (bytes when it has none)
    server = build_server(engine, port=0, model_name=name, tokenizer=tok).start()
    overrides = f" + {', '.join(setup.recipe.overrides)}" if setup.recipe.overrides else ""
    facts = {
        "recipe": setup.recipe.name + overrides,
        "preset": engine.spec.name,
        "vocab_size": engine.spec.vocab_size,
        "device": device_name(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
    }
    try:
        yield Endpoint(server.url, name, f"recipe {facts['recipe']} (in-process)"), facts
    finally:
        server.stop()
