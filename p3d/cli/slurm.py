"""The Slurm recipe's steps (recipes/slurm/train.sbatch), one command each:

python -m p3d.cli.slurm layout <run_dir>    world size, tasks per node, ... of the run spec, for srun
python -m p3d.cli.slurm hostfile <run_dir>  an elastic run over groups: the host file of the job's live nodes in the
                                            groups' order; prints its path and the master host (p3d.jobs.slurm.groupjob)
python -m p3d.cli.slurm resume <run_dir>    after a requeue: the spec re-frozen with train.resume=auto (elastic:
                                            fitted to the job's nodes)
python -m p3d.cli.slurm attempt <run_dir>   before each srun: the attempt's header in every rank log, the hang
                                            reports of the one before kept aside; prints where the logging rank's
                                            log ends (p3d.rundir.attempts)
python -m p3d.cli.slurm follow <log> <offset> <srun pid>   the logging rank's log on the console while srun runs
python -m p3d.cli.slurm hang <run_dir>      after srun failed: who waited where, who never arrived
python -m p3d.cli.slurm restart <run_dir> <srun status> <srun stderr file>   restart within the allocation?
python -m p3d.cli.slurm failed <run_dir>    after the last srun failed: the last lines of the failed rank's log
"""

from __future__ import annotations

import sys
from pathlib import Path

from p3d import exit_codes
from p3d.config.errors import P3DConfigError
from p3d.jobs.restart import failed_tail, slurm_restart
from p3d.jobs.slurm.step import follow_srun, hang_summary, print_layout, start_srun_attempt, write_hostfile
from p3d.launch.requeue import resume_in_allocation, resume_spec

USAGE = (
    "usage: python -m p3d.cli.slurm {layout|hostfile|resume|attempt|hang|failed} <run_dir>, python -m p3d.cli.slurm "
    "follow <log> <offset> <srun pid>, or python -m p3d.cli.slurm restart <run_dir> <srun status> <srun stderr file>"
)


def print_attempt(run_dir: str) -> int:
    print(start_srun_attempt(run_dir))
    return 0


def print_failed(run_dir: str) -> int:
    tail = failed_tail(Path(run_dir))
    if tail is not None:
        print(tail, flush=True)
    return 0 if tail is not None else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["restart"], ["follow"]):
        if len(argv) != 4:
            print(USAGE, file=sys.stderr)
            return exit_codes.CONFIG_ERROR
        if argv[0] == "follow":
            return follow_srun(*argv[1:])
        return slurm_restart(Path(argv[1]), int(argv[2]), Path(argv[3]), resume_spec)
    commands = {
        "layout": print_layout,
        "hostfile": write_hostfile,
        "resume": resume_in_allocation,
        "attempt": print_attempt,
        "hang": hang_summary,
        "failed": print_failed,
    }
    if len(argv) != 2 or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    try:
        return commands[argv[0]](argv[1])
    except (P3DConfigError, FileNotFoundError) as exc:
        print(f"p3d: {exc}", file=sys.stderr, flush=True)
        return exit_codes.CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
