"""The rules behind tests/e2e/test_faults.py, in-process: the step policy, the straggler streaks, the hang summary."""

from __future__ import annotations

import json

import pytest

from p3d.parallel import hang
from p3d.parallel.mesh import Mesh
from p3d.train.faults import SpikeReference, StepPolicy, StepVerdict
from p3d.train.timing import StragglerWatch
from tests.helpers.runs import typed


def test_skip_policy_counts_discards_in_a_row_and_stops_after_max_skipped():
    cfg, _ = typed("train.on_nonfinite=skip", "train.max_skipped=2")
    policy = StepPolicy(cfg.train)
    bad = [StepVerdict(s, float("nan"), loss_stages=[1], discarded=True) for s in (1, 2)]
    assert [policy.apply(v)[0] for v in bad] == [False, False]
    assert not policy.apply(StepVerdict(3, 2.0))[0]  # an applied step ends the run of discards
    stops = [policy.apply(StepVerdict(s, 2.0, grad_stages=[0, 1], discarded=True))[0] for s in (4, 5, 6)]
    assert stops == [False, False, True]
    stop, line, fields = policy.apply(StepVerdict(7, 2.0, grad_stages=[0], discarded=True))
    assert stop and "step 7: non-finite gradient norm on stage 0; 4 steps in a row" in line
    assert fields == {"skipped": 1, "loss_spike": 0, "skip_reason": "non-finite", "skipped_steps": 6}


def test_a_loss_that_stays_up_stops_being_a_spike():
    """Issue 31's frozen run, replayed: a discarded step leaves the weights as they were, so the next loss is as
    high; judged against applied steps only, every step from then on was a spike. The window follows the losses
    seen: after the rise, at most window // 2 + 1 steps are spikes, then the loss is its own reference."""
    for window in (3, 4, 20):
        ref = SpikeReference(1.05, window)
        for loss in [3.60, 3.58, 3.57, 3.5696] * window:  # a settled run
            ref.seen(loss)
        spikes = []
        for _ in range(3 * window):
            spikes.append(ref.over(4.3) > 0)  # the loss after one bad update, held there by every discard
            ref.seen(4.3)
        assert spikes[0] and not any(spikes[window // 2 + 1 :]), (window, spikes)
    off = SpikeReference(0.0, 3)
    for loss in (1.0, 1.0, 1.0):
        off.seen(loss)
    assert off.over(100.0) == 0.0  # spike_factor=0: off
    short = SpikeReference(1.05, 3)
    short.seen(float("nan"))  # a non-finite loss never becomes the reference
    short.seen(1.0)
    assert short.over(100.0) == 0.0 and list(short.recent) == [1.0]


def test_spikes_discarded_in_a_row_beyond_max_skipped_stop_the_run():
    cfg, _ = typed("train.spike_factor=1.5", "train.on_spike=skip", "train.max_skipped=2")
    policy = StepPolicy(cfg.train)
    spike = [StepVerdict(s, 9.0, spike_over=3.0, discarded=True, grad_norm=2.5) for s in (1, 2, 3)]
    results = [policy.apply(v) for v in spike]
    assert [stop for stop, _, _ in results] == [False, False, True]
    assert "update discarded (1 in a row, train.max_skipped=2, its gradient norm 2.5 finite)" in results[0][1]
    stop, line, fields = results[2]
    assert line.startswith("error: step 3: loss spike 9.0000 > 1.5 x 3.0000") and "3 steps in a row" in line
    assert "raise train.spike_factor" in line
    assert fields["skip_reason"] == "loss spike" and fields["skipped"] == 1


def test_stop_policy_names_step_quantity_and_stages():
    cfg, _ = typed()
    stop, line, _ = StepPolicy(cfg.train).apply(StepVerdict(9, float("inf"), [1], [0, 1], discarded=True))
    assert stop
    assert line.startswith(
        "error: step 9: non-finite loss (inf) on stage 1 and non-finite gradient norm on stages 0, 1"
    )


def test_a_straggler_is_named_once_per_streak():
    _, plan = typed("mesh=dp2_pp2")
    watch = StragglerWatch(2.0, 3, plan)
    fast, slow = [0.1, 0.1, 0.1, 0.5], [0.1, 0.1, 0.1, 0.1]
    named = [watch.update(fast)[1] for _ in range(5)]
    assert [len(n) for n in named] == [0, 0, 1, 0, 0] and "rank 3 (dp 1, pp 1, tp 0) is a straggler" in named[2][0]
    fields, _ = watch.update(fast)
    assert fields == {"slowest_rank": 3, "slowest_ratio": 5.0, "stage_compute_s": pytest.approx([0.1, 0.3])}
    watch.update(slow)  # the streak ends; a new one is named again
    assert [len(watch.update(fast)[1]) for _ in range(3)] == [0, 0, 1]


def test_hang_summary_names_who_never_arrived(tmp_path):
    _, plan = typed("mesh=dp2_pp2")
    for rank, what, peers in ((0, "RecvGrad", [2]), (1, "ReduceGrads", [3])):
        report = {"rank": rank, "what": what, "step": 4, "micro_batch": 2, "peers": peers, "timeout_s": 20}
        hang.report_path(tmp_path, rank).write_text(json.dumps(report))
    reports = hang.read_reports(tmp_path)
    line = hang.summarize(reports, [2, 3], Mesh.from_plan(plan, 0))
    assert "Waiting: rank 0 in RecvGrad (step 4, micro batch 2) on rank 2; rank 1 in ReduceGrads" in line
    assert "Never arrived: rank 2 (dp 0, pp 1, tp 0, still running: stopped or stuck), rank 3 (" in line


def test_slurm_cause_is_the_first_task_srun_saw_end_by_a_signal(tmp_path):
    from p3d.jobs.restart import slurm_cause

    (tmp_path / "logs").mkdir()
    err = tmp_path / "srun.err"
    err.write_text("srun: error: vm: task 1: Killed\nsrun: error: vm: task 0: Exited with exit code 1\n")
    assert slurm_cause(tmp_path, err) == "rank 1 ended: Killed"
    err.write_text("srun: error: vm: task 0: Exited with exit code 1\nsrun: error: vm: task 1: Killed\n")
    log0 = tmp_path / "logs" / "rank0.log"
    lost = "[rank 0] worker failed: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1\n"

    def srun(attempt: int) -> str:  # the header p3d.rundir.attempts writes before each srun
        return f"[p3d 2025-01-01 12:00:00] p3d: attempt {attempt}: srun of 2 tasks, job 1 (start 0)\n"

    log0.write_text("[rank 0] worker failed: ValueError: bad data\n" + srun(2) + lost)
    assert slurm_cause(tmp_path, err) == "rank 1 ended: Killed"  # in any order; the survivor lost its peer
    log0.write_text(log0.read_text() + srun(3) + "[rank 0] worker failed: ValueError: bad data\n")
    assert slurm_cause(tmp_path, err) is None  # rank 0 raised an error of its own: srun's --wait killed rank 1
    log0.unlink()
    err.write_text("srun: error: Node failure on node7\n")
    assert slurm_cause(tmp_path, err) == "a lost node (srun: error: Node failure on node7)"
    (tmp_path / "logs" / "rank0.hang.json").write_text(json.dumps({"rank": 0, "peers": [1, 2]}))
    (tmp_path / "logs" / "rank1.hang.json").write_text(json.dumps({"rank": 1, "peers": [0, 2]}))
    assert slurm_cause(tmp_path, err) == "a hang (ranks 2 never arrived)"


def test_restart_decision_stops_on_a_repeat_and_when_restarts_are_used():
    from p3d.jobs.restart import decide

    assert decide((5, "rank 0 ended: Killed"), None, 0, 2)[0]
    again, line = decide((5, "rank 0 ended: Killed"), (5, "rank 0 ended: Killed"), 1, 2)
    assert not again and "again, as before the last restart" in line
    assert decide((6, "rank 0 ended: Killed"), (5, "rank 0 ended: Killed"), 1, 2)[0]  # another step: a new failure
    again, line = decide((7, "rank 0 ended: Killed"), (6, "rank 0 ended: Killed"), 2, 2)
    assert not again and "all 2 restarts" in line
