"""Elastic runs (``cluster.elastic``): what the launcher does when a node is lost, applied to a run directory.

The local launcher (p3d.jobs.restart.run_with_restarts) asks :func:`after_loss` once the workers of a lost node are
gone: ``resize`` (start again on the nodes left, the spec re-fitted by p3d.launch.requeue.resume_spec with the
decision's ``event``), ``stop`` (fewer nodes than ``cluster.elastic.min_nodes``: exit_codes.NODES_LOST, the newest
checkpoint kept) or ``same`` (not an elastic run: today's restart rule). The arithmetic and the lines are
p3d.layout.elastic's. A node-loss restart does not count against ``train.max_restarts``: each one loses a node, so
the node count bounds them.

On a cluster of groups (``cluster.groups``, p3d.layout.hetero) the lost node's own group shrinks by one
(p3d.layout.hetero.groups_left: the launcher names the node by its index in the run's node order) and the split over
the groups left is planned again (p3d.planner.search.planned_split, the code mesh=auto chooses it with; the even split
on one group), the global batch kept. A split the run was given by hand belongs to the groups it was made for, which
are gone: it is re-planned too, and the line says it was not the planner's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p3d.checkpoint import find as checkpoint
from p3d.config.errors import P3DConfigError
from p3d.config.schema import ClusterGroup, Config, ElasticVary
from p3d.layout.elastic import fit_dp, largest_fit, loss_line, pinned, resize_line, split_text, stop_line, summary
from p3d.layout.elastic_rules import is_elastic
from p3d.layout.hetero import describe_groups, first_nodes, group_of_node, groups_left, regrouped
from p3d.layout.run_plan import RunPlan, sequence_parallel_default
from p3d.rundir.files import METRICS


@dataclass(frozen=True)
class Decision:
    action: str  # "resize": start again on ``nodes``; "stop": below min_nodes; "same": not elastic
    nodes: int
    line: str  # the one console line ("" for same)
    event: dict[str, Any] | None = None  # the layout change, recorded in the re-frozen spec and metrics.jsonl


def refit(cfg: Config, nodes: int) -> Config:
    """``cfg`` (``cluster.gpus_per_node`` pinned) re-planned for ``nodes`` nodes: ``vary=dp`` changes dp only;
    ``vary=any`` takes the planner's fastest layout that fits (p3d.planner.best_layout). With ``cluster.groups`` (those
    of the nodes left, :func:`with_groups_left`): the groups of the first ``nodes`` nodes, and the split over them
    planned again (p3d.planner.search.planned_split; with vary=any the planner's layout and split together)."""
    from p3d.planner import apply_layout, best_layout
    from p3d.planner.search import planned_split, resolve_auto

    c = cfg.cluster
    if c.groups:
        if nodes > sum(g.nodes for g in c.groups):
            raise P3DConfigError(
                f"{nodes} nodes are more than cluster.groups hold ({describe_groups(c)}): which group a node that "
                "came back belongs to is not known; resume naming the groups (p3d-train train.resume=auto "
                "cluster.groups=[...])"
            )
        cfg = dataclasses.replace(cfg, cluster=regrouped(c, first_nodes(c.groups, nodes)))
    if cfg.cluster.elastic.vary == ElasticVary.any:
        sched = cfg.schedule
        if sched.sequence_parallel == sequence_parallel_default(cfg, cfg.mesh.tp, cfg.mesh.cp):
            # the spec's value is what the old layout derived: unset again, the new layout derives its own
            sched = dataclasses.replace(sched, sequence_parallel=None)
            cfg = dataclasses.replace(cfg, schedule=sched)
        even = dataclasses.replace(cfg.schedule, stage_blocks=[], replica_micro_batches=[])
        there = dataclasses.replace(
            cfg,
            cluster=dataclasses.replace(cfg.cluster, nodes=nodes),
            mesh=dataclasses.replace(cfg.mesh, name="auto", dp="auto"),
            schedule=even if cfg.cluster.groups else cfg.schedule,
        )
        if len(there.cluster.groups) > 1:
            return resolve_auto(there)  # the best layout's split on the groups (mesh=auto's)
        return apply_layout(there, best_layout(there))
    fitted = fit_dp(cfg, nodes)
    return planned_split(fitted) if cfg.cluster.groups else fitted


def with_groups_left(cfg: Config, lost: list[int]) -> Config:
    """``cfg`` with ``cluster.groups`` those of the nodes left after the nodes ``lost`` (indices in the run's node
    order): p3d.layout.hetero.groups_left. Unchanged without groups."""
    if not cfg.cluster.groups:
        return cfg
    left = groups_left(cfg.cluster, lost)
    return dataclasses.replace(cfg, cluster=regrouped(cfg.cluster, left)) if left else cfg


def node_indices(lost: list[str]) -> list[int]:
    """The indices of the lost nodes in the run's node order: the local launcher names its simulated nodes by them
    (on Slurm the host file of the srun that failed orders them: p3d.jobs.slurm.groupjob.lost_indices)."""
    return [int(name) for name in lost]


def with_groups(cfg: Config, event: dict[str, Any] | None) -> Config:
    """``cfg`` with the groups a loss left (``event["groups_left"]``, :func:`after_loss`); unchanged without them."""
    if not event or event.get("groups_left") is None:
        return cfg
    groups = [ClusterGroup(**g) for g in event["groups_left"]]
    return dataclasses.replace(cfg, cluster=regrouped(cfg.cluster, groups))


def split_note(cfg: Config, lost: list[str], index: list[int], new_cfg: Config) -> str:
    """What the re-plan did on a cluster of groups, for the loss line: the group each lost node was in, the groups
    left, the new split and whether the old one was the planner's (a split given by hand is re-planned too: the
    groups it was made for are gone)."""
    from p3d.planner.search import planned_split

    c = cfg.cluster
    groups = [(name, group_of_node(c, i)) for name, i in zip(lost, index)]
    owners = ", ".join(f"node {n} was group {g}'s ({c.groups[g].nodes} x {c.groups[g].device})" for n, g in groups)
    ours = planned_split(cfg).schedule
    by_hand = (ours.stage_blocks, ours.replica_micro_batches) != (
        cfg.schedule.stage_blocks,
        cfg.schedule.replica_micro_batches,
    )
    was = f"was {split_text(cfg)}{', set by hand' if by_hand else ''}"
    left = describe_groups(new_cfg.cluster)
    return f"{owners}; groups left {left}, split re-planned: {split_text(new_cfg)} ({was})"


def newest_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint, the one a restart resumes; None when there is none."""
    found = checkpoint.find(run_dir, "auto")
    return json.loads((found / "meta.json").read_text())["step"] if found is not None else None


def last_logged(run_dir: Path) -> float | None:
    """When the last step before the loss was logged (metrics.jsonl's mtime): where the time lost starts."""
    path = run_dir / METRICS
    return path.stat().st_mtime if path.is_file() else None


def after_loss(run_dir: Path, lost: list[str], alive: int, at_step: int, index: list[int] | None = None) -> Decision:
    """What to do after the nodes ``lost`` were lost with ``alive`` nodes left, in step ``at_step``. ``index``: on a
    cluster of groups, their indices in the run's node order (None: the names are the indices, as the local launcher
    names its simulated nodes)."""
    from p3d.rundir.spec import read_spec

    cfg, plan = read_spec(run_dir)
    if not is_elastic(cfg):
        return Decision("same", cfg.cluster.nodes, "")
    resumed = newest_step(run_dir)
    if not cfg.cluster.groups:
        index = []
    elif index is None:
        index = node_indices(lost)
    got = largest_fit(with_groups_left(pinned(cfg, plan), index), alive, refit)
    if isinstance(got, str):
        return Decision("stop", alive, stop_line(lost, at_step, got, resumed))
    nodes, new_cfg, new_plan = got
    old, new = summary(cfg.cluster.nodes, plan, cfg), summary(nodes, new_plan, new_cfg)
    line = loss_line(lost, at_step, resumed, new, alive)
    if cfg.cluster.groups:
        line += f"; {split_note(cfg, lost, index, new_cfg)}"
    event = {
        "kind": "shrink",
        "cause": f"{'node' if len(lost) == 1 else 'nodes'} {', '.join(lost)} lost",
        "lost_nodes": lost,
        "at_step": at_step,
        "resumed_step": resumed,
        "steps_redone": at_step - 1 - (resumed or 0),  # logged since the checkpoint: trained again
        "old": old,
        "new": new,
        "since": last_logged(run_dir),
    }
    if cfg.cluster.groups:  # which group each lost node was in; the groups the run goes on with (resume_spec's)
        lost_groups = [group_of_node(cfg.cluster, i) for i in index]
        event["lost_groups"] = lost_groups
        owners = ", ".join(f"{n} (group {g})" for n, g in zip(lost, lost_groups))
        event["cause"] = f"{'node' if len(lost) == 1 else 'nodes'} {owners} lost"
        event["groups_left"] = [dataclasses.asdict(g) for g in new_cfg.cluster.groups]
    return Decision("resize", nodes, line, event)


def at_start(cfg: Config, plan: RunPlan) -> Decision | None:
    """A launch that resumes an elastic run on another node count than its checkpoint was trained on (nodes came
    back, grown by hand: ``p3d-train train.resume=auto cluster.nodes=2``): the line and the layout change to record;
    None otherwise. ``cfg``: checked (``train.resume`` a checkpoint directory or none)."""
    from p3d.rundir.files import SPEC
    from p3d.rundir.spec import read_spec

    if not is_elastic(cfg) or cfg.train.resume == "none" or not (Path(cfg.train.resume) / SPEC).is_file():
        return None
    was_cfg, was_plan = read_spec(Path(cfg.train.resume) / SPEC)
    was, nodes = was_cfg.cluster.nodes, cfg.cluster.nodes
    if was == nodes:
        return None
    resumed = json.loads((Path(cfg.train.resume) / "meta.json").read_text())["step"]
    new = summary(nodes, plan, cfg)
    event = {
        "kind": "grow" if nodes > was else "shrink",
        "cause": f"{nodes} {'node' if nodes == 1 else 'nodes'} at the start, was {was}",
        "lost_nodes": [],
        "at_step": resumed + 1,
        "resumed_step": resumed,
        "steps_redone": 0,
        "old": summary(was, was_plan, was_cfg),
        "new": new,
        "since": None,  # a start by hand: the time between runs is not the run's loss
    }
    line = resize_line(nodes, was, resumed, new)
    if cfg.cluster.groups and was_cfg.cluster.groups:  # which groups, and the split planned for them
        line += (
            f"; groups {describe_groups(cfg.cluster)} (were {describe_groups(was_cfg.cluster)}), split "
            f"{split_text(cfg)} (was {split_text(was_cfg)})"
        )
    return Decision("resize", nodes, line, event)
