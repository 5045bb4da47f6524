"""The DeepSpeed JSON of a run, derived from the typed config and run plan. No DeepSpeed import: the
launcher writes it beside the run spec without loading the engine."""

from __future__ import annotations

from p3d.config.schema import DType
from p3d.rundir.files import DS_CONFIG as DS_CONFIG_NAME  # noqa: F401 - the launcher writes it under this name


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
        **(
            {"data_types": {"grad_accum_dtype": "fp32"}}
            if cfg.train.dtype == DType.bf16 and cfg.zero.stage == 1
            else {}
        ),
        # With sequence parallelism each tp rank already sends its own (b, s/tp, h) block between stages;
        # DeepSpeed's pipe partitioning (on by default with tp > 1) would split that block again over tp
        # and all-gather it on the receiving stage.
        "pipeline": {
            "pipe_partitioned": not cfg.schedule.sequence_parallel,
            "grad_partitioned": not cfg.schedule.sequence_parallel,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
