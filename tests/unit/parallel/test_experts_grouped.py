"""The routed experts' grouped SwiGLU (p3d.parallel.experts.grouped) against the per-expert loop it replaced
(tests/helpers/moe_loop.py), outputs and every gradient, on both of its paths: ``torch._grouped_mm`` (CPU in any
dtype, CUDA bf16 on sm90+) and the padded bmm (CUDA fp32: forced here), with and without a capacity's tail of
dropped rows, with an expert that gets no row."""

from __future__ import annotations

import pytest
import torch

from p3d.parallel.experts import grouped
from p3d.parallel.experts.grouped import Groups, grouped_swiglu
from tests.helpers.moe_loop import loop_swiglu

H, F_E = 16, 8


def _case(sizes: list[int], tail: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    g = len(sizes)
    rows = torch.randn(sum(sizes) + tail, H, generator=gen).to(dtype)
    w_gate_up = (torch.randn(g, 2 * F_E, H, generator=gen) / 4).to(dtype)
    w_down = (torch.randn(g, H, F_E, generator=gen) / 4).to(dtype)
    groups = Groups(torch.tensor(sizes), bound=max(sizes), tail=tail > 0)
    return rows, w_gate_up, w_down, groups


def _run(fn, rows, w_gate_up, w_down, groups, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (rows, w_gate_up, w_down)]
    out = fn(*leaves, groups)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("path", ["grouped_mm", "padded"])
@pytest.mark.parametrize("tail", [0, 5], ids=["dropless", "capacity-tail"])
def test_grouped_swiglu_matches_the_loop_over_experts(path, tail, monkeypatch):
    if path == "padded":  # what CUDA fp32 takes: _grouped_mm would sync and loop there
        monkeypatch.setattr(grouped, "grouped_mm_without_sync", lambda device, dtype: False)
    rows, w_gate_up, w_down, groups = _case([5, 0, 9, 3], tail)
    grad = torch.randn(rows.shape[0], H, generator=torch.Generator().manual_seed(8))
    want, want_grads = _run(loop_swiglu, rows, w_gate_up, w_down, groups, grad)
    got, got_grads = _run(grouped_swiglu, rows, w_gate_up, w_down, groups, grad)
    tol = {"rtol": 0, "atol": 0} if path == "grouped_mm" else {"rtol": 1e-6, "atol": 1e-6}  # same mm, or bmm's
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)
    if tail:  # the dropped rows: zero out, zero gradient
        assert not got[-tail:].any() and not got_grads[0][-tail:].any()


def test_bf16_under_autocast_computes_in_bf16_close_to_fp32():
    rows, w_gate_up, w_down, groups = _case([6, 2, 0, 8], 0)
    want = loop_swiglu(rows, w_gate_up, w_down, groups)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_swiglu(rows, w_gate_up, w_down, groups)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_padded_slots_put_each_group_in_its_row_and_the_tail_in_the_spare():
    groups = Groups(torch.tensor([2, 0, 3]), bound=3, tail=True)
    assert groups.slots(7).tolist() == [0, 1, 6, 7, 8, 9, 9]
    assert groups.ends().tolist() == [2, 2, 5] and groups.ends().dtype == torch.int32
