"""Llama blocks, tensor-parallel: RMSNorm, RoPE, grouped-query attention split by heads, SwiGLU.

Shapes use b = micro batch, s = sequence, h = hidden, hd = head dim, nh/nkv = query/kv heads.
Attention: q|k|v is one column-parallel matmul (each of q, k, v split by heads, so a rank keeps
whole heads and the GQA pairing of its query heads with its kv heads), the output projection is
row-parallel: one all-reduce forward and one backward per attention. The MLP likewise:
gate|up column-parallel, down row-parallel.

Context parallelism (``mesh.cp`` > 1): a rank holds s / cp tokens of each sequence (p3d.parallel.context.chunks),
so every shape below reads s / cp for s; RoPE rotates each by its global position and the attention core
reaches the other ranks' keys and values over the cp group, all-gathered or around a ring
(p3d.parallel.context.attention, ``context.attention``).

Sequence parallelism (``sequence_parallel``): between the TP regions (norms, residual adds) every
tensor is this rank's block of the sequence, (b, s/tp, h); q|k|v and gate|up all-gather it, o and
down reduce-scatter back to it. The norm weights stay replicated; each rank sees s/tp tokens, so their
gradients are summed over tp. Selective recompute (``recompute_attention``): RoPE and the attention
core run under ``torch.utils.checkpoint`` and are recomputed in backward; q|k|v and the output stay.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.layout.geometry import is_moe_layer
from p3d.model.moe import MoEFeedForward
from p3d.parallel.context.attention import context_parallel_attention
from p3d.parallel.context.chunks import local_positions
from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, on_meta
from p3d.parallel.tp.mappings import copy_to_tp


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32. Replicated over tp (identical grads).

    ``sp_group``: the tp group when x is a sequence block (sequence parallelism); the weight then
    enters through copy_to_tp, so its gradient, partial over the tokens of this rank, is summed over tp.
    """

    def __init__(self, dim: int, eps: float, sp_group=None):
        super().__init__()
        self.eps, self.sp_group = eps, sp_group
        self.weight = nn.Parameter(torch.empty(dim) if on_meta() else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.sp_group is None else copy_to_tp(self.weight, self.sp_group)
        return xf.to(x.dtype) * weight


@functools.lru_cache(maxsize=8)
def rope_table(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (s, hd) in fp32 on the CPU, computed once per shape: every block's buffers start from it."""
    return rope_cos_sin(seq_len, head_dim, theta, "cpu", torch.float32)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (s, hd), frequencies repeated over both halves (the HF Llama convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (s, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, s, hd). Rotates pairs (i, i + hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def kv_for_fused_kernel(q, k, v, gqa: bool, device_type: str | None = None):
    """(k, v, enable_gqa) for SDPA. CUDA runs ``enable_gqa`` on the flash kernel only, which takes fp16 / bf16: in
    fp32 (``train.dtype=fp32``) it would fall back to the math kernel, whose (s, s) scores grow as s^2. There the kv
    heads are expanded to the query heads, (b, nkv, s, hd) -> (b, nh, s, hd), for the memory-efficient kernel,
    which takes fp32 (its gradient flows back to each kv head through the expansion). Elsewhere: unchanged."""
    if gqa and (device_type or q.device.type) == "cuda" and q.dtype == torch.float32:
        g = q.shape[1] // k.shape[1]
        return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), False
    return k, v, gqa


def _attention_core(q, k, v, cos, sin, gqa: bool) -> torch.Tensor:
    """RoPE on q, k (b, heads, s, hd) and causal SDPA: the part selective recompute repeats."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v, gqa = kv_for_fused_kernel(q, k, v, gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (b, nh/tp, s, hd)


def _context_parallel_core(q, k, v, cos, sin, group, cp: int, cp_rank: int, variant: str) -> torch.Tensor:
    """``_attention_core`` of a cp rank: RoPE at the tokens' global positions (``cos``, ``sin`` are this rank's
    rows), then attention over every cp rank's keys and values (``variant``: allgather or ring).
    q (b, nh/tp, s/cp, hd) -> the same shape."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return context_parallel_attention(q, k, v, group, cp, cp_rank, variant)


class Attention(nn.Module):
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
        self.recompute, self.cp_attention = recompute, cp_attention
        self.head_dim = hd = cfg.hidden_size // cfg.n_heads
        self.local_heads = cfg.n_heads // mesh.tp
        self.local_kv_heads = cfg.n_kv_heads // mesh.tp
        self.rope_theta = cfg.rope_theta
        self.cp, self.cp_group, self.cp_rank = mesh.cp, mesh.cp_group, mesh.cp_rank
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wqkv = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd],
            mesh,
            [f"{prefix}.wq", f"{prefix}.wk", f"{prefix}.wv"],
            cfg.init_std,
            seed,
            sequence_parallel=sequence_parallel,
        )
        self.wo = RowParallelLinear(
            cfg.n_heads * hd, cfg.hidden_size, mesh, f"{prefix}.wo", out_std, seed, sequence_parallel=sequence_parallel
        )
        # RoPE tables for positions 0..seq_len-1, built once, not every forward. Buffers, so that they move
        # and cast with the module (bf16 runs: the fp32 table rounded once, as computing it in bf16 did);
        # not persistent: checkpoints and HF exports hold weights only. A copy per block (what p3d-plan
        # counts); on "meta" (dry runs) none. Under context parallelism the rows of this rank's tokens.
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        if self.wqkv.weight.device.type == "meta":  # shapes only: a 131K-token table is not built for a dry run
            rows = cfg.seq_len // self.cp
            cos = sin = torch.empty(rows, hd, device="meta")
        else:
            cos, sin = rope_table(cfg.seq_len, hd, cfg.rope_theta)
            if self.cp > 1:
                rows_held = local_positions(cfg.seq_len, self.cp, self.cp_rank)
                cos, sin = cos[rows_held], sin[rows_held]
        self.register_buffer("rope_cos", cos.clone(), persistent=False)
        self.register_buffer("rope_sin", sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)  # (b, s, (nh + 2 nkv)/tp * hd): the whole sequence, also with SP
        b, s, _ = qkv.shape
        q, k, v = self.wqkv.split_output(qkv)  # (b, s, nh/tp*hd), (b, s, nkv/tp*hd) x 2
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # (b, nh/tp, s, hd)
        k = k.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)  # (b, nkv/tp, s, hd)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        if self.cp > 1:  # this rank's s/cp tokens of model.seq_len, the only length the rows are for
            if s != self.rope_cos.shape[0]:
                raise ValueError(f"{s} tokens on a cp rank: expected model.seq_len / cp = {self.rope_cos.shape[0]}")
            cos, sin = self.rope_cos.to(q.dtype), self.rope_sin.to(q.dtype)
        elif s <= self.rope_cos.shape[0]:
            cos, sin = self.rope_cos[:s].to(q.dtype), self.rope_sin[:s].to(q.dtype)  # no copy when dtypes match
        else:  # longer than model.seq_len (a caller's own inputs): computed for this length
            cos, sin = rope_cos_sin(s, self.head_dim, self.rope_theta, q.device, q.dtype)
        # cos, sin are bound, not passed: checkpoint keeps what it is passed, and the tables are the module's
        if self.cp > 1:
            core = functools.partial(
                _context_parallel_core,
                cos=cos,
                sin=sin,
                group=self.cp_group,
                cp=self.cp,
                cp_rank=self.cp_rank,
                variant=self.cp_attention,
            )
        else:
            core = functools.partial(_attention_core, cos=cos, sin=sin, gqa=self.local_heads != self.local_kv_heads)
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(core, q, k, v, use_reentrant=False)
        else:
            out = core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))  # (b, s or s/tp, h)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, (b, s, ffn/tp): what schedule.recompute_swiglu repeats in backward."""
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate|up fused column-parallel (ffn/tp each), down row-parallel.
    ``recompute``: silu(gate) * up runs under ``torch.utils.checkpoint``, so silu(gate) (b, s, ffn/tp) is not
    kept for backward (gate|up is, as the checkpoint's input; the product is, as down's input)."""

    def __init__(self, cfg, mesh, prefix: str, seed: int, sequence_parallel: bool = False, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.w_gate_up = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.ffn_hidden_size, cfg.ffn_hidden_size],
            mesh,
            [f"{prefix}.w_gate", f"{prefix}.w_up"],
            cfg.init_std,
            seed,
            sequence_parallel=sequence_parallel,
        )
        self.w_down = RowParallelLinear(
            cfg.ffn_hidden_size,
            cfg.hidden_size,
            mesh,
            f"{prefix}.w_down",
            out_std,
            seed,
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up.split_output(self.w_gate_up(x))  # (b, s, ffn/tp) each
        if self.recompute and torch.is_grad_enabled():
            return self.w_down(checkpoint(_swiglu, gate, up, use_reentrant=False))
        return self.w_down(_swiglu(gate, up))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). In and out: (b, s, h), replicated over tp;
    with ``sequence_parallel`` (b, s/tp, h), this rank's block of the sequence."""

    def __init__(
        self,
        cfg,
        mesh,
        layer_idx: int,
        seed: int,
        sequence_parallel: bool = False,
        recompute_attention: bool = False,
        recompute_swiglu: bool = False,
        cp_attention: str = "allgather",
    ):
        super().__init__()
        prefix = f"block{layer_idx}"
        sp_group = mesh.tp_group if sequence_parallel else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sp_group)
        self.attn = Attention(cfg, mesh, f"{prefix}.attn", seed, sequence_parallel, recompute_attention, cp_attention)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, sp_group)
        self.mlp: nn.Module
        if is_moe_layer(cfg, layer_idx):
            self.mlp = MoEFeedForward(cfg, mesh, layer_idx, seed, sequence_parallel, recompute_swiglu)
        else:
            self.mlp = SwiGLU(cfg, mesh, f"{prefix}.mlp", seed, sequence_parallel, recompute_swiglu)
        if cfg.compile:  # torch.compile of this block's forward (inductor: fused kernels on GPU and CPU alike)
            self.compile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))
