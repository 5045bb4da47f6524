"""Plans for a heterogeneous cluster (``cluster.groups``, docs/clusters.md): which group each stage and replica sits
on, how many blocks each pipeline stage holds and how many micro batches each dp replica runs.

Ranks fill the nodes block by block and the groups take the nodes in order (p3d.layout.hetero), so a layout fixes
the group of every (replica, stage) pair: the slowest group among its tp x cp ranks. Each pair's seconds per micro
batch come from the homogeneous model (p3d.planner.step_time) run on its group's device, for the layers the split
gives it; under ``plan.block_seconds`` (the sleep-timed blocks of ``P3D_TEST_BLOCK_SECONDS``) every block also
takes that x the group's slowdown in each of its F, B and W pieces (p3d.planner.step_time.block_sleep_seconds).

One replica of stage times t_s running m micro batches takes sum(t_s) + (m - 1) max(t_s) (fill, then the slowest
stage paces the rest: a flow shop of identical jobs); the step is the slowest replica's, plus the slowest rank's
dp reduction and optimizer. The planner

- cuts the blocks so that the slowest stage is as fast as it can be (the smallest pace T at which every stage's
  blocks fit in T, within its group's memory), one chunk per rank (1f1b, gpipe);
- gives each replica its micro batches one at a time to whichever finishes soonest with it (optimal for
  identical jobs on machines of different speeds), keeping the global batch and at least pp each;
- keeps the uniform split where it is not slower, so a plan is never worse than it on paper;
- and compares with the ideal: the sum of the groups' throughputs, each group's the homogeneous layout's on its
  device, in proportion to its share of the ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from p3d.config.devices import DEVICES, DeviceName
from p3d.config.schema import ClusterGroup, Config
from p3d.layout.dims import ParallelDims
from p3d.layout.hetero import group_of_node, nominal_tflops
from p3d.planner import memory, step_time
from p3d.planner.shapes import Layout, apply_layout, stage_params
from p3d.planner.verdict import HEADROOM

GB = 1e9


@dataclass
class HeteroPlan:
    """One layout on the groups: the split, its predicted step, the uniform split's and the ideal's, and each
    group's most loaded rank (bytes) against its memory."""

    layout: Layout
    stage_blocks: list[int]
    replica_micro_batches: list[int]
    step_s: float
    uniform_step_s: float
    ideal_step_s: float
    tokens_per_step: int
    stage_groups: list[list[int]]  # [replica][stage]: the group it runs on
    group_memory: list[tuple[str, float, float]] = field(default_factory=list)  # (name, most loaded, capacity)

    @property
    def fits(self) -> bool:
        return all(used <= cap for _, used, cap in self.group_memory)

    @property
    def crowded(self) -> bool:
        """Some group's most loaded rank uses more than ``verdict.HEADROOM`` of its memory (mesh=auto ranks these
        last: what the plan leaves out takes some GB)."""
        return any(used > HEADROOM * cap for _, used, cap in self.group_memory)

    @property
    def gap(self) -> float:
        """How far the step is from the ideal's: step / ideal - 1 (0: the sum of the groups' throughputs)."""
        return self.step_s / self.ideal_step_s - 1

    def to_json(self) -> dict:
        return {
            "layout": dataclasses.asdict(self.layout),
            "stage_blocks": self.stage_blocks,
            "replica_micro_batches": self.replica_micro_batches,
            "step_time_s": self.step_s,
            "uniform_step_time_s": self.uniform_step_s,
            "ideal_step_time_s": self.ideal_step_s,
            "gap_to_ideal": self.gap,
            "tokens_per_s": self.tokens_per_step / self.step_s,
            "stage_groups": self.stage_groups,
            "group_memory_gb": [
                {"group": n, "most_loaded": u / GB, "capacity": c / GB} for n, u, c in self.group_memory
            ],
            "fits": self.fits,
        }

    def render(self, seq_len: int) -> str:
        lines = [
            f"heterogeneous plan: {self.layout.describe(seq_len)}",
            f"  schedule.stage_blocks={self.stage_blocks} schedule.replica_micro_batches={self.replica_micro_batches}",
            "  groups of each replica's stages: " + "; ".join(" ".join(map(str, row)) for row in self.stage_groups),
            "  memory per group (GB, most loaded rank / capacity):",
        ]
        lines += [f"    {name:<24} {used / GB:8.2f} / {cap / GB:.0f}" for name, used, cap in self.group_memory]
        lines += [
            f"  step {self.step_s:.4f} s ({self.tokens_per_step / self.step_s:,.0f} tokens/s); uniform split "
            f"{self.uniform_step_s:.4f} s ({self.uniform_step_s / self.step_s:.2f}x slower)",
            f"  ideal (the sum of the groups' throughputs) {self.ideal_step_s:.4f} s: gap to the ideal {self.gap:+.1%}",
            f"  -> {'fits' if self.fits else 'does NOT fit'} every group's memory",
        ]
        return "\n".join(lines)


def group_config(cfg: Config, g: ClusterGroup) -> Config:
    """``cfg`` as a homogeneous cluster of group ``g``'s device (its numbers, its links, its calibration, and its
    ranks' ``plan.block_seconds``: the fastest group's stretched by its slowdown, as P3D_TEST_BLOCK_SECONDS is)."""
    preset = DEVICES[str(g.device)]
    fastest = max(nominal_tflops(other) for other in cfg.cluster.groups)
    sleep = cfg.plan.block_seconds and cfg.plan.block_seconds * fastest / nominal_tflops(g)
    cluster = dataclasses.replace(
        cfg.cluster,
        groups=[],
        device=DeviceName(str(g.device)),
        peak_tflops=g.peak_tflops or preset.peak_tflops,
        memory_gb=g.memory_gb or preset.memory_gb,
        intra_node_gbps=preset.intra_node_gbps,
        inter_node_gbps=preset.inter_node_gbps,
    )
    plan = dataclasses.replace(cfg.plan, block_seconds=sleep)
    return dataclasses.replace(cfg, cluster=cluster, plan=plan, calibration=g.calibration or cfg.calibration)


def pair_groups(cfg: Config, layout: Layout) -> list[list[int]]:
    """[replica][stage]: the group of each (dp replica, pp stage), the slowest among its tp x cp ranks."""
    c = cfg.cluster
    world = layout.world_size
    per_node = c.gpus_per_node or max(1, world // c.nodes)
    dims = ParallelDims(layout.tp, layout.pp, layout.dp, per_node, cp=layout.cp)
    rate = [nominal_tflops(g) for g in c.groups]
    out = []
    for d in range(layout.dp):
        row = []
        for s in range(layout.pp):
            ranks = [dims.rank_of(d, s, t, k) for t in range(layout.tp) for k in range(layout.cp)]
            groups = {group_of_node(c, min(dims.node_of(r), c.nodes - 1)) for r in ranks}
            row.append(min(groups, key=lambda i: rate[i]))
        out.append(row)
    return out


class Costs:
    """Seconds per micro batch and bytes of each stage on each group, for any split of the blocks."""

    def __init__(self, cfg: Config, layout: Layout):
        cfg = apply_layout(cfg, layout)  # the layout's schedule, recompute and ZeRO stage
        self.cfg, self.layout = cfg, layout
        self.group_cfgs = [group_config(cfg, g) for g in cfg.cluster.groups]
        rate = [nominal_tflops(g) for g in cfg.cluster.groups]
        self.slowdown = [max(rate) / r for r in rate]
        self._cache: dict[tuple, tuple[list[float], list[float], list[float]]] = {}
        # the tied embedding's all-reduce between the first and the last stage, on the slowest group's links
        self.tied = max(step_time.tied_seconds(g, layout) for g in self.group_cfgs)

    def stages(self, blocks: tuple[int, ...], group: int, m: int) -> tuple[list[float], list[float], list[float]]:
        """(seconds per micro batch, seconds of dp reduction and optimizer, bytes) of each stage on ``group``
        with ``blocks`` per stage (() : the partition's split) and m micro batches in the replica."""
        key = (blocks, group, m)
        if key not in self._cache:
            cfg = self.group_cfgs[group]
            cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, stage_blocks=list(blocks)))
            lay = dataclasses.replace(self.layout, micro_batches=m)
            params = stage_params(cfg, lay)
            mems = memory.stage_memory(cfg, lay, params)
            times = step_time.stage_times(cfg, lay, params)
            per_mb = [t.total for t in times]  # the blocks' sleeps (plan.block_seconds) included
            tails = []
            for p, t in zip(params, times):
                dp = step_time.dp_exposed(cfg, lay, p, step_time.dp_seconds(cfg, lay, p), t)
                tails.append(dp + step_time.optimizer_seconds(cfg, lay, p))
            self._cache[key] = (per_mb, tails, [mm.total for mm in mems])
        return self._cache[key]

    def step(self, blocks: list[int], counts: list[int], groups: list[list[int]]) -> float:
        """The step's seconds: the slowest replica's pipeline, then the slowest rank's tail."""
        replicas, tail = [], 0.0
        for d, m in enumerate(counts):
            t, tails = [], []
            for s, g in enumerate(groups[d]):
                per_mb, tail_s, _ = self.stages(tuple(blocks), g, m)
                t.append(per_mb[s])
                tails.append(tail_s[s])
            replicas.append(sum(t) + (m - 1) * max(t))
            tail = max(tail, *tails)
        return max(replicas) + tail + self.tied

    def even_step(self, blocks: list[int], m: float, groups: list[list[int]]) -> float:
        """The step of every replica running ``m`` micro batches, m the global batch's share of a replica (a fraction
        where the batch does not divide over dp: the layout's throughput as if it did)."""
        whole = max(1, round(m))
        replicas, tail = [], 0.0
        for row in groups:
            t = [self.stages(tuple(blocks), g, whole)[0][s] for s, g in enumerate(row)]
            replicas.append(sum(t) + (m - 1) * max(t))
            tail = max(tail, *(self.stages(tuple(blocks), g, whole)[1][s] for s, g in enumerate(row)))
        return max(replicas) + tail + self.tied

    def memory(self, blocks: list[int], counts: list[int], groups: list[list[int]]) -> list[tuple[str, float, float]]:
        """Each group's most loaded rank (bytes) and capacity."""
        used = [0.0] * len(self.group_cfgs)
        for d, m in enumerate(counts):
            for s, g in enumerate(groups[d]):
                used[g] = max(used[g], self.stages(tuple(blocks), g, m)[2][s])
        out = []
        for i, group in enumerate(self.cfg.cluster.groups):
            cap = float(self.group_cfgs[i].cluster.memory_gb or 0) * GB
            out.append((f"{i}: {group.nodes} x {group.device}", used[i], cap))
        return out


def even_counts(total: int, dp: int) -> list[int]:
    return [total // dp + (1 if d < total % dp else 0) for d in range(dp)]


def cut_blocks(costs: Costs, groups: list[list[int]], m: int) -> list[int]:
    """Blocks per stage so that the slowest (replica, stage) is as fast as it can be: the smallest pace T at which
    the stages together hold every block, each at most what T and its group's memory allow."""
    n, pp = costs.cfg.model.n_layers, costs.layout.pp
    even = tuple(even_counts(n, pp))
    if pp == 1:
        return [n]
    per_block, fixed, cap_blocks = [], [], []
    for s in range(pp):
        worst_g = max({groups[d][s] for d in range(len(groups))}, key=lambda g: costs.slowdown[g])
        one = costs.stages(even, worst_g, m)[0][s]
        blocks_here = even[s]
        bare = tuple(0 if i == s else b + (even[s] if i == (s + 1) % pp else 0) for i, b in enumerate(even))
        zero = costs.stages(bare, worst_g, m)[0][s]  # the stage without blocks: embedding, head, sends
        per_block.append((one - zero) / blocks_here if blocks_here else one)
        fixed.append(zero)
        _, _, mem0 = costs.stages(bare, worst_g, m)
        _, _, mem1 = costs.stages(even, worst_g, m)
        grow = (mem1[s] - mem0[s]) / blocks_here if blocks_here else 0.0
        cap = float(costs.group_cfgs[worst_g].cluster.memory_gb or 0) * GB
        cap_blocks.append(n if grow <= 0 else max(0, int((cap - mem0[s]) // grow)))
    paces = sorted({fixed[s] + k * per_block[s] for s in range(pp) for k in range(n + 1)})
    for pace in paces:
        most = [
            min(cap_blocks[s], int((pace - fixed[s]) / per_block[s] + 1e-9)) if pace >= fixed[s] else -1
            for s in range(pp)
        ]
        most = [max(0, k) for k in most]
        if (pp > 2 and min(most[1:-1]) < 1) or sum(most) < n:
            continue
        blocks, extra = list(most), sum(most) - n
        for s in sorted(range(pp), key=lambda i: -(fixed[i] + blocks[i] * per_block[i])):  # trim the slowest first
            take = min(extra, blocks[s] - (1 if 0 < s < pp - 1 else 0))
            blocks[s] -= take
            extra -= take
        return blocks
    return list(even)


def share_micro_batches(costs: Costs, blocks: list[int], groups: list[list[int]], total: int, least: int) -> list[int]:
    """Micro batches per replica: ``least`` each, then one at a time to the replica that finishes soonest with it."""
    dp = len(groups)
    pace, fill = [], []
    for d in range(dp):
        t = [costs.stages(tuple(blocks), g, total // dp)[0][s] for s, g in enumerate(groups[d])]
        pace.append(max(t))
        fill.append(sum(t) - max(t))
    counts = [least] * dp
    for _ in range(total - least * dp):
        d = min(range(dp), key=lambda i: fill[i] + (counts[i] + 1) * pace[i])
        counts[d] += 1
    return counts


def plan_layout(cfg: Config, layout: Layout, as_given: bool = False) -> HeteroPlan:
    """The split of ``layout`` on cfg's groups (``schedule.stage_blocks`` / ``replica_micro_batches`` as given, or
    planned where empty; ``as_given``: the even split where empty, the run p3d-train starts), its step, the uniform
    split's and the ideal's. Uneven micro batch counts run on torch's executor (``schedule_rules.engine_runs``), so
    a split that gives the replicas different counts is costed on it, and an even one on the layout's own."""
    costs = {uneven: Costs(cfg, dataclasses.replace(layout, uneven=uneven)) for uneven in (False, True)}

    def costs_of(counts: list[int]) -> Costs:
        return costs[len(set(counts)) > 1]

    groups = pair_groups(cfg, layout)
    total = cfg.schedule.global_batch_size // layout.micro_batch_size
    least = 2 * layout.pp if layout.pipeline == "dualpipev" else layout.pp
    uniform_blocks, uniform_counts = even_counts(cfg.model.n_layers, layout.pp), even_counts(total, layout.dp)
    uniform = costs_of(uniform_counts).step(uniform_blocks, uniform_counts, groups)
    blocks, counts = list(cfg.schedule.stage_blocks), list(cfg.schedule.replica_micro_batches)
    if as_given:
        blocks, counts = blocks or uniform_blocks, counts or uniform_counts
    # p3d-train refuses uneven counts under ZeRO-3 and expert parallelism; interleaving's rounds need m % (m // pp)
    splits_batch = layout.zero < 3 and layout.ep == 1 and layout.virtual_stages == 1 and total >= least * layout.dp
    planning = costs[bool(counts and len(set(counts)) > 1) or (not counts and splits_batch)]
    if not blocks:
        blocks = cut_blocks(planning, groups, total // layout.dp) if layout.virtual_stages == 1 else uniform_blocks
    if not counts:
        counts = share_micro_batches(planning, blocks, groups, total, least) if splits_batch else uniform_counts
    step = costs_of(counts).step(blocks, counts, groups)
    if not (cfg.schedule.stage_blocks or cfg.schedule.replica_micro_batches) and step >= uniform:
        blocks, counts, step = uniform_blocks, uniform_counts, uniform  # the uniform split is always a candidate
    # the ideal: each group's throughput on the homogeneous layout (the batch's share of a replica, even where it
    # does not divide over dp) and the split's executor, in proportion to its share of the ranks
    nodes, share = sum(g.nodes for g in cfg.cluster.groups), total / layout.dp
    rate = sum(
        g.nodes / nodes / costs_of(counts).even_step(uniform_blocks, share, [[i] * layout.pp] * layout.dp)
        for i, g in enumerate(cfg.cluster.groups)
    )
    tokens = cfg.schedule.global_batch_size * cfg.model.seq_len
    mem = costs_of(counts).memory(blocks, counts, groups)
    ran = dataclasses.replace(layout, micro_batches=max(counts), uneven=len(set(counts)) > 1)
    return HeteroPlan(ran, blocks, counts, step, uniform, 1 / rate, tokens, groups, mem)
