"""A measured timeline of the steps in ``train.trace_steps``: every rank's compute, waits and communication as events
on the step's own clocks, written as a Chrome trace (p3d.rundir.traces) that Perfetto opens and p3d-report draws.

What a traced step records, on this rank (``StepTracer.recording``):
- the intervals of the executor's step clocks (p3d.train.timing: ``StepClocks.begin_trace``): each pass of a micro
  batch through a chunk (F, B; I and W under the zero-bubble schedules) and the loss, each wait on a pipeline
  neighbour and the drain, with the marks that the step's figures add up, so the waits drawn are the measured bubble;
- DeepSpeed's data loads and optimizer step, the torch executor's optimizer step (wrapped for the step only);
- every collective, with its dimension (dp, tp, pp, cp, ep, world; ``GroupDims``: the group's ranks against this
  rank's groups of each dimension), by ``p3d.compat.dp_collectives.timed_collectives``, installed for the step only.

The marks are the step clocks' (``DeviceClock``: CUDA events on the current stream on a GPU, ``perf_counter`` on
CPU); an event's time is the interval from a step-start mark (``elapsed_time`` of two events on CUDA), read after the
step's figures are taken, so tracing adds no host sync inside the step. On a step not traced nothing here runs.
After the step's figures, each rank writes its part and the logging rank merges the parts in a background thread
(p3d.rundir.traces says why); ``close`` waits for the merges at the end of the run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from p3d.compat.dp_collectives import timed_collectives
from p3d.rundir.traces import merge, write_part

if TYPE_CHECKING:  # p3d.train.timing imports this module
    from p3d.train.timing import DeviceClock, StepClocks

MERGE_WAIT_S = 60.0  # how long the merge waits for every rank's part (they are written at the same point of the loop)


class StepTrace:
    """One rank's events of one step: (track, kind, name, start mark, end mark, args), marks of ``clock``."""

    def __init__(self, clock: DeviceClock, step: int):
        self.clock, self.step = clock, step
        self.events: list[tuple[str, str, str, Any, Any, dict]] = []
        self.start = clock.mark()
        self.end: Any = None

    def add(self, kind: str, name: str, span: tuple[Any, Any], track: str = "schedule", **args) -> None:
        """An interval another clock timed (``Seconds.timing``): its marks are the event's."""
        self.events.append((track, kind, name, span[0], span[1], args))

    @contextlib.contextmanager
    def timing(self, kind: str, name: str, track: str = "schedule") -> Iterator[None]:
        start = self.clock.mark()
        try:
            yield
        finally:
            self.events.append((track, kind, name, start, self.clock.mark(), {}))

    def read(self) -> tuple[float, list[list]]:
        """(the step's seconds, its events as [track, kind, name, ts µs, dur µs, args] from the step's start)."""
        us = self.clock.seconds
        events = [
            [track, kind, name, round(us(self.start, a) * 1e6, 3), round(us(a, b) * 1e6, 3), args]
            for track, kind, name, a, b, args in self.events
        ]
        return us(self.start, self.end), events


def traced_call(fn, trace: StepTrace, kind: str, name: str, engine_method: bool = False):
    """``fn`` (a bound method, or with ``engine_method`` an instruction of DeepSpeed's engine, which takes the
    engine first) as an event of ``trace``'s schedule track."""
    if engine_method:

        def instruction(engine, *args, **kwargs):
            with trace.timing(kind, name):
                return fn(engine, *args, **kwargs)

        return instruction

    def call(*args, **kwargs):
        with trace.timing(kind, name):
            return fn(*args, **kwargs)

    return call


def pass_event(method: str, stage, args: tuple, kwargs: dict) -> dict:
    """The label of a torch stage's pass from its call: ``forward_one_chunk(fwd_chunk_id, ...)`` is F,
    ``backward_one_chunk(bwd_chunk_id, loss, full_backward)`` B (I when not ``full_backward``: the input-gradient
    pass of a zero-bubble schedule), ``backward_weight_one_chunk(bwd_chunk_id)`` W; the chunk is the stage's index.
    Named in torch's notation, as the schedule's plan is: ``1F3``, chunk 1's forward of micro batch 3."""
    micro_batch = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
    if method == "forward_one_chunk":
        kind = "F"
    elif method == "backward_weight_one_chunk":
        kind = "W"
    else:
        kind = "B" if kwargs.get("full_backward", args[2] if len(args) > 2 else True) else "I"
    chunk = getattr(stage, "stage_index", 0)
    return {"kind": kind, "name": f"{chunk}{kind}{micro_batch}", "micro_batch": micro_batch, "chunk": chunk}


class GroupDims:
    """The dimension a collective runs over, from its group's ranks: this rank's tp, cp, ep, pp or dp group (the
    experts' dp group and dp x cp count as dp), its replica's pp x tp ranks (mp: the norm's sum), a subset of its
    pipeline (the tied embeddings' two holders) as pp, the whole world (or no group) as world, anything else as
    other."""

    def __init__(self, mesh):
        d, rank = mesh.dims, mesh.rank
        self.world, self.by_ranks, self.pipeline = d.world_size, {}, frozenset([rank])
        for dim, lists in (
            ("tp", d.tp_ranks()),
            ("cp", d.cp_ranks()),
            ("ep", d.ep_ranks()),
            ("pp", d.pp_ranks()),
            ("dp", d.dp_ranks()),
            ("dp", d.edp_ranks()),
            ("dp", d.dp_cp_ranks()),
            ("mp", d.replica_ranks()),
        ):
            for ranks in lists:
                if rank in ranks and len(ranks) > 1:
                    self.by_ranks.setdefault(frozenset(ranks), dim)
                    self.pipeline |= frozenset(ranks) if dim == "pp" else frozenset()
        self.known: dict[int, str] = {}

    def of(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        if id(group) not in self.known:
            ranks = frozenset(dist.get_process_group_ranks(group))
            dim = self.by_ranks.get(ranks)
            if dim is None:
                dim = "world" if len(ranks) == self.world else "pp" if ranks <= self.pipeline else "other"
            self.known[id(group)] = dim
        return self.known[id(group)]


class StepTracer:
    """The loop's side of tracing: which steps, recording one, writing this rank's part, merging on the logging
    rank. ``timer``: the executor's step clocks (``StepClocks``); ``cfg``, ``plan``, ``mesh``: the run's."""

    def __init__(self, cfg, plan, mesh, run_dir: str | Path, timer: StepClocks):
        self.steps = set(cfg.train.trace_steps)
        self.run_dir, self.timer, self.mesh, self.plan = Path(run_dir), timer, mesh, plan
        self.merges = mesh.rank == plan.logging_rank
        s = cfg.schedule
        self.run = {
            "schedule": s.pipeline.value,
            "virtual_stages": s.virtual_stages,
            "micro_batches": plan.micro_batches,
            "mesh": cfg.mesh.name,
            "dims": plan.dims.describe(),
            "world_size": plan.world_size,
            "logging_rank": plan.logging_rank,
        }
        self.dims = GroupDims(mesh) if self.steps else None
        self.threads: list[threading.Thread] = []

    @contextlib.contextmanager
    def recording(self, step: int) -> Iterator[StepTrace | None]:
        """Record ``step`` when it is one of ``train.trace_steps`` (yields its StepTrace), else do nothing (None)."""
        if step not in self.steps:
            yield None
            return
        trace = StepTrace(self.timer.wait.clock, step)
        self.timer.begin_trace(trace)
        try:
            with timed_collectives(partial(self._collective, trace)):
                yield trace
        finally:
            trace.end = trace.clock.mark()
            self.timer.end_trace()

    def _collective(self, trace: StepTrace, group, name: str) -> Callable[[], contextlib.AbstractContextManager]:
        return partial(trace.timing, self.dims.of(group), name, "collectives")  # type: ignore[union-attr]

    def write(self, trace: StepTrace | None, **figures: float) -> None:
        """After the step's figures are taken (the marks are then long past): this rank's part, and on the logging
        rank the merge of every rank's, in the background. ``figures``: the step's, as metrics.jsonl has them."""
        if trace is None:
            return
        step_s, events = trace.read()
        m = self.mesh
        write_part(
            self.run_dir,
            {
                "step": trace.step,
                "rank": m.rank,
                "world_size": m.world_size,
                "coords": {"pp": m.pp_rank, "dp": m.dp_rank, "cp": m.cp_rank, "tp": m.tp_rank},
                "step_s": step_s,
                "events": events,
                "planned": self.timer.planned() if self.timer.planned is not None else [],
                "run": self.run,
                "figures": figures if self.merges else {},
            },
        )
        if self.merges:
            args = (self.run_dir, trace.step, m.world_size, MERGE_WAIT_S)
            thread = threading.Thread(target=merge, args=args, name=f"p3d-trace-merge-{trace.step}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        """Wait for the merges in flight (the end of the run)."""
        for thread in self.threads:
            thread.join()
