"""Multi-head latent attention (p3d.model.mla) against transformers' ``DeepseekV3Attention``, its import oracle:
the same random weights (the rotated rows permuted as the import permutes them, p3d.hf.rope_rows), DeepSeek's yarn
with mscale and its softmax scale, with and without q compression (DeepSeek-V3; DeepSeek-V2-Lite's q_lora_rank
null): the outputs and the input's gradient within 1e-5 in fp32. The kernel: v padded to the query width runs on
the cpu flash kernel (no (s, s) scores), which takes one head dim only. The model group's MLA rules."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import assert_fixes_accepted, assert_refused_in_one_line

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, mscale=0.9,
            mscale_all_dim=0.7, beta_fast=32, beta_slow=1)  # fmt: skip
S = 24


def _pair(q_lora_rank, seed=0):
    """(p3d's MLA, transformers' DeepseekV3Attention) with the same random weights; 4 heads of d_qk 8 + 4, d_v 6."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from p3d.config.options import AttentionType, RopeType
    from p3d.config.schema import MLAConfig, ModelConfig, RopeScaling
    from p3d.hf.rope_rows import latent_rows, query_rows
    from p3d.model.mla import MultiHeadLatentAttention
    from p3d.parallel.mesh import Mesh

    hf_cfg = DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_parameters=YARN, max_position_embeddings=64,
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "layernorm" in name else 0.2 * torch.randn_like(p))
    scaling = RopeScaling(
        rope_type=RopeType.yarn, **{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}
    )
    cfg = ModelConfig(
        hidden_size=32, n_heads=4, n_kv_heads=4, seq_len=S, attention=AttentionType.mla, rope_scaling=scaling,
        mla=MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    )  # fmt: skip
    ours = MultiHeadLatentAttention(cfg, Mesh(tp=1, pp=1, dp=1), "block1.attn", seed)
    hf_w = {n: p.detach() for n, p in hf.named_parameters()}
    with torch.no_grad():
        if q_lora_rank:
            ours.wq_a.weight.copy_(hf_w["q_a_proj.weight"])
            ours.q_a_norm.weight.copy_(hf_w["q_a_layernorm.weight"])
            ours.wq_b.weight.copy_(hf_w["q_b_proj.weight"][query_rows(cfg)])
        else:
            ours.wq.weight.copy_(hf_w["q_proj.weight"][query_rows(cfg)])
        ours.wkv_a.weight.copy_(hf_w["kv_a_proj_with_mqa.weight"][latent_rows(cfg)])
        ours.kv_a_norm.weight.copy_(hf_w["kv_a_layernorm.weight"])
        ours.wkv_b.weight.copy_(hf_w["kv_b_proj.weight"])
        ours.wo.weight.copy_(hf_w["o_proj.weight"])
    return ours, hf, DeepseekV3RotaryEmbedding(hf_cfg)


@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["deepseek_v3", "no-q-compression"])
def test_mla_matches_transformers_deepseek_v3_attention(q_lora_rank):
    ours, hf, rotary = _pair(q_lora_rank)
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(3))
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    causal = torch.full((S, S), float("-inf")).triu(1)[None, None]
    position_embeddings = rotary(x, torch.arange(S)[None])
    theirs, _ = hf(x_hf, position_embeddings, causal)
    mine = ours(x_ours)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(theirs)
    (theirs * g).sum().backward()
    (mine * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-5)


def test_the_permuted_rows_matter():
    """Without the import's permutation the rotated columns pair up wrongly: the outputs differ."""
    ours, hf, rotary = _pair(12)
    with torch.no_grad():
        ours.wkv_a.weight.copy_(hf.kv_a_proj_with_mqa.weight)
        ours.wq_b.weight.copy_(hf.q_b_proj.weight)
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(3))
    causal = torch.full((S, S), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        theirs, _ = hf(x, rotary(x, torch.arange(S)[None]), causal)
        assert (ours(x) - theirs).abs().max() > 1e-3


def test_narrow_values_run_on_the_flash_kernel():
    """d_v < d_qk: v padded to d_qk runs on the cpu flash kernel alone (SDPA's math fallback keeps (s, s) scores),
    and equals the math kernel's attention over the unpadded v; unpadded, the flash kernel refuses it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from p3d.model.mla import sdpa_narrow_values

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 3, 16, 12, generator=g),
        torch.randn(2, 3, 16, 12, generator=g),
        torch.randn(2, 3, 16, 8, generator=g),
    )
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = sdpa_narrow_values(q, k, v, 0.2)
        with pytest.raises(RuntimeError):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.shape == (2, 3, 16, 8)


MLA = ("model=tiny", "model.attention=mla", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8", "model.n_kv_heads=8")  # fmt: skip


@pytest.mark.parametrize(
    "overrides,needle,fix",
    [
        (("model=tiny", "model.mla.kv_lora_rank=16"), "model.mla.kv_lora_rank=16 has no effect with "
         "model.attention=gqa", "try model.mla.kv_lora_rank=null"),
        (("model=tiny", "model.attention=mla"), "model.mla.kv_lora_rank is null: model.attention=mla needs it",
         "set model.mla.kv_lora_rank"),
        ((*MLA, "model.n_kv_heads=4"), "model.n_kv_heads=4 must equal model.n_heads=8 under model.attention=mla",
         "try model.n_kv_heads=8"),
        ((*MLA, "model.mla.qk_rope_head_dim=5"), "model.mla.qk_rope_head_dim=5 must be even",
         "try model.mla.qk_rope_head_dim=6"),
        ((*MLA, "model.qk_norm=true"), "model.qk_norm=true has no effect under model.attention=mla",
         "try model.qk_norm=false"),
    ],
    ids=["gqa-with-mla-widths", "mla-without-widths", "kv-heads", "odd-rope", "qk-norm"],
)  # fmt: skip
def test_mla_rules_refuse_in_one_line(overrides, needle, fix):
    assert_refused_in_one_line(overrides, needle, fix)
    if "try" in fix:
        assert_fixes_accepted(overrides)
