"""ZeRO-2/3 under ``train.fp8=tensorwise``: the float8 layers' weights all-gathered in float8 (docs/precision.md).

FSDP2 gathers each unit's weights for every forward (ZeRO-3: every micro batch) in the dtype its policy says
(bf16); a float8 layer would then cast the gathered bf16 copy. Gathered in float8 instead, half the bytes travel
and the weight arrives cast: each rank casts its fp32 shard (p3d.compat.fsdp_float8.Float8GatherWeight) with a scale
all shards share, the whole weight's, which the step's float8 casts without ZeRO would use too: its amax is the max
over the dp x cp holders of the shards (the whole tp-local weight) and over tp (the layer's tp-reduced weight amax,
p3d.parallel.tp.float8). So ZeRO-3's float8 weights are bitwise those of the run without ZeRO
(tests/workers/test_float8_zero.py). The scales are computed once a step, as it starts: after the optimizer step
and after a checkpoint's load, with one all-reduce over dp x cp and one over tp for all the weights together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from p3d.compat import torchao_internals as ao
from p3d.compat.fsdp_float8 import Float8GatherWeight, gathered_shard, hp_tensor


def gather_in_float8(chunks: Sequence[nn.Module]) -> list[Any]:
    """Wrap the weight of every tensorwise float8 layer of ``chunks`` so that FSDP2 gathers it in float8; before
    ``fully_shard``. Returns the layers, in a fixed order (every rank of a stage lists the same ones)."""
    layers = []
    for chunk in chunks:
        for m in chunk.modules():
            mm = getattr(m, "float8", None)
            if mm is None or mm.casts["weight"].axis is not None:
                continue
            p: Any = m.weight
            wrapped = nn.Parameter(Float8GatherWeight(p.data, mm.mm_config, mm.casts["weight"]), p.requires_grad)
            for attr, value in vars(p).items():  # the markers (model_parallel, ...), which fully_shard keeps
                setattr(wrapped, attr, value)
            m.weight = wrapped
            layers.append(m)
    return layers


@torch.no_grad()
def precompute_scales(layers: list[Any], holders, tp_group) -> None:
    """Give every layer's weight shard the scale of its whole weight for the gathers of the step to come: the amax
    of each shard, max-reduced over the dp x cp ``holders`` and over ``tp_group``, one collective each."""
    if not layers:
        return
    shards: list[Any] = [gathered_shard(m.weight) for m in layers]
    amax = torch.stack([hp_tensor(s).abs().max() if s.numel() else hp_tensor(s).new_zeros(()) for s in shards])
    for group in (holders, tp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scales = ao.amax_to_scale(amax, layers[0].float8.casts["weight"])
    for shard, scale in zip(shards, scales):
        shard.set_scale(scale)
