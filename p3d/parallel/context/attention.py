"""Causal attention across the cp ranks of a sequence: keys and values all-gathered, queries kept local.

Shapes: b micro batch, nh query heads, nkv key/value heads (GQA: g = nh / nkv queries share one), hd head dim,
s the whole sequence, sl = s / cp this rank's tokens (two chunks of c = s / (2 cp), ``chunks.chunk_ids``).

Forward: k and v (b, nkv, sl, hd) are all-gathered over the cp group into (b, nkv, s, hd) in global order; each of
the rank's two query chunks, global chunk i, attends the keys of chunks 0..i, with the causal mask inside chunk i.
The softmax is computed in fp32 with its log-sum-exp. Only the rank's own tensors are kept for backward: q, k, v,
the output and the log-sum-exp, the inventory flash attention keeps at cp = 1, for sl tokens, so a block's saved
activations fall by cp. The gathered keys and values are a working set of the forward, not kept.

Backward: k and v are gathered again; with P = exp(q k^T / sqrt(hd) - lse) and D = rowsum(dO * O),
dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K / sqrt(hd), dK = dS^T Q / sqrt(hd) (the flash-attention backward,
Dao et al. 2022); dK and dV, (b, nkv, s, hd) partial on every rank, are reduce-scattered back to the ranks that
hold each chunk. Why all-gather and not a ring: docs/context.md.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from p3d.parallel.context.chunks import chunk_ids, to_global_order, to_rank_order


def gather_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, heads, sl, hd) of every cp rank -> (b, heads, s, hd) in global order."""
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return to_global_order(parts, dim=2)


def reduce_scatter_sequence(full: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, heads, s, hd) partial sums on every cp rank -> this rank's (b, heads, sl, hd) of their sum."""
    parts = to_rank_order(full, cp, dim=2)
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _causal_block(c: int, device) -> torch.Tensor:
    """(c, c) True above the diagonal: inside a query's own chunk, the keys after it."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu(1)


def _chunk_scores(q: torch.Tensor, k: torch.Tensor, chunk: int, c: int, scale: float) -> torch.Tensor:
    """Scores of one query chunk (b, nkv, g, c, hd) against the keys of chunks 0..chunk (b, nkv, (chunk+1) c, hd):
    (b, nkv, g, c, (chunk + 1) c) in fp32, the keys after each query at -inf."""
    keys = k[:, :, : (chunk + 1) * c].unsqueeze(2)  # (b, nkv, 1, L, hd)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores[..., chunk * c :].masked_fill_(_causal_block(c, q.device), float("-inf"))
    return scores


def _grouped(x: torch.Tensor, nkv: int) -> torch.Tensor:
    """(b, nh, sl, hd) -> (b, nkv, g, sl, hd): query head h = kv head h // g (SDPA's enable_gqa pairing)."""
    b, nh, sl, hd = x.shape
    return x.reshape(b, nkv, nh // nkv, sl, hd)


class _AllGatherKVAttention(torch.autograd.Function):
    """forward: (q, k, v) of this rank's tokens -> the attention output (b, nh, sl, hd); backward: module doc."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, cp_rank: int):
        ctx.group, ctx.cp, ctx.cp_rank = group, cp, cp_rank
        with torch.autocast(q.device.type, enabled=False):
            k_all, v_all = gather_sequence(k, group, cp).float(), gather_sequence(v, group, cp).float()
            qf = _grouped(q.float(), k.shape[1])
            c, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
            outs, lses = [], []
            for half, chunk in enumerate(chunk_ids(cp, cp_rank)):
                scores = _chunk_scores(qf[..., half * c : (half + 1) * c, :], k_all, chunk, c, scale)
                lse = torch.logsumexp(scores, dim=-1)  # (b, nkv, g, c)
                probs = (scores - lse.unsqueeze(-1)).exp_()
                outs.append(torch.matmul(probs, v_all[:, :, : (chunk + 1) * c].unsqueeze(2)))
                lses.append(lse)
            out = torch.cat(outs, dim=3).reshape(q.shape).to(q.dtype)  # (b, nh, sl, hd)
            # stored (b, sl, nh, hd) as flash attention stores it: the block's (b, sl, nh hd) view for the output
            # projection is then this storage, not a copy that would be kept beside it
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
            lse = torch.cat(lses, dim=3)  # (b, nkv, g, sl)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, cp_rank = ctx.group, ctx.cp, ctx.cp_rank
        with torch.autocast(q.device.type, enabled=False):
            k_all, v_all = gather_sequence(k, group, cp).float(), gather_sequence(v, group, cp).float()
            nkv = k.shape[1]
            qf, do, of = (_grouped(t.float(), nkv) for t in (q, grad_out, out))
            c, scale = q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
            dq = torch.empty_like(qf)
            dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
            for half, chunk in enumerate(chunk_ids(cp, cp_rank)):
                rows, keys = slice(half * c, (half + 1) * c), (chunk + 1) * c
                q_c, do_c = qf[..., rows, :], do[..., rows, :]
                probs = (_chunk_scores(q_c, k_all, chunk, c, scale) - lse[..., rows].unsqueeze(-1)).exp_()
                dv_all[:, :, :keys] += torch.matmul(probs.transpose(-1, -2), do_c).sum(2)
                d_probs = torch.matmul(do_c, v_all[:, :, :keys].unsqueeze(2).transpose(-1, -2))
                delta = (do_c * of[..., rows, :]).sum(-1, keepdim=True)  # (b, nkv, g, c, 1)
                d_scores = probs.mul_(d_probs.sub_(delta))
                dq[..., rows, :] = torch.matmul(d_scores, k_all[:, :, :keys].unsqueeze(2)) * scale
                dk_all[:, :, :keys] += torch.matmul(d_scores.transpose(-1, -2), q_c).sum(2) * scale
            dk = reduce_scatter_sequence(dk_all, group, cp)
            dv = reduce_scatter_sequence(dv_all, group, cp)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int, cp_rank: int):
    """Causal attention of this rank's queries q (b, nh, sl, hd) over the whole sequence's keys and values, of
    which this rank holds k, v (b, nkv, sl, hd); the cp ranks of ``group`` call it together. Out: (b, nh, sl, hd)."""
    return _AllGatherKVAttention.apply(q, k, v, group, cp, cp_rank)
