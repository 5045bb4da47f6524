"""The run directory's layout, and the readers and writers of its small files. Everything that names a
file in a run directory takes the name from here.

    <run.dir>/
      run_spec.yaml          the frozen config + run plan (p3d.rundir.spec); specs/ the spec of each segment
      deepspeed_config.json  the DeepSpeed JSON of the run (p3d.train.executors.deepspeed_config; 1f1b only)
      metrics.jsonl          one JSON object per optimizer step (p3d.train.metrics)
      p3d_status.json        the outcome of a run or sweep point (done / failed / skipped + why / ...)
      slurm_jobs.log         one line per submission, start, exit and requeue of a Slurm job
      run.lock               the lease of the run that holds the directory (p3d.rundir.lease)
      logs/rank<N>.log       each worker's output, every attempt after its header (p3d.rundir.attempts)
      logs/rank<N>.hang.json a hang report of this attempt; rank<N>.hang.attempt<K>.json: attempt K's
      checkpoints/step_<N>/  checkpoints (p3d.checkpoint.checkpointer)
      traces/step_<N>.json   the timeline of a step of train.trace_steps, Chrome trace format (p3d.rundir.traces);
                             traces/step_<N>/rank<R>.json each rank's part until merged; step_<N>_timeline.png
                             its picture (p3d-report)
      wandb/                 W&B's offline files
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

SPEC = "run_spec.yaml"
DS_CONFIG = "deepspeed_config.json"
METRICS = "metrics.jsonl"
STATUS = "p3d_status.json"
JOBS_LOG = "slurm_jobs.log"
LOCK = "run.lock"
LOGS = "logs"
CHECKPOINTS = "checkpoints"
TRACES = "traces"


def logs(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOGS


def rank_log(run_dir: str | Path, rank: int) -> Path:
    return logs(run_dir) / f"rank{rank}.log"


def traces(run_dir: str | Path) -> Path:
    return Path(run_dir) / TRACES


def trace_path(run_dir: str | Path, step: int) -> Path:
    """The merged timeline of a traced step (Chrome trace format)."""
    return traces(run_dir) / f"step_{step}.json"


def trace_part_path(run_dir: str | Path, step: int, rank: int) -> Path:
    """One rank's events of a traced step, until the parts are merged into :func:`trace_path`."""
    return traces(run_dir) / f"step_{step}" / f"rank{rank}.json"


def timeline_path(run_dir: str | Path, step: int) -> Path:
    """The picture p3d-report draws of a traced step."""
    return traces(run_dir) / f"step_{step}_timeline.png"


def read_json_lines(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file; a line being written while we read is left out."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run directory's metrics.jsonl (or of a given .jsonl file)."""
    path = Path(run_dir)
    return read_json_lines(path / METRICS if path.is_dir() else path)


def holds_run(run_dir: str | Path) -> bool:
    """Whether the directory holds a run's results (a metrics line; checkpoints are checked by the caller)."""
    path = Path(run_dir) / METRICS
    return path.is_file() and path.stat().st_size > 0


def read_status(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / STATUS
    return json.loads(path.read_text()) if path.is_file() else {}


def write_status(run_dir: str | Path, status: str, returncode: int | None = None, **extra) -> None:
    """p3d_status.json, written atomically (p3d-report may read it while a sweep runs)."""
    path = Path(run_dir) / STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STATUS}.tmp")
    tmp.write_text(json.dumps({"status": status, "returncode": returncode, **extra}) + "\n")
    os.replace(tmp, path)


def log_job(run_dir: str | Path, line: str) -> None:
    """One line of slurm_jobs.log, with the time."""
    with open(Path(run_dir) / JOBS_LOG, "a") as f:
        f.write(f"{datetime.now().isoformat(timespec='seconds')} {line}\n")
