"""``mesh=auto``: every valid (tp, pp, dp, micro batch) layout of the cluster, ranked by throughput.

Valid means what p3d-train accepts for the layout: tp divides the heads, the kv heads and the FFN
width and stays inside a node, pp is at most the number of blocks, global_batch_size is a multiple of
micro_batch_size x dp, and there are at least pp micro batches (validate.check_mesh decides the
mesh rules, so the two cannot drift). Layouts predicted not to fit device memory are dropped; the
rest are sorted by predicted tokens/s (ties: less memory first).
"""

from __future__ import annotations

import dataclasses
from typing import cast

from p3d.config.schema import Config, Partition
from p3d.config.validate import P3DConfigError, check_mesh
from p3d.plan.report import PlanReport, apply_layout, check_options, evaluate
from p3d.plan.shapes import Layout, divisors, world_size


def candidates(cfg: Config) -> list[Layout]:
    world = world_size(cfg)
    if world is None:
        raise P3DConfigError(
            "mesh=auto needs the number of GPUs: set cluster.device (a GPU preset) and cluster.nodes, "
            "or cluster.gpus_per_node for cpu workers"
        )
    # gpus_per_node is set: world is not None
    m, gbs, gpn = cfg.model, cfg.schedule.global_batch_size, cast(int, cfg.cluster.gpus_per_node)
    max_pp = m.n_layers if cfg.schedule.partition == Partition.blocks else m.n_layers + 3
    out = []
    for tp in divisors(world):
        if tp > gpn or m.n_heads % tp or m.n_kv_heads % tp or m.ffn_hidden_size % tp:
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if pp > max_pp or gbs % dp:
                continue
            try:
                check_mesh(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, tp=tp, pp=pp, dp=dp)), tp, pp)
            except P3DConfigError:
                continue
            for mbs in divisors(gbs // dp):
                micro = gbs // (dp * mbs)
                if micro >= pp:
                    out.append(Layout(tp, pp, dp, mbs, micro, cfg.schedule.virtual_stages))
    return out


def search(cfg: Config) -> list[PlanReport]:
    """Reports of the fitting layouts, best first. Raises P3DConfigError when none fits."""
    reports, smallest = [], None
    for layout in candidates(cfg):
        r = evaluate(apply_layout(cfg, layout), layout, check=False)
        if r.fits:
            reports.append(r)
        elif smallest is None or r.worst.total < smallest.worst.total:
            smallest = r
    if not reports:
        if smallest is None:
            raise P3DConfigError(
                f"mesh=auto: no valid layout of {world_size(cfg)} GPUs for model={cfg.model.name} "
                f"with schedule.global_batch_size={cfg.schedule.global_batch_size}; change the "
                "batch size or cluster.nodes"
            )
        raise P3DConfigError(
            f"mesh=auto: no layout of {world_size(cfg)} GPUs fits {cfg.cluster.memory_gb:g} GB; the leanest "
            f"({smallest.layout.describe()}) needs {smallest.worst.total / 1e9:.1f} GB; try zero=stage1, "
            "schedule.recompute=full or more cluster.nodes"
        )
    reports.sort(key=lambda r: (-r.tokens_per_s, r.worst.total))
    return reports


def best_layout(cfg: Config) -> Layout:
    """The fastest layout predicted to fit (for ``p3d-train mesh=auto``); P3DConfigError when none fits."""
    return search(cfg)[0].layout


def plan(cfg: Config) -> PlanReport:
    """The planner's report for a typed config (after ``fill_cluster``); mesh=auto picks the best layout.

    Raises P3DConfigError where nothing can be modelled (a layout that does not divide the cluster,
    or mesh=auto without a fitting layout)."""
    check_options(cfg)
    if cfg.mesh.name == "auto":
        ranked = search(cfg)
        best = evaluate(apply_layout(cfg, ranked[0].layout))
        best.ranking = ranked[: max(1, cfg.plan.top)]
        return best
    return evaluate(cfg)
