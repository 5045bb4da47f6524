"""Qwen3ForCausalLM: Qwen3 dense. A Llama block with an RMSNorm over every query and key head before RoPE, and a
head_dim of its own (128 whatever hidden_size / num_attention_heads is: transformers' default too)."""

from __future__ import annotations

from p3d.hf.architectures.base import (
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    DENSE_BLOCK,
    GQA,
    METADATA,
    QK_NORM,
    Architecture,
    Fixed,
)
from p3d.hf.architectures.qwen2 import QWEN_WINDOW

QWEN3_ATTENTION = {
    "attention": GQA,
    "qkv_bias": Fixed(False, "its q, k and v have no biases (attention_bias=true would add one to o_proj too)"),
    "qk_norm": Fixed(True, "Qwen3 normalises every query and key head (q_norm, k_norm)"),
}

QWEN3 = Architecture(
    name="Qwen3ForCausalLM",
    model_type="qwen3",
    block={**DENSE_BLOCK, **QK_NORM},
    fields=COMMON_FIELDS,
    fixed=QWEN3_ATTENTION,
    defaults={**COMMON_DEFAULTS, "head_dim": 128, "max_position_embeddings": 32768},
    accepted={**COMMON_ACCEPTED, "attention_bias": (False,)},
    ignored=METADATA,
    window_keys=QWEN_WINDOW,
)
