"""The model group's own rules (``model.*``): head shapes (GQA's, or MLA's widths), RoPE scaling, the attention
window. Each raises :class:`P3DConfigError` with one line naming the field and a fix; run_plan.check_config runs them
with the rest."""

from __future__ import annotations

import dataclasses

from p3d.config.errors import P3DConfigError
from p3d.config.schema import AttentionType, Config, MLAConfig, RopeScaling, RopeType
from p3d.layout.geometry import head_dim

# the RopeScaling fields each rope_type needs (HF's rope init functions read them; p3d.model.rope likewise)
ROPE_NEEDS = {
    RopeType.llama3: ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    RopeType.linear: ("factor",),
    RopeType.yarn: ("factor", "original_max_position_embeddings"),
}


# MLA's widths it cannot do without (q_lora_rank null: no q compression)
MLA_NEEDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
V3_MLA = " ".join(
    f"model.mla.{k}={v}" for k, v in (("kv_lora_rank", 512), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
                                      ("v_head_dim", 128))
)  # fmt: skip


def check_model(cfg: Config) -> None:
    m = cfg.model
    if m.attention == AttentionType.mla:
        check_mla(cfg)
    else:
        check_gqa(cfg)
    check_rope_scaling(cfg)
    if m.sliding_window is not None and m.sliding_window < m.seq_len:
        raise P3DConfigError(
            f"model.sliding_window={m.sliding_window} is shorter than model.seq_len={m.seq_len}: p3d attends to the "
            f"whole sequence (no windowed attention); try model.seq_len={m.sliding_window}"
        )


def check_mla(cfg: Config) -> None:
    """Multi-head latent attention: its widths given (the rotated part even), and none of GQA's pieces."""
    m, a = cfg.model, cfg.model.mla
    for name in MLA_NEEDS:
        if getattr(a, name) is None:
            raise P3DConfigError(
                f"model.mla.{name} is null: model.attention=mla needs it (DeepSeek-V3's: {V3_MLA}); set "
                f"model.mla.{name}, or try model.attention=gqa"
            )
    if a.qk_rope_head_dim % 2:  # type: ignore[operator]  # checked non-null above
        raise P3DConfigError(
            f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim} must be even for rotary embeddings",
            [f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim + 1}"],  # type: ignore[operator]
        )
    if m.n_kv_heads != m.n_heads:
        raise P3DConfigError(
            f"model.n_kv_heads={m.n_kv_heads} must equal model.n_heads={m.n_heads} under model.attention=mla (every "
            "head expands its own key and value from the latent)",
            [f"model.n_kv_heads={m.n_heads}"],
        )
    for name, why in (("head_dim", "model.mla's widths"), ("qkv_bias", "no q, k, v projections"),
                      ("qk_norm", "norms over its latents, not over heads")):  # fmt: skip
        value = getattr(m, name)
        if value not in (None, False):
            off = "null" if name == "head_dim" else "false"
            raise P3DConfigError(
                f"model.{name}={str(value).lower()} has no effect under model.attention=mla ({why})",
                [f"model.{name}={off}"],
            )


def check_gqa(cfg: Config) -> None:
    """Grouped-query attention: the heads' widths, the kv heads dividing the heads; model.mla unset."""
    m = cfg.model
    set_fields = [f.name for f in dataclasses.fields(m.mla) if getattr(m.mla, f.name) != getattr(MLAConfig(), f.name)]
    if set_fields:
        name = set_fields[0]
        raise P3DConfigError(
            f"model.mla.{name}={getattr(m.mla, name)} has no effect with model.attention=gqa (an MLA width: "
            "model.attention=mla takes it, with the others)",
            [f"model.mla.{name}=null"],
        )
    if m.head_dim is None and m.hidden_size % m.n_heads:
        raise P3DConfigError(
            f"model.n_heads={m.n_heads} must divide model.hidden_size={m.hidden_size} (model.head_dim=null: "
            "hidden_size / n_heads)",
            lambda: [f"model.n_heads={d}" for d in nearest_divisors(m.hidden_size, m.n_heads)],
        )
    if head_dim(m) % 2:
        field = "model.head_dim" if m.head_dim else "model.hidden_size/model.n_heads"
        raise P3DConfigError(
            f"{field}={head_dim(m)} (head dim) must be even for rotary embeddings; "
            + ("try model.head_dim=" + str(head_dim(m) + 1) if m.head_dim else "change model.n_heads")
        )
    if m.n_heads % m.n_kv_heads:
        raise P3DConfigError(
            f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (grouped-query attention)",
            [f"model.n_kv_heads={d}" for d in nearest_divisors(m.n_heads, m.n_kv_heads)],
        )


def check_rope_scaling(cfg: Config) -> None:
    r = cfg.model.rope_scaling
    if r.rope_type is None:  # plain RoPE: a scaling field set alone would be ignored
        unused = [f.name for f in dataclasses.fields(r) if getattr(r, f.name) != getattr(RopeScaling(), f.name)]
        if unused:
            raise P3DConfigError(
                f"model.rope_scaling.{unused[0]}={getattr(r, unused[0])} has no effect with model.rope_scaling."
                "rope_type=null (plain RoPE); try model.rope_scaling.rope_type=linear (or llama3, yarn)"
            )
        return
    kind = r.rope_type.value
    for name in ROPE_NEEDS[r.rope_type]:
        if getattr(r, name) is None:
            raise P3DConfigError(
                f"model.rope_scaling.{name} is null: rope_type={kind} needs it (as HF's config.json gives it); set "
                f"model.rope_scaling.{name} (Llama 3.1's: factor=8, original_max_position_embeddings=8192, "
                "low_freq_factor=1, high_freq_factor=4)"
            )
    if r.rope_type == RopeType.llama3 and r.low_freq_factor >= r.high_freq_factor:  # type: ignore[operator]
        raise P3DConfigError(
            f"model.rope_scaling.low_freq_factor={r.low_freq_factor} must be below high_freq_factor="
            f"{r.high_freq_factor} (llama3 blends the band between them); try model.rope_scaling.low_freq_factor=1 "
            "model.rope_scaling.high_freq_factor=4"
        )


def nearest_divisors(n: int, given: int) -> list[int]:
    """The divisors of ``n``, the nearest below ``given`` first, then the nearest above (a fix for a count that must
    divide n; p3d.layout.fixes keeps those every other rule accepts)."""
    return sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (d > given, abs(d - given)))
