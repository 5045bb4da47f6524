"""Every place p3d relies on DeepSpeed beyond its documented API, in one module.

Each touchpoint is a small function used by the rest of p3d and an entry of ``TOUCHPOINTS``, whose
``present()`` checks (without processes) that the installed DeepSpeed still has it;
tests/unit/compat/test_deepspeed_internals.py runs them all, so an upgrade that removes one fails loudly, naming it,
instead of training a different model.
Checked against DeepSpeed 0.16 - 0.19.8 (pyproject pins ``deepspeed>=0.16,<0.20``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DS_CHECKED = ">=0.16,<0.20 (last read: 0.19.8)"


def _source_has(obj_path: str, text: str) -> bool:
    """Whether the source of ``module:qualname`` mentions ``text`` (for instance attributes)."""
    import importlib

    module, _, qualname = obj_path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else []:
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    try:
        return text in inspect.getsource(obj)
    except (OSError, TypeError):
        return False


# ---- the touchpoints


@contextlib.contextmanager
def quiet_stdout():
    """Keep DeepSpeed's bare prints on rank 0 (``SEED_LAYERS=...``, ``Using topology: ...``) off the
    console; they go to this worker's log at debug level."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    if buf.getvalue().strip():
        logging.getLogger("p3d.deepspeed").debug(buf.getvalue().strip())


def disable_cpu_shm_comm() -> None:
    """DeepSpeed JIT-compiles a shared-memory all-reduce (30 s to minutes, needs g++) when its comm backend
    starts on CPU; it serves inference only, never training: mark it unavailable in ``deepspeed.ops``'s
    private ``__compatible_ops__`` table."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def pipeline_instruction_map(engine) -> dict:
    """The pipeline engine's private instruction -> method table (``PipelineEngine._INSTRUCTION_MAP``), as this
    instance sees it (with the wrappers an earlier :func:`set_pipeline_instruction_map` put there)."""
    return engine._INSTRUCTION_MAP


def set_pipeline_instruction_map(engine, table: dict) -> None:
    """Replace the table on this engine instance only (the engine looks it up on ``self``)."""
    engine._INSTRUCTION_MAP = table


def deepspeed_pass_order(micro_batches: int, stages: int, stage_id: int) -> list[str]:
    """The forward and backward passes DeepSpeed's ``TrainSchedule`` runs on stage ``stage_id``, in its order, in
    torch's notation (``0F3``: stage 0's forward of micro batch 3). The micro batch of each is the schedule's own
    (its private ``_step_to_micro_batch``: the instructions carry only a buffer id)."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    schedule = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    order = []
    for step_id, cmds in enumerate(schedule.steps()):
        micro_batch, _ = schedule._step_to_micro_batch(step_id)
        for cmd in cmds:
            if isinstance(cmd, (ForwardPass, BackwardPass)):
                order.append(f"{stage_id}{'F' if isinstance(cmd, ForwardPass) else 'B'}{micro_batch}")
    return order


def engine_pass_order(engine) -> list[str]:
    """:func:`deepspeed_pass_order` of this pipeline engine's stage (``micro_batches``, ``num_stages``,
    ``stage_id``)."""
    return deepspeed_pass_order(engine.micro_batches, engine.num_stages, engine.stage_id)


def skip_backward_allreduce(engine) -> None:
    """Skip the pipeline engine's dp gradient all-reduce (``pipeline_enable_backward_allreduce``)."""
    engine.pipeline_enable_backward_allreduce = False


def set_engine_position(engine, steps: int, samples: int) -> None:
    """The engine's own step and sample counters (``global_steps``, ``global_samples``) after a resume."""
    engine.global_steps, engine.global_samples = steps, samples


def local_gradients(engine, module) -> list:
    """This rank's gradients as they stand after the step's last backward pass: the parameters' ``.grad`` and,
    under DeepSpeed's bf16 optimizer, the fp32 gradients it accumulates the micro batches in
    (``fp32_groups_gradients_flat``; its bf16 ``.grad`` holds the last micro batch only)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return grads + list(getattr(engine.optimizer, "fp32_groups_gradients_flat", []))


def param_gradients(engine, module) -> list:
    """(parameter, its gradient so far) for every trainable parameter of this rank after the step's last backward
    pass: under DeepSpeed's bf16 optimizer the fp32 gradient it accumulates (``param._hp_grad``, a view of
    ``fp32_groups_gradients_flat``), else ``.grad``; zeros for a parameter with none."""
    import torch

    pairs = []
    for p in module.parameters():
        if p.requires_grad:
            g = getattr(p, "_hp_grad", None)
            g = p.grad if g is None else g
            pairs.append((p, torch.zeros_like(p) if g is None else g))
    return pairs


def tied_weights(module) -> list:
    """(tied weight, the group of its holders) for the tied copies this rank holds (``PipelineModule``)."""
    return list(module.get_tied_weights_and_groups())


# The attribute DeepSpeed's engine copies from a client optimizer after ``step`` to report the grad norm.
GRAD_NORM_ATTR = "_global_grad_norm"


PIPE_REPLICATED_ATTR = "ds_pipe_replicated"  # the marker attribute itself (p3d.parallel.zero.fsdp copies it)


def is_pipe_replicated(p) -> bool:
    """A tied layer's copy on a later stage (``ds_pipe_replicated``, set by ``PipelineModule``)."""
    return bool(getattr(p, "ds_pipe_replicated", False))


def mark_pipe_replicated(p) -> None:
    """Mark ``p`` as a tied layer's later copy, as ``PipelineModule`` marks its own (the torch executor's copy of
    the tied table on the last chunk's rank, p3d.train.executors.torch_pipeline: counted once in the norm, like
    DeepSpeed's)."""
    p.ds_pipe_replicated = True


def has_hp_mapping(module) -> bool:
    """ZeRO and DeepSpeed's bf16 optimizer keep an fp32 master partitioned over dp behind each param
    (``param._hp_mapping``)."""
    return any(hasattr(p, "_hp_mapping") for p in module.parameters())


def hp_fragment(p, keys: tuple[str, ...]):
    """This dp rank's part of a parameter's fp32 master and optimizer states under ZeRO / bf16:
    ``(start, numel, {"master": flat fp32, key: flat fp32 ...})`` (a range of the flattened parameter),
    or None when this rank's partition holds none of it (``param._hp_mapping``, ``lp_fragment_address``)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    addr = mapping.lp_fragment_address
    states = {"master": mapping.get_hp_fragment(), **{k: mapping.get_hp_fragment(k) for k in keys}}
    return addr.start, addr.numel, states


def links_optimizer_states(wrapper) -> bool:
    """Whether a ZeRO / bf16 optimizer wrapper links its parameters' views of the optimizer states
    (plain fp32 without ZeRO does not)."""
    return hasattr(wrapper, "_lazy_init_hp_params_optimizer_state")


def relink_optimizer_states(wrapper) -> None:
    """Make such a wrapper link those views again (``_hp_optimizer_states_linked``,
    ``_lazy_init_hp_params_optimizer_state``)."""
    wrapper._hp_optimizer_states_linked = False
    wrapper._lazy_init_hp_params_optimizer_state()


@contextlib.contextmanager
def pipe_sends(record: list, keep_tensors: bool = False):
    """Record every tensor this rank's pipeline engine sends to a neighbouring stage while the block runs:
    ``record`` gets ``(dest_stage, shape, dtype, nbytes)`` per send (activations, their gradients and
    DeepSpeed's meta tensors), plus a copy of the tensor with ``keep_tensors``. The engine calls
    ``deepspeed.runtime.pipe.p2p.send`` through the module attribute, so wrapping that attribute sees each
    send (used by tests/workers/test_sp_p2p.py)."""
    from deepspeed.runtime.pipe import p2p

    original = p2p.send

    def counted(tensor, dest_stage, *args, **kwargs):
        sent = (dest_stage, tuple(tensor.shape), str(tensor.dtype), tensor.numel() * tensor.element_size())
        record.append((*sent, tensor.detach().clone()) if keep_tensors else sent)
        return original(tensor, dest_stage, *args, **kwargs)

    p2p.send = counted
    try:
        yield record
    finally:
        p2p.send = original


def wrapped_optimizer(wrapper):
    """The torch optimizer under DeepSpeed's ZeRO / bf16 wrapper (``engine.optimizer.optimizer``)."""
    return wrapper.optimizer


# ---- what tests/unit/compat/test_deepspeed_internals.py checks


@dataclass(frozen=True)
class Touchpoint:
    name: str
    used_by: str
    present: Callable[[], bool]


def _pipe_engine():
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return PipelineEngine


def _zero_and_bf16():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return BF16_Optimizer, DeepSpeedZeroOptimizer


def _compatible_ops_table() -> bool:
    import deepspeed.ops

    return isinstance(deepspeed.ops.__compatible_ops__, dict)


TOUCHPOINTS = (
    Touchpoint("deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']", "p3d.train.worker", _compatible_ops_table),
    Touchpoint(
        "PipelineEngine._INSTRUCTION_MAP",
        "p3d.train.timing",
        lambda: isinstance(getattr(_pipe_engine(), "_INSTRUCTION_MAP", None), dict),
    ),
    Touchpoint(
        "TrainSchedule._step_to_micro_batch; PipelineEngine.micro_batches / num_stages / stage_id",
        "p3d.train.timing (traces)",
        lambda: (
            _source_has("deepspeed.runtime.pipe.schedule:TrainSchedule", "def _step_to_micro_batch(self, step_id)")
            and all(
                _source_has("deepspeed.runtime.pipe.engine:PipelineEngine", f"self.{name} =")
                for name in ("micro_batches", "num_stages", "stage_id")
            )
        ),
    ),
    Touchpoint(
        "TrainSchedule: ReduceTiedGrads first after the last BackwardPass",
        "p3d.train.faults",
        lambda: _source_has("deepspeed.runtime.pipe.schedule:TrainSchedule", "cmds.append(ReduceTiedGrads())"),
    ),
    Touchpoint(
        "PipelineEngine.total_loss / DeepSpeedEngine.skipped_steps (optimizer.overflow)",
        "p3d.train.faults",
        lambda: (
            _source_has("deepspeed.runtime.pipe.engine:PipelineEngine", "self.total_loss")
            and _source_has("deepspeed.runtime.engine:DeepSpeedEngine", "overflow = self.optimizer.overflow")
        ),
    ),
    Touchpoint(
        "BF16_Optimizer.fp32_groups_gradients_flat",
        "p3d.train.faults",
        lambda: _source_has("deepspeed.runtime.bf16_optimizer:BF16_Optimizer", "self.fp32_groups_gradients_flat"),
    ),
    Touchpoint(
        "param._hp_grad (BF16_Optimizer) and PipelineModule.get_tied_weights_and_groups",
        "p3d.train.faults",
        lambda: (
            _source_has("deepspeed.runtime.bf16_optimizer:BF16_Optimizer", "lp._hp_grad = hp_grad")
            and _source_has("deepspeed.runtime.pipe.engine:PipelineEngine", "get_tied_weights_and_groups()")
        ),
    ),
    Touchpoint(
        "PipelineEngine sends through deepspeed.runtime.pipe.p2p.send",
        "tests/workers/test_sp_p2p.py",
        lambda: (
            _source_has("deepspeed.runtime.pipe.engine:PipelineEngine", "p2p.send(")
            and _source_has("deepspeed.runtime.pipe.engine", "from . import p2p")
        ),
    ),
    Touchpoint(
        "PipelineEngine.pipeline_enable_backward_allreduce",
        "p3d.train.loop",
        lambda: _source_has("deepspeed.runtime.pipe.engine:PipelineEngine", "self.pipeline_enable_backward_allreduce"),
    ),
    Touchpoint(
        "DeepSpeedEngine.global_steps / global_samples",
        "p3d.train.loop",
        lambda: _source_has("deepspeed.runtime.engine:DeepSpeedEngine", "self.global_samples = 0"),
    ),
    Touchpoint(
        f"client optimizer.{GRAD_NORM_ATTR} read by DeepSpeedEngine",
        "p3d.train.optim",
        lambda: _source_has("deepspeed.runtime.engine:DeepSpeedEngine", f"self.optimizer.{GRAD_NORM_ATTR}"),
    ),
    Touchpoint(
        "param.ds_pipe_replicated",
        "p3d.train.optim",
        lambda: _source_has("deepspeed.runtime.pipe.module", ".ds_pipe_replicated = True"),
    ),
    Touchpoint(
        "param._hp_mapping",
        "p3d.checkpoint.checkpointer",
        lambda: all(_source_has(f"{c.__module__}:{c.__qualname__}", "._hp_mapping") for c in _zero_and_bf16()),
    ),
    Touchpoint(
        "_hp_optimizer_states_linked / _lazy_init_hp_params_optimizer_state",
        "p3d.checkpoint.checkpointer",
        lambda: all(
            hasattr(c, "_lazy_init_hp_params_optimizer_state")
            and _source_has(f"{c.__module__}:{c.__qualname__}", "self._hp_optimizer_states_linked")
            for c in _zero_and_bf16()
        ),
    ),
    Touchpoint(
        "ZeRO / bf16 wrapper .optimizer (the torch optimizer)",
        "p3d.checkpoint.checkpointer",
        lambda: all(
            _source_has(f"{c.__module__}:{c.__qualname__}", "self.optimizer = init_optimizer") for c in _zero_and_bf16()
        ),
    ),
)
