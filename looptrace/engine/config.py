"""Engine configuration: every knob and toggle a recipe can set.

These are plain dataclasses so the engine has no validation dependency. `looptrace.recipes` validates a
YAML recipe against them (pydantic reads `__pydantic_config__`, so unknown keys are rejected with their
path; numeric bounds live in each field's metadata: `ge`, `gt`, `le`). Toggles are data: each
string-valued choice selects one implementation from a small table in the
file that owns that role (kv_cache.LAYOUTS, scheduler.POLICIES, exit_policy.EXIT_POLICIES, noise.NOISE).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

_STRICT = {"extra": "forbid"}  # read by pydantic when validating a recipe


@dataclass
class KVConfig:
    __pydantic_config__ = _STRICT
    # `planes`: one KV plane per recurrence depth (LAST_EXITED); `shared`: one plane, every loop of a core
    # layer overwrites the same slot.
    layout: Literal["planes", "shared"] = "planes"
    block_size: int = field(default=16, metadata={"ge": 1})
    # Pool size in blocks. None: CPU gets `cpu_pool_tokens` tokens; CUDA sizes the pool from free memory.
    num_blocks: int | None = field(default=None, metadata={"ge": 1})
    cpu_pool_tokens: int = field(default=8192, metadata={"ge": 1})
    gpu_memory_utilization: float = field(default=0.90, metadata={"gt": 0, "le": 1})
    # Blocks kept free at admission (headroom against fragmentation).
    watermark_blocks: int = field(default=0, metadata={"ge": 0})
    # Prefix cache over full blocks (chained SHA-256 keys); pages publish only at full coverage.
    prefix_caching: bool = True
    # Debug/test aid: fill freed blocks with a large finite value so stale history would show up.
    poison_freed_blocks: bool = False


@dataclass
class SchedulerConfig:
    __pydantic_config__ = _STRICT
    # `refill`: stage choice per step (base engine default); `norefill`: cohort fill -> core -> coda.
    policy: Literal["refill", "norefill"] = "refill"
    max_num_seqs: int = field(default=8, metadata={"ge": 1})
    max_num_batched_tokens: int = field(default=128, metadata={"ge": 1})
    prefill_chunk_size: int = field(default=128, metadata={"ge": 1})
    max_prefill_batches_before_decode: int = field(default=1, metadata={"ge": 0})
    min_coda_batch_size: int = field(default=1, metadata={"ge": 1})
    admission: Literal["fcfs", "priority"] = "fcfs"
    admission_scan_limit: int = field(default=64, metadata={"ge": 1})
    max_admission_bypasses: int = field(default=8, metadata={"ge": 0})
    # Longest prompt + output (tokens). None: the model's max positions (capped by the pool).
    max_model_len: int | None = field(default=None, metadata={"ge": 1})


@dataclass
class ExitConfig:
    __pydantic_config__ = _STRICT
    # `fixed`: every token runs max_loops; `threshold`: Ouro's cumulative exit probability with min_loops.
    policy: Literal["fixed", "threshold"] = "fixed"
    threshold: float = field(default=1.0, metadata={"gt": 0, "le": 1})
    min_loops: int = field(default=2, metadata={"ge": 1})
    # None: the model's default depth (Ouro 4, Huginn 32).
    max_loops: int | None = field(default=None, metadata={"ge": 1})


@dataclass
class GraphConfig:
    __pydantic_config__ = _STRICT
    enabled: bool = True  # only on CUDA
    max_graphs: int = field(default=16, metadata={"ge": 0})
    max_batch_size: int = field(default=128, metadata={"ge": 1})
    # `none`: the first `max_graphs` keys stay forever (base engine); `lru`: evict the least recently used.
    eviction: Literal["none", "lru"] = "none"
    # None: capture lazily on first use. A list: capture only these row counts, others run eager
    # (fallback reason `unseen_size`).
    capture_sizes: list[int] | None = None
    # Also capture the coda (Huginn coda layers + head; Ouro head) per row count.
    coda: bool = True


@dataclass
class EngineConfig:
    __pydantic_config__ = _STRICT
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    exit: ExitConfig = field(default_factory=ExitConfig)
    cuda_graphs: GraphConfig = field(default_factory=GraphConfig)
    # Huginn/OLMo initial recurrent state: `sequential` = per-request generator, trunc-normal draws in
    # processing order (base engine); `zeros` = deterministic zero state.
    noise: Literal["sequential", "zeros"] = "sequential"
    attention: Literal["torch"] = "torch"


def config_to_dict(obj: Any) -> Any:
    """Nested dataclass -> plain dict (for JSON metadata)."""
    if is_dataclass(obj):
        return {f.name: config_to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [config_to_dict(x) for x in obj]
    return obj
