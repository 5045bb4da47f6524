"""``p3d-report <sweep or run dir> [--csv F] [--png F] [--no-plot]``: the table, CSV and plot of a sweep
(p3d.launch.report)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from p3d import exit_codes
from p3d.console import error
from p3d.launch.report import report
from p3d.rundir.files import METRICS, SPEC, STATUS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p3d-report", description="Table, CSV and plot of a p3d sweep (or run).")
    parser.add_argument("sweep_dir", type=Path, help="a p3d-train -m sweep directory, or one run directory")
    parser.add_argument("--csv", type=Path, help="where to write the CSV (default: <sweep_dir>/report.csv)")
    parser.add_argument("--png", type=Path, help="where to write the plot (default: <sweep_dir>/report.png)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    from p3d.rundir.paths import absolute

    args.sweep_dir = absolute(args.sweep_dir)  # against the directory the command ran from, ~ expanded
    args.csv, args.png = (absolute(p) if p is not None else None for p in (args.csv, args.png))
    if not args.sweep_dir.is_dir():
        error(f"{args.sweep_dir} is not a directory", "p3d-report")
        return exit_codes.CONFIG_ERROR
    try:
        rows = report(args.sweep_dir, args.csv, args.png, make_plot=not args.no_plot)
    except OSError as exc:  # --csv / --png in a folder that cannot be made or written
        error(
            f"cannot write the report there ({exc.filename}: {exc.strerror or exc}); choose another --csv / --png",
            "p3d-report",
        )
        return exit_codes.CONFIG_ERROR
    if not rows:
        error(f"no p3d run under {args.sweep_dir} (no {SPEC}, {METRICS} or {STATUS})", "p3d-report")
        return exit_codes.CONFIG_ERROR
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
