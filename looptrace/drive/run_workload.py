"""`looptrace run`'s workload options -> a Workload: which kind, its prompts within host memory, the
longest request it can need (sizes the engine) and whether its requests fit the engine's context.

Bad input is a one-line `WorkloadError` (the CLI: exit code 2). numpy (drive.workloads) loads inside the
functions: `looptrace --help` stays fast.
"""

from __future__ import annotations

import enum
from pathlib import Path


class WorkloadKind(str, enum.Enum):
    burst = "burst"
    poisson = "poisson"
    sessions = "sessions"
    jsonl = "jsonl"


def make_workload(kind: WorkloadKind, **options):
    """CLI options -> a Workload: `workloads.make_workload`, the one constructor (imported here when
    called, so that importing this module loads no numpy)."""
    # deferred: numpy and YAML: `looptrace --help` stays light
    from looptrace.drive.workloads import make_workload as make

    return make(kind, **options)


def resolve_workload(
    kind: WorkloadKind | None, prompts: Path | None, rate: float | None, num_requests: int | None
) -> WorkloadKind:
    """--prompts FILE alone implies --workload jsonl; an option of another workload than the one chosen
    is an error (it would be silently ignored)."""
    # deferred: numpy and YAML: `looptrace --help` stays light
    from looptrace.drive.workloads import WorkloadError

    kind = kind or (WorkloadKind.jsonl if prompts is not None else WorkloadKind.burst)
    if prompts is not None and kind != WorkloadKind.jsonl:
        raise WorkloadError(f"--prompts FILE is for --workload jsonl, not --workload {kind.value}")
    for flag, value in (("--rate", rate), ("--num-requests", num_requests)):
        if value is not None and kind != WorkloadKind.poisson:
            raise WorkloadError(f"{flag} is for --workload poisson, not --workload {kind.value}")
    return kind


def check_workload_memory(kind: WorkloadKind, wl) -> None:
    """The prompts a synthetic workload draws, within host memory (before they are drawn)."""
    # deferred: the engine's modules load when a command runs: `looptrace --help` stays light
    from looptrace.engine.budget import check_memory, workload_needs

    if kind == WorkloadKind.burst:
        requests, tokens, setting = wl.concurrency, wl.prompt_len, "--concurrency / --prompt-len"
    elif kind == WorkloadKind.poisson:
        requests, tokens, setting = wl.num_requests, wl.prompt_len, "--num-requests / --prompt-len"
    elif kind == WorkloadKind.sessions:
        requests, tokens = wl.num_sessions, wl.max_prompt_len()
        setting = "--sessions / --turns / --prompt-len"
    else:
        return  # a JSONL file is already in memory
    check_memory(workload_needs(requests, tokens, setting), "cpu")


def workload_max_len(workload) -> int:
    """Longest prompt + output any item of the workload can need (sizes the engine's decode tables)."""
    if hasattr(workload, "max_prompt_len"):
        longest = workload.max_prompt_len()
    else:
        longest = max((len(i.prompt) for i in workload.initial_items()), default=1)
    most = max((i.max_tokens for i in workload.initial_items()), default=1)
    return longest + max(most, getattr(workload, "max_tokens", 0))


def check_fits(workload, max_len: int) -> None:
    """Every request must fit the context: the ones known up front, and a session's last turn (its
    prompt holds every earlier turn), which would otherwise be rejected only after the others ran."""
    # deferred: numpy and YAML: `looptrace --help` stays light
    from looptrace.drive.workloads import WorkloadError

    if hasattr(workload, "max_prompt_len"):
        need = workload.max_prompt_len() + workload.max_tokens - 1
        if need > max_len:
            raise WorkloadError(
                f"the last of {workload.turns} turns needs {need} KV positions (every earlier turn's prompt "
                f"and output); max context is {max_len}: lower --turns, --turn-prompt-len or --max-tokens"
            )
    for item in workload.initial_items():
        need = len(item.prompt) + item.max_tokens - 1
        if need > max_len:
            raise WorkloadError(
                f"prompt of {len(item.prompt)} tokens + max_tokens {item.max_tokens} needs {need} KV "
                f"positions; max context is {max_len}"
            )
