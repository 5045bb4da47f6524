"""``schedule.pipeline`` as a config override of a real run (p3d-train through the CLI, real worker processes).

- A run under a torch schedule (interleaved_1f1b v2 on pp2) matches the single-process run (``reference_run``):
  per-step loss and grad norm within 1e-5 relative, lr equal, clipping active (train.grad_clip=1.0, norms ~2).
- Resume across schedules: 3 steps under one schedule, 3 more under another from its checkpoint, against the
  uninterrupted single-process curve within 1e-5 (``train.decay=constant`` after a 2-step warmup, so that the
  first segment's ``train.steps=3`` does not change the LR schedule the reference runs).
"""

from __future__ import annotations

import functools

import pytest
import torch

from p3d.checkpoint import find as checkpoint
from p3d.layout.geometry import schedule_bubble
from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.runs import assert_follows_curve, p3d_train, typed
from tests.helpers.tiers import with_slow

RTOL = 1e-5
COMMON = ("train.warmup_steps=2", "train.decay=constant")
I2 = ("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2")
INTERLEAVED = ("mesh=pp2", *I2)
ZBV = ("mesh=pp2", "schedule.pipeline=zbv", "schedule.virtual_stages=2")
DEEPSPEED = ("mesh=pp2", "schedule.pipeline=1f1b")  # said on a resume too: it keeps the resumed run's schedule


@functools.cache
def reference(steps: int, *model: str) -> list[dict]:
    cfg, _ = typed("mesh=single", f"train.steps={steps}", *COMMON, *model)
    return reference_run(cfg)


def _out(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def _assert_matches(got: list[dict], ref: list[dict], norm_rtol: float = RTOL) -> None:
    assert_follows_curve(got, ref, RTOL, norm_rtol=norm_rtol, lr=True)


@pytest.mark.timeout(400)
def test_interleaved_run_matches_single_process(tmp_path):
    """p3d-train mesh=pp2 schedule.pipeline=interleaved_1f1b schedule.virtual_stages=2: 6 steps, each within 1e-5
    of the reference; the metrics carry the schedule's theory bubble and a measured one; the checkpoint is cut
    into the p * v = 4 chunks by layer name."""
    proc = p3d_train(f"run.dir={tmp_path}", "train.steps=6", *COMMON, *INTERLEAVED, timeout=360)
    assert proc.returncode == 0, _out(proc)
    got = read_metrics(tmp_path)
    _assert_matches(got, reference(6))
    m = 8  # 16 sequences / (2 per micro batch x dp 1)
    assert got[0]["bubble_theory"] == pytest.approx(schedule_bubble("interleaved_1f1b", 2, m, 2))
    assert all(0.0 <= r["bubble"] < 1.0 for r in got) and any(r["bubble"] > 0 for r in got)
    assert all(len(r["stage_compute_s"]) == 2 and min(r["stage_compute_s"]) > 0 for r in got)
    meta = checkpoint.verify(checkpoint.step_dir(tmp_path, 6))
    assert meta["pipeline"] == "interleaved_1f1b" and meta["stage_bounds"] == [0, 2, 3, 4, 7]
    assert sorted(f for f in meta["files"] if f.startswith("model/")) == [
        f"model/pp{c}_tp0_dp0.safetensors" for c in range(4)
    ]


RESUMES = {
    "1f1b-to-interleaved_1f1b": (DEEPSPEED, INTERLEAVED, ()),
    "interleaved_1f1b-to-1f1b": (INTERLEAVED, DEEPSPEED, ()),
    "1f1b-to-zbv-tied": (DEEPSPEED, ZBV, ("model.tie_embeddings=true",)),  # V placement: one shared table
    # ZeRO-1 on both sides: DeepSpeed's partitioned fragments in, torch ZeroRedundancyOptimizer's whole-parameter
    # states per owner out, and back into DeepSpeed on another mesh
    "1f1b-zero1-to-interleaved_1f1b-zero1": (
        ("mesh=dp2_pp2", "zero=stage1"),
        ("mesh=dp2_pp2", "zero=stage1", *I2),
        (),
    ),
    "interleaved_1f1b-zero1-to-1f1b-pp2": (("mesh=dp2_pp2", "zero=stage1", *I2), (*DEEPSPEED, "zero=stage0"), ()),
}


# slow tier (20 + 17 + 9 s): kept: the chain (1f1b -> interleaved -> zbv), ZeRO-1 from DeepSpeed into torch's,
# 1f1b -> zbv tied
SLOW_RESUMES = ("1f1b-to-interleaved_1f1b", "interleaved_1f1b-to-1f1b", "interleaved_1f1b-zero1-to-1f1b-pp2")
# and (40 s): 1f1b-to-zbv-tied (DeepSpeed to the torch executor, kept in 1f1b-zero1-to-interleaved_1f1b-zero1 and
# in the resume chain below, which ends on zbv)
SLOW_RESUMES += ("1f1b-to-zbv-tied",)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", with_slow(RESUMES, SLOW_RESUMES))
def test_resume_across_schedules_continues_the_curve(case, tmp_path):
    first, second, model = RESUMES[case]
    proc = p3d_train(f"run.dir={tmp_path}", "train.steps=3", *COMMON, *model, *first, timeout=300)
    assert proc.returncode == 0, _out(proc)
    if "zero=stage1" in first and I2[0] in first:  # torch's ZeRO-1: each parameter's states written by its owner
        _assert_owners_write_whole_states(checkpoint.step_dir(tmp_path, 3))
    proc = p3d_train(f"run.dir={tmp_path}", "train.steps=6", "train.resume=auto", *COMMON, *model, *second, timeout=300)
    assert proc.returncode == 0, _out(proc)
    assert "schedule.pipeline:" in proc.stdout, _out(proc)  # the launcher names the change
    # the DeepSpeed JSON describes the engine of a 1f1b run only: written for it, removed for a torch schedule
    torch_schedule = any(o.startswith("schedule.pipeline=") and o != "schedule.pipeline=1f1b" for o in second)
    assert (tmp_path / "deepspeed_config.json").exists() != torch_schedule
    _assert_matches(read_metrics(tmp_path), reference(6, *model))


def _assert_owners_write_whole_states(ckpt) -> None:
    """Every chunk's optim files over dp 0 and 1: disjoint names (each parameter once, by the dp rank whose
    ZeroRedundancyOptimizer steps it), together every parameter, each whole (start 0) with its Adam moments."""
    from p3d.checkpoint.files import read_tensors

    for c in range(4):
        names = []
        for d in range(2):
            _, index = read_tensors(ckpt / "optim" / f"pp{c}_tp0_dp{d}.safetensors")
            assert all(e["start"] == 0 and e["keys"] == ["exp_avg", "exp_avg_sq", "master"] for e in index.values())
            names.append(set(index))
        model = set().union(*(read_tensors(ckpt / "model" / f"pp{c}_tp0_dp{d}.safetensors")[1] for d in range(2)))
        assert not names[0] & names[1] and names[0] | names[1] == model, c
        assert names[0] and names[1], c  # both dp ranks own some of this chunk's parameters


@pytest.mark.timeout(400)
def test_export_of_a_torch_schedule_run_equals_deepspeeds(tmp_path):
    """p3d-export reads a torch schedule's chunk checkpoint by layer name: 3 steps of interleaved_1f1b v2 and 3 of
    DeepSpeed's 1f1b (pp2, fp32, the same data and init) export the same HF weights (measured: bitwise equal)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers.runs import ROOT

    exported = []
    for name, layout in (("torch", INTERLEAVED), ("deepspeed", DEEPSPEED)):
        run = tmp_path / name
        proc = p3d_train(f"run.dir={run}", "train.steps=3", *COMMON, *layout, timeout=300)
        assert proc.returncode == 0, _out(proc)
        cmd = [sys.executable, "-m", "p3d.cli.export", f"run.dir={run}", f"out={tmp_path / f'hf_{name}'}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        exported.append(load_file(tmp_path / f"hf_{name}" / "model.safetensors"))
    a, b = exported
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k


@pytest.mark.timeout(400)
def test_a_sweep_over_schedules_logs_to_wandb_and_reports_each_schedule(tmp_path):
    """p3d-train -m over schedule.pipeline (interleaved_1f1b, zbv; v = 2), W&B offline: each point trains under its
    schedule, its W&B run holds the metrics of metrics.jsonl (bubble included), and the sweep's p3d-report names
    each point's schedule."""
    import csv
    import re

    from tests.helpers.wandb_log import history

    sweep = tmp_path / "sweep"
    proc = p3d_train(
        "-m",
        "mesh=pp2",
        "schedule.pipeline=interleaved_1f1b,zbv",
        "schedule.virtual_stages=2",
        "train.steps=2",
        "logger=wandb",
        f"hydra.sweep.dir={sweep}",
        env={"HOME": str(tmp_path)},
        drop_env="WANDB_",
        timeout=360,
    )
    assert proc.returncode == 0, _out(proc)
    table = proc.stdout[proc.stdout.index("p3d-report:") :]
    for point, label in (("0", "interleaved_1f1b v=2"), ("1", "zbv v=2")):
        # the schedule varies, so it has a column; v=2 is common to both points, on the line above the table
        assert re.search(rf"^{point}\s+pp2\s+{label.split()[0]}\s+[\d,]+.*2/2\s+done$", table, re.M), table
        assert re.search(r"^every point: 2 ranks: .*, v=2, ", table, re.M), table
        meta = checkpoint.verify(checkpoint.step_dir(sweep / point, 2))
        assert meta["pipeline"] == label.split()[0]
        runs = list((sweep / point / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1, point
        for row, m in zip(history(runs[0]), read_metrics(sweep / point), strict=True):
            for key in ("loss", "grad_norm", "tokens_per_s", "bubble", "bubble_theory"):
                assert row[key] == pytest.approx(m[key]), (point, key)
    with open(sweep / "report.csv") as f:
        assert [(r["schedule"], r["v"]) for r in csv.DictReader(f)] == [("interleaved_1f1b", "2"), ("zbv", "2")]


@pytest.mark.timeout(700)
def test_resume_chain_of_the_issue_changes_schedule_mesh_and_tp(tmp_path):
    """The issue's chain: 1f1b dp2_pp2_tp2 (DeepSpeed, 8 ranks) -> interleaved_1f1b pp4 v2 (8 chunks) -> zbv tp2_pp2,
    3 steps each from the previous checkpoint: every segment reshards tp, pp and the chunk cut by layer name, and
    the 9 steps continue the single-process curve within 1e-5 (model=tiny with 8 blocks, so pp4 v2 has one each).

    The grad norm is held to 2e-4 here: step 9's norm of this 8-block model is ill-conditioned. Measured: the fp32
    reference sits 3.7e-5 from an fp64 run, and weights nudged by 1e-7 (relative) move it by 1.7e-4; any tp=2 run
    (DeepSpeed 1f1b, zbv, tp2 without pp, straight or resumed) reads 6.6e-5 from the fp32 reference, on the other
    side of the fp64 value, from the row-parallel sums' rounding, while every other step agrees to 5e-6 and every
    loss to 2e-7."""
    model = ("model.n_layers=8",)
    segments = (
        ("mesh=dp2_pp2_tp2",),
        ("mesh=pp4", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
        ("mesh=tp2_pp2", "schedule.pipeline=zbv", "schedule.virtual_stages=2"),
    )
    for i, layout in enumerate(segments):
        resume = ("train.resume=auto",) if i else ()
        proc = p3d_train(
            f"run.dir={tmp_path}", f"train.steps={3 * (i + 1)}", *resume, *COMMON, *model, *layout, timeout=400
        )
        assert proc.returncode == 0, _out(proc)
    _assert_matches(read_metrics(tmp_path), reference(9, *model), norm_rtol=2e-4)


VALIDATING_LAYOUTS = {
    # torch's own eval of the V schedules fails: p3d runs their forwards only; dp2: the dp reduction's buckets
    "dp2_pp2-dualpipev": ("mesh=dp2_pp2", "schedule.pipeline=dualpipev", "schedule.virtual_stages=2"),
    "dp2_pp2-interleaved": ("mesh=dp2_pp2", *I2),
}


@pytest.mark.timeout(300)
# slow tier, both (35 + 30 s): make test keeps validation on torch's executor in tests/e2e/test_cp_parity.py's
# cp2-validating (the issue's own line) and on DeepSpeed's in tests/e2e/test_parity.py's dp2_pp2_tp2-zero1-validating
@pytest.mark.parametrize("layout", with_slow(VALIDATING_LAYOUTS, ["dp2_pp2-interleaved", "dp2_pp2-dualpipev"]))
def test_validation_under_a_torch_schedule_matches_the_reference(layout, tmp_path):
    """p3d-train mesh=dp2_pp2 schedule.pipeline=dualpipev train.eval_every=2: the held-out losses after steps 2 and 4
    are the single-process run's within 1e-5, and the training steps after each validation pass still follow the
    reference (a validation that started the dp reduction of a backward that never ran halved step 3's gradient)."""
    evals = ("train.eval_every=2",)
    proc = p3d_train(f"run.dir={tmp_path}", "train.steps=4", *COMMON, *evals, *VALIDATING_LAYOUTS[layout], timeout=240)
    assert proc.returncode == 0, _out(proc)
    got, ref = read_metrics(tmp_path), reference(4, *evals)
    _assert_matches(got, ref)
    for step in (2, 4):
        assert ref[step - 1]["val_loss"] > 0
        assert got[step - 1]["val_loss"] == pytest.approx(ref[step - 1]["val_loss"], rel=RTOL), step
