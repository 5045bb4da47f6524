"""Ring attention across the cp ranks of a sequence (``context.attention=ring``): each rank's keys and values pass
around the cp group, one rank's block per step, while the previous block computes.

Shapes as in p3d.parallel.context.attention: q (b, nh, sl, hd), k and v (b, nkv, sl, hd), sl = 2 c, rank r holding
chunks r (its head half) and 2 cp - 1 - r (its tail half).

Forward: at step t = 0..cp-1 rank r holds the keys and values of rank j = (r - t) mod cp and sends them on to
rank r + 1 while it attends to them (the first step its own, the last step sends nothing). Which of its query
chunks see which of rank j's key chunks, under the causal mask (``pairs``):
    j = r   head -> head causal, tail -> tail causal, tail -> head full
    j < r   both chunks -> j's head (chunk j < r) full; j's tail (2 cp - 1 - j > 2 cp - 1 - r) is after both
    j > r   the tail chunk -> j's head and tail in full; the head chunk r < j sees neither
so every step after the first does the same work, c x 2 c scores. Each block is one fused-kernel call
(p3d.parallel.context.blocks), merged into the running output by log-sum-exp in fp32. Saved: q, k, v, the output
and the log-sum-exp (the all-gather's inventory); the working set is two blocks of keys and values, not s.

Backward: the keys and values go around again, and with them the dK, dV of each block (fp32): at step t rank r
adds its share of block j's gradient to the partial sum rank r - 1 sends it and passes the sum on; after cp steps
each block's sum arrives back at its owner. A step's send of the previous partial sum and of the next block go out
together and run while the step computes. Every p2p of a step is one ``batch_isend_irecv`` (sends first, then
receives, in the same order on every rank, so each pair of ranks matches its messages in order, gloo and NCCL).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from p3d.parallel.context.blocks import KVBlock, Merged, block_backward, block_forward


def pairs(j: int, cp_rank: int, c: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of the local tensors: which of rank ``cp_rank``'s query rows attend which of
    rank ``j``'s key rows (module doc)."""
    head, tail, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    if j == cp_rank:
        return [(head, head, True), (tail, tail, True), (tail, head, False)]
    if j < cp_rank:
        return [(both, head, False)]
    return [(tail, both, False)]


class _Ring:
    """Rank ``cp_rank``'s neighbours in the cp group and one step's messages."""

    def __init__(self, group, cp: int, cp_rank: int):
        self.group, self.cp, self.cp_rank = group, cp, cp_rank
        self.next = dist.get_global_rank(group, (cp_rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (cp_rank - 1) % cp)

    def exchange(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list:
        """Send ``sends`` to the next rank and receive ``recvs`` from the previous one, asynchronously."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    def source(self, step: int) -> int:
        """The cp rank whose keys and values this rank holds at ``step``."""
        return (self.cp_rank - step) % self.cp


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _attend_step(merged: Merged, q, kv, blocks: list[tuple[slice, slice, bool]], scale: float) -> tuple:
    """Adds the blocks of one step (``pairs``) of the keys and values ``kv`` (2, b, nkv, sl, hd) to the merge;
    returns the kernel's rng. A function, so that its blocks' outputs are freed before the next step."""
    rng: tuple = ()
    for rows, keys, causal in blocks:
        out, lse, rng = block_forward(q[:, :, rows], KVBlock(kv[0][:, :, keys], kv[1][:, :, keys], causal), scale)
        merged.add(out, lse, rows)
    return rng


def _step_grads(dq, grad_out, q, out, lse, kv, blocks: list[tuple[slice, slice, bool]], scale: float, rng):
    """One step's backward: adds the blocks' dq into ``dq`` (fp32) and returns this rank's share of the held
    block's dK, dV, (2, b, nkv, sl, hd) fp32. A function, so that the kernels' outputs are freed on return."""
    mine = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for rows, keys, causal in blocks:
        block = KVBlock(kv[0][:, :, keys], kv[1][:, :, keys], causal)
        dq_b, dk_b, dv_b = block_backward(grad_out[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                          block, scale, rng)  # fmt: skip
        dq[:, :, rows] += dq_b
        mine[0][:, :, keys] += dk_b
        mine[1][:, :, keys] += dv_b
    return mine


class _RingAttention(torch.autograd.Function):
    """forward: (q, k, v) of this rank's tokens -> the attention output (b, nh, sl, hd); backward: module doc."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, cp_rank: int):
        ring = _Ring(group, cp, cp_rank)
        ctx.ring = ring
        with torch.autocast(q.device.type, enabled=False):
            c, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
            kv = torch.stack([k, v])  # (2, b, nkv, sl, hd): one message a step
            merged = Merged(q)
            for step in range(cp):
                incoming = torch.empty_like(kv) if step < cp - 1 else None
                works = ring.exchange([kv], [incoming]) if incoming is not None else []
                rng = _attend_step(merged, q, kv, pairs(ring.source(step), cp_rank, c), scale)
                if step == 0:
                    ctx.rng = rng
                _wait(works)
                del works
                if incoming is not None:
                    kv = incoming
            del kv
            b, nh, sl, hd = q.shape
            out = q.new_empty(b, sl, nh, hd).transpose(1, 2)  # stored (b, sl, nh, hd): attention.empty_output
            out.copy_(merged.out)
            lse = merged.lse
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        cp = ring.cp
        with torch.autocast(q.device.type, enabled=False):
            c, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
            kv = torch.stack([k, v])
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            passed = None  # the partial dK, dV sum of the block held last step, sent on with this step's messages
            for step in range(cp):
                arriving = None if passed is None else torch.empty_like(passed)  # the previous rank's partial sum
                incoming = torch.empty_like(kv) if step < cp - 1 else None  # the next step's keys and values
                sends = [t for t in (passed, None if incoming is None else kv) if t is not None]
                works = ring.exchange(sends, [t for t in (arriving, incoming) if t is not None])
                mine = _step_grads(dq, grad_out, q, out, lse, kv, pairs(ring.source(step), ring.cp_rank, c), scale,
                                   ctx.rng)  # fmt: skip
                _wait(works)
                del works, sends
                passed = mine if arriving is None else mine.add_(arriving)
                del mine, arriving
                if incoming is not None:
                    kv = incoming
            del kv
            own = torch.empty_like(passed)
            _wait(ring.exchange([passed], [own]))  # the last partial sum goes to its owner, and ours arrives
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int, cp_rank: int) -> torch.Tensor:
    """Causal attention of this rank's queries q (b, nh, sl, hd) over the whole sequence, its keys and values
    passed around the cp ``group`` (module doc). Out: (b, nh, sl, hd)."""
    return _RingAttention.apply(q, k, v, group, cp, cp_rank)
