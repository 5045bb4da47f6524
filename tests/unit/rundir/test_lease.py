"""One run per run directory (p3d.rundir.lease), in-process: a held lease, a lease of another host, an unreadable
one, the heartbeat, a requeued Slurm job's own lease and one handed to a submitted job."""

from __future__ import annotations

import os
import socket
import time

import pytest

from p3d.rundir.lease import LOCK_NAME, STALE_S, Lease, RunLocked, read
from tests.helpers.leases import write_lease


def test_a_held_lease_refuses_a_second_holder_until_released(tmp_path):
    lease = Lease.acquire(tmp_path / "run")
    with pytest.raises(RunLocked) as refused:
        Lease.acquire(tmp_path / "run")
    msg = str(refused.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}, started " in msg and "choose another run.dir" in msg
    assert "\n" not in msg
    lease.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    Lease.acquire(tmp_path / "run").release()
    assert not list((tmp_path / "run").glob(".run.lock*"))  # no temporary files left behind


@pytest.mark.parametrize("age,taken", [(STALE_S + 5, True), (5, False)])
def test_a_lease_from_another_host_is_stale_only_without_heartbeat(tmp_path, capsys, age, taken):
    write_lease(tmp_path, host="node-elsewhere", pid=4242, heartbeat=time.time() - age)
    if not taken:
        with pytest.raises(RunLocked, match="pid 4242 on node-elsewhere"):
            Lease.acquire(tmp_path)
        return
    Lease.acquire(tmp_path).release()
    assert "no heartbeat for" in capsys.readouterr().err


def test_an_unreadable_lease_is_taken_over_only_once_it_is_old(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text("")  # e.g. torn by a crash on a file system without hard links
    os.utime(tmp_path / LOCK_NAME, (time.time() - 60, time.time() - 60))
    Lease.acquire(tmp_path).release()
    assert "an unreadable lease" in capsys.readouterr().err


def test_the_heartbeat_renews_the_lease_and_notices_losing_it(tmp_path, capsys):
    lease = Lease.acquire(tmp_path).start_heartbeat(interval=0.05)
    first = read(tmp_path)["heartbeat"]
    time.sleep(0.5)
    assert read(tmp_path)["heartbeat"] > first
    write_lease(tmp_path, pid=os.getpid(), token="someone-else")
    time.sleep(0.5)
    assert "lost the lease" in capsys.readouterr().err
    lease.release()
    assert read(tmp_path)["token"] == "someone-else"  # not ours to remove


def test_a_requeued_slurm_job_takes_over_its_own_lease(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "90001")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    Lease.acquire(tmp_path)  # the first start of the job; still alive (this process)
    with pytest.raises(RunLocked, match="Slurm job 90001"):
        Lease.acquire(tmp_path)  # a second run inside the same job and start is refused
    monkeypatch.setenv("SLURM_JOB_ID", "90002")
    with pytest.raises(RunLocked):
        Lease.acquire(tmp_path)  # another job
    monkeypatch.setenv("SLURM_JOB_ID", "90001")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lease = Lease.acquire(tmp_path)
    assert "this Slurm job's own lease" in capsys.readouterr().err
    assert read(tmp_path)["slurm_restart"] == "1"
    lease.release()


def test_a_lease_handed_to_a_submitted_job_is_taken_by_that_job_only(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    lease = Lease.acquire(tmp_path).start_heartbeat(interval=0.05)
    lease.hand_to_job("777")
    lease.release()  # p3d-train exits after sbatch: the lease stays with the job
    assert read(tmp_path)["slurm_job"] == "777"
    with pytest.raises(RunLocked, match="Slurm job 777"):
        Lease.acquire(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    Lease.acquire(tmp_path).release()
