"""ZeRO-2 and ZeRO-3 through ``p3d-train`` (real worker processes, gloo): checkpoints stay layout-free across stages.

The chain of the issue: 3 steps of ZeRO-3 on dp2_pp2_tp2 (1f1b, which ZeRO-3 runs on torch's Schedule1F1B), 3 more
resumed on DeepSpeed's 1f1b engine with ZeRO-1 on pp4, 3 more on ZeRO-2 tp2_pp2 under zbv. Each segment loads the
previous one's checkpoint (FSDP2's dp pieces, DeepSpeed's flat fragments, whole tensors) into another layout, and
the 9 steps continue the single-process curve within 1e-5 (``train.decay=constant`` after a 2-step warmup, so the
segments' ``train.steps`` do not change the LR the reference runs).
"""

from __future__ import annotations

import functools

import pytest

from p3d.checkpoint import find as checkpoint
from p3d.checkpoint.files import read_tensors
from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.runs import p3d_train, typed

RTOL = 1e-5
COMMON = ("train.warmup_steps=2", "train.decay=constant")


@functools.cache
def reference(steps: int) -> list[dict]:
    cfg, _ = typed("mesh=single", f"train.steps={steps}", *COMMON)
    return reference_run(cfg)


def _out(proc) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(600)
def test_zero3_checkpoint_resumes_on_deepspeed_zero1_and_zero2_zbv(tmp_path):
    segments = (
        ("mesh=dp2_pp2_tp2", "zero=stage3"),
        ("mesh=pp4", "zero=stage1"),
        ("mesh=tp2_pp2", "zero=stage2", "schedule.pipeline=zbv"),
    )
    for i, layout in enumerate(segments):
        resume = ("train.resume=auto",) if i else ()
        proc = p3d_train(f"run.dir={tmp_path}", f"train.steps={3 * (i + 1)}", *resume, *COMMON, *layout, timeout=400)
        assert proc.returncode == 0, _out(proc)
        if i == 0:  # ZeRO-3: both dp ranks of a (pp, tp) coordinate write the rows FSDP2 gave them
            ckpt = checkpoint.step_dir(tmp_path, 3)
            for d in (0, 1):
                _, index = read_tensors(ckpt / "optim" / f"pp0_tp0_dp{d}.safetensors")
                assert index and all(e["keys"] == ["exp_avg", "exp_avg_sq", "master"] for e in index.values())
                assert any(e["start"] > 0 for e in index.values()) == (d == 1), d  # dp 1 holds the later rows
    got, ref = read_metrics(tmp_path), reference(9)
    assert [r["step"] for r in got] == list(range(1, 10))
    assert any(r["grad_norm"] > 1.0 for r in ref), "clipping must be exercised"
    for r, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), f"step {r['step']} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL), f"step {r['step']} grad norm"
        assert g["lr"] == pytest.approx(r["lr"], rel=1e-12), f"step {r['step']} lr"
