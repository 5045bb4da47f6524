"""Elastic runs (``cluster.elastic``): what the launcher does when a node is lost, applied to a run directory.

The local launcher (p3d.jobs.restart.run_with_restarts) asks :func:`after_loss` once the workers of a lost node are
gone: ``resize`` (start again on the nodes left, the spec re-fitted by p3d.launch.requeue.resume_spec with the
decision's ``event``), ``stop`` (fewer nodes than ``cluster.elastic.min_nodes``: exit_codes.NODES_LOST, the newest
checkpoint kept) or ``same`` (not an elastic run: today's restart rule). The arithmetic and the lines are
p3d.layout.elastic's. A node-loss restart does not count against ``train.max_restarts``: each one loses a node, so
the node count bounds them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p3d.checkpoint import find as checkpoint
from p3d.config.schema import Config, ElasticVary
from p3d.layout.elastic import fit_dp, largest_fit, loss_line, pinned, resize_line, stop_line, summary
from p3d.layout.elastic_rules import is_elastic
from p3d.layout.run_plan import RunPlan
from p3d.rundir.files import METRICS


@dataclass(frozen=True)
class Decision:
    action: str  # "resize": start again on ``nodes``; "stop": below min_nodes; "same": not elastic
    nodes: int
    line: str  # the one console line ("" for same)
    event: dict[str, Any] | None = None  # the layout change, recorded in the re-frozen spec and metrics.jsonl


def refit(cfg: Config, nodes: int) -> Config:
    """``cfg`` (``cluster.gpus_per_node`` pinned) re-planned for ``nodes`` nodes: ``vary=dp`` changes dp only;
    ``vary=any`` takes the planner's fastest layout that fits (p3d.planner.best_layout)."""
    if cfg.cluster.elastic.vary == ElasticVary.any:
        from p3d.planner import apply_layout, best_layout

        there = dataclasses.replace(
            cfg,
            cluster=dataclasses.replace(cfg.cluster, nodes=nodes),
            mesh=dataclasses.replace(cfg.mesh, name="auto", dp="auto"),
        )
        return apply_layout(there, best_layout(there))
    return fit_dp(cfg, nodes)


def newest_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint, the one a restart resumes; None when there is none."""
    found = checkpoint.find(run_dir, "auto")
    return json.loads((found / "meta.json").read_text())["step"] if found is not None else None


def last_logged(run_dir: Path) -> float | None:
    """When the last step before the loss was logged (metrics.jsonl's mtime): where the time lost starts."""
    path = run_dir / METRICS
    return path.stat().st_mtime if path.is_file() else None


def after_loss(run_dir: Path, lost: list[str], alive: int, at_step: int) -> Decision:
    """What to do after the nodes ``lost`` were lost with ``alive`` nodes left, in step ``at_step``."""
    from p3d.rundir.spec import read_spec

    cfg, plan = read_spec(run_dir)
    if not is_elastic(cfg):
        return Decision("same", cfg.cluster.nodes, "")
    resumed = newest_step(run_dir)
    got = largest_fit(pinned(cfg, plan), alive, refit)
    if isinstance(got, str):
        return Decision("stop", alive, stop_line(lost, at_step, got, resumed))
    nodes, _, new_plan = got
    old, new = summary(cfg.cluster.nodes, plan), summary(nodes, new_plan)
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
    return Decision("resize", nodes, loss_line(lost, at_step, resumed, new, alive), event)


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
    new = summary(nodes, plan)
    event = {
        "kind": "grow" if nodes > was else "shrink",
        "cause": f"{nodes} {'node' if nodes == 1 else 'nodes'} at the start, was {was}",
        "lost_nodes": [],
        "at_step": resumed + 1,
        "resumed_step": resumed,
        "steps_redone": 0,
        "old": summary(was, was_plan),
        "new": new,
        "since": None,  # a start by hand: the time between runs is not the run's loss
    }
    return Decision("resize", nodes, resize_line(nodes, was, resumed, new), event)
