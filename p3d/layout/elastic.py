"""The arithmetic of an elastic run (``cluster.elastic``, docs/clusters.md): which layout runs on the nodes left, and
the lines and record that say what changed. No torch, no processes: the decision that uses it is p3d.jobs.elastic.

``vary=dp`` keeps tp, cp and pp and gives dp what the nodes hold: ``mesh.dp = nodes x ranks per node / (tp cp pp)``.
The global batch is a config field, so it stays; the micro batches per replica follow
(``schedule.global_batch_size / (micro_batch_size x dp)``: 4 at dp2 become 8 at dp1), and the run sees the same
samples per step, so the loss curve continues. :func:`p3d.layout.run_plan.build_plan` is the judge of whether a
layout fits: its refusal is the reason a node count does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config
from p3d.layout.elastic_rules import ranks_per_node
from p3d.layout.run_plan import RunPlan, build_plan

Refit = Callable[[Config, int], Config]  # (config, nodes) -> the config re-planned for that many nodes


def fit_dp(cfg: Config, nodes: int) -> Config:
    """``cfg`` re-planned for ``nodes`` nodes with only dp changed. ``cfg``: ``cluster.gpus_per_node`` set
    (:func:`pinned`). dp may come out 0 or leave ranks over: :func:`fit_or_reason` says so."""
    c, m = cfg.cluster, cfg.mesh
    assert c.gpus_per_node is not None, "pin the node size first (pinned)"
    mesh = dataclasses.replace(m, dp=nodes * c.gpus_per_node // (m.tp * m.cp * m.pp))
    return dataclasses.replace(cfg, cluster=dataclasses.replace(c, nodes=nodes), mesh=mesh)


def fit_or_reason(cfg: Config, nodes: int, refit: Refit, vocab: int | None) -> tuple[Config, RunPlan] | str:
    """The config and plan ``refit`` gives on ``nodes`` nodes, or why that layout cannot run (one line)."""
    try:
        fitted = refit(cfg, nodes)
        m, per_node = fitted.mesh, fitted.cluster.gpus_per_node or 0
        replica, ranks = m.tp * m.cp * m.pp, nodes * per_node
        if ranks < replica or ranks % replica:
            holds = f"{'holds' if nodes == 1 else 'hold'} {ranks} rank{'' if ranks == 1 else 's'}"
            return (
                f"{nodes} {_nodes(nodes)} {holds} ({nodes} x cluster.gpus_per_node={per_node}), "
                f"{'fewer than' if ranks < replica else 'not a multiple of'} one replica "
                f"(mesh.tp x mesh.cp x mesh.pp = {replica})"
            )
        return fitted, build_plan(fitted, vocab)
    except P3DConfigError as exc:
        return f"on {nodes} {_nodes(nodes)} the layout is refused: {exc}"


def largest_fit(cfg: Config, alive: int, refit: Refit, vocab: int | None = None) -> tuple[int, Config, RunPlan] | str:
    """The most nodes, from ``alive`` down to ``cluster.elastic.min_nodes``, on which ``refit`` gives a layout that
    runs, as (nodes, config, plan): 3 of 4 nodes left and a global batch 3 replicas do not divide give 2. Else the
    reason the ``min_nodes`` layout is refused. ``cfg``: the run's config with ``cluster.gpus_per_node`` pinned."""
    least = cfg.cluster.elastic.min_nodes
    assert least is not None, "largest_fit is for elastic runs"
    reason = f"{alive} {_nodes(alive)} left, below cluster.elastic.min_nodes={least}"
    for nodes in range(alive, least - 1, -1):
        got = fit_or_reason(cfg, nodes, refit, vocab)
        if isinstance(got, str):
            reason = got
            continue
        return (nodes, *got)
    return reason


def check_floor(cfg: Config, plan: RunPlan, refit: Refit, vocab: int | None) -> None:
    """Refuse an elastic run whose layout at ``cluster.elastic.min_nodes`` would not run: it could never continue
    there. ``plan``: the run's plan at ``cluster.nodes``."""
    least = cfg.cluster.elastic.min_nodes
    if least is None or least == cfg.cluster.nodes:
        return
    got = fit_or_reason(pinned(cfg, plan), least, refit, vocab)
    if isinstance(got, str):
        fix = f"cluster.elastic.min_nodes={least + 1}" if least + 1 <= cfg.cluster.nodes else "cluster.nodes=1"
        other = "" if cfg.cluster.elastic.vary.value == "any" else " or cluster.elastic.vary=any"
        raise P3DConfigError(f"cluster.elastic.min_nodes={least}: {got}; try {fix}{other}")


def pinned(cfg: Config, plan: RunPlan) -> Config:
    """``cfg`` with ``cluster.gpus_per_node`` set to the ranks per node of ``plan``: on cpu (null) the mesh's ranks
    spread over the nodes, the node size every later fit keeps."""
    per_node = ranks_per_node(cfg, plan.world_size)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, gpus_per_node=per_node))


# ---- what changed, in words and as a record (one home for the texts)
def mesh_text(plan: RunPlan) -> str:
    """``dp1 x pp2 x tp2`` (cp shown where it is > 1)."""
    cp = f" x cp{plan.cp}" if plan.cp > 1 else ""
    return f"dp{plan.dp} x pp{plan.pp}{cp} x tp{plan.tp}"


def split_text(cfg: Config) -> str:
    """A cluster of groups' split: ``schedule.stage_blocks=[3, 1] schedule.replica_micro_batches=[5, 3]`` (the uneven
    fields), or ``the even split``."""
    s = cfg.schedule
    fields = (("stage_blocks", s.stage_blocks), ("replica_micro_batches", s.replica_micro_batches))
    return " ".join(f"schedule.{name}={list(value)}" for name, value in fields if value) or "the even split"


def summary(nodes: int, plan: RunPlan, cfg: Config | None = None) -> dict[str, Any]:
    """One layout as the record keeps it; on a cluster of groups (``cfg.cluster.groups``) its groups and split too."""
    out: dict[str, Any] = {
        "nodes": nodes,
        "dp": plan.dp,
        "pp": plan.pp,
        "tp": plan.tp,
        "cp": plan.cp,
        "micro_batches": plan.micro_batches,
        "mesh": mesh_text(plan),
    }
    if len(set(plan.replica_micro_batches)) > 1:  # uneven counts: micro_batches is the largest replica's
        out["replica_micro_batches"] = list(plan.replica_micro_batches)
    if cfg is not None and cfg.cluster.groups:
        out["groups"] = " + ".join(f"{g.nodes} x {g.device}" for g in cfg.cluster.groups)
        out["stage_blocks"] = list(cfg.schedule.stage_blocks)
        out["split"] = split_text(cfg)
    return out


def _nodes(n: int) -> str:
    return "node" if n == 1 else "nodes"


def _lost(lost: list[str]) -> str:
    return f"{_nodes(len(lost))} {', '.join(lost)}"


def _resumed(resumed_step: int | None) -> str:
    return f"resumed step {resumed_step}" if resumed_step is not None else "restarted from step 0 (no checkpoint yet)"


def _per_replica(new: dict[str, Any]) -> str:
    """``8``, or ``5 + 3`` where the replicas run different counts."""
    return " + ".join(map(str, new.get("replica_micro_batches") or [new["micro_batches"]]))


def _as(new: dict[str, Any]) -> str:
    return f"on {new['nodes']} {_nodes(new['nodes'])} as {new['mesh']}, {_per_replica(new)} micro batches per replica"


def loss_line(lost: list[str], at_step: int, resumed_step: int | None, new: dict[str, Any], alive: int) -> str:
    """``p3d: elastic: node n2 lost at step 46; resumed step 40 on 1 node as dp1 x pp2 x tp2, 8 micro batches per
    replica`` (``on 2 of 3 nodes left`` when the layout does not fit all of them)."""
    where = _as(new) if new["nodes"] == alive else f"{_as(new)} (on {new['nodes']} of the {alive} nodes left)"
    return f"p3d: elastic: {_lost(lost)} lost at step {at_step}; {_resumed(resumed_step)} {where}"


def stop_line(lost: list[str], at_step: int, reason: str, resumed_step: int | None) -> str:
    kept = (
        f"the newest checkpoint (step {resumed_step}) is kept: resume with train.resume=auto when nodes return"
        if resumed_step is not None
        else "no checkpoint was written yet"
    )
    return f"p3d: elastic: {_lost(lost)} lost at step {at_step}; {reason}: stopping; {kept}"


def resize_line(nodes: int, was: int, resumed_step: int | None, new: dict[str, Any]) -> str:
    """A (re)start on another node count than the run last had: ``p3d: elastic: 2 nodes now (was 1); resumed step
    60 on 2 nodes as dp2 x pp2 x tp2, 4 micro batches per replica``."""
    return f"p3d: elastic: {nodes} {_nodes(nodes)} now (was {was}); {_resumed(resumed_step)} {_as(new)}"


def record_text(change: dict[str, Any]) -> str:
    """One layout change of metrics.jsonl (p3d.train.metrics) as p3d-report prints it."""
    old, new = change["old"], change["new"]
    lost = f" ({change['cause']})" if change.get("cause") else ""
    parts = [
        f"step {change['at_step']}: {old['mesh']} on {old['nodes']} {_nodes(old['nodes'])} -> {new['mesh']} on "
        f"{new['nodes']} {_nodes(new['nodes'])}{lost}",
        f"resumed from step {change['resumed_step']}" if change.get("resumed_step") is not None else "from step 0",
        f"{_per_replica(new)} micro batches per replica",
    ]
    if new.get("split"):
        parts.insert(-1, f"groups {new['groups']}, {new['split']}")
    if change.get("time_lost_s") is not None:
        parts.append(f"{change['time_lost_s']:.1f} s lost")
    if change.get("steps_redone") is not None:
        parts.append(f"{change['steps_redone']} step{'' if change['steps_redone'] == 1 else 's'} redone")
    return ", ".join(parts)
