"""`kernels.attention` (torch | triton): the engine wiring of the paged Triton attention path. The kernel
itself is tested in kernels/test_paged_attention.py (interpreter on CPU, bf16 on the GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from looptrace.engine.layers import (
    META_CTX,
    META_FIXED,
    AttentionMetadata,
    PagedAttention,
    TritonAttentionMetadata,
    TritonPagedAttention,
)
from tests.helpers import build_engine, run_interpreted


def test_triton_attention_is_inactive_on_cpu_and_keeps_the_torch_path():
    eng = build_engine("ouro-tiny", kernels__attention="triton")
    assert "kernels.attention" in eng.inactive_settings
    assert type(eng.runner.metadata) is AttentionMetadata  # the torch path's mask and gather list are built
    assert not any(isinstance(m, TritonPagedAttention) for m in eng.model.modules())
    assert any(isinstance(m, PagedAttention) for m in eng.model.modules())
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
    eager = AttentionMetadata(16)(raw, rope, torch.float32, cache, cache)
    lazy = TritonAttentionMetadata(16)(raw, rope, torch.float32, cache, cache)
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
from looptrace.engine.assemble import install, install_variants
from looptrace.engine.layers import TritonAttentionMetadata
torch.set_num_threads(1)
out = []
for triton in (False, True):
    spec, net = load_checkpoint(shipped_weights("ouro-tiny"), torch.device("cpu"), torch.float32)
    eng = LLMEngine(net, EngineConfig(noise="zeros"), device=torch.device("cpu"), dtype=torch.float32)
    if triton:
        assert install_variants(eng.model, "kernels.attention") == spec.num_layers
        install(eng.runner.metadata, TritonAttentionMetadata)
    out.append(eng.generate([[3, 5, 7, 9, 11], [4, 6, 8]], SamplingParams(max_tokens=3)))
print("RESULT " + json.dumps(out))
"""
    torch_tokens, triton_tokens = run_interpreted(code)
    assert triton_tokens == torch_tokens and len(torch_tokens[0]) == 3


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable")
@pytest.mark.parametrize("model", ["ouro-tiny", "huginn-tiny"])
def test_packed_prefill_on_the_interpreted_triton_path_gives_the_torch_paths_tokens(model):
    # prefill.packed under Triton attention: each request's prompt rows in query blocks of the packed
    # kernel (chunks of 4 rows: later chunks read cached keys; two requests share a prefill batch), eager
    # and through prefill graphs (blocks are a graph input). fp32, trained tiny checkpoints: the same
    # greedy tokens as per-row and packed torch attention. max_num_seqs 2 (both requests fit): the kernel's
    # grid holds min(rows, max_num_seqs) query blocks, padding included, and the interpreter runs padding
    # programs too; at the default 8 every chunk launched 7-8 blocks for 1-2 spans (1.5x the time).
    code = f"""
import json, torch
from looptrace.assets import shipped_weights
from looptrace.engine import EngineConfig, LLMEngine, SamplingParams
from looptrace.engine.checkpoint import load_checkpoint
from looptrace.engine.config import PrefillConfig, SchedulerConfig
from looptrace.engine.kernels import packed_attention
from looptrace.engine.assemble import install, install_variants
from looptrace.engine.layers import TritonAttentionMetadata
torch.set_num_threads(1)
out, blocks_seen, packed_calls, calls = [], [], [], []
kernel = packed_attention.packed_attention
packed_attention.packed_attention = lambda *a: packed_calls.append(1) or kernel(*a)
from tests.helpers import stand_in_graphs
runs = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
for packed, triton, graphs in runs:
    spec, net = load_checkpoint(shipped_weights("{model}"), torch.device("cpu"), torch.float32)
    cfg = EngineConfig(
        noise="zeros",
        prefill=PrefillConfig(packed=packed),
        scheduler=SchedulerConfig(prefill_chunk_size=4, max_num_batched_tokens=8, max_num_seqs=2),
    )
    eng = LLMEngine(net, cfg, device=torch.device("cpu"), dtype=torch.float32)
    if triton:
        install_variants(eng.model, "kernels.attention")
        install(eng.runner.metadata, TritonAttentionMetadata)
        eng.runner.triton_attention = True
        paths = eng.runner.prefill_paths
        make = paths.packed_blocks
        paths.packed_blocks = lambda spans, rows: blocks_seen.append(len(spans)) or make(spans, rows)
    if graphs:  # prefill chunks through the graph path (a CPU stand-in graph cache): blocks as an input
        eng.runner.prefill_graphs = stand_in_graphs("prefill", eng.runner.passes.prefill_pass)
    out.append(eng.generate([[3, 5, 7, 9, 11, 13, 2], [4, 6, 8]], SamplingParams(max_tokens=3)))
    calls.append(len(packed_calls))
    packed_calls.clear()
replays = eng.runner.prefill_graphs.counters.replays + eng.runner.prefill_graphs.counters.captures
print("RESULT " + json.dumps([out, blocks_seen, calls, replays]))
"""
    tokens, spans_per_batch, calls, graph_runs = run_interpreted(code)
    per_row, torch_packed, triton_packed, graphed = tokens
    assert graphed == triton_packed == torch_packed == per_row and len(per_row[0]) == 3
    assert graph_runs >= 2  # the last run's prefill chunks went through the (stand-in) graph cache
    assert max(spans_per_batch) == 2  # a batch held chunks of both requests
    assert calls[:2] == [0, 0] and calls[2] > 0 and calls[3] >= calls[2]  # graphed: + stand-in captures
