"""``p3d-plan calibrate cluster=slurm ...``: the probes on one node of the cluster, not on the login node.

Outside an allocation the command runs itself again as one ``srun`` step on one whole node (``--exclusive``, the
partition, account, qos, constraint and time limit of the cluster config), with the CPUs the run's tasks would get
there (its tasks per node x ``cluster.cpus_per_task``): the probes measure the machine the run will train on, and the
file lands where ``calibration=`` points (storage the login node sees). Inside an allocation (``SLURM_JOB_ID`` set:
this step, ``salloc``, a batch job) it probes where it runs. srun's output streams through; its status is returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from p3d.jobs.slurm.submit import placement_args, time_seconds

WAIT_S = 1800  # a queue wait and the probes (about a minute on the node)


def inside_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def cpus_for_the_run(cfg, world: int) -> int:
    """The CPUs the run's tasks take on one node: its tasks per node (``cluster.gpus_per_node``, else the mesh's
    ranks over ``cluster.nodes``) x ``cluster.cpus_per_task`` (one when unset, Slurm's default)."""
    c = cfg.cluster
    per_node = c.gpus_per_node or max(1, world // max(1, c.nodes))
    return per_node * (c.cpus_per_task or 1)


def srun_command(cfg, world: int, overrides: list[str], out: Path) -> list[str]:
    """The srun line that runs ``p3d-plan calibrate <overrides> calibration=<out>`` on one node."""
    c = cfg.cluster
    args = [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--exclusive",
        f"--cpus-per-task={cpus_for_the_run(cfg, world)}",
        f"--job-name={c.job_name}-calibrate",
    ]
    if c.time is not None:
        time_seconds(c.time)  # a malformed limit is refused here, in one line, not by srun
        args.append(f"--time={c.time}")
    args += placement_args(c)
    kept = [o for o in overrides if not o.lstrip("+").startswith("calibration=")]
    return [*args, sys.executable, "-m", "p3d.cli.plan", "calibrate", *kept, f"calibration={out}"]


def calibrate_on_a_node(cfg, world: int, overrides: list[str], out: Path) -> int:
    """Run the probes as one srun step; srun's status (0: the file is written)."""
    from p3d.console import say

    cmd = srun_command(cfg, world, overrides, out)
    say(f"calibrate: on one node of the cluster: {' '.join(cmd[: cmd.index(sys.executable)])} ...")
    try:
        return subprocess.run(cmd, timeout=WAIT_S).returncode
    except subprocess.TimeoutExpired:
        say(f"calibrate: the srun step did not end within {WAIT_S} s (queued?); nothing written")
        return 1
