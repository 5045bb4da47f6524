"""The torch pipeline schedules (interleaved_1f1b, interleaved_zero_bubble, zbv, dualpipev, gpipe) behind the
executor interface: ``p3d.train.executors.torch_pipeline.TorchPipeline`` runs them; the timer wraps its stages'
compute and p2p waits, the step gate runs after the gradient reductions (they overlap the schedule's last
backward), before the optimizer."""

from __future__ import annotations

from functools import partial

import torch

from p3d.checkpoint.checkpointer import Checkpointer, OptimizerStates, updates_applied
from p3d.compat.pipelining_internals import torch_pass_order
from p3d.parallel.hang import HangWatch
from p3d.parallel.mesh import Mesh
from p3d.rundir.files import logs as run_logs
from p3d.train.block_seconds import add_block_seconds, rank_block_seconds
from p3d.train.executors.torch_optim import ExpertZero1
from p3d.train.executors.torch_pipeline import TorchPipeline
from p3d.train.faults import StepGate
from p3d.train.optim import resume_schedule
from p3d.train.timing import TorchStageTimer


def optimizer_states(optimizer) -> OptimizerStates:
    """Where a torch schedule's Adam states live: every parameter's on every rank, or under ZeRO-1 (torch's
    ``ZeroRedundancyOptimizer``) those of the parameters its local optimizer ``optim`` steps, whole."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, (ZeroRedundancyOptimizer, ExpertZero1)):
        owns = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
        return OptimizerStates(optimizer.optim, owns)
    return OptimizerStates(optimizer)


class TorchExecutor:
    """A torch pipeline schedule (``p3d.train.executors.torch_pipeline.TorchPipeline``) behind the same interface."""

    def __init__(self, cfg, plan, mesh: Mesh, rank: int, device: torch.device, run_dir):
        self.cfg, self.plan, self.mesh = cfg, plan, mesh
        s = cfg.schedule
        self.pipe = TorchPipeline(
            cfg, plan, mesh, s.pipeline.value, s.virtual_stages, device=device, prepare=self.init_from
        )
        self.module, self.scheduler = self.pipe.module, self.pipe.lr_scheduler
        self.precision_line = self.pipe.precision_line  # train.fp8's console line
        add_block_seconds(self.module, rank_block_seconds(cfg.cluster, plan, rank))  # P3D_TEST_BLOCK_SECONDS
        self.timer = TorchStageTimer(self.pipe.stages, rank, device)
        self.pipe.clocks = self.timer  # the schedule's waits, the loss and the dp collectives: the same clocks
        self.timer.planned = partial(torch_pass_order, self.pipe.schedule, mesh.pp_rank)  # a traced step's plan
        self.timer.traced_calls.append((self.pipe, "clip_and_step", "optimizer"))  # on traced steps only
        self.gate = StepGate(None, self.module, mesh, plan, cfg.train, device)
        self.gate.measure_norm = self.pipe.reduced_norm
        self.hang = HangWatch(None, mesh, cfg.cluster.timeout_s, run_logs(run_dir))
        self.reads_data = self.pipe.holds_first or self.pipe.holds_last
        self.step, self.norm = 0, float("nan")
        self.pipe.before_update = lambda grads, loss: self.gate.before_update(self.step, grads, loss)
        states = optimizer_states(self.pipe.optimizer)
        self.checkpointer = Checkpointer(
            cfg, plan, mesh, run_dir, self.module, states, self.scheduler, device, self.chunks
        )

    def init_from(self, chunks) -> None:
        """``model.init_from``: the HF weights into the chunks, whole (before ZeRO-2/3 shard them)."""
        cfg = self.cfg
        if cfg.model.init_from and cfg.train.resume == "none":
            from p3d.hf.load import load_into

            for chunk in chunks:  # a V placement's shared tied table is set twice, to the same values
                load_into(chunk, cfg.model.init_from, cfg.model, self.mesh)

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

    def load(self, path) -> dict:
        """A checkpoint into this rank's chunks and optimizer; the LR schedule continues after its updates."""
        meta = self.checkpointer.load(path)
        resume_schedule(self.scheduler, updates_applied(meta))
        return meta
