"""The Slurm recipe's steps (recipes/slurm/train.sbatch), one command each:

python -m p3d.cli.slurm layout <run_dir>    world size, tasks per node, ... of the run spec, for srun
python -m p3d.cli.slurm resume <run_dir>    after a requeue: the spec re-frozen with train.resume=auto (elastic:
                                            fitted to the job's nodes)
python -m p3d.cli.slurm hang <run_dir>      after srun failed: who waited where, who never arrived
python -m p3d.cli.slurm restart <run_dir> <srun status> <srun stderr file>   restart within the allocation?
"""

from __future__ import annotations

import sys
from pathlib import Path

from p3d import exit_codes
from p3d.config.errors import P3DConfigError
from p3d.jobs.restart import slurm_restart
from p3d.jobs.slurm.step import hang_summary, print_layout
from p3d.launch.requeue import resume_in_allocation, resume_spec

USAGE = (
    "usage: python -m p3d.cli.slurm {layout|resume|hang} <run_dir>, or python -m p3d.cli.slurm restart <run_dir> "
    "<srun status> <srun stderr file>"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["restart"]:
        if len(argv) != 4:
            print(USAGE, file=sys.stderr)
            return exit_codes.CONFIG_ERROR
        return slurm_restart(Path(argv[1]), int(argv[2]), Path(argv[3]), resume_spec)
    commands = {"layout": print_layout, "resume": resume_in_allocation, "hang": hang_summary}
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
