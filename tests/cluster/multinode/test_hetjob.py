"""A cluster of groups on the two-node Slurm cluster (issue 55): ``p3d-train cluster.groups=...`` submits one
heterogeneous job, a component per group, each group's nodes picked by its constraint (the node features on_n1 and
on_n2 of .ci/slurm/two-node-slurm.sh). The groups are given in the order n2, n1, the reverse of the nodes' names, so
that ranks sitting on their groups' nodes is the hetjob's doing, not Slurm's default order."""

from __future__ import annotations

import re

import pytest

from p3d.layout.dims import ParallelDims
from p3d.layout.hetero import group_of_node
from tests.helpers.runs import assert_follows_curve, p3d_train, typed
from tests.helpers.slurm import client_env, placements

from .conftest import slurm

STEPS = 3
# group 0, the fast one, on n2; group 1, half its peak, on n1
GROUPS = (
    "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n2}, "
    "{device: cpu, nodes: 1, peak_tflops: 0.05, constraint: on_n1}]"
)
GROUP_NODE = ("n2", "n1")
TRAIN = ("model=tiny", f"train.steps={STEPS}", "train.warmup_steps=2", f"train.eval_every={STEPS}")
SLURM = ("cluster=slurm", "cluster.time=30", "cluster.signal_s=60")


def components(job: str) -> list[dict[str, str]]:
    """``scontrol show job -o``'s fields of each component of the job, in offset order."""
    lines = slurm("scontrol", "show", "job", "-o", job).stdout.splitlines()
    rows = [dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line)) for line in lines if line.strip()]
    return sorted(rows, key=lambda r: int(r.get("HetJobOffset", "0")))


@pytest.mark.timeout(420)
def test_groups_run_as_a_hetjob_with_each_ranks_on_its_groups_node_and_the_single_process_losses(two_nodes, tmp_path):
    """dp2_pp2 with 3 + 1 blocks and 3 + 5 micro batches: stage 0 (both replicas) on group 0's node n2, stage 1 on
    group 1's n1; the losses, gradient norms and learning rates are the single process's within 1e-5."""
    from p3d.train.metrics import read_metrics
    from p3d.train.reference import reference_run

    run_dir = tmp_path / "run"
    layout = ("mesh=dp2_pp2", "schedule.stage_blocks=[3,1]", "schedule.replica_micro_batches=[3,5]")
    result = p3d_train(*SLURM, GROUPS, *layout, *TRAIN, f"run.dir={run_dir}", timeout=120, env=client_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "p3d: warning: cluster.groups" not in result.stderr, result.stderr[-2000:]
    match = re.search(r"submitted Slurm job (\d+): .* 2 node\(s\) x 2 tasks; a heterogeneous job", result.stdout)
    assert match, result.stdout
    job = match.group(1)
    state = two_nodes.wait(job, timeout=360)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    parts = components(job)  # the job is a hetjob: one component per group, on its group's node
    assert [(p["HetJobId"], p["HetJobOffset"], p["NodeList"], p["Features"]) for p in parts] == [
        (job, "0", "n2", "on_n2"),
        (job, "1", "n1", "on_n1"),
    ], parts
    assert "srun 4 tasks (2 node(s) x 2, 2 hetjob components: n2 + n1)" in log, log[-3000:]

    cfg, _ = typed(*SLURM, GROUPS, *layout, *TRAIN)
    dims = ParallelDims(tp=1, pp=2, dp=2, procs_per_node=2)
    placed = placements(run_dir)
    assert {r: p[0] for r, p in placed.items()} == {
        r: GROUP_NODE[group_of_node(cfg.cluster, dims.node_of(r))] for r in range(4)
    }
    assert {r: p[0] for r, p in placed.items()} == {0: "n2", 1: "n2", 2: "n1", 3: "n1"}  # the same, spelled out
    assert {p[0] for p in placed.values() if p[2] == 0} == {"n2"}  # pp stage 0 on the fast group

    ref_cfg, _ = typed("mesh=single", *TRAIN)
    assert_follows_curve(read_metrics(run_dir), reference_run(ref_cfg), 1e-5, lr=True)


# slow tier (about 3 s): kept in make test: the unit test of the same refusal (tests/unit/jobs/test_hetjob.py)
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_group_whose_feature_no_node_has_is_refused_in_one_line_before_anything_is_submitted(two_nodes, tmp_path):
    groups = GROUPS.replace("on_n1", "on_n3")
    before = slurm("squeue", "-h", "-o", "%i").stdout.split()
    result = p3d_train(*SLURM, groups, "mesh=dp2", *TRAIN, f"run.dir={tmp_path / 'run'}", timeout=120, env=client_env())
    assert result.returncode != 0
    assert (
        "cluster.groups[1].constraint=on_n3: no node of partition two has that feature (its features: on_n1, on_n2)"
        in result.stderr
    ), result.stderr[-2000:]
    assert slurm("squeue", "-h", "-o", "%i").stdout.split() == before


# slow tier (about 40 s): kept in make test: the hetjob above; the time-limit requeue of an ordinary job
# (tests/cluster/slurm/test_slurm_jobs.py)
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_hetjob_signalled_before_its_time_limit_requeues_every_component_and_resumes(two_nodes, tmp_path):
    """The time-limit signal (sent at once with scancel --batch) reaches the batch shell on component 0's node; the
    workers on both components checkpoint and exit 75, the job requeues itself (every component, same id) and the
    next start resumes on the same groups' nodes to the single process's losses."""
    from p3d.train.metrics import read_metrics
    from p3d.train.reference import reference_run
    from tests.helpers.slurm import stopped_requeued_and_resumed

    steps, run_dir = 12, tmp_path / "run"
    train = ("model=tiny", f"train.steps={steps}", "train.warmup_steps=2", f"train.eval_every={steps}")
    slurm_opts = ("cluster=slurm", "cluster.time=10", "cluster.signal_s=60")
    result = p3d_train(*slurm_opts, GROUPS, "mesh=dp2", *train, f"run.dir={run_dir}", timeout=120, env=client_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", result.stdout).group(1)  # type: ignore[union-attr]

    def scancel():
        return slurm("scancel", "--batch", "--signal=USR1", job)

    def every_component_pending():
        assert [p["JobState"] for p in components(job)] == ["PENDING", "PENDING"], components(job)

    log_path = run_dir / f"slurm-{job}.out"
    stopped = stopped_requeued_and_resumed(two_nodes, job, run_dir, log_path, steps, scancel, every_component_pending)
    jobs_log = stopped[2]
    assert f"{job} start (restart 1) on n2 + n1" in jobs_log
    ref_cfg, _ = typed("mesh=single", *train)
    assert_follows_curve(read_metrics(run_dir), reference_run(ref_cfg), 1e-5, lr=True)


# slow tier (about 25 s): kept in make test: the hetjob above; the killed worker's restart of an ordinary job
# (tests/cluster/slurm/test_slurm_restarts.py)
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_worker_killed_in_a_hetjob_is_named_by_its_rank_and_every_worker_restarts_in_the_allocation(
    two_nodes, tmp_path
):
    """Rank 1, group 1's on n1, SIGKILLs itself as step 5 starts (once): srun reports it as component 1's task 0, the
    restart names rank 1, every worker resumes from step 3's checkpoint on both components, the losses are the
    single process's."""
    from p3d.train.loop import KILL_ENV
    from p3d.train.metrics import read_metrics
    from p3d.train.reference import reference_run

    run_dir = tmp_path / "run"
    train = ("model=tiny", "train.steps=8", "train.warmup_steps=2", "train.eval_every=8", "train.save_every=3")
    result = p3d_train(
        *SLURM, GROUPS, "mesh=dp2", *train, "train.max_restarts=2", f"run.dir={run_dir}",
        timeout=120, env=client_env(**{KILL_ENV: "1:5:once"}),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", result.stdout).group(1)  # type: ignore[union-attr]
    state = two_nodes.wait(job, timeout=360)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "n1: task 0: Killed" in log, log[-4000:]
    assert "p3d: restart 1 of 2: rank 1 ended: Killed at step 5" in log, log[-4000:]
    assert "resumed from step 3" in log, log[-4000:]
    assert f"{job} restart in the allocation after exit" in (run_dir / "slurm_jobs.log").read_text()
    ref_cfg, _ = typed("mesh=single", *train)
    assert_follows_curve(read_metrics(run_dir), reference_run(ref_cfg), 1e-5, lr=True)
