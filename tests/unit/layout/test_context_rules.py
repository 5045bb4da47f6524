"""The rules of context parallelism (mesh.cp): each refuses before any worker starts, in one line with a fix, and
what it allows is what the workers can run."""

from __future__ import annotations

import pytest

from p3d.layout.dims import ParallelDims
from tests.helpers.runs import assert_fixes_accepted, assert_refused_in_one_line, typed

RULES = [
    (("model=tiny", "mesh.cp=3"), "model.seq_len=64 must be a multiple of 6 with mesh.cp=3", "try model.seq_len=60"),
    (
        ("model=tiny", "mesh=tp4", "mesh.cp=2", "schedule.sequence_parallel=true", "model.seq_len=36"),
        "model.seq_len=36 must be a multiple of 8 with mesh.cp=2",
        "try model.seq_len=32",
    ),
    (("model=tiny", "mesh=single", "mesh.cp=0"), "mesh.cp=0 must be at least 1", "try mesh.cp=1"),
    (
        ("model=tiny", "mesh=dp2", "mesh.cp=2", "zero=stage3", "zero.shard_size=3"),
        "zero.shard_size=3 must divide the dp x cp degree 4",
        "try zero.shard_size=2",
    ),
    (
        ("model=llama3_8b", "cluster.device=h100_sxm", "mesh.tp=8", "mesh.pp=1", "mesh.cp=2", "mesh.dp=1"),
        "mesh.tp*mesh.cp*mesh.pp*mesh.dp=8*2*1*1=16 must equal the world size 8",
        "try mesh.cp=1, or mesh.tp=4",
    ),
]


@pytest.mark.parametrize("overrides,message,fix", RULES, ids=[r[1][:40] for r in RULES])
def test_each_cp_rule_names_field_value_and_fix(overrides, message, fix):
    assert_refused_in_one_line(overrides, message, fix)


@pytest.mark.parametrize("overrides", [r[0] for r in RULES], ids=[r[1][:40] for r in RULES])
def test_every_suggested_cp_fix_is_accepted_by_the_same_command(overrides):
    assert_fixes_accepted(overrides)


def test_dp_auto_divides_the_cluster_by_tp_cp_pp():
    _, plan = typed(
        "model=llama3_8b",
        "cluster=slurm",
        "cluster.device=h100_sxm",
        "cluster.nodes=4",
        "mesh.tp=8",
        "mesh.pp=1",
        "mesh.cp=2",
    )
    assert (plan.dp, plan.cp, plan.world_size) == (2, 2, 32)


def test_cp_runs_on_the_torch_executor_and_reduces_over_dp_x_cp():
    from p3d.layout.schedule_rules import runs_on_deepspeed

    cfg, _ = typed("model=tiny", "mesh=dp2", "mesh.cp=2")
    assert not runs_on_deepspeed(cfg)  # DeepSpeed's topology has no cp axis
    dims = ParallelDims(tp=2, pp=2, dp=2, cp=2)
    # rank = ((pp dp_size + dp) cp_size + cp) tp_size + tp: a cp group is tp apart, a dp x cp group spans tp cp dp
    assert dims.cp_ranks()[0] == [0, 2]
    assert dims.dp_cp_ranks()[0] == [0, 2, 4, 6]
    assert dims.dp_ranks()[0] == [0, 4]
    assert dims.tp_ranks()[0] == [0, 1]
    assert dims.pp_ranks()[0] == [0, 8]
    assert dims.replica_ranks()[0] == [0, 1, 8, 9]
    for r in range(dims.world_size):
        dp, pp, tp = dims.coords_of(r)
        assert dims.rank_of(dp, pp, tp, dims.cp_of(r)) == r
    groups = [dims.cp_ranks(), dims.dp_cp_ranks(), dims.replica_ranks()]
    for lists in groups:  # each list of groups covers every rank once
        assert sorted(r for g in lists for r in g) == list(range(dims.world_size))


def test_seq_len_rule_allows_what_the_chunks_need():
    from p3d.parallel.context.chunks import local_positions

    cfg, plan = typed("model=tiny", "mesh=tp2", "mesh.cp=4", "schedule.sequence_parallel=true")
    seen = sorted(int(p) for r in range(plan.cp) for p in local_positions(cfg.model.seq_len, plan.cp, r))
    assert seen == list(range(cfg.model.seq_len))  # the cp ranks hold every token once
    assert local_positions(64, 4, 1).tolist()[:8] == list(range(8, 16))  # rank 1: chunk 1 then chunk 6
    assert local_positions(64, 4, 1).tolist()[8:] == list(range(48, 56))


def test_cp_with_compile_is_allowed():
    """Issue 52: the cp attention runs on fused kernels that torch.compile takes, so model.compile=true with cp is
    no longer refused (its parity: tests/e2e/test_cp_parity.py, case cp2-compile)."""
    cfg, plan = typed("model=tiny", "mesh=single", "mesh.cp=2", "model.compile=true")
    assert cfg.model.compile and plan.cp == 2


@pytest.mark.parametrize("extra", [(), ("model.moe.capacity_factor=1.0",)], ids=["dropless", "capacity"])
def test_cp_with_experts_is_allowed(extra):
    """Issue 62: a mixture of experts trains with cp, its balancing loss, capacity and routing figures over the
    whole sequence (its parity: tests/e2e/test_moe_parity.py, the cp cases)."""
    cfg, plan = typed("model=moe_tiny", "mesh=dp2", "mesh.ep=2", "mesh.cp=2", *extra)
    assert (plan.dp, plan.ep, plan.cp, plan.world_size) == (2, 2, 2, 4)


def test_the_holders_of_an_expert_are_its_dp_ranks_times_cp():
    """With cp, an ep group is ep dp ranks of one cp coordinate (they exchange the tokens of the same chunks) and an
    expert's holders (edp: gradients, ZeRO) are the dp ranks with its ep rank at every cp coordinate."""
    dims = ParallelDims(tp=2, pp=1, dp=4, ep=2, cp=2)  # rank = (dp cp_size + cp) tp_size + tp
    assert dims.ep_ranks()[0] == [0, 4]  # dp 0 and 1 at cp 0, tp 0
    assert dims.edp_ranks()[0] == [0, 2, 8, 10]  # ep rank 0: dp 0 and 2, each at cp 0 and 1, tp 0
    for lists in (dims.ep_ranks(), dims.edp_ranks()):
        assert sorted(r for g in lists for r in g) == list(range(dims.world_size))
    for group in dims.ep_ranks():
        assert len({dims.cp_of(r) for r in group}) == 1 and len(group) == dims.ep
    for group in dims.edp_ranks():
        assert len({dims.ep_rank_of(dims.coords_of(r)[0]) for r in group}) == 1
        assert len(group) == dims.dp // dims.ep * dims.cp
