"""LoopDuet depth analysis (shared/reference/base-engine.md section 11): state distances, the q90 table,
the (S, P) recommendation, the layer-pass ratio R_layer (Eq. 3) and the Amdahl wall-time estimate (Eq. 4).

Everything here is a pure function over numbers, plus `StateCapture`, an engine observer that keeps the
recurrent state after every loop of every position (`Observer.wants_hidden`). Loop counts are 1-based:
h^k is the state after k loops (the engine's 0-based `loop_index` k - 1). The state is the carried
recurrent state the engine passes between loops (Huginn/OLMo: core output before ln_f; Ouro: the loop's
normed output); the paper leaves normed vs raw open.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from looptrace.engine.depth_control import queue_age_p
from looptrace.engine.hooks import Observer, StepResult

ROLES = ("prompt", "final_prefill", "decode")
ROLE_LABELS = {
    "prompt": "ordinary prompt token",
    "final_prefill": "final prefill token",
    "decode": "decode token",
}
PAPER_TAU = 0.24  # prompt-token q90 threshold (pooled 0.240964)
PAPER_DECODE_TAU = 0.11  # the paper's decoding threshold, drawn for reference


class DepthInputError(ValueError):
    """Bad analysis input (tau, S, P); one line."""


# Capture ---------------------------------------------------------------------------------------------------
class StateCapture(Observer):
    """Keeps `hidden` of every (request, position, loop) the engine reports (prefill and decode)."""

    wants_hidden = True

    def __init__(self) -> None:
        self.states: dict[str, dict[tuple[int, int], np.ndarray]] = {}

    def on_loop_hidden(self, stage, loop_index, request_ids, positions, hidden) -> None:
        h = hidden.numpy()
        for i, (rid, pos) in enumerate(zip(request_ids, positions)):
            self.states.setdefault(rid, {})[(loop_index, pos)] = h[i].astype(np.float64)

    def trajectory(self, request_id: str, length: int, loops: int) -> np.ndarray:
        """[loops, length, hidden]: the state after loop k+1 at every position 0..length-1."""
        got = self.states[request_id]
        return np.stack([np.stack([got[(t, p)] for p in range(length)]) for t in range(loops)])


class StepTimer(Observer):
    """Wall time of engine steps by stage (the prefill fraction f of Eq. 4)."""

    def __init__(self) -> None:
        self.by_stage: dict[str, float] = {}

    def on_step_end(self, result: StepResult) -> None:
        self.by_stage[result.stage] = self.by_stage.get(result.stage, 0.0) + result.elapsed_s

    @property
    def total(self) -> float:
        return sum(self.by_stage.values())

    @property
    def prefill_fraction(self) -> float:
        return self.by_stage.get("prefill", 0.0) / self.total if self.total > 0 else 0.0


def roles_for(prompt_len: int, answer_len: int) -> list[str]:
    """Positions 0..L-2 ordinary prompt, L-1 the final prefill token, then the fed-back decode tokens."""
    return ["prompt"] * (prompt_len - 1) + ["final_prefill"] + ["decode"] * answer_len


# Distances and the q90 table -----------------------------------------------------------------------------
def distances(traj: np.ndarray, p: int, s: int) -> np.ndarray:
    """d_i(P; S) = ||h_i^P - h_i^S|| / ||h_i^S|| for every position i (traj: [loops, positions, hidden])."""
    check_cell(s, p, traj.shape[0])
    hs = traj[s - 1]
    return np.linalg.norm(traj[p - 1] - hs, axis=-1) / np.linalg.norm(hs, axis=-1)


def check_cell(s: int, p: int, s_ref: int) -> None:
    if not 1 <= p <= s:
        raise DepthInputError(f"need 1 <= P <= S, got S={s}, P={p}")
    if s > s_ref:
        raise DepthInputError(f"S={s} exceeds the reference depth S_ref={s_ref}")


def check_tau(tau: float) -> None:
    if not 0 < tau < 1:
        raise DepthInputError(f"--tau must lie in (0, 1), got {tau}")


@dataclass
class Q90Table:
    s_ref: int
    quantile: float
    # role -> [s_ref + 1, s_ref + 1] array, cell [S, P] for 1 <= P < S <= s_ref, NaN elsewhere
    cells: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # tokens per role

    def get(self, role: str, s: int, p: int) -> float:
        return float(self.cells[role][s, p])

    def rows(self) -> list[dict]:
        out = []
        for s in range(2, self.s_ref + 1):
            for p in range(1, s):
                out.append({"S": s, "P": p, **{r: _num(self.get(r, s, p)) for r in ROLES}})
        return out


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 6)


def q90_table(
    trajectories: list[tuple[np.ndarray, list[str]]], s_ref: int, quantile: float = 0.9
) -> Q90Table:
    """Pool d_i(P; S) over every token of a role across trajectories and take the quantile per cell."""
    pooled: dict[str, dict[tuple[int, int], list[np.ndarray]]] = {r: {} for r in ROLES}
    counts = dict.fromkeys(ROLES, 0)
    for traj, roles in trajectories:
        if traj.shape[0] < s_ref:
            raise DepthInputError(f"a trajectory has {traj.shape[0]} loops, fewer than S_ref={s_ref}")
        role_arr = np.asarray(roles)
        norms = np.linalg.norm(traj[:s_ref], axis=-1)  # [s_ref, T]
        for r in ROLES:
            counts[r] += int((role_arr == r).sum())
        for s in range(2, s_ref + 1):
            d = np.linalg.norm(traj[: s - 1] - traj[s - 1][None], axis=-1) / norms[s - 1][None]  # [s-1, T]
            for r in ROLES:
                mask = role_arr == r
                if mask.any():
                    for p in range(1, s):
                        pooled[r].setdefault((s, p), []).append(d[p - 1][mask])
    table = Q90Table(s_ref, quantile, counts=counts)
    for r in ROLES:
        arr = np.full((s_ref + 1, s_ref + 1), np.nan)
        for (s, p), parts in pooled[r].items():
            arr[s, p] = np.quantile(np.concatenate(parts), quantile)
        table.cells[r] = arr
    return table


def recommend(table: Q90Table, s: int, tau: float) -> int:
    """Smallest P < S whose prompt-token q90 is <= tau at depth S; S itself (no split) when none is."""
    check_tau(tau)
    check_cell(s, 1, table.s_ref)
    for p in range(1, s):
        q = table.get("prompt", s, p)
        if not np.isnan(q) and q <= tau:
            return p
    return s


# Layer-pass model ------------------------------------------------------------------------------------------
def layer_cost(k: int, prelude: int, core: int, coda: int) -> int:
    """c_k = a + b k + c layer applications for a position that runs k loops."""
    return prelude + core * k + coda


def r_layer(
    L: float, D: float, s: int, p: int, prelude: int, core: int, coda: int, chunks: float = 1
) -> float:
    """Eq. 3: (L + D) c_S / ((L - M) c_P + (D + M) c_S), M = prompt chunks (every endpoint keeps S)."""
    check_cell(s, p, s)
    cs, cp = layer_cost(s, prelude, core, coda), layer_cost(p, prelude, core, coda)
    return (L + D) * cs / ((L - chunks) * cp + (D + chunks) * cs)


def r_prefill(L: float, s: int, p: int, prelude: int, core: int, coda: int, chunks: float = 1) -> float:
    """The prefill phase alone: L c_S / ((L - M) c_P + M c_S) (the r of Eq. 4 when f is prefill time)."""
    cs, cp = layer_cost(s, prelude, core, coda), layer_cost(p, prelude, core, coda)
    return L * cs / ((L - chunks) * cp + chunks * cs)


def amdahl(f: float, r: float, eps: float = 0.0) -> float:
    """Eq. 4: R_time = ((1 - f) + f / r + eps)^-1."""
    if not 0 <= f <= 1:
        raise DepthInputError(f"affected fraction f must lie in [0, 1], got {f}")
    if r <= 0:
        raise DepthInputError(f"speedup r must be > 0, got {r}")
    return 1.0 / ((1 - f) + f / r + eps)


# Queue-age controller (the engine runs it before each step; see engine/depth_control.py) -----------------
def controller_p(q: float, p_max: int, p_min: int, q_lo: float = 0.25, q_hi: float = 1.00) -> int:
    """P = round(P_max - z (P_max - P_min)), z = clip((q - q_lo) / (q_hi - q_lo), 0, 1); q = age (s) of the
    oldest admitted request still waiting for its first token."""
    try:
        return queue_age_p(q, p_max, p_min, q_lo, q_hi)
    except ValueError as exc:
        raise DepthInputError(str(exc)) from None
