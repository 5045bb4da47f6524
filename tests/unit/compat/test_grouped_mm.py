"""The touchpoints of ``torch._grouped_mm`` that p3d.compat.grouped_mm relies on, checked on the installed torch:
the op is there, takes (R, K) x (G, K, N) with int32 group ends, computes each group by its own matrix (bitwise the
per-group mm in fp32 on CPU), differentiates in both operands (an empty group's matrix gets a zero gradient),
and refuses strides off the 16-byte rule that ``grouped_mm_fits`` checks first."""

from __future__ import annotations

import pytest
import torch

from p3d.compat.grouped_mm import grouped_mm, grouped_mm_fits, grouped_mm_without_sync


def _operands(dtype, k=8, n=16, sizes=(3, 0, 5), tail=2):
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(sum(sizes) + tail, k, generator=gen).to(dtype).requires_grad_()
    weights_t = torch.randn(len(sizes), k, n, generator=gen).to(dtype).requires_grad_()
    ends = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return rows, weights_t, ends, sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_is_each_group_by_its_matrix_and_differentiable(dtype):
    rows, weights_t, ends, sizes = _operands(dtype)
    out = grouped_mm(rows, weights_t, ends)
    assert out.shape == (rows.shape[0], weights_t.shape[2]) and out.dtype == dtype
    start = 0
    for g, size in enumerate(sizes):
        want = rows[start : start + size] @ weights_t[g]
        tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(out[start : start + size], want, **tol)
        start += size
    out[:start].sum().backward()
    assert rows.grad is not None and weights_t.grad is not None
    assert not weights_t.grad[1].any(), "an empty group's matrix must get no gradient"


def test_grouped_mm_refuses_strides_off_16_bytes_and_fits_says_so():
    rows, weights_t, ends, _ = _operands(torch.float32, k=6)
    assert not grouped_mm_fits(torch.float32, 6)
    with pytest.raises(RuntimeError, match="16 bytes"):
        grouped_mm(rows, weights_t, ends)
    assert (
        grouped_mm_fits(torch.float32, 8, 16)
        and grouped_mm_fits(torch.bfloat16, 8)
        and not grouped_mm_fits(torch.bfloat16, 4)
    )


def test_without_sync_on_cpu_in_every_float_dtype_and_never_elsewhere_by_default():
    cpu = torch.device("cpu")
    assert all(grouped_mm_without_sync(cpu, d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert not grouped_mm_without_sync(torch.device("meta"), torch.bfloat16)
