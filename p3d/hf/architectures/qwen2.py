"""Qwen2ForCausalLM: Qwen2 and Qwen2.5. A Llama block with biases on q, k and v (always: no config.json field)."""

from __future__ import annotations

from p3d.hf.architectures.base import (
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    DENSE_BLOCK,
    GQA,
    METADATA,
    QKV_BIAS,
    Architecture,
    Fixed,
)
from p3d.hf.architectures.llama import NO_QK_NORM

# Qwen's window: on with use_sliding_window, for the layers from max_window_layers on (layer_types, when written)
QWEN_WINDOW = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")

QWEN2 = Architecture(
    name="Qwen2ForCausalLM",
    model_type="qwen2",
    block={**DENSE_BLOCK, **QKV_BIAS},
    fields=COMMON_FIELDS,
    fixed={"attention": GQA, "qkv_bias": Fixed(True, "Qwen2's q, k and v have biases"), "qk_norm": NO_QK_NORM},
    defaults={**COMMON_DEFAULTS, "max_position_embeddings": 32768},
    accepted=COMMON_ACCEPTED,
    ignored=METADATA,
    window_keys=QWEN_WINDOW,
)
