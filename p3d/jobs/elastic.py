"""Elastic runs (``cluster.elastic``): what the launcher does when a node is lost or the node count changed.

The arithmetic (which layout fits, the lines) is p3d.layout.elastic; here it is applied to a run directory.
"""

from __future__ import annotations

import dataclasses

from p3d.config.schema import Config, ElasticVary
from p3d.layout.elastic import fit_dp


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
