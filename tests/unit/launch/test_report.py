"""p3d-report (p3d.launch.report), in-process: the table, CSV and plot of a sweep, from the files each point leaves."""

from __future__ import annotations

import csv
import json
import re

import pytest

from p3d.cli.report import main
from p3d.launch.report import collect, table
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
    assert re.search(r"^1\s+pp2\s+1 x 2 x 2\s+1f1b\s+6,000\s+6.0%\s+0.30\s+-\s+4.0000\s+3/3\s+done$", text, re.M), text
    assert re.search(r"^3\s+tp8_pp1\s+-.*skipped: mesh.tp=8 must divide model.n_heads=8$", text, re.M), text
    assert text.splitlines()[-1] == "fastest: point 1, pp2 (dp=1 pp=2 tp=2, 1f1b): 6,000 tokens/s"


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
