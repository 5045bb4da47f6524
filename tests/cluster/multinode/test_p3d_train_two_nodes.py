"""p3d-train sizes two-node Slurm jobs itself: ``cluster=slurm cluster.nodes=2`` submits the recipe
with --nodes=2 --ntasks-per-node derived from the mesh, and a ``-m`` sweep runs a two-node point
through Hydra's submitit launcher next to a one-node point of the same mesh (same losses, exactly)."""

from __future__ import annotations

import re

import pytest

from p3d.layout.dims import ParallelDims
from tests.helpers.runs import p3d_train
from tests.helpers.slurm import client_env, hosts_of, losses, placements

STEPS = 3


@pytest.mark.timeout(420)
def test_p3d_train_cluster_nodes_2_submits_a_two_node_job(two_nodes, tmp_path):
    """mesh=dp2_tp2 on two nodes: 2 tasks per node, one TP group per node, the DP all-reduce across them."""
    run_dir = tmp_path / "run"
    result = p3d_train(
        "cluster=slurm",
        "cluster.nodes=2",
        "mesh=dp2_tp2",
        "model=tiny",
        f"train.steps={STEPS}",
        "cluster.time=30",
        "cluster.signal_s=60",
        f"run.dir={run_dir}",
        timeout=120,
        env=client_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    match = re.search(r"submitted Slurm job (\d+): .* 2 node\(s\) x 2 tasks", result.stdout)
    assert match, result.stdout
    job = match.group(1)
    detail = two_nodes.show(job)
    # A pending job shows its node range ("2-2"); a running or finished one shows "2".
    assert (set(detail["NumNodes"].split("-")), detail["NumTasks"]) == ({"2"}, "4"), detail
    state = two_nodes.wait(job, timeout=360)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "srun 4 tasks (2 node(s) x 2)" in log, log[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    host = {rank: p[0] for rank, p in placements(run_dir).items()}
    mesh = ParallelDims(tp=2, pp=1, dp=2, procs_per_node=2)
    assert host == {r: ("n1", "n2")[mesh.node_of(r)] for r in range(4)}
    assert all(len(h) == 1 for h in hosts_of(mesh.tp_ranks(), host)), host
    assert all(len(h) == 2 for h in hosts_of(mesh.dp_ranks(), host)), host


# slow tier (27 s): kept: the two-node job reproducing the one-node losses
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sweep_runs_a_two_node_point_with_the_one_node_points_losses(two_nodes, tmp_path):
    sweep = tmp_path / "sweep"
    result = p3d_train(
        "-m",
        "cluster=slurm",
        "cluster.nodes=1,2",
        "mesh=dp2_tp2",
        "model=tiny",
        f"train.steps={STEPS}",
        "cluster.time=30",
        "cluster.signal_s=60",
        f"hydra.sweep.dir={sweep}",
        timeout=580,
        env=client_env(),
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    jobs = re.findall(r"point #(\d) \(.*\): Slurm job (\d+), (\d) node\(s\) x (\d) tasks", result.stdout)
    assert [(p, n, t) for p, _, n, t in jobs] == [("0", "1", "4"), ("1", "2", "2")], out[-4000:]
    assert re.search(r"^1\s+dp2_tp2\s+.*3/3\s+done$", result.stdout, re.M), out[-3000:]
    one_node, two_node = losses(sweep / "0"), losses(sweep / "1")
    assert sorted(two_node) == list(range(1, STEPS + 1))
    assert two_node == one_node  # exact
    assert {p[0] for p in placements(sweep / "1").values()} == {"n1", "n2"}
    assert {p[0] for p in placements(sweep / "0").values()} == {"n1"}


# slow tier (about 60 s): kept: the ZeRO-3 HSDP checkpoint in tests/e2e/test_zero_runs.py, the two-node job above
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_sweep_on_two_nodes_keeps_each_shard_group_on_a_node_and_the_losses(two_nodes, tmp_path):
    """``-m zero=stage2,stage3 zero.shard_size=2 mesh=dp4 cluster.nodes=2``: each point is a two-node job of 2 tasks
    a node; the shard groups (dp 0-1, dp 2-3) sit on one node each and only the replica all-reduce crosses; both
    points continue the single-process losses within 1e-5."""
    from p3d.train.reference import reference_run
    from tests.helpers.runs import typed

    sweep = tmp_path / "sweep"
    result = p3d_train(
        "-m", "cluster=slurm", "cluster.nodes=2", "mesh=dp4", "zero=stage2,stage3", "zero.shard_size=2",
        "model=tiny", f"train.steps={STEPS}", "cluster.time=30", "cluster.signal_s=60", f"hydra.sweep.dir={sweep}",
        timeout=580, env=client_env(),
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    jobs = re.findall(r"point #(\d) \(.*\): Slurm job (\d+), (\d) node\(s\) x (\d) tasks", result.stdout)
    assert [(p, n, t) for p, _, n, t in jobs] == [("0", "2", "2"), ("1", "2", "2")], out[-4000:]
    cfg, _ = typed("mesh=single", "model=tiny", f"train.steps={STEPS}")
    want = {row["step"]: row["loss"] for row in reference_run(cfg)}
    dims = ParallelDims(tp=1, pp=1, dp=4, procs_per_node=2)
    for point in ("0", "1"):
        got = losses(sweep / point)
        assert sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), point
        host = {rank: p[0] for rank, p in placements(sweep / point).items()}
        assert host == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}, host
        assert all(len(h) == 1 for h in hosts_of(dims.shard_ranks(2), host)), host
        assert all(len(h) == 2 for h in hosts_of(dims.shard_replica_ranks(2), host)), host
