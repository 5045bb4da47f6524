"""Loss parity of the torch pipeline schedules (p3d.train.torch_pipe) with the single-process run.

Each case runs ``TorchPipeline`` in gloo worker processes (model=tiny, fp32, STEPS steps, m = 8 micro batches
per replica, ``train.grad_clip`` small enough that clipping fires every step) and compares the per-step loss
and global gradient norm with ``reference_run`` (the ``to_sequential`` twin, plain torch loop, same data, same
seeded init). Tolerance: 1e-5 relative (fp32 reduction order; the spike measured about 1e-7).
"""

from __future__ import annotations

import functools
import json

import pytest

from p3d.train.reference import reference_run
from tests.conftest import typed
from tests.dist import run_distributed

pytestmark = pytest.mark.procs  # every test here starts processes

STEPS = 4
RTOL = 1e-5
CLIP = 0.5  # the tiny model's first gradient norms are about 1.7-2.3: clipping fires
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=2", f"train.grad_clip={CLIP}")

# case -> (mesh overrides, schedule, virtual stages, processes, model overrides)
CASES = {
    "interleaved_1f1b-pp2-v2": (["mesh=pp2"], "interleaved_1f1b", 2, 2, []),
    "interleaved_1f1b-pp2-v2-tied": (["mesh=pp2"], "interleaved_1f1b", 2, 2, ["model.tie_embeddings=true"]),
    "zbv-pp2": (["mesh=pp2"], "zbv", 2, 2, []),
    "zbv-pp2-tied": (["mesh=pp2"], "zbv", 2, 2, ["model.tie_embeddings=true"]),
    "interleaved_zero_bubble-pp2-v2": (["mesh=pp2"], "interleaved_zero_bubble", 2, 2, []),
    "interleaved_1f1b-tp2_pp2-v2": (["mesh=tp2_pp2"], "interleaved_1f1b", 2, 4, []),
    "interleaved_1f1b-dp2_pp2-v2": (["mesh=dp2_pp2"], "interleaved_1f1b", 2, 4, []),
}


@functools.cache
def reference(model_overrides: tuple[str, ...]) -> list[dict]:
    cfg, _ = typed("mesh=single", *COMMON, *model_overrides)
    return reference_run(cfg)


def _train(rank, world, overrides, schedule, v, out_path):
    from p3d.data.loader import global_batches
    from p3d.dist.mesh import Mesh
    from p3d.train.torch_pipe import TorchPipeline

    cfg, plan = typed(*overrides)
    mesh = Mesh.from_plan(plan, rank).with_groups()
    pipe = TorchPipeline(cfg, plan, mesh, schedule, v)
    batches = global_batches(cfg.data, cfg.model.seq_len, cfg.schedule.global_batch_size, cfg.train.seed)
    rows = []
    for step in range(1, STEPS + 1):
        lr = pipe.get_lr()
        loss, norm = pipe.train_step(next(batches))
        assert not pipe.overflow
        rows.append({"step": step, "loss": loss, "grad_norm": norm, "lr": lr})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "bounds": pipe.bounds, "chunks": pipe.chunk_ids}, f)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_pipeline_matches_unsharded(case, tmp_path):
    mesh, schedule, v, world, model = CASES[case]
    out = tmp_path / "rows.json"
    run_distributed(_train, world, (*COMMON, *mesh, *model), schedule, v, str(out), timeout=540)
    got = json.loads(out.read_text())["rows"]
    ref = reference(tuple(model))
    assert [g["step"] for g in got] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > CLIP for r in ref), "clipping must be exercised"
    for r, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), f"step {r['step']} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL), f"step {r['step']} grad norm"
        assert g["lr"] == pytest.approx(r["lr"], rel=1e-12), f"step {r['step']} lr"
    assert got[-1]["loss"] < got[0]["loss"]  # it learns
