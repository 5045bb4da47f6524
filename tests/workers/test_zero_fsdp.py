"""ZeRO-2 and ZeRO-3 (FSDP2 over dp, p3d.parallel.zero.fsdp) on the torch executor, in gloo worker processes.

- Parity: each case trains STEPS fp32 steps of model=tiny (clipping on, every step) and matches the single-process
  run's loss and global gradient norm within 1e-5 relative, and its held-out loss after the last step.
- Reductions: FSDP2 reduce-scatters each unit's gradients once per step, not once per micro batch (counted by
  wrapping ``torch.distributed.reduce_scatter_single``, the call FSDP2 makes); ZeRO-2 gathers each unit's weights
  once per step, ZeRO-3 m + 1 times (each micro batch's forward, and the first backward).
- Model-state bytes: counted from the live tensors of each rank (its pieces of the parameters, gradients and Adam
  moments, after the step's reduction): at most 1/dp of the unsharded run's, and the planner's figure within 2%.
"""

from __future__ import annotations

import functools
import json

import pytest

from p3d.train.reference import reference_run
from tests.helpers.dist import run_distributed
from tests.helpers.runs import typed
from tests.helpers.tiers import with_slow

STEPS = 10
RTOL = 1e-5
CLIP = 0.5  # the tiny model's gradient norms are about 1.7-2.3: clipping fires every step
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=2", f"train.grad_clip={CLIP}", f"train.eval_every={STEPS}")

# case -> (overrides, processes)
CASES = {
    "zero3-dp2_pp2-1f1b": (["mesh=dp2_pp2", "zero=stage3"], 4),
    "zero2-dp2_pp2-1f1b": (["mesh=dp2_pp2", "zero=stage2"], 4),
    "zero2-dp2": (["mesh=dp2", "zero=stage2"], 2),
    "zero3-dp2": (["mesh=dp2", "zero=stage3"], 2),
    "zero3-dp2_pp2_tp2-interleaved": (
        ["mesh=dp2_pp2_tp2", "zero=stage3", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"],
        8,
    ),
    "zero2-dp2_pp2-zbv": (["mesh=dp2_pp2", "zero=stage2", "schedule.pipeline=zbv"], 4),
    "zero3-dp2_pp2-zbv": (["mesh=dp2_pp2", "zero=stage3", "schedule.pipeline=zbv"], 4),
    "zero3-dp2_pp2-dualpipev": (["mesh=dp2_pp2", "zero=stage3", "schedule.pipeline=dualpipev"], 4),
    "zero3-dp2_pp2_tp2-interleaved_zero_bubble": (
        ["mesh=dp2_pp2_tp2", "zero=stage3", "schedule.pipeline=interleaved_zero_bubble", "schedule.virtual_stages=2"],
        8,
    ),
    "zero3-dp2_pp2_tp2-sp-selective": (
        ["mesh=dp2_pp2_tp2", "zero=stage3", "schedule.sequence_parallel=true", "schedule.recompute=selective"],
        8,
    ),
    "zero3-dp2_pp2-tied-interleaved": (
        ["mesh=dp2_pp2", "zero=stage3", "model.tie_embeddings=true", "schedule.pipeline=interleaved_1f1b"],
        4,
    ),
    "zero2-dp2_pp2-dualpipev": (["mesh=dp2_pp2", "zero=stage2", "schedule.pipeline=dualpipev"], 4),
    "zero2-dp2_pp2-interleaved_zero_bubble": (
        ["mesh=dp2_pp2", "zero=stage2", "schedule.pipeline=interleaved_zero_bubble"],
        4,
    ),
    "zero3-dp2_pp2-gpipe": (["mesh=dp2_pp2", "zero=stage3", "schedule.pipeline=gpipe"], 4),
    "zero3-dp4-hsdp2": (["mesh=dp4", "zero=stage3", "zero.shard_size=2"], 4),
    "zero3-dp2_pp2-recompute": (["mesh=dp2_pp2", "zero=stage3", "schedule=recompute"], 4),
}
MODEL_KEYS = ("model.",)
# make test keeps zero3-dp2_pp2-1f1b (stage 3, a pipeline, the executor switch) and zero3-dp2_pp2-zbv (the I/W
# split on gathered weights); the other stages and schedules are in the slow tier
FAST = ("zero3-dp2_pp2-1f1b", "zero3-dp2_pp2-zbv")
SLOW = tuple(c for c in CASES if c not in FAST)


@functools.cache
def reference(model_overrides: tuple[str, ...]) -> list[dict]:
    cfg, _ = typed("mesh=single", *COMMON, *model_overrides)
    return reference_run(cfg)


def _live_model_state_bytes(pipe) -> int:
    """This rank's bytes of parameters, gradients and Adam moments: the local pieces where they are sharded."""
    from p3d.parallel.zero.fsdp import local

    total = 0
    for p in pipe.params:
        for t in (p, p.grad, *pipe.optimizer.state.get(p, {}).values()):
            if t is not None and t.ndim > 0:  # Adam's step count is a scalar
                piece = local(t)
                total += piece.numel() * piece.element_size()
    return total


def _train(rank, world, overrides, out_path):
    import torch.distributed as dist

    from p3d.data.loader import global_batches, validation_batches
    from p3d.layout.schedule_rules import chunks_per_rank
    from p3d.parallel.mesh import Mesh
    from p3d.train.executors.torch_pipeline import TorchPipeline

    cfg, plan = typed(*overrides)
    mesh = Mesh.from_plan(plan, rank).with_groups()
    pipe = TorchPipeline(cfg, plan, mesh, cfg.schedule.pipeline.value, chunks_per_rank(cfg))
    counts = {"reduce_scatter": 0, "all_gather": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    dist.reduce_scatter_single = counted("reduce_scatter", dist.reduce_scatter_single)
    dist.all_gather_single = counted("all_gather", dist.all_gather_single)
    from p3d.train.timing import StepClocks

    pipe.clocks = StepClocks()  # as p3d-train runs it: dp_comm_s's clocks on (p3d.compat.dp_collectives)
    state_bytes: list[int] = []
    pipe.before_update = lambda grads, loss: state_bytes.append(_live_model_state_bytes(pipe))
    batches = global_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size, cfg.train.seed)
    rows, per_step = [], []
    for step in range(1, STEPS + 1):
        lr = pipe.get_lr()
        before = dict(counts)
        loss, norm = pipe.train_step(next(batches))
        per_step.append({k: counts[k] - before[k] for k in counts})
        assert not pipe.overflow
        rows.append({"step": step, "loss": loss, "grad_norm": norm, "lr": lr})
    val = validation_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size, cfg.train.eval_batches)
    rows[-1]["val_loss"] = sum(pipe.eval_step(b) for b in val) / len(val)
    from p3d.model.llama import TransformerBlock

    blocks = [m for m in pipe.module.modules() if isinstance(m, TransformerBlock)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    # FSDP units with parameters: each block, and each chunk that holds more than blocks (the ends)
    units = len(blocks) + sum(any(id(p) not in in_blocks for p in c.parameters()) for c in pipe.chunks)
    result = {
        "rows": rows,
        "per_step": per_step,
        "units": units,
        "m": pipe.m,
        "state_bytes": state_bytes[-1],
        "dp_comm_s": sum(pipe.clocks.dp_comm.durations()),
        "unsharded_numel": sum(p.numel() for p in pipe.params),  # a DTensor's numel is the whole tensor's
        "planned_bytes": planned_state_bytes(cfg, plan, mesh.pp_rank),
    }
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)


def planned_state_bytes(cfg, plan, pp_rank: int) -> float:
    """p3d-plan's model-state bytes of this pp rank (parameters, gradients, Adam moments: the resident shards)."""
    from p3d.planner.memory import stage_memory
    from p3d.planner.shapes import layout_of_run_plan

    s = stage_memory(cfg, layout_of_run_plan(cfg, plan))[pp_rank]
    return s.params_bytes + s.grads_bytes + s.optimizer_bytes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", with_slow(CASES, SLOW))
def test_zero_matches_unsharded(case, tmp_path):
    overrides, world = CASES[case]
    out = tmp_path / "rows.json"
    run_distributed(_train, world, (*COMMON, *overrides), str(out), timeout=540)
    results = [json.loads((tmp_path / f"rows.json.{r}").read_text()) for r in range(world)]
    got = results[0]["rows"]
    ref = reference(tuple(o for o in overrides if o.startswith(MODEL_KEYS)))
    assert [g["step"] for g in got] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > CLIP for r in ref), "clipping must be exercised"
    for r, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), f"step {r['step']} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL), f"step {r['step']} grad norm"
        assert g["lr"] == pytest.approx(r["lr"], rel=1e-12), f"step {r['step']} lr"
    assert got[-1]["loss"] < got[0]["loss"]
    assert got[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=RTOL), "held-out loss after the last step"
    stage = 3 if "zero=stage3" in overrides else 2
    pieces = 2  # dp2, or dp4 in shard groups of 2 (HSDP)
    for res in results:
        assert res["dp_comm_s"] > 0, "the dp collectives were timed"
        unsharded = 16 * res["unsharded_numel"]  # fp32 parameter, gradient, two Adam moments
        assert res["state_bytes"] <= unsharded / pieces * 1.02, (res["state_bytes"], unsharded)
        assert res["state_bytes"] == pytest.approx(res["planned_bytes"], rel=0.02)
        units = res["units"]
        for step in res["per_step"][1:]:  # step 1 also runs PipelineStage's shape inference
            assert step["reduce_scatter"] == units, (res["per_step"], units)  # once per unit per step, not per m
            # ZeRO-2: each unit gathered once a step; ZeRO-3: for each micro batch's forward, and once for the
            # backward (it then stays gathered until the step's reduction: PipelineStage's no-sync backward)
            gathers = 1 if stage == 2 else res["m"] + 1
            assert step["all_gather"] == gathers * units, (res["per_step"], units)
