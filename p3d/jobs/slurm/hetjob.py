"""A cluster of groups on Slurm (``cluster.groups``, docs/clusters.md): one heterogeneous job, a component per group.

``p3d-train`` submits ``sbatch <component 0> : <component 1> : ... recipes/slurm/train.sbatch``: each component asks
for its group's nodes, the run's tasks (and GPUs) per node, and the group's ``partition`` / ``constraint`` (else the
cluster's); the options of the whole job (name, time limit, requeue, signal, log) ride on component 0, from which
Slurm propagates them. The recipe starts one srun step over every component (``srun --het-group=0-K``), whose task ids
run through the components in order, node by node: rank r lands on node r // ranks per node of the groups' order, the
node p3d.layout.hetero gives it. Pure functions; the partition check and the submission are p3d.jobs.slurm.submit's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from p3d.layout.hetero import plain_feature

HETJOB_SEPARATOR = ":"  # between the components on sbatch's command line


@dataclass(frozen=True)
class Component:
    """One component of the job: group ``index``'s nodes, and where Slurm may take them (None: its default)."""

    index: int
    nodes: int
    partition: str | None
    constraint: str | None
    own: frozenset[str] = frozenset()  # the fields of partition and constraint the group sets itself

    @property
    def field(self) -> str:
        return f"cluster.groups[{self.index}]"

    @property
    def partition_field(self) -> str:
        """The field that gave the partition: the group's, or the cluster's that every group takes."""
        return f"{self.field}.partition" if "partition" in self.own else "cluster.partition"

    @property
    def constraint_field(self) -> str:
        return f"{self.field}.constraint" if "constraint" in self.own else "cluster.constraint"

    @property
    def feature(self) -> str | None:
        """The constraint when it names one feature (the partition check counts the nodes that have it)."""
        return self.constraint if plain_feature(self.constraint) else None


def components(c) -> list[Component]:
    """The components of cluster config ``c`` (none without groups), in the groups' order."""
    return [
        Component(
            i,
            g.nodes,
            g.partition or c.partition,
            g.constraint or c.constraint,
            frozenset(f for f in ("partition", "constraint") if getattr(g, f)),
        )
        for i, g in enumerate(c.groups)
    ]


def component_args(c, comp: Component, lay) -> list[str]:
    """One component's size and place: its nodes, the run's tasks (GPUs, CPUs) per node, partition, account, qos,
    constraint. ``lay``: the run's p3d.jobs.slurm.submit.JobShape (the same tasks per node on every group)."""
    args = [f"--nodes={comp.nodes}", f"--ntasks-per-node={lay.ntasks_per_node}"]
    if lay.gpus_per_node:
        args.append(f"--gpus-per-node={lay.gpus_per_node}")
    if lay.cpus_per_task:
        args.append(f"--cpus-per-task={lay.cpus_per_task}")
    place = {"partition": comp.partition, "account": c.account, "qos": c.qos, "constraint": comp.constraint}
    return args + [f"--{flag}={value}" for flag, value in place.items() if value is not None]


def hetjob_args(c, lay, job_wide: list[str]) -> list[str]:
    """sbatch's options for the groups' heterogeneous job: component 0 with ``job_wide`` (name, time, requeue, signal,
    output, the user's extra lines: last, so that they win), then ':' and each further component."""
    first, *rest = components(c)
    args = component_args(c, first, lay) + job_wide
    for comp in rest:
        args += [HETJOB_SEPARATOR, *component_args(c, comp, lay)]
    return args


def refusal_fields(c, message: str) -> str | None:
    """sbatch refused the heterogeneous job: the group fields its message points at, or None. Slurm does not say which
    component it refused, so every group that sets the field is named."""
    comps = components(c)
    for word, attr in (("feature", "constraint"), ("partition", "partition")):
        if word in message.lower():
            named = [
                f"{getattr(comp, f'{attr}_field')}={getattr(comp, attr)}"
                for comp in comps
                if getattr(comp, attr) is not None
            ]
            if named:  # a cluster-wide field that every group takes: named once
                return ", ".join(dict.fromkeys(named))
    return None


def step_rank(node: str | None, task: int, env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> int:
    """The rank of srun's ``task`` on ``node`` in its failure lines ("srun: error: n1: task 0: Killed"). In a
    heterogeneous job (``SLURM_HET_SIZE`` in ``env``) srun numbers each component's tasks from 0 there, so the rank is
    ``task`` plus the tasks of the components before the node's (``SLURM_JOB_NODELIST_HET_GROUP_k``, expanded by
    ``hostnames``; ``SLURM_NTASKS_HET_GROUP_k``); in an ordinary job, ``task`` itself."""
    size = int(env.get("SLURM_HET_SIZE") or 0)
    before = 0
    for k in range(size):
        if node is not None and node in hostnames(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{k}", "")):
            return before + task
        before += int(env.get(f"SLURM_NTASKS_HET_GROUP_{k}") or 0)
    return task
