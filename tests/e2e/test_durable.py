"""Durable runs: exact resume after an interruption, atomic saves, and clear refusals of bad checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.train.metrics import read_metrics
from tests.helpers.runs import copy_run, kill_run, p3d_train, start_p3d_train, wait_for_steps, worker_pids

STEPS = 10


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return start_p3d_train(run_dir, *overrides)


def _assert_same_curve(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert y["samples"] == x["samples"], x["step"]  # the same data position at every step
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=0), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6, abs=0), x["step"]
        assert y["lr"] == pytest.approx(x["lr"], rel=1e-12), x["step"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "layout",
    [  # slow tier (96 + 75 s): kept: the same SIGTERM -> 75 -> resume under zbv; Ctrl-C once -> resume bitwise
        pytest.param(("mesh=dp2_pp2_tp2", "zero=stage0"), id="stage0", marks=pytest.mark.slow),
        pytest.param(("mesh=dp2_pp2_tp2", "zero=stage1"), id="stage1", marks=pytest.mark.slow),
        pytest.param(("mesh=pp2", "schedule.pipeline=zbv", "schedule.virtual_stages=2"), id="zbv"),  # a torch schedule
        pytest.param(("mesh=dp2_pp2", "zero=stage3"), id="stage3", marks=pytest.mark.slow),  # FSDP2's dp pieces
    ],
)
def test_sigterm_then_resume_reproduces_the_uninterrupted_run(layout, tmp_path):
    """2N steps straight vs. a run stopped by SIGTERM (what Slurm sends) and resumed: same per-step losses."""
    common = (f"train.steps={STEPS}", "train.warmup_steps=3", *layout)
    straight = p3d_train(f"run.dir={tmp_path / 'a'}", *common)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]

    run = tmp_path / "b"
    proc = _start(run, *common)
    try:
        wait_for_steps(run, 3, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_run(proc, run)
    assert proc.returncode == exit_codes.PREEMPTED, out[-3000:]
    stopped = checkpoint.find(run, "auto")
    assert stopped is not None and "after a stop signal" in out
    stopped_at = json.loads((stopped / "meta.json").read_text())["step"]
    assert 3 <= stopped_at < STEPS

    resumed = p3d_train(f"run.dir={run}", *common, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout
    _assert_same_curve(read_metrics(tmp_path / "a"), read_metrics(run))


@pytest.mark.timeout(300)
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, "train.steps=200", "train.save_every=1", "train.keep_last=3", "mesh=tp2_pp2")
    caught = None
    end = time.monotonic() + 150
    try:
        wait_for_steps(run, 2, proc)
        pids = list(worker_pids(run).values())
        assert len(pids) == 4, pids
        ckpts = run / "checkpoints"
        while time.monotonic() < end and caught is None:
            partial = list(ckpts.glob(".step_*.tmp"))
            if partial and (ckpts / "latest").exists():
                for pid in pids:  # freeze everyone mid-save, then look
                    os.kill(pid, signal.SIGSTOP)
                if any(p.exists() for p in partial):
                    caught = partial[0]
                    for pid in pids:  # killed in the middle of that save
                        os.kill(pid, signal.SIGKILL)
                else:  # the save finished in between: let the run go on to the next one
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
            time.sleep(0.002)
    finally:
        kill_run(proc, run)
    assert caught is not None, "never caught a save in progress"
    found = checkpoint.find(run, "auto")
    meta = checkpoint.verify(found)  # complete, every file at its recorded size
    assert meta["step"] < int(caught.name[len(".step_") : -len(".tmp")])  # the one before the interrupted save
    (run / "metrics.jsonl").unlink(missing_ok=True)
    resumed = p3d_train(f"run.dir={run}", f"train.steps={meta['step'] + 2}", "mesh=tp2_pp2", "train.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert [r["step"] for r in read_metrics(run)] == [meta["step"] + 1, meta["step"] + 2]
    assert not list((run / "checkpoints").glob(".step_*.tmp"))  # the next save swept the debris


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("saved") / "run"
    result = p3d_train(f"run.dir={run}", "train.steps=2", "mesh=tp2_pp2")
    assert result.returncode == 0, result.stderr[-2000:]
    return run


@pytest.mark.parametrize(
    "damage,needle",
    [
        ("truncate", "is truncated"),
        ("delete", "is missing"),
    ],
)
def test_a_damaged_checkpoint_is_refused_before_any_worker(saved_run, tmp_path, damage, needle):
    run = copy_run(saved_run, tmp_path)
    shard = checkpoint.step_dir(run, 2) / "optim" / "pp1_tp0_dp0.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.unlink()
    result = p3d_train(f"run.dir={run}", "train.steps=4", "mesh=tp2_pp2", "train.resume=auto", timeout=60)
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert f"checkpoint file {shard} {needle}" in result.stderr


def test_a_corrupt_checkpoint_file_is_named_by_the_worker(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path)
    shard = checkpoint.step_dir(run, 2) / "optim" / "pp0_tp1_dp0.safetensors"  # master weights and Adam moments
    shard.write_bytes(b"\0" * shard.stat().st_size)  # right size, garbage inside
    result = p3d_train(f"run.dir={run}", "train.steps=4", "mesh=tp2_pp2", "train.resume=auto", timeout=120)
    assert result.returncode == exit_codes.WORKER_FAILED
    assert f"checkpoint file {shard} cannot be read" in result.stdout


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.n_layers=6"], "holds another model: model.n_layers=4 there, 6 here; resume with model.n_layers=4"),
        (["data.tokenizer=/nonexistent.json"], "data.tokenizer=/nonexistent.json"),
        (["train.resume=/nonexistent/step_1"], "no complete checkpoint there"),
        (["train.resume=none"], "already holds a run"),
    ],
)
def test_an_incompatible_resume_is_refused(saved_run, tmp_path, overrides, needle):
    run = copy_run(saved_run, tmp_path)
    args = [f"run.dir={run}", "train.steps=4", "mesh=tp2_pp2", "train.resume=auto", *overrides]
    result = p3d_train(*args, timeout=60)
    assert result.returncode == exit_codes.CONFIG_ERROR, result.stdout[-1000:]
    assert needle in result.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2]  # nothing already written is lost


def test_resume_from_a_named_checkpoint_under_another_dp(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path)
    target = checkpoint.step_dir(run, 2)
    result = p3d_train(f"run.dir={run}", "train.steps=3", "mesh=dp2_pp2_tp2", f"train.resume={target}", timeout=200)
    assert result.returncode == 0, result.stdout[-2000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
