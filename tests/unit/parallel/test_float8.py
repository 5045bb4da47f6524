"""p3d's float8 layer (p3d.parallel.tp.float8) against torchao's own emulated ``Float8Linear``: bitwise, forward and
backward, for each dense recipe, on a column- and a row-parallel layer at tp = 1 (the tp split is
tests/workers/test_float8_tp.py); the casts a step makes per linear, counted, however many micro batches; what the
conversion leaves in bf16."""

from __future__ import annotations

import pytest
import torch

from p3d.compat import torchao_internals as ao
from p3d.parallel.mesh import Mesh
from p3d.parallel.tp.float8 import Float8Matmul, convert_to_float8
from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from p3d.parallel.tp.precision import drop_weight_casts

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _torchao_twin(layer: torch.nn.Module, recipe: str) -> torch.nn.Module:
    from torchao.float8.float8_linear import Float8Linear

    out_features, in_features = layer.weight.shape
    twin = Float8Linear(in_features, out_features, bias=False, config=ao.float8_config(recipe, emulate=True))
    twin.weight = torch.nn.Parameter(layer.weight.detach().clone())
    return twin


def _layer(kind: str) -> torch.nn.Module:
    mesh = Mesh(tp=1, pp=1, dp=1)
    if kind == "column":
        return ColumnParallelLinear(64, [64, 32, 32], mesh, ["q", "k", "v"], 0.02, seed=5)
    return RowParallelLinear(96, 48, mesh, "wo", 0.02, seed=5)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_layer_is_bitwise_torchaos_float8_linear(recipe, kind):
    layer = _layer(kind)
    twin = _torchao_twin(layer, recipe)
    layer.float8 = Float8Matmul(recipe, emulate=True, group=None)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 16, layer.weight.shape[1], generator=gen) * 3).to(torch.bfloat16)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_twin = layer(ours), twin(theirs)
    grad = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(grad)
    y_twin.backward(grad)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, y_twin)
    assert torch.equal(ours.grad, theirs.grad)
    assert torch.equal(layer.weight.grad, twin.weight.grad)
    # and it is float8, not bf16: the plain layer under bf16 autocast differs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(_layer(kind)(x), y)


def test_under_cpu_autocast_the_input_is_cast_to_bf16_first():
    """torchao follows CUDA autocast only: the layer casts the input itself, so an fp32 input under CPU autocast
    computes as the bf16 input does (rowwise_with_gw_hp fails in backward otherwise: bf16 against fp32)."""
    layer = _layer("column")
    layer.float8 = Float8Matmul("rowwise_with_gw_hp", emulate=True, group=None)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.requires_grad_())
    y.float().sum().backward()
    assert torch.equal(y, _torchao_twin(layer, "rowwise_with_gw_hp")(x.detach().to(torch.bfloat16)))


# casts per linear per step with m micro batches: the weight once per distinct cast, the others per micro batch
EXPECTED = {
    "tensorwise": lambda m: {"weight": 1, "input": m, "grad_output": m},
    "rowwise": lambda m: {
        "weight": 1,
        "weight_for_grad_input": 1,
        "input": m,
        "grad_output": m,
        "grad_output_for_grad_weight": m,
        "input_for_grad_weight": m,
    },
    "rowwise_with_gw_hp": lambda m: {"weight": 1, "weight_for_grad_input": 1, "input": m, "grad_output": m},
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_weight_cast_a_step_however_many_micro_batches(recipe):
    layer = _layer("column")
    layer.float8 = Float8Matmul(recipe, emulate=True, group=None)
    for micro_batches in (1, 4):
        drop_weight_casts(layer)
        layer.float8.counts.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [layer(torch.randn(2, 16, 64)) for _ in range(micro_batches)]  # all in flight, as 1F1B's warmup
        for y in outs:
            y.float().sum().backward()
        assert dict(layer.float8.counts) == EXPECTED[recipe](micro_batches)
    drop_weight_casts(layer)
    assert not layer.float8._weights, "no float8 weight outlives its step"


def test_a_weight_written_in_place_is_cast_again():
    layer = _layer("column")
    layer.float8 = Float8Matmul("tensorwise", emulate=True, group=None)
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # an optimizer step: a new version
    assert layer.float8.counts["weight"] == 1
    assert not torch.equal(layer(x), before)
    assert layer.float8.counts["weight"] == 2


class _Head(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.proj = ColumnParallelLinear(64, [512], mesh, ["h"], 0.02, 5)


def test_conversion_leaves_the_skipped_and_the_dimensions_off_16_in_bf16():
    mesh = Mesh(tp=1, pp=1, dp=1)
    model = torch.nn.ModuleDict(
        {
            "qkv": ColumnParallelLinear(64, [64, 32, 32], mesh, ["q", "k", "v"], 0.02, 5),
            "odd": RowParallelLinear(24, 64, mesh, "o", 0.02, 5),
            "head": _Head(mesh),
        }
    )
    kept = convert_to_float8(model, "tensorwise", emulate=True, skip=(_Head,))
    assert model["qkv"].float8 is not None
    assert model["odd"].float8 is None and kept == ["odd: in 24"]
    assert model["head"].proj.float8 is None
