"""An elastic run over ``cluster.groups`` (issue 55) that loses a node: the lost node's own group shrinks (not "the
last node goes"), the split over the groups left is planned again by the planner's code (the even split on one group),
the global batch is kept, and the line, the event and the re-frozen spec say which group lost the node and the new
split. On fake run directories (tests/unit/jobs/test_elastic.py's), in-process."""

from __future__ import annotations

import pytest

from p3d.config.schema import ClusterGroup
from p3d.jobs import elastic
from p3d.launch.requeue import resume_spec
from p3d.layout.elastic import record_text
from p3d.layout.hetero import first_nodes, groups_left
from p3d.rundir.spec import pending_layout_change, read_spec
from tests.helpers.runs import compose_config, typed
from tests.unit.jobs.test_elastic import fake_run

# three simulated cpu nodes of one rank: two of the cpu preset, then one twice as slow (test_hetero_parity's groups)
GROUPS = "cluster.groups=[{device: cpu, nodes: 2}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"
ELASTIC = ("model=tiny", "mesh=dp2", "mesh.dp=3", GROUPS, "cluster.elastic.min_nodes=1", "train.save_every=3")
PLANNED = "schedule.replica_micro_batches=[3,3,2]"  # what the planner gives dp3 on these groups (checked below)


def _groups(groups: list[ClusterGroup]) -> list[tuple[int, float]]:
    return [(g.nodes, g.peak_tflops or 0.0) for g in groups]


@pytest.mark.parametrize(
    "lost,left",
    [([0], [(1, 0.1), (1, 0.05)]), ([1], [(1, 0.1), (1, 0.05)]), ([2], [(2, 0.1)]), ([0, 1], [(1, 0.05)])],
    ids=["first", "second", "slow", "a-whole-group"],
)
def test_the_lost_nodes_own_group_shrinks_and_an_empty_one_is_dropped(lost, left):
    c = compose_config(GROUPS).cluster
    assert _groups(groups_left(c, lost)) == left


def test_a_refit_on_fewer_nodes_than_are_left_runs_on_the_first_ones():
    c = compose_config(GROUPS).cluster
    assert _groups(first_nodes(c.groups, 1)) == [(1, 0.1)]
    assert _groups(first_nodes(c.groups, 3)) == [(2, 0.1), (1, 0.05)]
    with pytest.raises(ValueError, match="node 3 is not one of the 3 nodes"):
        groups_left(c, [3])


def test_an_elastic_run_over_groups_is_accepted():
    """main refused cluster.elastic.min_nodes with cluster.groups in one line."""
    cfg, plan = typed(*ELASTIC[1:], PLANNED)
    assert (cfg.cluster.nodes, plan.dp, plan.replica_micro_batches) == (3, 3, [3, 3, 2])


def test_losing_a_fast_node_re_plans_the_split_on_the_groups_left(tmp_path):
    run = fake_run(tmp_path, *ELASTIC, PLANNED)
    d = elastic.after_loss(run, ["0"], alive=2, at_step=5)
    assert (d.action, d.nodes) == ("resize", 2)
    assert d.line == (
        "p3d: elastic: node 0 lost at step 5; resumed step 3 on 2 nodes as dp2 x pp1 x tp1, 5 + 3 micro batches per "
        "replica; node 0 was group 0's (2 x cpu); groups left 1 x cpu + 1 x cpu, split re-planned: "
        "schedule.replica_micro_batches=[5, 3] (was schedule.replica_micro_batches=[3, 3, 2])"
    )
    assert d.event is not None
    assert d.event["lost_groups"] == [0]
    assert [(g["nodes"], g["peak_tflops"]) for g in d.event["groups_left"]] == [(1, 0.1), (1, 0.05)]
    assert d.event["old"]["replica_micro_batches"] == [3, 3, 2]
    assert (d.event["new"]["replica_micro_batches"], d.event["new"]["groups"]) == ([5, 3], "1 x cpu + 1 x cpu")
    assert record_text(d.event) == (  # p3d-report's line
        "step 5: dp3 x pp1 x tp1 on 3 nodes -> dp2 x pp1 x tp1 on 2 nodes (node 0 (group 0) lost), resumed from step "
        "3, groups 1 x cpu + 1 x cpu, schedule.replica_micro_batches=[5, 3], 5 + 3 micro batches per replica, 1 step "
        "redone"
    )

    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    cfg, plan = read_spec(run)
    assert _groups(cfg.cluster.groups) == [(1, 0.1), (1, 0.05)]  # the slow node is still the second: its group
    assert cfg.cluster.peak_tflops == pytest.approx(0.075)
    assert (cfg.cluster.nodes, cfg.schedule.global_batch_size, cfg.schedule.replica_micro_batches) == (2, 16, [5, 3])
    assert (plan.world_size, plan.dp, plan.replica_micro_batches) == (2, 2, [5, 3])
    assert pending_layout_change(run, 3)["lost_groups"] == [0]


def test_losing_the_slow_group_leaves_one_group_and_the_even_split(tmp_path):
    run = fake_run(tmp_path, *ELASTIC, PLANNED)
    d = elastic.after_loss(run, ["2"], alive=2, at_step=5)
    assert d.line.endswith(
        "on 2 nodes as dp2 x pp1 x tp1, 4 micro batches per replica; node 2 was group 1's (1 x cpu); groups left "
        "2 x cpu, split re-planned: the even split (was schedule.replica_micro_batches=[3, 3, 2])"
    ), d.line
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    cfg, plan = read_spec(run)
    assert (_groups(cfg.cluster.groups), cfg.schedule.replica_micro_batches) == ([(2, 0.1)], [])
    assert cfg.cluster.peak_tflops == pytest.approx(0.1)  # MFU's peak from the groups left, (2 x 0.1 + 0.05) / 3 before
    assert (plan.dp, plan.micro_batches, cfg.schedule.global_batch_size) == (2, 4, 16)


def test_a_split_given_by_hand_is_re_planned_and_the_line_says_so(tmp_path):
    run = fake_run(tmp_path, *ELASTIC, "schedule.replica_micro_batches=[2,3,3]")
    d = elastic.after_loss(run, ["1"], alive=2, at_step=5)
    assert d.line.endswith(
        "split re-planned: schedule.replica_micro_batches=[5, 3] (was schedule.replica_micro_batches=[2, 3, 3], set "
        "by hand)"
    ), d.line


def test_uneven_stages_are_cut_again_for_the_groups_left(tmp_path):
    """pp2 x dp2 over [fast, fast, slow, slow] nodes of two ranks: losing node 0 leaves [fast, slow, slow] and dp
    cannot shrink to 1.5: 2 nodes fit, the first two left (fast, slow), and the planner cuts pp2's blocks for them."""
    groups = "cluster.groups=[{device: cpu, nodes: 2}, {device: cpu, nodes: 2, peak_tflops: 0.05}]"
    run = fake_run(tmp_path, "model=tiny", "mesh=dp2_pp2", groups, "cluster.elastic.min_nodes=1", "train.save_every=3")
    d = elastic.after_loss(run, ["0"], alive=3, at_step=5)
    assert d.nodes == 2 and d.event is not None
    assert d.event["new"]["groups"] == "1 x cpu + 1 x cpu" and d.event["new"]["stage_blocks"] == [3, 1]
    assert "(on 2 of the 3 nodes left)" in d.line and "schedule.stage_blocks=[3, 1]" in d.line


def test_vary_any_takes_the_planners_layout_and_split_on_the_groups_left(tmp_path):
    run = fake_run(tmp_path, *ELASTIC, PLANNED, "cluster.elastic.vary=any")
    d = elastic.after_loss(run, ["0"], alive=2, at_step=5)
    assert d.action == "resize" and d.event is not None
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    cfg, plan = read_spec(run)
    assert _groups(cfg.cluster.groups) == [(1, 0.1), (1, 0.05)] and plan.world_size == 2
    assert cfg.schedule.global_batch_size == 16


def test_a_groups_run_grows_back_by_a_resume_naming_its_groups(tmp_path):
    """Which group a node that comes back belongs to is not known from a node count: the resume names the groups (and
    a split dp3 can run, or mesh=auto); dp follows the nodes as for a resume on more nodes without groups."""
    import dataclasses
    import json
    import shutil

    from p3d.checkpoint import find as checkpoint

    run = fake_run(tmp_path, *ELASTIC, PLANNED)
    d = elastic.after_loss(run, ["0"], alive=2, at_step=5)
    assert resume_spec(str(run), nodes=d.nodes, event=d.event) == 0
    ckpt = checkpoint.step_dir(run, 6)  # what the run on 2 nodes saves
    ckpt.mkdir(parents=True)
    meta = json.loads((checkpoint.step_dir(run, 3) / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": 6}))
    shutil.copy(run / "run_spec.yaml", ckpt / "run_spec.yaml")
    cfg, plan = typed("train.resume=auto", GROUPS, PLANNED, run_dir=str(run))
    assert (cfg.cluster.nodes, plan.dp, plan.replica_micro_batches) == (3, 3, [3, 3, 2])
    grown = elastic.at_start(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(ckpt))), plan)
    assert grown is not None and grown.event is not None
    assert (grown.event["kind"], grown.event["old"]["groups"], grown.event["new"]["groups"]) == (
        "grow",
        "1 x cpu + 1 x cpu",
        "2 x cpu + 1 x cpu",
    )
    with pytest.raises(elastic.P3DConfigError, match="more than cluster.groups hold"):
        elastic.refit(pinned_run(run), 4)  # a re-fit onto more nodes than the groups it knows of: refused


def pinned_run(run):
    from p3d.layout.elastic import pinned

    return pinned(*read_spec(run))
