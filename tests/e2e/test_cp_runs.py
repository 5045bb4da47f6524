"""Context parallelism through ``p3d-train``: checkpoints stay layout-free across cp, and the other precisions run.

The chain: 3 steps at dp2 x cp2 with ZeRO-1 (torch's ZeroRedundancyOptimizer over the 4 dp x cp holders), 3 more
resumed at cp1 on DeepSpeed's 1f1b engine on tp2 (``mesh=tp2``, nothing else changed: the preset's cp is 1), then 3
more at cp2 on another mesh: tp2 x pp2 with sequence parallelism under interleaved_1f1b. Each segment loads the
previous one's checkpoint; the 9 steps continue the single-process curve within 1e-5 (``train.decay=constant`` after
a 2-step warmup, so the segments' ``train.steps`` do not change the LR the reference runs). Steps 1-3 and 7-9 are
also make test's parity of cp with dp and ZeRO-1, and with TP, SP and an interleaved pipeline
(tests/e2e/test_cp_parity.py runs the issue's cases one by one, for 10 steps, in the slow tier).
"""

from __future__ import annotations

import pytest

from p3d.checkpoint import find as checkpoint
from p3d.rundir.spec import read_spec
from p3d.train.metrics import read_metrics
from tests.helpers.runs import assert_follows_curve, output_tail, p3d_train, single_process_curve

RTOL = 1e-5
COMMON = ("train.warmup_steps=2", "train.decay=constant")


@pytest.mark.timeout(600)
def test_cp2_checkpoint_resumes_at_cp1_on_deepspeed_and_at_cp2_on_another_mesh(tmp_path):
    segments = (
        ("mesh=dp2", "mesh.cp=2", "zero=stage1"),
        ("mesh=tp2",),  # a resume with only what changes: the preset's cp is 1
        ("mesh=tp2_pp2", "mesh.cp=2", "schedule.sequence_parallel=true", "schedule.pipeline=interleaved_1f1b"),
    )
    for i, layout in enumerate(segments):
        resume = ("train.resume=auto",) if i else ()
        proc = p3d_train(f"run.dir={tmp_path}", f"train.steps={3 * (i + 1)}", *resume, *COMMON, *layout, timeout=400)
        assert proc.returncode == 0, output_tail(proc)
        if i == 0:  # every dp x cp rank writes its part of the model: 4 files per kind
            names = sorted(f.name for f in (checkpoint.step_dir(tmp_path, 3) / "model").glob("*.safetensors"))
            assert names == [f"pp0_tp0_dp{d}_cp{c}.safetensors" for d in (0, 1) for c in (0, 1)]
        assert read_spec(tmp_path)[0].mesh.cp == (2 if "mesh.cp=2" in layout else 1)
    assert_follows_curve(read_metrics(tmp_path), single_process_curve("train.steps=9", *COMMON), RTOL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cp2_trains_in_bf16_with_eval(tmp_path):
    """bf16 (autocast over fp32 weights; the cp attention computes in fp32 inside) on tp2 x cp2 with SP: it runs,
    evaluates, and stays within bf16's reach of the fp32 run's losses."""
    args = ("model=tiny", "mesh=tp2", "mesh.cp=2", "schedule.sequence_parallel=true", "train.steps=6")
    runs = {}
    for dtype in ("fp32", "bf16"):
        proc = p3d_train(*args, f"train.dtype={dtype}", "train.eval_every=3", f"run.dir={tmp_path / dtype}")
        assert proc.returncode == 0, output_tail(proc)
        runs[dtype] = read_metrics(tmp_path / dtype)
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), a["step"]
    assert runs["bf16"][-1]["val_loss"] == pytest.approx(runs["fp32"][-1]["val_loss"], rel=2e-2)
