"""Attention of a run of queries over blocks of keys, each block one fused-kernel call, merged by log-sum-exp.

Shapes: b micro batch, nh query heads, nkv key/value heads (GQA: g = nh / nkv queries share one, query head i
reads kv head i // g, SDPA's ``enable_gqa`` pairing), hd head dim, r query rows, L a block's keys. The values may
be narrower than the queries and keys (MLA: d_v < d_qk): the output is d_v wide, and a flash kernel, which takes one
head dim, gets v with zero columns added and its output cut back (p3d.compat.sdpa_kernels ``value_padding``).

A block is (k, v, causal): keys (b, nkv, L, hd) that every query row sees (``causal=False``), or the rows' own
chunk (L = r) with the causal mask inside (``causal=True``). The kernels (p3d.compat.sdpa_kernels) take as many kv
heads as query heads, so GQA is handled here without copying the keys g times:
- a full block folds the g query heads of a kv head into its rows: q (b, nkv, g r, hd) against (b, nkv, L, hd) is
  the same attention, row by row;
- a causal block (the diagonal, L = r keys) expands its keys to nh heads (a copy of r rows, the size of the query
  chunk) and sums their gradients back over g.

Merging: with each block's output o_j and log-sum-exp l_j (fp32), the attention over all the blocks is
lse = log sum_j exp(l_j) and out = sum_j exp(l_j - lse) o_j, computed in fp32 (``Merged``). Backward calls each
block's kernel backward with the merged out and lse (p3d.compat.sdpa_kernels, module doc): dq sums over the blocks,
each block's dk and dv belong to its keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from p3d.compat.sdpa_kernels import attention_backward, attention_forward, value_padding


class KVBlock(NamedTuple):
    k: torch.Tensor  # (b, nkv, L, hd)
    v: torch.Tensor
    causal: bool  # the rows' own chunk, L = r, causal mask inside


def _fold(x: torch.Tensor, nkv: int) -> torch.Tensor:
    """(b, nh, r, ...) -> (b, nkv, g r, ...): the g query heads of a kv head as one run of rows."""
    b, nh, r = x.shape[:3]
    return x.reshape(b, nkv, (nh // nkv) * r, *x.shape[3:])


def _unfold(x: torch.Tensor, nh: int) -> torch.Tensor:
    """The inverse of ``_fold``: (b, nkv, g r, ...) -> (b, nh, r, ...)."""
    b, nkv, gr = x.shape[:3]
    return x.reshape(b, nh, gr // (nh // nkv), *x.shape[3:])


def _expand(x: torch.Tensor, nh: int) -> torch.Tensor:
    """(b, nkv, L, hd) -> (b, nh, L, hd): kv head j repeated for its g query heads (a copy, L rows)."""
    b, nkv, length, hd = x.shape
    if nkv == nh:
        return x
    return x.unsqueeze(2).expand(b, nkv, nh // nkv, length, hd).reshape(b, nh, length, hd)


def _reduce(dx: torch.Tensor, nkv: int) -> torch.Tensor:
    """The gradient of ``_expand``: (b, nh, L, hd) -> (b, nkv, L, hd), summed over each kv head's g query heads."""
    b, nh, length, hd = dx.shape
    if nkv == nh:
        return dx
    return dx.reshape(b, nkv, nh // nkv, length, hd).sum(2)


def _padding(q: torch.Tensor, v: torch.Tensor) -> int:
    return value_padding(q.device.type, q.dtype, q.shape[-1], v.shape[-1])


def _pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(x, (0, pad)) if pad else x


def block_forward(q: torch.Tensor, block: KVBlock, scale: float):
    """q (b, nh, r, hd) over one block of values d_v wide -> (out (b, nh, r, d_v) in q's dtype, lse (b, nh, r)
    fp32, rng)."""
    nh, nkv, dv = q.shape[1], block.k.shape[1], block.v.shape[-1]
    pad = _padding(q, block.v)
    v = _pad(block.v, pad)
    if block.causal:
        out, lse, rng = attention_forward(q, _expand(block.k, nh), _expand(v, nh), True, scale)
        return out[..., :dv], lse, rng
    out, lse, rng = attention_forward(_fold(q, nkv), block.k, v, False, scale)
    return _unfold(out[..., :dv], nh), _unfold(lse, nh), rng


def block_backward(grad_out, q, out, lse, block: KVBlock, scale: float, rng):
    """One block's (dq (b, nh, r, hd), dk (b, nkv, L, hd), dv (b, nkv, L, d_v)) of the attention whose merged
    output and log-sum-exp are ``out``, ``lse``."""
    nh, nkv, dv = q.shape[1], block.k.shape[1], block.v.shape[-1]
    pad = _padding(q, block.v)
    v, grad_out, out = _pad(block.v, pad), _pad(grad_out, pad), _pad(out, pad)
    if block.causal:
        dq, dk, dv_ = attention_backward(grad_out, q, _expand(block.k, nh), _expand(v, nh), out, lse, True, scale, rng)
        return dq, _reduce(dk, nkv), _reduce(dv_[..., :dv], nkv)
    do_f, q_f, out_f, lse_f = (_fold(t, nkv) for t in (grad_out, q, out, lse))
    dq, dk, dv_ = attention_backward(do_f, q_f, block.k, v, out_f, lse_f, False, scale, rng)
    return _unfold(dq, nh), dk, dv_[..., :dv]


class Merged:
    """The running merge of blocks' (out, lse) over r query rows, in fp32: ``out`` (b, nh, r, d_v), ``lse``
    (b, nh, r), starting from no keys (0 and -inf). Adding a block's (o, l) for some of the rows rescales what is
    there: lse' = log(exp(lse) + exp(l)), out' = exp(lse - lse') out + exp(l - lse') o (the online softmax).
    ``like``: the queries (b, nh, r, hd); ``v_dim``: the values' width d_v (None: hd)."""

    def __init__(self, like: torch.Tensor, v_dim: int | None = None):
        shape = (*like.shape[:3], v_dim or like.shape[-1])
        self.out = torch.zeros(shape, dtype=torch.float32, device=like.device)
        self.lse = torch.full(like.shape[:3], float("-inf"), dtype=torch.float32, device=like.device)

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice = slice(None)) -> None:
        old = self.lse[:, :, rows]
        new = torch.logaddexp(old, lse)
        kept = self.out[:, :, rows] * (old - new).exp_().unsqueeze(-1)
        self.out[:, :, rows] = kept.add_(out.float() * (lse - new).exp_().unsqueeze(-1))
        self.lse[:, :, rows] = new


def attend(q: torch.Tensor, blocks: list[KVBlock], scale: float):
    """q (b, nh, r, hd) over every block, merged -> (out (b, nh, r, d_v) fp32, lse (b, nh, r) fp32, rng)."""
    merged, rng = Merged(q, blocks[0].v.shape[-1]), ()
    for block in blocks:
        out, lse, rng = block_forward(q, block, scale)
        merged.add(out, lse)
    return merged.out, merged.lse, rng
