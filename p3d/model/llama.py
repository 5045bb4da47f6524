"""The transformer block every family shares, tensor-parallel: RMSNorm, attention (p3d.model.attention: GQA split
by heads, with the families' biases, q/k norms and RoPE scalings; or p3d.model.mla: multi-head latent attention,
``model.attention=mla``), and SwiGLU or the mixture of experts
(p3d.model.moe). The families differ in fields of the model group, never in branches here (docs/models.md).

Shapes use b = micro batch, s = sequence, h = hidden. The MLP: gate|up column-parallel, down row-parallel.
Context parallelism (``mesh.cp`` > 1): a rank holds s / cp tokens of each sequence, so every shape reads s / cp for s.

Sequence parallelism (``sequence_parallel``): between the TP regions (norms, residual adds) every
tensor is this rank's block of the sequence, (b, s/tp, h); q|k|v and gate|up all-gather it, o and
down reduce-scatter back to it. The norm weights stay replicated; each rank sees s/tp tokens, so their
gradients are summed over tp. Selective recompute (``recompute_attention``): RoPE and the attention
core run under ``torch.utils.checkpoint`` and are recomputed in backward; q|k|v and the output stay.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from p3d.layout.geometry import is_mla, is_moe_layer
from p3d.model.attention import Attention
from p3d.model.mla import MultiHeadLatentAttention
from p3d.model.moe import MoEFeedForward
from p3d.model.norms import RMSNorm
from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear


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
        attention = MultiHeadLatentAttention if is_mla(cfg) else Attention  # model.attention: gqa or mla
        self.attn = attention(cfg, mesh, f"{prefix}.attn", seed, sequence_parallel, recompute_attention, cp_attention)
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
