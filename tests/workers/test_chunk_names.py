"""A ChunkModule's parameter names are DeepSpeed's PipelineModule's (pp2 gloo workers), so checkpoints are cut by
the same names under both executors."""

from __future__ import annotations

import pytest
import torch

from p3d.layout.geometry import stage_bounds
from p3d.parallel.mesh import Mesh
from p3d.pipeline.chunks import ChunkModule
from p3d.pipeline.specs import build_layer_specs
from tests.helpers.dist import run_distributed
from tests.helpers.runs import typed


def _names_as_deepspeed(rank, world, tie):
    """DeepSpeed's PipelineModule (the trainer's build_pipeline) on pp2 and a ChunkModule of the same layers:
    the same parameter names and values; and the p*v = 4 chunk cut names the same set over the pipeline."""
    import deepspeed
    import torch.distributed as dist

    from p3d.train.executors.ds_engine import build_pipeline

    deepspeed.init_distributed("gloo")
    cfg, plan = typed("mesh=pp2", f"model.tie_embeddings={str(tie).lower()}")
    mesh = Mesh.from_plan(plan, rank).with_groups()
    ds = dict(build_pipeline(cfg, plan, mesh).named_parameters())
    specs = build_layer_specs(cfg.model, plan.padded_vocab_size, mesh, cfg.train.seed)
    lo, hi = plan.stage_bounds[rank], plan.stage_bounds[rank + 1]
    ours = dict(ChunkModule(specs, lo, hi).named_parameters())
    assert sorted(ours) == sorted(ds), (sorted(ours), sorted(ds))
    for name, p in ds.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, sorted(ds))
    bounds = stage_bounds(cfg.model.n_layers, 4, cfg.schedule.partition, cfg.model)
    cut = {n for c in range(4) for n, _ in ChunkModule(specs, bounds[c], bounds[c + 1]).named_parameters()}
    assert cut == {n for names in everyone for n in names}


@pytest.mark.parametrize("tie", [False, True])
def test_chunk_names_are_deepspeeds(tie):
    run_distributed(_names_as_deepspeed, 2, tie, timeout=180)
