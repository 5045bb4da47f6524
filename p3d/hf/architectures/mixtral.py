"""MixtralForCausalLM: Mixtral 8x7B and 8x22B. A Llama attention; every block's feed-forward 8 experts, top-2, a
softmax router renormalised over the top-k. Names as the Hub's checkpoints (mistralai/Mixtral-8x7B-v0.1) and
transformers 5's save_pretrained: block_sparse_moe.experts.<j>.w1 (gate) / w3 (up) / w2 (down)."""

from __future__ import annotations

from p3d.config.options import RouterScore
from p3d.hf.architectures.base import (
    ATTENTION,
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    GQA,
    METADATA,
    NORMS,
    Architecture,
    Fixed,
)
from p3d.hf.architectures.llama import NO_QK_NORM, NO_QKV_BIAS

# the routing p3d's router (p3d.model.moe) has in common with Mixtral's and Qwen-MoE's: a softmax, no shared experts
SOFTMAX_ROUTER = {
    "moe.score": Fixed(RouterScore.softmax, "its router takes a softmax over the experts' logits"),
    "moe.n_shared_experts": Fixed(0, "it has no shared experts"),
    "moe.route_scale": Fixed(1.0, "it does not scale its experts' output"),
    "moe.n_groups": Fixed(1, "its router chooses among all the experts (DeepSeek-V3's grouping would be lost)"),
}
ROUTER_FIELDS = {"moe.top_k": "num_experts_per_tok", "moe.aux_loss_coef": "router_aux_loss_coef"}
MOE_IGNORED = frozenset({"output_router_logits"})  # whether transformers returns the router's logits

MIXTRAL = Architecture(
    name="MixtralForCausalLM",
    model_type="mixtral",
    block={
        **NORMS,
        **ATTENTION,
        "mlp.router.weight": ("block_sparse_moe.gate.weight",),
        "mlp.router.expert_bias": (),  # aux-loss-free balancing: Mixtral has no such tensor
    },
    expert={
        "mlp.experts.w_gate_up.weight": (
            "block_sparse_moe.experts.{j}.w1.weight",
            "block_sparse_moe.experts.{j}.w3.weight",
        ),
        "mlp.experts.w_down.weight": ("block_sparse_moe.experts.{j}.w2.weight",),
    },
    moe=True,
    fields={
        **COMMON_FIELDS,
        "moe.n_experts": "num_local_experts",
        "moe.expert_ffn_size": "intermediate_size",  # every block is an MoE block: its one inner size
        **ROUTER_FIELDS,
    },
    fixed={
        "attention": GQA,
        "qkv_bias": NO_QKV_BIAS,
        "qk_norm": NO_QK_NORM,
        **SOFTMAX_ROUTER,
        "moe.first_dense_layers": Fixed(0, "every Mixtral block is an MoE block"),
        "moe.norm_topk_prob": Fixed(True, "Mixtral renormalises its top-k weights"),
    },
    defaults={
        **COMMON_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 131072,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    },
    aliases={"num_local_experts": ("num_experts",)},
    accepted={**COMMON_ACCEPTED, "router_jitter_noise": (0, 0.0)},  # p3d's router adds no noise
    ignored=METADATA | MOE_IGNORED,
    window_keys=("sliding_window",),
    written={"router_jitter_noise": 0.0, "output_router_logits": False},
)
