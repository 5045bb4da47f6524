"""Qwen3MoeForCausalLM: Qwen3-30B-A3B and Qwen3-235B-A22B. Qwen3's attention (q/k norms, head_dim); every block's
feed-forward 128 experts of moe_intermediate_size, top-8, a softmax router renormalised over the top-k when
norm_topk_prob. The blocks of mlp_only_layers keep a dense SwiGLU of intermediate_size: p3d holds the first k
blocks so (model.moe.first_dense_layers); other lists, and decoder_sparse_step > 1, are refused."""

from __future__ import annotations

from p3d.hf.architectures.base import (
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    DENSE_BLOCK,
    METADATA,
    QK_NORM,
    Architecture,
    Field,
)
from p3d.hf.architectures.mixtral import MOE_IGNORED, ROUTER_FIELDS, SOFTMAX_ROUTER
from p3d.hf.architectures.qwen3 import QWEN3_ATTENTION


def _first_dense(layers: list[int]) -> int:
    """mlp_only_layers -> model.moe.first_dense_layers: only the first k blocks, [0, ..., k-1], can be held."""
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(
            f"mlp_only_layers={layers}: p3d's dense blocks are the first model.moe.first_dense_layers ones "
            "([0, 1, ..., k-1])"
        )
    return len(layers)


QWEN3_MOE = Architecture(
    name="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    block={**DENSE_BLOCK, **QK_NORM, "mlp.router.weight": ("mlp.gate.weight",), "mlp.router.expert_bias": ()},
    expert={
        "mlp.experts.w_gate_up.weight": ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
        "mlp.experts.w_down.weight": ("mlp.experts.{j}.down_proj.weight",),
    },
    moe=True,
    fields={
        **COMMON_FIELDS,
        "moe.n_experts": "num_experts",
        "moe.expert_ffn_size": "moe_intermediate_size",
        "moe.norm_topk_prob": "norm_topk_prob",
        "moe.first_dense_layers": Field("mlp_only_layers", read=_first_dense, write=lambda k: list(range(k))),
        **ROUTER_FIELDS,
    },
    fixed={**QWEN3_ATTENTION, **SOFTMAX_ROUTER},
    defaults={
        **COMMON_DEFAULTS,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
    aliases={"num_experts": ("num_local_experts",)},  # transformers 5 writes num_local_experts
    accepted={**COMMON_ACCEPTED, "attention_bias": (False,), "decoder_sparse_step": (1,)},
    ignored=METADATA | MOE_IGNORED,
    window_keys=("sliding_window", "use_sliding_window", "max_window_layers"),
    written={"decoder_sparse_step": 1},
)
