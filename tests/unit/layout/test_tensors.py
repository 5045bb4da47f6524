"""A model's tensors and parameter counts from its config alone (p3d.layout.tensors, p3d.layout.geometry): the
presets of each family against their published sizes, the tensors against the closed form, and the blocks p3d
builds (head_dim apart from hidden / heads, q|k|v biases, q/k norms, routed experts) against both."""

from __future__ import annotations

import dataclasses

import pytest

from p3d.config.options import AttentionType
from p3d.config.schema import MLAConfig, ModelConfig, MoEConfig
from p3d.layout.geometry import active_params, total_params
from p3d.layout.tensors import block_tensors, end_tensors, numel
from tests.helpers.runs import compose_config

# the parameter counts the model cards give, to their digits (B = 1e9), or exactly (the safetensors' total_size / 2)
PUBLISHED = {
    "llama3_1_8b": (8_030_261_248, None),  # meta-llama/Llama-3.1-8B
    "llama3_1_70b": (70_553_706_496, None),  # meta-llama/Llama-3.1-70B
    "llama3_1_405b": (405_853_388_800, None),  # meta-llama/Llama-3.1-405B
    "llama3_2_1b": (1_235_814_400, None),  # meta-llama/Llama-3.2-1B (tied)
    "llama3_2_3b": (3_212_749_824, None),  # meta-llama/Llama-3.2-3B (tied)
    "mistral_7b": (7_248_023_552, None),  # mistralai/Mistral-7B-v0.3
    "qwen2_5_7b": ("7.61", None),  # Qwen/Qwen2.5-7B: "Number of Parameters: 7.61B"
    "qwen2_5_72b": ("72.7", None),  # Qwen/Qwen2.5-72B: 72.7B
    "qwen3_8b": ("8.2", None),  # Qwen/Qwen3-8B: 8.2B
    "qwen3_32b": ("32.8", None),  # Qwen/Qwen3-32B: 32.8B
    "qwen3_30b_a3b": ("30.5", "3.3"),  # Qwen/Qwen3-30B-A3B: 30.5B in total, 3.3B activated
    "qwen3_235b_a22b": ("235", "22"),  # Qwen/Qwen3-235B-A22B: 235B in total, 22B activated
}


def _matches(count: int, published) -> bool:
    """Exactly, or within one unit of the published figure's last digit (the cards round, 8.19 -> "8.2", or
    truncate, 7.6156 -> "7.61")."""
    if isinstance(published, int):
        return count == published
    digits = len(published.split(".")[1]) if "." in published else 0
    return abs(count / 1e9 - float(published)) < 10**-digits


@pytest.mark.parametrize("preset", PUBLISHED)
def test_each_presets_closed_form_is_its_published_size(preset):
    m = compose_config(f"model={preset}").model
    total, active = PUBLISHED[preset]
    assert _matches(total_params(m), total), f"{total_params(m):,}"
    assert _matches(active_params(m), active or total), f"{active_params(m):,}"


def _summed(m: ModelConfig) -> int:
    blocks = sum(numel(t) for i in range(m.n_layers) for t in block_tensors(m, i).values())
    return blocks + sum(numel(t) for t in end_tensors(m).values())


def test_deepseek_v3_is_671b_with_37b_active():
    """The preset's closed form against DeepSeek-V3's, written out from its config.json (arXiv 2412.19437: "671B
    total parameters with 37B activated for each token", without the 14B of its multi-token prediction module): per
    block MLA's W_qa h r_q, its norm r_q, W_qb r_q a (d_n + d_r), W_kva h (r_kv + d_r), its norm r_kv, W_kvb r_kv
    a (d_n + d_v), W_o a d_v h, and two norms h; 3 dense blocks of 3 h f; 58 MoE blocks of a router E h, E routed and 1
    shared expert of 3 h f_e (active: 8 routed and the shared one); the embedding and the head V h, the final norm."""
    m = compose_config("model=deepseek_v3").model
    h, a, r_q, r_kv, d_n, d_r, d_v = 7168, 128, 1536, 512, 128, 64, 128
    V, f, f_e, E, k, L, dense = 129280, 18432, 2048, 256, 8, 61, 3
    attention = h * r_q + r_q + r_q * a * (d_n + d_r) + h * (r_kv + d_r) + r_kv + r_kv * a * (d_n + d_v) + a * d_v * h
    blocks = L * (attention + 2 * h) + dense * 3 * h * f
    ends = 2 * V * h + h
    assert total_params(m) == blocks + (L - dense) * (E * h + (E + 1) * 3 * h * f_e) + ends == 671_026_404_352
    assert active_params(m) == blocks + (L - dense) * (E * h + (k + 1) * 3 * h * f_e) + ends == 37_552_282_624
    assert round(total_params(m) / 1e9) == 671 and int(active_params(m) / 1e9) == 37  # the report's 671B and 37B


@pytest.mark.parametrize(
    "preset", [*PUBLISHED, "mixtral_8x7b", "moe_tiny", "tiny", "small", "deepseek_v3", "deepseek_v3_tiny"]
)
def test_the_tensors_add_up_to_the_closed_form(preset):
    m = compose_config(f"model={preset}").model
    assert _summed(m) == total_params(m)


WIDE = ModelConfig(hidden_size=48, n_heads=4, n_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=True)
MOE = dataclasses.replace(WIDE, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_size=24, n_shared_experts=1,
                                              first_dense_layers=1))  # fmt: skip


MLA = dataclasses.replace(MOE, head_dim=None, qkv_bias=False, qk_norm=False, n_kv_heads=4,
                          attention=AttentionType.mla, mla=MLAConfig(12, 10, 6, 4, 8))  # fmt: skip
MLA_NO_Q_LATENT = dataclasses.replace(MLA, mla=MLAConfig(None, 10, 6, 4, 8))


@pytest.mark.parametrize(
    "m", [WIDE, MOE, ModelConfig(), MLA, MLA_NO_Q_LATENT], ids=["head_dim-bias-qk_norm", "moe", "tiny", "mla", "mla-q"]
)
def test_the_built_blocks_hold_exactly_these_tensors(m):
    """head_dim 16 of a 48 hidden (not 12), biases, q/k norms, a dense and MoE blocks: names and shapes of the
    single-process twin's parameters are block_tensors' (and the count the closed form)."""
    from p3d.pipeline.specs import to_sequential

    twin = to_sequential(m, m.vocab_size, seed=0)
    built = {n.removeprefix("layers."): tuple(p.shape) for n, p in twin.named_parameters()}
    want = {f"{i + 1}.{name}": t.shape for i in range(m.n_layers) for name, t in block_tensors(m, i).items()}
    assert {
        n: s for n, s in built.items() if n.split(".")[0] not in ("0", str(m.n_layers + 1), str(m.n_layers + 2))
    } == want
    assert sum(p.numel() for p in twin.parameters()) == total_params(m) == _summed(m)
