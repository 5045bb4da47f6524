"""The rules of elastic runs (``cluster.elastic``, docs/clusters.md) that need no run plan.

``build_plan`` runs :func:`check_elastic`; each refusal is one line: field, value, fix. The rule that needs a plan
(the layout at ``cluster.elastic.min_nodes`` must exist) is :func:`p3d.layout.elastic.check_floor`, run by the
launcher after the plan is built.
"""

from __future__ import annotations

from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config, Launcher


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
        raise P3DConfigError(
            f"cluster.elastic.min_nodes={least} with cluster.groups on Slurm: the groups run as one heterogeneous job, "
            "and Slurm requeues or ends every component of it when one of its nodes fails, --no-kill or not (a "
            "component of one node always), so it cannot go on on the nodes left (elastic runs over groups run on "
            "the local launcher; docs/clusters.md, Elastic runs)",
            ["cluster.elastic.min_nodes=null", "cluster.launcher=local"],
        )
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
