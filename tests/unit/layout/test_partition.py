"""partition=cost against the FLOPs torch counts (issue 11, item 6): pp2, ``model=small`` with 4 layers (its
50k-vocabulary head and loss weigh 5.5 blocks), one micro batch of 256 tokens. Each stage's forward + backward
runs under ``torch.utils.flop_counter.FlopCounterMode`` on the real modules: the costliest stage must cost less
under ``cost`` than under ``blocks`` and ``uniform``."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from p3d.config.schema import Partition
from p3d.layout.geometry import layer_costs, padded_vocab, stage_bounds
from p3d.pipeline.specs import to_sequential
from tests.helpers.runs import typed

SEQ = 256


def stage_flops(model, bounds: list[int], ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """Forward + backward FLOPs of each stage's layers, as torch counts them, each stage on its own input (the
    previous stage's output, detached, as a pipeline stage receives it); the last stage includes the loss."""
    funcs = model._funcs
    x: torch.Tensor = ids
    flops = []
    for stage, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        inp = x.detach().requires_grad_(x.is_floating_point())
        with FlopCounterMode(display=False) as counter:
            y = inp
            for f in funcs[lo:hi]:
                y = f(y)
            if stage == len(bounds) - 2:
                model.loss_fn(y, labels).backward()
            else:
                y.backward(torch.ones_like(y))
        flops.append(counter.get_total_flops())
        x = y
    return flops


def test_the_cost_partition_lightens_the_costliest_stage():
    cfg, _ = typed("model=small", "model.n_layers=4", f"model.seq_len={SEQ}", "mesh=single")
    n = cfg.model.n_layers
    with torch.device("meta"):  # FLOPs need shapes only: no 50k x 768 tables to fill, attention counted too
        model = to_sequential(cfg.model, padded_vocab(cfg.model.vocab_size, 1), cfg.train.seed)
    ids = labels = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    counted = {p: stage_flops(model, stage_bounds(n, 2, p, cfg.model), ids, labels) for p in Partition}
    print({p.value: [f"{f / 1e9:.1f} GFLOP" for f in flops] for p, flops in counted.items()})
    cost = max(counted[Partition.cost])
    assert cost < max(counted[Partition.blocks]) and cost < max(counted[Partition.uniform]), counted
    # what the partition balances (layer_costs, per token) is what torch counts
    predicted = sum(layer_costs(cfg.model)) * SEQ
    for p, flops in counted.items():
        assert abs(sum(flops) - predicted) < 1e-3 * predicted, (p, flops, predicted)
