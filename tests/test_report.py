"""p3d-report: the table, CSV and plot of a sweep, from the files each point leaves; and a local
``p3d-train -m`` sweep (cluster=local, points in sequence) that skips an infeasible point and ends
in the report."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from p3d.cli.report import main
from p3d.launch.report import collect, table
from tests.conftest import p3d_train


def make_point(
    root,
    name,
    *,
    tp=1,
    pp=2,
    dp=1,
    steps=3,
    done_steps=3,
    tokens=(100.0, 2000.0, 3000.0),
    bubble=None,
    status=None,
    mesh="pp2",
):
    d = root / name
    d.mkdir(parents=True)
    spec = {
        "mesh": {"name": mesh, "tp": tp, "pp": pp, "dp": dp},
        "train": {"steps": steps},
        "run_plan": {"tp": tp, "pp": pp, "dp": dp, "world_size": tp * pp * dp},
    }
    (d / "run_spec.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(spec)))
    lines = []
    for step in range(1, done_steps + 1):
        rec = {
            "step": step,
            "loss": 7.0 - step,
            "tokens_per_s": tokens[step - 1],
            "mfu": tokens[step - 1] / 1e5,
            "peak_mem_gb": 0.1 * step,
        }
        if bubble is not None:
            rec["bubble"] = bubble
        lines.append(json.dumps(rec))
    if lines:
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if status:
        (d / "p3d_status.json").write_text(json.dumps(status))
    return d


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


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_local_multirun_runs_points_in_sequence_skips_infeasible_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    result = p3d_train("-m", "mesh=single,tp8_pp1,pp2", "train.steps=2", f"hydra.sweep.dir={sweep}", timeout=220)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]  # only skipped points: 2
    assert "p3d: skipped this point, config error: mesh.tp=8 (mesh/tp8_pp1.yaml) must divide" in result.stderr
    assert result.stderr.rstrip().endswith("p3d: 1 of 3 sweep points not done (1 skipped: point 1); exit status 2")
    table_text = result.stdout[result.stdout.index("p3d-report:") :]
    assert re.search(r"^0\s+single\s+1 x 1 x 1\s+[\d,]+.*2/2\s+done$", table_text, re.M), table_text
    assert re.search(r"^1\s+tp8_pp1 .*skipped: mesh.tp=8 \(mesh/tp8_pp1.yaml\) must divide", table_text, re.M)
    assert re.search(r"^2\s+pp2\s+1 x 2 x 1\s+[\d,]+.*2/2\s+done$", table_text, re.M), table_text
    # in sequence: point 2 started after point 0 finished
    assert (sweep / "0" / "metrics.jsonl").stat().st_mtime <= (sweep / "2" / "run_spec.yaml").stat().st_mtime
    assert json.loads((sweep / "1" / "p3d_status.json").read_text())["status"] == "skipped"
    assert (sweep / "report.csv").is_file() and (sweep / "report.png").is_file()
    again = subprocess.run(
        [sys.executable, "-m", "p3d.cli.report", str(sweep), "--no-plot"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and again.stdout.count(" done") == 2, again.stdout
