"""``mesh=auto``: every layout of the cluster p3d-train accepts, ranked by predicted throughput.

A layout is tp x cp x pp x dp, the expert-parallel degree ep, the micro batch size, the pipeline schedule with its
chunks per rank v, recompute and the ZeRO stage. The search tries every combination of

    tp, pp, dp      divisors of the GPUs, tp inside a node and dividing the heads, kv heads and FFN width
    cp              1; from model.seq_len >= 16384 (``context.LONG_SEQUENCE``) on also the powers of two whose chunks
                    the sequence divides into (``context_rules.sequence_multiple``) and that leave each rank at least
                    ``MIN_TOKENS_PER_RANK`` tokens of a sequence
    ep              a mixture of experts: every divisor of dp that divides the experts (and tp the experts' width);
                    a dense model: 1
    micro batch     every divisor of global_batch_size / dp
    schedule x v    1f1b and gpipe with v = 1; interleaved_1f1b and interleaved_zero_bubble with v = 2, 4, 8, ...
                    up to blocks / pp; zbv and dualpipev with v = 2
    recompute       none, selective, full
    zero.stage      0, 1, 2, 3 (2 and 3: FSDP2 on the torch executor, docs/zero.md)

and keeps those that pass p3d-train's own rules (``validate.check_mesh``, ``validate_schedule.check_schedule``,
``check_sequence_parallel``, ``check_recompute_swiglu``, ``check_zero``, ``check_experts``, ``check_context``: the
functions p3d-train calls, so the two cannot drift). Layouts predicted not to fit device memory are dropped; the rest
are sorted by predicted tokens/s (ties: less memory first), those that use more than 90 % of a device's memory last
(``verdict.headroom_warning``).
"""

from __future__ import annotations

import dataclasses
from typing import cast

from p3d.config.devices import DEVICES
from p3d.config.options import Float8
from p3d.config.schema import Config
from p3d.layout.context_rules import check_context, sequence_multiple
from p3d.layout.expert_rules import check_experts
from p3d.layout.float8_rules import recipe
from p3d.layout.geometry import max_pieces
from p3d.layout.run_plan import (
    P3DConfigError,
    check_mesh,
    check_recompute_swiglu,
    check_sequence_parallel,
    check_zero,
)
from p3d.layout.schedule_rules import check_schedule
from p3d.planner.context import LONG_SEQUENCE
from p3d.planner.float8 import PUBLISHED
from p3d.planner.hetero import HeteroPlan, plan_layout
from p3d.planner.hetero_search import plan_groups
from p3d.planner.predict import Prediction, apply_layout, evaluate
from p3d.planner.shapes import (
    Layout,
    StageParams,
    divisors,
    float8_on,
    layout_of,
    layout_of_run_plan,
    stage_params,
    world_size,
)
from p3d.planner.verdict import check_options, headroom_warning

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
# cp > 1 is searched down to this many tokens of a sequence per rank: Llama 3 ran 131,072 tokens on cp = 16 (8,192
# per rank); shorter local sequences make smaller matmuls, whose falling efficiency the GEMM model charges only through
# their tiles and waves
MIN_TOKENS_PER_RANK = 4096


def schedules(cfg: Config, pp: int) -> list[tuple[str, int]]:
    """(schedule.pipeline, virtual_stages) pairs worth trying on pp stages (validation prunes the rest)."""
    out = [("1f1b", 1)]
    if pp < 2:
        return out
    out.append(("gpipe", 1))
    blocks = max_pieces(cfg.model.n_layers, cfg.schedule.partition)
    v = 2
    while v * pp <= blocks:
        out += [("interleaved_1f1b", v), ("interleaved_zero_bubble", v)]
        v *= 2
    return out + [("zbv", 2), ("dualpipev", 2)]


def check_layout(cfg: Config, layout: Layout) -> None:
    """p3d-train's layout-dependent rules for ``cfg`` (with ``layout`` applied). Raises P3DConfigError."""
    check_schedule(cfg, layout.dp, layout.pp)
    check_sequence_parallel(cfg, layout.tp)
    check_recompute_swiglu(cfg)
    check_zero(cfg, layout.pp, layout.dp)
    check_experts(cfg, layout.dp)
    check_context(cfg, layout.tp)


def expert_degrees(cfg: Config, dp: int) -> list[int]:
    """The ep worth trying on dp replicas: the divisors of dp that divide the experts; 1 for a dense model."""
    moe = cfg.model.moe
    return [1] if moe is None else [ep for ep in divisors(dp) if moe.n_experts % ep == 0]


def context_degrees(cfg: Config, tp: int, gpus: int) -> list[int]:
    """The cp worth trying with tp on ``gpus`` = world / tp: 1, and for a sequence of at least ``LONG_SEQUENCE``
    tokens every power of two dividing ``gpus`` that cuts it into equal chunks (``sequence_multiple``, the rule
    check_context applies) of at least ``MIN_TOKENS_PER_RANK`` tokens per rank."""
    s, sched = cfg.model.seq_len, cfg.schedule
    if s < LONG_SEQUENCE or cfg.model.compile:
        return [1]
    out, cp = [1], 2
    while gpus % cp == 0 and s // cp >= MIN_TOKENS_PER_RANK:
        if s % sequence_multiple(cp, tp, bool(sched.sequence_parallel)) == 0:  # unset: on where it divides
            out.append(cp)
        cp *= 2
    return out


def candidates(cfg: Config) -> list[Layout]:
    world = world_size(cfg)
    if world is None:
        raise P3DConfigError(
            "mesh=auto needs the number of GPUs: set cluster.device (a GPU preset) and cluster.nodes, "
            "or cluster.gpus_per_node for cpu workers"
        )
    # gpus_per_node is set: world is not None
    m, gbs, gpn = cfg.model, cfg.schedule.global_batch_size, cast(int, cfg.cluster.gpus_per_node)
    max_pp = max_pieces(m.n_layers, cfg.schedule.partition)
    out = []
    for tp in divisors(world):
        if tp > gpn or m.n_heads % tp or m.n_kv_heads % tp or m.ffn_hidden_size % tp:
            continue
        for cp in context_degrees(cfg, tp, world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > max_pp or (gbs % dp and not cfg.cluster.groups):  # groups: uneven splits of the batch
                    continue
                mesh = dataclasses.replace(cfg.mesh, tp=tp, pp=pp, dp=dp, cp=cp)
                try:
                    check_mesh(dataclasses.replace(cfg, mesh=mesh), tp, pp)
                except P3DConfigError:
                    continue
                out += _layouts(cfg, tp, pp, dp, cp)
    return out


def _layouts(cfg: Config, tp: int, pp: int, dp: int, cp: int) -> list[Layout]:
    """Every micro batch, schedule, recompute, ZeRO stage and ep of the degrees tp x cp x pp x dp that p3d-train
    accepts. On a cluster of groups also the micro batches that do not divide the batch evenly over dp, which only an
    uneven split of the replicas' micro batches runs (``schedule.replica_micro_batches``, at least pp each; one chunk
    per rank, ZeRO < 3, ep 1: p3d.planner.hetero)."""
    gbs, out = cfg.schedule.global_batch_size, []
    sizes = divisors(gbs) if cfg.cluster.groups else divisors(gbs // dp)
    for mbs in sizes:
        total = gbs // mbs
        uneven = total % dp != 0
        if uneven and total < pp * dp:
            continue
        counts = [total // dp + (1 if d < total % dp else 0) for d in range(dp)] if uneven else []
        for pipeline, v in schedules(cfg, pp):
            if uneven and (v > 1 or pipeline == "dualpipev"):
                continue
            for recompute in RECOMPUTE:
                for zero in ZERO_STAGES:
                    for ep in expert_degrees(cfg, dp):
                        layout = Layout(
                            tp, pp, dp, mbs, total // dp, v, pipeline, recompute, zero, ep, cp, float8_on(cfg), uneven
                        )
                        applied = apply_layout(cfg, layout)
                        if uneven:
                            sched = dataclasses.replace(applied.schedule, replica_micro_batches=counts)
                            applied = dataclasses.replace(applied, schedule=sched)
                        try:
                            check_layout(applied, layout)
                        except P3DConfigError:
                            continue
                        out.append(layout)
    return out


def search(cfg: Config) -> list[Prediction]:
    """Reports of the fitting layouts, best first. Raises P3DConfigError when none fits."""
    reports, smallest = [], None
    # a rank's parameters depend on tp, pp, the schedule's chunks and ep only: worked out once for each such placement
    # (most of a candidate's cost), shared by its micro batches, recomputes, ZeRO stages and cp degrees
    params: dict[tuple[int, int, int, str, int], list[StageParams]] = {}
    for layout in candidates(cfg):
        key = (layout.tp, layout.pp, layout.virtual_stages, layout.pipeline, layout.ep)
        if key not in params:
            params[key] = stage_params(cfg, layout)
        r = evaluate(apply_layout(cfg, layout), layout, check=False, params=params[key])
        if r.fits:
            reports.append(r)
        elif smallest is None or r.worst.total < smallest.worst.total:
            smallest = r
    if not reports:
        if smallest is None:
            gbs = cfg.schedule.global_batch_size
            larger = batch_with_layouts(cfg)
            fix = f"try schedule.global_batch_size={larger}" if larger else "change the batch size or cluster.nodes"
            raise P3DConfigError(
                f"mesh=auto: no valid layout of {world_size(cfg)} GPUs for model={cfg.model.name} "
                f"with schedule.global_batch_size={gbs} (each replica's micro batches must fill its pipeline); {fix}"
            )
        lean = smallest.layout
        raise P3DConfigError(
            f"mesh=auto: no layout of {world_size(cfg)} GPUs fits {cfg.cluster.memory_gb:g} GB; the leanest "
            f"({lean.describe(cfg.model.seq_len)}, recompute={lean.recompute}, zero.stage={lean.zero}) needs "
            f"{smallest.worst.total / 1e9:.1f} GB; try more cluster.nodes"
        )
    # above 90 % of a device's memory last (verdict.headroom_warning: what the plan leaves out takes some GB)
    reports.sort(key=lambda r: (headroom_warning(r) is not None, -r.tokens_per_s, r.worst.total))
    return reports


def batch_with_layouts(cfg: Config, doublings: int = 12) -> int | None:
    """The smallest global batch of the given one times 2, 4, ... that the cluster has a valid layout for (so many
    GPUs need as many sequences: a pipeline's micro batches, the dp replicas), or None within ``doublings``."""
    gbs = cfg.schedule.global_batch_size
    for k in range(1, doublings + 1):
        trial = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, global_batch_size=gbs << k))
        if candidates(trial):
            return gbs << k
    return None


def best_layout(cfg: Config) -> Layout:
    """The fastest layout predicted to fit (for ``p3d-train mesh=auto``); P3DConfigError when none fits."""
    return search(cfg)[0].layout


def predict(cfg: Config, run_plan=None) -> Prediction:
    """The planner's prediction for a typed, checked config; mesh=auto picks the best layout. ``run_plan``: the
    run plan p3d-train built for ``cfg`` (its pre-flight check): its layout is modelled, not derived again.

    Raises P3DConfigError where nothing can be modelled (a layout that does not divide the cluster,
    or mesh=auto without a fitting layout)."""
    check_options(cfg)
    if run_plan is not None:
        report = evaluate(cfg, layout_of_run_plan(cfg, run_plan), accepted=True)
        if cfg.cluster.groups:  # the split the run starts with, on its groups
            report.hetero = plan_layout(cfg, report.layout, as_given=True)
        return report
    return with_float8_speedup(_predict(cfg))


def _predict(cfg: Config) -> Prediction:
    if cfg.mesh.name == "auto":
        ranked = search(cfg)
        if cfg.cluster.groups:  # a heterogeneous cluster: the split of every layout, searched (plan_groups)
            splits = plan_groups(cfg, ranked)
            best = evaluate(with_split(apply_layout(cfg, splits[0].layout), splits[0]))
            best.hetero, best.hetero_ranking = splits[0], splits[: max(1, cfg.plan.top)]
        else:
            best = evaluate(apply_layout(cfg, ranked[0].layout))
            best.ranking = ranked[: max(1, cfg.plan.top)]
        return best
    report = evaluate(cfg)
    if cfg.cluster.groups:
        report.hetero = plan_layout(cfg, report.layout)
    return report


def with_split(cfg: Config, plan: HeteroPlan) -> Config:
    """``cfg`` with the plan's blocks per stage and micro batches per replica (the even ones left empty)."""
    blocks = plan.stage_blocks if len(set(plan.stage_blocks)) > 1 else []
    counts = plan.replica_micro_batches if len(set(plan.replica_micro_batches)) > 1 else []
    sched = dataclasses.replace(cfg.schedule, stage_blocks=list(blocks), replica_micro_batches=list(counts))
    return dataclasses.replace(cfg, schedule=sched)


def planned_split(cfg: Config) -> Config:
    """``cfg`` with its mesh kept and ``schedule.stage_blocks`` / ``schedule.replica_micro_batches`` chosen again for
    its groups by the code that chooses them for mesh=auto (:func:`p3d.planner.hetero.plan_layout`, the even split
    where an uneven one is not faster); the even split on one group or none (an elastic run's re-plan,
    p3d.jobs.elastic)."""
    even = dataclasses.replace(cfg.schedule, stage_blocks=[], replica_micro_batches=[])
    cfg = dataclasses.replace(cfg, schedule=even)
    if len(cfg.cluster.groups) < 2:
        return cfg
    return with_split(cfg, plan_layout(cfg, layout_of(cfg)))


def resolve_auto(cfg: Config) -> Config:
    """``mesh=auto`` as p3d-train runs it: the best layout, and on a heterogeneous cluster its split."""
    if not cfg.cluster.groups:
        return apply_layout(cfg, best_layout(cfg))
    plan = plan_groups(cfg, search(cfg))[0]
    return with_split(apply_layout(cfg, plan.layout), plan)


def with_float8_speedup(report: Prediction) -> Prediction:
    """``report`` with its float8 figure (p3d-plan on a device with float8 tensor cores): the tokens/s of the step
    with float8 matmuls over the same step's in bf16, both on the torch executor that float8 runs on, in a note
    beside the published anchors (p3d.planner.float8.PUBLISHED), and in format=json as ``float8_speedup``."""
    cfg, layout = report.cfg, report.layout
    name = recipe(cfg)
    if name == "none" and not DEVICES[str(getattr(cfg.cluster.device, "value", cfg.cluster.device))].float8_tflops:
        return report
    shown = "tensorwise" if name == "none" else name
    torch_layout = dataclasses.replace(layout, fp8=True)
    with_fp8 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8=Float8(shown)))
    without = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8=Float8.none))
    fast = evaluate(with_fp8, torch_layout, check=False).step_time_s
    slow = evaluate(without, torch_layout, check=False).step_time_s
    report.float8_speedup = slow / fast
    report.notes.append(
        f"float8: train.fp8={shown} predicts {slow / fast:.2f}x the tokens/s of bf16 on this layout "
        f"({slow:.3f} s -> {fast:.3f} s a step); {PUBLISHED}"
    )
    return report
