"""Causal attention across the cp ranks of a sequence, on torch's fused kernels: keys and values all-gathered
(``allgather``, this module) or passed around the cp group (``ring``, p3d.parallel.context.ring).

Shapes: b micro batch, nh query heads, nkv key/value heads (GQA), hd head dim, s the whole sequence, sl = s / cp
this rank's tokens (two chunks of c = s / (2 cp), ``chunks.chunk_ids``: head chunk r, tail chunk 2 cp - 1 - r).

All-gather forward: k and v (b, nkv, sl, hd) are all-gathered over the cp group into (b, nkv, s, hd) in global
order. Each of the rank's two query chunks, global chunk i, attends two blocks of keys (p3d.parallel.context.blocks):
its own chunk, causal, and the keys of chunks 0..i-1, in full (none for chunk 0). Each block is one call of the
fused kernel SDPA runs (flash on cpu and on cuda in bf16, memory-efficient on cuda in fp32), in the run's dtype;
their outputs are merged by log-sum-exp in fp32. No score matrix is materialised: the kernels tile it. Saved for
backward: the rank's own q, k, v, the merged output and its log-sum-exp (b, nh, sl) fp32, what flash attention
saves at cp = 1 for sl tokens. The gathered keys and values are the forward's working set, not kept.

All-gather backward: k and v are gathered again; each block's kernel backward runs with the merged output and
log-sum-exp (the flash identity, p3d.compat.sdpa_kernels); dq sums over a chunk's blocks, and dK, dV, (b, nkv, s, hd)
fp32 partial sums on every rank, accumulated in rank order, are reduce-scattered back to the ranks that hold each
chunk. Which of the two variants wins where: docs/context.md.

The softmax scale is an argument (None: 1/sqrt(hd); MLA's is DeepSeek's), and the values may be narrower than the
keys (MLA: v (b, nkv, sl, d_v) beside k (b, nkv, sl, d_qk)); the output then has the values' width. MLA's own
variant, whose keys and values travel as their latent, is p3d.parallel.context.latent.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from p3d.parallel.context.blocks import KVBlock, attend, block_backward
from p3d.parallel.context.chunks import chunk_holder, chunk_ids, to_global_order
from p3d.parallel.context.ring import ring_attention

VARIANTS = ("allgather", "ring")


def gather_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, heads, sl, hd) of every cp rank -> (b, heads, s, hd) in global order."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return to_global_order(parts, dim=2)


def add_by_rank(dest: torch.Tensor, grad: torch.Tensor, first_chunk: int, c: int) -> None:
    """Adds ``grad`` (b, heads, n c, hd), the gradient of global chunks first_chunk.. first_chunk + n - 1, into
    ``dest`` (cp, b, heads, 2 c, hd): each rank's tokens at its index, in its local order (head, tail)."""
    cp = dest.shape[0]
    for i in range(grad.shape[2] // c):
        rank, half = chunk_holder(first_chunk + i, cp)
        dest[rank][:, :, half * c : (half + 1) * c] += grad[:, :, i * c : (i + 1) * c]


def reduce_scatter_ranks(by_rank: torch.Tensor, group) -> torch.Tensor:
    """(cp, b, heads, sl, hd) partial sums on every cp rank, rank r's tokens at index r -> this rank's (b, heads,
    sl, hd) of their sum."""
    out = torch.empty_like(by_rank[0])
    dist.reduce_scatter_single(out, by_rank.flatten(0, 1), group=group)  # (cp b, ...): rank r's at rows r b..
    return out


def chunk_blocks(k_all: torch.Tensor, v_all: torch.Tensor, chunk: int, c: int) -> list[KVBlock]:
    """The key blocks global query chunk ``chunk`` attends, out of the whole sequence's (b, nkv, s, hd): its own
    chunk (causal), then chunks 0..chunk-1 (full; none for chunk 0)."""
    own = slice(chunk * c, (chunk + 1) * c)
    blocks = [KVBlock(k_all[:, :, own], v_all[:, :, own], True)]
    if chunk:
        blocks.append(KVBlock(k_all[:, :, : chunk * c], v_all[:, :, : chunk * c], False))
    return blocks


def empty_output(q: torch.Tensor, v_dim: int | None = None) -> torch.Tensor:
    """(b, nh, sl, d_v) stored as (b, sl, nh, d_v), as flash attention stores its output: the block's
    (b, sl, nh d_v) view for the output projection is then this storage, not a copy kept beside it. ``v_dim``:
    the values' width (None: q's hd)."""
    b, nh, sl, hd = q.shape
    return q.new_empty(b, sl, nh, v_dim or hd).transpose(1, 2)


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """``scale``, or 1/sqrt(hd) of q's heads when None (SDPA's default)."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


class _AllGatherKVAttention(torch.autograd.Function):
    """forward: (q, k, v) of this rank's tokens -> the attention output (b, nh, sl, hd); backward: module doc."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, cp_rank: int, scale: float):
        ctx.group, ctx.cp, ctx.cp_rank, ctx.scale = group, cp, cp_rank, scale
        with torch.autocast(q.device.type, enabled=False):
            k_all, v_all = gather_sequence(k, group, cp), gather_sequence(v, group, cp)  # (b, nkv, s, hd)
            out, lse, ctx.rng = gathered_forward(q, k_all, v_all, cp, cp_rank, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk_by_rank, dv_by_rank = _gathered_backward(grad_out, q, k, v, out, lse, ctx)
            dk = reduce_scatter_ranks(dk_by_rank, ctx.group).to(k.dtype)
            del dk_by_rank  # one partial sum of the whole sequence at a time
            dv = reduce_scatter_ranks(dv_by_rank, ctx.group).to(v.dtype)
        return dq, dk, dv, None, None, None, None


def _gathered_backward(grad_out, q, k, v, out, lse, ctx):
    """dq (b, nh, sl, hd), and dK, dV of the whole sequence from this rank's queries, (cp, b, nkv, sl, hd) fp32 in
    rank order (what the reduce-scatter takes, no copy). The gathered keys and values are freed on return."""
    cp = ctx.cp
    k_all, v_all = gather_sequence(k, ctx.group, cp), gather_sequence(v, ctx.group, cp)
    return blocks_backward(grad_out, q, k_all, v_all, out, lse, cp, ctx.cp_rank, ctx.rng, ctx.scale)


def gathered_forward(q, k_all, v_all, cp: int, cp_rank: int, scale: float):
    """This rank's queries q (b, nh, sl, hd) over the whole sequence's k_all (b, nkv, s, hd), v_all (b, nkv, s, d_v)
    -> (out (b, nh, sl, d_v) in q's dtype, lse (b, nh, sl) fp32, the kernels' rng state)."""
    c = q.shape[2] // 2
    out = empty_output(q, v_all.shape[-1])
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)  # (b, nh, sl)
    rng = ()
    for half, chunk in enumerate(chunk_ids(cp, cp_rank)):
        rows = slice(half * c, (half + 1) * c)
        out[:, :, rows], lse[:, :, rows], rng = attend(q[:, :, rows], chunk_blocks(k_all, v_all, chunk, c), scale)
    return out, lse, rng


def blocks_backward(grad_out, q, k_all, v_all, out, lse, cp: int, cp_rank: int, rng, scale: float):
    """The backward of ``gathered_forward``: dq (b, nh, sl, hd), dK (cp, b, nkv, sl, hd), dV (cp, b, nkv, sl, d_v)
    fp32 in rank order."""
    c = q.shape[2] // 2
    dq = torch.empty_like(q)
    b, nkv, s, hd = k_all.shape
    dk_by_rank = torch.zeros((cp, b, nkv, s // cp, hd), dtype=torch.float32, device=k_all.device)
    dv_by_rank = torch.zeros((cp, b, nkv, s // cp, v_all.shape[-1]), dtype=torch.float32, device=v_all.device)
    for half, chunk in enumerate(chunk_ids(cp, cp_rank)):
        rows = slice(half * c, (half + 1) * c)
        blocks = chunk_blocks(k_all, v_all, chunk, c)
        dq[:, :, rows] = _chunk_grads(grad_out[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                      blocks, (chunk, 0), dk_by_rank, dv_by_rank, scale, rng)  # fmt: skip
    return dq, dk_by_rank, dv_by_rank


def _chunk_grads(do_c, q_c, out_c, lse_c, blocks, first_chunks, dk_by_rank, dv_by_rank, scale: float, rng):
    """One query chunk's backward over its blocks: adds each block's dK, dV into the rank-ordered sums and returns
    the chunk's dq (fp32). A function, so that each kernel's outputs are freed before the next chunk."""
    c = q_c.shape[2]
    dq_c = None
    for block, first_chunk in zip(blocks, first_chunks):
        dq_b, dk_b, dv_b = block_backward(do_c, q_c, out_c, lse_c, block, scale, rng)
        dq_c = dq_b.float() if dq_c is None else dq_c.add_(dq_b)
        add_by_rank(dk_by_rank, dk_b, first_chunk, c)
        add_by_rank(dv_by_rank, dv_b, first_chunk, c)
        del dq_b, dk_b, dv_b
    return dq_c


class _OneRankAttention(torch.autograd.Function):
    """``one_rank_attention``: the all-gather variant's forward and backward with the sequence already whole."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, cp: int, cp_rank: int, scale: float):
        ctx.cp, ctx.cp_rank, ctx.scale = cp, cp_rank, scale
        with torch.autocast(q.device.type, enabled=False):
            out, lse, ctx.rng = gathered_forward(q, k_all, v_all, cp, cp_rank, scale)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk_by_rank, dv_by_rank = blocks_backward(grad_out, q, k_all, v_all, out, lse, ctx.cp, ctx.cp_rank,
                                                         ctx.rng, ctx.scale)  # fmt: skip
            dk = to_global_order(list(dk_by_rank), dim=2).to(k_all.dtype)
            dv = to_global_order(list(dv_by_rank), dim=2).to(v_all.dtype)
        return dq, dk, dv, None, None, None


def one_rank_attention(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, cp: int, cp_rank: int, scale: float | None = None
):
    """What cp rank ``cp_rank`` of ``cp`` computes, in one process and without a process group (checks on one
    device, e.g. bench/gpu_layers.py): its queries q (b, nh, s / cp, hd) in local order (chunks.take_local) over the
    whole sequence's k_all, v_all (b, nkv, s, hd), through the same blocks, fused kernels and log-sum-exp merge as
    the all-gather variant, in the dtype they come in. Out: (b, nh, s / cp, hd). Backward: q's gradient, and k_all's
    and v_all's from this rank's queries only (the sum over the cp ranks is the whole attention's, what the
    reduce-scatter forms). ``scale``: the softmax scale (None: 1/sqrt(hd))."""
    return _OneRankAttention.apply(q, k_all, v_all, cp, cp_rank, softmax_scale(q, scale))


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    cp: int,
    cp_rank: int,
    variant: str = "allgather",
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries q (b, nh, sl, hd) over the whole sequence's keys and values, of
    which this rank holds k (b, nkv, sl, hd) and v (b, nkv, sl, d_v); the cp ranks of ``group`` call it together.
    ``variant``: how the keys travel, "allgather" or "ring" (docs/context.md). ``scale``: the softmax scale (None:
    1/sqrt(hd)). Under autocast the kernels run in its dtype (the run's bf16), as SDPA would. Out:
    (b, nh, sl, d_v)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = softmax_scale(q, scale)
    if variant == "ring":
        return ring_attention(q, k, v, group, cp, cp_rank, scale)
    if variant != "allgather":
        raise ValueError(f"context-parallel attention {variant!r}: one of {', '.join(VARIANTS)}")
    return _AllGatherKVAttention.apply(q, k, v, group, cp, cp_rank, scale)
