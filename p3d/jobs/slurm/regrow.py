"""A requeued elastic run over ``cluster.groups`` on Slurm grows back (docs/clusters.md, Elastic runs).

A shrunk groups job that is requeued (the time-limit signal, ``scontrol requeue``) gets all its nodes back: the job
keeps ``--nodes`` and its ``--constraint=[f0*n0&f1*n1]``. Which group a node belongs to is not known from a count, but
it is from its features: each group of the run's first spec (the groups the job was submitted with; the job's
constraint must still be theirs) gets back the job's live nodes of its feature, at most its count then
(p3d.jobs.slurm.groupjob.grown_groups). p3d.launch.requeue.resume_in_allocation re-fits the run to them
(p3d.jobs.elastic.refit: dp and the split re-planned) and records the grow (p3d.jobs.elastic.at_start).
"""

from __future__ import annotations

import re
from pathlib import Path

from p3d.config.errors import P3DConfigError
from p3d.config.schema import ClusterGroup, Config
from p3d.jobs.slurm.groupjob import grown_groups
from p3d.jobs.slurm.step import live_hosts, node_features, show_job

_FEATURES = re.compile(r"(?<![A-Za-z])Features=(\S+)")


def first_spec(run_dir: str | Path) -> Config:
    """The config of the run's first segment (p3d.rundir.spec), the groups the job was submitted with.
    P3DConfigError when it is gone."""
    from p3d.rundir.spec import first_segment_spec, read_spec

    first = first_segment_spec(run_dir)
    if not first.is_file():
        raise P3DConfigError(
            f"cluster.groups: the run's first spec {first} is gone, so the groups the job was submitted with are not "
            f"known; resume naming the groups (p3d-train train.resume=auto run.dir={run_dir} cluster.groups='[...]')"
        )
    return read_spec(first)[0]


def job_constraint(shown: str) -> str | None:
    """The job's ``--constraint`` in ``scontrol show job``'s text ``shown`` (``Features=[on_n2*1&on_n1*1]``); None
    when it has none."""
    found = _FEATURES.search(shown)
    return found.group(1) if found and found.group(1) != "(null)" else None


def groups_back(run_dir: str | Path) -> list[ClusterGroup]:
    """The groups this start of the job has: each of the first spec's groups on the job's live nodes of its feature."""
    first = first_spec(run_dir)
    shown = show_job()
    return grown_groups(first.cluster, node_features(live_hosts(shown=shown)), job_constraint(shown))
