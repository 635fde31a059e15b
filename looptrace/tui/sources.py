"""Where the dashboard's snapshots come from. No Textual here: `--once`, tests and the app share these.

Every source yields snapshots in one shape, the looptrace server's `/v1/stats` document (schema
`looptrace.stats/1`, built by `serve.engine_loop`); sources that cannot fill a section leave it None and the
panels say "n/a".

- `LooptraceSource(url)`: a running `looptrace serve`; `/v1/stats` once, or the `/v1/stats/stream` SSE.
- `PrometheusSource(url)`: any Prometheus text endpoint of a vLLM server (`vllm:` names; `looptrace:` works
  too), parsed with `prometheus_client.parser`; latency percentiles from histogram bucket deltas.
- `ReplaySource(path)`: a session recorded with `looptrace top --record FILE`.
- `InProcessSource(fn)`: `looptrace serve --tui`, reading the engine loop's snapshot directly.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looptrace.input_files import InputError, iter_jsonl
from looptrace.tui.snapshot_schema import SnapshotError, check_snapshot

SESSION_SCHEMA = "looptrace.top-session/1"
STATS_SCHEMA = "looptrace.stats/1"


class SourceError(RuntimeError):
    """The source cannot be read (unreachable URL, not a metrics endpoint, ...)."""


class ReplayError(ValueError):
    """A session file that is not a recorded looptrace top session (one line, FILE:LINE: why)."""


def normalize_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def auth_headers() -> dict[str, str]:
    """The server's `/v1/*` needs `Authorization: Bearer KEY` when it runs with `--api-key`; `top` sends
    the key of the LOOPTRACE_API_KEY environment variable (the same variable `serve` reads)."""
    key = os.environ.get("LOOPTRACE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _get(url: str, timeout: float) -> Any:
    # deferred: HTTP client and parser, only for a remote source
    import httpx

    try:
        url.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: httpx would raise while percent-encoding it
        raise SourceError(f"{ascii(url)}: not a URL (it holds text that is not valid Unicode)") from None
    try:
        resp = httpx.get(url, timeout=timeout, headers=auth_headers())
    except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL (`top '[bold]'`) is no HTTPError
        raise SourceError(f"{url}: cannot connect ({type(exc).__name__}: {exc or 'no answer'})") from None
    if resp.status_code != 200:
        raise SourceError(f"{url}: HTTP {resp.status_code}{_status_hint(resp.status_code)}")
    return resp


def _status_hint(status: int) -> str:
    """What to do about a refused request: a server started with --api-key wants the same key."""
    if status not in (401, 403):
        return ""
    if os.environ.get("LOOPTRACE_API_KEY"):
        return " (the server refused the key in LOOPTRACE_API_KEY: set it to the server's --api-key)"
    return " (the server wants an API key: set LOOPTRACE_API_KEY to its --api-key)"


def checked(snapshot: Any, where: str) -> dict[str, Any]:
    """`snapshot` if the dashboard can draw it, else SourceError naming `where` and the bad field."""
    try:
        check_snapshot(snapshot)
    except SnapshotError as exc:
        raise SourceError(f"{where}: {exc}") from None
    return snapshot


class LooptraceSource:
    kind = "looptrace"

    def __init__(self, url: str, timeout: float = 3.0) -> None:
        self.base = normalize_url(url)
        self.timeout = timeout
        self.label = self.base

    def fetch(self) -> dict[str, Any]:
        resp = _get(self.base + "/v1/stats", self.timeout)
        try:
            data = resp.json()
        except ValueError:
            raise SourceError(f"{self.base}/v1/stats: not JSON (is this a looptrace server?)") from None
        if not isinstance(data, dict) or data.get("schema") != STATS_SCHEMA:
            raise SourceError(f"{self.base}/v1/stats: not a looptrace stats document")
        return checked(data, f"{self.base}/v1/stats")

    def stream(self, interval: float, stopped: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        """Snapshots from the SSE stats stream until `stopped()` (checked at every event)."""
        # deferred: HTTP client and parser, only for a remote source
        import httpx
        from httpx_sse import connect_sse

        url = f"{self.base}/v1/stats/stream"
        try:
            with (
                httpx.Client(
                    timeout=httpx.Timeout(self.timeout, read=max(30.0, 4 * interval)), headers=auth_headers()
                ) as client,
                connect_sse(client, "GET", url, params={"interval": interval}) as events,
            ):
                status = events.response.status_code
                if status != 200:
                    raise SourceError(f"{url}: HTTP {status}{_status_hint(status)}")
                for sse in events.iter_sse():
                    if stopped():
                        return
                    if sse.event == "stats" and sse.data:
                        yield checked(json.loads(sse.data), url)
        except httpx.HTTPError as exc:
            raise SourceError(f"{url}: stream lost ({type(exc).__name__}: {exc or 'no answer'})") from None


class InProcessSource:
    kind = "in-process"

    def __init__(self, snapshot: Callable[[], dict[str, Any]], label: str = "in-process") -> None:
        self._snapshot, self.label = snapshot, label

    def fetch(self) -> dict[str, Any]:
        return self._snapshot()


# Prometheus (vLLM) ----------------------------------------------------------------------------------------
def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' rule: linear interpolation inside the bucket holding rank q * count.
    `buckets`: (upper bound, cumulative count), sorted, ending with +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


@dataclass
class _Scrape:
    values: dict[str, float] = field(default_factory=dict)  # sample name -> sum over label sets
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> count
    time: float = 0.0  # when it was scraped


def parse_prometheus(text: str) -> _Scrape:
    # deferred: HTTP client and parser, only for a remote source
    from prometheus_client.parser import text_string_to_metric_families

    out = _Scrape()
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith("_bucket") and "le" in s.labels:
                    b = out.buckets.setdefault(s.name[: -len("_bucket")], {})
                    le = float(s.labels["le"])
                    b[le] = b.get(le, 0.0) + s.value
                elif not math.isnan(s.value):
                    out.values[s.name] = out.values.get(s.name, 0.0) + s.value
    except ValueError as exc:
        raise SourceError(f"not Prometheus text format ({exc})") from None
    return out


LATENCY_NAMES = {
    "ttft": ("time_to_first_token_seconds",),
    "tpot": ("time_per_output_token_seconds", "request_time_per_output_token_seconds"),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2el": ("e2e_request_latency_seconds",),
}


class PrometheusSource:
    """Scrapes one Prometheus text endpoint; keeps the previous scrape for bucket deltas."""

    kind = "prometheus"

    def __init__(self, url: str, timeout: float = 3.0) -> None:
        url = normalize_url(url)
        self.url = url if "/" in url.split("://", 1)[1] else url + "/metrics"
        self.timeout = timeout
        self.label = f"{self.url} (Prometheus)"
        self._prev: _Scrape | None = None

    def fetch(self) -> dict[str, Any]:
        text = _get(self.url, self.timeout).text
        return self.convert(text, time.time())

    def convert(self, text: str, now: float) -> dict[str, Any]:
        scrape = parse_prometheus(text)
        scrape.time = now
        prefix = self._prefix(scrape)
        if prefix is None:
            raise SourceError(f"{self.url}: no vllm: or looptrace: metrics in this endpoint")
        prev, self._prev = self._prev, scrape
        return checked(snapshot_from_prometheus(scrape, prev, prefix, now, self.url), self.url)

    @staticmethod
    def _prefix(scrape: _Scrape) -> str | None:
        names = list(scrape.values) + list(scrape.buckets)
        for p in ("vllm:", "looptrace:"):
            if any(n.startswith(p) for n in names):
                return p
        return None


def _latency(scrape: _Scrape, prev: _Scrape | None, prefix: str, names: tuple[str, ...]) -> dict:
    """p50/p99 of one latency histogram. Prometheus histograms are cumulative since the server started:
    the percentiles are of the observations between the last two scrapes (window "interval", `window_s`
    seconds) when there are any, else of every observation since the start (window "total")."""
    for name in names:
        cur = scrape.buckets.get(prefix + name)
        if not cur:
            continue
        counts = dict(cur)
        window, window_s = "total", None
        if prev is not None and prefix + name in prev.buckets:
            old = prev.buckets[prefix + name]
            delta = {le: c - old.get(le, 0.0) for le, c in cur.items()}
            if delta.get(math.inf, 0) > 0:
                counts, window, window_s = delta, "interval", scrape.time - prev.time
        buckets = sorted(counts.items())
        n = buckets[-1][1] if buckets else 0
        return {
            "p50": histogram_quantile(0.5, buckets),
            "p99": histogram_quantile(0.99, buckets),
            "n": int(n),
            "window": window,
            "window_s": window_s,
        }
    return {"p50": None, "p99": None, "n": 0}


def snapshot_from_prometheus(
    scrape: _Scrape, prev: _Scrape | None, prefix: str, now: float, label: str
) -> dict[str, Any]:
    v = scrape.values

    def get(*names: str) -> float | None:
        for n in names:
            if prefix + n in v:
                return v[prefix + n]
        return None

    usage = get("kv_cache_usage_perc", "gpu_cache_usage_perc")
    queries, hits = get("prefix_cache_queries_total"), get("prefix_cache_hits_total")
    hit_rate = hits / queries if queries and hits is not None else get("gpu_prefix_cache_hit_rate")
    return {
        "schema": STATS_SCHEMA,
        "source": "prometheus",
        "time": now,
        "model": label,
        "requests": {
            "running": int(get("num_requests_running") or 0),
            "waiting": int(get("num_requests_waiting") or 0),
            "list": None,
        },
        "tokens": {
            "prompt_total": get("prompt_tokens_total"),
            "generation_total": get("generation_tokens_total"),
            "requests_finished": get("request_success_total"),
        },
        "latency": {k: _latency(scrape, prev, prefix, names) for k, names in LATENCY_NAMES.items()},
        "engine": None,
        "kv": {"usage": usage} if usage is not None else None,
        "graphs": None,
        "prefix": {"hit_rate": hit_rate, "hit_tokens": hits, "query_tokens": queries}
        if hit_rate is not None
        else None,
        "prefill_depth": get("prefill_depth"),
        "probe": None,
    }


# Recorded sessions ----------------------------------------------------------------------------------------
class ReplaySource:
    kind = "replay"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.header, self.frames = load_session(self.path)
        self.label = f"replay of {self.path.name} ({self.header.get('source', '?')})"

    def fetch(self) -> dict[str, Any]:
        return self.frames[-1][1]


def load_session(path: Path) -> tuple[dict[str, Any], list[tuple[float, dict[str, Any]]]]:
    """(header, [(t, snapshot)]) of a session file; ReplayError names the first bad line."""
    header: dict[str, Any] | None = None
    frames: list[tuple[float, dict[str, Any]]] = []
    try:  # looptrace.input_files: a regular file, within the nesting/number limits
        lines = list(iter_jsonl(path))
    except InputError as exc:
        raise ReplayError(str(exc).replace("invalid JSON", "not JSON")) from None
    for no, obj in lines:
        if not isinstance(obj, dict):
            raise ReplayError(f"{path}:{no}: expected a JSON object")
        if header is None:
            if obj.get("schema") != SESSION_SCHEMA:
                raise ReplayError(
                    f"{path}:{no}: not a looptrace top session (schema {SESSION_SCHEMA} expected)"
                )
            header = obj
            continue
        t, snap = obj.get("t"), obj.get("snapshot")
        if not isinstance(t, (int, float)) or not math.isfinite(t) or not isinstance(snap, dict):
            raise ReplayError(f'{path}:{no}: expected {{"t": seconds, "snapshot": {{...}}}}')
        try:
            check_snapshot(snap)
        except SnapshotError as exc:
            raise ReplayError(f"{path}:{no}: {exc}") from None
        if frames and t < frames[-1][0]:
            raise ReplayError(f"{path}:{no}: time goes backwards ({t} after {frames[-1][0]})")
        frames.append((float(t), snap))
    if header is None:
        raise ReplayError(f"{path}: empty session file")
    if not frames:
        raise ReplayError(f"{path}: the session has no snapshots")
    return header, frames


class Recorder:
    """Appends snapshots to a session file as they arrive (flushed per line: a crash keeps what was seen)."""

    def __init__(self, path: Path, source_label: str) -> None:
        self.path = Path(path)
        self._fh = self.path.open("w", encoding="utf-8")
        self._t0: float | None = None
        self.count = 0
        header = {"schema": SESSION_SCHEMA, "source": source_label, "started": time.time()}
        self._fh.write(json.dumps(header) + "\n")
        self._fh.flush()

    def write(self, snapshot: dict[str, Any], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._t0 is None:
            self._t0 = now
        self._fh.write(json.dumps({"t": round(now - self._t0, 4), "snapshot": snapshot}) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()
