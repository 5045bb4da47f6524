"""The heterogeneous planner (issue 55, p3d.planner.hetero): stages and replicas placed on the groups, blocks cut
in proportion to each group's speed and within its memory, micro batches shared so that the global batch stays,
the uniform split always a candidate, the ideal the sum of the groups' throughputs. In-process."""

from __future__ import annotations

import dataclasses

import pytest

from p3d.planner import predict
from p3d.planner.hetero import Costs, pair_groups, plan_layout
from p3d.planner.search import resolve_auto
from p3d.planner.shapes import layout_of
from tests.helpers.runs import compose_config

CPU2 = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"  # node 1: 2x slower
SAME = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1}]"
SLEEPS = ("plan.block_seconds=0.01", "schedule.micro_batch_size=2")


def planned(*overrides: str):
    cfg = compose_config(*overrides)
    return cfg, plan_layout(cfg, layout_of(cfg))


def test_a_stage_on_a_group_twice_as_slow_gets_half_the_blocks():
    cfg, p = planned(CPU2, "mesh=pp2", "model.n_layers=6", "schedule.global_batch_size=16", *SLEEPS)
    assert p.stage_groups == [[0, 1]]  # stage 0's rank on node 0 (fast), stage 1's on node 1
    assert p.stage_blocks == [4, 2] and p.replica_micro_batches == [8]
    # 3 sleeps of 10 ms per block and micro batch, 20 ms on the slow node; sum of the stages + 7 x the slowest:
    # uniform 3 + 3 blocks: 0.09 + 0.18 + 7 x 0.18 = 1.53 s; 4 + 2: 0.12 + 0.12 + 7 x 0.12 = 1.08 s (+ the model's own)
    assert p.uniform_step_s / p.step_s == pytest.approx(1.53 / 1.08, rel=0.05)
    assert p.uniform_step_s > 1.3 * p.step_s and abs(p.gap) < 0.02  # the plan reaches the groups' summed throughput


def test_a_replica_on_a_group_twice_as_slow_gets_half_the_micro_batches():
    cfg, p = planned(CPU2, "mesh=dp2", "model.n_layers=4", "schedule.global_batch_size=24", *SLEEPS)
    assert p.stage_groups == [[0], [1]]
    assert p.replica_micro_batches == [8, 4] and sum(p.replica_micro_batches) * 2 == 24  # the global batch kept
    assert p.uniform_step_s / p.step_s == pytest.approx(1.5, rel=0.05)


def test_the_uniform_split_is_kept_where_nothing_is_faster():
    cfg, p = planned(SAME, "mesh=dp2_pp2", "model.n_layers=6", "schedule.global_batch_size=16", *SLEEPS)
    assert p.stage_blocks == [3, 3] and p.replica_micro_batches == [4, 4]
    assert p.step_s == p.uniform_step_s == pytest.approx(p.ideal_step_s)


def test_the_blocks_stay_within_the_fast_groups_memory():
    """The fast group's memory set between what 3 and what 4 of the stage's blocks need: it gets 3, not 4."""
    over = ("mesh=pp2", "model.n_layers=6", "schedule.global_batch_size=16", *SLEEPS)
    cfg = compose_config(CPU2, *over)
    costs = Costs(cfg, layout_of(cfg))
    three, four = (costs.stages(blocks, 0, 8)[2][0] for blocks in ((3, 3), (4, 2)))
    cap = (three + four) / 2 / 1e9
    small = (
        f"cluster.groups=[{{device: cpu, nodes: 1, memory_gb: {cap}}}, {{device: cpu, nodes: 1, peak_tflops: 0.05}}]"
    )
    cfg, p = planned(small, *over)
    assert p.stage_blocks == [3, 3] and p.fits


def test_mixed_h100_a100_llama3_8b_is_planned_with_each_groups_memory_and_the_gap():
    """What ``p3d-plan cluster=mixed_h100_a100 model=llama3_8b mesh=auto`` prints: the plan, each group's memory
    and the gap to the ideal; the H100 stage holds more blocks than the A100 one, and the plan beats the uniform."""
    cfg = compose_config("cluster=mixed_h100_a100", "model=llama3_8b", "mesh=auto")
    report = predict(cfg)
    p = report.hetero
    assert p is not None and p.fits and p.step_s <= p.uniform_step_s
    groups = [g for row in p.stage_groups for g in row]
    assert set(groups) == {0, 1}
    if len(set(p.stage_blocks)) > 1:  # stages across the groups: the H100 stages take more blocks
        fast = [b for b, g in zip(p.stage_blocks, p.stage_groups[0]) if g == 0]
        slow = [b for b, g in zip(p.stage_blocks, p.stage_groups[0]) if g == 1]
        assert min(fast) > max(slow)
    text = report.render()
    assert "0: 1 x h100_sxm" in text and "1: 1 x a100_80gb" in text and "gap to the ideal" in text
    assert report.to_json()["heterogeneous"]["gap_to_ideal"] == pytest.approx(p.gap)
    # p3d-train's mesh=auto runs the same split
    run = resolve_auto(cfg)
    assert (run.mesh.tp, run.mesh.pp, run.mesh.dp) == (p.layout.tp, p.layout.pp, p.layout.dp)
    assert run.schedule.stage_blocks == (p.stage_blocks if len(set(p.stage_blocks)) > 1 else [])


def test_pairs_take_the_slowest_group_of_their_ranks():
    cfg = compose_config(CPU2, "mesh=tp2", "cluster.gpus_per_node=1")
    assert pair_groups(cfg, dataclasses.replace(layout_of(cfg))) == [[1]]  # tp spans both nodes: the slow one paces


def test_the_ranking_of_a_cluster_of_groups_names_the_groups():
    """Issue 64, item 9: the mesh=auto table of a mixed cluster and the plan's header name its groups, not the first
    group's device for all its GPUs."""
    text = predict(compose_config("cluster=mixed_h100_a100", "model=llama3_8b", "mesh=auto")).render()
    heading = next(line for line in text.splitlines() if line.startswith("mesh=auto:"))
    header = next(line for line in text.splitlines() if line.startswith("p3d-plan:"))
    for line in (heading, header):
        assert "1 x h100_sxm + 1 x a100_80gb" in line and "16 x h100_sxm" not in line, line
