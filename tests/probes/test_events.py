"""Event model and loaders: normalisation, formats, metadata and one-line errors."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from looptrace.probes.events import (
    Trace,
    TraceError,
    TraceEvent,
    load_chrome_trace,
    normalize_api_name,
    parse_chrome_trace,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("cudaLaunchKernel_v7000", "cudaLaunchKernel"),
        ("cudaGraphLaunch_v10000", "cudaGraphLaunch"),
        ("cudaStreamBeginCapture_v10000", "cudaStreamBeginCapture"),
        ("cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2"),  # _v2/_v3 are part of the API name
        ("cuLaunchKernel_v3", "cuLaunchKernel_v3"),
        ("cudaFoo_v123", "cudaFoo_v123"),  # fewer than 4 digits: not a CUPTI suffix
        ("cudaLaunchKernel", "cudaLaunchKernel"),
    ],
)
def test_normalize_api_name(raw: str, expected: str) -> None:
    assert normalize_api_name(raw) == expected


@settings(max_examples=50, deadline=None)
@given(st.from_regex(r"cu[A-Za-z]{1,20}", fullmatch=True), st.integers(1000, 10**7))
def test_normalize_strips_any_long_suffix_and_is_idempotent(base: str, version: int) -> None:
    name = normalize_api_name(f"{base}_v{version}")
    assert name == base
    assert normalize_api_name(name) == name


def test_event_properties() -> None:
    e = TraceEvent.from_dict(
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 2.5, "pid": 0, "tid": 7,
         "args": {"correlation": 42, "External id": 9, "graph id": 3, "bytes": 64}}
    )  # fmt: skip
    assert (e.correlation, e.external_id, e.graph_id, e.bytes, e.end) == (42, 9, 3, 64, 12.5)
    bare = TraceEvent.from_dict({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1})
    assert (bare.correlation, bare.external_id, bare.graph_id) == (None, None, None)
    assert (bare.bytes, bare.dur) == (0, 0.0)


def test_only_api_names_are_normalised(kt) -> None:
    kt.runtime("cudaLaunchKernel_v7000", 0.0)
    kt.runtime("cuLaunchKernelEx_v11060", 5.0, cat="cuda_driver")
    kt.kernel("my_kernel_v1234", 10.0, 1.0, 1)  # a kernel name is never rewritten
    trace = parse_chrome_trace(kt.to_dict())
    assert [e.name for e in trace.events] == ["cudaLaunchKernel", "cuLaunchKernelEx", "my_kernel_v1234"]


def test_load_object_keeps_complete_events_and_metadata(kt, tmp_path) -> None:
    kt.annotation("lt.window/decode", 0.0, 100.0)
    kt.cpu_op("aten::mm", 1.0, 5.0)
    path = kt.write(tmp_path / "t.json", distributedInfo={"rank": 0, "world_size": 2})
    trace = load_chrome_trace(path)
    assert isinstance(trace, Trace)
    assert [e.cat for e in trace.events] == ["user_annotation", "cpu_op"]  # "M" and "i" events dropped
    assert trace.device_properties[0]["name"] == "NVIDIA H200"
    assert trace.distributed_info == {"rank": 0, "world_size": 2}
    assert trace.metadata["schemaVersion"] == 1
    assert "traceEvents" not in trace.metadata
    assert trace.source == str(path)
    assert trace.by_cat("cpu_op")[0].name == "aten::mm"


def test_load_bare_list_and_gzip(kt, tmp_path) -> None:
    kt.cpu_op("aten::add", 0.0, 1.0)
    kt.cpu_op("aten::mul", 2.0, 1.0)
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(kt.events))
    gz = tmp_path / "t.json.gz"
    with gzip.open(gz, "wt") as fh:
        json.dump(kt.to_dict(), fh)
    assert [e.name for e in load_chrome_trace(listed).events] == ["aten::add", "aten::mul"]
    assert load_chrome_trace(listed).metadata == {}
    assert [e.name for e in load_chrome_trace(gz).events] == ["aten::add", "aten::mul"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"traceEvents": [', "invalid JSON"),
        ("not json", "invalid JSON"),
        ('{"foo": 1}', "without a 'traceEvents' list"),
        ("42", "expected an object or a list"),
        ('[{"ph": "X", "cat": "cpu_op", "name": "x", "ts": "soon"}]', "event 0 has no numeric"),
        ('[{"ph": "X", "cat": "cpu_op", "name": "x"}]', "event 0 has no numeric"),
    ],
)
def test_bad_content_raises_one_line_error(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TraceError) as err:
        load_chrome_trace(path)
    assert message in str(err.value)
    assert str(err.value).startswith(str(path))
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_missing_directory_and_bad_gzip(tmp_path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_chrome_trace(tmp_path / "missing.json")
    with pytest.raises(TraceError, match="is a directory"):
        load_chrome_trace(tmp_path)
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match="cannot read trace") as err:
        load_chrome_trace(bad)
    assert "\n" not in str(err.value)


def test_empty_trace_loads_with_no_events(tmp_path) -> None:
    path = tmp_path / "empty.json"
    path.write_text('{"traceEvents": []}')
    assert load_chrome_trace(path).events == []


class _FakeProfile:
    """Stands in for torch.profiler.profile: exports once, like torch."""

    def __init__(self, events: list[dict]) -> None:
        self.events, self.exported = events, False

    def export_chrome_trace(self, path: str) -> None:
        assert not self.exported, "Trace is already saved."
        self.exported = True
        with open(path, "w") as fh:
            json.dump({"traceEvents": self.events}, fh)


def test_trace_from_profiler_temp_file_and_kept_file(kt, tmp_path) -> None:
    from looptrace.probes.events import trace_from_profiler

    kt.cpu_op("aten::mm", 0.0, 1.0)
    live = trace_from_profiler(_FakeProfile(kt.events))
    assert (live.source, [e.name for e in live.events]) == ("<torch.profiler>", ["aten::mm"])
    kept = trace_from_profiler(_FakeProfile(kt.events), tmp_path / "kept.json")
    assert kept.source == str(tmp_path / "kept.json")
    assert load_chrome_trace(tmp_path / "kept.json").events[0].name == "aten::mm"
