"""An elastic run over cluster.groups (issue 55): three simulated nodes of one worker, two of the cpu preset and one
twice as slow, run dp3 with 3 + 3 + 2 micro batches (the planner's split for them). Node 0's worker is killed as step 5
starts (``P3D_TEST_KILL_AT=node0:5:once``: not again in the resumed run, whose node 0 is another): node 0 was the first
group's, so the nodes left are one of each group (not two fast ones, as "the last node goes" would have it), and the
run continues from the step-3 checkpoint as dp2 with the split planned again for them, 5 + 3, the global batch kept.
Every step of the 8 follows the single-process curve within 1e-5 (loss and grad norm), as test_elastic_local's runs
do. ``train.decay=constant`` after a 2-step warmup."""

from __future__ import annotations

import pytest

from p3d.rundir.spec import read_spec
from p3d.train.metrics import read_metrics
from tests.helpers.runs import assert_follows_curve, output_tail, p3d_train, single_process_curve

RTOL = 1e-5
COMMON = ("train.warmup_steps=2", "train.decay=constant")
GROUPS = "cluster.groups=[{device: cpu, nodes: 2}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"


@pytest.mark.timeout(240)
def test_a_groups_run_that_loses_a_node_continues_on_the_split_planned_for_the_groups_left(tmp_path):
    proc = p3d_train(
        f"run.dir={tmp_path}",
        "train.steps=8",
        *COMMON,
        "mesh=dp2",
        "mesh.dp=3",
        GROUPS,
        "schedule.replica_micro_batches=[3,3,2]",
        "cluster.elastic.min_nodes=1",
        "train.save_every=3",
        "logger.progress=lines",
        env={"P3D_TEST_KILL_AT": "node0:5:once"},
        timeout=200,
    )
    assert proc.returncode == 0, output_tail(proc)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("p3d: elastic:")]
    assert lines == [
        "p3d: elastic: node 0 lost at step 5; resumed step 3 on 2 nodes as dp2 x pp1 x tp1, 5 + 3 micro batches per "
        "replica; node 0 was group 0's (2 x cpu); groups left 1 x cpu + 1 x cpu, split re-planned: "
        "schedule.replica_micro_batches=[5, 3] (was schedule.replica_micro_batches=[3, 3, 2])"
    ], output_tail(proc)
    cfg, plan = read_spec(tmp_path)
    assert [(g.nodes, g.peak_tflops) for g in cfg.cluster.groups] == [(1, 0.1), (1, 0.05)]
    assert (plan.world_size, plan.dp, plan.replica_micro_batches, cfg.schedule.global_batch_size) == (2, 2, [5, 3], 16)

    records = read_metrics(tmp_path)
    assert_follows_curve(records, single_process_curve("train.steps=8", *COMMON), RTOL)
    changes = [r["layout_change"] for r in records if "layout_change" in r]
    assert [
        (c["lost_groups"], c["old"]["replica_micro_batches"], c["new"]["replica_micro_batches"]) for c in changes
    ] == [([0], [3, 3, 2], [5, 3])]
