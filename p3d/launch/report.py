"""``p3d-report <sweep dir>``: which layout is fastest. One row per sweep point (or one run dir):

    every point: dp2 pp1 tp1 ep1, ZeRO-0, 1f1b v=1, recompute none
    point  mesh  ranks  cp  tokens/s  MFU  peak GB  bubble  final loss  steps  status

(the axes of the layout that differ between the points in columns, the rest on the line above: report_rows.AXES)
read from each point's ``run_spec.yaml``, ``metrics.jsonl`` and ``p3d_status.json``; printed, and
written to ``<sweep dir>/report.csv`` and ``<sweep dir>/report.png`` (throughput per layout), and the picture of each
traced step of each point (``train.trace_steps``: p3d.launch.timeline), whose path the report prints.
tokens/s, MFU and bubble are medians over the steps after the first (which pays for warm-up); peak
memory is the largest step's; the final loss is the last step's. ``p3d-train -m`` prints this at the
end of every sweep (:class:`SweepCallback`, registered in conf/config.yaml).

Exit status: 0 a report was written (``--csv`` / ``--png`` folders are created); 2 no run found under the
directory, or the CSV or plot cannot be written there.
"""

from __future__ import annotations

import csv
import sys
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, cast

from hydra.experimental.callback import Callback

from p3d import exit_codes
from p3d.console import error, say
from p3d.launch.report_plot import plot
from p3d.launch.report_rows import AXES, Row, collect, has_layout, layout_text, mesh_label, varying_axes
from p3d.rundir.files import read_status, write_status

STATUS_BY_CODE = {
    exit_codes.OK: "done",
    exit_codes.WORKER_FAILED: "failed",
    exit_codes.CONFIG_ERROR: "skipped",
    exit_codes.PREEMPTED: "preempted",
}


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    return {"int": f"{value:,.0f}", "pct": f"{value:.1%}", "gb": f"{value:.2f}", "loss": f"{value:.4f}"}[kind]


METRICS_HEADER = ("tokens/s", "MFU", "peak GB", "bubble", "final loss", "steps")
NUMERIC_AXES = ("world_size", "dp", "pp", "tp", "cp", "ep", "zero_stage", "v")


def _ambiguous(rows: list[Row]) -> bool:
    """Two points that ran with the same value of every axis: what told them apart is not an axis (a
    ``zero.shard_size`` or ``schedule.micro_batch_size`` sweep), so the table shows their overrides too."""
    keys = [tuple(getattr(r, a) for a in AXES) for r in rows if has_layout(r)]
    return len(set(keys)) < len(keys)


def _own_overrides(rows: list[Row]) -> list[str]:
    """Each row's overrides less those every row has."""
    common = set.intersection(*(set(r.overrides.split()) for r in rows)) if rows else set()
    return [" ".join(o for o in r.overrides.split() if o not in common) or "-" for r in rows]


def table(rows: list[Row]) -> str:
    """The layout of every point, its throughput, memory, loss and status. The axes (AXES) that vary between the
    points get a column each and the rest one line above the table, so that two points never print the same row."""
    axes = varying_axes(rows)
    overrides = _own_overrides(rows) if _ambiguous(rows) else None
    overrides = overrides if overrides and len(set(overrides)) > 1 else None  # none there: nothing to tell apart
    header = ("point", "mesh", *(AXES[a] for a in axes), *(("overrides",) if overrides else ()), *METRICS_HEADER)
    lines = [(*header, "status")]
    for i, r in enumerate(rows):
        steps = f"{r.steps}/{r.total_steps}" if r.steps is not None else "-"
        status = r.status + (f": {r.reason}" if r.reason and r.status != "done" else "")
        lines.append(
            (
                r.point,
                r.mesh,
                *(str(getattr(r, a)) if has_layout(r) else "-" for a in axes),
                *((overrides[i],) if overrides else ()),
                _fmt(r.tokens_per_s, "int"),
                _fmt(r.mfu, "pct"),
                _fmt(r.peak_mem_gb, "gb"),
                _fmt(r.bubble, "pct"),
                _fmt(r.final_loss, "loss"),
                steps,
                status,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    right = {i for i, h in enumerate(header) if h in METRICS_HEADER or h in {AXES[a] for a in NUMERIC_AXES}}
    laid_out = [r for r in rows if has_layout(r)]
    common = [a for a in AXES if a not in axes]
    out = []
    if laid_out and common:
        out.append(f"{'layout' if len(laid_out) == 1 else 'every point'}: {layout_text(laid_out[0], common)}")
    for line in lines:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells + [line[-1]]).rstrip())
    done = [r for r in rows if r.status == "done" and r.tokens_per_s]
    if done:
        best = max(done, key=lambda r: cast(float, r.tokens_per_s))  # set: done keeps rows with tokens_per_s
        what = ", ".join(
            t for t in (layout_text(best), overrides[rows.index(best)] if overrides else "") if t not in ("", "-")
        )
        out.append(f"fastest: point {best.point}, {best.mesh} ({what}): {best.tokens_per_s:,.0f} tokens/s")
    return "\n".join(out)


def write_csv(rows: list[Row], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Row) if fl.name != "changes"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: v for k, v in asdict(r).items() if k != "changes"})


def report(
    sweep_dir: Path, csv_path: Path | None = None, png_path: Path | None = None, make_plot: bool = True, stream=None
) -> list[Row]:
    stream = stream or sys.stdout
    rows = collect(sweep_dir)
    if not rows:
        return rows
    csv_path = csv_path or sweep_dir / "report.csv"
    png_path = png_path or sweep_dir / "report.png"
    say(f"{sweep_dir} ({len(rows)} point{'s' if len(rows) != 1 else ''})", "p3d-report", stream=stream)
    print(table(rows), file=stream)
    for r in rows:
        for line in r.changes:
            print(f"layout change of {r.point}: {line}", file=stream)
    for path in (csv_path, png_path) if make_plot else (csv_path,):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_csv(rows, csv_path)
    written = [str(csv_path)]
    if make_plot:
        plot(rows, png_path, f"p3d sweep {sweep_dir}")
        written.append(str(png_path))
        from p3d.launch.timeline import draw_run

        for r in rows:  # each traced step's picture (train.trace_steps), linked from the report
            for path in draw_run(r.run_dir) if r.run_dir else []:
                print(f"timeline of point {r.point}: {path}", file=stream)
    say(f"wrote {', '.join(written)}", "p3d-report", stream=stream)
    return rows


# ---- the Hydra callback (hydra.callbacks in conf/config.yaml)


class SweepCallback(Callback):
    """Per sweep point: ``p3d_status.json`` (done / failed / skipped + why / preempted / stopped).
    At the end of a sweep: the report. Inactive for p3d-plan, which writes no output directories."""

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        import os

        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.output_subdir is None or HydraConfig.get().mode != RunMode.MULTIRUN:
            return
        out = Path(config.hydra.runtime.output_dir)
        before = read_status(out)
        mesh = mesh_label(job_return.cfg)
        if job_return.status != JobStatus.COMPLETED:
            exc = job_return._return_value
            write_status(out, "failed", exit_codes.WORKER_FAILED, reason=f"{type(exc).__name__}: {exc}", mesh=mesh)
            return
        rc = job_return._return_value if isinstance(job_return._return_value, int) else 0
        if before.get("status") in ("submitted", "skipped") and rc in (0, 2):
            # recorded where it happened (the job id, or why p3d-train skipped the point); add the mesh
            if "mesh" not in before:
                write_status(out, before.pop("status"), before.pop("returncode", rc), **before, mesh=mesh)
            return
        extra: dict[str, Any] = {}
        if os.environ.get("SLURM_JOB_ID"):
            extra["job_id"] = os.environ["SLURM_JOB_ID"]
        write_status(out, STATUS_BY_CODE.get(rc, "stopped" if rc >= 128 else "failed"), rc, mesh=mesh, **extra)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        """The report, then the sweep's exit status: :class:`p3d.exit_codes.SweepNotDone` unless every point is
        done (Hydra itself ignores what the points return)."""
        if config.hydra.output_subdir is None:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            rows = report(sweep_dir)
        except Exception as exc:
            error(f"could not report {config.hydra.sweep.dir}: {type(exc).__name__}: {exc}", "p3d-report")
            rows = collect(sweep_dir)
        status, summary = sweep_status(rows)
        if status:
            print(summary, file=sys.stderr, flush=True)
            raise exit_codes.SweepNotDone(status)


def sweep_status(rows: list[Row]) -> tuple[int, str]:
    """(exit status, one line) of a finished sweep: 0 when every point is done; else 1 (WORKER_FAILED) when a
    point failed, stopped or is incomplete, 2 (CONFIG_ERROR) when every such point was skipped by a config rule."""
    bad = [r for r in rows if r.status != "done"]
    if not bad:
        return exit_codes.OK, ""
    status = exit_codes.CONFIG_ERROR if all(r.status == "skipped" for r in bad) else exit_codes.WORKER_FAILED
    counts = Counter(r.status for r in bad)
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    which = f"point{'s' if len(bad) > 1 else ''} {', '.join(r.point for r in bad)}"
    return status, f"p3d: {len(bad)} of {len(rows)} sweep points not done ({kinds}: {which}); exit status {status}"
