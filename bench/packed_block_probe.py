"""`looptrace bench` with another query-block size for the packed prefill kernel (an A/B of the constant
`kernels.PACKED_BLOCK_ROWS`, which is no recipe setting: it sets the kernel's tile, not a behaviour).

    python bench/packed_block_probe.py ROWS -- <looptrace bench arguments>

Runs the bench in this process with every default that carries the block size set to ROWS (a power of
two >= 16), so both arms' packed prefill uses ROWS-row query blocks.
"""

from __future__ import annotations

import sys


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    rows = int(sys.argv[1]) if sys.argv[1].isdigit() else 0
    if rows < 16 or rows & (rows - 1):
        print(f"error: ROWS must be a power of two >= 16, got {sys.argv[1]!r}", file=sys.stderr)
        return 2
    from looptrace.engine import kernels as K
    from looptrace.engine.kernels import packed_attention as pk

    for fn in (K.packed_blocks, K.packed_block_count, pk.packed_attention):
        fn.__defaults__ = (*fn.__defaults__[:-1], rows)  # the block size is each one's last default
    from looptrace.cli.main import main as cli

    sys.argv = ["looptrace", "bench", *sys.argv[3:]]
    cli()
    return 0


if __name__ == "__main__":
    sys.exit(main())
