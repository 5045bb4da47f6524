"""The batch recipe restarts its workers within the allocation (p3d.jobs.restart, train.max_restarts) when
one is killed: real Slurm (one node here), a real SIGKILL (the P3D_TEST_KILL_AT hook), tiny pp2 on CPU."""

from __future__ import annotations

import pytest

from p3d.train.loop import KILL_ENV
from p3d.train.metrics import read_metrics
from tests.helpers.runs import p3d_train
from tests.helpers.slurm import RECIPE, steps_done

RUN = ("mesh=pp2", "train.steps=8", "train.warmup_steps=2", "train.save_every=3")


@pytest.mark.timeout(600)
def test_a_killed_worker_is_restarted_within_the_allocation(slurm_cluster, tmp_path, monkeypatch):
    """Rank 0 SIGKILLs itself as step 5 starts (once): the recipe prints the restart with its cause, every
    worker resumes from step 3's checkpoint in the same allocation (no requeue), the job completes, and the
    final loss and grad norm equal an uninterrupted run's (bitwise)."""
    straight = p3d_train(f"run.dir={tmp_path / 'a'}", *RUN, timeout=400)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run_dir = tmp_path / "b"
    monkeypatch.setattr(slurm_cluster, "env", {**slurm_cluster.env, KILL_ENV: "0:5:once"})  # sbatch's environment
    job = slurm_cluster.sbatch(
        "--ntasks-per-node=2", "--time=10", f"--output={tmp_path}/job-%j.out",
        RECIPE, *RUN, "train.max_restarts=2", f"run.dir={run_dir}",
    )  # fmt: skip
    state = slurm_cluster.wait(job, timeout=480)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    runs = slurm_cluster.wait_accounted(job, runs=1)
    assert [r["State"].split()[0] for r in runs] == ["COMPLETED"], runs  # one allocation: never requeued
    assert "task 0: Killed" in log, log[-4000:]
    assert "p3d: restart 1 of 2: rank 0 ended: Killed at step 5; restarting every worker" in log, log[-4000:]
    assert "resumed from step 3" in log, log[-4000:]
    assert f"{job} restart in the allocation after exit" in (run_dir / "slurm_jobs.log").read_text()
    assert steps_done(run_dir)[-1] == 8
    a, b = read_metrics(tmp_path / "a")[-1], read_metrics(run_dir)[-1]
    assert b["step"] == a["step"] == 8
    assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"], (a, b)  # bitwise


# slow tier (23 s): kept: the killed worker restarted within the allocation (the same decision, tested in-process)
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_worker_killed_at_the_same_step_again_fails_the_job(slurm_cluster, tmp_path, monkeypatch):
    """Rank 1 SIGKILLs itself at step 5 on every start: one restart in the allocation, then the same cause at
    the same step again stops retrying, and the job fails with the cause (no requeue)."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(slurm_cluster, "env", {**slurm_cluster.env, KILL_ENV: "1:5"})
    job = slurm_cluster.sbatch(
        "--ntasks-per-node=2", "--time=10", f"--output={tmp_path}/job-%j.out",
        RECIPE, *RUN, "train.max_restarts=3", f"run.dir={run_dir}",
    )  # fmt: skip
    state = slurm_cluster.wait(job, timeout=360)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "FAILED", log[-4000:]
    assert log.count("p3d: restart ") == 1 and "p3d: restart 1 of 3: rank 1 ended: Killed at step 5" in log
    assert "p3d: rank 1 ended: Killed at step 5 again, as before the last restart: not restarting" in log, log[-4000:]
    assert [r["State"].split()[0] for r in slurm_cluster.wait_accounted(job, runs=1)] == ["FAILED"]
