"""One run per run directory and Ctrl-C (p3d.jobs.stop), with real launches: a dead holder and its live worker,
two p3d-train racing for one directory, a SIGKILLed holder, Ctrl-C once and twice (at any delay)."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.jobs.stop import StopSignals
from p3d.rundir.lease import LOCK_NAME, Lease, RunLocked, read
from p3d.train.metrics import read_metrics
from p3d.train.timing import SLOW_ENV
from tests.helpers.leases import write_lease
from tests.helpers.runs import ROOT, kill_run, p3d_train, start_p3d_train, wait_for_steps, worker_pids

# ---- the lease, in-process


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_dead_holder_is_taken_over_with_a_note(tmp_path, capsys):
    holder = _sleeper()
    Lease.acquire(tmp_path, pid=holder.pid)
    with pytest.raises(RunLocked):
        Lease.acquire(tmp_path)
    holder.kill()
    holder.wait()
    lease = Lease.acquire(tmp_path)
    assert f"took over the lease of {tmp_path} (pid {holder.pid} on" in capsys.readouterr().err
    assert read(tmp_path)["pid"] == os.getpid()
    lease.release()


def test_a_live_worker_of_a_dead_holder_keeps_the_lease(tmp_path):
    worker = _sleeper()
    try:
        holder = _sleeper()
        holder.kill()
        holder.wait()
        write_lease(tmp_path, pid=holder.pid, workers=[worker.pid])
        with pytest.raises(RunLocked):
            Lease.acquire(tmp_path)
    finally:
        worker.kill()
        worker.wait()
    Lease.acquire(tmp_path).release()


# ---- real launches


def _start(run_dir: Path | str, *overrides: str, cwd: Path = ROOT) -> subprocess.Popen:
    """p3d-train in its own process group, as a shell starts a foreground job."""
    return start_p3d_train(run_dir, *overrides, cwd=cwd, new_session=True)


def _wait_for(what, timeout: float, proc: subprocess.Popen) -> None:
    end = time.monotonic() + timeout
    while not what():
        if proc.poll() is not None:
            pytest.fail(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > end:
            pytest.fail("timed out")
        time.sleep(0.02)


def _no_traceback(out: str, run_dir: Path) -> None:
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    for log in (run_dir / "logs").glob("rank*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log


TINY = ("model=tiny", "mesh=single", "train.warmup_steps=3")


@pytest.mark.timeout(600)
def test_a_second_launch_into_a_running_run_is_refused_until_it_ends(tmp_path):
    run = tmp_path / "run"
    steps = 60
    first = _start(run, *TINY, f"train.steps={steps}")
    try:
        _wait_for(lambda: (run / LOCK_NAME).exists(), 120, first)
        assert not (run / "metrics.jsonl").exists()  # the race the old check lost: the first has written no metrics
        started = time.monotonic()
        # from another working directory, with a relative run.dir naming the same directory
        rivals = {
            resume: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "p3d.cli",
                    "run.dir=run",
                    *TINY,
                    f"train.steps={steps}",
                    f"train.resume={resume}",
                ],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for resume in ("none", "auto")
        }
        for resume, rival in rivals.items():
            _, err = rival.communicate(timeout=120)
            took = time.monotonic() - started
            print(f"resume={resume}: refused after {took:.1f} s")
            assert rival.returncode == exit_codes.CONFIG_ERROR, err[-2000:]
            assert f"is in use by p3d-train (pid {first.pid} on {socket.gethostname()}, started " in err
            assert len(err.strip().splitlines()) == 1, err
            assert took < 60
        assert first.poll() is None  # refused while the first still ran
        out, _ = first.communicate(timeout=300)
    finally:
        kill_run(first, run)
    assert first.returncode == 0, out[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, steps + 1))  # nobody else wrote there
    assert not (run / LOCK_NAME).exists()  # released when the last worker exited

    resumed = p3d_train(f"run.dir={run}", *TINY, f"train.steps={steps + 2}", "train.resume=auto", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step {steps}" in resumed.stdout


@pytest.mark.timeout(600)
def test_the_lease_of_a_sigkilled_run_is_taken_over_with_a_note(tmp_path):
    run = tmp_path / "run"
    first = _start(run, *TINY, "train.steps=2000", "train.save_every=2")
    try:
        _wait_for(lambda: checkpoint.find(run, "auto") is not None, 180, first)
        workers = list(worker_pids(run).values())
        assert workers
        os.kill(first.pid, signal.SIGKILL)  # the launcher dies; its worker still trains: the lease holds
        first.wait()
        refused = p3d_train(f"run.dir={run}", *TINY, "train.steps=2000", "train.resume=auto", timeout=120)
        assert refused.returncode == exit_codes.CONFIG_ERROR, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert f"pid {first.pid}" in refused.stderr
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while worker_pids(run) and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        kill_run(first, run)
    assert (run / LOCK_NAME).exists()  # left behind: nobody released it
    step = checkpoint.verify(checkpoint.find(run, "auto"))["step"]
    taken = p3d_train(f"run.dir={run}", *TINY, f"train.steps={step + 2}", "train.resume=auto", timeout=300)
    assert taken.returncode == 0, taken.stdout[-2000:] + taken.stderr[-2000:]
    assert f"p3d: took over the lease of {run} (pid {first.pid} on {socket.gethostname()}" in taken.stderr
    assert "are gone" in taken.stderr
    assert f"resumed from step {step}" in taken.stdout
    assert not (run / LOCK_NAME).exists()


CTRL_C_STEPS = 24

DP2 = ("model=tiny", "mesh=dp2", "train.warmup_steps=3")


@pytest.mark.timeout(600)
def test_ctrl_c_once_saves_the_step_and_resume_continues_bitwise(tmp_path):
    straight = p3d_train(f"run.dir={tmp_path / 'a'}", *DP2, f"train.steps={CTRL_C_STEPS}", timeout=300)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]

    run = tmp_path / "b"
    proc = _start(run, *DP2, f"train.steps={CTRL_C_STEPS}")
    try:
        wait_for_steps(run, 3, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_run(proc, run)
    assert proc.returncode == exit_codes.PREEMPTED, out[-3000:]
    assert out.count("p3d: Ctrl-C: the workers finish the step in flight, save a checkpoint and stop") == 1
    assert "after a stop signal" in out
    _no_traceback(out, run)
    stopped_at = checkpoint.verify(checkpoint.find(run, "auto"))["step"]
    assert 3 <= stopped_at < CTRL_C_STEPS
    assert [r["step"] for r in read_metrics(run)] == list(range(1, stopped_at + 1))  # the step in flight finished

    resumed = p3d_train(f"run.dir={run}", *DP2, f"train.steps={CTRL_C_STEPS}", "train.resume=auto", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout
    a, b = read_metrics(tmp_path / "a"), read_metrics(run)
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, CTRL_C_STEPS + 1))
    for x, y in zip(a, b):  # bitwise: the same floats, not just close ones
        assert (y["loss"], y["grad_norm"], y["lr"], y["samples"]) == (x["loss"], x["grad_norm"], x["lr"], x["samples"])


@pytest.mark.slow  # slow tier: kept: the Ctrl-C-twice sweep at four delays, which checks what is on disk
@pytest.mark.timeout(600)
def test_ctrl_c_twice_stops_at_once_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Rank 0 sleeps 0.4 s in each of its 4 forward passes (the P3D_TEST_SLOW_RANK hook), so the step in flight
    when the first Ctrl-C lands, just after step 5 is logged, still has over a second to run: the second press,
    0.05 s later, must abort it. (With 0.05 s steps the first press's save could end before the second press,
    and the run then rightly ends saved, with status 75: test_second_ctrl_c_after_the_save_says_so.)"""
    monkeypatch.setenv(SLOW_ENV, "0:0.4")
    run = tmp_path / "run"
    proc = _start(run, *DP2, "train.steps=2000", "train.save_every=3")
    try:
        _wait_for(lambda: checkpoint.find(run, "auto") is not None, 180, proc)
        wait_for_steps(run, 5, proc)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        second = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - second
    finally:
        kill_run(proc, run)
    print(f"stopped {took:.2f} s after the second Ctrl-C")
    assert took < 5, out[-3000:]
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "p3d: second Ctrl-C: stopping the workers at once, without finishing the step in flight" in out
    newest = checkpoint.find(run, "auto")
    assert f"p3d: the newest complete checkpoint is {newest} (step " in out, out[-3000:]
    _no_traceback(out, run)
    assert not worker_pids(run)
    assert not (run / LOCK_NAME).exists()
    found = checkpoint.find(run, "auto")
    meta = checkpoint.verify(found)  # the previous checkpoint: complete, every file at its size
    assert meta["step"] % 3 == 0 and meta["step"] <= len(read_metrics(run))
    resumed = p3d_train(f"run.dir={run}", *DP2, f"train.steps={meta['step'] + 1}", "train.resume=auto", timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from step {meta['step']}" in resumed.stdout


def test_second_ctrl_c_after_the_save_says_so():
    """The second press comes after every worker saved and exited (status 75): nothing is aborted, no line
    claims a lost step, and the launcher still ends with PREEMPTED (launch_local reads the workers' status)."""
    console = io.StringIO()
    procs = {r: subprocess.Popen([sys.executable, "-c", f"raise SystemExit({exit_codes.PREEMPTED})"]) for r in range(2)}
    for p in procs.values():
        p.wait()
    signals = StopSignals(procs, console)
    signals._handle(signal.SIGINT, None)
    signals._handle(signal.SIGINT, None)
    assert not signals.aborted
    lines = console.getvalue().splitlines()
    assert lines[1] == "p3d: second Ctrl-C: the workers had already saved a checkpoint and stopped", lines
    assert "stopping the workers" not in console.getvalue()


def _worker_like() -> subprocess.Popen:
    """A sleeper in its own session, as launch_local starts workers (StopSignals signals their groups)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_second_ctrl_c_kills_running_workers():
    console = io.StringIO()
    procs = {r: _worker_like() for r in range(2)}
    signals = StopSignals(procs, console)
    try:
        signals._handle(signal.SIGINT, None)  # SIGTERM to each worker's group: a sleeper just dies of it
        for p in procs.values():
            p.wait(timeout=30)
        procs[2] = _worker_like()  # one still running when the second press comes
        signals._handle(signal.SIGINT, None)
        assert procs[2].wait(timeout=30) == -signal.SIGKILL
    finally:
        for p in procs.values():
            p.kill()
    assert signals.aborted
    assert "stopping the workers at once" in console.getvalue().splitlines()[1]


def _settled_as_said(out: str, run: Path, keep_last: int) -> None:
    """What a stopped run says is on disk is on disk: the newest complete checkpoint it names is complete and
    ``latest`` names it, at most ``keep_last`` are kept, nothing of an unfinished save or prune is left."""
    root = checkpoint.root(run)
    complete = checkpoint.complete_checkpoints(root)
    assert complete and len(complete) <= keep_last, (complete, out[-3000:])
    assert not list(root.glob(".step_*")) and not list(root.glob(".pruned-*")), list(root.iterdir())
    assert (root / checkpoint.LATEST).read_text().strip() == complete[-1].name
    checkpoint.verify(complete[-1])  # every file at its size
    named = [ln for ln in out.splitlines() if "the newest complete checkpoint is" in ln or "saved checkpoint" in ln]
    assert named and str(complete[-1]) in named[-1], (named, complete[-1])


CTRL_C_DELAYS = {"fast": (0.0, 0.2, 0.25, 0.3), "slow": (0.02, 0.05, 0.1, 0.15, 0.35, 0.4, 0.5, 0.7, 1.0)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "delays",
    [CTRL_C_DELAYS["fast"], pytest.param(CTRL_C_DELAYS["slow"], marks=pytest.mark.slow)],
    ids=list(CTRL_C_DELAYS),
)
def test_ctrl_c_twice_at_any_delay_says_what_is_on_disk_and_keeps_keep_last(tmp_path, delays):
    """Issue 31: the second press 0.3 s after the first said "no checkpoint was written" beside a complete
    step_00000059 with three checkpoints kept (the kill came between the save's rename and its pruning); at
    0.25 s the launcher's atexit functions printed a KeyboardInterrupt. A save every step puts the presses in
    every part of a save and of the teardown: at each delay the run ends 130 (killed) or 75 (it had saved), with
    no traceback, the checkpoints settled as it says and no worker left."""
    for delay in delays:
        run = tmp_path / f"d{delay}"
        proc = _start(run, *TINY, "train.steps=100000", "train.save_every=1", "train.keep_last=2")
        try:
            root = checkpoint.root(run)
            _wait_for(lambda root=root: len(checkpoint.complete_checkpoints(root)) >= 2, 180, proc)
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            kill_run(proc, run)
        assert proc.returncode in (exit_codes.PREEMPTED, 128 + signal.SIGINT), (delay, out[-3000:])
        _no_traceback(out, run)
        assert "Exception ignored" not in out, (delay, out[-3000:])
        _settled_as_said(out, run, keep_last=2)
        assert not worker_pids(run) and not (run / LOCK_NAME).exists()
