"""Timing the data-parallel collectives a step waits on (``dp_comm_s``, docs/zero.md "Exposed dp communication").

Two touchpoints, each checked by ``TOUCHPOINTS`` (tests/unit/compat/test_dp_collectives.py):
- ``timed_dp_collectives``: while inside, the ``torch.distributed`` collectives that FSDP2, torch's
  ``ZeroRedundancyOptimizer`` and p3d's own dp reduction call (looked up on the module at call time) are timed
  (a context from the caller, on the device's clock: p3d.train.timing), when their group is one of the dp groups
  given. A synchronous call
  blocks for the whole collective; an asynchronous one (``async_op=True``) for its launch and then for its
  ``wait()``, which is timed on the returned work. Nested calls (one collective implemented by another) count once.
- ``timed_deepspeed_allgathers``: DeepSpeed's ZeRO-1 and bf16 optimizers gather the updated parameter pieces over
  dp in their ``step`` (``deepspeed.runtime.utils.all_gather_dp_groups``, imported by name into each optimizer's
  module and looked up there at call time).

On CPU with gloo every one of these blocks its caller (FSDP2 issues its all-gathers and reduce-scatters with
``async_op=False`` off CUDA), so the figure is all of the step's dp traffic time. On CUDA FSDP2 orders its
collectives on side streams and the host is not blocked: this counts the host's waits only (not yet measured on a
GPU)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from functools import partial

import torch.distributed as dist

from p3d.compat.pipelining_internals import Touchpoint

# The collectives p3d's dp paths reach: FSDP2 (all_gather_single, reduce_scatter_single; all_reduce under HSDP),
# ZeroRedundancyOptimizer (broadcast), p3d's flat dp all-reduce; the rest for the ones these are built on, and the
# experts' token dispatch (all_to_all_single), which a traced step's timeline shows (p3d.train.trace).
COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce",
    "all_to_all_single",
    "all_to_all",
)
DEEPSPEED_GATHER_MODULES = ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.bf16_optimizer")
DEEPSPEED_GATHER = "all_gather_dp_groups"
Timing = Callable[[], AbstractContextManager]  # a fresh context per interval: it times what it holds


class _TimedWork(dist.Work):
    """An asynchronous collective's work whose ``wait()`` is timed (``timing``: a context that times what it holds).

    A ``dist.Work`` itself, because its callers test for one: FSDP2 waits on an all-gather only when
    ``isinstance(work, dist.distributed_c10d.Work)`` (``_fsdp_collectives.foreach_all_gather_copy_out``), and read a
    proxy's buffers unwaited, which gave nan losses under the prefetching runtime schedules (interleaved, V)."""

    def __init__(self, work, timing: Timing):
        super().__init__()
        self._work, self._timing = work, timing

    def wait(self, *args, **kwargs):
        with self._timing():
            return self._work.wait(*args, **kwargs)

    def is_completed(self):
        return self._work.is_completed()

    def is_success(self):
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def source_rank(self):
        return self._work.source_rank()

    def result(self):
        return self._work.result()

    def synchronize(self):
        return self._work.synchronize()

    def get_future(self):
        return self._work.get_future()

    def get_future_result(self):
        return self._work.get_future_result()

    def block_current_stream(self):
        return self._work.block_current_stream()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group_of(args: tuple, kwargs: dict, signature) -> object:
    if "group" in kwargs:
        return kwargs["group"]
    try:
        return signature.bind_partial(*args, **kwargs).arguments.get("group")
    except TypeError:
        return None


@contextlib.contextmanager
def timed_collectives(timing_of: Callable[[object, str], Timing | None]) -> Iterator[None]:
    """While inside, each collective (``COLLECTIVES``, looked up on ``torch.distributed`` at call time) runs inside
    the timing ``timing_of(group, name)`` gives for its group and name (``Seconds.timing`` of p3d.train.timing: the
    host's clock on CPU, CUDA events on a GPU), an asynchronous one's ``wait()`` too; None: not timed."""

    depth = [0]  # a collective built on another one (all_gather_single on all_gather_into_tensor) counts once
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def timed(name, fn):
        signature = inspect.signature(fn)  # once: TP's all-reduces pass through here every layer

        def call(*args, **kwargs):
            timing = None if depth[0] else timing_of(_group_of(args, kwargs, signature), name)
            if timing is None:
                return fn(*args, **kwargs)
            depth[0] += 1
            try:
                with timing():
                    work = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
            return _TimedWork(work, timing) if work is not None and kwargs.get("async_op") else work

        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def timed_dp_collectives(groups: Iterable[object], timing: Timing):
    """``timed_collectives`` of the collectives over any of ``groups`` (the dp groups), each inside ``timing()``."""
    mine = {id(g) for g in groups if g is not None}
    return timed_collectives(lambda group, name: timing if id(group) in mine else None)


def timed_deepspeed_allgathers(timing: Timing) -> None:
    """From now on in this process, DeepSpeed's optimizers' dp all-gathers of the updated pieces run inside
    ``timing()`` (one DeepSpeed engine per worker process)."""
    for module_name in DEEPSPEED_GATHER_MODULES:
        module = importlib.import_module(module_name)
        original = getattr(module, DEEPSPEED_GATHER)
        original = getattr(original, "__wrapped__", original)

        def timed(*args, _original=original, **kwargs):
            with timing():
                return _original(*args, **kwargs)

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(module, DEEPSPEED_GATHER, timed)


def _fsdp_calls(name: str) -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return f"dist.{name}(" in inspect.getsource(_fsdp_collectives)


def _has_gather(module: str) -> bool:
    return hasattr(importlib.import_module(module), DEEPSPEED_GATHER)


TOUCHPOINTS: tuple[Touchpoint, ...] = (
    *(
        Touchpoint(
            f"torch.distributed.fsdp._fully_shard._fsdp_collectives calls dist.{name}",
            "p3d.compat.dp_collectives.timed_dp_collectives",
            partial(_fsdp_calls, name),
        )
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")
    ),
    *(
        Touchpoint(
            f"{module}.{DEEPSPEED_GATHER}",
            "p3d.compat.dp_collectives.timed_deepspeed_allgathers",
            partial(_has_gather, module),
        )
        for module in DEEPSPEED_GATHER_MODULES
    ),
)
