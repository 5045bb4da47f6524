"""Each parallel dimension's communication in a step: its own time beside the part the step waited for
(docs/overlap.md).

For every dimension that runs (dp, tp, pp, cp, ep) a step reports two figures, each the mean over ranks:
- ``<dim>_comm_s``, own time: the seconds that dimension's communication was in flight, the length of the union of
  the intervals from each collective's issue to its completion (a synchronous one's: its call). Collectives queued
  behind each other count once, so it is the time the communicator was busy, not the sum of waits on a queue.
- ``<dim>_comm_exposed_s``: the seconds the step was blocked in it, a synchronous collective's whole call and an
  asynchronous one's launch and ``wait()``. ``1 - exposed / own`` is the dimension's overlap ratio.

The collectives are classified by their process group (``CommClocks.classify``: the mesh's groups, and the dp groups
an executor adds, FSDP2's and HSDP's) through ``p3d.compat.dp_collectives.timed_collectives``, the one mechanism
that times torch.distributed's collectives. The completion of an asynchronous one is the callback of its
future (``work.get_future().then``): on CPU gloo runs it in its own thread as the collective ends, on CUDA the callback
runs ordered after the collective on its stream, where the mark is an event (not yet measured on a GPU). A work with
no future (gloo's reduce-scatter) ends when its ``wait()`` returns: an upper bound.

pp is not a collective: its figures are the seconds blocked on pipeline neighbours (the schedule's p2p waits and the
drain, ``StepClocks.wait``, what ``bubble`` divides by the step) plus collectives over the pp group (the tied
embedding's all-reduce when pp = 2), both columns the same: a p2p receive cannot be told apart from waiting for the
neighbour's compute.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

DIMS = ("dp", "tp", "pp", "cp", "ep")
CALLBACK_WAIT_S = 5.0  # how long ``take`` waits for completion callbacks still running in the communicator's thread


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals`` ((start, end) seconds)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class CommClock:
    """One dimension's communication in a step on the step's ``DeviceClock``: ``exposed`` (the step blocked in it)
    and the busy intervals of its collectives (own time), read and reset by ``take`` once a step."""

    def __init__(self, clock, seconds: Callable[[Any], Any]):
        self.clock = clock  # p3d.train.timing.DeviceClock
        self.exposed = seconds(clock)  # p3d.train.timing.Seconds (given: timing imports this module)
        # each collective's marks: [issue, completion or None, its wait's return or None] (a synchronous one's
        # completion is its return); completion callbacks run in the communicator's thread
        self.busy: list[list[Any]] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Time a synchronous piece of communication: blocked for all of it, all of it the dimension's own time."""
        start = self.clock.mark()
        try:
            yield
        finally:
            end = self.clock.mark()
            self.exposed.spans.append((start, end))
            with self.lock:
                self.busy.append([start, end, None])

    # ---- the own-time protocol of p3d.compat.dp_collectives.timed_collectives
    def start(self) -> Any:
        return self.clock.mark()

    def finished(self, start: Any) -> None:
        """A synchronous collective issued at ``start`` returned now."""
        end = self.clock.mark()
        with self.lock:
            self.busy.append([start, end, None])

    def completes(self, work, start: Any) -> Callable[[], None]:
        """An asynchronous collective issued at ``start``: its own time ends when its work completes, noted by its
        future's callback, or when its ``wait()`` returns if that is sooner (the returned call): the callback needs
        the GIL, which the step's thread may hold for a while after the work is done (a work with no future,
        gloo's reduce-scatter: the wait's return only)."""
        marks = [start, None, None]
        with self.lock:
            self.busy.append(marks)

        def done(_future) -> None:
            marks[1] = self.clock.mark()

        def waited() -> None:
            marks[2] = self.clock.mark()

        try:
            work.get_future().then(done)
        except RuntimeError:
            pass
        return waited

    def take(self) -> tuple[float, float]:
        """(own seconds, exposed seconds) since the last call, and a fresh start. The step has waited for every
        collective by now; a completion callback may still be finishing in the communicator's thread.

        Own time is the union of the collectives' flights and of the stretches the step was blocked in them: a
        call can block after its collective is done (a launch that returns after the completion callback, gloo's
        callback thread beating the caller to the GIL; a ``wait()`` entered after completion), so the flights
        alone were once shorter than the exposed seconds (ep 0.073 s own, 0.0775 s exposed). So exposed <= own."""
        deadline = time.perf_counter() + CALLBACK_WAIT_S
        while any(m[1] is None and m[2] is None for m in self.busy) and time.perf_counter() < deadline:
            time.sleep(0.0005)
        with self.lock:
            spans, self.busy = self.busy, []
        blocked = list(self.exposed.spans)
        own = 0.0
        if spans or blocked:
            ref = (spans[0] if spans else blocked[0])[0]
            intervals = [(self.clock.seconds(ref, a), self.clock.seconds(ref, b)) for a, b in blocked]
            for start, done, waited in spans:
                ends = [self.clock.seconds(ref, m) for m in (done, waited) if m is not None]
                if ends:  # none: never waited for nor completed (not in a step's figures)
                    intervals.append((self.clock.seconds(ref, start), min(ends)))
            own = busy_seconds(intervals)
        return own, self.exposed.take()


class CommClocks:
    """A ``CommClock`` per dimension, and which process group is which dimension's."""

    def __init__(self, clock, seconds: Callable[[Any], Any]):
        self.dims = {dim: CommClock(clock, seconds) for dim in DIMS}
        self._dim_of: dict[int, str] = {}

    def classify(self, dim: str, groups: Iterable[object]) -> None:
        """Collectives over ``groups`` are ``dim``'s (the first dimension given a group keeps it)."""
        for group in groups:
            if group is not None:
                self._dim_of.setdefault(id(group), dim)

    def classify_mesh(self, mesh, dims: Iterable[str] = DIMS) -> None:
        """The mesh's groups of ``dims``: tp, pp (and the tied embedding's holders), dp (dp x cp, the experts' edp),
        cp, ep."""
        groups = {
            "tp": [mesh.tp_group],
            "pp": [mesh.pp_group],
            "dp": [mesh.dp_group, mesh.dp_cp_group, mesh.edp_group],
            "cp": [mesh.cp_group],
            "ep": [mesh.ep_group],
        }
        for dim in dims:
            self.classify(dim, groups[dim])

    def dim_of(self, group) -> str | None:
        return self._dim_of.get(id(group)) if group is not None else None

    def timed(self):
        """A context in which every collective over a classified group is timed into its dimension's clock."""
        from p3d.compat.dp_collectives import timed_collectives

        def timing_of(group, _name):
            dim = self.dim_of(group)
            return self.dims[dim].exposed.timing if dim is not None else None

        def own_of(group, _name):
            dim = self.dim_of(group)
            return self.dims[dim] if dim is not None else None

        return timed_collectives(timing_of, own_of)

    def take(self, running: Iterable[str] = DIMS) -> dict[str, float]:
        """``{<dim>_comm_s: own, <dim>_comm_exposed_s: exposed}`` of the dimensions ``running``, since the last call
        (every clock is reset)."""
        figures: dict[str, float] = {}
        keep = set(running)
        for dim, clock in self.dims.items():
            own, exposed = clock.take()
            if dim in keep:
                figures[f"{dim}_comm_s"], figures[f"{dim}_comm_exposed_s"] = own, exposed
        return figures


def running_dims(plan) -> list[str]:
    """The dimensions with more than one rank, whose collectives exist (dp: the dp x cp holders of the parameters,
    which reduce their gradients), and dp always: ``dp_comm_s`` is in every step's metrics, 0 with one replica."""
    sizes = {dim: getattr(plan, dim, 1) or 1 for dim in DIMS}
    sizes["dp"] *= sizes["cp"]
    return [dim for dim in DIMS if dim == "dp" or sizes[dim] > 1]
