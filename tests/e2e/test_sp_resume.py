"""Sequence parallelism changes no parameter: a run on tp2_pp2 trained 3 steps with SP, resumed 3 steps
without it and 3 more with it again follows the uninterrupted 9-step SP run step for step (fp32,
clipping on and active, loss and gradient norm within 1e-5 relative), and p3d-export of an SP checkpoint
writes the same Hugging Face tensors (names, shapes, values up to fp32 reduction order) as the SP-off run.

The lr schedule must not depend on train.steps (which each segment raises): warmup, then constant.
"""

from __future__ import annotations

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import p3d_train

COMMON = ("model=tiny", "mesh=tp2_pp2", "train.warmup_steps=2", "train.decay=constant", "train.grad_clip=1.0")
RTOL = 1e-5


def _train(run_dir, steps: int, sp: bool, *extra: str):
    r = p3d_train(
        *COMMON,
        f"run.dir={run_dir}",
        f"train.steps={steps}",
        f"schedule.sequence_parallel={str(sp).lower()}",
        *extra,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _hf_tensors(run_dir, out) -> dict:
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers.runs import ROOT

    r = subprocess.run(
        [sys.executable, "-m", "p3d.cli.export", f"run.dir={run_dir}", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return load_file(out / "model.safetensors")


# slow tier (87 s): kept: the SP parity meshes, SP checkpoints resumed under other layouts (e2e/test_layouts.py),
# SP p2p bytes
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_sp_off_and_on_again_continues_the_sp_run(tmp_path):
    import torch

    whole, chain, plain = tmp_path / "whole", tmp_path / "chain", tmp_path / "plain"
    _train(whole, 9, True)
    _train(chain, 3, True)
    hf_sp = _hf_tensors(chain, tmp_path / "hf-sp")  # the step-3 checkpoint, written with SP
    r = _train(chain, 6, False, "train.resume=auto")
    assert "p3d: schedule.sequence_parallel: true -> false from step 4" in r.stdout, r.stdout[-2000:]
    r = _train(chain, 9, True, "train.resume=auto")
    assert "p3d: schedule.sequence_parallel: false -> true from step 7" in r.stdout, r.stdout[-2000:]

    ref, got = read_metrics(whole), read_metrics(chain)
    assert [m["step"] for m in got] == [m["step"] for m in ref] == list(range(1, 10))
    assert any(m["grad_norm"] > 1.0 for m in ref), "clipping must be exercised"
    for r_, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r_["loss"], rel=RTOL), f"step {r_['step']} loss"
        assert g["grad_norm"] == pytest.approx(r_["grad_norm"], rel=RTOL), f"step {r_['step']} grad norm"
    assert got[-1]["loss"] < got[0]["loss"] - 0.5  # it learns

    # export: the SP run's step-3 checkpoint against 3 steps without SP
    _train(plain, 3, False)
    hf_plain = _hf_tensors(plain, tmp_path / "hf-plain")
    assert {k: v.shape for k, v in hf_sp.items()} == {k: v.shape for k, v in hf_plain.items()}
    for name, tensor in hf_plain.items():
        torch.testing.assert_close(hf_sp[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
