"""The rules of elastic runs (``cluster.elastic``, docs/clusters.md) that need no run plan.

``build_plan`` runs :func:`check_elastic`; each refusal is one line: field, value, fix. The rule that needs a plan
(the layout at ``cluster.elastic.min_nodes`` must exist) is :func:`p3d.layout.elastic.check_floor`, run by the
launcher after the plan is built.
"""

from __future__ import annotations

from p3d.config.errors import P3DConfigError
from p3d.config.schema import ClusterConfig, Config, Launcher
from p3d.layout.hetero import plain_feature


def is_elastic(cfg: Config) -> bool:
    return cfg.cluster.elastic.min_nodes is not None


def ranks_per_node(cfg: Config, world: int) -> int:
    """Workers per node: ``cluster.gpus_per_node``, or on cpu (null) the mesh's ``world`` spread over the nodes."""
    return cfg.cluster.gpus_per_node or world // cfg.cluster.nodes


def check_elastic(cfg: Config, world: int) -> None:
    """``world``: the ranks of the run at ``cluster.nodes`` (the mesh's)."""
    c = cfg.cluster
    nodes, least = c.nodes, c.elastic.min_nodes
    if c.launcher == Launcher.local and nodes != 1 and least is None and not c.groups:
        save = cfg.train.save_every or 100  # an elastic run resumes from its checkpoints (the rule below)
        raise P3DConfigError(
            f"cluster.nodes={nodes} with cluster.launcher=local: local runs use one machine; simulated nodes "
            "(worker groups) are for elastic runs and cluster.groups",
            ["cluster.nodes=1", f"cluster.elastic.min_nodes=1 train.save_every={save}"],
        )
    if least is None:
        return
    if c.groups and c.launcher == Launcher.slurm:
        check_slurm_groups(c)
    if least > nodes:
        raise P3DConfigError(
            f"cluster.elastic.min_nodes={least} exceeds cluster.nodes={nodes}: an elastic run continues on at most "
            f"the nodes it starts with; try cluster.elastic.min_nodes={nodes}"
        )
    if cfg.train.save_every == 0:
        raise P3DConfigError(
            f"cluster.elastic.min_nodes={least} resumes from the newest checkpoint after a lost node, but "
            "train.save_every=0 writes none before the end; set train.save_every (e.g. train.save_every=100)"
        )
    if c.gpus_per_node is None and world % nodes:
        raise P3DConfigError(
            f"cluster.nodes={nodes} does not divide the mesh's {world} ranks, so an elastic run has no node size "
            f"to lose; try cluster.nodes=1, or set cluster.gpus_per_node"
        )


def check_slurm_groups(c: ClusterConfig) -> None:
    """An elastic run over ``cluster.groups`` on Slurm is one ordinary ``--no-kill`` job (not a hetjob, which Slurm ends
    whole when a node fails; p3d.jobs.slurm.groupjob): it asks for each group's nodes by a node feature of its own, and
    it has one partition."""
    where = "an elastic run over cluster.groups on Slurm is one job that tells each group's nodes by a node feature"
    seen: dict[str, int] = {}
    for i, g in enumerate(c.groups):
        if not plain_feature(g.constraint):
            raise P3DConfigError(
                f"cluster.groups[{i}].constraint={g.constraint or 'null'}: {where}; set "
                f"cluster.groups[{i}].constraint to one feature that its nodes have and the other groups' do not "
                "(see `sinfo -o '%N %f'`), or set cluster.elastic.min_nodes=null"
            )
        if str(g.constraint) in seen:
            raise P3DConfigError(
                f"cluster.groups[{i}].constraint={g.constraint} is cluster.groups[{seen[str(g.constraint)]}]'s too: "
                f"{where}; give each group a feature of its own nodes (see `sinfo -o '%N %f'`)"
            )
        seen[str(g.constraint)] = i
    partitions = [g.partition or c.partition for g in c.groups]
    for i, part in enumerate(partitions):
        if part != partitions[0]:
            raise P3DConfigError(
                f"cluster.groups[{i}].partition={part or 'null'} differs from cluster.groups[0]'s "
                f"({partitions[0] or 'null'}): an elastic run over cluster.groups on Slurm is one job, in one "
                "partition; set cluster.partition and leave the groups' partition null, or set "
                "cluster.elastic.min_nodes=null (a heterogeneous job per group)"
            )
