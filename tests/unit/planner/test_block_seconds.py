"""``plan.block_seconds`` (issue 64, item 8): the planner's model of the sleep-timed blocks of
``P3D_TEST_BLOCK_SECONDS`` (p3d.train.block_seconds) in every section of a plan, not only the heterogeneous split:
each block sleeps s in its forward, its input gradient and its weight gradient, and again in a full recompute's
forward; a cluster of groups stretches it by each group's slowdown. In-process."""

from __future__ import annotations

import pytest

from p3d.planner import predict
from p3d.planner.shapes import layout_of, stage_params
from p3d.planner.step_time import stage_times

SLEEP = 0.05
SAME = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1}]"


@pytest.mark.parametrize(("recompute", "pieces"), [("none", 3), ("full", 4)])
def test_each_block_adds_its_sleeps_without_groups(make_cfg, recompute, pieces):
    over = ("mesh=pp2", "model.n_layers=6", "schedule.global_batch_size=16", f"schedule.recompute={recompute}")
    bare, slept = make_cfg(*over), make_cfg(*over, f"plan.block_seconds={SLEEP}")
    lay = layout_of(bare)
    params = stage_params(bare, lay)
    for p, t0, t1 in zip(params, stage_times(bare, lay, params), stage_times(slept, lay, params)):
        assert t1.total - t0.total == pytest.approx(pieces * SLEEP * p.blocks)
        assert t1.forward_compute - t0.forward_compute == pytest.approx(SLEEP * p.blocks)
    # the step: (m + p - 1) micro batch times of the slowest stage (1F1B), each slept pieces x s x its blocks longer
    m, most = lay.micro_batches, max(p.blocks for p in params)
    grown = predict(slept).step_time_s - predict(bare).step_time_s
    assert grown == pytest.approx((m + 1) * pieces * SLEEP * most, rel=0.02)


def test_the_homogeneous_plan_and_the_split_time_the_same_sleeps(make_cfg):
    """On two equal groups the homogeneous plan and the heterogeneous section describe the same run: the same step
    (before, the first left the sleeps out: 0.04 s beside 3.3 s)."""
    report = predict(make_cfg(SAME, "mesh=dp2", "model.n_layers=4", f"plan.block_seconds={SLEEP}"))
    assert report.step_time_s > 3 * SLEEP * 4 * report.layout.micro_batches
    assert report.step_time_s == pytest.approx(report.hetero.uniform_step_s, rel=0.01)


def test_a_cluster_of_groups_sleeps_at_its_mean_device(make_cfg):
    """The homogeneous model of a cluster of groups runs at the groups' mean peak; its sleeps are the fastest group's
    stretched to that mean device (here a group at half the peak: mean 0.075 of 0.1, 4/3 of the fast group's)."""
    fast, slow = "{device: cpu, nodes: 1}", "{device: cpu, nodes: 1, peak_tflops: 0.05}"
    over = ("mesh=dp2", "model.n_layers=4", f"plan.block_seconds={SLEEP}")
    bare = make_cfg(f"cluster.groups=[{fast}, {slow}]", *over[:2])
    mixed = make_cfg(f"cluster.groups=[{fast}, {slow}]", *over)
    lay = layout_of(mixed)
    params = stage_params(mixed, lay)
    grown = stage_times(mixed, lay, params)[0].total - stage_times(bare, lay, params)[0].total
    assert grown == pytest.approx(3 * SLEEP * 4 * 0.1 / 0.075)
