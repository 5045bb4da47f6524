"""The range of every numeric field of the schema (p3d.config.schema): p3d.layout.run_plan.check_fields refuses
a value outside it in one line, before any worker starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    """The values a numeric field accepts: ``low <= v <= high`` (``low < v`` with ``open_low``, ``v < high``
    with ``open_high``); None leaves that side open. Optional fields also accept null."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False


AT_LEAST_1, NON_NEGATIVE, POSITIVE = Bound(1), Bound(0), Bound(0, open_low=True)
FRACTION = Bound(0, 1)  # [0, 1]
BELOW_1 = Bound(0, 1, open_high=True)  # [0, 1)

# Every int and float field of the schema has its bound here (tests/unit/launch/test_check_inputs.py checks that none is
# missing); p3d.layout.run_plan.check_fields refuses a value outside it in one line.
BOUNDS: dict[str, Bound] = {
    "model.n_layers": AT_LEAST_1,
    "model.hidden_size": AT_LEAST_1,
    "model.n_heads": AT_LEAST_1,
    "model.n_kv_heads": AT_LEAST_1,
    "model.ffn_hidden_size": AT_LEAST_1,
    "model.vocab_size": AT_LEAST_1,
    "model.seq_len": Bound(2),
    "model.rope_theta": POSITIVE,
    "model.rope_scaling.factor": POSITIVE,
    "model.rope_scaling.original_max_position_embeddings": AT_LEAST_1,
    "model.rope_scaling.low_freq_factor": POSITIVE,
    "model.rope_scaling.high_freq_factor": POSITIVE,
    "model.rope_scaling.beta_fast": POSITIVE,
    "model.rope_scaling.beta_slow": POSITIVE,
    "model.rope_scaling.attention_factor": POSITIVE,
    "model.rope_scaling.mscale": POSITIVE,
    "model.rope_scaling.mscale_all_dim": POSITIVE,
    "model.head_dim": AT_LEAST_1,
    "model.mla.q_lora_rank": AT_LEAST_1,
    "model.mla.kv_lora_rank": AT_LEAST_1,
    "model.mla.qk_nope_head_dim": AT_LEAST_1,
    "model.mla.qk_rope_head_dim": Bound(2),
    "model.mla.v_head_dim": AT_LEAST_1,
    "model.sliding_window": AT_LEAST_1,
    "model.max_position_embeddings": AT_LEAST_1,
    "model.norm_eps": POSITIVE,
    "model.init_std": POSITIVE,
    "model.moe.n_experts": AT_LEAST_1,
    "model.moe.top_k": AT_LEAST_1,
    "model.moe.expert_ffn_size": AT_LEAST_1,
    "model.moe.n_shared_experts": NON_NEGATIVE,
    "model.moe.first_dense_layers": NON_NEGATIVE,
    "model.moe.n_groups": AT_LEAST_1,
    "model.moe.topk_groups": AT_LEAST_1,
    "model.moe.route_scale": POSITIVE,
    "model.moe.aux_loss_coef": NON_NEGATIVE,
    "model.moe.bias_update_rate": NON_NEGATIVE,
    "model.moe.capacity_factor": POSITIVE,
    "mesh.tp": AT_LEAST_1,
    "mesh.ep": AT_LEAST_1,
    "mesh.cp": AT_LEAST_1,
    "mesh.pp": AT_LEAST_1,  # mesh.dp (an int or auto): p3d.layout.run_plan._world_size
    "schedule.micro_batch_size": AT_LEAST_1,
    "schedule.global_batch_size": AT_LEAST_1,
    "schedule.virtual_stages": AT_LEAST_1,
    "zero.stage": Bound(0, 3),
    "zero.shard_size": AT_LEAST_1,
    "zero.bucket_mb": POSITIVE,
    "cluster.nodes": AT_LEAST_1,
    "cluster.gpus_per_node": AT_LEAST_1,
    "cluster.peak_tflops": POSITIVE,
    "cluster.memory_gb": POSITIVE,
    "cluster.intra_node_gbps": POSITIVE,
    "cluster.inter_node_gbps": POSITIVE,
    "cluster.timeout_s": AT_LEAST_1,
    "cluster.cpus_per_task": AT_LEAST_1,
    "cluster.signal_s": NON_NEGATIVE,
    "cluster.max_requeues": NON_NEGATIVE,
    "cluster.elastic.min_nodes": AT_LEAST_1,
    "data.shuffle_buffer": NON_NEGATIVE,
    "data.val_fraction": BELOW_1,
    "logger.log_every": AT_LEAST_1,
    "train.steps": AT_LEAST_1,
    "train.lr": POSITIVE,
    "train.min_lr_ratio": FRACTION,
    "train.warmup_steps": NON_NEGATIVE,
    "train.weight_decay": NON_NEGATIVE,
    "train.beta1": BELOW_1,
    "train.beta2": BELOW_1,
    "train.eps": POSITIVE,
    "train.grad_clip": NON_NEGATIVE,
    "train.seed": NON_NEGATIVE,
    "train.eval_every": NON_NEGATIVE,
    "train.eval_batches": AT_LEAST_1,
    "train.save_every": NON_NEGATIVE,
    "train.keep_last": NON_NEGATIVE,
    "train.max_skipped": NON_NEGATIVE,
    "train.spike_factor": NON_NEGATIVE,
    "train.spike_window": AT_LEAST_1,
    "train.straggler_factor": NON_NEGATIVE,
    "train.straggler_steps": AT_LEAST_1,
    "train.max_restarts": NON_NEGATIVE,
    "tokenizer.vocab_size": Bound(257),  # 256 bytes + end of text
    "tokenizer.max_documents": AT_LEAST_1,
    "tokenizer.min_frequency": NON_NEGATIVE,
    "prepare.workers": AT_LEAST_1,
    "prepare.shard_bytes": AT_LEAST_1,
    "prepare.slices": AT_LEAST_1,
    "plan.efficiency": Bound(0, 1, open_low=True),
    "plan.hbm_gbps": POSITIVE,
    "plan.gemm_k_overhead": NON_NEGATIVE,
    "plan.top": AT_LEAST_1,
    "plan.block_seconds": NON_NEGATIVE,
}
