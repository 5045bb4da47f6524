"""p3d's router against transformers' DeepSeek-V3 router (``DeepseekV3TopkRouter``, the import oracle): sigmoid
scores, group-limited selection by the bias-corrected scores, the weights from the uncorrected scores (renormalised
when norm_topk_prob) times routed_scaling_factor. Random weights and a random correction bias in fp32: the same
experts for every token and the same weights. Also: the bias routes with aux-loss-free balancing off
(``bias_update_rate=0``: an imported ``e_score_correction_bias``), and a bad grouping is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import assert_fixes_accepted, assert_refused_in_one_line, compose_config

HIDDEN = 64  # model=moe_tiny's
TOKENS = 512


def _routers(n_experts: int, top_k: int, groups: int, kept: int, norm: bool, seed: int):
    """(p3d's Router, transformers' DeepseekV3TopkRouter) with the same random weight and correction bias."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from p3d.model.moe import Router

    cfg = compose_config(
        "model=moe_tiny",
        f"model.moe.n_experts={n_experts}",
        f"model.moe.top_k={top_k}",
        f"model.moe.n_groups={groups}",
        f"model.moe.topk_groups={kept}",
        f"model.moe.norm_topk_prob={str(norm).lower()}",
        "model.moe.score=sigmoid",
        "model.moe.route_scale=2.5",
        "model.moe.bias_update_rate=0.0",
    ).model
    ours = Router(cfg, "block1.mlp", seed=seed)
    hf = DeepseekV3TopkRouter(
        DeepseekV3Config(
            hidden_size=HIDDEN,
            n_routed_experts=n_experts,
            num_experts_per_tok=top_k,
            n_group=groups,
            topk_group=kept,
            norm_topk_prob=norm,
            routed_scaling_factor=2.5,
        )
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(n_experts, HIDDEN, generator=g) * 0.3)
        hf.e_score_correction_bias.copy_(torch.randn(n_experts, generator=g) * 0.1)  # moves choices, not weights
        ours.weight.copy_(hf.weight)
        ours.expert_bias.copy_(hf.e_score_correction_bias)
    return ours, hf


def _by_expert(idx: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts in increasing order, with their weights (the slot order carries no meaning)."""
    order = idx.argsort(-1)
    return idx.gather(-1, order), weight.gather(-1, order)


@pytest.mark.parametrize(
    "n_experts, top_k, groups, kept, norm",
    [
        (16, 4, 4, 2, True),  # DeepSeek-V3's shape, scaled down (256 experts, 8 groups, keep 4, top-8)
        (16, 4, 4, 2, False),
        (8, 3, 4, 2, True),  # top-3 among the 4 experts of 2 of 4 groups
        (4, 2, 2, 1, True),  # moe_tiny's grouping in the parity tests
        (8, 2, 1, 1, True),  # no groups: the plain top-k of the corrected scores
    ],
)
def test_router_matches_transformers_deepseek_v3(n_experts, top_k, groups, kept, norm):
    ours, hf = _routers(n_experts, top_k, groups, kept, norm, seed=n_experts + top_k + groups)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        idx, weight, _ = ours(x)
        _, hf_weight, hf_idx = hf(x)
    idx, weight = _by_expert(idx, weight)
    hf_idx, hf_weight = _by_expert(hf_idx, hf_weight)
    assert torch.equal(idx, hf_idx)
    torch.testing.assert_close(weight, hf_weight, rtol=1e-6, atol=1e-7)
    # the grouping and the bias decide: without them other experts win for some tokens
    plain = (torch.sigmoid(x @ ours.weight.T)).topk(top_k, dim=-1).indices.sort(-1).values
    assert not torch.equal(plain, idx)


def test_the_selection_bias_routes_with_balancing_off():
    """bias_update_rate=0 (an imported checkpoint's e_score_correction_bias): a large bias on one expert makes every
    token choose it, and its weight is still its uncorrected score."""
    ours, _ = _routers(8, 2, 1, 1, norm=False, seed=1)
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        ours.expert_bias.zero_()
        ours.expert_bias[5] = 10.0
        idx, weight, _ = ours(x)
        scores = torch.sigmoid(x @ ours.weight.T)
    assert bool((idx == 5).any(-1).all())
    torch.testing.assert_close(weight, 2.5 * scores.gather(1, idx))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model.moe.n_groups=3",), "model.moe.n_groups=3 must divide model.moe.n_experts=4"),
        (("model.moe.n_groups=4",), "model.moe.n_groups=4 leaves 1 expert per group"),
        (("model.moe.n_groups=2", "model.moe.topk_groups=3"), "model.moe.topk_groups=3 exceeds model.moe.n_groups=2"),
        (
            ("model.moe.n_groups=2", "model.moe.topk_groups=1", "model.moe.top_k=3"),
            "model.moe.top_k=3 exceeds the 2 experts of model.moe.topk_groups=1 groups of 2",
        ),
    ],
)
def test_a_bad_grouping_is_refused_in_one_line_with_a_fix_the_command_accepts(overrides, message):
    line = ("model=moe_tiny", "mesh=single", *overrides)
    assert_refused_in_one_line(line, message, "try model.moe.")
    assert_fixes_accepted(line)
