"""The GEMV's tile configs and routing (`kernels.gemv`, see the package docstring): the tile table and its
candidates, how K is split, and whether the GEMV takes an input at all. Imports Triton (`triton.cdiv`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looptrace.engine.kernels.device_helpers import triton

MAX_ROWS = 8  # rows the kernel takes (decode); above it the GEMM is compute-bound
# Rows up to which `linear` routes to the GEMV: measured on the H200, it beats cuBLAS only at one row
# (Ouro's token chain 5.62 vs 5.98 ms, bench/results/h200/decode-token/; at 2-8 rows every
# tile candidate was slower, gemv_h200.md), so fast keeps cuBLAS from two rows on.
ROUTE_ROWS = 1
# Projection shapes (N, K) whose 2-8 rows stay on cuBLAS even under `kernels.gemv_batch`, where the GEMV
# takes them otherwise: a per-shape route for shapes cuBLAS serves better at those rows. Empty: no shape is
# measured to need it (`bench/gemv_batch.py --cublas-shapes` tries one in its process).
CUBLAS_MANY_ROWS: frozenset[tuple[int, int]] = frozenset()
SMS = 132  # H200 streaming multiprocessors: the grid should give each a few programs
TARGET_PROGRAMS = 4 * SMS
MIN_TILES_PER_SPLIT = 2  # a split below 2 tiles spends more on its partial than it streams


@dataclass(frozen=True)
class TileConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int | None = None  # None: as many splits as reach TARGET_PROGRAMS (see `split_for`)
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False
    # With `dot`: x (padded to 16 rows) is the MMA's left operand and the weight tile its right one
    # (16-row MMAs over the streamed tile), instead of the weight tile on the left (BLOCK_N-row MMAs)
    x_first: bool = False
    # Under PDL: weight tiles this program asks L2 for before its wait, after the one it preloads (a hint
    # that moves no values, R0): the next tiles stream while the kernel before finishes, with no registers
    # held for them (a 16-32 KB register preload measured slower: fewer programs per SM). 0 in every table
    # entry: depths 1, 2 and 4 made Ouro's token slower on an H100, 5.02 -> 5.47 / 5.74 / 6.16 ms
    # (bench/results/h100/decode-token/); not yet measured on an H200
    prefetch_tiles: int = 0


# Tile table: first entry whose (N range, K range, M range) holds the shape wins; ranges are inclusive.
# The M = 1 rows are the fastest candidate per shape measured on the H200 (bench/results/h200/kernels/:
# Ouro-1.4B's decode chain 3.97 ms against cuBLAS's 4.11 ms). At M >= 2 no candidate measured beat cuBLAS
# (the tensor-core path reads W once but runs at 36-76 % of copy bandwidth): the entry below is the best
# of them, kept so `fast` runs one kernel family; tuning it is open work.
DEFAULT = TileConfig(block_n=32, block_k=128)  # M = 1, K = 2048-5632, N <= 8191: Ouro's down
_WIDE = TileConfig(block_n=32, block_k=256)  # lm_heads, Huginn's fc: 94-98 % of copy bandwidth
_LONG_ROWS = TileConfig(block_n=16, block_k=512, num_stages=2)
# Ouro's other one-row projections (hidden 2048), tuned inside the dependent token chain, where a tile
# runs differently than alone (bench/token_ablation.py --gemv-sweep, then the whole token: 4.39 ->
# 4.19 ms with all three; bench/results/h200/decode-token/)
_OURO_QKV = TileConfig(block_n=8, block_k=512, num_warps=2, num_stages=2)  # 6144 x 2048
_OURO_O = TileConfig(block_n=32, block_k=128, num_warps=8)  # 2048 x 2048
_OURO_GATE_UP = TileConfig(block_n=16, block_k=256)  # 11264 x 2048
TILE_TABLE: tuple[tuple[tuple[int, int], tuple[int, int], tuple[int, int], TileConfig], ...] = (
    ((1, 1 << 30), (1, 1 << 30), (2, MAX_ROWS), TileConfig(block_n=64, block_k=128, dot=True)),
    ((11264, 11264), (2048, 2048), (1, 1), _OURO_GATE_UP),
    ((6144, 6144), (2048, 2048), (1, 1), _OURO_QKV),
    ((2048, 2048), (2048, 2048), (1, 1), _OURO_O),
    ((32768, 1 << 30), (1, 1 << 30), (1, 1), _WIDE),
    ((8192, 32767), (1, 1 << 30), (1, 1), _LONG_ROWS),  # Ouro gate_up, Huginn qkv
    ((4096, 8191), (5000, 6000), (1, 1), _LONG_ROWS),  # Huginn o (not Ouro down: N 2048)
    ((1, 8191), (12000, 1 << 30), (1, 1), _LONG_ROWS),  # Huginn down
)


# What `bench/kernel_gemv.py` tries next to the table's choice (the GPU tests check each of them too).
CANDIDATES = (
    TileConfig(block_n=64, block_k=128),
    TileConfig(block_n=32, block_k=256),
    TileConfig(block_n=32, block_k=128),
    TileConfig(block_n=16, block_k=512, num_stages=2),
    TileConfig(block_n=64, block_k=128, dot=True),
    TileConfig(block_n=128, block_k=128, num_warps=8, dot=True),
    TileConfig(block_n=32, block_k=256, num_stages=4, dot=True),
)


# What `bench/gemv_batch.py` (and `bench/kernel_gemv.py --many-rows`) tries at 2-8 rows, where no
# CANDIDATES entry beat cuBLAS on the H200: fixed splits from none to the table's (the table's auto split
# gives q/k/v 768 programs of 2 K tiles each; one split gives 96 of 16), deeper pipelines, and the 16-row
# MMA form. At N = 2048 (o, down) a split of 1-2 leaves fewer programs than SMs, so 8 is among them, and
# 32-column tiles (`mma.sync` in either order) double the column blocks; 64 x 256 tiles were left out: one
# program per SM, 164 registers (bench/results/cpu-2core/kernels/*gemv_compile.md).
MANY_ROW_CANDIDATES = tuple(
    TileConfig(block_n=bn, block_k=bk, split_k=split, num_warps=w, num_stages=4, dot=True, x_first=xf)
    for bn, bk, w in ((64, 128, 4), (128, 128, 8), (32, 256, 4))
    for split in (1, 2, 4, 8)
    for xf in (False, True)
)


def pick_config(m: int, n: int, k: int) -> TileConfig:
    for (n_lo, n_hi), (k_lo, k_hi), (m_lo, m_hi), cfg in TILE_TABLE:
        if n_lo <= n <= n_hi and k_lo <= k <= k_hi and m_lo <= m <= m_hi:
            return cfg
    return DEFAULT


def split_for(n: int, k: int, cfg: TileConfig) -> tuple[int, int]:
    """(SPLIT_K, K_TILES): splits of K and BLOCK_K tiles per split. Without a fixed `split_k`: as many splits
    as bring the grid to TARGET_PROGRAMS, each at least MIN_TILES_PER_SPLIT tiles; never an empty split."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    blocks = triton.cdiv(n, cfg.block_n)
    want = cfg.split_k or max(1, min(triton.cdiv(TARGET_PROGRAMS, blocks), k_tiles // MIN_TILES_PER_SPLIT))
    if cfg.split_k is None:  # a split count within 2x that divides the tiles: every split full, no K mask
        most = max(1, k_tiles // MIN_TILES_PER_SPLIT)
        divisors = [s for s in range(1, most + 1) if k_tiles % s == 0 and want <= 2 * s <= 4 * want]
        want = min(divisors, key=lambda s: (abs(s - want) / want, -s), default=want)
    per_split = triton.cdiv(k_tiles, max(1, want))
    return triton.cdiv(k_tiles, per_split), per_split


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The GEMV's domain: bias-free, bf16 on CUDA, 1..MAX_ROWS rows, weight with K contiguous."""
    return (
        bias is None
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and weight.stride(-1) == 1
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
    )


def takes_rows(rows: int, weight: torch.Tensor, route_rows: int) -> bool:
    """A projection of `rows` rows through `weight` goes to the GEMV with this row limit (ROUTE_ROWS, or
    MAX_ROWS under `kernels.gemv_batch`): one row always, more unless the shape is in CUBLAS_MANY_ROWS."""
    return 0 < rows <= route_rows and (rows == 1 or tuple(weight.shape) not in CUBLAS_MANY_ROWS)


def routes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`linear` would take the Triton GEMV for this input (one routed row on CUDA, bf16, no bias)."""
    return x.numel() <= ROUTE_ROWS * x.shape[-1] and supported(x, weight, None)


def one_row_config(n: int, k: int) -> TileConfig | None:
    """The tile config of a one-row GEMV if the fused input forms can run it (the CUDA-core path)."""
    cfg = pick_config(1, n, k)
    return None if cfg.dot else cfg
