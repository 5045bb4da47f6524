"""The shape of a run as the commands see it: the bubble is one number in metrics.jsonl and p3d-plan, and the
launcher's checks import neither torch nor datasets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

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
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]


def test_the_launchers_checkpoint_check_imports_no_torch(tmp_path):
    """model.init_from: the launcher checks every tensor's name and shape from the safetensors headers (issue 61)
    without torch: a Qwen3 checkpoint is read whole, and one relabelled llama refused, in a process that never
    imports it."""
    from safetensors.torch import save_file

    from p3d.config.schema import ModelConfig
    from p3d.hf.architectures import BY_FAMILY
    from p3d.hf.check import expected_tensors
    from p3d.hf.config_json import hf_config

    m = ModelConfig(family="qwen3", qk_norm=True, head_dim=16)
    hf = tmp_path / "qwen3"
    hf.mkdir()
    save_file({n: torch.zeros(s) for n, s in expected_tensors(m, BY_FAMILY["qwen3"]).items()}, hf / "model.safetensors")
    config = hf_config(m)
    (hf / "config.json").write_text(json.dumps(config))
    relabelled = tmp_path / "relabelled"
    shutil.copytree(hf, relabelled)
    (relabelled / "config.json").write_text(
        json.dumps(config | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    code = f"""
import sys
from p3d.layout.run_plan import P3DConfigError
from tests.helpers.runs import typed
cfg, _ = typed("model.init_from={hf}", run_dir="{tmp_path / "run"}")
assert cfg.model.qk_norm and cfg.model.head_dim == 16
try:
    typed("model.init_from={relabelled}", run_dir="{tmp_path / "run"}")
except P3DConfigError as exc:
    assert "k_norm.weight" in str(exc), exc
print(sorted({{"torch", "deepspeed", "safetensors.torch"}} & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]
