"""bench/kernel_persistent_loop.py's `--stream` forms: flags to `loop_streamed` arguments, and a bad entry
refused in one line (exit 2) before any GPU work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")


@needs_triton
def test_stream_flags_become_loop_streamed_arguments(monkeypatch):
    sys.path.insert(0, str(BENCH))
    import kernel_persistent_loop as kb

    from looptrace.engine.kernels import stream_loop as sl

    seen = []
    monkeypatch.setattr(sl, "loop_streamed", lambda *a, **kw: seen.append(kw))
    forms = kb.parse_streams("20:4:ws:kv0,12:4:kv1:noattn:nobar,16:4:ws")
    assert list(forms) == ["stream 20:4:ws:kv0", "stream 12:4:kv1:noattn:nobar", "stream 16:4:ws"]
    assert [f.ablated for f in forms.values()] == [False, True, False]
    for form in forms.values():
        form()
    assert seen == [
        dict(slots=20, num_warps=4, specialized=True, ablate=0, kv_blocks=0),
        dict(slots=12, num_warps=4, specialized=False, ablate=sl.NO_ATTENTION.value | sl.NO_BARRIERS.value,
             kv_blocks=1),
        dict(slots=16, num_warps=4, specialized=True, ablate=0),
    ]  # fmt: skip


@needs_triton
@pytest.mark.parametrize(
    "entry, says",
    [("20:4:wz", "unknown flag 'wz'"), ("x:4", "must be numbers"), ("16:4:kvx", "unknown flag 'kvx'")],
)
def test_a_bad_stream_entry_is_one_line_and_exit_2(tmp_path, entry, says):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(BENCH / "kernel_persistent_loop.py"), "--out", str(out), "--stream", entry],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert says in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not out.exists()
