"""An elastic run over cluster.groups on the two-node Slurm cluster (issue 55): ``p3d-train cluster.groups=...
cluster.elastic.min_nodes=1`` submits one ordinary ``--no-kill`` job (a hetjob ends whole when a node fails), each
group's node asked for by its feature (``--constraint=[on_n2*1&on_n1*1]``), the ranks put in the groups' order by a
host file and ``srun --distribution=arbitrary``: group 0 on n2, the reverse of the nodes' names. n2 is killed mid-run:
the job goes on on n1 without a requeue, group 0 is dropped, the layout re-fitted (dp2_pp2 -> dp1_pp2) and the split
re-planned, the master moved to n1, and every step's loss is the single process's within 1e-5."""

from __future__ import annotations

import re
import time

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import assert_follows_curve, p3d_train, typed
from tests.helpers.slurm import PLACEMENT, client_env, steps_done

STEPS, SAVE_EVERY = 12, 3
GROUPS = (  # group 0, the fast one, on n2; group 1, half its peak, on n1 (test_hetjob.py's)
    "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n2}, "
    "{device: cpu, nodes: 1, peak_tflops: 0.05, constraint: on_n1}]"
)
TRAIN = ("model=tiny", f"train.steps={STEPS}", "train.warmup_steps=2", f"train.eval_every={STEPS}")
LAYOUT = ("mesh=dp2_pp2", "schedule.stage_blocks=[3,1]", "schedule.replica_micro_batches=[3,5]")
ELASTIC = ("cluster=slurm", "cluster.time=30", "cluster.signal_s=60", "cluster.elastic.min_nodes=1")


def hosts_by_attempt(run_dir, rank: int) -> list[str]:
    """The host of ``rank`` in each srun that started it (its log's placement lines, in order)."""
    return [m[1] for m in PLACEMENT.findall((run_dir / "logs" / f"rank{rank}.log").read_text())]


# slow tier (about 110 s, most of it SlurmdTimeout and srun --wait past it): kept in make test: the same loss and
# re-plan on the local launcher (tests/e2e/test_elastic_groups.py), the hetjob on the two nodes (test_hetjob.py) and
# the sbatch line, host file and lost-host mapping in-process (tests/unit/jobs/test_groupjob.py)
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_groups_run_that_loses_group_0s_node_goes_on_on_the_other_group_re_planned(two_nodes, tmp_path):
    from p3d.train.reference import reference_run

    run_dir = tmp_path / "run"
    result = p3d_train(
        *ELASTIC, GROUPS, *LAYOUT, *TRAIN, f"train.save_every={SAVE_EVERY}", f"run.dir={run_dir}",
        timeout=120, env=client_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    match = re.search(r"submitted Slurm job (\d+): .* 2 node\(s\) x 2 tasks; one --no-kill job", result.stdout)
    assert match, result.stdout
    job = match.group(1)
    log_path = run_dir / f"slurm-{job}.out"
    deadline = time.monotonic() + 240
    while max(steps_done(run_dir), default=0) < 5:
        assert time.monotonic() < deadline, log_path.read_text()[-3000:] if log_path.exists() else "no job log"
        assert two_nodes.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log_path.read_text()[-3000:]
        time.sleep(0.2)
    shown = two_nodes.show(job)
    assert "HetJobId" not in shown and shown["Features"] == "[on_n2*1&on_n1*1]", shown
    on_n2 = two_nodes.pids_on("n2")
    try:
        two_nodes.kill_node("n2", first=on_n2)
        killed = time.time()
        state = two_nodes.wait(job, timeout=360)
        shown = two_nodes.show(job)
    finally:
        two_nodes.revive_node("n2")
    log = log_path.read_text()
    assert (state, shown.get("Restarts")) == ("COMPLETED", "0"), log[-4000:]
    assert "srun 4 tasks (2 node(s) x 2, the groups' hosts in order: n2 n1), master n2:" in log, log[-4000:]
    assert "srun 2 tasks (1 node(s) x 2, the groups' hosts in order: n1), master n1:" in log, log[-4000:]
    lines = [ln for ln in log.splitlines() if "p3d: elastic:" in ln]
    assert len(lines) == 1, log[-4000:]
    assert re.search(r"node n2 lost at step \d+; resumed step \d+ on 1 node as dp1 x pp2 x tp1", lines[0]), lines[0]
    assert "node n2 was group 0's (1 x cpu); groups left 1 x cpu, split re-planned:" in lines[0], lines[0]
    # dp2_pp2: ranks 0-1 (stage 0 of both replicas) on group 0's n2, ranks 2-3 on n1; dp1_pp2: ranks 0-1 on n1
    assert [hosts_by_attempt(run_dir, r) for r in range(4)] == [["n2", "n1"], ["n2", "n1"], ["n1"], ["n1"]]
    changes = [r["layout_change"] for r in read_metrics(run_dir) if "layout_change" in r]
    assert [(c["lost_groups"], c["new"]["dp"], c["new"]["groups"]) for c in changes] == [([0], 1, "1 x cpu")]
    shrink = changes[0]
    figures = {k: shrink[k] for k in ("at_step", "resumed_step", "steps_redone")}
    figures["kill_to_first_step_s"] = round(shrink["since"] + shrink["time_lost_s"] - killed, 1)
    print("elastic groups node loss:", figures)
    ref_cfg, _ = typed("mesh=single", *TRAIN)
    assert_follows_curve(read_metrics(run_dir), reference_run(ref_cfg), 1e-5, lr=True)


# slow tier (about 3 min: SlurmdTimeout, srun --wait past it, a requeue): kept in make test: the loss and re-plan above
# on the local launcher, and the grow-back from the job's features in-process (tests/unit/jobs/test_groupjob_requeue.py)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_shrunk_groups_run_that_is_requeued_grows_back_to_both_groups_from_the_nodes_features(two_nodes, tmp_path):
    """The run above, n2 killed and the job gone on on n1 alone; then n2 comes back and the job gets the time-limit
    signal (checkpoint, exit 75, requeue). The requeued job has both nodes again (it keeps --nodes=2 and the feature
    counts): n2's on_n2 feature gives group 0 back, dp2 again and the split re-planned for both groups, rank 0 on n2,
    the grow recorded, and every step's loss is the single process's within 1e-5."""
    from p3d.train.reference import reference_run
    from tests.cluster.multinode.conftest import shrunk_then_requeued

    steps = 24  # the run must outlast the shrink, n2's revival and the signal: each block sleeps 20 ms more
    train = ("model=tiny", f"train.steps={steps}", "train.warmup_steps=2", f"train.eval_every={steps}")
    run_dir = tmp_path / "run"
    result = p3d_train(
        *ELASTIC, GROUPS, *LAYOUT, *train, f"train.save_every={SAVE_EVERY}", f"run.dir={run_dir}",
        timeout=120, env=client_env(P3D_TEST_BLOCK_SECONDS="0.02"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", result.stdout).group(1)  # type: ignore[union-attr]
    log_path = run_dir / f"slurm-{job}.out"

    def changes() -> list[dict]:
        try:
            return [r["layout_change"] for r in read_metrics(run_dir) if "layout_change" in r]
        except (OSError, ValueError):
            return []

    deadline = time.monotonic() + 240
    while max(steps_done(run_dir), default=0) < 5:
        assert time.monotonic() < deadline, log_path.read_text()[-3000:] if log_path.exists() else "no job log"
        assert two_nodes.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log_path.read_text()[-3000:]
        time.sleep(0.2)
    log, _ = shrunk_then_requeued(two_nodes, job, log_path, run_dir, steps, changes, deadline + 240)
    lines = [ln for ln in log.splitlines() if "p3d: elastic:" in ln]
    assert len(lines) == 2, log[-4000:]
    assert "node n2 was group 0's (1 x cpu); groups left 1 x cpu" in lines[0], lines[0]
    assert re.search(r"2 nodes now \(was 1\); resumed step \d+ on 2 nodes as dp2 x pp2 x tp1", lines[1]), lines[1]
    assert "; groups 1 x cpu + 1 x cpu (were 1 x cpu), split " in lines[1], lines[1]
    after = log[log.index(lines[1]) :]
    assert "srun 4 tasks (2 node(s) x 2, the groups' hosts in order: n2 n1), master n2:" in after, after[-4000:]
    # dp2_pp2, then dp1_pp2 on n1, then dp2_pp2 again with group 0 (ranks 0-1) back on n2
    assert [hosts_by_attempt(run_dir, r) for r in range(4)] == [["n2", "n1", "n2"]] * 2 + [["n1", "n1"]] * 2
    found = changes()
    assert [(c["kind"], c["new"]["dp"], c["new"]["groups"]) for c in found] == [
        ("shrink", 1, "1 x cpu"),
        ("grow", 2, "1 x cpu + 1 x cpu"),
    ]
    print("elastic groups grow back:", {k: found[1][k] for k in ("at_step", "resumed_step")}, found[1]["new"]["split"])
    ref_cfg, _ = typed("mesh=single", *train)
    assert_follows_curve(read_metrics(run_dir), reference_run(ref_cfg), 1e-5, lr=True)
