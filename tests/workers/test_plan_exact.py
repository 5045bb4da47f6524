"""Exactness on what can be counted: the planner's parameters and optimizer bytes per rank equal those of a real
DeepSpeed engine on CPU (gloo processes). Measured optimizer bytes: the fp32 master tensors the optimizer
updates (those that are not the model's own parameters) plus every per-parameter state tensor (exp_avg,
exp_avg_sq), after one step."""

from __future__ import annotations

import os
import time

import pytest

from p3d.layout.run_plan import build_plan
from p3d.planner.memory import stage_memory
from p3d.planner.shapes import layout_of

# ---- a real DeepSpeed engine, 8 gloo processes: dp2 x pp2 x tp2, ZeRO 0 then ZeRO 1, fp32


def _engine_worker(rank: int, world: int, init_method: str, cfgs, results) -> None:
    """Build p3d's pipeline and DeepSpeed engine with the trainer's own build_engine, run one step, report bytes."""
    os.environ.update(
        P3D_INIT_METHOD=init_method, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", DS_ACCELERATOR="cpu"
    )
    try:
        import logging

        import torch
        import torch.distributed as dist

        from p3d.parallel.mesh import Mesh
        from p3d.train.executors.ds_engine import build_engine
        from p3d.train.worker import init_process_group

        init_process_group(build_plan(cfgs[0], None), rank, 120)
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        for index, cfg in enumerate(cfgs):
            plan = build_plan(cfg, None)
            mesh = Mesh.from_plan(plan, rank).with_groups()
            engine, _, _ = build_engine(cfg, plan, mesh)
            gen = torch.Generator().manual_seed(0)
            b, s, v = cfg.schedule.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
            batches = [
                (torch.randint(0, v, (b, s), generator=gen), torch.randint(0, v, (b, s), generator=gen))
                for _ in range(plan.micro_batches)
            ]
            engine.train_batch(data_iter=iter(batches))  # Adam's states exist after the first step
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer doing the update
            own = {id(p) for p in engine.module.parameters()}
            master = sum(
                p.numel() * p.element_size() for g in inner.param_groups for p in g["params"] if id(p) not in own
            )
            moments = sum(
                t.numel() * t.element_size()
                for st in inner.state.values()
                for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0
            )  # exp_avg, exp_avg_sq (not the step counter)
            params = sum(p.numel() for p in engine.module.parameters())
            results.put((index, rank, mesh.pp_rank, params, master + moments))
            del engine
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        results.put(("error", rank, repr(exc)))
    finally:
        os._exit(0)  # skip atexit hooks that can block on a torn-down group


@pytest.mark.timeout(300)
def test_params_and_optimizer_bytes_match_a_deepspeed_engine(make_cfg, tmp_path):
    from tests.helpers.dist import context

    # fp32 with ZeRO 0 (torch AdamW) and ZeRO 1 (DeepSpeed's ZeRO optimizer: fp32 copy + moments / dp),
    # and bf16 with zero.stage=0, where DeepSpeed's BF16_Optimizer shards master and moments over dp anyway
    cfgs = [
        make_cfg("mesh=dp2_pp2_tp2", "zero=stage0"),
        make_cfg("mesh=dp2_pp2_tp2", "zero=stage1"),
        make_cfg("mesh=dp2_pp2_tp2", "zero=stage0", "train.dtype=bf16"),
    ]
    world = 8
    ctx = context()  # the tests' forkserver: torch and DeepSpeed imported once, not by each of the 8
    results = ctx.SimpleQueue()
    init = f"file://{tmp_path / 'store'}"  # a file rendezvous: no port to race for
    procs = [ctx.Process(target=_engine_worker, args=(r, world, init, cfgs, results)) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + 240
    while len(got) < world * len(cfgs) and time.monotonic() < deadline:
        if not results.empty():
            got.append(results.get())
            if got[-1][0] == "error":
                break
        elif not any(p.is_alive() for p in procs):
            break
        else:
            time.sleep(0.2)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    errors = [g for g in got if g[0] == "error"]
    assert not errors, errors
    assert len(got) == world * len(cfgs), f"only {len(got)} reports arrived: {got}"
    for index, cfg in enumerate(cfgs):
        predicted = stage_memory(cfg, layout_of(cfg))
        measured = {(rank, stage): (params, opt) for i, rank, stage, params, opt in got if i == index}
        expected = {
            (rank, stage): (predicted[stage].params.total, predicted[stage].optimizer_bytes) for rank, stage in measured
        }
        assert measured == expected, f"zero.stage={cfg.zero.stage} train.dtype={cfg.train.dtype.value}"
