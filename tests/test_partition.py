"""partition=cost against the FLOPs torch counts (issue 11, item 6): pp2, ``model=small`` with 4 layers (its
50k-vocabulary head and loss weigh 5.5 blocks), one micro batch of 256 tokens. By count (blocks, uniform) the
last stage carries the head on top of its blocks; by cost the head gets the last stage to itself. Each stage's
forward + backward runs under ``torch.utils.flop_counter.FlopCounterMode`` on the real modules: the costliest
stage, which sets the pace of the pipeline, must cost less under ``cost`` than under ``blocks`` and ``uniform``.

The measured idle share (the metric ``bubble``, which counts the first stage's wait for the head at the end of
each step) is tested on a model shaped like that case at an eighth of its FLOPs, so that a step takes about a
second here; on the case itself it is a benchmark, ``bench/partition.py``."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from p3d.config.schema import Partition
from p3d.layout.geometry import layer_costs, padded_vocab, stage_bounds
from p3d.parallel.pipeline.specs import to_sequential
from p3d.train.metrics import read_metrics
from tests.conftest import p3d_train, typed

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


# model=small's 4-layer case in miniature: h = 256, 4 blocks, an 18k-word head weighing 5.4 blocks at s = 128
HEAVY_HEAD = (
    "model.hidden_size=256", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden_size=704",
    "model.vocab_size=18432", "model.seq_len=128", "mesh=pp2", "schedule.micro_batch_size=1",
    "schedule.global_batch_size=16", "train.steps=4", "train.save_every=0",
)  # fmt: skip


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_the_cost_partition_idles_less_than_uniform(tmp_path):
    """pp2, 16 micro batches: uniform puts [embed, 3 blocks | block, norm, head] (3 against 6.4 blocks of FLOPs),
    cost [embed, 4 blocks | norm, head] (4 against 5.4); the measured idle share of the steps after the first
    must be lower under cost, and its stages' compute seconds closer to equal."""
    measured = {}
    for partition in ("uniform", "cost"):
        run = tmp_path / partition
        result = p3d_train(*HEAVY_HEAD, f"schedule.partition={partition}", f"run.dir={run}", timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        records = read_metrics(run)[1:]
        ratio = statistics.median(max(r["stage_compute_s"]) / min(r["stage_compute_s"]) for r in records)
        measured[partition] = (statistics.median(r["bubble"] for r in records), ratio)
    print({p: f"idle {idle:.3f}, busier / other stage compute {ratio:.2f}" for p, (idle, ratio) in measured.items()})
    assert measured["cost"][0] < measured["uniform"][0], measured
    assert measured["cost"][1] < measured["uniform"][1], measured
