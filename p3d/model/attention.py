"""Grouped-query attention, tensor-parallel: q|k|v split by heads, RoPE (scaled or not), causal SDPA, o row-parallel.

Shapes use b = micro batch, s = sequence, h = hidden, hd = head dim (``model.head_dim``, else h / nh), nh/nkv =
query/kv heads. q|k|v is one column-parallel matmul (each of q, k, v split by heads, so a rank keeps whole heads and
the GQA pairing of its query heads with its kv heads), the output projection is row-parallel: one all-reduce
forward and one backward per attention.

What the families add, each a field of the model group and each cut by heads like the matrices it follows:
- ``qkv_bias`` (Qwen2/2.5): the biases of q, k and v (p3d.parallel.tp.bias), rank r holding its heads' slices.
- ``qk_norm`` (Qwen3): an RMSNorm over hd of every query and every key head, before RoPE; one weight (hd,) shared
  by the heads, replicated over tp. A rank normalises its own heads only, so the weight's gradient is partial and
  is summed over tp (the norm's ``sp_group``).
- ``rope_scaling``: the cos / sin tables (p3d.model.rope) with the scaled frequencies and yarn's attention factor.

Context parallelism (``mesh.cp`` > 1): a rank holds s / cp tokens of each sequence (p3d.parallel.context.chunks);
RoPE rotates each by its global position (the rows of the whole table) and the attention core reaches the other
ranks' keys and values over the cp group, all-gathered or around a ring (p3d.parallel.context.attention).
Selective recompute (``recompute``): RoPE and the attention core run under ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.layout.geometry import head_dim
from p3d.model.norms import RMSNorm
from p3d.model.rope import apply_rope, rope_cos_sin, rope_table
from p3d.parallel.context.attention import context_parallel_attention
from p3d.parallel.context.chunks import local_positions
from p3d.parallel.tp.bias import ColumnParallelBias
from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        self.head_dim = hd = head_dim(cfg)
        self.local_heads = cfg.n_heads // mesh.tp
        self.local_kv_heads = cfg.n_kv_heads // mesh.tp
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.cp, self.cp_group, self.cp_rank = mesh.cp, mesh.cp_group, mesh.cp_rank
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        widths = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
        self.wqkv = ColumnParallelLinear(
            cfg.hidden_size,
            widths,
            mesh,
            [f"{prefix}.wq", f"{prefix}.wk", f"{prefix}.wv"],
            cfg.init_std,
            seed,
            sequence_parallel=sequence_parallel,
        )
        self.bqkv = ColumnParallelBias(widths, mesh) if cfg.qkv_bias else None  # (q + 2 kv) / tp
        heads_group = mesh.tp_group if mesh.tp > 1 else None  # each rank normalises its own heads
        self.q_norm = RMSNorm(hd, cfg.norm_eps, heads_group) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps, heads_group) if cfg.qk_norm else None
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
            cos, sin = rope_table(cfg.seq_len, hd, cfg.rope_theta, cfg.rope_scaling)
            if self.cp > 1:
                rows_held = local_positions(cfg.seq_len, self.cp, self.cp_rank)
                cos, sin = cos[rows_held], sin[rows_held]
        self.register_buffer("rope_cos", cos.clone(), persistent=False)
        self.register_buffer("rope_sin", sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)  # (b, s, (nh + 2 nkv)/tp * hd): the whole sequence, also with SP
        if self.bqkv is not None:
            qkv = self.bqkv(qkv)
        b, s, _ = qkv.shape
        q, k, v = self.wqkv.split_output(qkv)  # (b, s, nh/tp*hd), (b, s, nkv/tp*hd) x 2
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # (b, nh/tp, s, hd)
        k = k.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)  # (b, nkv/tp, s, hd)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # over hd, each head on its own, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cp > 1:  # this rank's s/cp tokens of model.seq_len, the only length the rows are for
            if s != self.rope_cos.shape[0]:
                raise ValueError(f"{s} tokens on a cp rank: expected model.seq_len / cp = {self.rope_cos.shape[0]}")
            cos, sin = self.rope_cos.to(q.dtype), self.rope_sin.to(q.dtype)
        elif s <= self.rope_cos.shape[0]:
            cos, sin = self.rope_cos[:s].to(q.dtype), self.rope_sin[:s].to(q.dtype)  # no copy when dtypes match
        else:  # longer than model.seq_len (a caller's own inputs): computed for this length
            cos, sin = rope_cos_sin(s, self.head_dim, self.rope_theta, self.rope_scaling, q.device, q.dtype)
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
