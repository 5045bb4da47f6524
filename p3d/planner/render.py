"""Text output of a PlanReport: layout, memory per stage, time per step, warnings."""

from __future__ import annotations

from p3d.config.schema import Recompute
from p3d.layout.float8_rules import recipe
from p3d.layout.geometry import active_params, moe_layers, total_params
from p3d.layout.hetero import describe_groups
from p3d.layout.schedule_rules import executor_name
from p3d.planner import calibration, context
from p3d.planner.machine import machine_of
from p3d.planner.memory import GB, StageMemory
from p3d.planner.step_time import a2a_link, assumptions, kv_link, kv_seconds, kv_traffic

MAX_STAGE_ROWS = 12
_KV_TRAFFIC = {"allgather": "all-gathers", "ring": "ring sends"}


def _stage_rows(report) -> list:
    """All stages, or the first two, the most loaded and the last two when there are many."""
    stages = report.stages
    if len(stages) <= MAX_STAGE_ROWS:
        return stages
    keep = {0, 1, len(stages) - 2, len(stages) - 1, report.worst.stage}
    return [s for s in stages if s.stage in keep]


def _layers(names: tuple[str, ...]) -> str:
    blocks = [n for n in names if n.startswith("block")]
    parts = [n for n in names if n == "embed"]
    if blocks:
        parts.append(f"{len(blocks)} blocks")
    parts += [n for n in names if n in ("final_norm", "head")]
    return "+".join(parts) or "-"


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _experts(report) -> list[str]:
    """An MoE model's lines: its experts, total and active parameters, ep, and each stage's dense and expert
    parameters per GPU."""
    cfg, lay = report.cfg, report.layout
    m = cfg.model
    moe = m.moe
    if moe is None:
        return []
    shared = f" + {moe.n_shared_experts} shared" if moe.n_shared_experts else ""
    out = [
        f"  mixture of experts: {moe.n_experts} routed experts (top-{moe.top_k}){shared} in {len(moe_layers(m))} of "
        f"{m.n_layers} blocks; {_billions(total_params(m))} parameters, {_billions(active_params(m))} active per token",
        f"  ep={lay.ep}: each GPU holds {moe.n_experts // lay.ep} of the {moe.n_experts} routed experts of each MoE "
        f"block; their gradients reduce (and ZeRO shards) over edp={lay.edp} ranks"
        + (f"; all-to-alls over {lay.ep * lay.tp} consecutive ranks ({a2a_link(cfg, lay)}-node)" if lay.ep > 1 else ""),
    ]
    per_stage = [
        f"stage {s.stage}: {_billions(s.params.dense)} dense + {_billions(s.params.experts)} experts"
        for s in _stage_rows(report)
    ]
    if len(per_stage) == 1:
        return [*out, f"  parameters per GPU: {per_stage[0].split(': ', 1)[1]}"]
    return [*out, "  parameters per GPU:", *(f"    {line}" for line in per_stage)]


def memory_unit(nbytes: float) -> tuple[str, float]:
    """(unit, bytes per unit) to print memory figures up to ``nbytes``: GB from 0.1 GB on, else MB."""
    return ("GB", GB) if nbytes >= 0.1 * GB else ("MB", 1e6)


def memory_table(stages: list[StageMemory], shown: list[StageMemory], scale: float) -> list[str]:
    """The header and rows of the memory table (p3d-plan's, the dry run's): ``shown`` of ``stages``, in units of
    ``scale`` bytes, the most loaded flagged."""
    worst = max(stages, key=lambda s: s.total)
    out = [
        f"  {'stage':>5} {'layers':<26} {'params':>8} {'grads':>8} {'optim':>8} {'act/mb':>8} {'in flight':>9} "
        f"{'loss':>7} {'total':>8}"
    ]
    for s in shown:
        flag = "  <- most loaded" if s.stage == worst.stage and len(stages) > 1 else ""
        out.append(
            f"  {s.stage:>5} {_layers(s.params.layers):<26} {s.params_bytes / scale:>8.2f} "
            f"{s.grads_bytes / scale:>8.2f} {s.optimizer_bytes / scale:>8.2f} "
            f"{s.activation_bytes / scale:>8.2f} "
            f"{s.in_flight:>9.2f} {s.loss_bytes / scale:>7.2f} {s.total / scale:>8.2f}{flag}"
        )
    return out


def _context(report) -> list[str]:
    """A cp layout's line: the tokens a GPU holds, how its keys and values travel, the bytes it sends per layer and
    micro batch, on which link, and how much of it hides."""
    cfg, lay = report.cfg, report.layout
    if lay.cp == 1:
        return []
    if context.variant(cfg) == "ring":
        kvs, grads = context.ring_messages(lay)
        how = f"passed round a ring, {kvs} sends of k, v + {grads} of dk, dv"
    else:
        gathers, scatters = context.kv_collectives(Recompute(lay.recompute))
        how = f"{gathers} all-gathers + {scatters} reduce-scatter"
    sent = context.kv_bytes_sent(cfg, lay)
    return [
        f"  cp={lay.cp}: each GPU holds {context.local_tokens(cfg, lay):,.0f} of the {cfg.model.seq_len:,} tokens of a "
        f"sequence (2 of its {2 * lay.cp} chunks); keys and values: {how} per layer and micro batch, "
        f"{sent / 1e6:,.1f} MB sent per GPU, {kv_seconds(cfg, lay) * 1e3:.2f} ms exposed, over "
        f"{context.kv_span(lay)} consecutive ranks ({kv_link(cfg, lay)}-node), {_kv_hidden(cfg, lay):.0%} hidden"
    ]


def _kv_hidden(cfg, lay) -> float:
    exposed, traffic = kv_traffic(cfg, lay)
    return 1 - exposed / traffic if traffic else 0.0


def render(report) -> str:
    cfg, lay = report.cfg, report.layout
    unit, scale = memory_unit(report.worst.total)
    m = cfg.model
    out: list[str] = []
    if report.ranking:
        ep = m.moe is not None  # an ep column for a mixture of experts
        # a cp column for a long sequence (where mesh=auto tries cp > 1) or a ranking that holds one
        cp = m.seq_len >= context.LONG_SEQUENCE or any(r.layout.cp > 1 for r in report.ranking)
        out += [
            f"mesh=auto: {len(report.ranking)} best of the layouts that fit {_devices(cfg, lay.world_size)}",
            f"  {'tp':>3}"
            + (f" {'cp':>3}" if cp else "")
            + f" {'pp':>3} {'dp':>5}"
            + (f" {'ep':>3}" if ep else "")
            + f" {'mbs':>4} {'m':>5} {'mem GB':>7} {'step s':>9} {'tokens/s':>12} "
            f"{'TFLOP/s':>8} {'MFU':>6} {'bubble':>7}  {'schedule':<26} {'recompute':<9} zero",
        ]
        for r in report.ranking:
            lo = r.layout
            out.append(
                f"  {lo.tp:>3}"
                + (f" {lo.cp:>3}" if cp else "")
                + f" {lo.pp:>3} {lo.dp:>5}"
                + (f" {lo.ep:>3}" if ep else "")
                + f" {lo.micro_batch_size:>4} {lo.micro_batches:>5} "
                f"{r.worst.total / GB:>7.1f} {r.step_time_s:>9.3f} {r.tokens_per_s:>12,.0f} "
                f"{r.tflops_per_gpu:>8.1f} {r.mfu:>6.1%} {r.bubble:>7.1%}  {lo.schedule_name:<26} {lo.recompute:<9} "
                f"{lo.zero}"
            )
        out.append("")
    elif report.hetero_ranking:  # mesh=auto on a cluster of groups: the layouts ranked by their splits' steps
        out += [
            f"mesh=auto: {len(report.hetero_ranking)} best splits over {_devices(cfg, lay.world_size)}, by the "
            "split's step",
            *ranking_table(report.hetero_ranking),
            "",
        ]
    mla = ", mla" if m.attention.value == "mla" else ""  # the block's attention where it is not the default
    out.append(
        f"p3d-plan: {m.name} ({m.arch.value}{mla}, {m.n_layers} layers, h={m.hidden_size}) on "
        f"{lay.describe(m.seq_len)}, {_devices(cfg)}"
    )
    out.append(
        f"  {cfg.train.dtype.value}{_float8(cfg)}, "
        f"zero.stage={cfg.zero.stage}, recompute={cfg.schedule.recompute.value}, "
        f"sequence_parallel={cfg.schedule.sequence_parallel}, global batch {cfg.schedule.global_batch_size} "
        f"x {m.seq_len} tokens"
    )
    out += _experts(report)
    out += _context(report)
    out += ["", f"memory per GPU ({unit}; capacity {cfg.cluster.memory_gb:g} GB)"]
    out += memory_table(report.stages, _stage_rows(report), scale)
    verdict = "fits" if report.fits else "DOES NOT FIT"
    if report.shared_host:
        out.append(
            f"  -> {verdict}: {report.all_ranks_bytes / scale:.2f} {unit} for all {lay.world_size} workers of "
            f"{cfg.cluster.memory_gb:g} GB host memory"
        )
    else:
        out.append(
            f"  -> {verdict}: {report.worst.total / scale:.2f} {unit} of {cfg.cluster.memory_gb:g} GB on the "
            "most loaded GPU"
        )
    w = report.worst
    beside = [f"{w.host_bytes / scale:.2f} {unit} for the cpu worker process and its data buffer"] * (w.host_bytes > 0)
    if w.attention_bytes > 0:
        beside.append(f"{w.attention_bytes / scale:.2f} {unit} of cp attention working set ({context.variant(cfg)})")
    if beside:
        out.append(f"     the total includes {' and '.join(beside)}")
    b = report.breakdown
    out += ["", "time per step (s; slowest stage)"]
    for key in (
        "compute",
        "recompute",
        "tp_comm",
        "pp_comm",
        "a2a_comm",
        "kv_comm",
        "pipeline_idle",
        "dp_comm",
        "optimizer",
        "tied_embedding",
        "overhead",
        "contention",
    ):
        if b.get(key, 0.0) > 0 or key in ("compute", "pipeline_idle"):
            link = {
                "a2a_comm": f"  (ep={lay.ep} all-to-alls, {a2a_link(cfg, lay)}-node link)",
                "kv_comm": f"  (cp={lay.cp} key/value {_KV_TRAFFIC[context.variant(cfg)]}, {kv_link(cfg, lay)}-node "
                f"link, {_kv_hidden(cfg, lay):.0%} hidden)",
                "contention": f"  ({lay.world_size} ranks' work over {machine_of(cfg).cores} cores)",
                "dp_comm": _dp_overlap(report),
            }.get(key, "")
            out.append(f"  {key:<15} {b[key]:>10.4f}{link}")
    out.append(f"  {'step':<15} {report.step_time_s:>10.4f}")
    out += [
        "",
        f"throughput: {report.tokens_per_s:,.0f} tokens/s, {report.tflops_per_gpu:.1f} TFLOP/s per GPU "
        f"(MFU {report.mfu:.1%}{_mfu_peak(cfg)}), "
        f"{report.hfu_tflops_per_gpu:.1f} with recompute (HFU {report.hfu:.1%}), "
        f"bubble {report.bubble:.1%}",
    ]
    a = assumptions(cfg, lay)
    matmuls = (
        f"GEMMs from their shapes at {a['efficiency']:.1%} of {a['peak_tflops']:g} TFLOP/s for a large one, "
        f"k0 {a['gemm_k_overhead']:g} ({a['gemm_efficiency']:.1%} in a block's GEMMs here)"
        if a["gemm_model"]
        else f"{a['efficiency']:.0%} of {a['peak_tflops']:g} TFLOP/s in matmuls"
    )
    out.append(
        f"assumed: {matmuls}, "
        f"HBM {a['hbm_gbps']:g} GB/s, "
        f"links {a['intra_node_gbps']:g}/{a['inter_node_gbps']:g} GB/s x {a['comm_efficiency']:g}, "
        f"flash_attention={a['flash_attention']}, overlap tp/pp/dp={a['overlap_tp']}/{a['overlap_pp']}/"
        f"{'executor' if a['overlap_dp'] is None else a['overlap_dp']}"
    )
    if cfg.calibration:
        out.append(f"calibrated: {cfg.calibration} ({calibration.load(cfg.calibration).describe()})")
    for n in report.notes:
        out.append(f"note: {n}")
    for w in report.warnings:
        out.append(f"warning: {w}")
    if report.hetero is not None:  # cluster.groups: the split on the groups, each group's memory, the gap
        out.append(report.hetero.render(m.seq_len))
    return "\n".join(out)


def _devices(cfg, world: int | None = None) -> str:
    """The devices a plan is for: ``64 x h100_sxm`` (``h100_sxm`` without ``world``), or on a cluster of groups the
    groups, and how the homogeneous model stands for them (their mean peak, their smallest memory)."""
    c = cfg.cluster
    if not c.groups:
        return f"{world} x {c.device}" if world else str(c.device)
    gpus = f"the {world} GPUs of " if world else ""
    return (
        f"{gpus}cluster.groups {describe_groups(c)} (timed at their mean peak, {c.peak_tflops:g} TFLOP/s, in their "
        f"smallest memory, {c.memory_gb:g} GB)"
    )


def _float8(cfg) -> str:
    name = recipe(cfg)
    return "" if name == "none" else f" + float8 {name} matmuls"


def _mfu_peak(cfg) -> str:
    """Which peak MFU divides by, where float8 makes it a question: the bf16 one (torchtitan's convention)."""
    return "" if not _float8(cfg) else f" of the bf16 peak {cfg.cluster.peak_tflops:g} TFLOP/s"


def _dp_overlap(report) -> str:
    """The dp line's note: the exposed seconds' share of the dp traffic, and who hides the rest (docs/overlap.md)."""
    total, exposed = report.dp_traffic_s, report.breakdown.get("dp_comm", 0.0)
    if total <= 0:
        return ""
    stated = report.cfg.plan.overlap_dp
    if stated is not None:
        who = f"plan.overlap_dp={str(stated).lower()}"
    elif not report.layout.torch_executor:
        who = f"{executor_name(True)} reduces after the last backward"
    elif report.layout.zero >= 2:
        who = f"{executor_name(False)}: FSDP2 reduce-scatters in the last backward and prefetches its gathers"
    else:  # its buckets go out in the last backward as their gradients are final (docs/overlap.md)
        who = f"{executor_name(False)} issues its buckets in the last backward, the last one exposed"
    return f"  (exposed, of {total:.4f} s of dp traffic: overlap {1 - exposed / total:.0%}; {who})"


def ranking_table(plans: list) -> list[str]:
    """mesh=auto's table on a cluster of groups: each layout with its split, its step, the uniform split's, the
    ideal's and the gap, best first."""
    out = [
        f"  {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'mbs':>4}  {'schedule':<22} {'recompute':<9} {'zero':>4}  "
        f"{'step s':>9} {'uniform s':>9} {'ideal s':>9} {'gap':>7}  blocks per stage / micro batches per replica"
    ]
    for p in plans:
        lo = p.layout
        out.append(
            f"  {lo.tp:>3} {lo.cp:>3} {lo.pp:>3} {lo.dp:>4} {lo.micro_batch_size:>4}  {lo.schedule_name:<22} "
            f"{lo.recompute:<9} {lo.zero:>4}  {p.step_s:>9.4f} {p.uniform_step_s:>9.4f} {p.ideal_step_s:>9.4f} "
            f"{p.gap:>+7.1%}  {_listed(p.stage_blocks)} / {_listed(p.replica_micro_batches)}"
            + ("" if p.fits else "  (does not fit)")
        )
    return out


def _listed(values: list[int]) -> str:
    return "[" + ",".join(map(str, values)) + "]"
