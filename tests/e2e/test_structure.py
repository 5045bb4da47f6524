"""The shape of a run as the commands see it: the bubble is one number in metrics.jsonl and p3d-plan, and the
launcher's checks import neither torch nor datasets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.runs import ROOT, p3d_train


@pytest.mark.timeout(300)
def test_bubble_is_one_number_in_metrics_and_planner(tmp_path):
    """pp=4 with m=4 micro batches: metrics.jsonl's bubble_theory is p3d-plan's bubble, (p-1)/(m+p-1)."""
    args = ["mesh=pp4", "model=tiny", "schedule.micro_batch_size=1", "schedule.global_batch_size=4"]
    run = p3d_train(f"run.dir={tmp_path / 'run'}", "train.steps=1", "logger=none", *args)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    planned = subprocess.run(
        [sys.executable, "-m", "p3d.cli.plan", "format=json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert record["bubble_theory"] == json.loads(planned.stdout)["bubble"] == pytest.approx(3 / 7)


def test_the_launchers_checks_import_neither_torch_nor_datasets(tmp_path):
    """p3d-train's checks before any worker starts (the checkpoint to resume, the run directory, the data) read
    JSON, file sizes and text only. Importing torch there (for the checkpoint module) and datasets (for the
    stdlib corpus and plain-text files, which do not need it) cost the launcher 2.6 s of every run here, before
    the workers, which import torch themselves, could start."""
    notes = tmp_path / "notes.txt"
    notes.write_text("A line of the user's own notes, long enough for a window of tokens.\n" * 40)
    code = f"""
import sys
from tests.helpers.runs import typed
from p3d.launch.check import check_run
for data in (["data=stdlib"], ["data=files", "data.path={notes}"]):
    cfg, _ = typed("train.resume=auto", *data, run_dir="{tmp_path / "run"}")
    check_run(cfg)
print(sorted({{"torch", "datasets", "deepspeed", "transformers"}} & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
