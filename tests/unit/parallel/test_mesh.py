"""Rank arithmetic (ParallelDims, Mesh), no processes: tp fastest, then dp, then pp (DeepSpeed's axes)."""

from __future__ import annotations

import itertools

import pytest

from p3d.config.errors import P3DConfigError
from p3d.layout.dims import ParallelDims, resolve_dp
from p3d.parallel.mesh import Mesh


def test_dp2_pp2_tp2_coordinates():
    mesh = Mesh(tp=2, pp=2, dp=2)
    # rank = (pp * dp_size + dp) * tp_size + tp
    expected = {
        0: (0, 0, 0),
        1: (0, 0, 1),
        2: (1, 0, 0),
        3: (1, 0, 1),
        4: (0, 1, 0),
        5: (0, 1, 1),
        6: (1, 1, 0),
        7: (1, 1, 1),
    }
    assert {r: mesh.dims.coords_of(r) for r in range(8)} == expected
    assert {r: Mesh(tp=2, pp=2, dp=2, rank=r).coords for r in range(8)} == expected
    assert mesh.dims.tp_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # adjacent: one node, fastest links
    assert mesh.dims.pp_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.dims.dp_ranks() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.dims.replica_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 2), (8, 8, 2), (4, 2, 3)])
def test_rank_arithmetic_is_a_bijection(tp, pp, dp):
    mesh = ParallelDims(tp=tp, pp=pp, dp=dp)
    seen = set()
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        r = mesh.rank_of(d, p, t)
        assert r == (p * dp + d) * tp + t
        assert mesh.coords_of(r) == (d, p, t)
        seen.add(r)
    assert seen == set(range(tp * pp * dp))
    for groups, axis in ((mesh.tp_ranks(), 2), (mesh.pp_ranks(), 1), (mesh.dp_ranks(), 0)):
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
        for g in groups:  # a group varies along its own axis only
            coords = [mesh.coords_of(r) for r in g]
            for other in {0, 1, 2} - {axis}:
                assert len({c[other] for c in coords}) == 1


def test_stage_flags_and_nodes():
    mesh = Mesh(tp=8, pp=8, dp=2, rank=0, procs_per_node=8)
    dims = mesh.dims
    last = Mesh(tp=8, pp=8, dp=2, rank=dims.rank_of(1, 7, 3), procs_per_node=8)
    assert mesh.is_first_stage and not mesh.is_last_stage
    assert last.is_last_stage and last.coords == (1, 7, 3) and last.tp_rank == 3
    # a TP group of 8 fills exactly one node of 8
    for group in dims.tp_ranks():
        assert len({dims.node_of(r) for r in group}) == 1
    assert dims.node_of(17) == 2 and dims.local_rank_of(17) == 1


def test_logging_rank_is_last_stage_dp0_tp0():
    from tests.helpers.runs import typed

    for name in ("dp2_pp2_tp2", "pp4", "tp2", "single"):
        _, plan = typed(f"mesh={name}")
        mesh = Mesh.from_plan(plan, plan.logging_rank)
        assert mesh.coords == (0, plan.pp - 1, 0)
        assert plan.logging_rank == plan.dims.logging_rank


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        Mesh(tp=0, pp=1, dp=1)
    with pytest.raises(ValueError, match="rank=8"):
        Mesh(tp=2, pp=2, dp=2, rank=8)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2), (2, 1, 3), (4, 2, 3), (1, 4, 2), (8, 8, 2)])
def test_parallel_dims_match_deepspeed_topology(tp, pp, dp):
    """DeepSpeed's PipelineModule is handed its own topology; ours must number ranks and groups alike."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for r in range(dims.world_size):
        c = topo.get_coord(r)
        assert dims.coords_of(r) == (c.data, c.pipe, c.model)
    for ours, axis in ((dims.tp_ranks(), "model"), (dims.pp_ranks(), "pipe"), (dims.dp_ranks(), "data")):
        assert ours == (topo.get_axis_comm_lists(axis) or [[r] for r in range(dims.world_size)]), axis


def test_dp_auto_is_resolved_once_for_validation_and_planner():
    from p3d.planner.shapes import layout_of
    from tests.helpers.runs import typed

    assert resolve_dp(2, 2, "auto", nodes=4, gpus_per_node=8) == 8
    assert resolve_dp(2, 2, "auto", nodes=4, gpus_per_node=None) == 1  # cpu workers: the mesh decides
    assert resolve_dp(2, 2, 3, nodes=4, gpus_per_node=8) == 3  # explicit: as given
    with pytest.raises(P3DConfigError, match=r"^mesh.tp\*mesh.pp=12 must divide the world size 16 .*cluster.nodes=3"):
        resolve_dp(4, 3, "auto", nodes=2, gpus_per_node=8)
    with pytest.raises(P3DConfigError, match=r"^mesh.dp=0 must be a positive integer or auto; try mesh.dp=auto$"):
        resolve_dp(2, 2, 0, nodes=1, gpus_per_node=None)
    cfg, plan = typed("mesh=tp2_pp2", "cluster=slurm", "cluster.gpus_per_node=4", "cluster.nodes=2")
    assert plan.dp == layout_of(cfg).dp == 2 and plan.world_size == 8


@pytest.mark.parametrize("tp,pp,dp,s,per_node", [(1, 1, 4, 2, 2), (2, 2, 4, 2, 4), (2, 1, 8, 4, 8), (8, 2, 4, 1, 8)])
def test_hsdp_shard_groups_sit_inside_a_node_when_their_ranks_divide_it(tp, pp, dp, s, per_node):
    """zero.shard_size=s: each shard group is s dp ranks of one (pp, tp), s x tp consecutive ranks with tp fastest,
    so Slurm's block placement (per_node consecutive ranks a node) keeps it on one node when s x tp divides
    per_node; its replica groups hold one rank of every shard group and so cross the nodes."""
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, procs_per_node=per_node)
    shards, replicas = dims.shard_ranks(s), dims.shard_replica_ranks(s)
    assert (
        sorted(r for g in shards for r in g) == sorted(r for g in replicas for r in g) == list(range(dims.world_size))
    )
    assert all(len(g) == s for g in shards) and all(len(g) == dp // s for g in replicas)
    for g in shards:
        assert {dims.coords_of(r)[1:] for r in g} == {dims.coords_of(g[0])[1:]}  # one (pp, tp): dp ranks only
        assert len({dims.node_of(r) for r in g}) == 1, g
    for g in replicas:  # one rank of each shard group of its dp group
        assert all(sum(r in shard for r in g) <= 1 for shard in shards)


def test_hsdp_shard_groups_cross_nodes_when_their_ranks_do_not_divide_one():
    dims = ParallelDims(tp=1, pp=1, dp=6, procs_per_node=4)
    assert dims.shard_ranks(3) == [[0, 1, 2], [3, 4, 5]]
    assert [len({dims.node_of(r) for r in g}) for g in dims.shard_ranks(3)] == [1, 2]
