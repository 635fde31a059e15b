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


def make_workload(
    kind: WorkloadKind,
    *,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    rate: float | None,
    num_requests: int | None,
    sessions: int,
    turns: int,
    turn_prompt_len: int,
    prompts: Path | None,
    seed: int,
    vocab_size: int,
    tokenizer_dir: Path | None,
):
    """CLI options -> a Workload; the workload validates its own numbers (one-line WorkloadError)."""
    from looptrace.drive import workloads as w
    from looptrace.drive.workloads import WorkloadError

    shared = dict(max_tokens=max_tokens, seed=seed, vocab_size=vocab_size)
    if kind == WorkloadKind.burst:
        return w.BurstWorkload(concurrency=concurrency, prompt_len=prompt_len, **shared)
    if kind == WorkloadKind.poisson:
        if rate is None:
            raise WorkloadError("--workload poisson needs --rate (requests per second)")
        count = concurrency if num_requests is None else num_requests
        return w.PoissonWorkload(rate=rate, num_requests=count, prompt_len=prompt_len, **shared)
    if kind == WorkloadKind.sessions:
        return w.SessionWorkload(
            num_sessions=sessions,
            turns=turns,
            first_prompt_len=prompt_len,
            turn_prompt_len=turn_prompt_len,
            **shared,
        )
    return _jsonl_workload(prompts, tokenizer_dir, max_tokens, vocab_size)


def _jsonl_workload(prompts: Path | None, tokenizer_dir: Path | None, max_tokens: int, vocab_size: int):
    from looptrace.drive.workloads import JsonlWorkload, WorkloadError
    from looptrace.engine.tokenizer import load_tokenizer

    if prompts is None:
        raise WorkloadError("--workload jsonl needs --prompts FILE")
    return JsonlWorkload(
        path=prompts,
        tokenizer=load_tokenizer(tokenizer_dir),
        default_max_tokens=max_tokens,
        vocab_size=vocab_size,
    )


def resolve_workload(
    kind: WorkloadKind | None, prompts: Path | None, rate: float | None, num_requests: int | None
) -> WorkloadKind:
    """--prompts FILE alone implies --workload jsonl; an option of another workload than the one chosen
    is an error (it would be silently ignored)."""
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
    """Every request known up front must fit the context (later session turns are checked as they come)."""
    from looptrace.drive.workloads import WorkloadError

    for item in workload.initial_items():
        need = len(item.prompt) + item.max_tokens - 1
        if need > max_len:
            raise WorkloadError(
                f"prompt of {len(item.prompt)} tokens + max_tokens {item.max_tokens} needs {need} KV "
                f"positions; max context is {max_len}"
            )
