"""Where do CUDA-graph replays and eager calls differ bitwise? Op-level and pass-level probes on a GPU.

python bench/graph_vs_eager_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looptrace.engine import EngineConfig, LLMEngine, SamplingParams


def in_graph(fn, *inputs):
    static = [x.clone() for x in inputs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*static)
    g.replay()
    torch.cuda.synchronize()
    return out


def ops() -> None:
    torch.manual_seed(0)
    shapes = {
        "qkv 2048": (2048, 2048),
        "up 5632": (2048, 5632),
        "down": (5632, 2048),
        "head": (2048, 49152),
        "huginn fc": (5280, 35840),
        "huginn Wqkv": (5280, 15840),
    }
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 2, 3, 4, 5, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager = F.linear(x, w)
            graph = in_graph(lambda a, w=w: F.linear(a, w), x)
            print(f"linear {name:12s} M={m:2d}: bitwise {torch.equal(eager, graph)}")


def passes() -> None:
    for preset in ("ouro-1.4b", "huginn-0125"):
        outs = {}
        for mode in ("graph", "eager", "eager2"):
            cfg = EngineConfig(noise="zeros")
            cfg.cuda_graphs.enabled = mode == "graph"
            cfg.scheduler.max_model_len = 256
            cfg.kv.num_blocks = 512 * (4 if preset.startswith("ouro") else 32) // 8
            eng = LLMEngine.from_preset(preset, cfg, device="cuda", seed=0)
            prompts = [[(7 * i + 13 * j) % 5000 + 10 for j in range(40 + 9 * i)] for i in range(4)]
            outs[mode] = eng.generate(prompts, SamplingParams(max_tokens=24))
            del eng
            torch.cuda.empty_cache()
        for other in ("eager", "eager2"):
            same = sum(a == b for a, b in zip(outs["graph"], outs[other]))
            print(f"{preset}: graph vs {other}: {same}/4 identical")
        same = sum(a == b for a, b in zip(outs["eager"], outs["eager2"]))
        print(f"{preset}: eager vs eager2: {same}/4 identical")


def core_pass(preset: str) -> None:
    """One recurrent traversal on identical inputs: eager call vs captured replay."""
    from looptrace.engine.layers import META_SLOT
    from looptrace.engine.request import Stage
    from looptrace.engine.runner import Row

    cfg = EngineConfig(noise="zeros")
    cfg.scheduler.max_model_len = 256
    cfg.kv.num_blocks = 2048
    eng = LLMEngine.from_preset(preset, cfg, device="cuda", seed=0)
    for i in range(4):
        eng.add_request([(11 * i + j) % 3000 + 5 for j in range(30 + i)], SamplingParams(max_tokens=8))
    while True:  # step until a recurrent batch is next
        eng.step()
        if eng.scheduler.queues[Stage.RECURRENT] and not eng.scheduler.queues[Stage.PRELUDE]:
            break
    r = eng.runner
    reqs = list(eng.scheduler.queues[Stage.RECURRENT])
    rows = [Row(q, q.decode_position) for q in reqs]
    planes = [eng.layout.plane("core", q.loops_done) for q in reqs]
    raw = r.staging.to_device(r._raw(rows, [planes], r._decode_width(rows)))[0]
    slots = raw[:, META_SLOT]
    inputs = (raw, r.state_pool.index_select(0, slots))
    if r.inject_pool is not None:
        inputs += (r.inject_pool.index_select(0, slots),)
    with torch.inference_mode():
        eager = [t.clone() for t in r._core_pass(*inputs)]
        graph = [t.clone() for t in r.recurrent_graphs.run(len(rows), inputs)]
        eager2 = [t.clone() for t in r._core_pass(*inputs)]
    torch.cuda.synchronize()
    for i, (a, b, c) in enumerate(zip(eager, graph, eager2)):
        print(
            f"{preset} core pass R={len(rows)} output {i}: eager==graph {torch.equal(a, b)} "
            f"eager==eager {torch.equal(a, c)} max|diff| {(a.float() - b.float()).abs().max().item():.3g}"
        )


if __name__ == "__main__":
    ops()
    core_pass("ouro-1.4b")
    core_pass("huginn-0125")
    passes()
