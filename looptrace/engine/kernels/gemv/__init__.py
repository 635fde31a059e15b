"""Bandwidth-bound GEMV for decode: `y = x @ W.T` for a few rows (M <= 8) in Triton (R3: `kernels.gemv`).

Why: at decode batch 1-8 a projection reads its whole weight once and does almost no arithmetic, so the
time floor is `N * K * 2` bytes at the copy bandwidth (H200: 4.28 TB/s). cuBLAS reaches about 46-58 % of it on
Ouro's chain; a GEMV that keeps every SM streaming W can get close to the floor.

Design (`_gemv_kernel`):
- Grid `(cdiv(N, BLOCK_N), SPLIT_K)`: program (n, s) owns output columns `n*BLOCK_N ...` and the K range
  of split s (`K_TILES` tiles of `BLOCK_K`). Where N / BLOCK_N alone gives too few programs for the 132 SMs
  (o_proj and down_proj: 2048 columns), K is split too (`split_for`).
- All M rows of x are handled by one program, so W is read exactly once. x is tiny (M * K * 2 bytes) and stays
  in L1/L2.
- Loads along K are contiguous runs of BLOCK_K bf16 (K contiguous in W and x, pointers 16-byte aligned, K a
  multiple of 16): Triton emits 16-byte vector loads. `EVEN_K` (K a whole number of tiles, every split full)
  drops the K mask.
- Products: `DOT=True` runs `tl.dot(W_tile, x_tile.T)` on tensor cores with x padded to 16 rows (bf16 x bf16
  products are exact in fp32, accumulation in fp32; the padding rows cost tensor-core cycles, which are
  nowhere near the limit here); `DOT=False` multiplies on CUDA cores in fp32 and reduces with `tl.sum`
  (M == 1: an elementwise fp32 accumulator, reduced once after the K loop). The tile table picks one.
- Split-K reduction, deterministic (no float atomics): each split stores its fp32 partial `[M, BLOCK_N]` in a
  scratch buffer, then takes a ticket (an `acq_rel` atomic add on the column block's int32 counter, after a
  barrier so all its stores are released with it). The program that draws the last ticket reads the
  SPLIT_K partials back from L2 (`.cg`) and adds them in split order 0, 1, ..., SPLIT_K - 1 (the same
  order whoever is last), rounds once to bf16, stores y and resets the counter to zero for the next launch.
  The counters are one persistent zeroed buffer per device (`scratch.tickets`, shared with the paged
  attention kernel: launches on one stream never overlap and each leaves them zero).
- CUDA graphs: no host syncs, the grid depends only on (M, N, K), the partial scratch is a plain
  `torch.empty` per call (graph-pool memory under capture) and the ticket buffer is allocated outside
  capture on first use (`warmup` or the graph's eager warm-up).
- One row, CUDA cores only (see `split_product`):
  - `PRELOAD` (`kernels.gemv_preload`, under PDL): tile 0 of W is loaded before the wait. Weights are never
    written, so this overlaps the kernel before.
  - `X_FORM` (`kernels.gemv_silu` / `kernels.gemv_norm`): the input row is computed in the kernel from the
    inputs of the exact kernel it replaces (`silu_mul_linear`, `residual_norm_linear`), bit for bit. Measured
    slower on the H200, so off in `fast`.
  - `Y_FORM` (`kernels.gemv_silu_out` / `kernels.gemv_norm_out`): the kernel finishes the exact kernel that
    would run after it, bit for bit: SiLU·mul of the gate/up GEMV's output (`gate_up_silu`: one program
    holds a block of gate rows and the same block of up rows; one split only, so it refuses shapes where the
    plain GEMV splits K) or the sandwich residual norm after o / down (`linear_residual_norm`: the program
    that completes the row's last column block, after a second ticket, runs it over the whole row). On the
    H200 the first pays (one launch fewer) and the second does not (a one-program tail after a ticket costs
    more than a separate launch under PDL): on and off in `fast`.

Batched decode (`kernels.gemv_batch`, off: not yet measured in the engine): `linear` routes 2-8 rows too
(`forms.route_rows`), through the table's many-row entry (tensor cores). `TileConfig.x_first` puts x, padded
to 16 rows, on the MMA's left and the streamed weight tile on its right (16-row `mma.sync` instead of
BLOCK_N-row `wgmma`); `tiles.MANY_ROW_CANDIDATES` (fixed splits, deeper pipelines, both operand orders) is
what `bench/gemv_batch.py` sweeps before it runs `fast` against `fast` + `kernels.gemv_batch` in the
engine. The SiLU·mul output form and `gemv_rope`'s q/k/v form follow to those rows (each row's gate and
up, or its rotate-half pairs, in one program of the plain many-row GEMV's products, one split), bitwise
the two launches' as at one row. `tiles.CUBLAS_MANY_ROWS` keeps listed (N, K) shapes on cuBLAS from two
rows on (`tiles.takes_rows`): a per-shape route, empty until a measurement asks for one.

Exactness: not bitwise equal to cuBLAS (another reduction order): R3, graded by `looptrace diff exactloop
fast --accuracy`. Run-to-run deterministic (fixed tiles, fixed order). Tile configs come from `pick_config`,
which may depend on M; a row's result is therefore not claimed to be independent of the batch size.

`linear(x, w, b)` is the drop-in for `F.linear`: the Triton GEMV for bias-free bf16 CUDA inputs of at most
`MAX_ROWS` rows, `F.linear` otherwise. `engine/assemble.py` swaps in the variants that call it: `GemvLinear`
on every bias-free nn.Linear, `GemvFusedLinear` on Ouro's fused projections.

The package, one role a file (each imports Triton): `tiles` (the tile table, splits and routing: which
config and whether the GEMV takes an input), `kernel` (`_gemv_kernel`, its device helpers, the launch and
`gemv`), `forms` (`linear` and the fused input/output entry points with their `*_fusable` checks).
Importing the package itself imports neither Triton nor its modules.
"""
