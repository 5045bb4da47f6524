"""RMSNorm, the norm of every block (two per block, the final one) and of Qwen3's query and key heads.

y = x / sqrt(mean(x^2) + eps) * w over the last dimension, in fp32; a bf16 input keeps bf16 for backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from p3d.parallel.tp.layers import on_meta
from p3d.parallel.tp.mappings import copy_to_tp


class _LowPrecisionRMSNorm(torch.autograd.Function):
    """forward: y = (x / rms(x)).to(c) * w.to(c) for x in a c = bf16 (or fp16) dtype, the statistics in fp32;
    saves x (c bytes a value) and 1/rms (b, s, 1) in fp32, not an fp32 copy of x. backward in fp32, with n = x / rms
    and g = dy w: dx = (g - n mean(g n)) / rms, dw = sum over tokens of dy n; each returned in its input's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (b, s, 1)
        ctx.save_for_backward(x, rstd, weight)
        return (xf * rstd).to(x.dtype) * weight.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        n = x.float() * rstd
        gf = grad.float()
        grad_w = (gf * n).reshape(-1, n.shape[-1]).sum(0)
        g = gf * weight.float()
        grad_x = (g - n * (g * n).mean(-1, keepdim=True)) * rstd
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32. Replicated over tp (identical grads). A bf16 x (the
    residual stream under bf16) gives a bf16 y and keeps x in bf16 for backward (``_LowPrecisionRMSNorm``).

    ``sp_group``: the tp group when each tp rank normalises a different part of what the weight acts on: x a
    sequence block (sequence parallelism), or x this rank's query or key heads (Qwen3's q/k norms, split by heads).
    The weight then enters through copy_to_tp, so its gradient, partial over tp, is summed over tp.
    """

    def __init__(self, dim: int, eps: float, sp_group=None):
        super().__init__()
        self.eps, self.sp_group = eps, sp_group
        self.weight = nn.Parameter(torch.empty(dim) if on_meta() else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.sp_group is None else copy_to_tp(self.weight, self.sp_group)
        if x.dtype != torch.float32:
            return _LowPrecisionRMSNorm.apply(x, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * weight
