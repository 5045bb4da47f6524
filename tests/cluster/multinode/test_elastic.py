"""An elastic run on two Slurm nodes (issue 37): ``sbatch --no-kill --nodes=2 --ntasks-per-node=4`` the recipe with
mesh=dp2_pp2_tp2 and ``cluster.elastic.min_nodes=1``; kill-node n2 mid-run. The job is not requeued: once Slurm
declares n2 down, the recipe re-plans the run for n1 alone (dp1 x pp2 x tp2, 8 micro batches per replica instead of
4, the global batch kept), resumes the newest checkpoint and says so in one line; every step follows the
single-process curve within 1e-5 (loss and grad norm), to the last. The time from the kill to the first step on the
survivor is printed (the target: 60 s plus the steps since the checkpoint)."""

from __future__ import annotations

import json
import time

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import assert_follows_curve, single_process_curve
from tests.helpers.slurm import PLACEMENT, RECIPE, steps_done

STEPS, SAVE_EVERY = 16, 4
RUN = ("mesh=dp2_pp2_tp2", "model=tiny", f"train.steps={STEPS}", f"train.save_every={SAVE_EVERY}")


@pytest.mark.timeout(420)
def test_a_lost_node_continues_on_the_survivor_as_dp1_without_a_requeue(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    job = two_nodes.sbatch(
        "--no-kill",
        "--nodes=2",
        "--ntasks-per-node=4",
        "--time=30",
        f"--output={tmp_path}/job-%j.out",
        RECIPE,
        *RUN,
        "cluster.elastic.min_nodes=1",
        f"run.dir={run_dir}",
    )
    log_path = tmp_path / f"job-{job}.out"
    deadline = time.monotonic() + 240
    while max(steps_done(run_dir), default=0) < 6:
        assert time.monotonic() < deadline, f"no step 6: {log_path.read_text()[-3000:] if log_path.exists() else ''}"
        assert two_nodes.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log_path.read_text()[-3000:]
        time.sleep(0.2)
    on_n2 = two_nodes.pids_on("n2")
    try:
        two_nodes.kill_node("n2", first=on_n2)
        killed = time.time()
        state = two_nodes.wait(job, timeout=300)
        log = log_path.read_text()
        assert state == "COMPLETED", log[-4000:]
        assert two_nodes.show(job).get("Restarts") == "0", "an elastic run goes on without a requeue"
    finally:
        two_nodes.revive_node("n2")
    lines = [ln for ln in log.splitlines() if "p3d: elastic:" in ln]
    assert len(lines) == 1 and "node n2 lost at step" in lines[0], log[-4000:]
    assert "on 1 node as dp1 x pp2 x tp2, 8 micro batches per replica" in lines[0], lines[0]
    after = log[log.index(lines[0]) :]
    assert {p[1] for p in PLACEMENT.findall(after)} <= {"n1"}, after[:3000]  # the logging rank's placement line
    records = read_metrics(run_dir)
    assert_follows_curve(records, single_process_curve(*RUN[1:3]), 1e-5)
    change = next(r for r in records if "layout_change" in r)
    assert (change["layout_change"]["new"]["dp"], change["layout_change"]["new"]["micro_batches"]) == (1, 8)
    figures = {
        "lost_at_step": change["layout_change"]["at_step"],
        "resumed_step": change["layout_change"]["resumed_step"],
        "steps_redone": change["layout_change"]["steps_redone"],
        "time_lost_s": round(change["layout_change"]["time_lost_s"], 1),
        "kill_to_first_step_s": round(
            change["layout_change"]["since"] + change["layout_change"]["time_lost_s"] - killed, 1
        ),
    }
    print("elastic node loss:", json.dumps(figures))
