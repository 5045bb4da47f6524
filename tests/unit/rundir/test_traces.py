"""A traced step's file (issue 56): every rank's part merged into one Chrome trace that Perfetto opens: one process
per rank named by its (pp, dp, cp, tp) coordinates and sorted by them, two named threads, complete events in µs,
the logging rank's figures, the ranks whose part is missing named; parts a stopped run left are merged later."""

from __future__ import annotations

import json

from p3d.rundir.files import trace_part_path, trace_path
from p3d.rundir.traces import merge, merge_left_over, rank_events, read_trace, traced_steps, write_part


def part(rank: int, pp: int, dp: int, step: int = 3, world: int = 4, figures: dict | None = None) -> dict:
    return {
        "step": step,
        "rank": rank,
        "world_size": world,
        "coords": {"pp": pp, "dp": dp, "cp": 0, "tp": 0},
        "step_s": 0.5,
        "events": [
            ["schedule", "F", f"{pp}F0", 10.0, 100.0, {"micro_batch": 0, "chunk": pp}],
            ["collectives", "dp", "all_reduce", 200.0, 20.0, {}],
            ["schedule", "wait", "p2p wait", 120.0, 30.0, {}],
        ],
        "planned": [f"{pp}F0", f"{pp}B0"],
        "run": {"schedule": "1f1b", "mesh": "dp2_pp2"},
        "figures": figures or {},
    }


def test_the_parts_merge_into_one_chrome_trace_of_one_process_per_rank(tmp_path):
    # ranks 0..3 of dp2_pp2: rank = pp * 2 + dp; rank 2 (the logging rank, pp 1 dp 0) carries the figures
    for rank in (3, 0, 2, 1):
        figures = {"bubble": 0.25, "step_time_s": 0.5} if rank == 2 else None
        write_part(tmp_path, part(rank, rank // 2, rank % 2, figures=figures))
    path = merge(tmp_path, 3, world_size=4)
    assert path == trace_path(tmp_path, 3) and not trace_part_path(tmp_path, 3, 0).parent.exists()
    trace = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r} (pp {r // 2}, dp {r % 2}, cp 0, tp 0)" for r in range(4)}
    sort = {e["pid"]: e["args"]["sort_index"] for e in trace["traceEvents"] if e.get("name") == "process_sort_index"}
    assert sorted(sort, key=sort.get) == [0, 1, 2, 3]  # (pp, dp, cp, tp) order
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert threads[(1, 0)] == "schedule" and threads[(1, 1)] == "collectives"
    events = rank_events(trace)
    assert [e["name"] for e in events[2]] == ["1F0", "p2p wait", "all_reduce"]  # in time order
    first = events[2][0]
    assert first["ph"] == "X" and first["cat"] == "F" and (first["ts"], first["dur"]) == (10.0, 100.0)
    assert first["args"] == {"micro_batch": 0, "chunk": 1} and events[2][2]["tid"] == 1
    meta = trace["otherData"]["p3d"]
    assert meta["step"] == 3 and meta["figures"] == {"bubble": 0.25, "step_time_s": 0.5}
    assert meta["ranks"]["3"]["planned"] == ["1F0", "1B0"] and meta["missing_ranks"] == []
    assert traced_steps(tmp_path) == [3] and read_trace(path) == trace


def test_a_missing_part_is_named_and_a_stopped_runs_parts_merge_later(tmp_path):
    write_part(tmp_path, part(0, 0, 0, step=5, world=2))
    assert traced_steps(tmp_path) == []
    assert merge_left_over(tmp_path) == [trace_path(tmp_path, 5)]
    assert read_trace(trace_path(tmp_path, 5))["otherData"]["p3d"]["missing_ranks"] == [1]
    assert merge(tmp_path, 6) is None  # no parts, no file
