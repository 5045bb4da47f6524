"""The executor of a run's steps: DeepSpeed's pipeline engine (``schedule.pipeline=1f1b``, ds_engine.py) or a torch
pipeline schedule (interleaved_1f1b, interleaved_zero_bubble, zbv, dualpipev, gpipe: torch_schedules.py, which runs
torch_pipeline.TorchPipeline).

The step loop (p3d.train.loop) talks to one small interface, which both satisfy: ``train_batch(data_iter) ->
loss``, ``evaluate(val) -> loss``, ``get_lr()``, ``grad_norm()``, ``load(path) -> meta``, ``set_position(step,
samples)``, ``reads_data``, ``checkpointer`` (p3d.checkpoint.checkpointer.Checkpointer: the run's saves), and three
observers built with it: ``timer`` (seconds blocked on pipeline neighbours and of compute, per step),
``gate`` (p3d.train.faults.StepGate: the step's faults, judged before the update) and ``hang``
(p3d.parallel.hang.HangWatch). Under DeepSpeed these wrap the engine's pipeline instructions; under a torch schedule
the timer wraps the stages' compute and the schedule's p2p waits, the gate is called between the schedule and
the gradient reductions, and the hang watch watches the whole step as one phase (no per-instruction marks).
"""

from __future__ import annotations

import torch

from p3d.parallel.mesh import Mesh


def build_executor(cfg, plan, mesh: Mesh, rank: int, device: torch.device, run_dir):
    """The executor the config implies (``schedule_rules.runs_on_deepspeed``; validated before launch)."""
    from p3d.layout.schedule_rules import runs_on_deepspeed

    if runs_on_deepspeed(cfg):
        from p3d.train.executors.ds_engine import DeepSpeedExecutor

        return DeepSpeedExecutor(cfg, plan, mesh, rank, device, run_dir)
    from p3d.train.executors.torch_schedules import TorchExecutor

    return TorchExecutor(cfg, plan, mesh, rank, device, run_dir)
