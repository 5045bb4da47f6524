"""What p3d-plan says beside its numbers: whether p3d-train would refuse the config, whether it fits, and the
warnings and notes about the layout (a report of p3d.planner.predict; nothing here computes a prediction)."""

from __future__ import annotations

from typing import cast

from p3d.config.schema import Config, DType, Recompute
from p3d.layout.dims import ParallelDims
from p3d.layout.run_plan import P3DConfigError, build_plan
from p3d.planner.context import kv_span
from p3d.planner.memory import GB
from p3d.planner.shapes import Layout
from p3d.planner.step_time import a2a_link, kv_link

# a plan above this share of a device's memory is warned about: the CUDA context, NCCL's buffers and the caching
# allocator's fragmentation are not in the model (docs/planner.md, Known limits), and take some GB of it
HEADROOM = 0.9


def headroom_warning(r) -> str | None:
    """One line when prediction ``r`` fits but uses more than ``HEADROOM`` of a device's memory (cpu workers: of the
    host's, together), with what to change; None otherwise. p3d-plan, the dry run and the launch's pre-flight say it."""
    if not r.fits:
        return None
    used, cap = (r.all_ranks_bytes if r.shared_host else r.worst.total), r.capacity_bytes
    if used <= HEADROOM * cap:
        return None
    lay = r.layout
    who = f"the {lay.world_size} cpu workers together use" if r.shared_host else f"stage {r.worst.stage} uses"
    fixes = [f"schedule.micro_batch_size={lay.micro_batch_size // 2}"] if lay.micro_batch_size > 1 else []
    recompute = r.cfg.schedule.recompute
    if recompute != Recompute.full:
        fixes.append(f"schedule.recompute={'selective' if recompute == Recompute.none else 'full'}")
    if not r.cfg.schedule.sequence_parallel and lay.tp > 1:
        fixes.append("schedule.sequence_parallel=true")
    fixes.append("more pipeline stages")
    return (
        f"{who} {used / GB:.1f} GB of {r.cfg.cluster.memory_gb:g} GB ({used / cap:.0%}), more than {HEADROOM:.0%}: "
        "the CUDA context, NCCL's buffers and the allocator's fragmentation (not in the plan) may not fit; try "
        + ", ".join(fixes[:-1])
        + (" or " if len(fixes) > 1 else "")
        + fixes[-1]
    )


def verdict(r, accepted: bool) -> tuple[list[str], list[str]]:
    """(warnings, notes) of prediction ``r``; ``accepted``: p3d-train has built its run plan (no refusal to check)."""
    cfg, lay, warnings, notes = r.cfg, r.layout, [], []
    try:
        if not accepted:
            build_plan(cfg, None, for_training=True)
    except P3DConfigError as exc:
        warnings.append(f"p3d-train would refuse this config: {exc}")
    w = r.worst
    if not r.fits and r.shared_host:
        warnings.append(
            f"does not fit: the {lay.world_size} cpu workers need {r.all_ranks_bytes / GB:.1f} GB "
            f"together, cluster.memory_gb={cfg.cluster.memory_gb:g}"
        )
    elif not r.fits:
        warnings.append(
            f"does not fit: stage {w.stage} needs {w.total / GB:.1f} GB of {cfg.cluster.memory_gb:g} GB "
            f"(params {w.params_bytes / GB:.1f}, grads {w.grads_bytes / GB:.1f}, optimizer "
            f"{w.optimizer_bytes / GB:.1f}, activations {w.activations_total / GB:.1f})"
        )
    crowded = headroom_warning(r)
    if crowded is not None:
        warnings.append(crowded)
    gpn = cfg.cluster.gpus_per_node
    if gpn is not None and lay.tp > gpn:
        warnings.append(f"mesh.tp={lay.tp} > {gpn} GPUs per node: tensor-parallel traffic crosses the inter-node link")
    crossing = shard_groups_across_nodes(cfg.zero.shard_size, lay, gpn)
    if crossing:
        s, holders = cast(int, cfg.zero.shard_size), "dp x cp" if lay.cp > 1 else "dp"
        warnings.append(
            f"zero.shard_size={s}: {crossing} of the shard groups ({s} {holders} ranks x tp {lay.tp} = {s * lay.tp} "
            f"consecutive ranks) cross nodes of {gpn}, so FSDP2's gathers and reduce-scatters take the inter-node "
            f"link; try a zero.shard_size whose product with mesh.tp divides {gpn}"
        )
    if r.bubble > 0.1:
        warnings.append(
            f"pipeline bubble {r.bubble:.0%} of the step ({lay.schedule_name} with m={lay.micro_batches}): raise "
            "schedule.global_batch_size or lower schedule.micro_batch_size"
        )
    asked = cfg.schedule.pipeline.value
    if asked != lay.pipeline:
        notes.append(
            f"schedule.pipeline={asked} with schedule.virtual_stages={cfg.schedule.virtual_stages}: planned as "
            f"{lay.pipeline} (v chunks per rank); p3d-train runs that as schedule.pipeline={lay.pipeline}"
        )
    if cfg.cluster.device == "cpu":
        notes.append(
            f"cluster.device=cpu: the {lay.world_size} workers share the host's {cfg.cluster.memory_gb:g} GB "
            f"(together {r.all_ranks_bytes / GB:.2f} GB); "
            + ("times use this machine's calibration" if cfg.calibration else "times use a nominal CPU peak")
        )
    if cfg.train.dtype == DType.bf16 and cfg.zero.stage == 0 and not lay.torch_executor:
        notes.append(
            "bf16 with zero.stage=0: DeepSpeed's BF16_Optimizer shards master weights and Adam moments "
            "over dp anyway and keeps a second bf16 gradient buffer"
        )
    notes += _expert_notes(r)
    notes += _context_notes(r)
    if cfg.schedule.recompute == Recompute.full:
        notes.append("full recompute: each block keeps its input; one block's activations are rebuilt at a time")
    return warnings, notes


def fit_refusal(r) -> str | None:
    """The one line with which p3d-train (its pre-flight, and its dry run alike) refuses prediction ``r``'s layout for
    not fitting device memory; None when it fits, or when ``plan.force=true`` launches it anyway. cpu workers share
    the host's memory (their sum is compared), a GPU has its own (the most loaded rank's)."""
    if r.fits or r.cfg.plan.force:
        return None
    lay = r.layout
    need = (
        f"{_gb(r.all_ranks_bytes)} GB for its {lay.world_size} workers together"
        if r.shared_host
        else f"{_gb(r.worst.total)} GB on its most loaded device"
    )
    return (
        f"the layout tp={lay.tp} pp={lay.pp} dp={lay.dp} is predicted to need {need}, "
        f"more than cluster.memory_gb={r.cfg.cluster.memory_gb}: see the breakdown above "
        "or p3d-plan; try more stages or tensor parallelism, schedule.recompute=full, zero=stage1, "
        "or plan.force=true"
    )


def _gb(n_bytes: float) -> str:
    """Bytes in GB to three digits, whole GB with separators from 1,000 on: 385, 4,276 (not 4.28e+03)."""
    gb = n_bytes / GB
    return f"{gb:.3g}" if gb < 1000 else f"{gb:,.0f}"


def _expert_notes(r) -> list[str]:
    """An MoE layout's all-to-alls when they leave the node: their share of the step and how to keep them in."""
    cfg, lay = r.cfg, r.layout
    if cfg.model.moe is None or lay.ep == 1 or a2a_link(cfg, lay) == "intra":
        return []
    a2a = r.breakdown["a2a_comm"]
    return [
        f"the all-to-alls of mesh.ep={lay.ep} span ep x tp = {lay.ep * lay.tp} consecutive ranks, more than a node of "
        f"{cfg.cluster.gpus_per_node}: they take the inter-node link ({a2a:.2f} s, {a2a / r.step_time_s:.0%} of the "
        "step); a smaller mesh.ep or mesh.tp keeps them on the intra-node link"
    ]


def _context_notes(r) -> list[str]:
    """A cp layout's key/value collectives when they leave the node: their share of the step and how to keep them in."""
    cfg, lay = r.cfg, r.layout
    if lay.cp == 1 or kv_link(cfg, lay) == "intra":
        return []
    kv = r.breakdown["kv_comm"]
    what = "ring sends" if str(cfg.context.attention) == "ring" else "all-gathers"
    return [
        f"the key/value {what} of mesh.cp={lay.cp} span tp x cp = {kv_span(lay)} consecutive ranks, more than a "
        f"node of {cfg.cluster.gpus_per_node}: they take the inter-node link ({kv:.2f} s exposed, "
        f"{kv / r.step_time_s:.0%} of the step); a smaller mesh.cp or mesh.tp keeps them on the intra-node link"
    ]


def check_options(cfg: Config) -> None:
    """The cluster numbers the model divides by must be set (the fields' bounds are checked before, by
    p3d.launch.check.typed_config, for p3d-train and p3d-plan alike)."""
    c = cfg.cluster
    for name in ("peak_tflops", "memory_gb", "intra_node_gbps", "inter_node_gbps"):
        if getattr(c, name) is None:
            raise P3DConfigError(f"cluster.{name}=null has no value from cluster.device={c.device}; set cluster.{name}")


def shard_groups_across_nodes(shard_size: int | None, lay: Layout, gpus_per_node: int | None) -> int:
    """How many HSDP shard groups (``ParallelDims.shard_ranks``) span more than one node of ``gpus_per_node``
    consecutive ranks (Slurm's block placement); 0 without HSDP or nodes."""
    if not shard_size or not gpus_per_node or shard_size >= lay.dp_cp or lay.zero < 2:
        return 0
    dims = ParallelDims(tp=lay.tp, pp=lay.pp, dp=lay.dp, procs_per_node=gpus_per_node, cp=lay.cp)
    return sum(len({dims.node_of(r) for r in group}) > 1 for group in dims.shard_ranks(shard_size))
