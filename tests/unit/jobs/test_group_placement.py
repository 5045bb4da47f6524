"""cluster.groups on Slurm (issue 55): until p3d submits a heterogeneous job, the user is told at submission that
Slurm chooses which nodes hold which group's ranks (p3d.jobs.slurm.submit.group_placement_warning)."""

from __future__ import annotations

from p3d.jobs.slurm.submit import group_placement_warning
from tests.helpers.runs import compose_config


def test_a_slurm_run_over_groups_is_warned_that_placement_is_slurms():
    cfg = compose_config("cluster=mixed_h100_a100", "cluster.launcher=slurm")
    warning = group_placement_warning(cfg)
    assert warning is not None and "\n" not in warning
    assert "1 x h100_sxm, 1 x a100_80gb" in warning and "hetjob" in warning and "docs/clusters.md" in warning


def test_a_homogeneous_cluster_is_not_warned():
    assert group_placement_warning(compose_config("cluster=h100_sxm", "cluster.launcher=slurm")) is None
