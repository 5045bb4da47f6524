"""What the tensor-parallel layer tests share: the seed, the tolerance, a tp group of every rank, the slices of a
master weight, inputs equal on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

SEED = 7


TOL = dict(rtol=1e-5, atol=1e-6)


def meshes(rank, world):
    from p3d.parallel.mesh import Mesh

    full = Mesh(tp=1, pp=1, dp=1)
    sharded = Mesh(tp=world, pp=1, dp=1, rank=rank, tp_group=dist.group.WORLD)
    return full, sharded


def column_shard(full: torch.Tensor, sizes, rank, world, dim=0):
    """This rank's rows of a fused column-parallel tensor: each logical block split on its own."""
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in full.split(sizes, dim=dim)], dim=dim)


def same_inputs(*shape, dtype=torch.float32, high=None):
    g = torch.Generator().manual_seed(123)
    if high is not None:
        return torch.randint(0, high, shape, generator=g)
    return torch.randn(*shape, generator=g, dtype=dtype)
