"""``schedule.pipeline=1f1b``: DeepSpeed's PipelineEngine runs the steps (plain 1F1B, one stage per pp rank), with
our optimizer and LR schedule; the step gate, the stage timer and the hang watch wrap its pipeline instructions."""

from __future__ import annotations

import torch

from p3d.checkpoint.checkpointer import Checkpointer, OptimizerStates, updates_applied
from p3d.compat.deepspeed_internals import (
    param_gradients,
    quiet_stdout,
    set_engine_position,
    skip_backward_allreduce,
    tied_weights,
)
from p3d.config.schema import DType, Recompute
from p3d.data.loader import rank_slice
from p3d.model.moe import set_micro_batches
from p3d.parallel.hang import HangWatch
from p3d.parallel.mesh import Mesh
from p3d.parallel.pipeline.specs import P3DPipelineModule, VocabParallelLoss, layer_specs_of
from p3d.rundir.files import logs as run_logs
from p3d.train.block_seconds import add_block_seconds, rank_block_seconds
from p3d.train.executors.deepspeed_config import deepspeed_config
from p3d.train.faults import StepGate
from p3d.train.optim import build_optimizer, norm_once_reduced, resume_schedule
from p3d.train.timing import StageTimer


def build_pipeline(cfg, plan, mesh: Mesh) -> P3DPipelineModule:
    specs = layer_specs_of(cfg, plan, mesh)
    recompute = cfg.schedule.recompute == Recompute.full
    return P3DPipelineModule(
        specs,
        plan.stage_bounds,
        topology=mesh.topology,
        loss_fn=VocabParallelLoss(cfg.model, plan.padded_vocab_size, mesh),
        activation_checkpoint_interval=1 if recompute else 0,
        checkpointable_layers=["TransformerBlock"] if recompute else None,
    )


def evaluate(engine, val_batches, cfg, plan, mesh) -> float:
    """Mean loss over the fixed held-out batches (forward only, the same 1F1B stage order)."""
    losses = []
    for batch in val_batches:
        it = rank_slice(batch, cfg.schedule.micro_batch_size, plan.dp, mesh.dp_rank) if batch is not None else None
        losses.append(float(engine.eval_batch(data_iter=it)))
    engine.module.train()
    return sum(losses) / len(losses)


def build_engine(cfg, plan, mesh: Mesh):
    """This rank's pipeline module (seeded init, or HF weights when model.init_from is set), optimizer,
    LR schedule and DeepSpeed engine, exactly as a training run uses them."""
    import deepspeed

    torch.manual_seed(cfg.train.seed)
    with quiet_stdout():
        module = build_pipeline(cfg, plan, mesh)  # fp32; DeepSpeed casts to bf16 when the config asks
    set_micro_batches(module, plan.micro_batches)  # a balancing loss weighs 1 / m, as DeepSpeed scales the LM loss
    if cfg.model.init_from and cfg.train.resume == "none":
        from p3d.hf.load import load_into

        load_into(module, cfg.model.init_from, cfg.model, mesh)  # only this rank's slices
    clip_here = cfg.zero.stage == 0 and cfg.train.dtype == DType.fp32
    optimizer, scheduler = build_optimizer(module, cfg.train, mesh, clip_here=clip_here)
    with quiet_stdout():
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, plan)
        )
    if plan.dp == 1 and cfg.zero.stage == 0 and cfg.train.dtype == DType.fp32:
        # nothing to all-reduce over one replica; DeepSpeed would still flatten, "reduce" over a group of
        # one and copy back every gradient each step (0.4 s per step for model=small on a CPU core)
        skip_backward_allreduce(engine)
    return engine, module, scheduler


class DeepSpeedExecutor:
    """``schedule.pipeline=1f1b``: DeepSpeed's PipelineEngine, as p3d has always run it."""

    def __init__(self, cfg, plan, mesh: Mesh, rank: int, device: torch.device, run_dir):
        self.cfg, self.plan, self.mesh = cfg, plan, mesh
        self.engine, self.module, self.scheduler = build_engine(cfg, plan, mesh)
        add_block_seconds(self.module, rank_block_seconds(cfg.cluster, plan, rank))  # P3D_TEST_BLOCK_SECONDS
        self.gate = StepGate(self.engine, self.module, mesh, plan, cfg.train, device)
        self.gate.measure_norm = lambda: norm_once_reduced(
            param_gradients(self.engine, self.module), tied_weights(self.module), mesh
        )
        # after the gate: its drain barrier runs first
        self.timer = StageTimer(self.engine, rank, mesh.pp_group, mesh.dp, device)
        # tp and ep collectives are p3d's layers' (dp: the ReduceGrads instruction; pp: the p2p instructions)
        self.timer.comm.classify_mesh(mesh, ("tp", "ep"))
        self.hang = HangWatch(self.engine, mesh, cfg.cluster.timeout_s, run_logs(run_dir))  # last: wraps the others
        self.reads_data = mesh.is_first_stage or mesh.is_last_stage
        states = OptimizerStates(self.engine.optimizer)
        self.checkpointer = Checkpointer(cfg, plan, mesh, run_dir, self.module, states, self.scheduler, device)

    def train_batch(self, data) -> float:
        with self.timer.comm.timed():
            loss = self.engine.train_batch(data_iter=data)
        return float(loss)

    def evaluate(self, val_batches) -> float:
        return evaluate(self.engine, val_batches, self.cfg, self.plan, self.mesh)

    def get_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self) -> float:
        return float(self.engine.get_global_grad_norm())

    def set_position(self, step: int, samples: int) -> None:
        set_engine_position(self.engine, step, samples)

    def load(self, path) -> dict:
        """A checkpoint into this rank's stage and optimizer; the LR schedule continues after its updates."""
        meta = self.checkpointer.load(path)
        resume_schedule(self.scheduler, updates_applied(meta))
        return meta
