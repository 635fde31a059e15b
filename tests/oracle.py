"""Dense, unbatched, per-request reference forward for the three looped families.

Written independently of the engine: plain functions over the checkpoint's public tensor names, one
position at a time, a dense K/V list per (physical layer, loop). Complex-number RoPE for Huginn, explicit
rotate-half for Ouro/OLMo, explicit softmax attention. Semantics of the `planes` layout: at loop t a
query reads each earlier position's key of loop t, or — if that position exited at depth e <= t — its
key of loop e (the exit plane copied into deeper planes). Semantics of the `shared` layout: one slot per
(layer, position) that every loop overwrites, so a query reads each earlier position's key of its last loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from looptrace.engine.model_config import ModelSpec
from tests.helpers import Recorder


def HiddenRecorder() -> Recorder:  # noqa: N802 - the states-only recorder the oracle tests attach
    return Recorder(hidden=True)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_half(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:  # x [H, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (pos * inv).float()
    cos, sin = torch.cat([ang.cos(), ang.cos()]).to(x.dtype), torch.cat([ang.sin(), ang.sin()]).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope_interleaved(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2)[: d // 2].float() / d)
    rot = torch.polar(torch.ones(d // 2), pos * inv)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).reshape(x.shape).to(x.dtype)


def attend(q: torch.Tensor, keys: list[torch.Tensor], vals: list[torch.Tensor]) -> torch.Tensor:
    """q [H, D]; keys/vals: one [KVH, D] per visible position."""
    k, v = torch.stack(keys), torch.stack(vals)  # [n, KVH, D]
    groups = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v.float()).to(q.dtype).reshape(-1)


@dataclass
class DenseKV:
    """kv[(layer, loop)] = list of (k, v) by position; loop 0 for prelude/coda layers."""

    kv: dict[tuple[int, int], list] = field(default_factory=dict)

    def put(self, layer: int, loop: int, pos: int, k, v, overwrite: bool = False) -> None:
        lst = self.kv.setdefault((layer, loop), [])
        if overwrite and len(lst) == pos + 1:  # shared layout: a later loop replaces the slot
            lst[pos] = (k, v)
            return
        assert len(lst) == pos, f"layer {layer} loop {loop}: writing {pos} after {len(lst)}"
        lst.append((k, v))

    def read(self, layer: int, loop: int, upto: int):
        lst = self.kv[(layer, loop)][: upto + 1]
        return [k for k, _ in lst], [v for _, v in lst]


class Oracle:
    def __init__(
        self, spec: ModelSpec, state_dict: dict[str, torch.Tensor], max_loops: int, shared: bool = False
    ) -> None:
        self.s, self.w, self.L, self.shared = spec, state_dict, max_loops, shared
        self.kv = DenseKV()
        self.pos = 0
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}  # (pos, loop) -> state after the loop
        self.gates: dict[tuple[int, int], float] = {}

    # ---- shared pieces ----
    def _attn(self, prefix: str, x, layer: int, loop: int, pos: int):
        s, w = self.s, self.w
        nh, kvh, d = s.num_heads, s.num_kv_heads, s.head_dim
        if s.family == "ouro":
            q = x @ w[prefix + "q_proj.weight"].T
            k = x @ w[prefix + "k_proj.weight"].T
            v = x @ w[prefix + "v_proj.weight"].T
        else:
            q, k, v = (x @ w[prefix + "Wqkv.weight"].T).split([nh * d, kvh * d, kvh * d])
            if s.qk_norm:
                q = rms(q, w[prefix + "q_norm.weight"], s.rms_norm_eps)
                k = rms(k, w[prefix + "k_norm.weight"], s.rms_norm_eps)
        q, k, v = q.reshape(nh, d), k.reshape(kvh, d), v.reshape(kvh, d)
        if s.qk_bias:
            q = q + w[prefix + "qk_bias"][0, 0]
            k = k + w[prefix + "qk_bias"][1, 0]
        rope = rope_interleaved if s.rope_style == "interleaved" else rope_half
        q, k = rope(q, pos, s.rope_theta), rope(k, pos, s.rope_theta)
        loop = 0 if self.shared else loop
        self.kv.put(layer, loop, pos, k, v, overwrite=self.shared)
        keys, vals = self.kv.read(layer, loop, pos)
        out = attend(q, keys, vals)
        return out @ w[prefix + ("o_proj.weight" if s.family == "ouro" else "proj.weight")].T

    def _mlp(self, prefix: str, x):
        w = self.w
        if self.s.family == "ouro":
            g, u = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
            return (torch.nn.functional.silu(g) * u) @ w[prefix + "down_proj.weight"].T
        g, u = (x @ w[prefix + "fc.weight"].T).chunk(2)
        return (torch.nn.functional.silu(g) * u) @ w[prefix + "proj.weight"].T

    def _block(self, prefix: str, x, layer: int, loop: int, pos: int):
        s, w, eps = self.s, self.w, self.s.rms_norm_eps
        n = lambda name, t: rms(t, w[prefix + name + ".weight"], eps)  # noqa: E731
        if s.family == "ouro":
            x = x + n(
                "input_layernorm_2",
                self._attn(prefix + "self_attn.", n("input_layernorm", x), layer, loop, pos),
            )
            return x + n(
                "post_attention_layernorm_2", self._mlp(prefix + "mlp.", n("post_attention_layernorm", x))
            )
        if s.family == "huginn":
            x = n("norm_2", self._attn(prefix + "attn.", n("norm_1", x), layer, loop, pos) + x)
            return n("norm_4", self._mlp(prefix + "mlp.", n("norm_3", x)) + x)
        x = x + n("norm_1", self._attn(prefix + "attn.", x, layer, loop, pos))
        return x + n("norm_2", self._mlp(prefix + "mlp.", x))

    # ---- one position ----
    def step(self, token: int, depth: int, state0: torch.Tensor | None = None) -> torch.Tensor:
        """Runs position `self.pos` to exit depth `depth`; returns logits [V]."""
        s, w, pos = self.s, self.w, self.pos
        if s.family == "ouro":
            h = w["model.embed_tokens.weight"][token]
            for t in range(depth):
                for i in range(s.n_core):
                    h = self._block(f"model.layers.{i}.", h, i, t, pos)
                h = rms(h, w["model.norm.weight"], s.rms_norm_eps)
                self.hidden[(pos, t)] = h
                g = h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]
                self.gates[(pos, t)] = float(g)
            self._copy_deeper(pos, depth, range(s.n_core))
            logits = h @ w["lm_head.weight"].T
        else:
            e = w["transformer.wte.weight"][token] * (s.embed_scale if s.embed_scale != 1.0 else 1)
            for i in range(s.n_prelude):
                e = self._block(f"transformer.prelude.{i}.", e, i, 0, pos)
            x = torch.zeros_like(e) if state0 is None else state0
            core = range(s.n_prelude, s.n_prelude + s.n_core)
            for t in range(depth):
                x = torch.cat([x, e]) @ w["transformer.adapter.weight"].T
                for j, layer in enumerate(core):
                    x = self._block(f"transformer.core_block.{j}.", x, layer, t, pos)
                self.hidden[(pos, t)] = x
            self._copy_deeper(pos, depth, core)
            y = rms(x, w["transformer.ln_f.weight"], s.rms_norm_eps) if s.family == "huginn" else x
            for k in range(s.n_coda):
                y = self._block(f"transformer.coda.{k}.", y, s.n_prelude + s.n_core + k, 0, pos)
            y = rms(y, w["transformer.ln_f.weight"], s.rms_norm_eps)
            head = w.get("lm_head.weight", w["transformer.wte.weight"])
            logits = y @ head.T
        self.pos += 1
        return logits

    def _copy_deeper(self, pos: int, depth: int, layers) -> None:
        if self.shared:  # one slot per position already holds the exit loop's key
            return
        for layer in layers:
            k, v = self.kv.kv[(layer, depth - 1)][pos]
            for t in range(depth, self.L):
                self.kv.put(layer, t, pos, k, v)


def reference_run(
    spec: ModelSpec,
    state_dict,
    max_loops: int,
    prompt: list[int],
    outputs: list[int],
    depths: list[int],
    shared: bool = False,
) -> tuple[Oracle, list[torch.Tensor]]:
    """Teacher-forced dense run: the prompt at full depth, then each fed-back output at its exit depth.
    Returns the oracle (hidden states, gates) and the logits that produced each output token."""
    o = Oracle(spec, state_dict, max_loops, shared)
    logits = []
    for tok in prompt[:-1]:
        o.step(tok, max_loops)
    logits.append(o.step(prompt[-1], max_loops))
    for i, tok in enumerate(outputs[:-1]):
        logits.append(o.step(tok, depths[i + 1]))
    return o, logits
