"""A traced step of a real run (issue 56): ``p3d-train train.trace_steps=[2]`` writes ``traces/step_2.json``, which
holds one process per rank named by its coordinates; each rank's passes in the order its schedule plans them
(DeepSpeed's TrainSchedule, computed here; torch's ``pipeline_order``, recorded by the worker); no two events of one
track of a rank overlapping; a span equal to the step's ``step_time_s`` within 5%; waits that add up to the measured
bubble; and p3d-report draws and names its picture.

Every block sleeps ``P3D_TEST_BLOCK_SECONDS`` in each pass, so a pass lasts tens of milliseconds whatever the load of
the shared cores, and the step's few milliseconds of host work outside any event stay well inside the 5%.
"""

from __future__ import annotations

import io

import pytest

from p3d.compat.deepspeed_internals import deepspeed_pass_order
from p3d.rundir.files import read_metrics, timeline_path, trace_path
from p3d.rundir.traces import PASSES, rank_events, read_trace
from p3d.train.block_seconds import BLOCK_SECONDS_ENV
from tests.helpers.runs import output_tail, p3d_train, typed
from tests.helpers.tiers import with_slow

BLOCK_S = 0.02
CASES = {  # case -> overrides; 1f1b on DeepSpeed's engine in make test, torch's schedules in the slow tier
    "dp2_pp2_tp2-1f1b": ("mesh=dp2_pp2_tp2",),
    "pp2-interleaved_1f1b": ("mesh=pp2", "schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"),
    "pp2-zbv": ("mesh=pp2", "schedule.pipeline=zbv"),
    "dp2_ep2-moe": ("model=moe_tiny", "mesh=dp2", "mesh.ep=2"),  # the experts' all-to-alls: ep
    "dp2_cp2": ("mesh=dp2", "mesh.cp=2"),  # context parallel attention's gathers: cp
}
SLOW = ["pp2-interleaved_1f1b", "pp2-zbv", "dp2_ep2-moe", "dp2_cp2"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", with_slow(CASES, SLOW))
def test_a_traced_step_follows_its_schedule_and_spans_the_step(tmp_path, case):
    overrides = (*CASES[case], "train.steps=2", "train.trace_steps=[2]", "logger=none")
    result = p3d_train(f"run.dir={tmp_path}", *overrides, env={BLOCK_SECONDS_ENV: str(BLOCK_S)})
    assert result.returncode == 0, output_tail(result)
    cfg, plan = typed(*overrides)
    dims, m = plan.dims, plan.micro_batches
    trace = read_trace(trace_path(tmp_path, 2))
    meta = trace["otherData"]["p3d"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(names) == list(range(plan.world_size)) and meta["missing_ranks"] == []
    events = rank_events(trace)
    row = read_metrics(tmp_path)[1]
    waited = []
    for rank in range(plan.world_size):
        dp, pp, tp = dims.coords_of(rank)
        assert names[rank] == f"rank {rank} (pp {pp}, dp {dp}, cp {dims.cp_of(rank)}, tp {tp})"
        passes = [e["name"] for e in events[rank] if e["cat"] in PASSES]
        planned = meta["ranks"][str(rank)]["planned"]
        assert passes == planned, (rank, passes, planned)  # measured order == the schedule's own
        if case.endswith("1f1b") and cfg.schedule.virtual_stages == 1:
            assert planned == deepspeed_pass_order(m, plan.pp, pp)
        assert len(passes) == m * (cfg.schedule.virtual_stages or 1) * (3 if case.endswith("zbv") else 2)  # F B, F I W
        for tid in (0, 1):  # a track's events follow each other (µs, rounded to 1e-3 each)
            track = [(e["ts"], e["ts"] + e["dur"]) for e in events[rank] if e["tid"] == tid]
            assert all(b[0] >= a[1] - 0.01 for a, b in zip(track, track[1:])), (rank, tid)
        span_s = (max(e["ts"] + e["dur"] for e in events[rank]) - min(e["ts"] for e in events[rank])) / 1e6
        assert span_s == pytest.approx(meta["ranks"][str(rank)]["step_s"], rel=0.05), rank
        if rank == plan.logging_rank:
            assert span_s == pytest.approx(row["step_time_s"], rel=0.05)
        wait_s = sum(e["dur"] for e in events[rank] if e["cat"] in ("wait", "drain")) / 1e6
        waited.append(wait_s / meta["ranks"][str(rank)]["step_s"])
    kinds = {e["cat"] for evs in events.values() for e in evs}
    assert {"F", "B" if "I" not in kinds else "W", "optimizer"} <= kinds and (("I" in kinds) == case.endswith("zbv"))
    assert ({"wait", "drain"} <= kinds) == (plan.pp > 1), kinds  # no pipeline, no neighbour to wait on
    for dim, size in (("tp", plan.tp), ("dp", plan.dp), ("ep", plan.ep), ("cp", plan.cp)):
        assert (dim in kinds) == (size > 1), (dim, kinds)  # tp's all-reduces, dp's reduction, ep's all-to-alls, ...
    assert sum(waited) / len(waited) == pytest.approx(row["bubble"], rel=0.05)  # the waits drawn: the bubble
    assert meta["figures"]["bubble"] == row["bubble"] and meta["figures"]["step_time_s"] == row["step_time_s"]

    from p3d.launch.report import report

    out = io.StringIO()
    report(tmp_path, stream=out)
    assert f"timeline of point {tmp_path.name}: {timeline_path(tmp_path, 2)}" in out.getvalue()
    assert timeline_path(tmp_path, 2).stat().st_size > 10_000


ZERO_STAGES = ("stage0", "stage1", "stage2", "stage3")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", with_slow(ZERO_STAGES, ["stage0", "stage1", "stage3"]))
def test_the_simulated_block_sleeps_all_three_pieces_under_every_zero_stage(tmp_path, zero):
    """P3D_TEST_BLOCK_SECONDS=s: every block sleeps s in its forward and 2 s in its backward (B and W) under every
    ZeRO stage, as the trace of a step shows: each rank's F events last at least blocks x m x s, its B events
    blocks x m x 2 s (sleeps: lower bounds whatever the load). Under FSDP2 (ZeRO-2/3) the W sleep, a hook on a
    weight the model was built with, never ran: the backward was ~250 ms of the 400 its sleeps take."""
    s = 0.05
    overrides = ("mesh=dp2", f"zero={zero}", "schedule.micro_batch_size=8", "train.steps=2", "train.trace_steps=[2]")
    result = p3d_train(f"run.dir={tmp_path}", *overrides, "logger=none", env={BLOCK_SECONDS_ENV: str(s)})
    assert result.returncode == 0, output_tail(result)
    cfg, plan = typed(*overrides)
    blocks = cfg.model.n_layers * plan.micro_batches
    for rank, events in rank_events(read_trace(trace_path(tmp_path, 2))).items():
        seconds = {kind: sum(e["dur"] for e in events if e["cat"] == kind) / 1e6 for kind in ("F", "B")}
        assert seconds["F"] >= blocks * s * 0.99, (rank, seconds)
        assert seconds["B"] >= blocks * 2 * s * 0.99, (rank, seconds)


@pytest.mark.timeout(300)
def test_the_first_traced_step_of_a_process_lines_up_its_ranks(tmp_path):
    """Issue 64, item 5: ``p3d-train mesh=pp2 train.steps=2 train.trace_steps=[1]``. A later step's ranks set out
    together (the previous step's all-gather releases them); the first step of a process had nothing to line them up,
    and its timelines were tens of ms apart: the step gate's all-gather, which every rank leaves at once, ended at
    194.5 ms on rank 0 and 147.9 ms on rank 1, and rank 1 was drawn computing a forward rank 0 had not yet sent.
    Lined up: each micro batch's forward on rank 1 starts after rank 0's ends, each backward on rank 0 after rank 1's,
    and the gate's all-gather ends at the same time on both (within 15 ms)."""
    overrides = ("mesh=pp2", "train.steps=1", "train.trace_steps=[1]", "logger=none")
    result = p3d_train(f"run.dir={tmp_path}", *overrides, env={BLOCK_SECONDS_ENV: str(BLOCK_S)})
    assert result.returncode == 0, output_tail(result)
    events = rank_events(read_trace(trace_path(tmp_path, 1)))

    def spans(rank: int, kind: str) -> dict[int, tuple[float, float]]:
        return {e["args"]["micro_batch"]: (e["ts"], e["ts"] + e["dur"]) for e in events[rank] if e["cat"] == kind}

    slack_us = 1000.0
    for i, (start, _) in spans(1, "F").items():
        assert start >= spans(0, "F")[i][1] - slack_us, ("forward", i)
    for i, (start, _) in spans(0, "B").items():
        assert start >= spans(1, "B")[i][1] - slack_us, ("backward", i)
    gate_ends = [max(e["ts"] + e["dur"] for e in events[r] if e["name"] == "all_gather") for r in (0, 1)]
    assert abs(gate_ends[0] - gate_ends[1]) < 15_000, gate_ends
