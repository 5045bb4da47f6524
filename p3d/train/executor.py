"""The executor of a run's steps: DeepSpeed's pipeline engine (``schedule.pipeline=1f1b``) or a torch pipeline
schedule (``p3d.train.torch_pipe.TorchPipeline``: interleaved_1f1b, interleaved_zero_bubble, zbv, dualpipev, gpipe).

The trainer's step loop talks to one small interface (docs/design/pipeline-schedules.md §2), which both satisfy:
``train_batch(data_iter) -> loss``, ``evaluate(val) -> loss``, ``get_lr()``, ``grad_norm()``, ``save(...)`` /
``load(...)`` (the layout-free checkpoint, p3d.train.checkpoint), ``set_position(step, samples)``, ``reads_data``,
and three observers built with it: ``timer`` (seconds blocked on pipeline neighbours and of compute, per step),
``gate`` (p3d.train.faults.StepGate: the step's faults, judged before the update) and ``hang``
(p3d.dist.hang.HangWatch). Under DeepSpeed these wrap the engine's pipeline instructions; under a torch schedule
the timer wraps the stages' compute and the schedule's p2p waits, the gate is called between the schedule and
the gradient reductions, and the hang watch watches the whole step as one phase (no per-instruction marks).
"""

from __future__ import annotations

import torch

from p3d.config.deepspeed_json import deepspeed_config
from p3d.config.schema import DType, Recompute
from p3d.data.loader import rank_slice
from p3d.dist.hang import HangWatch
from p3d.dist.mesh import Mesh
from p3d.ds_compat import param_gradients, quiet_stdout, set_engine_position, skip_backward_allreduce, tied_weights
from p3d.model.pipe import P3DPipelineModule, VocabParallelLoss, layer_specs_of
from p3d.run_dir import logs as run_logs
from p3d.train import checkpoint
from p3d.train.block_seconds import add_block_seconds
from p3d.train.faults import StepGate
from p3d.train.optim import build_optimizer, norm_once_reduced
from p3d.train.timing import StageTimer, TorchStageTimer


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
    if cfg.model.init_from and cfg.train.resume == "none":
        from p3d.hf import load_into

        load_into(module, cfg.model.init_from, cfg.model.n_layers, mesh)  # only this rank's slices
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
        add_block_seconds(self.module)  # the P3D_TEST_BLOCK_SECONDS test hook (off unless set)
        self.gate = StepGate(self.engine, self.module, mesh, plan, cfg.train, device)
        self.gate.measure_norm = lambda: norm_once_reduced(
            param_gradients(self.engine, self.module), tied_weights(self.module), mesh
        )
        self.timer = StageTimer(self.engine, rank, mesh.pp_group)  # after the gate: its drain barrier runs first
        self.hang = HangWatch(self.engine, mesh, cfg.cluster.timeout_s, run_logs(run_dir))  # last: wraps the others
        self.reads_data = mesh.is_first_stage or mesh.is_last_stage

    def train_batch(self, data) -> float:
        return float(self.engine.train_batch(data_iter=data))

    def evaluate(self, val_batches) -> float:
        return evaluate(self.engine, val_batches, self.cfg, self.plan, self.mesh)

    def get_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self) -> float:
        return float(self.engine.get_global_grad_norm())

    def set_position(self, step: int, samples: int) -> None:
        set_engine_position(self.engine, step, samples)

    def save(self, saver, run_dir, step: int, samples: int, extra: dict):
        return checkpoint.save(
            saver,
            self.engine,
            self.module,
            self.mesh,
            self.cfg,
            self.plan,
            run_dir,
            step,
            samples,
            self.scheduler,
            extra,
        )

    def load(self, path) -> dict:
        return checkpoint.load(path, self.engine, self.module, self.mesh, self.plan, self.scheduler)


class TorchExecutor:
    """A torch pipeline schedule (``p3d.train.torch_pipe.TorchPipeline``) behind the same interface."""

    def __init__(self, cfg, plan, mesh: Mesh, rank: int, device: torch.device, run_dir):
        from p3d.train.torch_pipe import TorchPipeline

        self.cfg, self.plan, self.mesh = cfg, plan, mesh
        s = cfg.schedule
        self.pipe = TorchPipeline(cfg, plan, mesh, s.pipeline.value, s.virtual_stages, device=device)
        self.module, self.scheduler = self.pipe.module, self.pipe.lr_scheduler
        add_block_seconds(self.module)  # the P3D_TEST_BLOCK_SECONDS test hook (off unless set)
        if cfg.model.init_from and cfg.train.resume == "none":
            from p3d.hf import load_into

            for chunk in self.pipe.chunks:  # a V placement's shared tied table is set twice, to the same values
                load_into(chunk, cfg.model.init_from, cfg.model.n_layers, mesh)
        self.timer = TorchStageTimer(self.pipe.stages, rank)
        self.pipe.add_wait, self.pipe.add_compute = self.timer.add_wait, self.timer.add_compute
        self.gate = StepGate(None, self.module, mesh, plan, cfg.train, device)
        self.gate.measure_norm = self.pipe.norm_once_reduced
        self.hang = HangWatch(None, mesh, cfg.cluster.timeout_s, run_logs(run_dir))
        self.reads_data = self.pipe.holds_first or self.pipe.holds_last
        self.step, self.norm = 0, float("nan")
        self.pipe.before_update = lambda grads, loss: self.gate.before_update(self.step, grads, loss)

    @property
    def chunks(self) -> tuple[list[int], list]:
        """(chunk bounds, [(chunk index, chunk module)]): how checkpoints see this rank's share."""
        return self.pipe.bounds, list(zip(self.pipe.chunk_ids, self.pipe.chunks))

    def train_batch(self, data) -> float:
        self.step += 1
        self.timer.training = True
        try:
            loss, self.norm = self.pipe.train_batch(data)
        finally:
            self.timer.training = False
        return loss

    def evaluate(self, val_batches) -> float:
        """Mean loss over the fixed held-out batches (forward only, through the same schedule)."""
        losses = [self.pipe.eval_step(batch) for batch in val_batches]
        return sum(losses) / len(losses)

    def get_lr(self) -> float:
        return self.pipe.get_lr()

    def grad_norm(self) -> float:
        return self.norm

    def set_position(self, step: int, samples: int) -> None:
        self.step = step

    def save(self, saver, run_dir, step: int, samples: int, extra: dict):
        p, states = self, AdamStates(self.pipe.optimizer)
        return checkpoint.save(
            saver, states, p.module, p.mesh, p.cfg, p.plan, run_dir, step, samples, p.scheduler, extra, p.chunks
        )

    def load(self, path) -> dict:
        states = AdamStates(self.pipe.optimizer)
        return checkpoint.load(path, states, self.module, self.mesh, self.plan, self.scheduler, self.chunks)


class AdamStates:
    """What checkpoint.save / load read of a torch schedule's optimizer: ``optimizer.state`` (param -> Adam states)
    and ``owns``: None when this rank keeps every parameter's states, else the ids of the parameters whose states
    it keeps (torch's ``ZeroRedundancyOptimizer``: its local optimizer ``optim`` steps those only)."""

    def __init__(self, optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.optimizer, self.owns = optimizer, None
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            self.optimizer = optimizer.optim
            self.owns = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}


def build_executor(cfg, plan, mesh: Mesh, rank: int, device: torch.device, run_dir):
    """The executor ``schedule.pipeline`` names (validated by p3d.config.validate_schedule before launch)."""
    cls = DeepSpeedExecutor if cfg.schedule.pipeline.value == "1f1b" else TorchExecutor
    return cls(cfg, plan, mesh, rank, device, run_dir)
