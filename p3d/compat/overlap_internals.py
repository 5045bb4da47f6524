"""The touchpoints of torch's pipelining and FSDP2 internals that let the dp reduction overlap the last backward
(docs/overlap.md); each is an entry of ``TOUCHPOINTS`` (tests/unit/compat/test_overlap_internals.py).

- ``on_last_backward``: the schedule tells a stage which backward is its last of the step (``last_backward=``, by
  keyword, to ``backward_one_chunk`` and ``backward_weight_one_chunk``); p3d runs that call inside a context.
- ``reduce_in_last_backward``: torch 2.13's ``PipelineStage.backward_maybe_with_nosync`` turns off FSDP2's gradient
  sync for every backward, the last one too, and ``perform_reduce_grad`` reduces every unit of the stage after
  the schedule's last backward. In a stage's last full backward p3d leaves FSDP2's sync on (and its reshard after
  backward), so FSDP2's own post-backward hook reduce-scatters each unit as its backward is done; the later
  ``perform_reduce_grad`` finds nothing left (``FSDPParamGroup.post_backward`` is a no-op without gradients).
- ``DeferredReduceScatters``: FSDP2 issues its reduce-scatter synchronously off CUDA (gloo); this custom
  reduce-scatter (FSDP2's ``set_custom_reduce_scatter``) issues it asynchronously and completes it when the executor
  asks, before the gradients are read. Sound because FSDP2's ``foreach_reduce`` reads the output, after the call,
  only to make the sharded gradients views of it, when: no gradient is accumulated into (they are None at the
  reduction: the optimizer's ``zero_grad(set_to_none=True)``), no divide after the reduce (fp32 / bf16 reduce
  dtype: the op divides), the reduce dtype is the parameters' (fp32), and no HSDP all-reduce follows.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from p3d.compat.pipelining_internals import Touchpoint

LAST_BACKWARD_METHODS = ("backward_one_chunk", "backward_weight_one_chunk")
FSDP_SYNC_SETTERS = ("set_is_last_backward", "set_reshard_after_backward", "set_requires_gradient_sync")


def on_last_backward(stage, context: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run ``stage``'s last backward of each step (full, or the weight pass of a split one) inside ``context()``;
    not under the schedule's ``eval``, which calls the same methods with ``stage.has_backward`` off."""
    for name in LAST_BACKWARD_METHODS:
        original = getattr(stage, name)

        def call(*args, _original=original, **kwargs):
            # eval() runs the same action list with has_backward off: torch's method returns at once, and the
            # context (the dp reduction of a step's final gradients) must not run for a backward that never was
            if not (kwargs.get("last_backward", False) and stage.has_backward):
                return _original(*args, **kwargs)
            with context():
                return _original(*args, **kwargs)

        setattr(stage, name, call)


def reduce_in_last_backward(stage) -> None:
    """In ``stage``'s last full backward of the step, FSDP2 reduce-scatters each unit as its backward is done (module
    doc); other backwards are torch's."""
    original = stage.backward_maybe_with_nosync

    def backward(backward_type, bwd_kwargs, last_backward=False):
        submod = stage.submod
        if not (last_backward and backward_type == "full" and _is_fsdp(submod)):
            return original(backward_type, bwd_kwargs, last_backward)
        submod.set_is_last_backward(True)
        submod.set_reshard_after_backward(True)
        submod.set_requires_gradient_sync(True)
        for name in FSDP_SYNC_SETTERS:  # torch's turns them off again before the backward: not this time
            setattr(submod, name, lambda *a, **k: None)
        try:
            return original(backward_type, bwd_kwargs, last_backward)
        finally:
            for name in FSDP_SYNC_SETTERS:
                delattr(submod, name)

    stage.backward_maybe_with_nosync = backward


def _is_fsdp(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class DeferredReduceScatters:
    """FSDP2's reduce-scatters on gloo, issued asynchronously (``comm()``, for ``set_custom_reduce_scatter``) and
    completed by ``finish()`` before anything reads the gradients.

    gloo's own reduce-scatter is no use here: its launch alone blocks for a third of its time and its work has no
    future, so its completion cannot be seen (measured on 32 MB: 19 ms launch + 32 ms wait, against 4 + 18 ms for an
    asynchronous all-reduce of the same input). So each is an asynchronous all-reduce (SUM) of FSDP2's input, the
    ranks' pieces one after the other, of which ``finish`` copies this rank's piece into FSDP2's output (divided by
    the ranks for FSDP2's AVG). Twice the bytes of a reduce-scatter; CPU only: on CUDA FSDP2's NCCL reduce-scatter
    runs on its own stream."""

    def __init__(self):
        self.pending: list[tuple[object, torch.Tensor, torch.Tensor, int, int, bool]] = []

    def comm(self):
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        pending = self.pending

        class AsyncReduceScatter(ReduceScatter):
            def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
                if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                    raise ValueError(f"p3d's deferred reduce-scatter takes SUM or AVG, not {op}")
                work = dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
                rank, size = dist.get_rank(group), dist.get_world_size(group)
                pending.append((work, input_tensor, output_tensor, rank, size, op == dist.ReduceOp.AVG))
                return work

        return AsyncReduceScatter()

    @torch.no_grad()
    def finish(self) -> None:
        for work, summed, output, rank, size, average in self.pending:
            work.wait()  # type: ignore[attr-defined]
            output.copy_(summed.view(size, -1)[rank])
            if average:
                output.div_(size)
        self.pending.clear()


def _fsdp_source(fn: str) -> str:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return inspect.getsource(getattr(_fsdp_collectives, fn))


def _reduce_reads_output_as_views() -> bool:
    src = _fsdp_source("foreach_reduce")
    return all(
        text in src
        for text in (
            "reduce_scatter_comm(",
            "torch.as_strided(\n                reduce_output",
            "_div_if_needed(reduce_output, postdivide_factor)",
            "to_accumulate_grad = fsdp_param.sharded_param.grad is not None",
        )
    )


def _stage_sets(text: str) -> bool:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return text in inspect.getsource(_PipelineStageBase.backward_maybe_with_nosync)


def _eval_skips_backward() -> bool:
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    skip = "if not self.has_backward:\n            return"
    return (
        "self._has_backward = False" in inspect.getsource(schedules._PipelineSchedule.eval)
        and skip in inspect.getsource(_PipelineStageBase.backward_one_chunk)
        and skip in inspect.getsource(_PipelineStageBase.backward_weight_one_chunk)
    )


def _schedules_pass_last_backward() -> bool:
    from torch.distributed.pipelining import schedules

    src = inspect.getsource(schedules)
    return "last_backward=last_backward" in src and "stage.backward_weight_one_chunk(" in src


def _has_custom_reduce_scatter() -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    return hasattr(FSDPModule, "set_custom_reduce_scatter") and hasattr(_fsdp_api, "ReduceScatter")


def _post_backward_idempotent() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    src = inspect.getsource(FSDPParamGroup.post_backward)
    return "if len(fsdp_params_with_grad) == 0:\n            return" in src


TOUCHPOINTS: tuple[Touchpoint, ...] = (
    Touchpoint(
        "torch.distributed.pipelining schedules pass last_backward= by keyword to the stage's backward methods",
        "p3d.compat.overlap_internals.on_last_backward",
        _schedules_pass_last_backward,
    ),
    Touchpoint(
        "a schedule's eval() turns has_backward off and the stage's backward methods return at once then",
        "p3d.compat.overlap_internals.on_last_backward",
        _eval_skips_backward,
    ),
    *(
        Touchpoint(
            f"PipelineStage.backward_maybe_with_nosync calls self.submod.{name}(False)",
            "p3d.compat.overlap_internals.reduce_in_last_backward",
            partial(_stage_sets, f"self.submod.{name}(False)"),
        )
        for name in FSDP_SYNC_SETTERS
    ),
    Touchpoint(
        "FSDPParamGroup.post_backward returns when no gradient is left (perform_reduce_grad after the last backward)",
        "p3d.compat.overlap_internals.reduce_in_last_backward",
        _post_backward_idempotent,
    ),
    Touchpoint(
        "FSDPModule.set_custom_reduce_scatter and _fsdp_api.ReduceScatter",
        "p3d.compat.overlap_internals.DeferredReduceScatters",
        _has_custom_reduce_scatter,
    ),
    Touchpoint(
        "_fsdp_collectives.foreach_reduce reads the reduce-scatter's output only as views (no accumulate, no divide)",
        "p3d.compat.overlap_internals.DeferredReduceScatters",
        _reduce_reads_output_as_views,
    ),
)
