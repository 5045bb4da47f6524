"""A model's tensors and parameter counts from its config alone (p3d.layout.tensors, p3d.layout.geometry): the
presets of each family against their published sizes, the tensors against the closed form, and the blocks p3d
builds (head_dim apart from hidden / heads, q|k|v biases, q/k norms, routed experts) against both."""

from __future__ import annotations

import dataclasses

import pytest

from p3d.config.schema import ModelConfig, MoEConfig
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


@pytest.mark.parametrize("preset", [*PUBLISHED, "mixtral_8x7b", "moe_tiny", "tiny", "small"])
def test_the_tensors_add_up_to_the_closed_form(preset):
    m = compose_config(f"model={preset}").model
    assert _summed(m) == total_params(m)


WIDE = ModelConfig(hidden_size=48, n_heads=4, n_kv_heads=2, head_dim=16, qkv_bias=True, qk_norm=True)
MOE = dataclasses.replace(WIDE, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_size=24, n_shared_experts=1,
                                              first_dense_layers=1))  # fmt: skip


@pytest.mark.parametrize("m", [WIDE, MOE, ModelConfig()], ids=["head_dim-bias-qk_norm", "moe", "tiny"])
def test_the_built_blocks_hold_exactly_these_tensors(m):
    """head_dim 16 of a 48 hidden (not 12), biases, q/k norms, a dense and MoE blocks: names and shapes of the
    single-process twin's parameters are block_tensors' (and the count the closed form)."""
    from p3d.parallel.pipeline.specs import to_sequential

    twin = to_sequential(m, m.vocab_size, seed=0)
    built = {n.removeprefix("layers."): tuple(p.shape) for n, p in twin.named_parameters()}
    want = {f"{i + 1}.{name}": t.shape for i in range(m.n_layers) for name, t in block_tensors(m, i).items()}
    assert {
        n: s for n, s in built.items() if n.split(".")[0] not in ("0", str(m.n_layers + 1), str(m.n_layers + 2))
    } == want
    assert sum(p.numel() for p in twin.parameters()) == total_params(m) == _summed(m)
