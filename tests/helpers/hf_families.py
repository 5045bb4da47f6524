"""Tiny random checkpoints written by transformers' own classes (offline, ``save_pretrained``), one per family p3d
imports: the oracle of the import, export and layout tests (tests/e2e/test_hf_families.py, test_family_parity.py).

Every weight is drawn at std 0.1 (transformers' 0.02 gives logits too flat to show a misplaced slice), and the
vectors off their init: norm weights 1 + 0.2 N, biases 0.2 N, so that a bias or a q/k norm p3d dropped or cut
wrongly moves the logits. RoPE scalings are set over a 16-token pretraining context, so that 40 positions reach
far into the scaled frequencies. 64 hidden, 4 heads over 2 kv heads, 4 layers, 512 words (the byte tokenizer's
257 fit): every piece divides tp 2 and ep 2; a 256-token context (max_position_embeddings) above model.seq_len.
DeepSeek-V3's selection biases (e_score_correction_bias) are drawn too."""

from __future__ import annotations

from pathlib import Path

VOCAB, CONTEXT = 512, 256
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=CONTEXT,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # fmt: skip
YARN_ROPE = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# DeepSeek-V3 scaled down: MLA (q and kv latents 32 and 16, heads of 8 + 4 rotated, values 8), yarn with mscale (the
# softmax scale's mscale^2 and cos/sin's attention factor both off 1), its first block dense, then 8 experts in 4
# groups (top-2 among the best 2 groups) and a shared one, scaled by 2.5
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                     mscale_all_dim=0.8, beta_fast=32, beta_slow=1)  # fmt: skip
DEEPSEEK = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=DEEPSEEK_YARN,
)  # fmt: skip

# family -> (transformers config class, model class, their config's fields beside SHAPE)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),  # Llama 3.1's scaling
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096)),  # a window >= seq_len: none
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q|k|v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, rope_parameters=YARN_ROPE)),  # 24 != 64 / 4
    # its first block dense (mlp_only_layers [0]: model.moe.first_dense_layers 1), the rest 4 experts, top-2
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=24, mlp_only_layers=[0], **MOE)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
}


def model_class(family: str):
    import transformers

    return getattr(transformers, FAMILIES[family][1])


def write_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """The tiny random ``family`` checkpoint, saved to ``path`` by transformers."""
    import torch
    import transformers

    config_class, _, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(family)(getattr(transformers, config_class)(**{**SHAPE, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection biases: they move choices
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path)
    return path


def logits(path: Path, family: str, ids):
    """transformers' logits of the checkpoint at ``path`` for token ids ``ids`` (b, s), fp32, eval mode."""
    import torch

    with torch.no_grad():
        return model_class(family).from_pretrained(path).eval()(ids).logits
