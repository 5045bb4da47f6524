"""Elastic runs' arithmetic (p3d.layout.elastic): the layout on the nodes left keeps the global batch, the largest
node count that fits is found, the refusals of cluster.elastic are one line each, and the lines read as the issue
wrote them."""

from __future__ import annotations

import pytest

from p3d.jobs.elastic import refit
from p3d.layout.elastic import (
    check_floor,
    fit_dp,
    fit_or_reason,
    largest_fit,
    loss_line,
    pinned,
    record_text,
    resize_line,
    stop_line,
    summary,
)
from p3d.layout.run_plan import build_plan
from tests.helpers.runs import assert_refused_in_one_line, compose_config

ELASTIC = ("model=tiny", "cluster.elastic.min_nodes=1", "train.save_every=3")


def _run(*overrides: str):
    cfg = compose_config(*overrides)
    plan = build_plan(cfg)
    return pinned(cfg, plan), plan


def test_fit_dp_keeps_the_global_batch_through_the_micro_batches():
    cfg, plan = _run(*ELASTIC, "mesh=dp2_pp2", "cluster.nodes=2")
    assert (plan.dp, plan.micro_batches, cfg.cluster.gpus_per_node) == (2, 4, 2)  # cpu: 4 ranks over 2 nodes
    one = fit_dp(cfg, 1)
    one_plan = build_plan(one)
    assert (one.cluster.nodes, one.mesh.dp, one_plan.world_size, one_plan.micro_batches) == (1, 1, 2, 8)
    assert (one.mesh.tp, one.mesh.pp) == (1, 2)
    back = build_plan(fit_dp(one, 2))
    assert (back.dp, back.micro_batches, back.world_size) == (2, 4, 4)
    for c in (cfg, one):
        assert c.schedule.global_batch_size == 16


def test_largest_fit_skips_a_node_count_the_batch_does_not_divide():
    cfg, plan = _run(*ELASTIC, "mesh=single", "mesh.dp=auto", "cluster.gpus_per_node=1", "cluster.nodes=4")
    assert plan.dp == 4
    got = largest_fit(cfg, 3, refit)
    assert not isinstance(got, str)
    nodes, fitted, fitted_plan = got
    assert (nodes, fitted.mesh.dp, fitted_plan.micro_batches) == (2, 2, 4)  # dp3 x 2 does not divide 16
    assert "must be a multiple of schedule.micro_batch_size x dp = 2 x 3" in str(fit_or_reason(cfg, 3, refit, None))


def test_largest_fit_below_min_nodes_gives_the_reason():
    cfg, _ = _run(*ELASTIC, "mesh=dp2_pp2", "cluster.nodes=2", "cluster.elastic.min_nodes=2")
    assert largest_fit(cfg, 1, refit) == "1 node left, below cluster.elastic.min_nodes=2"


def test_vary_any_lets_the_planner_choose_the_layout_on_the_nodes_left():
    cfg, plan = _run(*ELASTIC, "mesh=pp2", "cluster.nodes=2", "cluster.elastic.vary=any")
    check_floor(cfg, plan, refit, None)  # vary=dp could not: 1 rank is less than one pp2 replica
    got = fit_or_reason(cfg, 1, refit, None)
    assert not isinstance(got, str)
    assert (got[1].world_size, got[1].pp, got[1].dp) == (1, 1, 1)


RULES = [
    (
        ("cluster.nodes=2",),
        "cluster.nodes=2 with cluster.launcher=local",
        "cluster.elastic.min_nodes=1 train.save_every=100",
    ),
    (("cluster.elastic.min_nodes=0",), "cluster.elastic.min_nodes=0 must be at least 1", "min_nodes=null"),
    (
        (*ELASTIC, "mesh=dp2_pp2", "cluster.nodes=2", "cluster.elastic.min_nodes=3"),
        "cluster.elastic.min_nodes=3 exceeds cluster.nodes=2",
        "try cluster.elastic.min_nodes=2",
    ),
    (
        ("model=tiny", "mesh=dp2_pp2", "cluster.nodes=2", "cluster.elastic.min_nodes=1"),
        "train.save_every=0 writes none before the end",
        "train.save_every=100",
    ),
    (
        (*ELASTIC, "mesh=pp2", "cluster.nodes=3"),
        "cluster.nodes=3 does not divide the mesh's 2 ranks",
        "try cluster.nodes=1",
    ),
    (
        (*ELASTIC, "mesh=pp2", "cluster.nodes=2"),
        "cluster.elastic.min_nodes=1: 1 node holds 1 rank (1 x cluster.gpus_per_node=1), fewer than one replica "
        "(mesh.tp x mesh.cp x mesh.pp = 2)",
        "try cluster.elastic.min_nodes=2 or cluster.elastic.vary=any",
    ),
    (
        (*ELASTIC, "mesh=dp4", "cluster.nodes=4", "cluster.elastic.min_nodes=3"),
        "cluster.elastic.min_nodes=3: on 3 nodes the layout is refused: schedule.global_batch_size=16 must be a "
        "multiple of schedule.micro_batch_size x dp = 2 x 3",
        "try cluster.elastic.min_nodes=4",
    ),
]


@pytest.mark.parametrize("overrides,message,fix", RULES, ids=[r[1][:40] for r in RULES])
def test_each_elastic_rule_names_field_value_and_fix(overrides, message, fix):
    assert_refused_in_one_line(overrides, message, fix)


def _layout(nodes: int, dp: int, micro_batches: int) -> dict:
    return {
        "nodes": nodes,
        "dp": dp,
        "pp": 2,
        "tp": 2,
        "cp": 1,
        "micro_batches": micro_batches,
        "mesh": f"dp{dp} x pp2 x tp2",
    }


def test_summary_names_the_mesh_as_the_lines_do():
    cfg, plan = _run(*ELASTIC, "mesh=dp2_pp2", "cluster.nodes=2")
    assert summary(2, plan) == {
        "nodes": 2,
        "dp": 2,
        "pp": 2,
        "tp": 1,
        "cp": 1,
        "micro_batches": 4,
        "mesh": "dp2 x pp2 x tp1",
    }


def test_the_lines_read_as_the_issue_wrote_them():
    one, two = _layout(1, 1, 8), _layout(2, 2, 4)
    assert loss_line(["n2"], 46, 40, one, alive=1) == (
        "p3d: elastic: node n2 lost at step 46; resumed step 40 on 1 node as dp1 x pp2 x tp2, 8 micro batches per "
        "replica"
    )
    assert loss_line(["n4"], 46, 40, two, alive=3).endswith("(on 2 of the 3 nodes left)")
    assert loss_line(["n2"], 2, None, one, alive=1) == (
        "p3d: elastic: node n2 lost at step 2; restarted from step 0 (no checkpoint yet) on 1 node as dp1 x pp2 x "
        "tp2, 8 micro batches per replica"
    )
    assert stop_line(["n2"], 46, "1 node left, below cluster.elastic.min_nodes=2", 40) == (
        "p3d: elastic: node n2 lost at step 46; 1 node left, below cluster.elastic.min_nodes=2: stopping; the newest "
        "checkpoint (step 40) is kept: resume with train.resume=auto when nodes return"
    )
    assert resize_line(2, 1, 60, two) == (
        "p3d: elastic: 2 nodes now (was 1); resumed step 60 on 2 nodes as dp2 x pp2 x tp2, 4 micro batches per replica"
    )
    change = {
        "kind": "shrink",
        "cause": "node n2 lost",
        "at_step": 46,
        "resumed_step": 40,
        "steps_redone": 5,
        "old": two,
        "new": one,
        "time_lost_s": 48.2,
    }
    assert record_text(change) == (
        "step 46: dp2 x pp2 x tp2 on 2 nodes -> dp1 x pp2 x tp2 on 1 node (node n2 lost), resumed from step 40, "
        "8 micro batches per replica, 48.2 s lost, 5 steps redone"
    )


def test_an_elastic_local_run_pins_its_node_size_in_the_spec():
    from tests.helpers.runs import typed

    cfg, plan = typed(*ELASTIC, "mesh=dp2_pp2", "cluster.nodes=2")
    assert (cfg.cluster.gpus_per_node, plan.procs_per_node, plan.world_size) == (2, 2, 4)  # cpu: 4 ranks / 2 nodes
    plain, _ = typed("model=tiny", "mesh=dp2_pp2")
    assert plain.cluster.gpus_per_node is None  # not elastic: the mesh decides the world, as before
