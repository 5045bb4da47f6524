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
import math
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


def ranking_table(plans: list[HeteroPlan]) -> list[str]:
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


# mesh=auto over groups (``plan_groups``): a layout is split only while its homogeneous time for the global batch is
# within 1 / UNDER_IDEAL of the best split's so far (a split beats its layout's homogeneous time by evening out its
# stages and, for uneven micro batches, on torch's executor, whose dp buckets overlap the backward: up to ~25 %), and
# at most MAX_SPLITS layouts are split (about 4 ms each)
UNDER_IDEAL = 0.7
# the other layouts of a set of degrees and micro batch size: split while their estimate (the set's first split scaled
# by their homogeneous time) is within 1 / SAME_SET of the best split
SAME_SET = 0.9
MAX_SPLITS = 600


def plan_groups(cfg: Config, ranked: list) -> list[HeteroPlan]:
    """``mesh=auto`` on a cluster of groups: the split of the layouts of the homogeneous ranking (``ranked``:
    predictions, fastest first; every micro batch size, schedule, recompute and ZeRO stage p3d-train accepts, and
    the layouts only an uneven split of the batch allows), best first: those that fit every group first, and of those
    the ones that leave every group 10 % of its memory (``crowded``).

    A layout's homogeneous time for the global batch on the groups' mean device is about its ideal, the sum of the
    groups' throughputs: the split reaches it where the batch leaves micro batches to move (a small micro batch) and
    stays at the uniform split where it does not. So the search splits, in the ranking's order, first the best layout
    of each set of degrees, micro batch size and what the split may move (where its freedom lies), then the other
    schedules, recomputes and ZeRO stages of each set, each while its estimated step is within reach of the best
    split so far."""
    batch = cfg.schedule.global_batch_size * cfg.model.seq_len
    sets: dict[tuple[int, ...], list] = {}
    for r in ranked:
        lay = r.layout
        # what the split may move (the blocks of one chunk per rank, the micro batches but under ZeRO-3) and the
        # homogeneous layout's executor (an uneven split runs on torch's, whose homogeneous time another set scales)
        moves = (lay.virtual_stages == 1, lay.zero < 3, lay.torch_executor)
        sets.setdefault((lay.tp, lay.cp, lay.pp, lay.dp, lay.ep, lay.micro_batch_size, *moves), []).append(r)
    plans: list[HeteroPlan] = []
    best = math.inf

    def split(r, bound: float) -> bool:
        """Split ``r``'s layout unless ``bound`` (a lower estimate of its split's step) is out of reach of the best
        split so far or the search is spent (False)."""
        nonlocal best
        if bound > best or len(plans) >= MAX_SPLITS:
            return False
        plans.append(plan_layout(cfg, r.layout))
        if plans[-1].fits:
            best = min(best, plans[-1].step_s)
        return True

    def homogeneous(r) -> float:
        return batch / r.tokens_per_s

    firsts = []
    for first, *_ in sets.values():  # each set's best layout, in the order of the sets' best
        if not split(first, UNDER_IDEAL * homogeneous(first)):
            break
        firsts.append(plans[-1])
    # the other layouts of the sets split: their split's step estimated as the set's first split's, scaled by their
    # homogeneous times, best first
    others = sorted(
        (
            (p.step_s * homogeneous(r) / homogeneous(first), r)
            for p, (first, *rest) in zip(firsts, sets.values())
            for r in rest
        ),
        key=lambda pair: pair[0],
    )
    for estimate, r in others:
        if not split(r, SAME_SET * estimate):
            break
    return sorted(plans, key=lambda p: (not p.fits, p.crowded, p.step_s))
