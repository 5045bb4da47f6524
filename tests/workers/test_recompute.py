"""Full recompute under the pipeline engine (gloo workers): every block runs again in backward, and without
recompute each runs once."""

from __future__ import annotations

import torch

from p3d.parallel.mesh import Mesh
from tests.helpers.dist import run_distributed
from tests.helpers.runs import typed


def _count_block_forwards(rank, world, recompute, counts):
    import deepspeed

    from p3d.model.llama import TransformerBlock
    from p3d.train.executors.deepspeed_config import deepspeed_config
    from p3d.train.executors.ds_engine import build_pipeline
    from p3d.train.optim import build_optimizer

    deepspeed.init_distributed("gloo")
    over = ["mesh=pp2" if world == 2 else "mesh=single", "train.steps=1", "model.n_layers=2"]
    cfg, plan = typed(*over, *(["schedule=recompute"] if recompute else []))
    mesh = Mesh.from_plan(plan, rank).with_groups()
    module = build_pipeline(cfg, plan, mesh)
    assert module.parts == plan.stage_bounds
    calls = []
    for m in module.modules():
        if isinstance(m, TransformerBlock):
            m.register_forward_hook(lambda *_: calls.append(1))
    opt, sched = build_optimizer(module, cfg.train, mesh)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=opt, lr_scheduler=sched, config=deepspeed_config(cfg, plan)
    )
    x = torch.randint(0, 257, (cfg.schedule.micro_batch_size, cfg.model.seq_len))
    engine.train_batch(data_iter=iter([(x, x)] * plan.micro_batches))
    blocks_here = sum(isinstance(m, TransformerBlock) for m in module.modules())
    assert blocks_here == 1
    assert len(calls) == plan.micro_batches * (2 if recompute else 1), (recompute, len(calls))


def test_full_recompute_reruns_every_block_in_backward():
    run_distributed(_count_block_forwards, 2, True, None, timeout=180)


def test_no_recompute_runs_each_block_once():
    run_distributed(_count_block_forwards, 2, False, None, timeout=180)
