"""Every place p3d relies on ``torch.distributed.pipelining`` beyond its documented API, in one module.

The twin of ``p3d.compat.deepspeed_internals``: each touchpoint is a small function used by the rest of p3d and
an entry of ``TOUCHPOINTS``, whose ``present()`` checks (without processes) that the installed torch still has it;
tests/unit/pipeline/test_chunks.py runs them all, so an upgrade that removes one fails loudly, naming it.
Read in torch 2.13.0 (docs/schedules.md, "The torch API p3d relies on", gives the file and line of each).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

TORCH_CHECKED = ">=2.9 (last read: 2.13.0)"
MIN_TORCH = (2, 9)  # ScheduleDualPipeV and the I/W-split schedules as read; older ones are refused

# schedule name -> (class in torch.distributed.pipelining, chunk placement style). The class decides the
# placement (ScheduleInterleaved*: "loop"; ScheduleZBVZeroBubble / ScheduleDualPipeV: "v", two per rank).
SCHEDULE_CLASSES: dict[str, tuple[str, str]] = {
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
    "gpipe": ("ScheduleGPipe", "loop"),
}


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """One-line error when the installed torch is older than the pipelining API read here."""
    if torch_version() < MIN_TORCH:
        raise RuntimeError(
            f"torch {torch.__version__}: p3d's torch pipeline schedules need torch {TORCH_CHECKED}; "
            "upgrade torch or use schedule.pipeline=1f1b (DeepSpeed's engine)"
        )


def schedule_class(name: str) -> type:
    """The torch schedule class of schedule ``name`` (a key of ``SCHEDULE_CLASSES``)."""
    check_torch()
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULE_CLASSES[name][0])


def stage_to_rank_mapping(pp: int, n_stages: int, style: str) -> dict[int, int]:
    """torch's own placement (private ``_utils.generate_stage_to_rank_mapping``), for the test that
    ``geometry.chunk_to_rank`` computes the same."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    return generate_stage_to_rank_mapping(pp, n_stages, style=style)


@contextlib.contextmanager
def timed_p2p_waits(timing: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """While inside, every wait of a schedule on a pipeline neighbour (the private module-level
    ``schedules._wait_batch_p2p``, looked up at call time by the runtime) runs inside ``timing()``."""
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p

    def timed(work):
        with timing():
            return original(work)

    schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def torch_pass_order(schedule, pp_rank: int) -> list[str]:
    """The passes (F, B, I, W) torch's ``schedule`` plans for pipeline rank ``pp_rank``, in its order, as torch
    writes its actions (``1F3``: chunk 1's forward of micro batch 3): the compute actions of its undocumented
    ``pipeline_order`` (a DualPipeV ``OVERLAP_F_B`` action: its forward, then its backward, as the runtime runs it),
    but for the last rank of ``Schedule1F1B``, whose plan is off by one (its ``_n_microbatches``, ``_num_stages``)."""
    from torch.distributed.pipelining.schedules import Schedule1F1B
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    if isinstance(schedule, Schedule1F1B) and pp_rank == schedule._num_stages - 1:
        # torch's 1F1B plan numbers the last rank's forwards from 1 (F1 B0 F2 B1 ... F<m>: its counter starts at the
        # last warm-up forward's index, 0 also when there is none); its runtime runs each forward, then its backward
        m = schedule._n_microbatches
        return [f"{pp_rank}{kind}{i}" for i in range(m) for kind in "FB"]
    passes = (Kind.FORWARD, Kind.FULL_BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
    order = []
    for action in (schedule.pipeline_order or {}).get(pp_rank, []):
        if action is None:
            continue
        for a in action.sub_actions or () if action.computation_type == Kind.OVERLAP_F_B else (action,):
            if a.computation_type in passes:
                order.append(f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}")
    return order


@contextlib.contextmanager
def forward_only_order(schedule) -> Iterator[None]:
    """While inside, a multi-stage schedule runs only its forward actions and their sends and receives: each rank's
    action list (the private ``pipeline_order_with_comms`` that ``_PipelineScheduleRuntime`` executes) with every
    backward, weight and gradient action taken out, the rest in its order (FSDP's UNSHARD and RESHARD of a stage
    stay: ZeRO-2/3 gather a chunk's weights for its forwards).

    Why: torch 2.13's ``eval`` of ScheduleZBVZeroBubble / ScheduleDualPipeV still runs their input-gradient
    actions and fails ("can't steal_bwd_input if this stage doesn't have backward"). Forwards depend only on
    earlier forwards, so the filtered order keeps every dependency of the original, which ran."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    keep = (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F, Kind.UNSHARD, Kind.RESHARD)

    def forwards(actions):
        for a in actions:
            if a is not None and a.computation_type == Kind.OVERLAP_F_B:  # DualPipeV: a forward and a backward
                yield from (sub for sub in a.sub_actions or () if sub.computation_type == Kind.FORWARD)
            elif a is not None and a.computation_type in keep:
                yield a

    original = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: list(forwards(actions)) for rank, actions in original.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = original


def gathered_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``module.parameters()`` with each FSDP2 shard replaced by its gathered parameter, the one object FSDP2 keeps
    across gathers (``FSDPParam._unsharded_param``, whose storage is freed while the shard is registered) and the
    leaf that a forward's autograd graph holds. A parameter not yet gathered, or not sharded, is itself."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    gathered: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in fully_shard.state(sub)._fsdp_param_groups:  # type: ignore[attr-defined]
                for fp in group.fsdp_params:
                    if hasattr(fp, "_unsharded_param"):
                        gathered[id(fp.sharded_param)] = fp._unsharded_param
    return [gathered.get(id(p), p) for p in module.parameters()]


def split_backward_on_gathered_weights(stage) -> None:
    """Make ``stage``'s input (I) and weight (W) passes find the weights in the graph under ZeRO-3.

    torch 2.13's ``PipelineStage.backward_maybe_with_nosync`` lists ``submod.parameters()`` as an I or W pass
    starts: ``stage_backward_input`` looks the weights up in the graph with it and ``stage_backward_weight`` puts
    the W pass's gradients on it. Under ZeRO-3 a block's weights are freed after each forward, so when a later
    micro batch's forward ran in between, the list holds the shards, which are in no graph: the W pass then computes
    no weight gradient (measured before this: a gradient norm of 1.25 against the reference's 1.82 at step 1).
    Inside the pass the list is ``gathered_params``; nothing is gathered for it (W reads activations and output
    gradients, not weights), and the gradients land on the gathered parameters, where FSDP2's reduction reads them.
    """
    original = stage.backward_maybe_with_nosync
    submod = stage.submod

    def backward(backward_type, bwd_kwargs, last_backward=False):
        if backward_type == "full":
            return original(backward_type, bwd_kwargs, last_backward)
        weights = gathered_params(submod)
        submod.parameters = lambda recurse=True: iter(weights)  # for this call only
        try:
            return original(backward_type, bwd_kwargs, last_backward)
        finally:
            del submod.parameters

    stage.backward_maybe_with_nosync = backward


def after_metadata_inference(stage, fn: Callable[[], None]) -> None:
    """Call ``fn`` once torch's metadata inference of ``stage`` is over.

    The first time a torch 2.13 schedule steps, it runs each stage's forward and backward on stand-in tensors
    to learn the shapes (``_initialize_pp_stages``: ``_forward_metadata_inference``, ``_backward_metadata_inference``)
    and then calls ``stage._post_metadata_inference_cleanup()``, which drops FSDP's side effects of that pass;
    ``fn`` drops ours (the MoE blocks' routing figures of the stand-in tokens)."""
    original = stage._post_metadata_inference_cleanup

    def cleanup() -> None:
        original()
        fn()

    stage._post_metadata_inference_cleanup = cleanup


# ---- the checks


@dataclass(frozen=True)
class Touchpoint:
    name: str
    used_by: str
    present: Callable[[], bool]


def _has(module: str, attr: str) -> bool:
    import importlib

    return hasattr(importlib.import_module(module), attr)


def _accepts(module: str, cls: str, arg: str) -> bool:
    import importlib

    obj = getattr(importlib.import_module(module), cls, None)
    return obj is not None and arg in inspect.signature(obj.__init__).parameters


def _source_has(module: str, cls: str, method: str, text: str) -> bool:
    import importlib

    obj = getattr(getattr(importlib.import_module(module), cls, None), method, None)
    return obj is not None and text in inspect.getsource(obj)


PIPELINING = "torch.distributed.pipelining"


def _schedules():
    import importlib

    return importlib.import_module(f"{PIPELINING}.schedules")


TOUCHPOINTS: tuple[Touchpoint, ...] = (
    *(
        Touchpoint(
            f"{PIPELINING}.{cls}(scale_grads=)",
            "p3d.train.executors.torch_pipeline",
            partial(_accepts, PIPELINING, cls, "scale_grads"),
        )
        for cls, _ in SCHEDULE_CLASSES.values()
    ),
    Touchpoint(
        f"{PIPELINING}.PipelineStage(group=)",
        "p3d.train.executors.torch_pipeline",
        lambda: _accepts(PIPELINING, "PipelineStage", "group"),
    ),
    Touchpoint(
        f"{PIPELINING}._utils.generate_stage_to_rank_mapping",
        "tests/unit/pipeline/test_chunks.py",
        lambda: _has(f"{PIPELINING}._utils", "generate_stage_to_rank_mapping"),
    ),
    Touchpoint(
        f"{PIPELINING}.schedules._ComputationType(FORWARD, SEND_F, RECV_F, OVERLAP_F_B)",
        "p3d.compat.pipelining_internals.forward_only_order",
        lambda: all(
            hasattr(getattr(_schedules(), "_ComputationType", None), k)
            for k in ("FORWARD", "SEND_F", "RECV_F", "OVERLAP_F_B")
        ),
    ),
    Touchpoint(
        f"{PIPELINING}.schedules._PipelineScheduleRuntime._step_microbatches runs pipeline_order_with_comms",
        "p3d.compat.pipelining_internals.forward_only_order",
        lambda: (
            "pipeline_order_with_comms" in inspect.getsource(_schedules()._PipelineScheduleRuntime._step_microbatches)
        ),
    ),
    Touchpoint(
        f"{PIPELINING} schedules call stage._post_metadata_inference_cleanup() after metadata inference",
        "p3d.compat.pipelining_internals.after_metadata_inference",
        lambda: (
            _source_has(
                f"{PIPELINING}.schedules", "_PipelineSchedule", "_initialize_pp_stages", "_post_metadata_inference"
            )
            and _source_has(f"{PIPELINING}.stage", "PipelineStage", "_post_metadata_inference_cleanup", "def ")
        ),
    ),
    Touchpoint(
        f"{PIPELINING}.PipelineStage.backward_maybe_with_nosync passes submod.parameters() to the I and W passes",
        "p3d.compat.pipelining_internals.split_backward_on_gathered_weights",
        lambda: _source_has(
            f"{PIPELINING}.stage", "_PipelineStageBase", "backward_maybe_with_nosync", "self.submod.parameters()"
        ),
    ),
    Touchpoint(
        "torch.distributed.fsdp fully_shard.state(m)._fsdp_param_groups[].fsdp_params[]._unsharded_param",
        "p3d.compat.pipelining_internals.gathered_params",
        lambda: (
            _source_has(
                "torch.distributed.fsdp._fully_shard._fsdp_param",
                "FSDPParam",
                "init_unsharded_param",
                "self._unsharded_param",
            )
            and _source_has(
                "torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "__init__", "_fsdp_param_groups"
            )
            and hasattr(__import__("torch.distributed.fsdp", fromlist=["fully_shard"]).fully_shard, "state")
        ),
    ),
    Touchpoint(
        f"{PIPELINING} schedules' pipeline_order (rank -> _Action(stage_index, computation_type, microbatch_index)), "
        "_num_stages, _n_microbatches",
        "p3d.compat.pipelining_internals.torch_pass_order",
        lambda: (
            _source_has(f"{PIPELINING}.schedules", "PipelineScheduleSingle", "__init__", "self.pipeline_order")
            and _source_has(f"{PIPELINING}.schedules", "PipelineScheduleMulti", "__init__", "self.pipeline_order")
            and _source_has(f"{PIPELINING}.schedules", "PipelineScheduleSingle", "__init__", "self._num_stages")
            and _source_has(f"{PIPELINING}.schedules", "_PipelineSchedule", "__init__", "self._n_microbatches")
            and all(
                f in _schedules()._Action._fields
                for f in ("stage_index", "computation_type", "microbatch_index", "sub_actions")
            )
        ),
    ),
    Touchpoint(
        f"{PIPELINING}.schedules._wait_batch_p2p",
        "p3d.compat.pipelining_internals.timed_p2p_waits",
        lambda: _has(f"{PIPELINING}.schedules", "_wait_batch_p2p"),
    ),
)
