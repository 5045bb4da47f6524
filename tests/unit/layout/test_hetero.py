"""Heterogeneous clusters (issue 55), the launcher's half: cluster.groups filled from the device presets, each node's
group and speed, the uneven layouts (schedule.stage_blocks, schedule.replica_micro_batches) cut and read as the single
process reads them, and every bad value refused in one line before any worker starts."""

from __future__ import annotations

import pytest
import torch

from p3d.config.devices import DEVICES
from p3d.config.schema import Partition
from p3d.data.loader import rank_slice
from p3d.data.order import replica_rows
from p3d.layout.geometry import layer_names, stage_bounds
from p3d.layout.hetero import group_of_node, slowdown
from p3d.layout.schedule_rules import runs_on_deepspeed
from tests.helpers.runs import assert_refused_in_one_line, compose_config, typed

MIXED = "cluster.groups=[{device: h100_sxm, nodes: 1}, {device: a100_80gb, nodes: 2}]"
CPU2 = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"


def test_groups_fill_the_cluster_from_their_presets():
    c = compose_config(MIXED).cluster
    assert c.nodes == 3 and str(c.device) == "h100_sxm" and c.gpus_per_node == 8
    assert [(g.device, g.nodes, g.peak_tflops, g.memory_gb) for g in c.groups] == [
        ("h100_sxm", 1, 989.0, 80.0),
        ("a100_80gb", 2, 312.0, 80.0),
    ]
    assert c.peak_tflops == pytest.approx((989 + 2 * 312) / 3)  # MFU's peak: per GPU, over the groups' GPUs
    assert (c.intra_node_gbps, c.inter_node_gbps) == (300.0, 25.0)  # the slower links (A100's)
    assert [group_of_node(c, n) for n in range(3)] == [0, 1, 1]
    # a group k times slower sleeps k times as long (the fastest group: 1): nominal peak x matmul efficiency
    h100, a100 = DEVICES["h100_sxm"].matmul_efficiency, DEVICES["a100_80gb"].matmul_efficiency
    assert slowdown(c, 0) == 1.0 and slowdown(c, 2) == pytest.approx(989 * h100 / (312 * a100))


def test_the_preset_is_one_node_of_h100_and_one_of_a100():
    c = compose_config("cluster=mixed_h100_a100").cluster
    assert [(g.device, g.nodes) for g in c.groups] == [("h100_sxm", 1), ("a100_80gb", 1)]
    assert c.nodes == 2 and c.launcher.value == "slurm"


def test_simulated_groups_on_the_local_launcher():
    """Two simulated cpu nodes, the second twice as slow; the ranks fill the nodes in order."""
    cfg, plan = typed("mesh=dp2_pp2", CPU2)
    assert plan.procs_per_node == 2 and [plan.dims.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [slowdown(cfg.cluster, n) for n in range(2)] == [1.0, 2.0]


@pytest.mark.parametrize(
    "overrides,message,fix",
    [
        (("cluster.groups=[{nodes: 1}]",), "cluster.groups[0].device is not set", "device: h100_sxm"),
        (("cluster.groups=[{device: cpu}, {device: v100}]",), "cluster.groups[1].device=v100 is not a device", "cpu"),
        (("cluster.groups=[{device: cpu, nodes: 0}]",), "cluster.groups[0].nodes=0 must be at least 1", "nodes=1"),
        (("cluster.groups=[{device: cpu, peak_tflops: -1}]",), "peak_tflops=-1.0 must be positive", "=null"),
        (("cluster.groups=[{device: cpu}, {device: h100_sxm}]",), "different GPUs per node", "cluster.gpus_per_node"),
        (("mesh=dp2", "cluster.groups=[{device: cpu, nodes: 3}]"), "do not fill the 3 nodes", "multiple of 3"),
    ],
    ids=["no-device", "unknown-device", "no-nodes", "negative-peak", "mixed-node-size", "ranks-per-node"],
)
def test_bad_groups_are_refused_in_one_line(overrides, message, fix):
    assert_refused_in_one_line(overrides, message, fix)


@pytest.mark.parametrize(
    "overrides,message,fix",
    [
        (("mesh=dp2", "schedule.replica_micro_batches=[3]"), "names 1 replica, mesh.dp=2", "=[4,4]"),
        (("mesh=dp2", "schedule.replica_micro_batches=[3,4]"), "= 14 sequences, not", "=[4,4]"),
        (("mesh=dp2", "schedule.replica_micro_batches=[0,8]"), "at least one micro batch", "=[4,4]"),
        (("mesh=dp2_pp2", "schedule.replica_micro_batches=[1,7]"), "a replica 1 micro batches", "at least 2"),
        (
            ("mesh=dp2_pp2", "schedule.pipeline=interleaved_1f1b", "schedule.replica_micro_batches=[3,5]"),
            "rounds of max(1, m // mesh.pp)",
            "a multiple of mesh.pp",
        ),
        (("mesh=pp2", "schedule.stage_blocks=[3,2]"), "holds 5 blocks, model.n_layers=4", "=[2,2]"),
        (("mesh=pp2", "schedule.stage_blocks=[4]"), "names 1 pipeline pieces, mesh.pp = 2", "=[2,2]"),
        (
            ("mesh=pp2", "schedule.pipeline=interleaved_1f1b", "schedule.stage_blocks=[3,1]"),
            "mesh.pp x 2 chunks per rank = 4",
            "=[1,1,1,1]",
        ),
        (("mesh=pp4", "schedule.stage_blocks=[2,0,1,1]"), "every piece but the first and the last", "=[1,1,1,1]"),
    ],
    ids=["replicas", "sum", "empty", "fewer-than-pp", "interleaved-rounds", "blocks", "pieces", "chunks", "mid"],
)
def test_bad_uneven_layouts_are_refused_in_one_line(overrides, message, fix):
    assert_refused_in_one_line(overrides, message, fix)


def test_uneven_micro_batches_with_expert_parallelism_are_refused():
    assert_refused_in_one_line(
        ("model=moe_tiny", "mesh=dp2", "mesh.ep=2", "schedule.replica_micro_batches=[3,5]"),
        "with mesh.ep=2: the ranks of an expert group exchange tokens",
        "mesh.ep=1",
    )


def test_uneven_micro_batches_with_zero3_are_refused():
    """ZeRO-3 all-gathers each chunk's parameters over dp in every forward: replicas with 3 and 5 micro batches
    would pair unlike collectives (measured before this rule: step 1's loss off by 2e-4 on gloo)."""
    assert_refused_in_one_line(
        ("mesh=dp2", "zero=stage3", "schedule.replica_micro_batches=[3,5]"),
        "with zero.stage=3: FSDP2 gathers the parameters over dp in every micro batch's forward",
        "zero.stage=2",
    )


def test_uneven_micro_batches_run_on_the_torch_executor():
    """DeepSpeed's engine averages over dp with one accumulation count: uneven replicas go to torch's 1F1B; uneven
    stages alone stay on DeepSpeed's engine, which takes the plan's bounds."""
    cfg, plan = typed("mesh=dp2_pp2", "schedule.replica_micro_batches=[3,5]", "schedule.stage_blocks=[3,1]")
    assert not runs_on_deepspeed(cfg)
    assert plan.replica_micro_batches == [3, 5] and plan.micro_batches == 5 and plan.mean_micro_batches == 4.0
    assert [plan.micro_batches_of(d) for d in (0, 1)] == [3, 5]
    assert plan.stage_bounds == [0, 4, 7]  # embed + 3 blocks | 1 block + final_norm + head
    cfg, plan = typed("mesh=pp2", "schedule.stage_blocks=[3,1]")
    assert runs_on_deepspeed(cfg) and plan.stage_bounds == [0, 4, 7] and plan.replica_micro_batches == [8]
    cfg, _ = typed("mesh=dp2", "schedule.replica_micro_batches=[4,4]")
    assert runs_on_deepspeed(cfg)  # an even split written out is the even split


def test_stage_blocks_cut_the_layer_list():
    names = layer_names(4)
    bounds = stage_bounds(4, 2, Partition.cost, None, v=2, blocks=[2, 1, 0, 1])
    assert [names[a:b] for a, b in zip(bounds, bounds[1:])] == [
        ["embed", "block0", "block1"],
        ["block2"],
        [],
        ["block3", "final_norm", "head"],
    ]
    with pytest.raises(ValueError):
        stage_bounds(4, 2, Partition.cost, None, blocks=[3, 2])


def test_uneven_replicas_read_the_global_batch_in_order():
    """Replica d reads its own micro batches after the rows of the replicas before it: the replicas' rows, in order,
    are the global batch the single process reads, whatever the split."""
    batch = torch.arange(16 * 3).view(16, 3)  # 16 sequences of 2 + 1 tokens
    for split in ([3, 5], [1, 2, 5], [8]):
        dp = len(split)
        rows = [replica_rows(16, 2, dp, d, split) for d in range(dp)]
        assert rows[0][0] == 0 and sum(n for _, n in rows) == 16
        assert all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))
        per_replica = [list(rank_slice(batch, 2, dp, d, split)) for d in range(dp)]
        assert [len(micro) for micro in per_replica] == split
        got = [torch.cat([x, y[:, -1:]], 1) for micro in per_replica for x, y in micro]  # inputs + the last label
        assert torch.equal(torch.cat(got), batch)
    assert replica_rows(16, 2, 2, 1) == (8, 8)  # no split: the d-th slice of B / dp


def test_a_group_twice_as_slow_sleeps_twice_as_long_per_block(monkeypatch):
    """P3D_TEST_BLOCK_SECONDS on a simulated mixed cluster: the local launcher's nodes are the groups in order (ranks
    block by block: dp2_pp2 puts stage 0's two ranks on node 0, stage 1's on node 1), and a rank on a group of half
    the peak sleeps twice the seconds in each piece of each block; unset, nothing sleeps."""
    from p3d.train.block_seconds import BLOCK_SECONDS_ENV, rank_block_seconds

    cfg, plan = typed(CPU2, "mesh=dp2_pp2")
    assert [plan.dims.coords_of(r)[1] for r in range(4)] == [0, 0, 1, 1]  # (dp, pp, tp): pp rank by node
    monkeypatch.setenv(BLOCK_SECONDS_ENV, "0.01")
    assert [rank_block_seconds(cfg.cluster, plan, r) for r in range(4)] == pytest.approx([0.01, 0.01, 0.02, 0.02])
    cfg, plan = typed("mesh=dp2_pp2")  # one group: every rank the same
    assert [rank_block_seconds(cfg.cluster, plan, r) for r in range(4)] == pytest.approx([0.01] * 4)
    monkeypatch.delenv(BLOCK_SECONDS_ENV)
    assert rank_block_seconds(cfg.cluster, plan, 3) == 0.0
