"""The plan of one config: memory per stage, step time, throughput, and what p3d-train would say.

``predict(cfg)`` (:mod:`p3d.planner.search`) is the entry point (``cfg`` a typed, checked Config); ``mesh=auto``
predicts the best layout of the search and keeps the ranking; ``predict(cfg, run_plan)`` models the run p3d-train
has accepted, with the layout its run plan derived.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from p3d.config.schema import Config
from p3d.layout.geometry import (
    active_params,
    model_flops_per_token,
    recompute_flops_per_token,
    schedule_bubble,
    total_params,
)
from p3d.planner import context, experts, memory, step_time
from p3d.planner.machine import executor_of, machine_of
from p3d.planner.render import render
from p3d.planner.shapes import Layout, StageParams, apply_layout, layout_of  # noqa: F401 - apply_layout: p3d.planner's
from p3d.planner.step_time import assumptions
from p3d.planner.verdict import verdict

GB = memory.GB


@dataclass
class Prediction:
    """Memory per stage, time per step and the derived figures of one config and layout.

    ``fits``, ``step_time_s``, ``tokens_per_s``, ``tflops_per_gpu`` (model FLOPs), ``hfu_tflops_per_gpu``
    (with recompute), ``mfu``, ``hfu``, ``bubble`` and ``warnings`` are what p3d-plan prints;
    ``to_json()`` is the same as one dict, ``render()`` as text."""

    cfg: Config
    layout: Layout
    stages: list[memory.StageMemory]
    stage_times: list[step_time.StageTime]
    step_time_s: float
    breakdown: dict[str, float]  # seconds per step
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ranking: list[Prediction] = field(default_factory=list)  # mesh=auto: the best layouts, best first
    dp_traffic_s: float = 0.0  # the slowest tail's dp collectives, whole; breakdown["dp_comm"] is their exposed part
    hetero: Any = None  # cluster.groups: the split on the groups (p3d.planner.hetero.HeteroPlan)
    hetero_ranking: list[Any] = field(default_factory=list)  # mesh=auto on groups: the best splits, best first
    float8_speedup: float | None = None  # tokens/s in float8 over bf16 on the layout (search.with_float8_speedup)

    # ---- figures
    @property
    def capacity_bytes(self) -> float:
        return cast(float, self.cfg.cluster.memory_gb) * GB

    @property
    def worst(self) -> memory.StageMemory:
        """The most loaded stage (its every rank holds the same bytes)."""
        return max(self.stages, key=lambda s: s.total)

    @property
    def all_ranks_bytes(self) -> float:
        """Memory of every rank together (each stage has tp x cp x dp ranks)."""
        return sum(s.total for s in self.stages) * self.layout.tp * self.layout.dp_cp

    @property
    def shared_host(self) -> bool:
        """cpu workers (gpus_per_node unset) share one machine's memory."""
        return self.cfg.cluster.gpus_per_node is None

    @property
    def fits(self) -> bool:
        if self.shared_host:
            return self.all_ranks_bytes <= self.capacity_bytes
        return self.worst.total <= self.capacity_bytes

    @property
    def tokens_per_step(self) -> int:
        """m micro batches of b sequences on each of d replicas (= global_batch x s when the batch divides)."""
        lay = self.layout
        return lay.micro_batches * lay.micro_batch_size * lay.dp * self.cfg.model.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def tflops_per_gpu(self) -> float:
        return model_flops_per_token(self.cfg.model) * self.tokens_per_s / self.layout.world_size / 1e12

    @property
    def hfu_tflops_per_gpu(self) -> float:
        extra = recompute_flops_per_token(self.cfg.model, self.cfg.schedule.recompute.value)
        return self.tflops_per_gpu * (1 + extra / model_flops_per_token(self.cfg.model))

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / cast(float, self.cfg.cluster.peak_tflops)

    @property
    def hfu(self) -> float:
        return self.hfu_tflops_per_gpu / cast(float, self.cfg.cluster.peak_tflops)

    @property
    def bubble(self) -> float:
        """The idle share of a step under the layout's schedule: ``p3d.layout.geometry.schedule_bubble``."""
        lay = self.layout
        return schedule_bubble(lay.pipeline, lay.pp, lay.micro_batches, lay.virtual_stages)

    # ---- output
    def summary(self) -> dict[str, Any]:
        w = self.worst
        return {
            "fits": self.fits,
            "memory_gb": {
                "params": w.params_bytes / GB,
                "grads": w.grads_bytes / GB,
                "optimizer": w.optimizer_bytes / GB,
                "activations": w.activations_total / GB,
                "total": w.total / GB,
                "loss_buffer": w.loss_bytes / GB,
                "capacity": self.cfg.cluster.memory_gb,
                "stage": w.stage,
                "all_ranks": self.all_ranks_bytes / GB,
            },
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hfu_tflops_per_gpu": self.hfu_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "bubble": self.bubble,
        }

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        out = self.summary()
        out["warnings"] = list(self.warnings)
        if self.hetero is not None:
            out["heterogeneous"] = self.hetero.to_json()
        out["layout"] = {
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "micro_batch_size": lay.micro_batch_size,
            "micro_batches": lay.micro_batches,
            "virtual_stages": lay.virtual_stages,
            "pipeline": lay.pipeline,
            "recompute": lay.recompute,
            "zero": lay.zero,
            "world_size": lay.world_size,
            "ep": lay.ep,
            "cp": lay.cp,
        }
        m = self.cfg.model
        out["model"] = {
            "name": m.name,
            "arch": m.arch.value,
            "params": total_params(m),
            "active_params": active_params(m),
            "flops_per_token": model_flops_per_token(m),
        }
        out["experts"] = experts.summary(
            self.cfg,
            lay,
            [s.params for s in self.stages],
            step_time.a2a_seconds(self.cfg, lay),
            step_time.a2a_link(self.cfg, lay),
        )
        exposed, traffic = step_time.kv_traffic(self.cfg, lay)
        hidden = 1 - exposed / traffic if traffic else 0.0
        out["context"] = context.summary(self.cfg, lay, exposed, hidden, step_time.kv_link(self.cfg, lay))
        out["time_s"] = dict(self.breakdown)
        out["stages"] = [
            {
                "stage": s.stage,
                "blocks": s.params.blocks,
                "params": s.params.total,
                "expert_params": s.params.experts,
                "in_flight": s.in_flight,
                "time_per_micro_batch_s": t.total,
                "memory_gb": {
                    "params": s.params_bytes / GB,
                    "grads": s.grads_bytes / GB,
                    "optimizer": s.optimizer_bytes / GB,
                    "activations": s.activations_total / GB,
                    "total": s.total / GB,
                },
            }
            for s, t in zip(self.stages, self.stage_times)
        ]
        out["assumptions"] = assumptions(self.cfg, self.layout)
        out["notes"] = list(self.notes)
        out["float8_speedup"] = self.float8_speedup
        if self.ranking:
            out["ranking"] = [{**r.to_json()["layout"], **r.summary()} for r in self.ranking]
        if self.hetero_ranking:
            out["heterogeneous_ranking"] = [p.to_json() for p in self.hetero_ranking]
        return out

    def render(self) -> str:
        return render(self)


def evaluate(
    cfg: Config,
    layout: Layout | None = None,
    check: bool = True,
    accepted: bool = False,
    params: list[StageParams] | None = None,
) -> Prediction:
    """Memory and time of ``cfg`` (its layout, or ``layout``); ``check`` adds the warnings and notes, among
    them whether p3d-train would refuse the config, unless ``accepted`` (p3d-train has built its run plan).
    ``params``: the layout's ``shapes.stage_params``, where the caller has them already (mesh=auto)."""
    layout = layout or layout_of(cfg)
    stages = memory.stage_memory(cfg, layout, params)
    times = step_time.stage_times(cfg, layout, [s.params for s in stages])
    slow = max(range(layout.pp), key=lambda i: times[i].total)
    t_mb = times[slow].total
    idle = schedule_bubble(layout.pipeline, layout.pp, layout.micro_batches, layout.virtual_stages)
    fill = layout.micro_batches * idle / (1 - idle)  # micro-batch times of fill and drain: idle = fill / (m + fill)
    tails = []
    for mem, t in zip(stages, times):
        traffic = step_time.dp_seconds(cfg, layout, mem.params)
        dp = step_time.dp_exposed(cfg, layout, mem.params, traffic, t)
        tails.append((dp + step_time.optimizer_seconds(cfg, layout, mem.params), dp, traffic))
    tail, dp_exposed, dp_traffic = max(tails)
    tied = step_time.tied_seconds(cfg, layout)
    m = layout.micro_batches
    mach = machine_of(cfg)
    per_mb, per_step = mach.overhead(executor_of(layout))
    overhead = m * per_mb + per_step
    step = (m + fill) * t_mb + tail + tied + overhead
    contention = 0.0
    if mach.cores is not None and layout.world_size > mach.cores:  # more ranks than cores: the work over the cores
        contention = max(0.0, busy_seconds(layout, times, tails, tied, overhead) / mach.cores - step)
        step += contention
    breakdown = {
        "compute": m * times[slow].compute,
        "recompute": m * times[slow].recompute,
        "tp_comm": m * times[slow].tp_comm,
        "pp_comm": m * times[slow].pp_comm,
        "a2a_comm": m * times[slow].a2a,
        "kv_comm": m * times[slow].kv,
        "pipeline_idle": fill * t_mb,
        "dp_comm": dp_exposed,
        "optimizer": tail - dp_exposed,
        "tied_embedding": tied,
        "step": step,
    }
    for key, value in (("overhead", overhead), ("contention", contention)):
        if value > 0:  # a calibrated machine's executor overhead, and the cores' time-sharing on cpu
            breakdown[key] = value
    report = Prediction(cfg, layout, stages, times, step, breakdown, dp_traffic_s=dp_traffic)
    if check:
        report.warnings, report.notes = verdict(report, accepted)
        report.notes += mach.notes(layout)
    return report


def busy_seconds(
    layout: Layout,
    times: list[step_time.StageTime],
    tails: list[tuple[float, float, float]],
    tied: float,
    overhead: float,
) -> float:
    """Seconds of work of all ranks together in one step: each stage's tp x cp x dp ranks run its m micro batches
    and its tail (dp traffic, optimizer), both ends the tied all-reduce, every rank the executor's overhead. A rank
    blocked in a gloo receive or collective sleeps and gives its core away, so with more ranks than cores the step
    takes at least this over the cores (the work bound of list scheduling: Brent, 1974; docs/planner.md)."""
    ranks = layout.tp * layout.dp_cp
    work = sum(layout.micro_batches * t.total + tail for t, (tail, *_) in zip(times, tails))
    return ranks * work + (2 * tied if tied else 0.0) + layout.world_size * overhead
