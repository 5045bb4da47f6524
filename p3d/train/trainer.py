"""One worker's training run: mesh, pipeline model, DeepSpeed engine, data, the step loop."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from p3d.config.schema import DType, Recompute
from p3d.data.loader import micro_batches
from p3d.dist.mesh import Mesh
from p3d.metrics import MetricsLogger
from p3d.model.pipe import P3DPipelineModule, VocabParallelLoss, build_layer_specs
from p3d.train.optim import build_optimizer

DS_CONFIG_NAME = "deepspeed_config.json"


def deepspeed_config(cfg, plan) -> dict:
    """The DeepSpeed JSON of this run. Clipping is DeepSpeed's under ZeRO or bf16 (its norm is exact
    there) and ours otherwise (see p3d.train.optim)."""
    ds_clips = cfg.zero.stage > 0 or cfg.train.dtype == DType.bf16
    return {
        "train_batch_size": cfg.schedule.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.schedule.micro_batch_size,
        "gradient_accumulation_steps": plan.micro_batches,
        "gradient_clipping": cfg.train.grad_clip if ds_clips else 0.0,
        "zero_optimization": {"stage": cfg.zero.stage},
        "bf16": {"enabled": cfg.train.dtype == DType.bf16},
        # bf16 with ZeRO-1: accumulate micro-batch gradients in fp32 (DeepSpeed allows this mix only with
        # ZeRO-1; with ZeRO 0 its BF16_Optimizer accumulates in bf16 and warns)
        **({"data_types": {"grad_accum_dtype": "fp32"}} if cfg.train.dtype == DType.bf16 and cfg.zero.stage == 1
           else {}),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_pipeline(cfg, plan, mesh: Mesh) -> P3DPipelineModule:
    specs = build_layer_specs(cfg.model, plan.padded_vocab_size, mesh, cfg.train.seed)
    recompute = cfg.schedule.recompute == Recompute.full
    return P3DPipelineModule(
        specs, plan.stage_bounds, topology=mesh.topology,
        loss_fn=VocabParallelLoss(cfg.model, plan.padded_vocab_size, mesh),
        activation_checkpoint_interval=1 if recompute else 0,
        checkpointable_layers=["TransformerBlock"] if recompute else None,
    )


def train(cfg, plan, run_dir: str | Path, rank: int) -> None:
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    mesh = Mesh.from_plan(plan, rank).with_groups()
    torch.manual_seed(cfg.train.seed)
    module = build_pipeline(cfg, plan, mesh)  # fp32; DeepSpeed casts to bf16 when the config asks
    clip_here = cfg.zero.stage == 0 and cfg.train.dtype == DType.fp32
    optimizer, scheduler = build_optimizer(module, cfg.train, mesh, clip_here=clip_here)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, plan))
    data = None
    if mesh.is_first_stage or mesh.is_last_stage:
        data = micro_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size,
                             cfg.schedule.micro_batch_size, plan.dp, mesh.dp_rank)
    metrics = MetricsLogger(run_dir, cfg, plan) if rank == plan.logging_rank else None
    if metrics:
        print(f"training {cfg.model.name} ({plan.n_params / 1e6:.2f}M params) on {mesh.describe()}, "
              f"{plan.micro_batches} micro batches of {cfg.schedule.micro_batch_size} x {cfg.model.seq_len} "
              f"per replica, {cfg.train.steps} steps", flush=True)
    for step in range(1, cfg.train.steps + 1):
        lr = engine.get_lr()[0]
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=data)
        step_time = time.perf_counter() - t0
        if metrics:
            grad_norm = engine.get_global_grad_norm()
            metrics.log(step, loss=float(loss), lr=float(lr), grad_norm=float(grad_norm), step_time_s=step_time)
    if metrics:
        metrics.close()
