"""The MoE feed-forward under context parallelism (with ep, or with tp and sequence parallelism) against its
unsharded twin: the balancing loss, a capacity and the routing figures are the whole sequence's.

The twin is the same class on one rank (every expert local, no group) from the same seeded master weights; it runs
each dp replica's whole sequences in turn. A cp rank feeds its chunks of its replica's sequences
(p3d.parallel.context.chunks). As in training, each rank's loss counts its tokens cp times (a cp rank's mean loss is
cp times its tokens' share of the sequence's) and the gradients are averaged over the cp ranks. Checked on every
rank: the output and input gradient of its tokens; its experts' weight gradients, the router's (which carries the
balancing loss's gradient: its weight is raised so that a wrong one shows) and the shared expert's, against the
twin's summed over the replicas; and the step's routing figures summed over the world (balancing loss, tokens per
expert, dropped pairs), as p3d.parallel.experts.balance reduces them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.tiers import with_slow
from tests.helpers.tp import SEED, TOL, column_shard

LAYER = 1  # moe_tiny's first MoE block


def _tokens(seed: int, b: int, s: int, h: int) -> torch.Tensor:
    return torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed))


def _check(rank, world, tp, ep, cp, sp, overrides):
    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.context.chunks import take_local
    from p3d.parallel.experts.balance import metrics
    from p3d.parallel.mesh import Mesh
    from tests.helpers.runs import compose_config

    cfg = compose_config("model=moe_tiny", "model.moe.aux_loss_coef=1.0", *overrides).model
    mesh = Mesh(tp=tp, pp=1, dp=ep, ep=ep, cp=cp, rank=rank).with_groups()
    full = MoEFeedForward(cfg, Mesh(tp=1, pp=1, dp=1), LAYER, SEED).train()
    shard = MoEFeedForward(cfg, mesh, LAYER, SEED, sequence_parallel=sp).train()
    for m in (full, shard):  # a selection bias that changes some choices (as an imported one would)
        m.router.expert_bias.copy_(torch.tensor([0.0, 0.01, -0.01, 0.004]))
    b, s, h = 2, 16, cfg.hidden_size
    n_experts, local = cfg.moe.n_experts, cfg.moe.n_experts // ep

    for d in range(ep):  # the twin: every replica's whole sequences in turn, gradients summed over them
        x_full = _tokens(100 + d, b, s, h).requires_grad_()
        y_full = full(x_full)
        (y_full * _tokens(50 + d, b, s, h)).sum().backward()
        if d == mesh.dp_rank:
            mine_y, mine_grad = y_full.detach(), x_full.grad

    x = take_local(_tokens(100 + mesh.dp_rank, b, s, h), cp, mesh.cp_rank)  # (b, s / cp, h)
    g = take_local(_tokens(50 + mesh.dp_rank, b, s, h), cp, mesh.cp_rank)
    mine_y, mine_grad = (take_local(t, cp, mesh.cp_rank) for t in (mine_y, mine_grad))
    if sp:
        x, g, mine_y, mine_grad = (t.chunk(tp, dim=1)[mesh.tp_rank].contiguous() for t in (x, g, mine_y, mine_grad))
    x.requires_grad_()
    y = shard(x)
    torch.testing.assert_close(y, mine_y, **TOL)
    (y * g * cp).sum().backward()
    torch.testing.assert_close(x.grad / cp, mine_grad, **TOL)

    def averaged(grad, group):  # the mean over the cp ranks of the sum over the dp replicas
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad / cp

    f = cfg.moe.expert_ffn_size
    twin_gate_up = full.experts.w_gate_up.weight.grad.view(n_experts, 2 * f, h)
    twin_down = full.experts.w_down.weight.grad.view(n_experts, h, f)
    gate_up = averaged(shard.experts.w_gate_up.weight.grad, mesh.cp_group).view(local, -1, h)
    down = averaged(shard.experts.w_down.weight.grad, mesh.cp_group).view(local, h, -1)
    for i in range(local):
        j = shard.experts.first + i
        torch.testing.assert_close(gate_up[i], column_shard(twin_gate_up[j], [f, f], mesh.tp_rank, tp), **TOL)
        torch.testing.assert_close(down[i], twin_down[j].chunk(tp, dim=1)[mesh.tp_rank], **TOL)
    router = averaged(shard.router.weight.grad, mesh.dp_cp_group)
    torch.testing.assert_close(router, full.router.weight.grad, **TOL)
    shared = averaged(shard.shared.w_down.weight.grad, mesh.dp_cp_group)
    torch.testing.assert_close(shared, full.shared.w_down.weight.grad.chunk(tp, dim=1)[mesh.tp_rank], **TOL)

    figures = shard.take_stats()
    local_share = figures[3:] / figures[3:].sum()
    dist.all_reduce(figures)  # the step's figures over the world (p3d.parallel.experts.balance.step_figures)
    # the rank's tokens go to the experts in other shares than the whole sequence's: a balancing loss of the rank's
    # tokens alone would differ
    assert (local_share - figures[3:] / figures[3:].sum()).abs().max() > 0.01
    got, want = metrics(figures.view(1, -1)), metrics(full.take_stats().view(1, -1))
    assert got["moe_aux_loss"] == pytest.approx(want["moe_aux_loss"], rel=1e-6)
    assert got["moe_load_imbalance"] == pytest.approx(want["moe_load_imbalance"], rel=1e-6)
    assert got["moe_dropped"] == pytest.approx(want["moe_dropped"], abs=1e-12)
    if cfg.moe.capacity_factor:
        assert want["moe_dropped"] > 0.05  # the capacity drops pairs, so where they fall matters


CASES = {
    "ep2-cp2": (1, 2, 2, False, ()),
    "ep2-cp2-capacity": (1, 2, 2, False, ("model.moe.capacity_factor=0.75",)),
    "tp2-cp2-sp-grouped-capacity": (
        2,
        1,
        2,
        True,
        ("model.moe.score=sigmoid", "model.moe.n_groups=2", "model.moe.capacity_factor=0.75"),
    ),
    "ep1-cp4-capacity": (1, 1, 4, False, ("model.moe.capacity_factor=0.75",)),
}


# slow tier: dropless ep2 x cp2 (its capacity variant covers the loss and the figures) and cp4 (the e2e cp4 layouts of
# tests/e2e/test_cp_parity.py hold the chunk order)
SLOW = ("ep2-cp2", "ep1-cp4-capacity")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", with_slow(CASES, SLOW))
def test_moe_feed_forward_under_cp_matches_unsharded(case):
    tp, ep, cp, sp, overrides = CASES[case]
    run_distributed(_check, tp * ep * cp, tp, ep, cp, sp, overrides)
