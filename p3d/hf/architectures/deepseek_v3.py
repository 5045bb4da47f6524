"""DeepseekV3ForCausalLM: DeepSeek-V3 and V3-Base (671B, 37B active), and any shape transformers' DeepseekV3Config
describes (q_lora_rank null: no q compression, as DeepSeek-V2-Lite's attention). Multi-head latent attention
(``model.attention=mla``, p3d.model.mla) with DeepSeek's yarn and softmax scale; the first first_k_dense_replace blocks
dense (intermediate_size), the rest n_routed_experts of moe_intermediate_size with n_shared_experts shared, a sigmoid
router choosing top-k within its topk_group best of n_group groups by the scores plus e_score_correction_bias (p3d's
selection bias, ``expert_bias``), the top-k weights renormalised (norm_topk_prob) and scaled by routed_scaling_factor.

The rotated rows of q_b_proj (q_proj) and kv_a_proj_with_mqa are interleaved in DeepSeek's checkpoints (rope_interleave:
true); they are permuted at import and back at export (p3d.hf.rope_rows). The published weights are block FP8
(quantization_config), dequantized at import (p3d.hf.fp8). The multi-token prediction module after the blocks
(num_nextn_predict_layers: model.layers.61.* in V3) is not trained by p3d: refused unless ``model.drop_mtp=true``,
which imports the model without it; the export writes num_nextn_predict_layers 0. Keys that say how DeepSeek's own
code ran (ep_size, seq_aux, auto_map) change nothing in the model."""

from __future__ import annotations

from p3d.config.options import AttentionType, RouterScore
from p3d.hf.architectures.base import (
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    METADATA,
    NORMS,
    SWIGLU,
    Architecture,
    Fixed,
)
from p3d.hf.architectures.mixtral import MOE_IGNORED
from p3d.hf.rope_rows import latent_rows, query_rows

MLA_BLOCK = {
    "attn.wq_a.weight": ("self_attn.q_a_proj.weight",),
    "attn.q_a_norm.weight": ("self_attn.q_a_layernorm.weight",),
    "attn.wq_b.weight": ("self_attn.q_b_proj.weight",),
    "attn.wq.weight": ("self_attn.q_proj.weight",),  # q_lora_rank null
    "attn.wkv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
    "attn.kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight",),
    "attn.wkv_b.weight": ("self_attn.kv_b_proj.weight",),
    "attn.wo.weight": ("self_attn.o_proj.weight",),
}
DEEPSEEK_MOE = {
    "mlp.router.weight": ("mlp.gate.weight",),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias",),
    "mlp.shared.w_gate_up.weight": ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "mlp.shared.w_down.weight": ("mlp.shared_experts.down_proj.weight",),
}
MLA_FIELDS = {
    f"mla.{k}": k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
}

DEEPSEEK_V3 = Architecture(
    name="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    block={**NORMS, **MLA_BLOCK, **SWIGLU, **DEEPSEEK_MOE},
    expert={
        "mlp.experts.w_gate_up.weight": ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
        "mlp.experts.w_down.weight": ("mlp.experts.{j}.down_proj.weight",),
    },
    moe=True,
    fields={
        **{k: v for k, v in COMMON_FIELDS.items() if k != "head_dim"},  # config.json's head_dim is d_r: derived
        **MLA_FIELDS,
        "moe.n_experts": "n_routed_experts",
        "moe.top_k": "num_experts_per_tok",
        "moe.expert_ffn_size": "moe_intermediate_size",
        "moe.n_shared_experts": "n_shared_experts",
        "moe.first_dense_layers": "first_k_dense_replace",
        "moe.n_groups": "n_group",
        "moe.topk_groups": "topk_group",
        "moe.norm_topk_prob": "norm_topk_prob",
        "moe.route_scale": "routed_scaling_factor",
        "moe.aux_loss_coef": "aux_loss_alpha",  # its sequence-wise balance loss's weight; p3d's is per micro batch
    },
    fixed={
        "attention": Fixed(AttentionType.mla, "its attention is multi-head latent attention (model.attention=mla)"),
        "qkv_bias": Fixed(False, "its projections have no biases"),
        "qk_norm": Fixed(False, "it normalises its latents, not its heads"),
        "moe.score": Fixed(RouterScore.sigmoid, "its router scores each expert with a sigmoid"),
    },
    defaults={  # transformers' DeepseekV3Config's, for a key config.json leaves out
        **COMMON_DEFAULTS,
        "max_position_embeddings": 4096,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "aux_loss_alpha": 0.0001,  # the V3 report's balance factor (transformers has no balancing loss)
    },
    accepted={
        **COMMON_ACCEPTED,
        "attention_bias": (False,),
        "rope_interleave": (True,),  # the rotated rows' layout the import permutes
        "pretraining_tp": (1,),
        "moe_layer_freq": (1,),  # DeepSeek's code: every block from first_k_dense_replace on an MoE block
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),  # its grouped top-k over the bias-corrected scores
    },
    # head_dim and qk_head_dim: transformers derives them (d_r, d_n + d_r); ep_size, seq_aux: how DeepSeek's code ran
    ignored=METADATA | MOE_IGNORED | {"head_dim", "qk_head_dim", "auto_map", "ep_size", "seq_aux"},
    written={
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    },
    row_orders={"attn.wq_b.weight": query_rows, "attn.wq.weight": query_rows, "attn.wkv_a.weight": latent_rows},
    fp8_blocks=True,
    mtp_key="num_nextn_predict_layers",
)
