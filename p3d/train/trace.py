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

import torch.distributed as dist

from p3d.compat.dp_collectives import timed_collectives
from p3d.rundir.traces import merge, write_part
from p3d.train.timing import StepClocks
from p3d.train.trace_events import StepTrace

MERGE_WAIT_S = 60.0  # how long the merge waits for every rank's part (they are written at the same point of the loop)


MESH_GROUPS = (  # p3d.parallel.mesh's groups and the dimension of each (the experts' dp and dp x cp count as dp)
    ("tp_group", "tp"),
    ("cp_group", "cp"),
    ("ep_group", "ep"),
    ("pp_group", "pp"),
    ("dp_group", "dp"),
    ("edp_group", "dp"),
    ("dp_cp_group", "dp"),
    ("replica_group", "mp"),
)


class GroupDims:
    """The dimension a collective runs over: that of the mesh's group it names (``MESH_GROUPS``), else (a group
    DeepSpeed or torch made) from the group's ranks: this rank's tp, cp, ep, pp or dp group (the experts' dp group and
    dp x cp count as dp), its replica's pp x tp ranks (mp: the norm's sum), a subset of its pipeline (the tied
    embeddings' two holders) as pp, the whole world (or no group) as world, anything else as other."""

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
        self.known: dict[int, str] = {}  # id(group) -> its dimension: the mesh's own groups first, by what they are
        for attr, dim in MESH_GROUPS:  # (two can hold the same ranks: dp2 with ep2's all-to-all and dp groups)
            group = getattr(mesh, attr, None)
            if group is not None:
                self.known.setdefault(id(group), dim)

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

    def line_up(self, step: int, device) -> None:
        """Before a traced step, every rank waits for the others (one all-reduce of one element over the world, on
        the compute device): the ranks start it together and their timelines line up at 0. A later step's ranks are
        lined up by the previous step's all-gather already, the first step of a process (a fresh start, a resume)
        by nothing: its ranks set out up to tens of ms apart, and rank 1 of a pipeline was drawn computing a
        forward before rank 0 had sent it. Outside the step's clock (``t0`` is taken after it)."""
        if step in self.steps and self.mesh.world_size > 1:
            import torch

            dist.all_reduce(torch.zeros(1, device=device))

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
