"""A tp-split float8 layer against the unsplit float8 layer (p3d.parallel.tp.float8): the column- and row-parallel
layers and the sequence-parallel column layer (tensorwise: gathered in float8), each dense recipe, forward and
backward, within 1e-6 (fp32 high precision: the partial sums add in another order, nothing else differs). And the
tensorwise split with per-shard amaxes (``reduce_amax=False``): it differs, by far more than the tolerance, so the
max-reduction over tp is what makes the split right (torchtitan issue 3109's NaN losses). The rowwise recipes round
their scales to powers of 2, and a power-of-2 scale only shifts a float8 value's exponent: per-shard scales there
change only the values that fall to float8's subnormals (measured: 5e-8 to 9e-7 here), so the reduction is kept
for exactness and the failure is shown on tensorwise."""

from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tp import SEED, column_shard, meshes, same_inputs

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TOL = 1e-6
SIZES, KEYS = [64, 32, 32], ["q", "k", "v"]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b).abs().max() / b.abs().max())


def _spread(t: torch.Tensor, world: int, blocks: list[int]) -> torch.Tensor:
    """``t`` with tp rank r's share of the last dim (each of ``blocks`` split over tp) scaled by 16^r: per-shard
    amaxes then differ by more than the power of 2 the rowwise recipes round their scales to."""
    factors = [torch.full((n // world,), 16.0**r) for n in blocks for r in range(world)]
    return t * torch.cat(factors)


def _case(rank, world, recipe: str, kind: str, reduce_amax: bool) -> float:
    """The largest relative difference of the split layer from the unsplit one over y, dx and dW."""
    from p3d.parallel.tp.float8 import Float8Matmul
    from p3d.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

    full_mesh, mesh = meshes(rank, world)
    sp = kind == "sp_column"
    if kind == "row":
        full = RowParallelLinear(96, 48, full_mesh, "wo", 0.1, SEED)
        shard = RowParallelLinear(96, 48, mesh, "wo", 0.1, SEED)
    else:
        full = ColumnParallelLinear(64, SIZES, full_mesh, KEYS, 0.1, SEED)
        shard = ColumnParallelLinear(64, SIZES, mesh, KEYS, 0.1, SEED, sequence_parallel=sp)
    full.float8 = Float8Matmul(recipe, emulate=True, group=None)
    shard.float8 = Float8Matmul(recipe, emulate=True, group=mesh.tp_group, reduce_amax=reduce_amax)
    k = full.weight.shape[1]
    x_full = _spread(same_inputs(2, 16, k), world, [k] if kind == "row" else [k]).requires_grad_()
    if kind == "row":
        x = x_full.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
    elif sp:
        x = x_full.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    else:
        x = x_full.detach().clone().requires_grad_()
    y_full, y = full(x_full), shard(x)
    g = _spread(same_inputs(*y_full.shape), world, [y_full.shape[-1]] if kind == "row" else SIZES)
    (y_full * g).sum().backward()
    if kind == "row":
        want_y, want_w, want_x = y_full, full.weight.grad.chunk(world, dim=1)[rank], x_full.grad.chunk(world, -1)[rank]
        (y * g).sum().backward()
    else:
        want_y = column_shard(y_full.detach(), SIZES, rank, world, dim=-1)
        want_w = column_shard(full.weight.grad, SIZES, rank, world)
        want_x = x_full.grad.chunk(world, dim=1)[rank] if sp else x_full.grad
        (y * column_shard(g, SIZES, rank, world, dim=-1)).sum().backward()
    return max(_relative(y, want_y), _relative(x.grad, want_x), _relative(shard.weight.grad, want_w))


def _check_all(rank, world):
    for recipe in RECIPES:
        for kind in ("column", "row", "sp_column"):
            exact = _case(rank, world, recipe, kind, reduce_amax=True)
            where = f"{recipe} {kind} on rank {rank}"
            assert exact <= TOL, f"{where}: the split differs from the unsplit layer by {exact:.2e}"
            if recipe == "tensorwise":
                per_shard = _case(rank, world, recipe, kind, reduce_amax=False)
                assert per_shard > 1000 * TOL, f"{where}: per-shard amaxes should differ, by {per_shard:.2e} only"


def test_float8_tp2_split_matches_unsplit_and_fails_with_per_shard_amax():
    run_distributed(_check_all, 2)
