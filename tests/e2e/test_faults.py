"""Faults of long runs, injected for real into real runs: non-finite steps (train.lr=1e6, or an inf written into
one stage's gradient by the P3D_TEST_NONFINITE hook), loss spikes, a straggler (a rank made to sleep in its
forward), a hang (a worker SIGSTOPped)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.parallel.hang import STOP_ENV
from p3d.train.faults import INJECT_ENV
from p3d.train.loop import KILL_ENV
from p3d.train.metrics import read_metrics
from p3d.train.timing import SLOW_ENV
from tests.helpers.runs import p3d_train, start_p3d_train, wait_for_steps, worker_pids
from tests.helpers.tiers import with_slow


def _out(proc) -> str:
    return proc.stdout[-4000:] + proc.stderr[-4000:]


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict / list, by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    found: dict[str, torch.Tensor] = {}
    for k, v in items:
        found.update(_tensors(v, f"{prefix}/{k}"))
    return found


def _state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Parameters and optimizer states (master weights, Adam moments, step counts) of a checkpoint."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(ckpt.rglob("*.safetensors")):  # every rank's share (p3d/checkpoint/files.py)
        if f.parts[-2] in ("model", "optim"):
            state.update(_tensors(load_file(f), f"{f.parent.name}/{f.name}"))
    assert state, f"no model/optim files in {ckpt}"
    return state


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(400)
def test_huge_lr_stops_at_the_first_nonfinite_step(tmp_path):
    """train.lr=1e6: the run stops at the first step whose loss or gradient norm is not finite, names it, exits
    with NONFINITE and leaves the newest complete checkpoint the one before it."""
    run = tmp_path / "run"
    proc = p3d_train(
        f"run.dir={run}", "mesh=dp2_pp2", "train.steps=8", "train.lr=1e6", "train.warmup_steps=0",
        "train.save_every=1", "train.keep_last=0", timeout=360,
    )  # fmt: skip
    assert proc.returncode == exit_codes.NONFINITE, _out(proc)
    records = read_metrics(run)
    bad = records[-1]["step"]
    assert 1 < bad < 8, _out(proc)
    assert all(torch.tensor(r["grad_norm"]).isfinite() and torch.tensor(r["loss"]).isfinite() for r in records[:-1])
    lines = [ln for ln in proc.stdout.splitlines() if f"step {bad}: non-finite" in ln]
    assert len(lines) == 1 and "stage" in lines[0] and "train.on_nonfinite=stop" in lines[0], _out(proc)
    newest = checkpoint.find(run, "auto")
    assert newest is not None and newest.name == f"step_{bad - 1:08d}", newest  # nothing of the bad step saved


@pytest.mark.timeout(600)
@pytest.mark.parametrize(  # slow tier (18 + 10 s): kept: stage0 and interleaved (the torch executor)
    "zero", with_slow(["stage0", "stage1", "bf16", "interleaved"], ["stage1", "bf16"])
)
def test_skip_discards_the_update_bitwise(zero, tmp_path):
    """on_nonfinite=skip with an inf injected into stage 1's gradient at steps 3 and 4: those steps change no
    parameter, no Adam state and not the learning rate (bitwise), are counted, and the run goes on. Under
    ZeRO-1 (dp2_pp2) the discard goes through DeepSpeed's ZeRO optimizer's own overflow path; under bf16
    (pp2, ZeRO 0) through DeepSpeed's BF16_Optimizer, whose fp32 gradients the gate checks and fills; under a
    torch schedule (interleaved_1f1b v2) through the executor's own gate call and non-finite-norm skip."""
    run = tmp_path / "run"
    layout = {"stage0": ("mesh=pp2", "zero=stage0"), "stage1": ("mesh=dp2_pp2", "zero=stage1"),
              "bf16": ("mesh=pp2", "zero=stage0", "train.dtype=bf16"),
              "interleaved": ("mesh=pp2", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
              }[zero]  # fmt: skip
    proc = p3d_train(
        f"run.dir={run}", *layout, "train.steps=6",
        "train.warmup_steps=4", "train.on_nonfinite=skip", "train.save_every=1", "train.keep_last=0",
        timeout=500, env={INJECT_ENV: "1:3,4"},
    )  # fmt: skip
    assert proc.returncode == exit_codes.OK, _out(proc)
    records = read_metrics(run)
    assert [r["skipped"] for r in records] == [0, 0, 1, 1, 0, 0]
    assert records[-1]["skipped_steps"] == 2
    assert "step 3: non-finite gradient norm on stage 1; update discarded (1 in a row" in proc.stdout, _out(proc)
    lr = [r["lr"] for r in records]  # the lr each step ran with: warmup rises, but not over discarded steps
    assert lr[1] < lr[2] == lr[3] == lr[4] < lr[5], lr
    states = {s: _state(checkpoint.step_dir(run, s)) for s in (2, 3, 4, 5)}
    assert _bitwise_equal(states[2], states[3]) and _bitwise_equal(states[2], states[4])
    assert not _bitwise_equal(states[4], states[5])  # an applied step does change them


MOE_SKIP_RUN = ("model=moe_tiny", "model.moe.bias_update_rate=0.01", "train.steps=5", "train.warmup_steps=2",
                "train.on_nonfinite=skip")  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize(  # slow tier: kept: DeepSpeed's engine; the torch executor's step ends in the same loop
    "executor", with_slow(["deepspeed", "torch"], ["torch"])
)
def test_a_discarded_step_leaves_the_selection_biases_and_follows_the_reference(executor, tmp_path):
    """Aux-loss-free balancing with an inf injected into stage 1's gradient at step 3 (on_nonfinite=skip): the
    discarded step leaves every router's expert_bias bitwise as it was (with the parameters and Adam's state), an
    applied step moves them, and the run follows the single-process reference that discards the same step."""
    run = tmp_path / "run"
    layout = {"deepspeed": ("mesh=pp2",), "torch": ("mesh=pp2", "schedule.pipeline=interleaved_1f1b")}[executor]
    proc = p3d_train(
        f"run.dir={run}", *layout, *MOE_SKIP_RUN, "train.save_every=1", "train.keep_last=0",
        timeout=500, env={INJECT_ENV: "1:3"},
    )  # fmt: skip
    assert proc.returncode == exit_codes.OK, _out(proc)
    got = read_metrics(run)
    assert [r["skipped"] for r in got] == [0, 0, 1, 0, 0]
    states = {s: _state(checkpoint.step_dir(run, s)) for s in (2, 3, 4)}
    biases = {s: {k: v for k, v in state.items() if "expert_bias" in k} for s, state in states.items()}
    assert len(biases[2]) == 3, sorted(states[2])  # moe_tiny: three MoE blocks, each router's bias saved
    assert _bitwise_equal(biases[2], biases[3]) and _bitwise_equal(states[2], states[3])
    assert not any(torch.equal(biases[3][k], biases[4][k]) for k in biases[3])  # an applied step moves each
    from p3d.train.reference import reference_run
    from tests.helpers.runs import typed

    ref = reference_run(typed("mesh=single", *MOE_SKIP_RUN)[0], discard={3})
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5), (r["step"], g["loss"], r["loss"])
        if not g["skipped"]:
            assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), (r["step"], g["grad_norm"])
            assert g["moe_load_imbalance"] == pytest.approx(r["moe_load_imbalance"], rel=1e-5), r["step"]


# slow tier (8 s): kept: test_skip_discards_the_update_bitwise[bf16], the same overflow path of the bf16 optimizer
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bf16_stop_exits_nonfinite_without_an_update(tmp_path):
    """bf16 (DeepSpeed's BF16_Optimizer) with on_nonfinite=stop and an inf in stage 0's gradient at step 2:
    status NONFINITE at step 2, and the newest checkpoint is step 1's."""
    run = tmp_path / "run"
    proc = p3d_train(
        f"run.dir={run}", "mesh=pp2", "train.dtype=bf16", "train.steps=4", "train.save_every=1",
        timeout=360, env={INJECT_ENV: "0:2"},
    )  # fmt: skip
    assert proc.returncode == exit_codes.NONFINITE, _out(proc)
    assert "step 2: non-finite gradient norm on stage 0" in proc.stdout, _out(proc)
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert checkpoint.find(run, "auto") == checkpoint.step_dir(run, 1)


SKIP_RESUME_RUN = (
    "mesh=single",
    "train.steps=8",
    "train.warmup_steps=2",
    "train.save_every=5",
    "train.on_nonfinite=skip",
)


@pytest.mark.timeout(600)
def test_a_resume_after_skipped_steps_continues_lr_and_losses_bitwise(tmp_path):
    """Steps 3 and 4 discarded, a checkpoint at step 5 (3 updates applied), the worker killed at step 7 and
    the run resumed: from step 6 on, lr, loss and grad norm equal the uninterrupted run's with the same skips
    (the schedule and Adam's step count sit at the updates applied, not at the step number)."""
    inject = {INJECT_ENV: "0:3,4"}
    straight = p3d_train(f"run.dir={tmp_path / 'a'}", *SKIP_RESUME_RUN, timeout=400, env=inject)
    assert straight.returncode == 0, _out(straight)
    run = tmp_path / "b"
    killed = p3d_train(f"run.dir={run}", *SKIP_RESUME_RUN, timeout=400, env={**inject, KILL_ENV: "0:7"})
    assert killed.returncode != 0, _out(killed)
    meta = json.loads((checkpoint.step_dir(run, 5) / "meta.json").read_text())
    assert meta["optimizer_steps"] == 3 and meta["faults"]["skipped_steps"] == 2, meta
    old = tmp_path / "old" / "step_00000005"  # the same checkpoint as one written before these fields
    shutil.copytree(checkpoint.step_dir(run, 5), old)
    (old / "meta.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k not in ("optimizer_steps", "faults")})
    )
    resumed = p3d_train(f"run.dir={run}", *SKIP_RESUME_RUN, "train.resume=auto", timeout=400, env=inject)
    assert resumed.returncode == 0 and "resumed from step 5" in resumed.stdout, _out(resumed)
    a = {r["step"]: r for r in read_metrics(tmp_path / "a")}
    b = {r["step"]: r for r in read_metrics(run)}  # the resumed run's lines come last and win
    assert [a[s]["skipped"] for s in range(1, 9)] == [0, 0, 1, 1, 0, 0, 0, 0]
    assert a[6]["lr"] != a[8]["lr"]  # the schedule still moves: a shifted one would show
    for s in (6, 7, 8):
        for key in ("lr", "loss", "grad_norm", "skipped_steps"):
            assert b[s][key] == a[s][key], (s, key, b[s][key], a[s][key])  # bitwise
    older = p3d_train(f"run.dir={tmp_path / 'c'}", *SKIP_RESUME_RUN, f"train.resume={old}", timeout=400, env=inject)
    assert older.returncode == 0 and "resumed from step 5" in older.stdout, _out(older)  # it still loads,
    c = {r["step"]: r for r in read_metrics(tmp_path / "c")}
    assert c[6]["lr"] != a[6]["lr"]  # at its step number as before: 2 updates ahead on the schedule


@pytest.mark.timeout(400)
def test_more_skips_in_a_row_than_max_skipped_stop_the_run(tmp_path):
    run = tmp_path / "run"
    proc = p3d_train(
        f"run.dir={run}", "mesh=pp2", "train.steps=6", "train.on_nonfinite=skip", "train.max_skipped=2",
        timeout=360, env={INJECT_ENV: "0:2,3,4"},
    )  # fmt: skip
    assert proc.returncode == exit_codes.NONFINITE, _out(proc)
    assert "step 4: non-finite gradient norm on stage 0; 3 steps in a row discarded" in proc.stdout, _out(proc)
    assert [r["skipped"] for r in read_metrics(run)] == [0, 1, 1, 1]


@pytest.mark.timeout(400)
def test_loss_spikes_are_flagged_and_skipped(tmp_path):
    """spike_factor=1 over a window of 3: every step whose loss is above the median of the last 3 losses seen
    (discarded steps included) is flagged and (on_spike=skip) discarded; checked against metrics.jsonl."""
    run = tmp_path / "run"
    proc = p3d_train(
        f"run.dir={run}", "mesh=pp2", "train.steps=12", "train.lr=0.05", "train.warmup_steps=0",
        "train.spike_factor=1", "train.spike_window=3", "train.on_spike=skip", "train.max_skipped=12", timeout=360,
    )  # fmt: skip
    assert proc.returncode == exit_codes.OK, _out(proc)
    records = read_metrics(run)
    assert [r["skipped"] for r in records] == [r["loss_spike"] for r in records]
    seen: list[float] = []
    checked = 0
    for r in records:
        if len(seen) >= 3:
            median = sorted(seen[-3:])[1]
            if abs(r["loss"] - median) > 1e-4:  # the gate's fp64 mean and the engine's loss agree to ~1e-6
                assert r["loss_spike"] == int(r["loss"] > median), (r, seen[-3:])
                checked += 1
        else:
            assert r["loss_spike"] == 0
        seen.append(r["loss"])
    assert checked >= 5 and 0 < sum(r["loss_spike"] for r in records) < len(records), records
    assert f"step {next(r['step'] for r in records if r['loss_spike'])}: loss spike" in proc.stdout


def _longest_run(flags: list[int]) -> int:
    longest = current = 0
    for f in flags:
        current = current + 1 if f else 0
        longest = max(longest, current)
    return longest


FROZEN = ("mesh=single", "train.lr=0.05", "train.warmup_steps=0", "train.spike_factor=1.05", "train.on_spike=skip")


@pytest.mark.timeout(200)
def test_spike_skips_cannot_freeze_a_run_and_a_run_of_them_stops_it(tmp_path):
    """Issue 31's command: steps 8-15 were all discarded against a median that never moved, each with grad_norm
    nan, and the run ended "done", exit 0. Now the window follows the losses (the run learns again), a discarded
    spike reports its finite norm and why, and more discards in a row than train.max_skipped stop the run."""
    run = tmp_path / "spk"
    proc = p3d_train(f"run.dir={run}", *FROZEN, "train.spike_window=3", "train.steps=15", timeout=180)
    records = read_metrics(run)
    skipped = [r["skipped"] for r in records]
    assert proc.returncode == exit_codes.OK and len(records) == 15, _out(proc)
    assert sum(skipped) > 0 and _longest_run(skipped) <= 2 and not skipped[-1], skipped  # window 3: 2 at most
    for r in records:
        if r["skipped"]:
            assert r["skip_reason"] == "loss spike" and r["grad_norm"] > 0 and r["grad_norm"] < float("inf"), r
            assert f"step {r['step']:>5}/15" in proc.stdout and "update discarded (loss spike)" in proc.stdout
    # a window of one loss: a loss above the one before is a spike; with max_skipped=1 a second in a row stops
    run2 = tmp_path / "spk1"
    proc = p3d_train(
        f"run.dir={run2}", *FROZEN[:3], "train.spike_factor=1", "train.on_spike=skip", "train.spike_window=1",
        "train.max_skipped=1", "train.steps=30", timeout=180,
    )  # fmt: skip
    assert proc.returncode == exit_codes.NONFINITE, _out(proc)
    last = read_metrics(run2)[-1]
    assert _longest_run([r["skipped"] for r in read_metrics(run2)]) == 2 and last["skip_reason"] == "loss spike"
    assert f"error: step {last['step']}: loss spike" in proc.stdout, _out(proc)
    assert "2 steps in a row discarded, more than train.max_skipped=1: stopped" in proc.stdout, _out(proc)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("mesh=dp2_pp2", "model.tie_embeddings=true"), id="dp2_pp2-tied"),
        pytest.param(("mesh=dp2_tp2", "train.dtype=bf16"), id="dp2_tp2-bf16", marks=pytest.mark.slow),
        pytest.param(("mesh=dp2_pp2", "model.tie_embeddings=true", "zero=stage1"), id="zero1", marks=pytest.mark.slow),
        pytest.param(
            ("mesh=dp2_pp2", "model.tie_embeddings=true", "schedule.pipeline=zbv", "schedule.virtual_stages=2"),
            id="zbv-tied",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_discarded_spike_reports_the_norm_its_update_would_have_had(tmp_path, layout):
    """The same run twice: on_spike=warn applies the first spike's update, on_spike=skip discards it. Until that
    step the two are the same run, so the norm the discarding run measured (on copies of its gradients, reduced
    over the tied holders and dp as the step would) is the norm the optimizer saw in the other run."""
    common = (*layout, "train.steps=8", "train.lr=0.05", "train.warmup_steps=0", "train.spike_factor=1.0")
    common = (*common, "train.spike_window=2", "train.max_skipped=8")
    runs = {}
    for on_spike in ("warn", "skip"):
        proc = p3d_train(f"run.dir={tmp_path / on_spike}", *common, f"train.on_spike={on_spike}", timeout=280)
        assert proc.returncode == exit_codes.OK, _out(proc)
        runs[on_spike] = read_metrics(tmp_path / on_spike)
    first = next(i for i, r in enumerate(runs["skip"]) if r["skipped"])
    applied, discarded = runs["warn"][first], runs["skip"][first]
    assert applied["loss_spike"] and not applied["skipped"] and discarded["skip_reason"] == "loss spike"
    assert discarded["loss"] == pytest.approx(applied["loss"], rel=1e-6)
    assert discarded["grad_norm"] == pytest.approx(applied["grad_norm"], rel=1e-5), (applied, discarded)


@pytest.mark.timeout(400)
def test_a_slowed_rank_is_named_as_the_straggler(tmp_path):
    """Rank 3 of dp2_pp2 sleeps 0.4 s in each forward pass (the P3D_TEST_SLOW_RANK hook): metrics name it as
    the slowest rank every step, and the console names it once it has been slow 3 steps in a row."""
    run = tmp_path / "run"
    proc = p3d_train(
        f"run.dir={run}", "mesh=dp2_pp2", "train.steps=5", "train.straggler_factor=2", "train.straggler_steps=3",
        timeout=360, env={SLOW_ENV: "3:0.4"},
    )  # fmt: skip
    assert proc.returncode == exit_codes.OK, _out(proc)
    records = read_metrics(run)
    assert all(r["slowest_rank"] == 3 and r["slowest_ratio"] > 2 for r in records), records
    named = [ln for ln in proc.stdout.splitlines() if "is a straggler" in ln]
    assert len(named) == 1 and named[0].startswith("p3d: warning: rank 3 (dp 1, pp 1, tp 0) is a straggler"), named


@pytest.mark.timeout(300)
def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize(  # slow tier (51 + 41 s): kept: the stopped worker after its schedule (DeepSpeed's)
    "where", with_slow(["sent", "after_its_schedule", "sent_zbv"], ["sent", "sent_zbv"])
)
def test_a_stopped_worker_is_named_and_the_others_dump_their_stacks(tmp_path, monkeypatch, where):
    """SIGSTOP rank 2 of dp2_pp2 with cluster.timeout_s=12: within 60 s the job ends with HUNG, the
    launcher names rank 2 as the rank that never arrived, and every other rank's log holds its stack.
    ``sent``: the test stops it wherever it is after step 2. ``after_its_schedule``: it stops itself
    right after step 3's OptimizerStep, so its peers wait in DeepSpeed's loss all-reduce / broadcast
    after the pipeline schedule, outside every instruction (the wait no watch covered before). ``sent_zbv``: as
    ``sent`` under a torch schedule, whose whole step is one watched phase (no per-instruction marks)."""
    run = tmp_path / "run"
    if where == "after_its_schedule":
        monkeypatch.setenv(STOP_ENV, "2:3")
    torch_schedule = ("schedule.pipeline=zbv", "schedule.virtual_stages=2") if where == "sent_zbv" else ()
    proc = start_p3d_train(run, "mesh=dp2_pp2", "train.steps=500", "cluster.timeout_s=12", *torch_schedule)
    pids: dict[int, int] = {}
    try:
        wait_for_steps(run, 1 if where == "after_its_schedule" else 2, proc)
        pids = worker_pids(run)
        assert sorted(pids) == [0, 1, 2, 3], pids
        if where != "after_its_schedule":
            os.kill(pids[2], signal.SIGSTOP)
        else:
            while not _stopped(pids[2]):
                assert proc.poll() is None, proc.stdout.read()[-3000:]  # type: ignore[union-attr]
                time.sleep(0.1)
        stopped_at = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in worker_pids(run).values():  # what this test started, found by its own run directory
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == exit_codes.HUNG, out[-4000:]
    assert took < 60, took
    summary = [ln for ln in out.splitlines() if ln.startswith("p3d: hang:")]
    assert len(summary) == 1, out[-4000:]
    print(summary[0])
    assert re.search(r"Never arrived: rank 2 \(dp \d, pp \d, tp 0, still running: stopped or stuck\)\. ", summary[0])
    for rank in (0, 1, 3):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"[rank {rank}] p3d: no progress for" in log and "most recent call first" in log, (rank, log[-3000:])
        assert f"rank {rank} in " in summary[0]
    assert "p3d: no progress" not in (run / "logs" / "rank2.log").read_text()


RESTART_RUN = ("mesh=pp2", "train.steps=12", "train.warmup_steps=3", "train.save_every=5")
RESTART_LAYOUTS = {"deepspeed": (), "zero3": ("mesh=dp2", "zero=stage3")}  # zero3: FSDP2's pieces, restarted


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", with_slow(RESTART_LAYOUTS, ["zero3"]))
def test_a_killed_worker_is_restarted_from_the_checkpoint_and_ends_bitwise_equal(tmp_path, layout):
    """SIGKILL one worker after step 7 with save_every=5, max_restarts=2: every worker restarts from step 5,
    the run finishes, the restart is printed with its cause, and the final loss equals an uninterrupted run's."""
    overrides = (*RESTART_RUN, *RESTART_LAYOUTS[layout])
    straight = p3d_train(f"run.dir={tmp_path / 'a'}", *overrides, timeout=400)
    assert straight.returncode == 0, _out(straight)
    run = tmp_path / "b"
    proc = start_p3d_train(run, *overrides, "train.max_restarts=2")
    try:
        wait_for_steps(run, 7, proc)
        os.kill(worker_pids(run)[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in worker_pids(run).values():
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"p3d: restart 1 of 2: rank 0 was killed by SIGKILL at step \d+; restarting", out), out[-4000:]
    assert "resumed from step 5" in out, out[-4000:]
    a, b = read_metrics(tmp_path / "a"), read_metrics(run)
    assert [r["step"] for r in b] == list(range(1, 13))
    assert b[-1]["loss"] == a[-1]["loss"] and b[-1]["grad_norm"] == a[-1]["grad_norm"]  # bitwise


@pytest.mark.timeout(600)
def test_a_worker_killed_at_the_same_step_again_ends_the_run(tmp_path):
    """The P3D_TEST_KILL_AT hook SIGKILLs rank 1 as step 7 starts, in every attempt: one restart, then the
    repeat (same step, same cause) ends the run with the cause, though restarts are left."""
    proc = p3d_train(
        f"run.dir={tmp_path / 'run'}", *RESTART_RUN, "train.max_restarts=5", timeout=500, env={KILL_ENV: "1:7"}
    )
    assert proc.returncode == exit_codes.WORKER_FAILED, _out(proc)
    assert proc.stdout.count("p3d: restart ") == 1, _out(proc)
    assert "p3d: rank 1 was killed by SIGKILL at step 7 again, as before the last restart: not restarting" in (
        proc.stdout
    ), _out(proc)
