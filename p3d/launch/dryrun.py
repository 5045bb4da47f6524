"""``dry_run=true``: build every pipeline stage of every (pp, tp) coordinate on torch's meta device.

No worker, no process group, no memory: it shows the mesh map (rank -> dp, pp, cp (when > 1), tp -> node, local
device; inside a Slurm allocation with the run's node count, each node's hostname too), the layers
of each stage and the exact parameter count of each rank, and checks that the shards add up to the
closed-form count of the model. An MoE model's ranks also show their routed experts' share (E / ep experts of
each MoE block; the ep ranks of dp hold the others, as many) beside the dense parameters. Last, each stage's memory
per rank as the planner models it (p3d.planner.memory.stage_memory, p3d-plan's table): the same on every dp, cp
and tp rank of a stage, with cp > 1 for s / cp tokens of each sequence; and whether it fits, the verdict of the
launch's pre-flight (p3d.planner.verdict.fit_refusal): a layout the launch refuses, its dry run refuses too, with
the same line and exit status.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p3d.config.schema import Launcher
from p3d.console import human_count
from p3d.layout.geometry import active_params, rank_chunks, stage_bounds, total_params
from p3d.layout.hetero import group_of_node
from p3d.parallel.experts.params import is_expert_param
from p3d.parallel.mesh import Mesh
from p3d.parallel.tp.layers import owned_by_tp_rank
from p3d.pipeline.specs import layer_specs_of
from p3d.planner import predict
from p3d.planner.memory import StageMemory
from p3d.planner.predict import Prediction
from p3d.planner.render import memory_table, memory_unit
from p3d.planner.verdict import fit_refusal, headroom_warning

if TYPE_CHECKING:
    from p3d.config.schema import Config
    from p3d.layout.run_plan import RunPlan

MAX_MAP_ROWS = 64


@dataclass
class DryRunReport:
    cfg: Config
    plan: RunPlan
    # rank, dp, pp, cp, tp, node, local device
    mesh_map: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    stage_layers: list[list[str]] = field(default_factory=list)  # per stage, or per chunk under a torch schedule
    rank_chunks: list[list[int]] = field(default_factory=list)  # pp rank -> its chunks (torch schedules only)
    params: dict[tuple[int, int], int] = field(default_factory=dict)  # (pp, tp) -> parameters on that rank
    padding: dict[tuple[int, int], int] = field(default_factory=dict)  # (pp, tp) -> vocab padding entries
    owned: dict[tuple[int, int], int] = field(default_factory=dict)  # (pp, tp) -> its share of the model
    experts: dict[tuple[int, int], int] = field(default_factory=dict)  # (pp, tp) -> routed experts' parameters
    node_names: list[str] = field(default_factory=list)  # node index -> hostname, inside a Slurm allocation
    memory: list[StageMemory] = field(default_factory=list)  # per stage, one rank's bytes (p3d.planner.memory)
    prediction: Prediction | None = None  # the planner's model of the run, as the launch's pre-flight makes it

    @property
    def refusal(self) -> str | None:
        """The line the launch would refuse this layout with (predicted not to fit), or None."""
        return fit_refusal(self.prediction) if self.prediction is not None else None

    @property
    def total(self) -> int:
        """The model's parameters from the shards: each sharded slice once, each replicated tensor
        (norms: on every tp rank; a tied embedding: on the first and last stage) once, no padding."""
        return sum(self.owned.values())

    @property
    def closed_form(self) -> int:
        return total_params(self.cfg.model)

    def render(self) -> str:
        plan, cfg = self.plan, self.cfg
        cp = plan.cp > 1
        out = [
            f"dry run: {cfg.model.name} on {plan.dims.describe()}, {plan.procs_per_node} per node",
            "",
            f"mesh map (rank: dp pp {'cp ' if cp else ''}tp -> node/local device)",
        ]
        if self.node_names:
            out[-1] += f"; node i is host i of the allocation: {' '.join(self.node_names)}"
        groups = cfg.cluster.groups
        if groups:  # a heterogeneous cluster: the groups take the nodes in order (p3d.layout.hetero)
            out[-2:-2] = [f"cluster.groups: {_nodes_of_groups(cfg.cluster)}"]
        for rank, dp, pp, c, tp, node, local in self.mesh_map[:MAX_MAP_ROWS]:
            host = f" ({self.node_names[node]})" if self.node_names else ""
            if groups:
                host += f" group {group_of_node(cfg.cluster, node)}"
            where = f"dp {dp:>3} pp {pp:>3}" + (f" cp {c:>3}" if cp else "") + f" tp {tp:>2}"
            out.append(f"  rank {rank:>5}: {where} -> node {node:>3}{host} device {local}")
        if len(self.mesh_map) > MAX_MAP_ROWS:
            rule = "((pp * dp_size + dp) * cp_size + cp) * tp_size + tp" if cp else "(pp * dp_size + dp) * tp_size + tp"
            out.append(f"  ... {len(self.mesh_map) - MAX_MAP_ROWS} more ranks (rank = {rule})")
        if self.rank_chunks:  # a torch schedule: pp x v chunks, each rank's in the order of its stages
            pipe = f"schedule.pipeline={cfg.schedule.pipeline.value}"
            out += ["", f"chunks of {pipe} (layers of the flat pipeline list), per pp rank"]
            for pp, chunks in enumerate(self.rank_chunks):
                for c in chunks:
                    out.append(f"  pp {pp:>3} chunk {c:>3}: {_compact(self.stage_layers[c])}")
        else:
            out += ["", "stages (layers of the flat pipeline list)"]
            for s, names in enumerate(self.stage_layers):
                out.append(f"  stage {s:>3}: {_compact(names)}")
        moe = cfg.model.moe
        if moe is None:
            out += ["", "parameters per rank (same on every dp replica)"]
        else:
            out += [
                "",
                f"parameters per rank (dense: the same on every dp replica; experts: {moe.n_experts // plan.ep} of the "
                f"{moe.n_experts} routed experts of each MoE block, the other ep ranks of dp holding the rest)",
            ]
        for (pp, tp), n in sorted(self.params.items()):
            note = f" (incl. {self.padding[(pp, tp)]:,} vocab padding)" if self.padding.get((pp, tp)) else ""
            if moe is not None:
                e = self.experts[(pp, tp)]
                note = f" = dense {n - e:,} + experts {e:,}" + note
            out.append(f"  pp {pp:>3} tp {tp:>2}: {n:>15,}{note}")
        out += [
            "",
            f"total from shards: {self.total:,} ({human_count(self.total)}); closed form: {self.closed_form:,}; "
            f"{'match' if self.total == self.closed_form else 'MISMATCH'}",
        ]
        if cfg.model.moe is not None:
            active = active_params(cfg.model)
            out.append(
                f"active per token (top-{cfg.model.moe.top_k} routed experts): {active:,} ({human_count(active)})"
            )
        return "\n".join(out + self._memory_lines())

    def _memory_lines(self) -> list[str]:
        """Each stage's memory per rank, p3d-plan's table (the planner's model), and the most loaded rank's total."""
        if not self.memory:
            return []
        cfg, plan = self.cfg, self.plan
        worst = max(self.memory, key=lambda s: s.total)
        unit, scale = memory_unit(worst.total)
        capacity, gpus = cfg.cluster.memory_gb, cfg.cluster.gpus_per_node is not None
        tokens = f", {cfg.model.seq_len // plan.cp:,} tokens of each sequence" if plan.cp > 1 else ""
        if capacity is None:
            room = ""
        else:  # a GPU's own memory, or the host's that cpu workers share (p3d-plan compares their sum)
            room = f"; {capacity:g} GB per GPU" if gpus else f"; the {plan.world_size} workers share {capacity:g} GB"
        out = [
            "",
            f"memory per rank ({unit}; p3d.planner's model, the same on every dp{', cp' if plan.cp > 1 else ''} and tp "
            f"rank of a stage{tokens}{room})",
            *memory_table(self.memory, self.memory, scale),
        ]
        p = self.prediction
        if p is not None:
            verdict = "fits" if p.fits else "DOES NOT FIT"
            if not p.fits and cfg.plan.force:
                verdict += " (plan.force=true: p3d-train launches it anyway)"
            need = p.all_ranks_bytes if p.shared_host else p.worst.total  # what the pre-flight compares
            need_unit, need_scale = memory_unit(need)
            where = f"{need / need_scale:.2f} {need_unit} of {capacity:g} GB " + (
                f"for the {plan.world_size} workers together" if p.shared_host else "on the most loaded rank"
            )
            out.append(f"  -> {verdict}: {where}")
            crowded = headroom_warning(p)
            if crowded is not None:
                out.append(f"warning: {crowded}")
            if p.hetero is not None:  # the split over the groups that this run starts with, and its prediction
                out += ["", p.hetero.render(cfg.model.seq_len)]
        return out


def _nodes_of_groups(c) -> str:
    """``nodes 0-0: group 0 (1 x h100_sxm); nodes 1-1: group 1 (1 x a100_80gb)``."""
    parts, first = [], 0
    for i, g in enumerate(c.groups):
        parts.append(
            f"node{'s' if g.nodes > 1 else ''} {first}{f'-{first + g.nodes - 1}' if g.nodes > 1 else ''}: "
            f"group {i} ({g.nodes} x {g.device})"
        )
        first += g.nodes
    return "; ".join(parts)


def _compact(names: list[str]) -> str:
    """embed, block0..block9 (10 blocks), final_norm, head"""
    out, run = [], []
    for n in names + [""]:
        if n.startswith("block"):
            run.append(n)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]} ({len(run)} blocks)")
            run = []
        if n:
            out.append(n)
    return ", ".join(out)


def allocation_hosts(cfg, plan) -> list[str]:
    """The hosts of the Slurm allocation this runs in (node i of the mesh map runs on host i, as the
    recipe's srun places tasks: block by block, in node-list order), when it has the run's node count."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if cfg.cluster.launcher != Launcher.slurm or not nodelist:
        return []
    from p3d.jobs.slurm.step import hostnames

    try:
        hosts = hostnames(nodelist)
    except (OSError, subprocess.SubprocessError):
        return []
    return hosts if len(hosts) * plan.procs_per_node == plan.world_size else []


def dry_run(cfg, plan) -> DryRunReport:
    report = DryRunReport(cfg, plan)
    report.node_names = allocation_hosts(cfg, plan)
    dims = plan.dims
    for rank in range(plan.world_size):
        dp, pp, tp = dims.coords_of(rank)
        report.mesh_map.append((rank, dp, pp, dims.cp_of(rank), tp, dims.node_of(rank), dims.local_rank_of(rank)))
    bounds, chunks_of = plan.stage_bounds, [[pp] for pp in range(plan.pp)]
    pipeline = cfg.schedule.pipeline.value
    if pipeline != "1f1b":  # the torch schedules' chunks (docs/schedules.md, Placement)
        from p3d.layout.schedule_rules import V_SHAPED, chunks_per_rank

        v, style = chunks_per_rank(cfg), "v" if pipeline in V_SHAPED else "loop"
        given = list(cfg.schedule.stage_blocks) if len(cfg.schedule.stage_blocks) == plan.pp * v else None
        bounds = stage_bounds(cfg.model.n_layers, plan.pp, cfg.schedule.partition, cfg.model, v, style, given)
        chunks_of = [rank_chunks(plan.pp, v, style, pp) for pp in range(plan.pp)]
        report.rank_chunks = chunks_of
    report.stage_layers = [plan.layer_names[bounds[s] : bounds[s + 1]] for s in range(len(bounds) - 1)]
    for pp in range(plan.pp):
        for tp in range(plan.tp):
            mesh = Mesh.from_plan(plan, dims.rank_of(0, pp, tp))
            specs = layer_specs_of(cfg, plan, mesh)
            n = pad = owned = experts = 0
            built_tied: set[str] = set()
            with torch.device("meta"):
                for idx in (i for c in chunks_of[pp] for i in range(bounds[c], bounds[c + 1])):
                    spec = specs[idx]
                    key = getattr(spec, "key", None)
                    if key is not None and key in built_tied:
                        continue  # one tied module per rank, as in DeepSpeed's PipelineModule and ChunkModule
                    module = spec.build()
                    if key is not None:
                        built_tied.add(key)
                    padding = getattr(module, "padding_numel", 0)
                    n += sum(p.numel() for p in module.parameters())
                    routed = sum(p.numel() for p in module.parameters() if is_expert_param(p))
                    experts += routed
                    pad += padding
                    if key is not None and _first_stage_of(specs, bounds, key) not in chunks_of[pp]:
                        continue  # the tied copy on the last stage is owned by the first
                    # every ep rank holds its own share of the routed experts, as large as this one's
                    owned += sum(p.numel() for p in module.parameters() if owned_by_tp_rank(p, tp)) - padding
                    owned += routed * (plan.ep - 1)
            report.params[(pp, tp)], report.padding[(pp, tp)], report.owned[(pp, tp)] = n, pad, owned
            report.experts[(pp, tp)] = experts
    report.prediction = predict(cfg, plan)  # the pre-flight's model of this run plan
    report.memory = report.prediction.stages
    return report


def _first_stage_of(specs, bounds, key) -> int:
    for s in range(len(bounds) - 1):
        if any(getattr(specs[i], "key", None) == key for i in range(bounds[s], bounds[s + 1])):
            return s
    raise ValueError(key)
