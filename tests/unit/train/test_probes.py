"""The calibration's compute probes (p3d.train.probes, issue 36): timed in rounds, each recompute mode as the run
has it."""

from __future__ import annotations

import pytest
import torch

from p3d.train import probes
from tests.helpers.runs import compose_config


class FakeClock:
    """perf_counter for the probes: work advances it by its cost times the machine's slowdown of the moment."""

    def __init__(self) -> None:
        self.now, self.slowdown = 0.0, 1.0

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds * self.slowdown


def test_a_slow_stretch_falls_on_every_probe_alike_and_moves_no_median(monkeypatch):
    """Five rounds of three passes; the machine is 40 % slower through all of round 1 (a slow stretch). Each
    run's medians are its own costs, and every run saw the stretch: the rounds interleave the runs."""
    clock = FakeClock()
    monkeypatch.setattr(probes.time, "perf_counter", clock)
    order: list[int] = []

    class Tick(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd, bwd):
            clock.work(fwd)
            ctx.bwd = bwd
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            clock.work(ctx.bwd)
            return grad, None, None

    costs = [(0.024, 0.045), (0.024, 0.070), (0.030, 0.050)]  # (fwd, bwd): none, full, selective of one block

    def run_of(i: int):
        x = torch.ones(2, requires_grad=True)

        def run() -> torch.Tensor:
            order.append(i)
            return Tick.apply(x, *costs[i])

        return run

    slow_seen = set()

    def gate(name: str) -> None:
        clock.slowdown = 1.4 if name.startswith("r1") else 1.0
        if name.startswith("r1"):
            slow_seen.add(int(name.split("p")[1]))

    timed = probes.fwd_bwd_rounds([run_of(i) for i in range(3)], reps=3, rounds=5, sync=lambda: None, gate=gate)
    assert timed == [pytest.approx(c) for c in costs]
    assert slow_seen == {0, 1, 2}
    assert order[:12] == [0] * 4 + [1] * 4 + [2] * 4  # round 0: a warm-up pass each, then three
    assert order[12:21] == [0] * 3 + [1] * 3 + [2] * 3 and len(order) == 12 + 4 * 9


def test_each_block_probe_runs_its_own_recompute_mode_whatever_ran_before():
    """The block probes of one tp share a block: each run sets the recompute flags it is timed under. What the
    forward keeps for backward tells the modes apart: full (torch's checkpoint or DeepSpeed's) keeps only the
    block's input, selective less than none (the attention core's tensors are recomputed)."""
    cfg = compose_config("model=tiny")
    block = probes.block_probes(cfg, 1, ["none", "full", "selective", "full_deepspeed"], "cpu")
    runs = {row["recompute"]: run for row, run in block}

    def kept(mode: str) -> int:
        numel = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal numel
            numel += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            runs[mode]()
        return numel

    first = {mode: kept(mode) for mode in ("selective", "full_deepspeed", "none", "full")}
    again = {mode: kept(mode) for mode in ("none", "full", "selective", "full_deepspeed")}
    assert first == again
    assert max(first["full"], first["full_deepspeed"]) < first["selective"] < first["none"]
