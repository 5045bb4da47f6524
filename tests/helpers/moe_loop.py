"""The routed experts as p3d computed them before they were stacked (issue 53): a Python loop over the experts,
each one's rows cut out by counts read on the host (``.tolist()``: a device sync), linear -> SwiGLU -> linear per
expert, every expert running even on zero rows: 6 matmuls per expert forward and backward. Kept as the reference the
grouped GEMM is checked against (tests/unit/parallel/test_experts_grouped.py) and timed against (bench/moe.py layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loop_swiglu(rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, groups) -> torch.Tensor:
    """rows (R, h) grouped by ``groups`` (p3d.parallel.experts.grouped.Groups), weights (G, 2f, h) and (G, h, f)
    -> (R, h); rows after the last group (a capacity's tail) give zeros."""
    counts = groups.sizes.tolist()
    tail = rows.shape[0] - sum(counts)
    outs = []
    for j, part in enumerate(rows.split([*counts, tail])[: len(counts)]):
        gate, up = F.linear(part, w_gate_up[j]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w_down[j]))
    return torch.cat([*outs, rows.new_zeros(tail, w_down.shape[1])])


def use_loop(moe) -> None:
    """Make an MoE feed-forward (p3d.model.moe.MoEFeedForward) compute its routed experts by the loop."""
    experts = moe.experts

    def forward(rows, groups):
        w_gate_up = experts.w_gate_up.weight.view(experts.local, -1, experts.h)
        w_down = experts.w_down.weight.view(experts.local, experts.h, -1)
        return loop_swiglu(rows, w_gate_up, w_down, groups)

    experts.forward = forward
