"""Multi-head latent attention (DeepSeek-V2/V3; ``model.attention=mla``), tensor-parallel. transformers'
``DeepseekV3Attention`` is its oracle (tests/unit/model/test_mla.py).

Shapes: b micro batch, s sequence, h hidden, a heads (a / t on a tp rank: H), r_q and r = r_kv the latents, d_n, d_r,
d_v the heads' widths without RoPE, with it, and of the values (d_qk = d_n + d_r); ``model.mla`` names them as
DeepSeek's config.json does (V3: 1536, 512, 128, 64, 128).

    c_q = norm(x W_qa^T)                 (b, s, r_q)      replicated     (no q compression: q = x W_q^T)
    q   = c_q W_qb^T                     (b, s, H d_qk)   split by heads: each head [d_n | d_r]
    [c | k_r] = x W_kva^T                (b, s, r + d_r)  replicated: the latent and ONE rotated key for all heads
    [k_n | v] = norm(c) W_kvb^T          (b, s, H (d_n + d_v))   split by heads: each head [d_n | d_v]
    k = [k_n | rope(k_r)], q = [q_n | rope(q_r)]; out = softmax(q k^T x scale) v   (b, H, s, d_v)
    y = out W_o^T                        (b, s, h)        row-parallel: one all-reduce

RoPE rotates the d_r columns only, with the model's RoPE scaling (yarn for V3, p3d.model.rope) over a d_r-wide
head, rotate-half: DeepSeek's checkpoints rotate interleaved pairs, and their rotated rows are permuted at import
(p3d.hf.rope_rows), so that the logits are the same. The softmax scale is DeepSeek's: 1/sqrt(d_qk) times yarn's
mscale(factor, mscale_all_dim)^2 (``p3d.model.rope.mla_scale_factor``). The latents' norms have eps 1e-6 whatever
``model.norm_eps`` (DeepSeek's code and transformers' build them with their default).

Tensor parallelism: W_qb, W_kvb and W_o are split by heads (whole heads per rank); W_qa, W_kva and the two norms
are replicated. The latents enter the tp region through the column-parallel W_qb and W_kvb (their gradient summed
over tp there), k_r through ``copy_to_tp``: the replicated weights then get the same gradient on every rank.
Sequence parallelism: x is this rank's (b, s/tp, h) block; W_qa, W_kva and the norms run on it (their weights'
gradients summed over tp), and what is all-gathered is the latents, r_q + r + d_r wide, not h.

Context parallelism (``mesh.cp`` > 1): a rank holds s / cp tokens; the keys and values travel as the latent
[norm(c) | rope(k_r)] (r + d_r wide per token, p3d.parallel.context.latent), not as the heads' keys and values, and
every rank expands the tokens it attends to with its W_kvb (docs/context.md, "MLA"). The fused kernels take one head
dim for q, k and v on cpu and in FlashAttention-2: v gets d_qk - d_v zero columns there and the output is cut back
(p3d.compat.sdpa_kernels ``value_padding``; the memory-efficient kernel, cuda's fp32 one, takes d_v as it is).
Selective recompute (``recompute``): RoPE and the attention core run under ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.compat.sdpa_kernels import value_padding
from p3d.layout.geometry import qk_head_dim, rope_dim
from p3d.model.norms import RMSNorm
from p3d.model.rope import apply_rope, mla_scale_factor, rope_cos_sin, rope_table
from p3d.parallel.context.chunks import local_positions
from p3d.parallel.context.latent import latent_context_attention
from p3d.parallel.tp.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from p3d.parallel.tp.mappings import copy_to_tp, gather_from_sp
from p3d.parallel.tp.precision import compute_weight

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm: RMSNorm's default, not config's rms_norm_eps


def mla_softmax_scale(cfg) -> float:
    """1/sqrt(d_qk) x yarn's mscale(factor, mscale_all_dim)^2 (transformers' ``yarn_apply_mscale``)."""
    return mla_scale_factor(cfg.rope_scaling) / math.sqrt(qk_head_dim(cfg))


def sdpa_narrow_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA of q, k (b, H, s, d_qk) over v (b, H, s, d_v), on the fused kernel: v padded to d_qk where that
    kernel is a flash kernel (module doc), the output cut back to d_v. Out: (b, H, s, d_v)."""
    dv = v.shape[-1]
    pad = value_padding(q.device.type, q.dtype, q.shape[-1], dv)
    if pad:
        v = F.pad(v, (0, pad))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[..., :dv] if pad else out


def _rotate(q, k_rot, cos, sin, nope_dim: int):
    """q (b, H, s, d_qk) with its d_r columns rotated, and k_r (b, 1, s, d_r) rotated."""
    q_nope, q_rot = q.split([nope_dim, q.shape[-1] - nope_dim], dim=-1)
    return torch.cat([q_nope, apply_rope(q_rot, cos, sin)], dim=-1), apply_rope(k_rot, cos, sin)


def _mla_core(q, k_nope, k_rot, v, cos, sin, scale: float) -> torch.Tensor:
    """RoPE on q's and k_r's rotated columns, the keys assembled, causal SDPA: what selective recompute repeats.
    q (b, H, s, d_qk), k_nope (b, H, s, d_n), k_rot (b, 1, s, d_r), v (b, H, s, d_v) -> (b, H, s, d_v)."""
    q, k_rot = _rotate(q, k_rot, cos, sin, k_nope.shape[-1])
    k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    return sdpa_narrow_values(q, k, v, scale)


def _mla_context_core(q, c, k_rot, cos, sin, weight, scale: float, nope_dim: int, v_dim: int, cp_args: tuple):
    """``_mla_core`` of a cp rank: RoPE at the tokens' global positions (``cos``, ``sin``: this rank's rows), then the
    latent [c | rope(k_r)] (b, 1, s/cp, r + d_r) exchanged over the cp group and expanded by ``weight`` (W_kvb)."""
    q, k_rot = _rotate(q, k_rot, cos, sin, nope_dim)
    latent = torch.cat([c.unsqueeze(1), k_rot], dim=-1)
    group, cp, cp_rank, variant = cp_args
    return latent_context_attention(q, latent, weight, group, cp, cp_rank, variant, scale, nope_dim, v_dim)


class MultiHeadLatentAttention(nn.Module):
    """In and out as ``p3d.model.attention.Attention``'s: (b, s, h) replicated over tp, or (b, s/tp, h) with SP."""

    def __init__(
        self,
        cfg,
        mesh,
        prefix: str,
        seed: int,
        sequence_parallel: bool = False,
        recompute: bool = False,
        cp_attention: str = "allgather",
    ):
        super().__init__()
        x = cfg.mla
        h, a = cfg.hidden_size, cfg.n_heads
        self.recompute, self.cp_attention = recompute, cp_attention
        self.nope_dim, self.rope_dim, self.v_dim = x.qk_nope_head_dim, rope_dim(cfg), x.v_head_dim
        self.latent = x.kv_lora_rank
        self.local_heads = a // mesh.tp
        self.sp = sequence_parallel and mesh.tp > 1
        self.tp_group = mesh.tp_group
        self.cp, self.cp_group, self.cp_rank = mesh.cp, mesh.cp_group, mesh.cp_rank
        self.scale = mla_softmax_scale(cfg)
        sp_group = mesh.tp_group if self.sp else None  # the replicated pieces see s/tp tokens: gradients summed
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        qk = qk_head_dim(cfg)

        def column(n_in: int, n_out: int, name: str) -> ColumnParallelLinear:
            return ColumnParallelLinear(n_in, [n_out], mesh, [f"{prefix}.{name}"], std, seed, sequence_parallel=self.sp)

        self.wq_a = self.q_a_norm = self.wq_b = self.wq = None
        if x.q_lora_rank:
            self.wq_a = ReplicatedLinear(h, x.q_lora_rank, f"{prefix}.wq_a", std, seed, sp_group)
            self.q_a_norm = RMSNorm(x.q_lora_rank, LATENT_NORM_EPS, sp_group)
            self.wq_b = column(x.q_lora_rank, a * qk, "wq_b")
        else:
            self.wq = column(h, a * qk, "wq")
        self.wkv_a = ReplicatedLinear(h, self.latent + self.rope_dim, f"{prefix}.wkv_a", std, seed, sp_group)
        self.kv_a_norm = RMSNorm(self.latent, LATENT_NORM_EPS, sp_group)
        self.wkv_b = column(self.latent, a * (self.nope_dim + self.v_dim), "wkv_b")
        self.wo = RowParallelLinear(a * self.v_dim, h, mesh, f"{prefix}.wo", out_std, seed, sequence_parallel=self.sp)
        # RoPE tables of the rotated width d_r, built once (as Attention's: buffers, not persistent; a cp rank's rows)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        if self.wkv_b.weight.device.type == "meta":
            cos = sin = torch.empty(cfg.seq_len // self.cp, self.rope_dim, device="meta")
        else:
            cos, sin = rope_table(cfg.seq_len, self.rope_dim, cfg.rope_theta, cfg.rope_scaling)
            if self.cp > 1:
                rows_held = local_positions(cfg.seq_len, self.cp, self.cp_rank)
                cos, sin = cos[rows_held], sin[rows_held]
        self.register_buffer("rope_cos", cos.clone(), persistent=False)
        self.register_buffer("rope_sin", sin.clone(), persistent=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, H d_qk): the whole sequence, also with SP (the column-parallel layer gathers its input)."""
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_a_norm(self.wq_a(x)))  # SP: what is gathered is c_q, r_q wide

    def _tables(self, s: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cp > 1:  # this rank's s/cp tokens of model.seq_len, the only length the rows are for
            if s != self.rope_cos.shape[0]:
                raise ValueError(f"{s} tokens on a cp rank: expected model.seq_len / cp = {self.rope_cos.shape[0]}")
            return self.rope_cos.to(like.dtype), self.rope_sin.to(like.dtype)
        if s <= self.rope_cos.shape[0]:
            return self.rope_cos[:s].to(like.dtype), self.rope_sin[:s].to(like.dtype)
        return rope_cos_sin(s, self.rope_dim, self.rope_theta, self.rope_scaling, like.device, like.dtype)

    def _enter(self, t: torch.Tensor) -> torch.Tensor:
        """A replicated activation's entry into the tp region: all-gathered along the sequence (SP) or copied; its
        gradient, partial over the heads, summed over tp either way."""
        return gather_from_sp(t, self.tp_group) if self.sp else copy_to_tp(t, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._queries(x)  # (b, s, H d_qk)
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, -1).transpose(1, 2)  # (b, H, s, d_qk)
        c, k_rot = self.wkv_a(x).split([self.latent, self.rope_dim], dim=-1)  # (b, s or s/tp, r), (.., d_r)
        c = self.kv_a_norm(c)
        k_rot = self._enter(k_rot).unsqueeze(1)  # (b, 1, s, d_r): one key for every head
        cos, sin = self._tables(s, q)
        if self.cp > 1:  # the latent travels: the heads' keys and values are made where they are attended
            weight = compute_weight(self.wkv_b.weight)
            cp_args = (self.cp_group, self.cp, self.cp_rank, self.cp_attention)
            core = functools.partial(_mla_context_core, cos=cos, sin=sin, weight=weight, scale=self.scale,
                                     nope_dim=self.nope_dim, v_dim=self.v_dim, cp_args=cp_args)  # fmt: skip
            args: tuple = (q, self._enter(c), k_rot)
        else:
            kv = self.wkv_b(c).view(b, s, self.local_heads, -1).transpose(1, 2)  # (b, H, s, d_n + d_v)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            core = functools.partial(_mla_core, cos=cos, sin=sin, scale=self.scale)
            args = (q, k_nope, k_rot, v)
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(core, *args, use_reentrant=False)
        else:
            out = core(*args)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.local_heads * self.v_dim))  # (b, s or s/tp, h)
