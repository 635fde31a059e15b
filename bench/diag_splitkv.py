"""(Needs bench/paged_attention_nofence.py: `git show 54ff117:looptrace/engine/kernels/paged_attention.py`.)
Run-to-run and alone-vs-batch bitwise checks of split-KV attention with and without the fences."""

import importlib.util
import sys

import torch

sys.path.insert(0, "bench")
from decode_attention_h200 import case_inputs  # noqa: E402


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


mods = {
    "fenced": load("looptrace/engine/kernels/paged_attention.py", "pa_f"),
    "nofence": load("bench/paged_attention_nofence.py", "pa_n"),
}
gen = torch.Generator(device="cuda").manual_seed(1)
for model, rows, ctx in (
    ("huginn-0125", 1, 640),
    ("ouro-1.4b", 8, 640),
    ("ouro-1.4b", 64, 2112),
    ("huginn-0125", 64, 640),
):
    q, k, v, tables, ctxs, scale = case_inputs(model, rows, ctx, gen)
    for name, m in mods.items():
        ref = m.paged_attention(q, k, v, tables, ctxs, 1, scale).clone()
        rerun = sum(
            not torch.equal(ref, m.paged_attention(q, k, v, tables, ctxs, 1, scale)) for _ in range(50)
        )
        n = min(rows, 8)
        alone = sum(
            not torch.equal(
                ref[r], m.paged_attention(q[r : r + 1], k, v, tables[r : r + 1], ctxs[r : r + 1], 1, scale)[0]
            )
            for r in range(n)
        )
        print(
            f"{model} rows {rows} ctx {ctx} {name}: rerun {rerun}/50, alone {alone}/{n}",
            flush=True,
        )
