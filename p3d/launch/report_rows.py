"""The rows of p3d-report (p3d.launch.report), one per sweep point or run directory, read from the files the run
left: ``run_spec.yaml`` (the layout), ``metrics.jsonl`` (throughput, memory, loss) and ``p3d_status.json``. The table,
the CSV and the plot (p3d.launch.report_plot) are made from them."""

from __future__ import annotations

import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from p3d.layout.elastic import record_text
from p3d.rundir.files import METRICS, SPEC, STATUS, read_json_lines, read_status
from p3d.rundir.spec import RUN_PLAN_KEY


@dataclass
class Row:
    point: str
    mesh: str  # the mesh preset's name (mesh.cp / mesh.ep overrides keep it: the axes below say what ran)
    # the layout, every axis a sweep can vary (AXES); None where the point has no run spec (skipped, not run)
    world_size: int | None = None
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero_stage: int | None = None
    schedule: str = "-"  # the pipeline schedule: 1f1b, gpipe, interleaved_1f1b, zbv, ...
    v: int | None = None  # its chunks per pp rank (schedule.virtual_stages)
    recompute: str | None = None  # none, selective or full
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
    overrides: str = ""  # the point's command-line overrides (Hydra's .hydra/overrides.yaml), space-separated
    changes: list[str] = field(default_factory=list)  # each as a line (p3d.layout.elastic.record_text); not in the CSV


# Row field -> the table's column header, for every axis a sweep can vary, in the order they are named
AXES = {
    "world_size": "ranks",
    "dp": "dp",
    "pp": "pp",
    "tp": "tp",
    "cp": "cp",
    "ep": "ep",
    "zero_stage": "ZeRO",
    "schedule": "schedule",
    "v": "v",
    "recompute": "recompute",
}


def has_layout(row: Row) -> bool:
    return row.world_size is not None


def varying_axes(rows: list[Row]) -> list[str]:
    """The axes (AXES' fields) whose value differs between two points that ran with a run spec, in AXES' order."""
    laid_out = [r for r in rows if has_layout(r)]
    return [a for a in AXES if len({getattr(r, a) for r in laid_out}) > 1]


def layout_text(row: Row, axes: list[str] | None = None) -> str:
    """Every axis of ``row`` (or only ``axes``) in one phrase: '4 ranks: dp2 pp1 tp1 cp2 ep1, ZeRO-1, 1f1b v=1,
    recompute none'; '' for a point without a run spec."""
    if not has_layout(row):
        return ""
    shown = list(AXES) if axes is None else [a for a in AXES if a in axes]
    dims = " ".join(f"{a}{getattr(row, a)}" for a in ("dp", "pp", "tp", "cp", "ep") if a in shown)
    schedule = " ".join(s for s in (row.schedule * ("schedule" in shown), f"v={row.v}" * ("v" in shown)) if s)
    zero = f"ZeRO-{row.zero_stage}" if "zero_stage" in shown else ""
    recompute = f"recompute {row.recompute}" if "recompute" in shown else ""
    text = ", ".join(part for part in (dims, zero, schedule, recompute) if part)
    if "world_size" not in shown:
        return text
    ranks = f"{row.world_size} rank{'s' if row.world_size != 1 else ''}"
    return f"{ranks}: {text}" if text else ranks


def mesh_label(task_cfg) -> str:
    """'tp2_pp2 (tp=2 pp=2 dp=auto)' from a composed config; '?' when it cannot be read."""
    try:
        m = task_cfg.mesh
        return f"{m.name} (tp={m.tp} pp={m.pp} dp={m.dp})"
    except Exception:
        return "?"


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
    overrides_path = point / ".hydra" / "overrides.yaml"
    overrides = cast(ListConfig, OmegaConf.load(overrides_path)) if overrides_path.is_file() else []  # strings
    row.overrides = " ".join(str(o) for o in overrides)
    if spec_path.is_file():
        spec = cast(dict, OmegaConf.to_container(OmegaConf.load(spec_path)))
        plan, mesh, schedule = spec.get(RUN_PLAN_KEY, {}), spec.get("mesh", {}), spec.get("schedule", {})
        row.dp, row.pp, row.tp = plan.get("dp"), plan.get("pp"), plan.get("tp")
        row.cp, row.ep = plan.get("cp", 1), plan.get("ep", 1)  # a spec written before cp and ep: 1 each
        row.world_size = plan.get("world_size")
        row.zero_stage = spec.get("zero", {}).get("stage", 0)
        row.schedule = schedule.get("pipeline", "1f1b")
        row.v = schedule.get("virtual_stages") or 1
        row.recompute = str(schedule.get("recompute", "none"))
        row.mesh = mesh.get("name", "?")
        row.total_steps = spec.get("train", {}).get("steps")
    elif row.mesh == "?" and overrides:
        row.mesh = " ".join(str(o) for o in overrides if str(o).startswith("mesh")) or "?"
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
