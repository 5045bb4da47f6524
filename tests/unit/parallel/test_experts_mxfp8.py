"""The routed experts' grouped SwiGLU in MXFP8 (``train.fp8=mxfp8``, p3d.parallel.experts.mxfp8): close to bf16's
and not bf16 (the MXFP8 path ran), its tp split adding up to the unsplit experts (MXFP8's 32-value blocks fall
inside a shard: no scale crosses ranks), and a capacity's tail of dropped rows falling back to bf16."""

from __future__ import annotations

from functools import partial

import torch

from p3d.compat import torchao_internals as ao
from p3d.parallel.experts.grouped import Groups, grouped_swiglu

H, F_E, SIZES = 64, 64, [5, 0, 40, 19]
MX = partial(ao.mxfp8_grouped_mm, emulate=True)


def _case(tail: int = 0):
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(sum(SIZES) + tail, H, generator=gen).to(torch.bfloat16)
    w_gate_up = (torch.randn(len(SIZES), 2 * F_E, H, generator=gen) / 8).to(torch.bfloat16)
    w_down = (torch.randn(len(SIZES), H, F_E, generator=gen) / 8).to(torch.bfloat16)
    return rows, w_gate_up, w_down, Groups(torch.tensor(SIZES), bound=max(SIZES), tail=tail > 0)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_mxfp8_experts_are_close_to_bf16_and_not_bf16():
    rows, w1, w2, groups = _case()
    bf16 = grouped_swiglu(rows, w1, w2, groups)
    mx = grouped_swiglu(rows, w1, w2, groups, low_precision_mm=MX)
    assert mx.dtype == torch.bfloat16 and 1e-3 < _relative(mx, bf16) < 0.1


def test_mxfp8_tp2_split_adds_up_to_the_unsplit_experts():
    """Each expert cut as p3d.model.experts cuts it over tp = 2 (gate|up by rows of each half, down by columns): the
    partial outputs' sum is the unsplit output within bf16's rounding of the two partial sums."""
    rows, w1, w2, groups = _case()
    whole = grouped_swiglu(rows, w1, w2, groups, low_precision_mm=MX)
    gate, up = w1.chunk(2, dim=1)  # (G, f, h) each
    parts = []
    for r in range(2):
        w1_r = torch.cat([gate.chunk(2, dim=1)[r], up.chunk(2, dim=1)[r]], dim=1)  # (G, 2 f/t, h)
        w2_r = w2.chunk(2, dim=2)[r].contiguous()  # (G, h, f/t)
        parts.append(grouped_swiglu(rows, w1_r, w2_r, groups, low_precision_mm=MX).float())
    assert _relative(parts[0] + parts[1], whole) < 5e-3  # measured 2.4e-3; MXFP8 itself is 6.4e-2 off bf16


def test_a_capacity_tail_falls_back_to_bf16():
    rows, w1, w2, groups = _case(tail=3)
    assert torch.equal(grouped_swiglu(rows, w1, w2, groups, low_precision_mm=MX), grouped_swiglu(rows, w1, w2, groups))
