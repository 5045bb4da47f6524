"""``mesh=auto`` on a cluster of groups (``cluster.groups``, docs/clusters.md): the split of every layout the
homogeneous search allows, searched best first (p3d.planner.hetero splits one layout; p3d.planner.search ranks the
layouts and calls :func:`plan_groups`)."""

from __future__ import annotations

import math

from p3d.config.schema import Config
from p3d.planner.hetero import HeteroPlan, plan_layout
from p3d.planner.predict import Prediction

# mesh=auto over groups (``plan_groups``): a layout is split only while its homogeneous time for the global batch is
# within 1 / UNDER_IDEAL of the best split's so far (a split beats its layout's homogeneous time by evening out its
# stages and, for uneven micro batches, on torch's executor, whose dp buckets overlap the backward: up to ~25 %), and
# at most MAX_SPLITS layouts are split (about 4 ms each)
UNDER_IDEAL = 0.7
# the other layouts of a set of degrees and micro batch size: split while their estimate (the set's first split scaled
# by their homogeneous time) is within 1 / SAME_SET of the best split
SAME_SET = 0.9
MAX_SPLITS = 600


def plan_groups(cfg: Config, ranked: list[Prediction]) -> list[HeteroPlan]:
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
