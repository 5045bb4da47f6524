"""mesh=auto over cluster.groups (issue 64, item 7; p3d.planner.search.plan_groups): the heterogeneous search splits
every layout the homogeneous search allows (every micro batch size, schedule, recompute and ZeRO stage, and the
layouts only an uneven split of the batch runs), so it never settles on a micro batch that leaves nothing to move
where a smaller one splits faster. Held on cases the test does not choose (a seeded random sweep of the groups'
devices and speeds, node counts, the model and the global batch), in-process:

- its split is the fastest split of every layout (each planned by p3d.planner.hetero.plan_layout, the search's
  pruning checked against all of them; of those that leave every group 10 % of its memory, where any does), and
  never slower than its uniform split;
- where that split gives a replica 7 micro batches or more on average, it is within 15 % of its layout's ideal (the
  sum of the groups' throughputs): one micro batch of the fastest replica is then at most 1/7 of the step. Where
  it gives fewer, a smaller micro batch would split finer but is slower (the GEMM model: a micro batch of one
  8K-token sequence of a 1B model leaves an H100's SMs part idle), and the first property says so.
"""

from __future__ import annotations

import functools
import random

import pytest

from p3d.planner import predict
from p3d.planner.hetero import plan_layout
from p3d.planner.search import search
from tests.helpers.runs import compose_config

DEVICES = ("h100_sxm", "a100_80gb", "a100_40gb")
FINE = 7  # micro batches per replica from which the split is held within 15 % of the ideal
SEEDS = range(24)
FAST = range(6)  # make test: the first six cases (0.7-3 s each); the rest, and the exhaustive check, slow


def random_case(seed: int) -> tuple[str, ...]:
    """Two or three groups of 1-2 nodes of 4 GPUs, each a device at a random peak, a model, a global batch of 1/2
    to 8 sequences per GPU."""
    rng = random.Random(seed)
    groups, gpus = [], 0
    for device in rng.sample(DEVICES, rng.choice((2, 3))):
        nodes = rng.choice((1, 2))
        groups.append(f"{{device: {device}, nodes: {nodes}, peak_tflops: {rng.randint(100, 989)}}}")
        gpus += 4 * nodes
    batch = max(1, int(gpus * rng.choice((0.5, 1, 2, 4, 8))))
    model = rng.choice(("llama3_8b", "llama3_2_1b"))
    return (
        f"cluster.groups=[{', '.join(groups)}]",
        "cluster.gpus_per_node=4",
        "mesh=auto",
        f"model={model}",
        f"schedule.global_batch_size={batch}",
    )


@functools.cache
def planned(seed: int):
    cfg = compose_config(*random_case(seed))
    return cfg, predict(cfg).hetero


def per_replica(plan) -> float:
    return sum(plan.replica_micro_batches) / plan.layout.dp


def tiers(seeds, fast) -> list:
    return [pytest.param(s, id=f"seed{s}", marks=() if s in fast else pytest.mark.slow) for s in seeds]


@pytest.mark.parametrize("seed", tiers(SEEDS, FAST))
def test_a_split_of_many_micro_batches_is_near_the_ideal(seed):
    _, plan = planned(seed)
    assert plan.fits and plan.step_s <= plan.uniform_step_s
    if per_replica(plan) >= FINE:
        assert plan.gap <= 0.15, (plan.layout, plan.replica_micro_batches, plan.gap)


def test_the_fast_cases_split_fine_and_move_micro_batches():
    """make test's cases are not vacuous: some split fine enough for the bound, one of them unevenly."""
    fine = [planned(s)[1] for s in FAST if per_replica(planned(s)[1]) >= FINE]
    assert len(fine) >= 2 and any(len(set(p.replica_micro_batches)) > 1 for p in fine)


@pytest.mark.parametrize("seed", tiers(SEEDS, (2,)))  # make test: one case; the rest slow (2-14 s each)
def test_mesh_auto_over_groups_is_the_fastest_split_of_every_layout(seed):
    """The search's pruning loses nothing: every layout the homogeneous search allows, split, is no faster."""
    cfg, plan = planned(seed)
    every = [plan_layout(cfg, r.layout) for r in search(cfg)]
    roomy = [p for p in every if p.fits and not p.crowded] or [p for p in every if p.fits]  # 10 % to spare first
    fastest = min(roomy, key=lambda p: p.step_s)
    assert plan.step_s == pytest.approx(fastest.step_s, rel=1e-9), (plan.layout, fastest.layout)
