"""p3d-report (p3d.launch.report), in-process: the table, CSV and plot of a sweep, from the files each point leaves."""

from __future__ import annotations

import csv
import json
import re

import pytest

from p3d.cli.report import main
from p3d.launch.report import collect, table
from p3d.launch.report_plot import bar_labels
from p3d.launch.report_rows import AXES
from p3d.rundir.spec import write_spec
from tests.helpers.runs import typed
from tests.helpers.sweeps import make_point


def test_rows_from_spec_metrics_and_status(tmp_path):
    make_point(tmp_path, "0", status={"status": "done", "returncode": 0}, bubble=0.25)
    make_point(tmp_path, "1", tp=2, tokens=(50.0, 5000.0, 7000.0), status={"status": "done", "returncode": 0})
    make_point(tmp_path, "2", done_steps=1, status={"status": "failed", "returncode": 1})
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "p3d_status.json").write_text(
        json.dumps(
            {"status": "skipped", "returncode": 2, "reason": "mesh.tp=8 must divide model.n_heads=8", "mesh": "tp8_pp1"}
        )
    )
    make_point(tmp_path, "10", done_steps=2)  # no status file: inferred from the metrics
    (tmp_path / ".submitit").mkdir()
    rows = collect(tmp_path)
    assert [r.point for r in rows] == ["0", "1", "2", "3", "10"]  # numeric order, hidden dirs ignored
    r0, r1, r2, r3, r10 = rows
    assert r0.tokens_per_s == 2500.0 and r0.mfu == pytest.approx(0.025)  # median after the first step
    assert r0.bubble == 0.25 and r1.bubble is None
    assert r0.peak_mem_gb == pytest.approx(0.3) and r0.final_loss == 4.0 and (r0.steps, r0.total_steps) == (3, 3)
    assert (r0.dp, r0.pp, r0.tp) == (1, 2, 1) and r1.tp == 2
    assert (r2.status, r2.tokens_per_s, r2.steps) == ("failed", 100.0, 1)
    assert (r3.status, r3.mesh, r3.tokens_per_s) == ("skipped", "tp8_pp1", None)
    assert r10.status == "incomplete"
    text = table(rows)
    assert text.splitlines()[:2] == [
        "every point: dp1 pp2 cp1 ep1, ZeRO-0, 1f1b v=1, recompute none",  # what no two points differ in
        "point  mesh     ranks  tp  tokens/s   MFU  peak GB  bubble  final loss  steps  status",  # what they differ in
    ]
    assert re.search(r"^1\s+pp2\s+4\s+2\s+6,000\s+6.0%\s+0.30\s+-\s+4.0000\s+3/3\s+done$", text, re.M), text
    assert re.search(r"^3\s+tp8_pp1\s+-\s+-.*skipped: mesh.tp=8 must divide model.n_heads=8$", text, re.M), text
    assert text.splitlines()[-1] == (
        "fastest: point 1, pp2 (4 ranks: dp1 pp2 tp2 cp1 ep1, ZeRO-0, 1f1b v=1, recompute none): 6,000 tokens/s"
    )


def test_cli_writes_csv_and_png(tmp_path, capsys):
    make_point(tmp_path, "0", status={"status": "done", "returncode": 0})
    make_point(tmp_path, "1", tp=2, status={"status": "done", "returncode": 0})
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "p3d-report:" in out and "fastest: point 0" in out
    with open(tmp_path / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["point"] for r in rows] == ["0", "1"] and rows[0]["status"] == "done"
    assert float(rows[0]["tokens_per_s"]) == 2500.0
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(tmp_path / "nothing")]) == 2
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2


def test_layout_changes_are_counted_in_the_csv_and_printed_one_line_each(tmp_path, capsys):
    point = make_point(tmp_path, "0", status={"status": "done", "returncode": 0})
    records = [json.loads(line) for line in (point / "metrics.jsonl").read_text().splitlines()]
    layout = {"nodes": 2, "dp": 2, "pp": 2, "tp": 1, "cp": 1, "micro_batches": 4, "mesh": "dp2 x pp2 x tp1"}
    records[1]["layout_change"] = {
        "kind": "shrink",
        "cause": "node 1 lost",
        "at_step": 3,
        "resumed_step": 1,
        "steps_redone": 1,
        "old": layout,
        "new": {**layout, "nodes": 1, "dp": 1, "micro_batches": 8, "mesh": "dp1 x pp2 x tp1"},
        "time_lost_s": 12.5,
    }
    (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert (
        "layout change of 0: step 3: dp2 x pp2 x tp1 on 2 nodes -> dp1 x pp2 x tp1 on 1 node (node 1 lost), resumed "
        "from step 1, 8 micro batches per replica, 12.5 s lost, 1 step redone"
    ) in out
    with open(tmp_path / "report.csv") as f:
        row = next(csv.DictReader(f))
    assert (row["layout_changes"], row["time_lost_s"]) == ("1", "12.5") and "changes" not in row


def _swept(root, sweep: list[list[str]]):
    """A sweep's points as p3d-train freezes them (run_spec.yaml from the composed config), each with three steps'
    metrics, point i the i-th fastest."""
    for i, overrides in enumerate(sweep):
        point = root / str(i)
        point.mkdir()
        write_spec(*typed(*overrides, run_dir=str(point)), point)
        steps = [{"step": s, "loss": 5.0, "tokens_per_s": 1000.0 * (i + 1), "mfu": 0.01} for s in (1, 2, 3)]
        (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        (point / "p3d_status.json").write_text(json.dumps({"status": "done", "returncode": 0}))
    return collect(root)


def _lines_less_the_point(text: str) -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if re.match(r"\d+\s", line)]


def test_points_of_a_cp_sweep_print_apart(tmp_path):
    """Issue 50: ``-m mesh=dp2 mesh.cp=1,2`` printed ``dp2  2 x 1 x 1  1f1b`` for both points, the second 4 ranks."""
    rows = _swept(tmp_path, [["mesh=dp2", f"mesh.cp={cp}", "train.steps=3"] for cp in (1, 2)])
    text = table(rows)
    body = _lines_less_the_point(text)
    assert len(set(body)) == 2, text
    assert re.search(r"^point\s+mesh\s+ranks\s+cp\s+tokens/s", text, re.M), text
    assert re.search(r"^1\s+dp2\s+4\s+2\s+2,000", text, re.M), text
    assert "every point: dp2 pp1 tp1 ep1, ZeRO-0, 1f1b v=1, recompute none" in text
    assert text.splitlines()[-1] == (
        "fastest: point 1, dp2 (4 ranks: dp2 pp1 tp1 cp2 ep1, ZeRO-0, 1f1b v=1, recompute none): 2,000 tokens/s"
    )


def test_points_of_an_ep_and_zero_sweep_print_apart_in_the_table_csv_and_plot(tmp_path, capsys):
    """Issue 50: ``-m model=moe_tiny mesh=dp2 mesh.ep=1,2 zero=stage1,stage3`` printed four identical rows and a
    fastest line that did not say which. The CSV names every axis (AXES) of every point."""
    sweep = [
        ["model=moe_tiny", "mesh=dp2", f"mesh.ep={ep}", f"zero={z}", "train.steps=3"]
        for ep in (1, 2)
        for z in ("stage1", "stage3")
    ]
    rows = _swept(tmp_path, sweep)
    text = table(rows)
    assert len(set(_lines_less_the_point(text))) == 4, text
    assert re.search(r"^point\s+mesh\s+ep\s+ZeRO\s+tokens/s", text, re.M), text
    assert re.search(r"^2\s+dp2\s+2\s+1\s+3,000", text, re.M), text
    assert "fastest: point 3, dp2 (2 ranks: dp2 pp1 tp1 cp1 ep2, ZeRO-3, 1f1b v=1, recompute none)" in text
    labels, shared = bar_labels(rows)
    assert labels == [f"#{i} dp2 (ep{ep}, ZeRO-{z})" for i, (ep, z) in enumerate([(1, 1), (1, 3), (2, 1), (2, 3)])]
    assert shared == "2 ranks: dp2 pp1 tp1 cp1, 1f1b v=1, recompute none"
    assert main([str(tmp_path), "--no-plot"]) == 0
    capsys.readouterr()
    with open(tmp_path / "report.csv") as f:
        written = list(csv.DictReader(f))
    assert [{a: r[a] for a in AXES} for r in written] == [
        {
            "world_size": "2",
            "dp": "2",
            "pp": "1",
            "tp": "1",
            "cp": "1",
            "ep": str(ep),
            "zero_stage": str(z),
            "schedule": "1f1b",
            "v": "1",
            "recompute": "none",
        }
        for ep in (1, 2)
        for z in (1, 3)
    ]


def test_every_axis_that_varies_gets_a_column(tmp_path):
    """Hand-written specs apart in one axis each: schedule, v, recompute, pp and tp have their columns too."""
    make_point(tmp_path, "0", status={"status": "done", "returncode": 0})
    make_point(tmp_path, "1", pipeline="interleaved_1f1b", v=2, status={"status": "done", "returncode": 0})
    make_point(tmp_path, "2", recompute="full", status={"status": "done", "returncode": 0})
    make_point(tmp_path, "3", pp=1, tp=2, status={"status": "done", "returncode": 0})
    text = table(collect(tmp_path))
    assert re.search(r"^point\s+mesh\s+pp\s+tp\s+schedule\s+v\s+recompute\s+tokens/s", text, re.M), text
    assert re.search(r"^1\s+pp2\s+2\s+1\s+interleaved_1f1b\s+2\s+none\s", text, re.M), text
    assert "every point: 2 ranks: dp1 cp1 ep1, ZeRO-0" in text
    assert len(set(_lines_less_the_point(text))) == 4, text


def test_points_apart_in_no_axis_show_their_overrides(tmp_path):
    """A sweep of a field that is not an axis (zero.shard_size here) still prints two different rows."""
    for i, size in enumerate((1, 2)):
        make_point(
            tmp_path,
            str(i),
            status={"status": "done", "returncode": 0},
            overrides=["mesh=pp2", f"zero.shard_size={size}"],
        )
    text = table(collect(tmp_path))
    assert re.search(r"^point\s+mesh\s+overrides\s+tokens/s", text, re.M), text
    assert re.search(r"^1\s+pp2\s+zero.shard_size=2\s+2,500", text, re.M), text
    assert len(set(_lines_less_the_point(text))) == 2, text
