"""Issue #3 acceptance runs on a GPU: one `looptrace profile` configuration per process (so no profiler
session ever precedes a graph capture), written as the table text and the JSON of the same run.

    python bench/profile_h200.py NAME OUTDIR -- <looptrace profile options>

Equivalent to `looptrace profile <options>` (table) plus `--format json` of the very same measurement.
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from looptrace.cli import profile_cmd
from looptrace.cli.common import dumps
from looptrace.cli.options import OutputFormat
from looptrace.probes import profile_report, profile_run


def main() -> None:
    name, outdir = sys.argv[1], Path(sys.argv[2])
    args = sys.argv[sys.argv.index("--") + 1 :]
    captured: dict = {}
    real_render = profile_report.render_single

    def render_and_keep(side, fmt):  # keep the side dict to also dump its JSON
        captured["side"] = side
        return real_render(side, fmt)

    profile_report.render_single = render_and_keep
    sys.argv = ["looptrace", "profile", *args]
    buf = io.StringIO()
    t0 = time.perf_counter()
    from typer.main import get_command

    cmd = get_command(profile_cmd_app())
    try:
        cmd.main(args=args, prog_name="looptrace profile", standalone_mode=False)
    finally:
        elapsed = time.perf_counter() - t0
    side = captured["side"]
    data = {
        "schema": "looptrace.profile/1",
        "command": "looptrace profile " + " ".join(args),
        "wall_s": elapsed,
        **profile_run._jsonable(side),
    }
    (outdir / f"{name}.json").write_text(dumps(data))
    console = Console(width=140, record=True, file=buf, force_terminal=False)
    console.print(f"$ looptrace profile {' '.join(args)}\n")
    console.print(real_render(side, OutputFormat.table), markup=False, highlight=False)
    (outdir / f"{name}.txt").write_text(console.export_text())
    decode = data["windows"]["decode"]
    print(
        json.dumps(
            {"name": name, "kernels_per_token": decode["per_token"]["kernels"], "wall_s": round(elapsed, 1)}
        )
    )


def profile_cmd_app():
    import typer

    app = typer.Typer()
    app.command()(profile_cmd.profile)
    return app


if __name__ == "__main__":
    main()
