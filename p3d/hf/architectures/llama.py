"""LlamaForCausalLM: Llama 2, Llama 3, Llama 3.1-3.3 (RoPE scaling llama3), and the dense models p3d trains."""

from __future__ import annotations

from p3d.hf.architectures.base import (
    COMMON_ACCEPTED,
    COMMON_DEFAULTS,
    COMMON_FIELDS,
    DENSE_BLOCK,
    GQA,
    METADATA,
    Architecture,
    Fixed,
)

NO_QKV_BIAS = Fixed(False, "its q, k and v have no biases (attention_bias=true would add one to o_proj too)")
NO_QK_NORM = Fixed(False, "it has no q/k norms")

LLAMA = Architecture(
    name="LlamaForCausalLM",
    model_type="llama",
    block=DENSE_BLOCK,
    fields=COMMON_FIELDS,
    fixed={"attention": GQA, "qkv_bias": NO_QKV_BIAS, "qk_norm": NO_QK_NORM},
    defaults={**COMMON_DEFAULTS, "max_position_embeddings": 2048},
    accepted={**COMMON_ACCEPTED, "attention_bias": (False,), "mlp_bias": (False,)},
    ignored=METADATA | {"pretraining_tp"},  # transformers 5 computes the same with any value
    written={"attention_bias": False, "mlp_bias": False},
)
