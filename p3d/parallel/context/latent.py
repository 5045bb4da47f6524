"""Context-parallel attention whose keys and values travel as multi-head latent attention's latent (p3d.model.mla):
one (r_kv + d_r)-wide row per token, shared by every head, instead of the heads' keys and values.

Shapes: b micro batch, H this tp rank's heads, sl = s / cp this rank's tokens, r = r_kv the key/value latent, d_n,
d_r, d_v the heads' unrotated, rotated and value widths (d_qk = d_n + d_r). A rank's message is its latent
(b, 1, sl, r + d_r): the normed latent c and the rotated shared key k_r, RoPE applied at the tokens' global
positions before it travels. ``expand_latent`` makes the heads' keys and values of any tokens from it:

    [k_n | v] = c W_kvb^T   (H (d_n + d_v) rows: each head's d_n key rows then its d_v value rows)
    k = [k_n | k_r]         (the same k_r for every head)      v (b, H, L, d_v)

What travels is (r + d_r) / (H (d_qk + d_v)) of the heads' keys and values: 576 / 40,960 for DeepSeek-V3 at tp 1,
576 / 5,120 at tp 8. What it costs: every rank expands every token it attends to, the whole sequence under the
all-gather (s tokens, not sl: W_kvb's matmul cp times over a rank's), and in backward maps the heads' dK, dV back to
the latent by hand (``LatentKV.contract_kv``: dc = d[k_n | v] W_kvb, dW_kvb = d[k_n | v]^T c, dk_r = the sum of dK's
rotated columns over the heads), so the latent's gradient, not dK and dV, is what returns: reduce-scattered
(all-gather) or passed round (ring) in fp32 (docs/context.md, "MLA").

- all-gather (``_AllGatherLatentAttention``): the latents gathered (cp, b, 1, sl, r + d_r), expanded, put in global
  order; the blocks and merge of p3d.parallel.context.attention; backward gathers and expands again, and the latent's
  fp32 gradient in rank order is reduce-scattered. Saved: q, the local latent, the output and its log-sum-exp.
- ring: p3d.parallel.context.ring's Function with ``LatentKV`` as its codec (each step expands the latent it holds).

W_kvb's gradient is this rank's queries' share (summed over the cp ranks with dp's gradient reduction, as every
weight's); the latent's gradient is partial over tp (each rank's heads), summed where the latent entered the tp
region (p3d.model.mla).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from p3d.parallel.context.attention import blocks_backward, gathered_forward, reduce_scatter_ranks
from p3d.parallel.context.chunks import to_global_order
from p3d.parallel.context.ring import ring_over_messages


def expand_latent(latent: torch.Tensor, weight: torch.Tensor, nope_dim: int, v_dim: int):
    """latent (n, 1, L, r + d_r), weight (H (d_n + d_v), r) -> k (n, H, L, d_n + d_r), v (n, H, L, d_v)."""
    n, _, length, width = latent.shape
    r = weight.shape[1]
    c, k_rot = latent[:, 0].split([r, width - r], dim=-1)  # (n, L, r), (n, L, d_r)
    kv = F.linear(c, weight).view(n, length, -1, nope_dim + v_dim).transpose(1, 2)  # (n, H, L, d_n + d_v)
    k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
    k = torch.cat([k_nope, k_rot.unsqueeze(1).expand(n, kv.shape[1], length, width - r)], dim=-1)
    return k, v


class LatentKV:
    """MLA's keys and values as a cp message: the latent (``parts``: one tensor), the up-projection ``weight``
    (H (d_n + d_v), r) this rank's heads'. ``contract`` returns the latent's gradient (fp32) and adds W_kvb's into
    ``dw`` (fp32), over however many blocks it is given (a ring's steps)."""

    parts = 1

    def __init__(self, weight: torch.Tensor, nope_dim: int, v_dim: int):
        self.weight, self.nope_dim, self.v_dim = weight, nope_dim, v_dim
        self.dw: torch.Tensor | None = None

    def message(self, latent: torch.Tensor) -> torch.Tensor:
        return latent

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return expand_latent(latent, self.weight, self.nope_dim, self.v_dim)

    def grad_buffer(self, latent: torch.Tensor) -> torch.Tensor:
        """Zeros (n, H, L, d_qk + d_v) fp32: dK | dV of the heads the latent expands to."""
        n, _, length, width = latent.shape
        heads = self.weight.shape[0] // (self.nope_dim + self.v_dim)
        qk = self.nope_dim + width - self.weight.shape[1]
        return torch.zeros((n, heads, length, qk + self.v_dim), dtype=torch.float32, device=latent.device)

    def contract(self, latent: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        qk = grads.shape[-1] - self.v_dim
        return self.contract_kv(latent, grads[..., :qk], grads[..., qk:])

    def contract_kv(self, latent: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """The latent's gradient (n, 1, L, r + d_r) fp32 from dK (n, H, L, d_qk), dV (n, H, L, d_v), and W_kvb's
        added into ``dw``: the backward of ``expand_latent``, in the latent's dtype as autograd's would run."""
        n, heads, length, _ = dk.shape
        r, dtype = self.weight.shape[1], latent.dtype
        c = latent[:, 0, :, :r]  # (n, L, r)
        d_kv = torch.cat([dk[..., : self.nope_dim], dv], dim=-1).transpose(1, 2)  # (n, L, H, d_n + d_v)
        d_kv = d_kv.reshape(n, length, -1).to(dtype)  # (n, L, H (d_n + d_v)): W_kvb's output rows
        dc = d_kv.matmul(self.weight.to(dtype))  # (n, L, r)
        dw = d_kv.reshape(-1, d_kv.shape[-1]).t().matmul(c.reshape(-1, r)).float()  # (H (d_n + d_v), r)
        self.dw = dw if self.dw is None else self.dw.add_(dw)
        d_rot = dk[..., self.nope_dim :].sum(1)  # (n, L, d_r): every head's share of the shared rotated key
        return torch.cat([dc.float(), d_rot.float()], dim=-1).unsqueeze(1)

    def part_grads(self, own: torch.Tensor, latent: torch.Tensor) -> tuple[torch.Tensor]:
        return (own.to(latent.dtype),)

    def param_grads(self) -> tuple[torch.Tensor | None]:
        """W_kvb's gradient summed so far, in its dtype; the sum starts again (a backward run twice adds once)."""
        dw, self.dw = self.dw, None
        return (None if dw is None else dw.to(self.weight.dtype),)


def _gather_by_rank(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(n, 1, sl, w) of every cp rank -> (cp, n, 1, sl, w), rank r's at index r."""
    out = x.new_empty((cp * x.shape[0], *x.shape[1:]))  # rank r's at rows r n.. (gloo takes the flat layout)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.unflatten(0, (cp, x.shape[0]))


def _whole_sequence(latent: torch.Tensor, codec: LatentKV, group, cp: int):
    """(the gathered latents (cp, b, 1, sl, w) in rank order, k_all (b, H, s, d_qk), v_all (b, H, s, d_v) in global
    order) of every cp rank's tokens."""
    by_rank = _gather_by_rank(latent, group, cp)
    k, v = codec.expand(by_rank.flatten(0, 1))  # (cp b, H, sl, d), rank r's rows at r b
    b = latent.shape[0]
    k_all = to_global_order(list(k.unflatten(0, (cp, b))), dim=2)
    v_all = to_global_order(list(v.unflatten(0, (cp, b))), dim=2)
    return by_rank, k_all, v_all


class _AllGatherLatentAttention(torch.autograd.Function):
    """forward: (q (b, H, sl, d_qk), this rank's latent (b, 1, sl, r + d_r), W_kvb) -> the attention output
    (b, H, sl, d_v); backward: module doc."""

    @staticmethod
    def forward(ctx, q, latent, weight, group, cp: int, cp_rank: int, scale: float, nope_dim: int, v_dim: int):
        ctx.group, ctx.cp, ctx.cp_rank, ctx.scale, ctx.dims = group, cp, cp_rank, scale, (nope_dim, v_dim)
        with torch.autocast(q.device.type, enabled=False):
            _, k_all, v_all = _whole_sequence(latent, LatentKV(weight, nope_dim, v_dim), group, cp)
            out, lse, ctx.rng = gathered_forward(q, k_all, v_all, cp, cp_rank, scale)
        ctx.save_for_backward(q, latent, weight, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, latent, weight, out, lse = ctx.saved_tensors
        codec = LatentKV(weight, *ctx.dims)
        with torch.autocast(q.device.type, enabled=False):
            by_rank, k_all, v_all = _whole_sequence(latent, codec, ctx.group, ctx.cp)
            dq, dk_by_rank, dv_by_rank = blocks_backward(grad_out, q, k_all, v_all, out, lse, ctx.cp, ctx.cp_rank,
                                                         ctx.rng, ctx.scale)  # fmt: skip
            del k_all, v_all
            d_latent = codec.contract_kv(by_rank.flatten(0, 1), dk_by_rank.flatten(0, 1), dv_by_rank.flatten(0, 1))
            del dk_by_rank, dv_by_rank
            d_latent = reduce_scatter_ranks(d_latent.unflatten(0, (ctx.cp, latent.shape[0])), ctx.group)
        (dw,) = codec.param_grads()
        return dq, d_latent.to(latent.dtype), dw, None, None, None, None, None, None


def latent_context_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    weight: torch.Tensor,
    group,
    cp: int,
    cp_rank: int,
    variant: str,
    scale: float,
    nope_dim: int,
    v_dim: int,
) -> torch.Tensor:
    """Causal attention of this rank's queries q (b, H, sl, d_qk) over the whole sequence, whose keys and values
    every rank expands from the latents (b, 1, sl, r + d_r) the cp ranks of ``group`` exchange (module doc), with
    this rank's heads' up-projection ``weight`` (H (d_n + d_v), r). ``variant``: "allgather" or "ring". Under
    autocast in its dtype. Out: (b, H, sl, d_v)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, latent, weight = q.to(dtype), latent.to(dtype), weight.to(dtype)
    if variant == "ring":
        return ring_over_messages(q, LatentKV(weight, nope_dim, v_dim), group, cp, cp_rank, scale, latent, weight)
    if variant != "allgather":
        raise ValueError(f"context-parallel attention {variant!r}: allgather or ring")
    return _AllGatherLatentAttention.apply(q, latent, weight, group, cp, cp_rank, scale, nope_dim, v_dim)
