"""What describes one Hugging Face architecture to p3d: an :class:`Architecture` (data, no code paths of its own).

The import (p3d.hf.config_json: config.json -> model fields; p3d.hf.check: every tensor consumed; p3d.hf.load: the
slices) and the export (p3d.hf.export) read these descriptions and nothing else about a family, and the model
blocks read only the model fields (docs/models.md). Adding an architecture is adding a module beside this one with
its description, and naming it in p3d.hf.architectures' registry.

The pieces every Llama-like family shares are here, for the descriptions to combine: the block's tensor names
(attention, its biases and q/k norms, the dense SwiGLU), the config.json fields they all read, the metadata keys that
change nothing. RoPE (``rope_parameters`` / ``rope_scaling`` / ``rope_theta``) and the attention window are read and
written by p3d.hf.config_json for every description, through ``window_keys``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p3d.config.options import AttentionType


@dataclass(frozen=True)
class Field:
    """A config.json key whose value p3d converts: ``read`` (config.json value -> model field value; a ValueError
    says why it cannot be held) and ``write`` (the reverse). A plain key string: the value as it is."""

    key: str
    read: Callable[[Any], Any] | None = None
    write: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Fixed:
    """A model field this architecture always has: the import sets it, the export refuses a model without it."""

    value: Any
    reason: str  # why, as the export's refusal says it: "Qwen2 has q, k and v biases"


@dataclass(frozen=True)
class Architecture:
    """One HF architecture as p3d reads and writes it.

    ``block``: each p3d tensor of a transformer block (its name below ``<layer>.``) -> the HF tensors below
    ``model.layers.<i>.`` it is made of, its fused parts in order (q | k | v; gate | up); () for a p3d tensor HF has
    no counterpart of (the export refuses it unless zero). ``expert``: a stacked routed experts' tensor -> each
    expert's HF tensors, ``{j}`` the expert's index. ``fields``: model field (``moe.top_k`` for the experts') ->
    config.json key. ``fixed``: model fields the architecture implies. ``accepted``: config.json keys p3d does not
    map, with the values that change nothing in p3d's model (any other value is refused: p3d would ignore it).
    ``ignored``: keys that never change the computation (token ids, caching, init). ``window_keys``: the keys of its
    attention window. ``written``: constants the export adds to config.json. ``row_orders``: p3d tensor -> a function of
    the model giving, for each of its rows, the HF row it is read from (DeepSeek's interleaved rotary rows,
    p3d.hf.rope_rows; the export writes them back). ``fp8_blocks``: it may come block-quantized (float8 weights with a
    ``weight_scale_inv`` each, as config.json's ``quantization_config`` says; p3d.hf.fp8), dequantized at import."""

    name: str  # config.json "architectures": ["<name>"]
    model_type: str  # config.json "model_type", and p3d's model.family
    block: Mapping[str, tuple[str, ...]]
    fields: Mapping[str, str | Field]
    fixed: Mapping[str, Fixed] = field(default_factory=dict)
    expert: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    moe: bool = False  # its blocks (from model.moe.first_dense_layers on) hold routed experts: model.moe is set
    defaults: Mapping[str, Any] = field(default_factory=dict)  # config.json key -> transformers' value when absent
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # key -> other names it is read under
    accepted: Mapping[str, tuple] = field(default_factory=dict)
    ignored: frozenset[str] = frozenset()
    window_keys: tuple[str, ...] = ()
    written: Mapping[str, Any] = field(default_factory=dict)
    row_orders: Mapping[str, Callable[[Any], list[int]]] = field(default_factory=dict)
    fp8_blocks: bool = False
    mtp_key: str | None = None  # config.json's count of multi-token prediction layers after the blocks (DeepSeek-V3)

    def hf_block_names(self) -> set[str]:
        """Every HF tensor name below ``model.layers.<i>.`` this architecture has (experts' with ``{j}``)."""
        return {n for names in (*self.block.values(), *self.expert.values()) for n in names}


# every architecture but DeepSeek-V3's: q, k, v projections of model.head_dim per head
GQA = Fixed(AttentionType.gqa, "its attention is grouped-query attention (q, k, v projections), not MLA")

# ---- the tensors of a Llama-like block (p3d name below "<layer>." -> HF names below "model.layers.<i>.")

NORMS = {"attn_norm.weight": ("input_layernorm.weight",), "mlp_norm.weight": ("post_attention_layernorm.weight",)}
ATTENTION = {
    "attn.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.wo.weight": ("self_attn.o_proj.weight",),
}
QKV_BIAS = {"attn.bqkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")}
QK_NORM = {"attn.q_norm.weight": ("self_attn.q_norm.weight",), "attn.k_norm.weight": ("self_attn.k_norm.weight",)}
SWIGLU = {
    "mlp.w_gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.w_down.weight": ("mlp.down_proj.weight",),
}
DENSE_BLOCK = {**NORMS, **ATTENTION, **SWIGLU}

# ---- config.json: the fields every family reads (model field -> key)

COMMON_FIELDS: dict[str, str | Field] = {
    "n_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_hidden_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
COMMON_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None,  # None: num_attention_heads (no grouping)
    "head_dim": None,  # None: hidden_size / num_attention_heads
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
# the keys of the values p3d holds nowhere but that must have these values for p3d's model to be the checkpoint's
COMMON_ACCEPTED: dict[str, tuple] = {
    "hidden_act": ("silu",),  # SwiGLU's activation
    "attention_dropout": (0, 0.0),  # p3d has no dropout
    "partial_rotary_factor": (1, 1.0),  # RoPE over the whole head
}
# keys that do not change the computation: token ids, generation, caching, init, bookkeeping of transformers
METADATA = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "_name_or_path",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "use_bfloat16",
        "torchscript",
        "task_specific_params",
    }
)
