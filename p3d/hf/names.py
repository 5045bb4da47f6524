"""What p3d and Hugging Face call the same things: tensor names and config.json fields, for Llama (a dense
p3d model) and Mixtral (an MoE p3d model, ``model.moe``).

p3d's Llama uses HF's conventions (RoPE rotating halves, RMSNorm, SwiGLU, no biases), so weights map one to
one; only our fused q|k|v and gate|up matrices are split into their HF parts (``model.layers.<i>.`` omitted
on the right):

    p3d (global name)                               HF
    0.weight | tied_modules.embed.weight            model.embed_tokens.weight
    <i+1>.attn_norm.weight                          input_layernorm.weight
    <i+1>.attn.wqkv.weight  (q | k | v)             self_attn.{q,k,v}_proj.weight
    <i+1>.attn.wo.weight                            self_attn.o_proj.weight
    <i+1>.mlp_norm.weight                           post_attention_layernorm.weight
    <i+1>.mlp.w_gate_up.weight (gate | up)          mlp.{gate,up}_proj.weight                (Llama)
    <i+1>.mlp.w_down.weight                         mlp.down_proj.weight                     (Llama)
    <i+1>.mlp.router.weight                         block_sparse_moe.gate.weight             (Mixtral)
    <i+1>.mlp.experts.w_gate_up.weight              block_sparse_moe.experts.<j>.{w1,w3}.weight  (Mixtral)
        (g_0 | u_0 | g_1 | u_1 ...: every expert)
    <i+1>.mlp.experts.w_down.weight                 block_sparse_moe.experts.<j>.w2.weight   (Mixtral)
        (d_0 ; d_1 ...: every expert's rows)
    <i+1>.mlp.router.expert_bias (a buffer)         none: import leaves it zero, export refuses a non-zero one
    <L+1>.weight                                    model.norm.weight
    <L+2>.weight (untied)                           lm_head.weight

p3d stacks an MoE block's routed experts (one tensor per projection, p3d.model.experts), Mixtral keeps one tensor
per expert: the stacked tensor's HF names are every expert's in expert order (``hf_names`` with ``experts``).
Mixtral's names are those of the Hub's checkpoints (mistralai/Mixtral-8x7B-v0.1), which transformers 5 also
writes (``save_pretrained``) though its module holds each layer's experts as fused 3-D tensors
(``mlp.experts.gate_up_proj``); a directory holding those fused tensors is refused with how to convert it.
No torch here: the launcher checks HF directories without it.
"""

from __future__ import annotations

from collections.abc import Sequence

from p3d.config.schema import MoEConfig, RouterScore

LLAMA, MIXTRAL = "LlamaForCausalLM", "MixtralForCausalLM"
ARCH = LLAMA  # the dense architecture
_TYPES = {"llama": LLAMA, "mixtral": MIXTRAL}  # config.json model_type -> architecture
_BLOCK = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "attn.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.wo.weight": ["self_attn.o_proj.weight"],
    "mlp_norm.weight": ["post_attention_layernorm.weight"],
    "mlp.w_gate_up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.w_down.weight": ["mlp.down_proj.weight"],
    "mlp.router.weight": ["block_sparse_moe.gate.weight"],
    "mlp.router.expert_bias": [],  # aux-loss-free balancing: Mixtral has no such tensor
}
_EXPERT = {"mlp.experts.w_gate_up.weight": ["w1.weight", "w3.weight"], "mlp.experts.w_down.weight": ["w2.weight"]}
FUSED_EXPERTS = ".mlp.experts.gate_up_proj"  # transformers 5's module name, not its files'


class HFImportError(ValueError):
    """A HF checkpoint p3d cannot import; the message names the file or field."""


def hf_names(name: str, n_layers: int, experts: Sequence[int] | None = None) -> list[str]:
    """HF tensor names, in block order, of the p3d parameter (or buffer) ``name``; [] if HF has none. A stacked
    routed experts' weight: those of the ``experts`` (global indices) it holds, expert by expert."""
    if name == "tied_modules.embed.weight" or name == "0.weight":
        return ["model.embed_tokens.weight"]
    head, rest = name.split(".", 1)
    layer = int(head)
    if layer == n_layers + 1:
        return ["model.norm.weight"]
    if layer == n_layers + 2:
        return ["lm_head.weight"]
    prefix = f"model.layers.{layer - 1}."
    if rest in _EXPERT:
        if experts is None:
            raise ValueError(f"{name} stacks experts: hf_names needs which experts it holds")
        return [f"{prefix}block_sparse_moe.experts.{j}.{p}" for j in experts for p in _EXPERT[rest]]
    if rest not in _BLOCK:  # shared experts: export refuses their models first (export_problem)
        raise HFImportError(f"{name} has no Hugging Face {LLAMA} or {MIXTRAL} tensor")
    return [prefix + part for part in _BLOCK[rest]]


def twin_name(name: str) -> str:
    """The name in the single-process twin (p3d.parallel.pipeline.specs.SequentialModel) of global ``name``."""
    return "tied." + name.removeprefix("tied_modules.") if name.startswith("tied_modules.") else f"layers.{name}"


def global_name(twin: str) -> str:
    """The global name of the twin's parameter ``twin`` (the inverse of :func:`twin_name`)."""
    return "tied_modules." + twin.removeprefix("tied.") if twin.startswith("tied.") else twin.removeprefix("layers.")


# ---- config.json -> model group


def model_fields(hf: dict, where: str) -> dict:
    """The p3d model fields of a HF Llama or Mixtral config.json; refuses other architectures and features."""
    model_type = hf.get("model_type")
    arch = (hf.get("architectures") or [None])[0]
    if model_type not in _TYPES or arch not in (None, _TYPES[model_type]):
        raise HFImportError(
            f"model.init_from={where}: config.json describes {arch or model_type} "
            f"(model_type={model_type}); p3d imports {LLAMA} and {MIXTRAL} checkpoints only"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFImportError(f"model.init_from={where}: {flag}=true is not supported (p3d's Llama has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"model.init_from={where}: hidden_act={hf['hidden_act']} is not supported (SwiGLU: silu)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling:
        raise HFImportError(
            f"model.init_from={where}: RoPE scaling {scaling.get('rope_type', scaling)} is not "
            "supported yet (plain RoPE only)"
        )
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise HFImportError(f"model.init_from={where}: head_dim={hf['head_dim']} differs from hidden/heads")
    return {
        "n_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "moe": _mixtral_moe(hf, where) if model_type == "mixtral" else None,
    }


def _mixtral_moe(hf: dict, where: str) -> MoEConfig:
    """Mixtral's router: a softmax over the experts' logits, the top-k renormalised, no shared experts."""
    if hf.get("sliding_window") is not None:
        raise HFImportError(
            f"model.init_from={where}: sliding_window={hf['sliding_window']} is not supported (p3d attends to the "
            "whole sequence); a window at least model.seq_len long changes nothing: set it to null in config.json"
        )
    return MoEConfig(
        n_experts=hf.get("num_local_experts", 8),
        top_k=hf.get("num_experts_per_tok", 2),
        expert_ffn_size=hf["intermediate_size"],
        n_shared_experts=0,
        first_dense_layers=0,
        score=RouterScore.softmax,
        norm_topk_prob=True,
        route_scale=1.0,
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),  # transformers' MixtralConfig default
    )


# ---- model group -> config.json


def export_problem(m) -> str | None:
    """Why the model ``m`` (a ModelConfig) has no Hugging Face architecture p3d writes, or None: a dense model
    is a Llama, an MoE model a Mixtral, which has a softmax router with the top-k renormalised and routed
    experts only."""
    e = m.moe
    if e is None:
        return None
    why = {
        "n_shared_experts": (e.n_shared_experts, 0, "Mixtral has no shared experts"),
        "first_dense_layers": (e.first_dense_layers, 0, "every Mixtral block is an MoE block"),
        "score": (e.score.value, "softmax", "Mixtral's router takes a softmax over the experts' logits"),
        "norm_topk_prob": (e.norm_topk_prob, True, "Mixtral renormalises its top-k weights"),
        "route_scale": (e.route_scale, 1.0, "Mixtral does not scale its experts' output"),
    }
    for field, (value, mixtral, reason) in why.items():
        if value != mixtral:
            shown = str(value).lower() if isinstance(value, bool) else value
            return (
                f"model.moe.{field}={shown}: p3d-export writes an MoE model as {MIXTRAL}, and {reason}; "
                "only models with Mixtral's routing (model=mixtral_8x7b's moe fields) can be exported"
            )
    return None


def hf_config(m, eos_id: int | None = None) -> dict:
    """config.json of the model ``m`` (a ModelConfig; see :func:`export_problem` first)."""
    config = {
        "architectures": [MIXTRAL if m.moe else LLAMA],
        "model_type": "mixtral" if m.moe else "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": (m.moe.expert_ffn_size or m.ffn_hidden_size) if m.moe else m.ffn_hidden_size,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.hidden_size // m.n_heads,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
    }
    if m.moe:
        config |= {
            "num_local_experts": m.moe.n_experts,
            "num_experts_per_tok": m.moe.top_k,
            "router_aux_loss_coef": m.moe.aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
        }
    else:
        config |= {"attention_bias": False, "mlp_bias": False}
    return config | {"torch_dtype": "float32", "eos_token_id": eos_id}
