"""Run-to-run determinism of eager decoding on a GPU: two fresh engines, same requests; where do the
per-loop hidden states first differ, and does forcing deterministic algorithms or an SDPA backend fix it?

    python bench/determinism_probe.py
"""

from __future__ import annotations

import contextlib
import sys

import torch

from looptrace.engine import EngineConfig, LLMEngine, Observer, SamplingParams


class Rec(Observer):
    wants_hidden = True

    def __init__(self):
        self.h = {}

    def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden):
        for rid, pos, row in zip(request_ids, positions, hidden):
            self.h[(rid, pos, loop_index)] = row.clone()


def run(preset: str, graphs: bool, hidden: bool):
    cfg = EngineConfig(noise="zeros")
    cfg.cuda_graphs.enabled = graphs
    cfg.scheduler.max_model_len = 256
    cfg.kv.num_blocks = 512 * (4 if preset.startswith("ouro") else 32) // 8
    eng = LLMEngine.from_preset(preset, cfg, device="cuda", seed=0)
    rec = Rec()
    if hidden:
        eng.attach(rec)
    prompts = [[(7 * i + 13 * j) % 5000 + 10 for j in range(40 + 9 * i)] for i in range(4)]
    out = eng.generate(prompts, SamplingParams(max_tokens=24))
    del eng
    torch.cuda.empty_cache()
    return out, rec.h


def first_divergence(a: dict, b: dict):
    keys = sorted(a, key=lambda k: (k[1], k[2], k[0]))
    for k in keys:
        if k in b and not torch.equal(a[k], b[k]):
            return k, (a[k] - b[k]).abs().max().item()
    return None


def main() -> None:
    variants = {
        "default": contextlib.nullcontext,
        "math_sdpa": lambda: torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]),
        "efficient_sdpa": lambda: torch.nn.attention.sdpa_kernel(
            [torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]
        ),
    }
    for preset in sys.argv[1:] or ["huginn-0125", "ouro-1.4b"]:
        for name, ctx in variants.items():
            with ctx():
                o1, h1 = run(preset, False, name == "default")
                o2, h2 = run(preset, False, name == "default")
            same = sum(a == b for a, b in zip(o1, o2))
            msg = f"{preset} eager {name}: {same}/4 identical token streams"
            if name == "default":
                msg += f"; first hidden divergence {first_divergence(h1, h2)} of {len(h1)} states"
            print(msg, flush=True)
        torch.use_deterministic_algorithms(True)
        o1, _ = run(preset, False, False)
        o2, _ = run(preset, False, False)
        torch.use_deterministic_algorithms(False)
        print(f"{preset} eager deterministic_algorithms: {sum(a == b for a, b in zip(o1, o2))}/4", flush=True)


if __name__ == "__main__":
    main()
