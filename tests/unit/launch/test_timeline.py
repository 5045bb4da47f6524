"""The picture of a traced step (issue 56): p3d-report draws a PNG per traced step of a run, a row per rank, so its
height follows the rank count; drawn in-process from traces merged by p3d.rundir.traces, as a run writes them."""

from __future__ import annotations

import matplotlib.image

from p3d.cli.report import main
from p3d.launch.timeline import DPI, WIDTH_IN, draw, draw_run, figure_height, title_of
from p3d.rundir.files import timeline_path, trace_path
from p3d.rundir.traces import merge, read_trace, write_part
from tests.helpers.sweeps import make_point


def traced_run(run_dir, pp: int, dp: int, step: int = 2) -> None:
    """A run directory with the parts of one traced 1F1B step (m = 2) of every rank of a dp x pp mesh."""
    world = pp * dp
    for rank in range(world):
        stage, replica = divmod(rank, dp)
        t, events = 0.0, []
        for kind, mb in (("F", 0), ("F", 1), ("B", 0), ("B", 1)):
            events.append(["schedule", kind, f"{stage}{kind}{mb}", t, 40_000.0, {"micro_batch": mb, "chunk": stage}])
            events.append(["collectives", "tp", "all_reduce", t + 5_000.0, 1_000.0, {}])
            events.append(["schedule", "wait", "p2p wait", t + 40_000.0, 10_000.0, {}])
            t += 50_000.0
        events.append(["collectives", "dp", "all_reduce", t, 8_000.0, {}])
        events.append(["schedule", "optimizer", "optimizer step", t + 8_000.0, 2_000.0, {}])
        write_part(
            run_dir,
            {
                "step": step,
                "rank": rank,
                "world_size": world,
                "coords": {"pp": stage, "dp": replica, "cp": 0, "tp": 0},
                "step_s": t / 1e6,
                "events": events,
                "run": {"schedule": "1f1b", "virtual_stages": 1, "mesh": f"dp{dp}_pp{pp}", "dims": f"{world} ranks"},
                "figures": {"bubble": 0.2, "bubble_theory": 1 / 3, "step_time_s": 0.21} if rank == world - dp else {},
            },
        )


def test_the_picture_exists_and_its_height_follows_the_rank_count(tmp_path):
    heights = {}
    for world, (pp, dp) in {2: (2, 1), 8: (4, 2)}.items():
        run = tmp_path / f"run{world}"
        traced_run(run, pp, dp)
        assert draw_run(run) == [timeline_path(run, 2)]  # merged from the parts, then drawn
        png = matplotlib.image.imread(timeline_path(run, 2))
        assert png.shape[1] == round(WIDTH_IN * DPI)
        heights[world] = png.shape[0]
        assert heights[world] == round(figure_height([world]) * DPI), (world, png.shape)
    assert heights[8] - heights[2] == round(6 * (figure_height([2]) - figure_height([1])) * DPI)  # 6 more rows


def test_the_title_names_the_schedule_and_the_measured_bubble(tmp_path):
    traced_run(tmp_path, 2, 1)
    trace = read_trace(merge(tmp_path, 2))  # type: ignore[arg-type]
    assert title_of(trace) == "step 2: 1f1b on dp1_pp2 (2 ranks), measured bubble 20.0% (theory 33.3%), step 210 ms"
    stacked = draw([trace, trace, trace], tmp_path / "three.png", ["a", "b", "c"])  # docs' side by side: 3 panels
    assert matplotlib.image.imread(stacked).shape[0] == round(figure_height([2, 2, 2]) * DPI)
    assert trace_path(tmp_path, 2).is_file()


def test_a_sweeps_report_names_each_traced_points_picture_and_draws_none_for_the_others(tmp_path, capsys):
    traced, untraced = tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"
    make_point(tmp_path / "sweep", "0", status={"status": "done", "returncode": 0})
    make_point(tmp_path / "sweep", "1", tp=2, status={"status": "done", "returncode": 0})
    traced_run(traced, pp=2, dp=1)  # point 0 traced step 2 (its parts, not yet merged: p3d-report merges them)
    assert main([str(tmp_path / "sweep")]) == 0
    timelines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("timeline of")]
    assert timelines == [f"timeline of point 0: {timeline_path(traced, 2)}"]
    assert timeline_path(traced, 2).read_bytes()[:4] == b"\x89PNG" and not (untraced / "traces").exists()

    make_point(tmp_path / "plain", "0", status={"status": "done", "returncode": 0})  # a sweep traced nowhere
    assert main([str(tmp_path / "plain")]) == 0
    assert "timeline" not in capsys.readouterr().out
    assert list((tmp_path / "plain").rglob("*.png")) == [tmp_path / "plain" / "report.png"]  # the sweep's plot only
