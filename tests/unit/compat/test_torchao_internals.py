"""The touchpoints of torchao that p3d.compat.torchao_internals relies on, checked on the installed torchao: the
pinned version, the recipes' six casts as p3d reads them, the amax and the cast (a ``Float8TrainingTensor`` whose
payload and scale dequantise to the input within e4m3's precision, and rebuild from a payload), the emulated scaled
GEMM (the dequantised fp32 mm, in the first operand's dtype), and the MXFP8 grouped GEMM's EMULATED kernel on CPU."""

from __future__ import annotations

import pytest
import torch

from p3d.compat import torchao_internals as ao


def test_the_pinned_torchao_is_installed():
    assert ao.torchao_version() == ao.PINNED


def test_the_recipes_casts_as_p3d_reads_them():
    tw = ao.recipe_casts(ao.float8_config("tensorwise", emulate=True))
    assert {c.axis for c in tw.values()} == {None}
    assert tw["input"].dtype == tw["weight"].dtype == torch.float8_e4m3fn
    assert tw["grad_output"].dtype == torch.float8_e5m2 and not tw["input"].power_of_2
    rw = ao.recipe_casts(ao.float8_config("rowwise", emulate=True))
    assert rw["input"].axis == -1 and rw["weight"].axis == 0 and rw["input_for_grad_weight"].axis == 0
    assert rw["grad_output"].dtype == torch.float8_e4m3fn and rw["weight"].power_of_2
    hp = ao.recipe_casts(ao.float8_config("rowwise_with_gw_hp", emulate=True))
    assert hp["input_for_grad_weight"].dtype is None and hp["grad_output_for_grad_weight"].dtype is None
    assert hp["weight_for_grad_input"].axis is None  # tensorwise for the input gradient
    assert ao.float8_config("tensorwise", emulate=False).emulate is False


def test_cast_payload_and_emulated_mm():
    config = ao.float8_config("tensorwise", emulate=True)
    casts, mm = ao.recipe_casts(config), ao.linear_mm_config(config)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    w_t = torch.randn(64, 16, generator=gen)
    amax = ao.amax(x, casts["input"])
    assert amax.shape == () and amax == x.abs().max()
    xq, wq = (
        ao.to_float8(x, amax, casts["input"], mm),
        ao.to_float8(w_t, ao.amax(w_t, casts["weight"]), casts["weight"], mm),
    )
    assert ao.is_float8(xq) and not ao.is_float8(x)
    data, scale = ao.payload(xq)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    torch.testing.assert_close(data.float() / scale, x.float(), rtol=0.07, atol=1e-2)  # e4m3: 3 mantissa bits
    rebuilt = ao.from_payload(data.view(torch.uint8).view(data.dtype), scale, x.dtype, mm, casts["input"].role)
    y = torch.mm(xq, wq)
    assert y.dtype == torch.bfloat16
    assert torch.equal(torch.mm(rebuilt, wq), y)
    assert torch.equal(y, torch.mm(data.float() / scale, wq._data.float() / wq._scale).to(torch.bfloat16))
    rows = ao.amax(x, ao.recipe_casts(ao.float8_config("rowwise", True))["input"])
    assert rows.shape == (32, 1)


def test_mxfp8_grouped_mm_runs_emulated_on_cpu_and_is_differentiable():
    gen = torch.Generator().manual_seed(1)
    sizes = [5, 0, 40, 19]  # padded to 32 rows each inside
    ends = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    x = torch.randn(sum(sizes), 64, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(4, 96, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    y = ao.mxfp8_grouped_mm(x, w.transpose(1, 2), ends, emulate=True)
    ref = torch._grouped_mm(x.detach(), w.detach().transpose(1, 2), offs=ends)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    rel = float((y.detach().float() - ref.float()).norm() / ref.float().norm())
    assert 1e-3 < rel < 0.08, rel  # MXFP8, not bf16, and close
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None and not w.grad[1].any()  # the empty group: no gradient


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_linear_mm_config_is_float8_linears(recipe):
    from torchao.float8.float8_linear import Float8Linear

    config = ao.float8_config(recipe, emulate=True)
    assert ao.linear_mm_config(config) == Float8Linear(8, 8, bias=False, config=config).linear_mm_config
