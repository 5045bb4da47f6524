"""train.async_save: the write happens in the background, training is bitwise unchanged, and a kill or
a stop signal during the write never leaves ``latest`` on an incomplete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from p3d import exit_codes
from p3d.checkpoint import checkpointer as checkpoint
from p3d.checkpoint import find as ckpt_find
from p3d.train.metrics import read_metrics
from tests.helpers.runs import kill_run, p3d_train, start_p3d_train, wait_for_steps, worker_pids


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    meta = ckpt_find.verify(ckpt)
    read = checkpoint.reader(ckpt, meta)
    out = {}
    for pp in range(meta["mesh"]["pp"]):
        for tp in range(meta["mesh"]["tp"]):
            for name, t in read("model", pp, tp)["params"].items():
                out[f"model/{pp}/{tp}/{name}"] = t
            for name, states in read("optim", pp, tp).items():
                out.update({f"optim/{pp}/{tp}/{name}/{k}": v for k, v in states.items()})
    return out


@pytest.mark.timeout(1500)
def test_async_save_trains_bitwise_like_sync_and_writes_the_same_checkpoints(tmp_path):
    common = ("train.steps=6", "train.save_every=2", "train.keep_last=0", "mesh=dp2_pp2", "zero=stage1")
    sync = p3d_train(f"run.dir={tmp_path / 'sync'}", *common, "train.async_save=false", timeout=700)
    assert sync.returncode == 0, sync.stdout[-2000:] + sync.stderr[-2000:]
    asyn = p3d_train(f"run.dir={tmp_path / 'async'}", *common, "train.async_save=true", timeout=700)
    assert asyn.returncode == 0, asyn.stdout[-2000:] + asyn.stderr[-2000:]
    assert "in the background" in asyn.stdout and "in the background" not in sync.stdout
    a, b = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]  # bitwise
    for step in (2, 4, 6):
        ta, tb = (
            _tensors(ckpt_find.step_dir(tmp_path / "sync", step)),
            _tensors(ckpt_find.step_dir(tmp_path / "async", step)),
        )
        assert ta.keys() == tb.keys() and ta
        assert all(torch.equal(ta[k], tb[k]) for k in ta), step  # the snapshot of that step, not a later one
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text().strip() == "step_00000006"


@pytest.mark.timeout(600)
def test_sigkill_during_a_background_write_leaves_latest_on_the_previous_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = start_p3d_train(
        run, "train.steps=200", "train.save_every=1", "train.keep_last=3", "mesh=tp2_pp2", "train.async_save=true"
    )
    caught = None
    end = time.monotonic() + 400
    try:
        wait_for_steps(run, 2, proc, timeout=300)
        pids = list(worker_pids(run).values())
        assert len(pids) == 4, pids
        ckpts = run / "checkpoints"
        while time.monotonic() < end and caught is None:
            partial = list(ckpts.glob(".step_*.tmp"))
            if partial and (ckpts / "latest").exists():
                for pid in pids:  # freeze everyone mid-write, then look
                    os.kill(pid, signal.SIGSTOP)
                if any(p.exists() for p in partial):
                    caught = partial[0]
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                else:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
            time.sleep(0.002)
    finally:
        kill_run(proc, run)
    assert caught is not None, "never caught a background write in progress"
    found = ckpt_find.find(run, "auto")
    meta = ckpt_find.verify(found)  # complete, every file at its recorded size
    assert (run / "checkpoints" / "latest").read_text().strip() == found.name
    assert meta["step"] < int(caught.name[len(".step_") : -len(".tmp")])
    (run / "metrics.jsonl").unlink(missing_ok=True)
    resumed = p3d_train(f"run.dir={run}", f"train.steps={meta['step'] + 1}", "mesh=tp2_pp2", "train.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert not list((run / "checkpoints").glob(".step_*.tmp"))


@pytest.mark.timeout(600)
def test_a_stop_signal_waits_for_the_background_write_before_exit_75(tmp_path):
    run = tmp_path / "run"
    proc = start_p3d_train(run, "train.steps=200", "train.save_every=1", "mesh=tp2_pp2", "train.async_save=true")
    try:
        wait_for_steps(run, 3, proc, timeout=300)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_run(proc, run)
    assert proc.returncode == exit_codes.PREEMPTED, out[-3000:]
    last = read_metrics(run)[-1]["step"]
    found = ckpt_find.find(run, "auto")
    assert found == ckpt_find.step_dir(run, last)  # the stop's own save, complete before the exit
    assert json.loads((found / "meta.json").read_text())["step"] == last
    ckpt_find.verify(found)
    assert not list((run / "checkpoints").glob(".step_*.tmp"))
