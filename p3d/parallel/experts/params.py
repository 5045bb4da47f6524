"""Which parameters are routed experts' weights: they live on the ranks of one ep share only, so they reduce
their gradients over the expert-data-parallel group (the dp ranks holding the same experts, dp / ep of them),
are sharded by ZeRO over it, and count once per ep share in the gradient norm (p3d.layout.dims)."""

from __future__ import annotations

import torch

EXPERT_PARALLEL = "expert_parallel"  # the marker attribute, set on every routed expert's weights


def mark_expert(p: torch.nn.Parameter) -> torch.nn.Parameter:
    setattr(p, EXPERT_PARALLEL, True)
    return p


def is_expert_param(p: torch.Tensor) -> bool:
    return bool(getattr(p, EXPERT_PARALLEL, False))
