"""``p3d-report <sweep dir>``: which layout is fastest. One row per sweep point (or one run dir):

    point  mesh  dp x pp x tp  schedule  tokens/s  MFU  peak GB  bubble  final loss  steps  status

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
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

from hydra.experimental.callback import Callback

from p3d import exit_codes
from p3d.console import error, say
from p3d.layout.elastic import record_text
from p3d.rundir.files import METRICS, SPEC, STATUS, read_json_lines, read_status, write_status
from p3d.rundir.spec import RUN_PLAN_KEY

STATUS_BY_CODE = {
    exit_codes.OK: "done",
    exit_codes.WORKER_FAILED: "failed",
    exit_codes.CONFIG_ERROR: "skipped",
    exit_codes.PREEMPTED: "preempted",
}


@dataclass
class Row:
    point: str
    mesh: str
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    schedule: str = "-"  # the pipeline schedule: 1f1b, or a torch schedule with its chunks per rank
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gb: float | None = None
    bubble: float | None = None
    final_loss: float | None = None
    steps: int | None = None
    total_steps: int | None = None
    status: str = "?"
    reason: str = ""
    run_dir: str = ""
    layout_changes: int = 0  # an elastic run's re-fits (p3d.jobs.elastic): the records with layout_change
    time_lost_s: float | None = None  # their time lost together
    changes: list[str] = field(default_factory=list)  # each as a line (p3d.layout.elastic.record_text); not in the CSV


def mesh_label(task_cfg) -> str:
    """'tp2_pp2 (tp=2 pp=2 dp=auto)' from a composed config; '?' when it cannot be read."""
    try:
        m = task_cfg.mesh
        return f"{m.name} (tp={m.tp} pp={m.pp} dp={m.dp})"
    except Exception:
        return "?"


def schedule_label(schedule: dict) -> str:
    """'1f1b', 'interleaved_1f1b v=2', 'zbv v=2' (as p3d-plan names them) from a run spec's ``schedule``."""
    name, v = schedule.get("pipeline", "1f1b"), schedule.get("virtual_stages") or 1
    return name if v == 1 and name in ("1f1b", "gpipe") else f"{name} v={v}"


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def slurm_state(job_id: str) -> str | None:
    """The job's state from sacct (the last run of a requeued job), or None."""
    try:
        out = subprocess.run(
            ["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = [s.split()[0] for s in out.stdout.split("\n") if s.strip()]
    return states[-1] if out.returncode == 0 and states else None


def read_point(point: Path, name: str) -> Row:
    from omegaconf import ListConfig, OmegaConf

    status = read_status(point)
    row = Row(point=name, mesh=status.get("mesh", "?"), run_dir=str(point))
    spec_path = point / SPEC
    if spec_path.is_file():
        spec = cast(dict, OmegaConf.to_container(OmegaConf.load(spec_path)))
        plan, mesh = spec.get(RUN_PLAN_KEY, {}), spec.get("mesh", {})
        row.dp, row.pp, row.tp = plan.get("dp"), plan.get("pp"), plan.get("tp")
        row.mesh = mesh.get("name", "?")
        row.total_steps = spec.get("train", {}).get("steps")
        row.schedule = schedule_label(spec.get("schedule", {}))
    elif row.mesh == "?" and (point / ".hydra" / "overrides.yaml").is_file():
        overrides = cast(ListConfig, OmegaConf.load(point / ".hydra" / "overrides.yaml"))  # a list of strings
        row.mesh = " ".join(o for o in overrides if str(o).startswith("mesh")) or "?"
    records = read_json_lines(point / METRICS) if (point / METRICS).is_file() else []
    if records:
        steady = records[1:] or records
        row.tokens_per_s = _median([r.get("tokens_per_s") for r in steady])
        row.mfu = _median([r.get("mfu") for r in steady])
        row.bubble = _median([r.get("bubble") for r in steady])
        mems = [r["peak_mem_gb"] for r in records if isinstance(r.get("peak_mem_gb"), (int, float))]
        row.peak_mem_gb = max(mems) if mems else None
        row.final_loss = records[-1].get("loss")
        row.steps = records[-1].get("step")
        changes = [r["layout_change"] for r in records if r.get("layout_change")]
        row.layout_changes, row.changes = len(changes), [record_text(c) for c in changes]
        lost = [c["time_lost_s"] for c in changes if c.get("time_lost_s") is not None]
        row.time_lost_s = sum(lost) if lost else None
    complete = bool(records) and row.total_steps is not None and row.steps == row.total_steps
    row.status, row.reason = status.get("status", ""), status.get("reason", "") or ""
    if row.status == "submitted":  # p3d-train cluster=slurm: ask Slurm how the job is doing
        job = status.get("job_id")
        state = slurm_state(job) if job else None
        row.status = "done" if complete and state in (None, "COMPLETED") else f"job {job} {state or '?'}"
    elif not row.status:
        row.status = "done" if complete else ("incomplete" if records else "not run")
    elif row.status == "done" and not complete:
        row.status = "incomplete"
    return row


def _point_key(path: Path):
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def collect(sweep_dir: Path) -> list[Row]:
    """Rows of every point under ``sweep_dir`` (or of the run in it), in sweep order."""
    if (sweep_dir / SPEC).is_file() or (sweep_dir / STATUS).is_file():
        return [read_point(sweep_dir, sweep_dir.name)]
    points = [
        d
        for d in sweep_dir.iterdir()
        if d.is_dir()
        and not d.name.startswith(".")
        and any((d / f).exists() for f in (SPEC, STATUS, METRICS, ".hydra"))
    ]
    return [read_point(d, d.name) for d in sorted(points, key=_point_key)]


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    return {"int": f"{value:,.0f}", "pct": f"{value:.1%}", "gb": f"{value:.2f}", "loss": f"{value:.4f}"}[kind]


HEADER = (
    "point",
    "mesh",
    "dp x pp x tp",
    "schedule",
    "tokens/s",
    "MFU",
    "peak GB",
    "bubble",
    "final loss",
    "steps",
    "status",
)


def table(rows: list[Row]) -> str:
    lines = [HEADER]
    for r in rows:
        dims = f"{r.dp} x {r.pp} x {r.tp}" if r.dp is not None else "-"
        steps = f"{r.steps}/{r.total_steps}" if r.steps is not None else "-"
        status = r.status + (f": {r.reason}" if r.reason and r.status != "done" else "")
        lines.append(
            (
                r.point,
                r.mesh,
                dims,
                r.schedule,
                _fmt(r.tokens_per_s, "int"),
                _fmt(r.mfu, "pct"),
                _fmt(r.peak_mem_gb, "gb"),
                _fmt(r.bubble, "pct"),
                _fmt(r.final_loss, "loss"),
                steps,
                status,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER) - 1)]
    right = {4, 5, 6, 7, 8, 9}
    out = []
    for line in lines:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells + [line[-1]]).rstrip())
    done = [r for r in rows if r.status == "done" and r.tokens_per_s]
    if done:
        best = max(done, key=lambda r: cast(float, r.tokens_per_s))  # set: done keeps rows with tokens_per_s
        out.append(
            f"fastest: point {best.point}, {best.mesh} (dp={best.dp} pp={best.pp} tp={best.tp}, {best.schedule}): "
            f"{best.tokens_per_s:,.0f} tokens/s"
        )
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
        from p3d.launch.report_plot import plot

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
