"""Token dispatch to experts and the combine back: permutation by expert, and all-to-all over the ep group.

Shapes: N tokens of one micro batch (b s, the whole sequence: with sequence parallelism the MoE block gathers
it first), h hidden, k slots per token (top-k), E experts of the layer, ep ranks in the ep group, E_l = E / ep
experts per rank; rank r of the ep group holds experts [r E_l, (r + 1) E_l).

One MoE layer's routed experts, forward (``dispatch_combine``):
  1. permute: the N k (token, slot) pairs sorted by expert (stable, so each expert sees its tokens in order):
     rows (N k, h), ``counts[e]`` of them for expert e; a capacity (``capacity``) drops each expert's rows
     after its first ``capacity`` ones (in token order);
  2. dispatch (ep > 1): the rows for the experts of ep rank r go to r (``all_to_all_rows``, uneven splits:
     sum of counts over r's experts); what arrives is ordered by source rank, then by expert, and is regrouped
     by local expert;
  3. each local expert runs on its contiguous rows (every expert runs, on zero rows if none came, so every
     expert weight gets a gradient, if zero: the dp reductions then pair up on every rank);
  4. combine: the reverse regrouping and all-to-all bring each row's output back to its token's rank, where
     the rows are weighted by their routing weight and summed per token (index_add).
Backward runs the same steps in reverse (all-to-all's gradient is the all-to-all with the splits swapped).
Only rows for experts on other ranks leave a rank: the block of the splits for this rank is a local copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAllRows(torch.autograd.Function):
    """forward: all-to-all of rows (n, h) over ``group``: rows [sum(send[:r]), sum(send[:r+1])) go to rank r, and
    ``recv[r]`` rows arrive from rank r, in rank order; backward: the all-to-all of the gradient with ``send``
    and ``recv`` swapped (each row's gradient returns to the rank that sent it)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``_AllToAllRows``; the identity for a group of one rank (or None)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, send, recv, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts`` (E,): this rank's rows per expert of the layer -> (ep, E_l): rows each rank of the ep group
    sends to each of this rank's experts (no gradient; one small all-to-all)."""
    ep = dist.get_world_size(group)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)  # even splits: E_l counts per rank
    return recv.view(ep, counts.numel() // ep)


@dataclass
class Routed:
    """One micro batch's routing, on every rank of the tp group alike: for each of the N tokens, the k experts
    ``idx`` (N, k) it goes to and their weights ``weight`` (N, k) (differentiable)."""

    idx: torch.Tensor
    weight: torch.Tensor


def slot_order(idx: torch.Tensor, n_experts: int, capacity: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the (token, slot) pairs (flattened, N k) sorted by expert, stable, less those over an
    expert's ``capacity`` (its first ``capacity`` in token order are kept); rows kept per expert (E,)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    if capacity is None:
        return order, counts
    starts = torch.cumsum(counts, 0) - counts  # where each expert's run begins in the sorted order
    position = torch.arange(order.numel(), device=idx.device) - starts[flat[order]]
    keep = position < capacity
    return order[keep], counts.clamp(max=capacity)


def dispatch_combine(
    x: torch.Tensor,
    routed: Routed,
    n_experts: int,
    run_local: Callable[[torch.Tensor, list[int]], torch.Tensor],
    ep_group=None,
    capacity: int | None = None,
    sent_rows: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The routed experts' output (N, h) for tokens ``x`` (N, h): see the module doc. ``run_local(rows, counts)``
    runs this rank's E_l experts on rows grouped by local expert (``counts[j]`` rows for expert j, in order) and
    returns their outputs (same shape as rows, partial over tp). ``sent_rows``: told how many rows this rank sends
    to other ranks of the ep group (a test's count)."""
    k = routed.idx.shape[1]
    order, counts = slot_order(routed.idx, n_experts, capacity)
    token = order // k  # the token of each kept (token, slot) pair, in expert order
    rows = x.index_select(0, token)  # (kept, h), grouped by expert
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    if ep == 1:
        out = run_local(rows, counts.tolist())
    else:
        me = dist.get_rank(ep_group)
        local = n_experts // ep
        send = counts.view(ep, local).sum(1).tolist()  # rows for each rank's experts
        from_each = exchange_counts(counts, ep_group)  # (ep, E_l): rows from each rank for each local expert
        recv = from_each.sum(1).tolist()
        if sent_rows is not None:
            sent_rows(sum(send) - send[me])
        arrived = all_to_all_rows(rows, send, recv, ep_group)  # ordered by source rank, then local expert
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), from_each.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)  # by local expert, then source rank
        done = run_local(arrived.index_select(0, regroup), from_each.sum(0).tolist())
        back = torch.empty_like(done).index_copy(0, regroup, done)  # undo the regrouping (differentiable)
        out = all_to_all_rows(back, recv, send, ep_group)  # each row back to the rank of its token
    weighted = out * routed.weight.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x, dtype=out.dtype).index_add(0, token, weighted)  # (N, h)
