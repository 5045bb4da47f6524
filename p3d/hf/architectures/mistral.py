"""MistralForCausalLM: Mistral 7B (v0.1 with its 4096-token window, v0.2/v0.3 without). A Llama block; the window is
held as model.sliding_window, which p3d accepts only where it changes nothing (at least model.seq_len)."""

from __future__ import annotations

from p3d.hf.architectures.base import (
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    DENSE_BLOCK,
    GQA,
    METADATA,
    Architecture,
)
from p3d.hf.architectures.llama import NO_QK_NORM, NO_QKV_BIAS

MISTRAL = Architecture(
    name="MistralForCausalLM",
    model_type="mistral",
    block=DENSE_BLOCK,
    fields=COMMON_FIELDS,
    fixed={"attention": GQA, "qkv_bias": NO_QKV_BIAS, "qk_norm": NO_QK_NORM},
    defaults={**COMMON_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
    accepted=COMMON_ACCEPTED,
    ignored=METADATA,
    window_keys=("sliding_window",),
)
