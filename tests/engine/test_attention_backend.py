"""`kernels.attention` (torch | triton): the engine wiring of the paged Triton attention path. The kernel
itself is tested in test_paged_attention_kernel.py (interpreter on CPU, bf16 on the GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looptrace.engine.layers import META_CTX, META_FIXED, AttentionMetadata, PagedAttention
from tests.helpers import build_engine

ROOT = Path(__file__).resolve().parents[2]


def test_triton_attention_is_inactive_on_cpu_and_keeps_the_torch_path():
    eng = build_engine("ouro-tiny", kernels__attention="triton")
    assert "kernels.attention" in eng.inactive_settings
    assert eng.runner.metadata.torch_path  # the torch path's mask and gather list are built per traversal
    assert not any(m.triton for m in eng.model.modules() if isinstance(m, PagedAttention))
    torch_path = build_engine("ouro-tiny", kernels__attention="torch")
    assert "kernels.attention" not in torch_path.inactive_settings


def test_metadata_mask_and_gather_are_the_same_built_now_or_on_first_use():
    rope = type("Rope", (), {"tables": staticmethod(lambda pos, dtype: (pos.float(), pos.float()))})()
    raw = torch.full((3, META_FIXED + 4), -1, dtype=torch.int64)
    raw[:, META_CTX] = torch.tensor([1, 17, 40])
    raw[:, META_FIXED] = torch.tensor([0, 5, 9])
    raw[1:, META_FIXED + 1] = torch.tensor([6, 10])
    raw[2, META_FIXED + 2] = 11
    cache = torch.zeros(12, 16, 1, 4)
    meta = AttentionMetadata(16)
    eager = meta(raw, rope, torch.float32, cache, cache)
    meta.torch_path = False
    lazy = meta(raw, rope, torch.float32, cache, cache)
    assert lazy._mask is None and lazy._gather is None  # the Triton path pays for neither
    assert torch.equal(lazy.mask, eager.mask) and torch.equal(lazy.gather_entries, eager.gather_entries)
    assert eager.mask[:, 0, 0].sum(-1).tolist() == [1, 17, 40]
    other = AttentionMetadata.for_plane(raw, eager)
    assert other.mask is eager.mask  # another plane of the same rows shares the mask


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")
def test_engine_tokens_with_the_interpreted_triton_attention_equal_the_torch_path():
    # The whole engine (prefill, recurrent and coda traversals, trained ouro-tiny, fp32) with every
    # PagedAttention switched to the Triton kernels, run by Triton's interpreter in a child process.
    code = """
import json, torch
from looptrace.assets import shipped_weights
from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.checkpoint import load_checkpoint
from looptrace.engine.layers import enable_triton_attention
torch.set_num_threads(1)
out = []
for triton in (False, True):
    spec, net = load_checkpoint(shipped_weights("ouro-tiny"), torch.device("cpu"), torch.float32)
    eng = LLMEngine(net, EngineConfig(noise="zeros"), device=torch.device("cpu"), dtype=torch.float32)
    if triton:
        assert enable_triton_attention(eng.model) == spec.num_layers
        eng.runner.metadata.torch_path = False
    out.append(eng.generate([[3, 5, 7, 9, 11], [4, 6, 8]], SamplingParams(max_tokens=3)))
print("RESULT " + json.dumps(out))
"""
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_tokens, triton_tokens = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert triton_tokens == torch_tokens and len(torch_tokens[0]) == 3
