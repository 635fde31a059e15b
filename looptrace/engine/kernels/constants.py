"""Constants shared by the kernels package's `__init__` and its kernel modules (a leaf: imports nothing of
the package, so `packed_attention` can read them without importing the package `__init__`, which imports
`packed_attention` lazily: no import circle)."""

from __future__ import annotations

EAGER_ROWS_THRESHOLD = 256
# Query rows per program of the packed prefill kernel (a tl.dot needs >= 16). A program reads its request's
# keys once per block, so bigger blocks read the K/V cache fewer times: H200, Huginn 512-token prompts,
# bench/results/h200/kernels/ (16 rows was the first choice).
PACKED_BLOCK_ROWS = 64
