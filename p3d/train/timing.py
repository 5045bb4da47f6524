"""Measured pipeline bubble: the share of a step a stage spends blocked on its pipeline neighbours.

A stage is blocked on its neighbours in two places: inside the schedule, waiting to receive an activation or a
gradient (or for a send to be taken), and at the end of the step, when its own last backward is done but the
pipeline's is not (the drain: in 1F1B the first stage finishes last, the others wait for it). The first is
timed at the schedule's p2p instructions; the second by a barrier over this rank's pp group right after the
step's last backward (before the step gate, the gradient reductions and the optimizer, whose collectives would
otherwise absorb the wait unseen). Their sum over the step time is the idle share whose theory is
``p3d.layout.geometry.schedule_bubble``: (p - 1) / (m + p - 1) for 1F1B, measured on every rank against the
step's end, as the theory counts it.

DeepSpeed's pipeline engine runs a step as a list of instructions (load, forward, backward, send/recv of
activations and gradients, reduce, optimizer step): the send/recv ones are timed, and the drain barrier runs
at ``ReduceTiedGrads``, the first instruction after the last backward. The torch schedules: their runtime's
p2p waits (``torch_compat.timed_p2p_waits``) and the same barrier after ``schedule.step``.

Exposed dp communication (``dp_comm_s``): seconds of the step this rank was blocked in data-parallel
collectives. DeepSpeed: its ReduceGrads instruction (the gradients' dp reduction, after the last backward) and
its optimizers' dp all-gather of the updated pieces; the torch schedules: every collective over a dp group
(FSDP2's gathers and reduce-scatters, the flat all-reduce, ZeRO-1's broadcasts), ``p3d.compat.dp_collectives``.

The clocks (``DeviceClock``): on CPU the host's ``perf_counter``; on CUDA, events recorded on the current stream,
because the host only launches the work and a host clock around a launch measures the launch. An interval is a
pair of marks; its seconds are read when the loop takes the step's figures, after the step's last kernel (the loss
read already waits for it), so timing adds no host sync inside the step. A wait on a neighbour or a collective
under NCCL stalls the stream, not the host: the events around it measure that stall.

Stragglers: the same wrappers time the ForwardPass and BackwardPass instructions, this rank's compute per step
(p3d.train.loop gathers it from every rank). Test hooks: ``P3D_TEST_SLOW_RANK=<rank>:<seconds>`` makes that
rank sleep that long in each forward pass, a real straggler; ``P3D_TEST_BLOCK_SECONDS`` gives every block a fixed
compute time (p3d.train.block_seconds).

Traced steps (``train.trace_steps``, p3d.train.trace): while a ``StepTrace`` is attached (``begin_trace``), every
interval of ``wait`` and ``compute`` is also an event of the step's timeline, with the same marks, labelled by the
wrapper that times it (the pass, micro batch and chunk; the p2p instruction; the drain); what these clocks do not
time (DeepSpeed's data loads and optimizer step, the torch executor's optimizer step) is wrapped for that step only.
On other steps the wrappers test one attribute and nothing more runs.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from types import FunctionType
from typing import Any

import torch
import torch.distributed as dist

from p3d.compat.deepspeed_internals import engine_pass_order, pipeline_instruction_map, set_pipeline_instruction_map
from p3d.train.trace_events import StepTrace, pass_event, traced_call

PIPE_WAITS = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
DRAIN = "ReduceTiedGrads"  # the first instruction after the step's last backward
DP_REDUCE = "ReduceGrads"  # the gradients' dp all-reduce (or ZeRO-1's reduction), after the step's last backward
COMPUTE = ("ForwardPass", "BackwardPass")
TRACED_ONLY = {"LoadMicroBatch": "data", "OptimizerStep": "optimizer"}  # instruction -> its kind, on traced steps
SLOW_ENV = "P3D_TEST_SLOW_RANK"


class DeviceClock:
    """Marks on the timeline of the device that runs the work: a CUDA event recorded on the current stream (no host
    sync), or the host's ``perf_counter`` on CPU. ``seconds(a, b)`` waits for mark ``b`` to have happened."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()  # long past when the step's figures are taken: the loss read waited for the step
        return start.elapsed_time(end) / 1e3


class Seconds:
    """The seconds of one kind of work in a step: intervals between marks of a ``DeviceClock``, read and summed
    only when taken (``take``, once a step), plus host-measured seconds (``add``: a test hook's sleep)."""

    def __init__(self, clock: DeviceClock, kind: str = "", name: str = ""):
        self.clock = clock
        self.spans: list[tuple[Any, Any]] = []
        self.host_s = 0.0
        self.kind, self.name = kind, name  # an interval's event on a traced step, unless ``timing`` names another
        self.trace: StepTrace | None = None  # a traced step's: each interval is one of its events too

    @contextlib.contextmanager
    def timing(self, kind: str = "", name: str = "", **args) -> Iterator[None]:
        start = self.clock.mark()
        try:
            yield
        finally:
            self.spans.append((start, self.clock.mark()))
            if self.trace is not None:
                self.trace.add(kind or self.kind, name or kind or self.name, self.spans[-1], **args)

    def add(self, seconds: float) -> None:
        self.host_s += seconds

    def durations(self) -> list[float]:
        """Each interval's seconds so far (reads the marks; keeps them)."""
        return [self.clock.seconds(a, b) for a, b in self.spans]

    def take(self) -> float:
        """The seconds since the last call, and a fresh start."""
        total = self.host_s + sum(self.durations())
        self.spans, self.host_s = [], 0.0
        return total


def drain(pp_group, waits: Seconds) -> None:
    """Wait until every stage of this rank's pipeline has done its last backward of the step (a barrier over the pp
    group; None, a pipeline of one stage: nothing), timed into ``waits``."""
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return
    with waits.timing("drain"):
        dist.barrier(group=pp_group)


def _test_delay(rank: int) -> float:
    who, _, seconds = os.environ.get(SLOW_ENV, "").partition(":")
    return float(seconds) if who and int(who) == rank else 0.0


class StepClocks:
    """Seconds of a step blocked on pipeline neighbours (``wait``), of compute (``compute``) and blocked in dp
    collectives (``dp_comm``), on the device's clock (``DeviceClock``), each taken (and reset) once a step by the
    loop."""

    def __init__(self, device: torch.device | None = None):
        clock = DeviceClock(device)
        self.wait, self.compute, self.dp_comm = Seconds(clock, "wait", "p2p wait"), Seconds(clock), Seconds(clock)
        self.trace: StepTrace | None = None  # set from begin_trace to end_trace: a traced step
        self.planned: Any = None  # () -> the passes this rank's schedule plans, in order ("0F3", ...; traces)
        self.traced_calls: list[tuple[Any, str, str]] = []  # (owner, method, kind): events on traced steps only
        self._untraced: list[tuple[Any, str, Any]] = []

    def begin_trace(self, trace: StepTrace) -> None:
        """Record this step's timeline into ``trace``: the wait and compute intervals, and ``traced_calls``."""
        self.trace = self.wait.trace = self.compute.trace = trace
        for owner, method, kind in self.traced_calls:
            self._untraced.append((owner, method, owner.__dict__.get(method)))
            setattr(owner, method, traced_call(getattr(owner, method), trace, kind, method))

    def end_trace(self) -> None:
        self.trace = self.wait.trace = self.compute.trace = None
        while self._untraced:
            owner, method, before = self._untraced.pop()
            if before is None:
                delattr(owner, method)  # the class's method again
            else:
                setattr(owner, method, before)

    def take_compute(self) -> float:
        """Seconds in forward and backward passes since the last call."""
        return self.compute.take()

    def take(self) -> float:
        """Seconds blocked on pipeline neighbours since the last call."""
        return self.wait.take()

    def take_dp_comm(self) -> float:
        """Seconds blocked in data-parallel collectives since the last call (``dp_comm_s``)."""
        return self.dp_comm.take()


class StageTimer(StepClocks):
    """Wraps this engine's instructions (build it after the step gate, so that the drain barrier runs before
    the gate's all-gather). ``pp_group``: this rank's pipeline group, for the drain barrier; ``dp``: the replicas
    (one: no dp collective, dp_comm_s stays 0); ``device``: the compute device, whose clock times the step."""

    def __init__(self, engine, rank: int = -1, pp_group=None, dp: int = 1, device: torch.device | None = None):
        super().__init__(device)
        self.delay_s = _test_delay(rank)
        self.engine, self.stage = engine, dist.get_rank(pp_group) if pp_group is not None else 0
        self.planned = lambda: engine_pass_order(engine)
        self.passes: dict[str, int] = {}  # a traced step's forwards and backwards so far: the next one's micro batch
        timed = {}
        for instr, fn in pipeline_instruction_map(engine).items():
            if instr.__name__ in PIPE_WAITS:
                timed[instr] = self._wrap(fn, self.wait, name=instr.__name__)
            elif instr.__name__ == DRAIN:
                timed[instr] = self._after_drain(fn, pp_group)
            elif instr.__name__ == DP_REDUCE and dp > 1:
                timed[instr] = self._wrap(fn, self.dp_comm)
            elif instr.__name__ in COMPUTE:
                delay_s = self.delay_s if instr.__name__ == "ForwardPass" else 0.0
                timed[instr] = self._wrap(fn, self.compute, delay_s, instr.__name__)
            else:
                timed[instr] = fn
        set_pipeline_instruction_map(engine, timed)  # this engine instance only
        if dp > 1:
            from p3d.compat.dp_collectives import timed_deepspeed_allgathers

            timed_deepspeed_allgathers(self.dp_comm.timing)  # ZeRO-1 / bf16: the updated pieces' dp all-gather

    def begin_trace(self, trace: StepTrace) -> None:
        """Also the instructions these clocks do not time (``TRACED_ONLY``), for this step only."""
        super().begin_trace(trace)
        self.passes = {}
        table = pipeline_instruction_map(self.engine)
        self._table = table
        traced = {
            i: traced_call(fn, trace, TRACED_ONLY[i.__name__], i.__name__, engine_method=True)
            for i, fn in table.items()
            if i.__name__ in TRACED_ONLY
        }
        set_pipeline_instruction_map(self.engine, {**table, **traced})

    def end_trace(self) -> None:
        super().end_trace()
        set_pipeline_instruction_map(self.engine, self._table)

    def _event(self, name: str) -> dict:
        """A traced interval's label: the pass, micro batch and stage (TrainSchedule runs its forwards in micro batch
        order, and its backwards: the k-th of a step is micro batch k), or the wait's instruction."""
        if name not in COMPUTE:
            return {"name": name}
        kind = "F" if name == "ForwardPass" else "B"
        micro_batch = self.passes[kind] = self.passes.get(kind, -1) + 1
        return {
            "kind": kind,
            "name": f"{self.stage}{kind}{micro_batch}",
            "micro_batch": micro_batch,
            "chunk": self.stage,
        }

    def _wrap(self, fn: FunctionType, total: Seconds, delay_s: float = 0.0, name: str = ""):
        def timed(engine, *args, **kwargs):
            with total.timing(**self._event(name)) if self.trace is not None else total.timing():
                if delay_s and engine.module.training:  # the test hook: a slow rank, training steps only
                    time.sleep(delay_s)
                return fn(engine, *args, **kwargs)

        return timed

    def _after_drain(self, fn: FunctionType, pp_group):
        def drained(engine, *args, **kwargs):
            drain(pp_group, self.wait)
            return fn(engine, *args, **kwargs)

        return drained


class StragglerWatch:
    """Every rank's forward + backward seconds of a step -> metrics (slowest rank, its ratio to the median) and
    the ranks slower than ``factor`` x the median for ``steps`` steps in a row (named once per streak)."""

    def __init__(self, factor: float, steps: int, plan):
        self.factor, self.steps, self.plan = factor, steps, plan
        self.streak: dict[int, int] = {}

    def update(self, compute_s: list[float]) -> tuple[dict[str, Any], list[str]]:
        """(metrics fields, a console line for each rank to name now)."""
        from p3d.parallel.mesh import Mesh

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


class TorchStageTimer(StepClocks):
    """The same figures for a torch pipeline schedule (docs/schedules.md, Metrics): seconds blocked on pipeline
    neighbours (every wait of the schedule's runtime on a p2p exchange, ``torch_compat.timed_p2p_waits``, and the
    drain), of compute (each stage's forward, backward and weight-backward of one micro batch, and the loss) and in
    dp collectives, all timed by ``TorchPipeline`` into these clocks (its ``clocks``).
    ``P3D_TEST_SLOW_RANK`` delays every training forward of this rank's stages, as for DeepSpeed."""

    def __init__(self, stages, rank: int = -1, device: torch.device | None = None):
        super().__init__(device)
        self.delay_s = _test_delay(rank)
        self.training = False
        for stage in stages:  # wrapped on each instance: the schedule calls them as methods of the stage
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._wrap(getattr(stage, name), name, stage))

    def _wrap(self, fn, method: str, stage):
        forward = method == "forward_one_chunk"

        def timed(*args, **kwargs):
            with (
                self.compute.timing(**pass_event(method, stage, args, kwargs)) if self.trace else self.compute.timing()
            ):
                if forward and self.delay_s and self.training:
                    time.sleep(self.delay_s)
                return fn(*args, **kwargs)

        return timed
