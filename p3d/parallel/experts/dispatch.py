"""Token dispatch to experts and the combine back: the permutation by expert, the all-to-alls over the ep group,
and the shared experts computed while they travel. No host sync at ep = 1; one copy of the split sizes to the host
per layer and micro batch at ep > 1 (docs/moe.md, "Dispatch and combine").

Shapes: N tokens of one micro batch (b s, the whole sequence: with sequence parallelism the MoE block gathers it
first), h hidden, k slots per token (top-k), E experts of the layer, ep ranks in the ep group, E_l = E / ep experts
per rank; rank r of the ep group holds experts [r E_l, (r + 1) E_l).

One MoE layer's routed experts, forward (``dispatch_combine``):
  1. permute (``slot_order``): the N k (token, slot) pairs sorted by expert (stable: each expert sees its tokens in
     order), counted per expert by a scatter-add on the device; a capacity keeps each expert's first ``capacity``
     pairs and sorts the rest after every expert (a static N k rows: no size that the host would have to read);
  2. ep = 1: the rows (N k, h) through the local experts (p3d.parallel.experts.grouped), grouped by the kept counts;
     ep > 1: the kept counts exchanged (a small all-to-all on the device) and copied to the host, the copy issued at
     once and read after the rows are gathered; the kept rows sent to their experts' ranks by an all-to-all issued
     asynchronously, the shared experts' first half (gate|up and SwiGLU) computed while it travels; what arrives
     (by source rank, then expert) regrouped by local expert, computed, put back in arrival order and sent home by
     the second all-to-all, during which the shared experts' second half (down) runs;
  3. combine: each pair's output back in (token, slot) order, weighted by its routing weight, summed per token.
Backward runs the same steps in reverse; each all-to-all's gradient is issued before, and waited for after, the
backward of the shared experts' half that overlapped it in forward (p3d.parallel.experts.all_to_all).
Only rows for experts on other ranks leave a rank: the block of the splits for this rank is a local copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from p3d.parallel.experts.all_to_all import HostCopy, exchange_counts, finish_all_to_all, start_all_to_all
from p3d.parallel.experts.grouped import Groups


@dataclass
class Routed:
    """One micro batch's routing, on every rank of the tp group alike: for each of the N tokens, the k experts
    ``idx`` (N, k) it goes to and their weights ``weight`` (N, k) (differentiable)."""

    idx: torch.Tensor
    weight: torch.Tensor


@dataclass
class SlotOrder:
    """The permutation of one micro batch's N k (token, slot) pairs: ``order`` (N k,) the pairs (flattened index
    token k + slot) sorted by expert, each expert's kept ones in token order, the pairs a capacity dropped last;
    ``counts`` (E,) pairs routed to each expert; ``kept`` (E,) those it computes (``counts`` when dropless)."""

    order: torch.Tensor
    counts: torch.Tensor
    kept: torch.Tensor


def slot_order(
    idx: torch.Tensor, n_experts: int, capacity: int | None, earlier: torch.Tensor | None = None
) -> SlotOrder:
    """Sort the (token, slot) pairs of ``idx`` (N, k) by expert, counting them on the device (module doc, 1).
    ``earlier`` (N k,): for each pair, the pairs of its expert before it that other ranks hold (context
    parallelism: p3d.parallel.context.routing), so that the capacity keeps each expert's first pairs of the whole
    sequence; None: ``idx`` is the whole micro batch."""
    flat = idx.reshape(-1)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    if capacity is None:
        return SlotOrder(order, counts, counts)
    expert = flat.index_select(0, order)
    starts = torch.cumsum(counts, 0) - counts  # where each expert's run begins in the sorted order
    position = torch.arange(order.numel(), device=idx.device) - starts.index_select(0, expert)
    if earlier is not None:
        position = position + earlier.index_select(0, order)
    fits = position < capacity
    key = torch.where(fits, expert, n_experts)  # a dropped pair: after every expert
    if earlier is None:
        kept = counts.clamp(max=capacity)
    else:  # the pairs of an expert that fit need not be its first local ones: counted
        kept = torch.zeros_like(counts).scatter_add_(0, expert, fits.long())
    return SlotOrder(order.index_select(0, torch.argsort(key, stable=True)), counts, kept)


class SharedExperts(Protocol):
    """What ``dispatch_combine`` needs of the shared experts: their two halves, computed while the all-to-alls
    travel."""

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, h) -> silu(gate) * up (N, S f_e / t)."""
        ...

    def project(self, a: torch.Tensor) -> torch.Tensor:
        """(N, S f_e / t) -> (N, h), partial over tp."""
        ...


def dispatch_combine(
    x: torch.Tensor,
    routed: Routed,
    slots: SlotOrder,
    run_local: Callable[[torch.Tensor, Groups], torch.Tensor],
    ep_group=None,
    capacity: int | None = None,
    shared: SharedExperts | None = None,
    sent_rows: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The routed experts' output plus the shared experts' (N, h) for tokens ``x`` (N, h) (module doc).
    ``run_local(rows, groups)`` runs this rank's E_l experts on rows grouped by local expert and returns their
    outputs (same shape, partial over tp). ``sent_rows``: told how many rows this rank sends to other ranks of the
    ep group (a test's count)."""
    n, k = routed.idx.shape
    rows = x.index_select(0, slots.order // k)  # (N k, h), grouped by expert
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    if ep == 1:
        bound = n if capacity is None else min(n, capacity)  # a token picks an expert at most once
        out = run_local(rows, Groups(slots.kept, bound, tail=capacity is not None))
        extra = None if shared is None else shared.project(shared.hidden(x))
    else:
        out, extra = _across_ranks(x, rows, slots.kept, run_local, ep_group, shared, sent_rows)
    y = _combine(out, slots.order, routed.weight)
    return y if extra is None else y + extra


def _across_ranks(x, rows, kept, run_local, group, shared, sent_rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 2 at ep > 1: (each pair's output (N k, h) in ``rows``' order, the dropped pairs' zero; the shared
    experts' output or None)."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    n_experts = kept.numel()
    local = n_experts // ep
    from_each = exchange_counts(kept, group)  # (ep, E_l): rows from each rank for each of this rank's experts
    host = HostCopy(torch.cat([kept, from_each.reshape(-1)]))  # the layer's one copy to the host, issued now
    per_expert, sizes = from_each.sum(0), from_each.reshape(-1)  # device work while the copy lands
    counts = host.values()
    mine, theirs = counts[:n_experts], counts[n_experts:]
    send = [sum(mine[r * local : (r + 1) * local]) for r in range(ep)]  # kept rows for each rank's experts
    recv = [sum(theirs[r * local : (r + 1) * local]) for r in range(ep)]  # rows from each rank
    bound = max(sum(theirs[r * local + j] for r in range(ep)) for j in range(local))
    if sent_rows is not None:
        sent_rows(sum(send) - send[me])
    buffer, flight = start_all_to_all(rows[: sum(send)], send, recv, group)  # the dropped pairs stay home
    hidden = None if shared is None else shared.hidden(x)  # while the rows travel
    regroup = _by_local_expert(sizes, sum(recv), local)
    arrived = finish_all_to_all(buffer, flight, send, recv, group)  # by source rank, then local expert
    done = run_local(arrived.index_select(0, regroup), Groups(per_expert, bound))
    back = torch.index_copy(torch.empty_like(done), 0, regroup, done)  # arrival order again
    buffer, flight = start_all_to_all(back, recv, send, group)
    extra = None if hidden is None else shared.project(hidden)  # while the outputs travel home
    out = finish_all_to_all(buffer, flight, recv, send, group)
    missing = rows.shape[0] - out.shape[0]  # the dropped pairs: zero outputs
    return (torch.cat([out, out.new_zeros(missing, out.shape[1])]) if missing else out), extra


def _by_local_expert(sizes: torch.Tensor, n_rows: int, local: int) -> torch.Tensor:
    """(R,) the arrived rows' order by local expert, then source rank: ``sizes`` (ep E_l,) the rows of each (source
    rank, local expert) block in arrival order, ``n_rows`` (host) their sum."""
    ends = torch.cumsum(sizes, 0)
    block = torch.searchsorted(ends, torch.arange(n_rows, device=sizes.device), right=True)  # source E_l + expert
    return torch.argsort(block % local, stable=True)


def _combine(out: torch.Tensor, order: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Step 3: ``out`` (N k, h) in ``order`` -> (N, h), each token's k outputs weighted by ``weight`` (N, k)."""
    n, k = weight.shape
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    per_slot = out.index_select(0, inverse).view(n, k, -1)  # (N, k, h) in (token, slot) order
    return (per_slot * weight.unsqueeze(-1).to(out.dtype)).sum(1)
