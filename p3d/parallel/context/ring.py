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


class PlainKV:
    """The keys and values travel as they are: one message k | v (b, nkv, sl, d_qk + d_v) along the last dim, and the
    partial sums of their gradients (fp32) in the same layout. (MLA's keys and values travel as their latent:
    p3d.parallel.context.latent.LatentKV, the same methods.)"""

    parts = 2  # the Function's tensors that make the message (k, v); the codec's weights follow them (none)

    def __init__(self, qk_dim: int):
        self.qk_dim = qk_dim

    def message(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's message: k | v, one tensor a step sends."""
        return torch.cat([k, v], dim=-1)

    def part_grads(self, own: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The gradients of the message's parts from its summed gradient ``own`` (fp32), in their dtypes."""
        return own[..., : self.qk_dim].to(k.dtype), own[..., self.qk_dim :].to(v.dtype)

    def param_grads(self) -> tuple:
        return ()

    def expand(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The message -> (k, v), views."""
        return kv[..., : self.qk_dim], kv[..., self.qk_dim :]

    def grad_buffer(self, kv: torch.Tensor) -> torch.Tensor:
        """Zeros (fp32) to add a block's dK | dV into, by key rows, in ``expand``'s layout."""
        return torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)

    def contract(self, kv: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """This rank's share of the message's gradient from ``grads`` (the buffer): the buffer itself."""
        return grads


def _attend_step(merged: Merged, q, k, v, blocks: list[tuple[slice, slice, bool]], scale: float) -> tuple:
    """Adds the blocks of one step (``pairs``) of the keys and values k (b, nkv, sl, d_qk), v (b, nkv, sl, d_v) to
    the merge; returns the kernel's rng. A function, so that its blocks' outputs are freed before the next step."""
    rng: tuple = ()
    for rows, keys, causal in blocks:
        out, lse, rng = block_forward(q[:, :, rows], KVBlock(k[:, :, keys], v[:, :, keys], causal), scale)
        merged.add(out, lse, rows)
    return rng


def _step_grads(dq, grad_out, q, out, lse, kv, codec, blocks: list[tuple[slice, slice, bool]], scale: float, rng):
    """One step's backward: adds the blocks' dq into ``dq`` (fp32) and returns this rank's share of the held
    message's gradient (``codec.contract``: dK | dV (b, nkv, sl, d_qk + d_v) fp32 for plain keys and values). A
    function, so that the kernels' outputs are freed on return."""
    k, v = codec.expand(kv)
    mine = codec.grad_buffer(kv)
    mine_k, mine_v = mine[..., : k.shape[-1]], mine[..., k.shape[-1] :]
    for rows, keys, causal in blocks:
        block = KVBlock(k[:, :, keys], v[:, :, keys], causal)
        dq_b, dk_b, dv_b = block_backward(grad_out[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                          block, scale, rng)  # fmt: skip
        dq[:, :, rows] += dq_b
        mine_k[:, :, keys] += dk_b
        mine_v[:, :, keys] += dv_b
    return codec.contract(kv, mine)


class _RingAttention(torch.autograd.Function):
    """forward: (q, ``codec``: how this rank's keys and values travel, ``tensors``: the codec's parts of the message
    then its weights) -> the attention output (b, nh, sl, d_v); backward: module doc, the parts' gradients and the
    weights' (``codec.contract`` accumulates them over the steps)."""

    @staticmethod
    def forward(ctx, q, codec, group, cp: int, cp_rank: int, scale: float, *tensors):
        ring = _Ring(group, cp, cp_rank)
        ctx.ring, ctx.codec, ctx.scale = ring, codec, scale
        with torch.autocast(q.device.type, enabled=False):
            c = q.shape[2] // 2
            held = codec.message(*tensors[: codec.parts])  # attended this step; sent on to the next rank meanwhile
            merged: Merged | None = None
            for step in range(cp):
                incoming = torch.empty_like(held) if step < cp - 1 else None
                works = ring.exchange([held], [incoming]) if incoming is not None else []
                k, v = codec.expand(held)
                if merged is None:
                    merged = Merged(q, v.shape[-1])
                rng = _attend_step(merged, q, k, v, pairs(ring.source(step), cp_rank, c), scale)
                del k, v
                if step == 0:
                    ctx.rng = rng
                _wait(works)
                del works
                if incoming is not None:
                    held = incoming
            del held
            assert merged is not None
            b, nh, sl, _ = q.shape
            out = q.new_empty(b, sl, nh, merged.out.shape[-1]).transpose(1, 2)  # attention.empty_output's storage
            out.copy_(merged.out)
            lse = merged.lse
        ctx.save_for_backward(q, out, lse, *tensors[: codec.parts])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, *parts = ctx.saved_tensors
        ring, codec, scale = ctx.ring, ctx.codec, ctx.scale
        cp = ring.cp
        with torch.autocast(q.device.type, enabled=False):
            c = q.shape[2] // 2
            held = codec.message(*parts)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            passed = None  # the partial sum of the message held last step, sent on with this step's messages
            for step in range(cp):
                arriving = None if passed is None else torch.empty_like(passed)  # the previous rank's partial sum
                incoming = torch.empty_like(held) if step < cp - 1 else None  # the next step's message
                sends = [t for t in (passed, None if incoming is None else held) if t is not None]
                works = ring.exchange(sends, [t for t in (arriving, incoming) if t is not None])
                mine = _step_grads(dq, grad_out, q, out, lse, held, codec, pairs(ring.source(step), ring.cp_rank, c),
                                   scale, ctx.rng)  # fmt: skip
                _wait(works)
                del works, sends
                passed = mine if arriving is None else mine.add_(arriving)
                del mine, arriving
                if incoming is not None:
                    held = incoming
            del held
            own = torch.empty_like(passed)
            _wait(ring.exchange([passed], [own]))  # the last partial sum goes to its owner, and ours arrives
            del passed
        nones = (None,) * 5  # codec, group, cp, cp_rank, scale
        return (dq.to(q.dtype), *nones, *codec.part_grads(own, *parts), *codec.param_grads())


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int, cp_rank: int, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's queries q (b, nh, sl, hd) over the whole sequence, its keys k (b, nkv, sl, hd)
    and values v (b, nkv, sl, d_v) passed around the cp ``group`` as one message (module doc). ``scale``: the
    softmax scale (None: 1/sqrt(hd)). Out: (b, nh, sl, d_v)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, PlainKV(k.shape[-1]), group, cp, cp_rank, scale, k, v)


def ring_over_messages(q: torch.Tensor, codec, group, cp: int, cp_rank: int, scale: float, *tensors) -> torch.Tensor:
    """``ring_attention`` with each rank's keys and values as the message ``codec`` makes of ``tensors`` (its parts,
    then its weights: MLA's latent and up-projection, p3d.parallel.context.latent), the weights' gradients summed
    over the ring's steps."""
    return _RingAttention.apply(q, codec, group, cp, cp_rank, scale, *tensors)
