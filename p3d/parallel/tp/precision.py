"""bf16 weights cast once a step (docs/overlap.md, "bf16").

The torch executor trains bf16 under ``torch.autocast`` over fp32 parameters (the master weights, whose gradients
accumulate in fp32). Autocast casts a weight at each use and drops its cache when the autocast region ends, so
every micro batch in flight kept its own bf16 copy of every weight for its backward (2 bytes per parameter per
micro batch). ``compute_weight`` gives the layers one bf16 copy per weight, made at the weight's first use in a step
and shared by every micro batch's forward and backward: a view of it enters each micro batch's graph through
``_CastOnce`` (backward: the gradient cast back to the parameter's dtype, as autocast's cast does), so saved tensors
of all micro batches share its storage.

The copy is stored on the parameter and valid for the parameter's ``_version`` (an optimizer step writes the
parameter in place); the executor also drops every copy as a step starts and ends (``drop_weight_casts``), so
writes that bypass the version (a checkpoint loaded through ``.data``, a broadcast) are never missed and no copy
outlives its step. Outside autocast, for a weight already in the compute dtype (DeepSpeed's bf16 modules, FSDP2's
bf16 gathers) or under ``torch.compile``: the weight itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

CAST_ATTR = "_p3d_compute_cast"  # (version, dtype, bf16 copy) on the parameter
FLOAT8_ATTR = "float8"  # a TP layer's float8 matmul (p3d.parallel.tp.float8), which keeps the step's weight casts


class _CastOnce(torch.autograd.Function):
    """forward: the cached copy of ``weight`` in ``dtype`` (a view, one storage for all calls); backward: the
    gradient in the weight's dtype."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight_dtype = weight.dtype
        cached = getattr(weight, CAST_ATTR, None)
        if cached is None or cached[0] != weight._version or cached[1] != dtype:
            cached = (weight._version, dtype, weight.detach().to(dtype))
            setattr(weight, CAST_ATTR, cached)
        return cached[2].view_as(cached[2])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.weight_dtype), None


def compute_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a matmul under the current autocast would use it, cast once a step (module doc)."""
    dtype = autocast_dtype(weight.device.type)
    if dtype is None or torch.compiler.is_compiling():
        return weight
    if weight.dtype == dtype or not weight.is_floating_point():
        return weight
    return _CastOnce.apply(weight, dtype)


def drop_weight_casts(module: nn.Module) -> None:
    """Forget every parameter's cast copy, and every float8 layer's weight casts (the executor, as a step starts and
    ends)."""
    for p in module.parameters():
        if hasattr(p, CAST_ATTR):
            delattr(p, CAST_ATTR)
    for m in module.modules():
        float8 = getattr(m, FLOAT8_ATTR, None)
        if float8 is not None:
            float8.drop()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type``, or None outside autocast (and on devices autocast does not
    know: meta, the planner's FLOP counts)."""
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except RuntimeError:
        return None
