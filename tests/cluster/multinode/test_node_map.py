"""In-process: where a multi-node run puts its ranks, as the dry run prints it (no cluster needed)."""

from __future__ import annotations

from p3d.launch.dryrun import dry_run
from tests.helpers.runs import typed


def test_cpu_run_on_two_slurm_nodes_spreads_its_ranks_evenly_in_the_dry_run_map():
    cfg, plan = typed("cluster=slurm", "cluster.nodes=2", "mesh=dp2_pp2_tp2", "model=tiny", "dry_run=true")
    assert plan.procs_per_node == 4
    report = dry_run(cfg, plan)
    assert [(rank, node, local) for rank, *_, node, local in report.mesh_map] == [(r, r // 4, r % 4) for r in range(8)]
    assert report.node_names == []  # outside an allocation: node indices only
    assert "  rank     5: dp   0 pp   1 tp  1 -> node   1 device 1" in report.render()


def test_one_node_cpu_run_keeps_every_rank_on_node_0():
    cfg, plan = typed("mesh=dp2_pp2_tp2", "model=tiny", "dry_run=true")
    assert plan.procs_per_node == 8
    assert {node for *_, node, _ in dry_run(cfg, plan).mesh_map} == {0}
