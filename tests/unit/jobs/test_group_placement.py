"""cluster.groups on Slurm (issue 55): p3d-train outside an allocation submits a heterogeneous job whose components
are the groups (p3d.jobs.slurm.hetjob); only a run inside an ordinary allocation (a sweep job, salloc), where Slurm
chose the nodes, is warned that a group's ranks may sit on another group's nodes
(p3d.jobs.slurm.submit.group_placement_warning)."""

from __future__ import annotations

from p3d.jobs.slurm.submit import group_placement_warning
from tests.helpers.runs import compose_config


def test_a_groups_run_inside_an_ordinary_job_is_warned_that_placement_is_slurms(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.delenv("SLURM_HET_SIZE", raising=False)
    warning = group_placement_warning(compose_config("cluster=mixed_h100_a100", "cluster.launcher=slurm"))
    assert warning is not None and "\n" not in warning
    assert "1 x h100_sxm, 1 x a100_80gb" in warning and "ordinary Slurm job 17" in warning
    assert "hetjob" in warning and "docs/clusters.md" in warning


def test_inside_a_heterogeneous_job_the_components_are_the_groups_and_nothing_is_warned(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_HET_SIZE", "2")
    assert group_placement_warning(compose_config("cluster=mixed_h100_a100", "cluster.launcher=slurm")) is None


def test_a_homogeneous_cluster_is_not_warned():
    assert group_placement_warning(compose_config("cluster=h100_sxm", "cluster.launcher=slurm")) is None
