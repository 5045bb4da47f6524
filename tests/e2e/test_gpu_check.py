"""`make gpu-check` on a machine without a GPU: its dry mode says so, names the steps it would run and
checks each step's config as p3d-train and p3d-plan would (issue 16). The real run needs a CUDA device."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_make_gpu_check_without_a_gpu_is_a_dry_run_of_every_step(tmp_path):
    docs = tmp_path / "gpu.md"
    proc = subprocess.run(
        ["make", "-C", str(ROOT), "gpu-check", f"ARGS=--out {tmp_path / 'out'} --docs {docs}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "no CUDA GPU found" in out
    for step in ("a", "b", "c", "e", "i"):  # i: float8 (train.fp8=tensorwise) on the preset's GPU
        assert f"gpu-check step {step}: dry: config ok" in out, out[-3000:]
    for step in ("f", "g", "h", "j"):  # the layer steps run with the CPU as the device: the code path, not a config
        assert f"gpu-check step {step}: dry: ran on the cpu" in out, out[-3000:]
    assert "predicted_peak_gb" in out and "predicted_speedup" in out and "all steps passed (dry)" in out
    assert not docs.exists()  # figures are written only by a run on a GPU


def test_a_refused_config_fails_its_step_and_the_table_says_why(tmp_path, monkeypatch):
    gpu_check = load_gpu_check()
    step = gpu_check.Step("a", "a step")
    monkeypatch.setattr(gpu_check, "THROUGHPUT", ["model=llama3_2_1b", "mesh=tp3"])
    with pytest.raises(RuntimeError, match="p3d-plan refused"):
        gpu_check.step_throughput(step, ["cluster.device=h200", "cluster.gpus_per_node=1"], tmp_path, True, 120)
    step.status = "failed: p3d-plan refused"
    ok = gpu_check.Step("b", "bf16", figures={"max_rel_loss_diff": 0.004}, status="passed")
    gpu_check.write_docs(tmp_path / "gpu.md", "NVIDIA H200", 1, {"torch": "2.11"}, [step, ok])
    text = (tmp_path / "gpu.md").read_text()
    assert "1 x NVIDIA H200" in text and "torch 2.11" in text
    assert "| a | a step | failed: p3d-plan refused |" in text and "max_rel_loss_diff 0.004" in text


def _untracked() -> set[str]:
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return {line[3:] for line in proc.stdout.splitlines() if line.startswith("??")}


def test_the_dry_mode_leaves_nothing_in_the_checkout(monkeypatch, capsys):
    """Issue 31, item 8f: ``make gpu-check`` on a CPU machine, run from the checkout, left ``gpu-check-out/``
    behind; a dry run now writes into a temporary folder it removes, a GPU run under ``outputs/`` (ignored).
    The steps are stubbed: only where the run writes is checked (the test above runs them)."""
    gpu_check = load_gpu_check()
    given: list[Path] = []

    def step(s, gpu, out, dry, timeout, *rest):
        given.append(out)
        (out / f"run_{len(given)}").mkdir()

    for name in ("step_throughput", "step_bf16", "step_nccl", "step_float8"):
        monkeypatch.setattr(gpu_check, name, step)
    monkeypatch.setattr(gpu_check, "step_sdpa", lambda s, dry: None)
    monkeypatch.setattr(gpu_check, "step_layer", lambda s, name, dry: None)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(ROOT)
    before = _untracked()
    assert gpu_check.main(["--dry"]) == 0
    assert "all steps passed (dry)" in capsys.readouterr().out
    assert len(set(given)) == 1 and ROOT not in given[0].parents and not given[0].exists()
    assert not (ROOT / "gpu-check-out").exists() and _untracked() <= before
    gpu_run = gpu_check.out_folder(None, dry=False, stack=contextlib.ExitStack())
    ignored = subprocess.run(["git", "check-ignore", "-q", str(gpu_run / "gpu_check.json")], cwd=ROOT)
    assert gpu_run.parent == ROOT / "outputs" and ignored.returncode == 0


def test_a_gpu_machine_whose_python_has_no_cuda_fails_with_the_reason(tmp_path, monkeypatch, capsys):
    """Issue 51: with a GPU present but a CPU build of torch in the chosen Python, the check used to fall back to its
    dry mode and exit 0; it fails and says why."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "gpus_on_machine", lambda: ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)"])
    monkeypatch.setattr(gpu_check, "device_preset", lambda: ("", "", 0))  # this torch sees no CUDA device
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "has 1 NVIDIA GPU(s)" in out and "has no CUDA" in out and "P3D_GPU_PYTHON" in out
    assert "all steps passed" not in out and not (tmp_path / "out").exists()  # refused before any step
