"""Every console script and sbatch subcommand of p3d, one module each: parse the command line, call one library
function, return its exit status. Nothing imports this package (tests/unit/test_structure.py checks it).

    p3d-train      train.py       (also ``python -m p3d.cli``, what torchrun and srun start)
    p3d-plan       plan.py        p3d-prepare   prepare.py     p3d-tokenizer   tokenizer.py
    p3d-export     export.py      p3d-report    report.py
    python -m p3d.cli.worker <run_spec.yaml>                   one worker (the local launcher's exec start, srun)
    python -m p3d.cli.lease {acquire|heartbeat|release} ...    the Slurm recipe's run-directory lease
    python -m p3d.cli.slurm {layout|resume|hang|restart} ...   the Slurm recipe's steps
"""
