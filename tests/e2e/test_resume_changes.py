"""A resumed run continues the run it says it continues, also when the resume changes the config: the new lr
schedule from the resumed step, the samples after the last trained one under a new global batch size and dp,
train.steps not above the checkpoint refused, a field that may not change refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from p3d import exit_codes
from p3d.checkpoint import find as checkpoint
from p3d.config.schema import LRDecay, TrainConfig
from p3d.data.loader import sample_stream
from p3d.rundir.spec import read_spec
from p3d.train.metrics import read_metrics
from p3d.train.optim import lr_factor
from tests.helpers.runs import ROOT

BASE = ("model=tiny", "mesh=single", "train.steps=3")  # lr 3e-3, 20 warmup steps, global batch 16


def user_train(cwd: Path, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """``p3d-train`` as a user types it, from their own directory (relative run.dir)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A 3-step run r1 with its step-3 checkpoint."""
    home = tmp_path_factory.mktemp("base")
    result = user_train(home, *BASE, "run.dir=r1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return home / "r1"


@pytest.fixture
def home(base_run, tmp_path) -> Path:
    """A user directory holding a copy of r1."""
    shutil.copytree(base_run, tmp_path / "r1")
    return tmp_path


# ---- end to end
@pytest.mark.timeout(300)
def test_a_new_lr_applies_from_the_next_step(home):
    """lr, warmup, decay and steps changed at step 3: every step's lr is its segment's schedule formula."""
    r = user_train(
        home,
        *BASE[:2],
        "train.steps=6",
        "train.lr=1e-2",
        "train.warmup_steps=4",
        "train.decay=linear",
        "train.resume=auto",
        "run.dir=r1",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for line in (
        "p3d: train.steps: 3 -> 6 from step 4",
        "p3d: train.lr: 0.003 -> 0.01 from step 4",
        "p3d: train.warmup_steps: 20 -> 4 from step 4",
        "p3d: train.decay: cosine -> linear from step 4",
    ):
        assert line in r.stdout
    assert r.stdout.index("p3d: train.lr") < r.stdout.index("starting 1 workers")  # said before the launch
    logged = {m["step"]: m["lr"] for m in read_metrics(home / "r1")}
    old = TrainConfig(steps=3)
    new = TrainConfig(steps=6, lr=1e-2, warmup_steps=4, decay=LRDecay.linear)
    # warmup (step + 1) / warmup_steps, then linear decay to min_lr_ratio = 0.1 over steps - warmup_steps
    formula = {1: 3e-3 / 20, 2: 3e-3 * 2 / 20, 3: 3e-3 * 3 / 20, 4: 1e-2 * 4 / 4, 5: 1e-2, 6: 1e-2 * (0.1 + 0.9 / 2)}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, lr in logged.items():
        cfg = old if step <= 3 else new
        assert lr == pytest.approx(cfg.lr * lr_factor(step - 1, cfg), rel=1e-12), step
        assert lr == pytest.approx(formula[step], rel=1e-12), step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,mesh", [(32, "dp2"), (8, "single")])
def test_a_new_global_batch_and_dp_train_on_the_next_samples(home, batch, mesh):
    """Resumed with another global batch (and dp): the logged samples stay true, and the loss of the first
    resumed step is the step-3 model's loss on samples [48, 48 + batch) of the stream."""
    from p3d.hf.export import load_sequential

    r = user_train(
        home,
        "model=tiny",
        f"mesh={mesh}",
        "train.steps=4",
        f"schedule.global_batch_size={batch}",
        "train.resume=auto",
        "run.dir=r1",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"p3d: schedule.global_batch_size: 16 -> {batch} from step 4" in r.stdout
    records = read_metrics(home / "r1")
    assert [m["samples"] for m in records] == [16, 32, 48, 48 + batch]
    assert checkpoint.verify(checkpoint.step_dir(home / "r1", 4))["samples"] == 48 + batch

    cfg, _ = read_spec(home / "r1")
    model = load_sequential(checkpoint.step_dir(home / "r1", 3))
    windows = torch.stack(list(islice(sample_stream(cfg.data, cfg.model.seq_len, cfg.train.seed, start=48), batch)))
    with torch.no_grad():
        losses = [float(model.loss(mb[:, :-1], mb[:, 1:])) for mb in windows.split(cfg.schedule.micro_batch_size)]
    assert records[3]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("steps", [3, 2])
def test_train_steps_not_above_the_checkpoint_is_refused_and_writes_nothing(home, steps):
    spec = (home / "r1" / "run_spec.yaml").read_bytes()
    metrics = (home / "r1" / "metrics.jsonl").read_bytes()
    r = user_train(home, *BASE[:2], f"train.steps={steps}", "train.resume=auto", "run.dir=r1", timeout=90)
    assert r.returncode == exit_codes.CONFIG_ERROR
    (line,) = r.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(
        f"p3d: config error: train.steps={steps} (command line) is not above the step of the checkpoint "
    )
    assert line.endswith("r1/checkpoints/step_00000003 (3): nothing to train; set train.steps=4 or more to train on")
    assert "starting" not in r.stdout
    assert (home / "r1" / "run_spec.yaml").read_bytes() == spec and (
        home / "r1" / "metrics.jsonl"
    ).read_bytes() == metrics
    assert not (home / "r1" / "specs" / "from_step_00000003.yaml").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override,old", [("train.seed=7", "1234"), ("model.seq_len=32", "64")])
def test_a_field_that_may_not_change_is_refused(home, override, old):
    spec = (home / "r1" / "run_spec.yaml").read_bytes()
    r = user_train(home, *BASE[:2], "train.steps=5", override, "train.resume=auto", "run.dir=r1", timeout=90)
    assert r.returncode == exit_codes.CONFIG_ERROR, r.stdout[-1000:]
    field = override.split("=")[0]
    assert len(r.stderr.strip().splitlines()) == 1
    assert f"r1/checkpoints/step_00000003 ({old}) and may not change on resume" in r.stderr
    assert f"resume with {field}={old} or start a new run.dir" in r.stderr
    assert (home / "r1" / "run_spec.yaml").read_bytes() == spec
