"""What p3d and Hugging Face call the same tensors, for any architecture of p3d.hf.architectures.

p3d's blocks use HF's conventions (RoPE rotating halves, RMSNorm, SwiGLU), so weights map one to one; only our
fused matrices are split into their HF parts, as the architecture's ``block`` map lists them
(``model.layers.<i>.`` omitted on the right; Llama's):

    p3d (global name)                               HF
    0.weight | tied_modules.embed.weight            model.embed_tokens.weight
    <i+1>.attn_norm.weight                          input_layernorm.weight
    <i+1>.attn.wqkv.weight  (q | k | v)             self_attn.{q,k,v}_proj.weight
    <i+1>.attn.bqkv.bias    (q | k | v)             self_attn.{q,k,v}_proj.bias             (Qwen2)
    <i+1>.attn.{q,k}_norm.weight                    self_attn.{q,k}_norm.weight             (Qwen3)
    <i+1>.attn.wo.weight                            self_attn.o_proj.weight
    <i+1>.mlp_norm.weight                           post_attention_layernorm.weight
    <i+1>.mlp.w_gate_up.weight (gate | up)          mlp.{gate,up}_proj.weight
    <i+1>.mlp.w_down.weight                         mlp.down_proj.weight
    <i+1>.mlp.router.weight                         block_sparse_moe.gate.weight (Mixtral), mlp.gate.weight (Qwen3-MoE)
    <i+1>.mlp.experts.w_gate_up.weight              each expert's gate and up, expert by expert: (g_0 | u_0 | g_1 ...)
    <i+1>.mlp.experts.w_down.weight                 each expert's down, expert by expert: (d_0 ; d_1 ...)
    <i+1>.mlp.router.expert_bias (a buffer)         none: import leaves it zero, export refuses a non-zero one;
                                                    mlp.gate.e_score_correction_bias (DeepSeek-V3)
    <i+1>.attn.{wq_a,wq_b,wkv_a,wkv_b}.weight      self_attn.{q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj}.weight
                                                    (DeepSeek-V3's MLA; the rotated rows permuted, ``row_order``)
    <L+1>.weight                                    model.norm.weight
    <L+2>.weight (untied)                           lm_head.weight

p3d stacks an MoE block's routed experts (one tensor per projection, p3d.model.experts); HF checkpoints keep one
tensor per expert: the stacked tensor's HF names are every expert's in expert order (``hf_names`` with ``experts``).
No torch here: the launcher checks HF directories without it.
"""

from __future__ import annotations

from collections.abc import Sequence

from p3d.hf.architectures import Architecture


class HFImportError(ValueError):
    """A HF checkpoint p3d cannot import; the one-line message names the file or field."""


EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def layer_prefix(i: int) -> str:
    """The HF prefix of block ``i`` (0-based)."""
    return f"model.layers.{i}."


def hf_names(name: str, n_layers: int, arch: Architecture, experts: Sequence[int] | None = None) -> list[str]:
    """HF tensor names, in block order, of the p3d parameter (or buffer) ``name`` in architecture ``arch``; [] if HF
    has none. A stacked routed experts' weight: those of the ``experts`` (global indices) it holds, expert by
    expert."""
    if name == "tied_modules.embed.weight" or name == "0.weight":
        return [EMBED]
    head, rest = name.split(".", 1)
    layer = int(head)
    if layer == n_layers + 1:
        return [FINAL_NORM]
    if layer == n_layers + 2:
        return [HEAD]
    prefix = layer_prefix(layer - 1)
    if rest in arch.expert:
        if experts is None:
            raise ValueError(f"{name} stacks experts: hf_names needs which experts it holds")
        return [prefix + part.format(j=j) for j in experts for part in arch.expert[rest]]
    if rest not in arch.block:  # export checks the model against the architecture first (config_json.export_problem)
        raise HFImportError(f"{name} has no Hugging Face {arch.name} tensor")
    return [prefix + part for part in arch.block[rest]]


def row_order(name: str, arch: Architecture, m) -> list[int] | None:
    """The HF row each row of the p3d parameter ``name`` (global) is read from, where ``arch`` reorders them (DeepSeek's
    interleaved rotary rows, p3d.hf.rope_rows); None: the same order."""
    head, _, rest = name.partition(".")
    if not head.isdigit() or rest not in arch.row_orders:
        return None
    return arch.row_orders[rest](m)


def twin_name(name: str) -> str:
    """The name in the single-process twin (p3d.pipeline.specs.SequentialModel) of global ``name``."""
    return "tied." + name.removeprefix("tied_modules.") if name.startswith("tied_modules.") else f"layers.{name}"


def global_name(twin: str) -> str:
    """The global name of the twin's parameter ``twin`` (the inverse of :func:`twin_name`)."""
    return "tied_modules." + twin.removeprefix("tied.") if twin.startswith("tied.") else twin.removeprefix("layers.")
