"""A mixture of experts under context parallelism: the routing statistics of the whole sequence (docs/context.md,
"Experts").

A cp rank routes its s / cp tokens of each sequence (p3d.parallel.context.chunks: per row, chunk r then chunk
2 cp - 1 - r). Routing itself is per token, but two things of an MoE layer are per micro batch, over all its tokens:

- the balancing loss aux = E sum_i f_i P_i (p3d.model.moe), f_i the share of the (token, slot) pairs routed to
  expert i, P_i expert i's mean score. ``sum_over_cp`` sums the per-expert pair counts and score sums over the cp
  group, so every cp rank computes the whole sequence's aux; its backward sums the gradient over the group (the
  rank's local score sums feed every rank's copy of aux);
- a capacity (``model.moe.capacity_factor``): an expert keeps the first ceil(c N k / E) pairs of the N tokens in
  sequence order (row by row, then position). ``earlier_elsewhere`` gives each local pair its place among the
  pairs of its expert in that order, from the pair counts of every (row, chunk) of every cp rank (one all-gather
  of b x 2 x E integers), so each cp rank keeps and drops exactly the pairs the unsplit sequence would.

The other routing figures (tokens per expert, dropped pairs) stay per rank: the step's all-reduce over the world
(p3d.parallel.experts.balance) sums them over the cp ranks as over the dp replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from p3d.parallel.context.chunks import chunk_ids


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _SumOverCP(torch.autograd.Function):
    """forward: all-reduce (sum) over the cp group; backward: all-reduce (sum) the gradient over the cp group.

    Every cp rank uses the sum (the whole sequence's statistics) in a copy of the same loss, and the gradients
    of the dp x cp ranks are averaged (p3d.train.executors): a rank's local input reaches all cp copies, so its
    gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the cp group, differentiably (identity for one rank or no group)."""
    return x if _size(group) == 1 else _SumOverCP.apply(x, group)


@torch.no_grad()
def earlier_elsewhere(idx: torch.Tensor, rows: int, n_experts: int, group) -> torch.Tensor:
    """(N k,) for each local (token, slot) pair of ``idx`` (N, k), in flattened order: the pairs routed to its
    expert that come before it in the whole micro batch (rows x s tokens, sequence order) and are not this rank's.
    A pair's place among its expert's pairs of the whole sequence is its place among the rank's own plus this
    (``slot_order``'s ``earlier``). ``idx``: this cp rank's tokens' experts, N = rows x s / cp, local order (each
    row's two chunks, p3d.parallel.context.chunks). One all-gather of rows x 2 x E counts; no host sync."""
    cp, me = _size(group), dist.get_rank(group)
    n, k = idx.shape
    per_chunk = n // (2 * rows) * k  # pairs of one chunk of one row
    part = torch.arange(n * k, device=idx.device).div(per_chunk, rounding_mode="floor")  # (N k,) row 2 + half
    key = part * n_experts + idx.reshape(-1)  # (row, half, expert) of each pair
    mine = torch.zeros(rows * 2 * n_experts, dtype=torch.int64, device=idx.device)
    mine.scatter_add_(0, key, torch.ones_like(key))  # pairs per (row, half, expert)
    every = mine.new_empty(cp * rows, 2, n_experts)  # (cp rows, 2, E): rank r's at r rows
    dist.all_gather_into_tensor(every, mine.view(rows, 2, n_experts), group=group)
    every = every.view(cp, rows, 2, n_experts)
    # the chunks in sequence order: the heads of ranks 0 .. cp - 1, then the tails of ranks cp - 1 .. 0
    chunks = torch.cat([every[:, :, 0], every[:, :, 1].flip(0)]).transpose(0, 1)  # (rows, 2 cp, E)
    flat = chunks.reshape(rows * 2 * cp, n_experts)
    before = (flat.cumsum(0) - flat).view(rows, 2 * cp, n_experts)  # each expert's pairs in earlier chunks
    head, tail = chunk_ids(cp, me)
    own = mine.view(rows * 2, n_experts)
    own_before = (own.cumsum(0) - own).view(rows, 2, n_experts)  # the same among this rank's own chunks
    shift = torch.stack([before[:, head], before[:, tail]], 1) - own_before  # (rows, 2, E)
    return shift.reshape(-1).index_select(0, key)
