"""The MoE feed-forward on one process against its definition, written out token by token: each token's output is
the sum of its top-k experts' outputs weighted by their (renormalised) scores, plus the shared experts'; an expert
over its capacity drops its later tokens; the balancing loss is E sum_i f_i P_i."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers.runs import compose_config

LAYER = 1


def _model(*overrides):
    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.mesh import Mesh

    cfg = compose_config("model=moe_tiny", *overrides).model
    return cfg, MoEFeedForward(cfg, Mesh(tp=1, pp=1, dp=1), LAYER, seed=3)


def _swiglu(w_gate_up, w_down, x):
    gate, up = w_gate_up.chunk(2)
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), w_down)


def _by_definition(moe, cfg, x, capacity=None):
    e = cfg.moe
    logits = F.linear(x, moe.router.weight)
    scores = logits.softmax(-1) if e.score.value == "softmax" else logits.sigmoid()
    top = (scores + moe.router.expert_bias).topk(e.top_k, dim=-1)
    out = torch.zeros_like(x)
    taken = [0] * e.n_experts
    for t in range(x.shape[0]):
        w = scores[t, top.indices[t]]
        if e.norm_topk_prob:
            w = w / w.sum()
        for slot in range(e.top_k):
            j = int(top.indices[t, slot])
            taken[j] += 1
            if capacity is not None and taken[j] > capacity:
                continue
            out[t] += e.route_scale * w[slot] * _swiglu(*moe.experts.weights_of(j), x[t])
    return out + _swiglu(moe.shared.w_gate_up.weight, moe.shared.w_down.weight, x)


def test_output_is_the_weighted_sum_of_the_chosen_experts():
    cfg, moe = _model()
    x = torch.randn(2, 16, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).view(-1, cfg.hidden_size), _by_definition(moe, cfg, x.view(-1, 64)))


def test_sigmoid_scores_are_renormalised_and_scaled():
    cfg, moe = _model("model.moe.score=sigmoid", "model.moe.norm_topk_prob=false", "model.moe.route_scale=2.5")
    x = torch.randn(1, 12, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).view(-1, 64), _by_definition(moe, cfg, x.view(-1, 64)))


def test_capacity_drops_an_experts_later_tokens_and_counts_them():
    cfg, moe = _model("model.moe.capacity_factor=0.5")
    x = torch.randn(1, 16, cfg.hidden_size, requires_grad=True)
    capacity = 4  # ceil(0.5 x 16 tokens x 2 slots / 4 experts)
    out = moe(x)
    with torch.no_grad():
        torch.testing.assert_close(out.view(-1, 64), _by_definition(moe, cfg, x.view(-1, 64), capacity))
    out.sum().backward()
    figures = moe.take_stats()
    counts = figures[3:]
    assert float(figures[2]) == float((counts - capacity).clamp(min=0).sum()) > 0  # dropped pairs
    assert float(counts.sum()) == 32


def test_balancing_loss_is_one_when_balanced_and_enters_the_gradient_with_its_weight():
    from p3d.model.moe import _AuxLoss

    cfg, moe = _model("model.moe.aux_loss_coef=0.5")
    moe.loss_scale = 0.25  # 4 micro batches
    with torch.no_grad():
        moe.router.weight.zero_()  # every score 1/E: f_i P_i = 1/E^2 whatever the tie-break
    x = torch.randn(1, 8, cfg.hidden_size, requires_grad=True)
    moe(x).sum().backward()
    assert float(moe.take_stats()[0]) == torch.tensor(1.0, dtype=torch.float64).item()
    aux = torch.zeros((), requires_grad=True)
    out = torch.ones(3, requires_grad=True)
    _AuxLoss.apply(out, aux, 0.125, lambda: None).sum().backward()
    assert float(aux.grad) == 0.125 and torch.equal(out.grad, torch.ones(3))


def test_figures_are_committed_once_per_backward_even_with_recompute():
    from torch.utils.checkpoint import checkpoint

    cfg, moe = _model()
    x = torch.randn(1, 8, cfg.hidden_size, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # the forward runs twice, the backward once
    moe(x).sum().backward()
    figures = moe.take_stats()
    assert float(figures[1]) == 2.0 and float(figures[3:].sum()) == 2 * 8 * cfg.moe.top_k
    with torch.no_grad():
        moe(x)  # evaluation: no figures
    assert moe.take_stats().abs().sum() == 0


def test_model_parameter_count_is_the_closed_form():
    from p3d.layout.geometry import padded_vocab, total_params
    from p3d.parallel.pipeline.specs import to_sequential

    for preset in ("model=moe_tiny",):
        cfg = compose_config(preset).model
        model = to_sequential(cfg, padded_vocab(cfg.vocab_size, 1), 1)
        assert sum(p.numel() for p in model.parameters()) == total_params(cfg)
