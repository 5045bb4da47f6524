"""The tensors of a model, by name and whole (unsharded) shape, from its config alone: what the launcher checks a
Hugging Face checkpoint against before any worker starts (p3d.hf.check). No torch.

Names are the p3d parameters' below their pipeline layer (``attn.wqkv.weight``; p3d.hf.names maps them to HF's).
Their sizes add up to the closed forms of p3d.layout.geometry (``total_params``), and the blocks p3d.model builds
hold exactly these (tests/unit/layout/test_tensors.py checks both).
"""

from __future__ import annotations

from typing import NamedTuple

from p3d.config.schema import ModelConfig
from p3d.layout.geometry import expert_ffn_size, head_dim, head_dims, is_mla, is_moe_layer, qk_head_dim, v_head_dim


class Tensor(NamedTuple):
    """A whole p3d tensor: its ``shape``, and the rows of each part fused along dim 0, in order (q | k | v, an
    expert's gate | up, ...; one part: the tensor itself). Each part is one HF tensor of shape (rows, *shape[1:])."""

    shape: tuple[int, ...]
    parts: tuple[int, ...]

    @property
    def part_shapes(self) -> list[tuple[int, ...]]:
        return [(rows, *self.shape[1:]) for rows in self.parts]


def _whole(*shape: int) -> Tensor:
    return Tensor(tuple(shape), (shape[0],))


def block_tensors(m: ModelConfig, layer: int) -> dict[str, Tensor]:
    """The parameters of block ``layer`` (0-based): attention (with the q|k|v biases and the q/k norms the model has)
    and its feed-forward, dense or mixture of experts (every routed expert: E of them stacked)."""
    h = m.hidden_size
    out = {"attn_norm.weight": _whole(h), **attention_tensors(m), "mlp_norm.weight": _whole(h)}
    if not is_moe_layer(m, layer):
        f = m.ffn_hidden_size
        return out | {"mlp.w_gate_up.weight": Tensor((2 * f, h), (f, f)), "mlp.w_down.weight": _whole(h, f)}
    assert m.moe is not None
    e, f, shared = m.moe.n_experts, expert_ffn_size(m), m.moe.n_shared_experts
    out |= {
        "mlp.router.weight": _whole(e, h),
        "mlp.experts.w_gate_up.weight": Tensor((e * 2 * f, h), (f, f) * e),
        "mlp.experts.w_down.weight": Tensor((e * h, f), (h,) * e),
    }
    if shared:
        out |= {
            "mlp.shared.w_gate_up.weight": Tensor((2 * shared * f, h), (shared * f, shared * f)),
            "mlp.shared.w_down.weight": _whole(h, shared * f),
        }
    return out


def attention_tensors(m: ModelConfig) -> dict[str, Tensor]:
    """The attention's parameters: q|k|v (its biases, its q/k norms) and o; or MLA's (p3d.model.mla): the queries'
    down-projection wq_a (r_q, h), its norm and up-projection wq_b (a d_qk, r_q), or wq (a d_qk, h) without q
    compression; wkv_a (r_kv + d_r, h) to the key/value latent and the shared rotated key, its norm over r_kv,
    wkv_b (a (d_n + d_v), r_kv) to the heads' keys and values, each head's d_n key rows then its d_v value rows;
    wo (h, a d_v)."""
    h, a = m.hidden_size, m.n_heads
    if is_mla(m):
        x = m.mla
        assert x.kv_lora_rank is not None and x.qk_nope_head_dim is not None and x.qk_rope_head_dim is not None
        out: dict[str, Tensor] = {}
        if x.q_lora_rank:
            out |= {
                "attn.wq_a.weight": _whole(x.q_lora_rank, h),
                "attn.q_a_norm.weight": _whole(x.q_lora_rank),
                "attn.wq_b.weight": _whole(a * qk_head_dim(m), x.q_lora_rank),
            }
        else:
            out["attn.wq.weight"] = _whole(a * qk_head_dim(m), h)
        return out | {
            "attn.wkv_a.weight": _whole(x.kv_lora_rank + x.qk_rope_head_dim, h),
            "attn.kv_a_norm.weight": _whole(x.kv_lora_rank),
            "attn.wkv_b.weight": _whole(a * (x.qk_nope_head_dim + v_head_dim(m)), x.kv_lora_rank),
            "attn.wo.weight": _whole(h, a * v_head_dim(m)),
        }
    hd = head_dim(m)
    q, kv = head_dims(m)
    out = {"attn.wqkv.weight": Tensor((q + 2 * kv, h), (q, kv, kv))}
    if m.qkv_bias:
        out["attn.bqkv.bias"] = Tensor((q + 2 * kv,), (q, kv, kv))
    if m.qk_norm:
        out |= {"attn.q_norm.weight": _whole(hd), "attn.k_norm.weight": _whole(hd)}
    return out | {"attn.wo.weight": _whole(h, q)}


def block_buffers(m: ModelConfig, layer: int) -> dict[str, Tensor]:
    """The persistent buffers of block ``layer`` a checkpoint holds beside its parameters: an MoE block's selection
    biases (E,) (aux-loss-free balancing), which an architecture may name an HF tensor for (DeepSeek-V3's
    ``e_score_correction_bias``); not parameters, so not in the closed forms."""
    return {"mlp.router.expert_bias": _whole(m.moe.n_experts)} if m.moe is not None and is_moe_layer(m, layer) else {}


def end_tensors(m: ModelConfig) -> dict[str, Tensor]:
    """The embedding, the final norm and (untied) the head, by the role p3d.hf.names gives them HF names for."""
    out = {"embed": _whole(m.vocab_size, m.hidden_size), "final_norm": _whole(m.hidden_size)}
    return out if m.tie_embeddings else out | {"head": _whole(m.vocab_size, m.hidden_size)}


def numel(t: Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n
