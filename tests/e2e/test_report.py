"""A local ``p3d-train -m`` sweep (cluster=local, points in sequence) that skips an infeasible point and ends in the
report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers.runs import p3d_train


@pytest.mark.timeout(240)
def test_local_multirun_runs_points_in_sequence_skips_infeasible_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    result = p3d_train("-m", "mesh=single,tp8_pp1,pp2", "train.steps=2", f"hydra.sweep.dir={sweep}", timeout=220)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]  # only skipped points: 2
    assert "p3d: skipped this point, config error: mesh.tp=8 (mesh/tp8_pp1.yaml) must divide" in result.stderr
    assert result.stderr.rstrip().endswith("p3d: 1 of 3 sweep points not done (1 skipped: point 1); exit status 2")
    table_text = result.stdout[result.stdout.index("p3d-report:") :]
    # the axes apart (ranks, pp) in columns, the rest in one line
    assert "every point: dp1 tp1 cp1 ep1, ZeRO-0, 1f1b v=1, recompute none" in table_text, table_text
    assert re.search(r"^0\s+single\s+1\s+1\s+[\d,]+.*2/2\s+done$", table_text, re.M), table_text
    assert re.search(r"^1\s+tp8_pp1 .*skipped: mesh.tp=8 \(mesh/tp8_pp1.yaml\) must divide", table_text, re.M)
    assert re.search(r"^2\s+pp2\s+2\s+2\s+[\d,]+.*2/2\s+done$", table_text, re.M), table_text
    # in sequence: point 2 started after point 0 finished
    assert (sweep / "0" / "metrics.jsonl").stat().st_mtime <= (sweep / "2" / "run_spec.yaml").stat().st_mtime
    assert json.loads((sweep / "1" / "p3d_status.json").read_text())["status"] == "skipped"
    assert (sweep / "report.csv").is_file() and (sweep / "report.png").is_file()
    again = subprocess.run(
        [sys.executable, "-m", "p3d.cli.report", str(sweep), "--no-plot"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0 and again.stdout.count(" done") == 2, again.stdout
