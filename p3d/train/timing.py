"""Measured pipeline bubble: the share of a step a stage spends blocked on its pipeline neighbours.

DeepSpeed's pipeline engine runs a step as a list of instructions (load, forward, backward,
send/recv of activations and gradients, reduce, optimizer step). We time the send/recv ones on this
rank: in 1F1B they are where a stage waits for the stage before or after it (the transfer itself is
small next to the wait). The theoretical idle share for p stages and m micro batches is
``p3d.model.geometry.pipeline_bubble``, (p - 1) / (m + p - 1).

Stragglers: the same wrappers time the ForwardPass and BackwardPass instructions, this rank's compute per step
(p3d.train.trainer gathers it from every rank). Test hook: ``P3D_TEST_SLOW_RANK=<rank>:<seconds>`` makes that
rank sleep that long in each forward pass, a real straggler.
"""

from __future__ import annotations

import os
import statistics
import time
from types import FunctionType
from typing import Any

from p3d.ds_compat import pipeline_instruction_map, set_pipeline_instruction_map

PIPE_WAITS = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
COMPUTE = ("ForwardPass", "BackwardPass")
SLOW_ENV = "P3D_TEST_SLOW_RANK"


def _test_delay(rank: int) -> float:
    who, _, seconds = os.environ.get(SLOW_ENV, "").partition(":")
    return float(seconds) if who and int(who) == rank else 0.0


class StageTimer:
    def __init__(self, engine, rank: int = -1):
        self.wait_s = self.compute_s = 0.0
        self.delay_s = _test_delay(rank)
        timed = {}
        for instr, fn in pipeline_instruction_map(engine).items():
            if instr.__name__ in PIPE_WAITS:
                timed[instr] = self._wrap(fn, "wait_s")
            elif instr.__name__ in COMPUTE:
                timed[instr] = self._wrap(fn, "compute_s", self.delay_s if instr.__name__ == "ForwardPass" else 0.0)
            else:
                timed[instr] = fn
        set_pipeline_instruction_map(engine, timed)  # this engine instance only

    def _wrap(self, fn: FunctionType, total: str, delay_s: float = 0.0):
        def timed(engine, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                if delay_s and engine.module.training:  # the test hook: a slow rank, training steps only
                    time.sleep(delay_s)
                return fn(engine, *args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - t0)

        return timed

    def take_compute(self) -> float:
        """Seconds in forward and backward passes since the last call."""
        compute, self.compute_s = self.compute_s, 0.0
        return compute

    def take(self) -> float:
        """Seconds blocked on pipeline neighbours since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait


class StragglerWatch:
    """Every rank's forward + backward seconds of a step -> metrics (slowest rank, its ratio to the median) and
    the ranks slower than ``factor`` x the median for ``steps`` steps in a row (named once per streak)."""

    def __init__(self, factor: float, steps: int, plan):
        self.factor, self.steps, self.plan = factor, steps, plan
        self.streak: dict[int, int] = {}

    def update(self, compute_s: list[float]) -> tuple[dict[str, Any], list[str]]:
        """(metrics fields, a console line for each rank to name now)."""
        from p3d.dist.mesh import Mesh

        median = statistics.median(compute_s)
        slowest = max(range(len(compute_s)), key=lambda r: compute_s[r])
        ratio = compute_s[slowest] / median if median > 0 else 1.0
        named = []
        for rank, seconds in enumerate(compute_s):
            slow = self.factor > 0 and median > 0 and seconds > self.factor * median
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if self.streak[rank] == self.steps:
                dp, pp, tp = Mesh.from_plan(self.plan, rank).coords
                named.append(
                    f"p3d: warning: rank {rank} (dp {dp}, pp {pp}, tp {tp}) is a straggler: {seconds:.3f} s of "
                    f"forward and backward in a step, {seconds / median:.1f}x the median {median:.3f} s of all ranks, "
                    f"{self.steps} steps in a row (train.straggler_factor={self.factor:g})"
                )
        return {"slowest_rank": slowest, "slowest_ratio": ratio, "stage_compute_s": self.by_stage(compute_s)}, named

    def by_stage(self, compute_s: list[float]) -> list[float]:
        """Mean forward + backward seconds of a step per pipeline stage: unequal figures are stage imbalance,
        which ``bubble`` (idle share) then holds beside the fill and drain that ``bubble_theory`` models."""
        dims, sums = self.plan.dims, [0.0] * self.plan.pp
        for rank, seconds in enumerate(compute_s):
            sums[dims.coords_of(rank)[1]] += seconds
        return [total / (self.plan.tp * self.plan.dp) for total in sums]


class TorchStageTimer:
    """The same two figures for a torch pipeline schedule (docs/design/pipeline-schedules.md §7): seconds blocked
    on pipeline neighbours (every wait of the schedule's runtime on a p2p exchange, ``torch_compat.timed_p2p_waits``
    around each step) and seconds of compute (each stage's forward, backward and weight-backward of one micro batch).
    ``P3D_TEST_SLOW_RANK`` delays every training forward of this rank's stages, as for DeepSpeed."""

    def __init__(self, stages, rank: int = -1):
        self.wait_s = self.compute_s = 0.0
        self.delay_s = _test_delay(rank)
        self.training = False
        for stage in stages:  # wrapped on each instance: the schedule calls them as methods of the stage
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._wrap(getattr(stage, name), name == "forward_one_chunk"))

    def _wrap(self, fn, forward: bool):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                if forward and self.delay_s and self.training:
                    time.sleep(self.delay_s)
                return fn(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - t0

        return timed

    def add_wait(self, seconds: float) -> None:
        self.wait_s += seconds

    take_compute = StageTimer.take_compute
    take = StageTimer.take
