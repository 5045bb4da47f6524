"""The bias of a column-parallel layer, split as its output is (Qwen2's q, k and v biases).

A module of its own, added to the layer's output, so that the layers of p3d.parallel.tp.layers stay bias-free:
y = x A + b with A = [A_1 ... A_p] split by columns and b = [b_1 ... b_p] likewise, rank r adds b_r to its X A_r.
Its gradient is the sum over the tokens of the output's gradient on this rank's columns: complete on every rank
(the column-parallel output is the whole sequence, also with sequence parallelism), so no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from p3d.parallel.tp.layers import mark_sharded, on_meta


class ColumnParallelBias(nn.Module):
    """``bias`` (sum(out_features) / tp,): the r-th slice of each fused block's bias (q | k | v), as
    ColumnParallelLinear's weight rows, zero at init (as transformers initialises linear biases), so every mesh
    starts identical. ``shard_spec`` is the weight's: rows of each block split over tp."""

    def __init__(self, out_features: Sequence[int], mesh):
        super().__init__()
        tp = mesh.tp
        if any(o % tp for o in out_features):
            raise ValueError(f"out_features {list(out_features)} not divisible by tp={tp}")
        self.blocks = list(out_features)
        local = sum(out_features) // tp
        self.bias = mark_sharded(nn.Parameter(torch.empty(local) if on_meta() else torch.zeros(local)))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.bias.to(y.dtype)  # y (b, s, sum(out)/tp); under bf16 autocast the bias follows y

    def shard_spec(self) -> dict:
        return {"kind": "rows", "blocks": list(self.blocks), "padded": list(self.blocks)}
