"""Restarts within one launch: ``train.max_restarts=N``.

When the workers fail for a reason that is not an error they raised (a worker killed by a signal: SIGKILL, the
OOM killer, a lost node; or a hang, p3d.parallel.hang), every worker is started again from the newest complete
checkpoint (the run spec is re-frozen with ``train.resume=auto`` resolved, as a requeued Slurm job does), at
most N times, each restart printed with its cause. An error a worker raised (a config, data or code error)
is never retried, and neither is a failure that repeats the previous one: the same cause at the same step.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from p3d import exit_codes
from p3d.jobs import elastic
from p3d.jobs.slurm.hetjob import step_rank
from p3d.jobs.slurm.step import hostnames
from p3d.rundir.attempts import current_attempt
from p3d.rundir.files import logs as run_logs
from p3d.rundir.files import read_metrics

RESTARTABLE = (exit_codes.WORKER_FAILED, exit_codes.HUNG)


def step_in_flight(run_dir: Path) -> int:
    """The step the run was in when it failed: one after the last one logged."""
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return (records[-1]["step"] if records else 0) + 1


def decide(
    this: tuple[int, str], previous: tuple[int, str] | None, restarts: int, max_restarts: int
) -> tuple[bool, str]:
    """(restart, the console line) for a restartable failure ``this`` = (step in flight, cause), after
    ``restarts`` restarts whose last failure was ``previous``."""
    if this == previous:
        return False, f"p3d: {this[1]} at step {this[0]} again, as before the last restart: not restarting"
    if restarts >= max_restarts:
        return False, f"p3d: {this[1]} at step {this[0]}; all {max_restarts} restarts (train.max_restarts) used"
    return True, (
        f"p3d: restart {restarts + 1} of {max_restarts}: {this[1]} at step {this[0]}; restarting every worker "
        "from the newest complete checkpoint"
    )


def run_with_restarts(
    launch: Callable[[dict], int],
    run_dir: Path,
    max_restarts: int,
    refreeze: Callable[..., int],
    console=None,
    stopped=lambda: False,
) -> int:
    """``launch(failure)`` runs the workers once (p3d.jobs.local.launch_local); returns the last status.
    ``refreeze(run_dir, nodes=None, event=None)``: the spec frozen again to resume the newest checkpoint
    (p3d.launch.requeue.resume_spec; on ``nodes`` nodes for an elastic run), 0 when it could; ``stopped()``: a stop
    signal came (never restart then). A lost node (``failure["lost_nodes"]``) of an elastic run is decided by
    p3d.jobs.elastic first, outside train.max_restarts."""
    console = console or sys.stdout
    previous: tuple[int, str] | None = None
    restarts = 0
    while True:
        failure: dict = {}
        rc = launch(failure)
        if failure.get("lost_nodes") and rc in RESTARTABLE and not stopped():
            decision = elastic.after_loss(
                run_dir, failure["lost_nodes"], failure["alive_nodes"], step_in_flight(run_dir)
            )
            if decision.action != "same":
                print(decision.line, file=console, flush=True)
                if decision.action == "stop":
                    return exit_codes.NODES_LOST
                if refreeze(str(run_dir), nodes=decision.nodes, event=decision.event) != 0:
                    return rc
                continue
        if rc not in RESTARTABLE or not failure.get("restartable") or max_restarts == 0 or stopped():
            return rc
        this = (step_in_flight(run_dir), failure["cause"])
        again, line = decide(this, previous, restarts, max_restarts)
        print(line, file=console, flush=True)
        if not again:
            return rc
        restarts += 1
        previous = this
        if refreeze(str(run_dir)) != 0:
            return rc


# ---- the Slurm recipe (recipes/slurm/train.sbatch): the same rule within one allocation
STATE = "slurm_restarts.json"  # in <run dir>/logs/: this start's restarts so far and the last failure
TASK_LINE = re.compile(r"(?:(\S+): )?task (\d+): (.+)$")  # srun's "srun: error: <node>: task <id>: <how it ended>"


LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError")
FAILED = "worker failed:"  # p3d.train.worker's line when a worker raises


def _failures(run_dir: Path) -> list[tuple[Path, str, str]]:
    """(rank log, its first failure line, what the current attempt wrote to it) of every rank whose worker raised
    in the current attempt (what follows the log's last attempt header, p3d.rundir.attempts)."""
    found = []
    for log in sorted(run_logs(run_dir).glob("rank*.log"), key=lambda p: (len(p.name), p.name)):
        text = current_attempt(log.read_text(errors="replace"))
        line = next((ln.strip() for ln in text.splitlines() if FAILED in ln), None)
        if line is not None:
            found.append((log, line, text))
    return found


def raised_error(run_dir: Path) -> str | None:
    """The first error a worker of the last srun raised that is not the lost connection to a peer that died
    (what every survivor of a SIGKILL raises), as ``rank N: <error>``."""
    return next((line for _, line, _ in _failures(run_dir) if not LOST_PEER.search(line)), None)


def failed_tail(run_dir: Path, n: int = 20) -> str | None:
    """The last ``n`` lines the current attempt wrote to the log of the rank that failed, headed by its name: a
    rank that raised an error of its own before one that lost a peer; None when no worker raised."""
    found = sorted(_failures(run_dir), key=lambda f: bool(LOST_PEER.search(f[1])))
    if not found:
        return None
    log, _, text = found[0]
    return f"p3d: last lines of {log}:\n" + "\n".join(text.splitlines()[-n:])


def slurm_cause(run_dir: Path, srun_err: Path) -> str | None:
    """Why srun failed, when it is worth a restart: a hang report (p3d.parallel.hang), a task srun saw end by a
    signal (Killed, Out Of Memory, ...), or a lost node. None when a worker raised an error of its own (a
    config, data or code error; NONFINITE) or no task ended by a signal: a restart would only repeat it.
    srun prints its task lines in no reliable order, so the rank logs, not the order, tell a raised error
    from the lost connections a killed worker leaves behind."""
    from p3d.parallel import hang

    reports = hang.read_reports(run_logs(run_dir))
    if reports:
        absent = sorted({p for r in reports.values() for p in r["peers"]} - set(reports))
        return f"a hang (ranks {', '.join(map(str, absent)) or '?'} never arrived)"
    if raised_error(run_dir):
        return None
    lines = srun_err.read_text(errors="replace").splitlines() if srun_err.is_file() else []
    for line in lines:
        if "node failure" in line.lower():
            return f"a lost node ({line.strip()})"
        m = TASK_LINE.search(line)
        if m and not m.group(3).startswith("Exited with exit code"):
            return f"rank {srun_rank(m.group(1), int(m.group(2)))} ended: {m.group(3).strip()}"
    return None


def srun_rank(node: str | None, task: int) -> int:
    """The rank of srun's task ``task`` on ``node`` in this job (a heterogeneous job numbers each component's tasks
    from 0: p3d.jobs.slurm.hetjob.step_rank)."""
    if not os.environ.get("SLURM_HET_SIZE"):
        return task
    return step_rank(node, task, os.environ, hostnames)


def slurm_restart(run_dir: Path, rc: int, srun_err: Path, refreeze: Callable[..., int], console=None) -> int:
    """After a failed srun: 0 when the workers should start again (the spec is re-frozen with
    train.resume=auto by ``refreeze`` and the restart printed), REQUEUE when a restart is warranted but
    train.max_restarts are used up here (the recipe requeues the job), 1 when not (the reason printed). An elastic
    run that lost nodes: 0 on the nodes left (re-fitted), NODES_LOST below cluster.elastic.min_nodes."""
    from p3d.rundir.spec import read_spec

    console = console or sys.stdout
    cfg, _ = read_spec(run_dir)
    if cfg.cluster.elastic.min_nodes is not None and rc not in (exit_codes.OK, exit_codes.PREEMPTED):
        from p3d.jobs.slurm.step import allocation

        lost, alive = allocation(srun_err)
        index = None
        if lost and cfg.cluster.groups:  # each lost host's place in the failed srun's host file: its group's node
            from p3d.config.errors import P3DConfigError
            from p3d.jobs.slurm.groupjob import hostfile_path, lost_indices, read_order

            try:
                lost, index = lost_indices(lost, read_order(hostfile_path(run_dir)))
            except P3DConfigError as exc:  # which group each lost host held is not known: nothing to re-plan
                nodes = f"node{'s' if len(lost) > 1 else ''} {', '.join(lost)}"
                print(
                    f"p3d: elastic: {nodes} lost, but {exc}: which group each lost host was in is not known; not "
                    "restarting, the newest checkpoint is kept: resume naming the groups (p3d-train "
                    f"train.resume=auto run.dir={run_dir} cluster.groups='[...]')",
                    file=console,
                    flush=True,
                )
                return 1
        if lost:  # an elastic run (--no-kill) goes on on the nodes left, or stops below min_nodes (p3d.jobs.elastic)
            decision = elastic.after_loss(run_dir, lost, alive, step_in_flight(run_dir), index)
            print(decision.line, file=console, flush=True)
            if decision.action == "stop":
                return exit_codes.NODES_LOST
            return 0 if refreeze(str(run_dir), nodes=decision.nodes, event=decision.event) == 0 else 1
    cause = slurm_cause(run_dir, srun_err)
    if cause is None or rc in (exit_codes.OK, exit_codes.PREEMPTED) or cfg.train.max_restarts == 0:
        return 1
    state_path = run_logs(run_dir) / STATE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    restarts: int = state.get("restarts", 0)
    previous = (state["previous"][0], state["previous"][1]) if state.get("previous") else None
    this = (step_in_flight(run_dir), cause)
    again, line = decide(this, previous, restarts, cfg.train.max_restarts)
    print(line, file=console, flush=True)
    if not again:
        return 1 if this == previous else REQUEUE
    state_path.write_text(json.dumps({"restarts": restarts + 1, "previous": list(this)}) + "\n")
    return 0 if refreeze(str(run_dir)) == 0 else 1


REQUEUE = 3
