"""The MoE feed-forward sharded over ep (and tp, with and without sequence parallelism) against its unsharded twin.

The twin is the same class built on one rank (every expert local, no group) from the same seeded master weights.
Each dp rank feeds its own tokens (the ep group's ranks are dp replicas); the twin runs each replica's tokens in
turn. Checked on every rank: the output and input gradient of its tokens, its experts' weight gradients (summed
over the replicas whose tokens reached them, which the all-to-all's backward does), the router's and the shared
expert's gradients summed over dp, and the rows the dispatch all-to-all sent: exactly the (token, slot) pairs
routed to experts of other ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.tp import SEED, TOL, column_shard

LAYER = 1  # moe_tiny's first MoE block (block 0 is dense)


def _tokens(dp_rank: int, b: int, s: int, h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + dp_rank)
    return torch.randn(b, s, h, generator=g)


def _check_moe(rank, world, tp, sp):
    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.mesh import Mesh
    from tests.helpers.runs import compose_config

    cfg = compose_config("model=moe_tiny").model
    ep = world // tp
    mesh = Mesh(tp=tp, pp=1, dp=ep, ep=ep, rank=rank).with_groups()
    full = MoEFeedForward(cfg, Mesh(tp=1, pp=1, dp=1), LAYER, SEED)
    shard = MoEFeedForward(cfg, mesh, LAYER, SEED, sequence_parallel=sp)
    sent: list[int] = []
    shard.sent_rows = sent.append
    b, s, h = 2, 8, cfg.hidden_size
    k, n_experts = cfg.moe.top_k, cfg.moe.n_experts
    local = n_experts // ep

    # the twin: every replica's tokens in turn, gradients summed over them
    remote = None
    for d in range(ep):
        x_full = _tokens(d, b, s, h).requires_grad_()
        y_full = full(x_full)
        (y_full * _tokens(50 + d, b, s, h)).sum().backward()
        if d == mesh.dp_rank:
            mine_x, mine_y, mine_grad = x_full.detach(), y_full.detach(), x_full.grad
            with torch.no_grad():
                idx = full.router(mine_x.reshape(-1, h))[0]
            remote = int((idx // local != mesh.ep_rank).sum())

    x = _tokens(mesh.dp_rank, b, s, h)
    g = _tokens(50 + mesh.dp_rank, b, s, h)
    if sp:
        x, g = (t.chunk(tp, dim=1)[mesh.tp_rank].contiguous() for t in (x, g))
        mine_y, mine_grad = (t.chunk(tp, dim=1)[mesh.tp_rank] for t in (mine_y, mine_grad))
    x.requires_grad_()
    y = shard(x)
    torch.testing.assert_close(y, mine_y, **TOL)
    (y * g).sum().backward()
    torch.testing.assert_close(x.grad, mine_grad, **TOL)
    assert sent == [remote], (sent, remote)  # only the rows for other ranks' experts leave this rank

    f = cfg.moe.expert_ffn_size
    twin_gate_up = full.experts.w_gate_up.weight.grad.view(n_experts, 2 * f, h)
    twin_down = full.experts.w_down.weight.grad.view(n_experts, h, f)
    gate_up = shard.experts.w_gate_up.weight.grad.view(local, -1, h)
    down = shard.experts.w_down.weight.grad.view(local, h, -1)
    assert shard.experts.first == mesh.ep_rank * local  # this rank's experts: the ep rank's share
    for i in range(local):
        j = shard.experts.first + i
        torch.testing.assert_close(gate_up[i], column_shard(twin_gate_up[j], [f, f], mesh.tp_rank, tp), **TOL)
        torch.testing.assert_close(down[i], twin_down[j].chunk(tp, dim=1)[mesh.tp_rank], **TOL)
    for name, twin_grad in (("router.weight", full.router.weight.grad), ("shared.w_down.weight", None)):
        got = dict(shard.named_parameters())[name].grad.clone()
        dist.all_reduce(got, group=mesh.dp_group)  # each replica's share
        if twin_grad is None:
            twin_grad = full.shared.w_down.weight.grad.chunk(tp, dim=1)[mesh.tp_rank]
        torch.testing.assert_close(got, twin_grad, **TOL)
    assert k == 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "tp, ep, sp", [(1, 2, False), (2, 2, True), (2, 2, False)], ids=["ep2", "tp2-ep2-sp", "tp2-ep2"]
)
def test_moe_feed_forward_matches_unsharded(tp, ep, sp):
    run_distributed(_check_moe, tp * ep, tp, sp)


def _count_ep2(rank, world):
    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.mesh import Mesh
    from tests.helpers.kernels import KernelCounter
    from tests.helpers.runs import compose_config

    cfg = compose_config("model=moe_tiny").model
    mesh = Mesh(tp=1, pp=1, dp=world, ep=world, rank=rank).with_groups()
    moe = MoEFeedForward(cfg, mesh, LAYER, SEED).train()
    # the ranks feed different numbers of tokens: a rank receives as many rows as it sends only by chance
    x = _tokens(rank, 2, 8 + 4 * rank, cfg.hidden_size).requires_grad_()
    events = _log_overlap(moe)
    with KernelCounter() as counter:
        (moe(x) * _tokens(50 + rank, *x.shape)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert counter.host_copies == 1, counter.host_copies  # the split sizes, once for forward and backward
    assert counter.syncs == 0, counter.sync_ops
    # forward: the shared experts' halves while the dispatch and the combine travel; backward: each gradient
    # all-to-all issued, the backward of the half that overlapped it in forward, then waited for
    forward = ["issue", "shared.hidden", "wait", "issue", "shared.project", "wait"]
    assert events[:6] == forward, events
    backward = ["issue", "backward of shared.project", "wait", "issue", "backward of shared.hidden", "wait"]
    assert events[6:] == backward, events


def _log_overlap(moe) -> list[str]:
    """Log the rows all-to-alls' issues and waits, the shared experts' halves in forward and their backward (the
    last op of each done) in the order they happen."""
    from p3d.parallel.experts import all_to_all

    events: list[str] = []
    issue = all_to_all._issue

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def logged_issue(*args):
        out, work = issue(*args)
        events.append("issue")
        return out, Logged(work)

    all_to_all._issue = logged_issue
    shared = moe.shared
    hidden, project = shared.hidden, shared.project

    def logged_hidden(x):
        events.append("shared.hidden")
        a = hidden(x)
        a.grad_fn.register_hook(lambda *_: events.append("backward of shared.hidden"))  # its last op's, done
        return a

    def logged_project(a):
        events.append("shared.project")
        out = project(a)
        out.grad_fn.register_hook(lambda *_: events.append("backward of shared.project"))
        return out

    shared.hidden, shared.project = logged_hidden, logged_project
    return events


@pytest.mark.timeout(120)
def test_one_host_copy_and_no_sync_per_moe_layer_at_ep2():
    """forward and backward of one MoE layer at ep = 2 (tests/helpers/kernels.py counts): exactly one copy to the
    host (the split sizes of the all-to-alls), nothing else that waits for the device; and the overlap as an order
    of events (on gloo the ordering is what can be checked): each half of the shared experts, forward and backward,
    between the issue and the wait of the all-to-all it overlaps."""
    run_distributed(_count_ep2, 2)
