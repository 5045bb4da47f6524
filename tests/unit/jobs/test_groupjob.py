"""An elastic run over ``cluster.groups`` on Slurm (issue 55): one ordinary ``--no-kill`` job asking for each group's
nodes by its feature, not a hetjob (which Slurm ends whole when a node fails); the ranks placed in the groups' order
by a host file; a lost host mapped to its group by its place in that file (p3d.jobs.slurm.groupjob). In-process; the
two-node run is tests/cluster/multinode/test_elastic_groups.py."""

from __future__ import annotations

import pytest

from p3d.jobs import elastic
from p3d.jobs.slurm.groupjob import hostfile_text, lost_indices, node_order, parse_node_features
from p3d.jobs.slurm.submit import job_shape, sbatch_args
from tests.helpers.runs import assert_refused_in_one_line, typed
from tests.unit.jobs.test_elastic import fake_run

RUN_DIR = "/shared/runs/r1"
# group 0, the fast one, on n2's feature; group 1, half its peak, on n1's (test_hetjob's two-node groups)
GROUPS = (
    "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n2}, "
    "{device: cpu, nodes: 1, peak_tflops: 0.05, constraint: on_n1}]"
)
ELASTIC = ("cluster=slurm", "model=tiny", "mesh=dp2_pp2", "cluster.elastic.min_nodes=1", "train.save_every=3")
# `scontrol show node -o n1,n2` on the two-node cluster (trimmed)
SHOW_NODES = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUTot=4 AvailableFeatures=on_n1 ActiveFeatures=on_n1 "
    "Gres=(null) NodeAddr=10.77.0.2 NodeHostName=n1 State=MIXED Partitions=two\n"
    "NodeName=n2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUTot=4 AvailableFeatures=on_n2 ActiveFeatures=on_n2 "
    "Gres=(null) NodeAddr=10.77.0.3 NodeHostName=n2 State=MIXED Partitions=two\n"
)


def test_an_elastic_groups_run_is_one_no_kill_job_with_each_groups_node_count_of_its_feature():
    cfg, plan = typed(*ELASTIC, GROUPS, "cluster.partition=two")
    args = sbatch_args(cfg, job_shape(cfg, plan), RUN_DIR)
    assert ":" not in args  # not a heterogeneous job
    assert args[:4] == ["--nodes=2", "--ntasks-per-node=2", "--partition=two", "--constraint=[on_n2*1&on_n1*1]"]
    assert "--no-kill" in args and f"--output={RUN_DIR}/slurm-%j.out" in args
    cfg, plan = typed("cluster=slurm", "model=tiny", "mesh=dp2_pp2", GROUPS)  # not elastic: still a hetjob
    args = sbatch_args(cfg, job_shape(cfg, plan), RUN_DIR)
    assert args.count(":") == 1 and "--constraint=on_n2" in args and "--no-kill" not in args


@pytest.mark.parametrize(
    "groups,message,fix",
    [
        (
            "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n2}, {device: cpu, nodes: 1}]",
            "cluster.groups[1].constraint=null: an elastic run over cluster.groups on Slurm is one job",
            "set cluster.groups[1].constraint to one feature",
        ),
        (
            "cluster.groups=[{device: cpu, nodes: 1, constraint: 'on_n2|on_n1'}, {device: cpu, nodes: 1, "
            "constraint: on_n1}]",
            "cluster.groups[0].constraint=on_n2|on_n1:",
            "set cluster.groups[0].constraint to one feature",
        ),
        (
            "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n1}, {device: cpu, nodes: 1, constraint: on_n1}]",
            "cluster.groups[1].constraint=on_n1 is cluster.groups[0]'s too",
            "give each group a feature of its own nodes",
        ),
        (
            "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n2}, {device: cpu, nodes: 1, constraint: on_n1, "
            "partition: other}]",
            "cluster.groups[1].partition=other differs from cluster.groups[0]'s (null): an elastic run over "
            "cluster.groups on Slurm is one job, in one partition",
            "set cluster.partition and leave the groups' partition null",
        ),
    ],
    ids=["no-feature", "an-expression", "a-shared-feature", "two-partitions"],
)
def test_a_group_an_ordinary_job_cannot_tell_apart_is_refused_in_one_line(groups, message, fix):
    assert_refused_in_one_line((*ELASTIC, groups), message, fix)


def test_the_host_file_lists_each_groups_hosts_in_the_groups_order_not_by_name():
    features = parse_node_features(SHOW_NODES)
    assert features == {"n1": {"on_n1"}, "n2": {"on_n2"}}
    cfg, _ = typed(*ELASTIC, GROUPS)
    order = node_order(cfg.cluster, features)
    assert order == ["n2", "n1"]
    assert hostfile_text(order, 2) == "n2\nn2\nn1\nn1\n"  # ranks 0-1 (group 0) on n2, ranks 2-3 on n1


def test_a_group_with_fewer_live_hosts_than_nodes_is_named():
    from p3d.config.errors import P3DConfigError

    cfg, _ = typed(*ELASTIC, GROUPS)
    with pytest.raises(P3DConfigError, match=r"cluster.groups\[0\] \(1 x cpu, feature on_n2\): the job has 0"):
        node_order(cfg.cluster, {"n1": {"on_n1"}})


def test_a_lost_host_is_its_groups_node_and_that_group_is_dropped_and_the_split_re_planned(tmp_path):
    """n2 held group 0 (the host file's first host): losing it leaves group 1 on n1, the layout re-fitted to dp1 and
    the split re-planned; a host lost before (not in the failed srun's host file) is no loss of this srun."""
    assert lost_indices(["n2"], ["n2", "n1"]) == (["n2"], [0])
    assert lost_indices(["n3", "n1"], ["n2", "n1"]) == (["n1"], [1])
    run = fake_run(tmp_path, *ELASTIC, GROUPS, "schedule.stage_blocks=[3,1]", "schedule.replica_micro_batches=[3,5]")
    lost, index = lost_indices(["n2"], ["n2", "n1"])
    d = elastic.after_loss(run, lost, alive=1, at_step=5, index=index)
    assert (d.action, d.nodes) == ("resize", 1) and d.event is not None
    assert d.event["lost_groups"] == [0] and [g["constraint"] for g in d.event["groups_left"]] == ["on_n1"]
    assert d.line.startswith("p3d: elastic: node n2 lost at step 5; resumed step 3 on 1 node as dp1 x pp2 x tp1")
    assert "node n2 was group 0's (1 x cpu); groups left 1 x cpu, split re-planned" in d.line, d.line


def _restart_after_losing_n2(tmp_path, monkeypatch, *overrides: str) -> tuple[int, str]:
    """The recipe's ``python -m p3d.cli.slurm restart`` after n2 was lost, the failed srun's host file n2 n1."""
    import io

    from p3d import exit_codes
    from p3d.jobs import restart
    from p3d.jobs.slurm import step
    from p3d.jobs.slurm.groupjob import hostfile_path
    from p3d.launch.requeue import resume_spec

    monkeypatch.setenv("SLURM_JOB_ID", "52")
    run = fake_run(tmp_path, *ELASTIC, GROUPS, *overrides)
    hostfile_path(run).parent.mkdir(parents=True, exist_ok=True)
    hostfile_path(run).write_text(hostfile_text(["n2", "n1"], 2))
    monkeypatch.setattr(step, "allocation", lambda srun_err: (["n2"], 1))
    console = io.StringIO()
    got = restart.slurm_restart(run, exit_codes.WORKER_FAILED, tmp_path / "srun.err", resume_spec, console=console)
    return got, console.getvalue()


def test_the_recipes_restart_maps_the_lost_host_by_the_host_file_and_re_freezes_the_groups_left(tmp_path, monkeypatch):
    """The host file of the srun that failed (n2's lines first: group 0's) names n2 node 0, so group 0 is dropped, not
    "the last node", and the spec is re-frozen on group 1 alone."""
    from p3d.rundir.spec import read_spec

    run = tmp_path
    got, line = _restart_after_losing_n2(tmp_path, monkeypatch)
    assert got == 0 and "node n2 was group 0's (1 x cpu); groups left 1 x cpu" in line
    cfg, plan = read_spec(run)
    assert [(g.constraint, g.peak_tflops) for g in cfg.cluster.groups] == [("on_n1", 0.05)]
    assert (cfg.cluster.nodes, plan.dp, plan.pp) == (1, 1, 2)


def test_below_min_nodes_the_recipes_restart_stops_with_status_6(tmp_path, monkeypatch):
    from p3d import exit_codes

    got, line = _restart_after_losing_n2(tmp_path, monkeypatch, "cluster.elastic.min_nodes=2")
    assert got == exit_codes.NODES_LOST
    assert "1 node left, below cluster.elastic.min_nodes=2: stopping; the newest checkpoint" in line, line
