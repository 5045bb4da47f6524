"""cluster.groups on Slurm (issue 55): one heterogeneous job, a component per group (p3d.jobs.slurm.hetjob). The sbatch
line, the per-group partition and feature check against ``sinfo``, and sbatch's refusal named by its group fields.
In-process; the real hetjob runs in tests/cluster/multinode/test_hetjob.py."""

from __future__ import annotations

import dataclasses

import pytest

from p3d.jobs.slurm.hetjob import components, refusal_fields
from p3d.jobs.slurm.submit import Partition, component_partition, job_shape, sbatch_args
from p3d.layout.run_plan import P3DConfigError
from tests.helpers.runs import typed

RUN_DIR = "/shared/runs/r1"
CPU_GROUPS = "cluster.groups=[{device: cpu, nodes: 1, constraint: on_n2}, {device: cpu, nodes: 1, constraint: on_n1}]"


def args_of(*overrides: str) -> list[str]:
    cfg, plan = typed(*overrides)
    return sbatch_args(cfg, job_shape(cfg, plan), RUN_DIR)


def split(args: list[str]) -> list[list[str]]:
    """sbatch's options, one list per component (':' between them)."""
    parts: list[list[str]] = [[]]
    for a in args:
        if a == ":":
            parts.append([])
        else:
            parts[-1].append(a)
    return parts


def test_mixed_h100_a100_is_one_component_per_group_with_the_job_wide_options_on_the_first():
    args = args_of(
        "cluster=mixed_h100_a100",
        "model=llama3_8b",
        "mesh=auto",
        "cluster.groups=[{device: h100_sxm, nodes: 1, constraint: h100}, "
        "{device: a100_80gb, nodes: 1, partition: a100}]",
        "cluster.account=proj",
    )
    first, second = split(args)
    assert first == [
        "--nodes=1",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=8",
        "--account=proj",
        "--constraint=h100",
        "--job-name=p3d",
        "--time=01:00:00",
        "--requeue",
        "--signal=B:USR1@300",
        "--open-mode=append",
        f"--output={RUN_DIR}/slurm-%j.out",
    ]
    assert second == [
        "--nodes=1",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=8",
        "--partition=a100",
        "--account=proj",
    ]


def test_each_component_takes_its_groups_nodes_and_else_the_clusters_partition_and_constraint():
    groups = "cluster.groups=[{device: cpu, nodes: 2}, {device: cpu, nodes: 2, partition: slow, constraint: old}]"
    parts = split(
        args_of(
            "cluster=slurm",
            groups,
            "mesh=dp4",
            "cluster.partition=main",
            "cluster.constraint=ib",
            "cluster.extra_sbatch=[--exclusive]",
        )
    )
    assert [[a for a in p if a.startswith(("--nodes", "--partition", "--constraint"))] for p in parts] == [
        ["--nodes=2", "--partition=main", "--constraint=ib"],
        ["--nodes=2", "--partition=slow", "--constraint=old"],
    ]
    assert parts[0][-1] == "--exclusive" and "--exclusive" not in parts[1]  # the user's lines: job-wide, last
    assert all("--ntasks-per-node=1" in p for p in parts)


def test_a_cluster_without_groups_is_one_ordinary_job():
    args = args_of("cluster=slurm", "cluster.nodes=2", "mesh=dp2_tp2")
    assert ":" not in args and "--nodes=2" in args and "--ntasks-per-node=2" in args


# sinfo -h -N -o '%N|%c|%G|%P|%f'
SINFO = """n1|4|(null)|two*|on_n1
n2|4|(null)|two*|on_n2
g1|64|gpu:8|gpu|h100,ib
g2|64|gpu:8|gpu|h100,ib
g3|64|gpu:8|gpu|a100
"""


def comps(groups: str, mesh: str = "mesh=dp2"):
    cfg, _ = typed("cluster=slurm", groups, mesh)
    return components(cfg.cluster)


def test_a_groups_nodes_are_its_partitions_nodes_with_its_feature():
    n2, n1 = comps(CPU_GROUPS)
    assert component_partition(SINFO, n2) == Partition("two", nodes=1, cpus_per_node=4, gpus_per_node=0)
    h100, a100 = comps(
        "cluster.groups=[{device: cpu, nodes: 2, partition: gpu, constraint: h100}, "
        "{device: cpu, nodes: 2, partition: gpu, constraint: 'a100|h100'}]",
        "mesh=dp4",
    )
    assert component_partition(SINFO, h100) == Partition("gpu", nodes=2, cpus_per_node=64, gpus_per_node=8)
    assert component_partition(SINFO, a100).nodes == 3  # an expression: Slurm decides, the partition is checked


def test_a_feature_no_node_has_or_too_few_have_is_refused_naming_the_groups_field():
    _, missing = comps("cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, constraint: on_n3}]")
    with pytest.raises(P3DConfigError, match="cluster.groups") as err:
        component_partition(SINFO, missing)
    assert str(err.value) == (
        "cluster.groups[1].constraint=on_n3: no node of partition two has that feature (its features: on_n1, on_n2); "
        "set cluster.groups[1].constraint to one of them, or null"
    )
    (many,) = comps("cluster.groups=[{device: cpu, nodes: 2, constraint: on_n1}]", "mesh=dp2")
    with pytest.raises(P3DConfigError, match=r"cluster.groups\[0\].nodes=2 exceeds the 1 node\(s\) of partition two"):
        component_partition(SINFO, many)
    _, elsewhere = comps("cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, partition: big}]")
    with pytest.raises(P3DConfigError, match=r"^cluster.groups\[1\].partition=big: Slurm lists no nodes there"):
        component_partition(SINFO, elsewhere)


def test_sbatchs_refusal_of_a_feature_or_partition_names_the_groups_that_set_it():
    cfg, _ = typed("cluster=slurm", CPU_GROUPS, "mesh=dp2")
    refused = "sbatch refused the job: sbatch: error: Batch job submission failed: Invalid feature specification"
    assert (
        refusal_fields(cfg.cluster, refused) == "cluster.groups[0].constraint=on_n2, cluster.groups[1].constraint=on_n1"
    )
    assert refusal_fields(cfg.cluster, "sbatch refused the job: Invalid account or account/partition") is None
    assert refusal_fields(cfg.cluster, "Job violates accounting/QOS policy") is None


def test_srun_numbers_each_components_tasks_from_0_and_the_rank_adds_the_components_before():
    """srun's failure line in a hetjob: "srun: error: n1: task 0: Killed" is rank 2 when component 0 holds ranks
    0-1 (seen on the two-node cluster: the killed rank 1 of a dp2 hetjob was reported as task 0 on n1)."""
    from p3d.jobs.slurm.hetjob import step_rank

    def expand(nodelist: str) -> list[str]:  # scontrol show hostnames, for the lists below
        return {"n[3-4]": ["n3", "n4"]}.get(nodelist, [nodelist])

    env = {
        "SLURM_HET_SIZE": "3",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "n2",
        "SLURM_NTASKS_HET_GROUP_0": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n1",
        "SLURM_NTASKS_HET_GROUP_1": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_2": "n[3-4]",
        "SLURM_NTASKS_HET_GROUP_2": "4",
    }
    assert [step_rank(n, t, env, expand) for n, t in [("n2", 1), ("n1", 0), ("n1", 1), ("n3", 0), ("n4", 3)]] == [
        1,
        2,
        3,
        4,
        7,
    ]
    assert step_rank("n1", 1, {}, expand) == 1  # an ordinary job: srun's task ids are the ranks


def test_a_partition_or_feature_every_group_takes_from_the_cluster_is_named_as_the_cluster_field():
    """Issue 64, item 21: cluster.partition=nopart with groups was named cluster.groups[0].partition."""
    both = comps("cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1}]")
    cfg, _ = typed("cluster=slurm", "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1}]", "mesh=dp2")
    nopart = [dataclasses.replace(c, partition="nopart") for c in both]
    with pytest.raises(P3DConfigError, match=r"^cluster.partition=nopart: Slurm lists no nodes there"):
        component_partition(SINFO, nopart[0])
    cluster = dataclasses.replace(cfg.cluster, partition="nopart")
    assert refusal_fields(cluster, "sbatch: error: invalid partition specified") == "cluster.partition=nopart"
