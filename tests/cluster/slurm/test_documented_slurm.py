"""The Slurm command lines of the docs (README.md, docs/*.md) and the recipe header, typed as written
from a fresh working directory, on the local Slurm cluster (which line runs how: ``tests/helpers/documented.py``)."""

from __future__ import annotations

import re

import pytest

from tests.helpers.documented import CASES, argv_of, last_step, metrics_files, run_line, user_env

pytestmark = pytest.mark.timeout(900)

STEPS = 1


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=pytest.mark.slow) if k.slow else c for c, k in CASES.items() if k.kind == "slurm"]
)
def test_documented_slurm_line(slurm_cluster, command, tmp_path):
    cwd = tmp_path / "work dir"
    cwd.mkdir()
    extra = CASES[command].extra
    if command.startswith("sbatch"):
        env, argv = argv_of(command, cwd)
        slurm_cluster.env = user_env(env)
        job = slurm_cluster.sbatch(*argv[1:], *extra, cwd=cwd)
        state = slurm_cluster.wait(job, timeout=600)
        log = next(cwd.glob(f"*-{job}.out")).read_text()  # the recipe names it <job name>-<job id>.out
        assert state == "COMPLETED", log[-3000:]
        points = 1
    else:
        result = run_line(command, cwd, extra, timeout=800)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        if "-m" not in command.split():  # p3d-train submits and returns: wait for the job it names
            job = re.search(r"submitted Slurm job (\d+)", result.stdout).group(1)
            state = slurm_cluster.wait(job, timeout=600)
            assert state == "COMPLETED", result.stdout[-2000:]
        points = len(re.search(r"mesh=(\S+)", command).group(1).split(","))
    runs = metrics_files(cwd)
    assert len(runs) == points, f"{command!r}: expected {points} run(s) under {cwd}, found {runs}"
    assert all(last_step(m) == STEPS for m in runs), [(m, last_step(m)) for m in runs]
