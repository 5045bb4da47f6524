"""The events of one traced step on one rank (``train.trace_steps``, p3d.train.trace): each an interval between two
marks of the step's clock, read only after the step's figures are taken, and the wrappers that record a call as one.

Below p3d.train.timing, which labels its own intervals with these (``pass_event``) and wraps, for a traced step
only, the calls its clocks do not time (``traced_call``); p3d.train.trace drives the recording.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol


class Clock(Protocol):
    """p3d.train.timing's ``DeviceClock``: a mark now (a CUDA event or ``perf_counter``) and the seconds between two."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class StepTrace:
    """One rank's events of one step: (track, kind, name, start mark, end mark, args), marks of ``clock``."""

    def __init__(self, clock: Clock, step: int):
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
