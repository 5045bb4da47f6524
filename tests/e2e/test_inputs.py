"""Inputs that used to crash or be silently ignored (issue 23), each from the command a user ran: W&B's
environment and failures, zero or negative numbers, p3d-plan on an impossible model, keys added with +, a sweep
with a skipped point, and p3d-report --csv into a missing folder. No traceback reaches the console."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p3d.layout.run_plan import P3DConfigError
from p3d.train.metrics import MetricsLogger, read_metrics
from tests.helpers.runs import p3d_train, typed
from tests.helpers.sweeps import make_point
from tests.helpers.wandb_log import FAKE_KEY, history

NO_SERVER = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    no_traceback(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _wandb_env(tmp_path, **env):
    return {"HOME": str(tmp_path), "WANDB_DIR": str(tmp_path / "wandb-home"), **env}  # no ~/.netrc


@pytest.mark.timeout(420)
def test_wandb_mode_disabled_writes_no_wandb_run(tmp_path):
    run = tmp_path / "run"
    result = p3d_train(
        "logger=wandb",
        f"run.dir={run}",
        "mesh=single",
        "train.steps=2",
        env=_wandb_env(tmp_path, WANDB_MODE="disabled"),
        drop_env="WANDB_",
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    no_traceback(result)
    assert "W&B disabled (WANDB_MODE=disabled)" in result.stdout
    assert not (run / "wandb").exists() and not list(tmp_path.rglob("*.wandb"))
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


@pytest.mark.timeout(420)
def test_wandb_mode_offline_with_an_api_key_runs_offline_without_network(tmp_path):
    # WANDB_MODE=offline WANDB_API_KEY=<key> p3d-train logger=wandb: an online attempt would fail here (no
    # server at WANDB_BASE_URL) and leave a warning; offline writes the run's file and never connects
    run = tmp_path / "run"
    t0 = time.monotonic()
    result = p3d_train(
        "logger=wandb",
        f"run.dir={run}",
        "mesh=single",
        "train.steps=2",
        env=_wandb_env(tmp_path, WANDB_MODE="offline", WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=NO_SERVER),
        drop_env="WANDB_",
        timeout=400,
    )
    elapsed = time.monotonic() - t0
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    no_traceback(result)
    assert "W&B failed" not in result.stdout and "CommError" not in result.stdout + result.stderr
    runs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and [r["_step"] for r in history(runs[0])] == [1, 2]
    print(f"offline W&B run of 2 steps: {elapsed:.1f} s")


@pytest.mark.timeout(420)
def test_wandb_that_cannot_start_does_not_stop_training(tmp_path):
    # logger.mode=online (above WANDB_MODE=offline) against a server that refuses connections: W&B fails
    # for real, after WANDB_INIT_TIMEOUT; training warns once and finishes with console and metrics.jsonl
    run = tmp_path / "run"
    env = _wandb_env(
        tmp_path, WANDB_MODE="offline", WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=NO_SERVER, WANDB_INIT_TIMEOUT="5"
    )
    result = p3d_train(
        "logger=wandb",
        "logger.mode=online",
        f"run.dir={run}",
        "mesh=single",
        "train.steps=2",
        env=env,
        drop_env="WANDB_",
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    no_traceback(result)
    warnings = [line for line in result.stdout.splitlines() if "W&B failed" in line]
    assert len(warnings) == 1, result.stdout
    assert "W&B failed to start in online mode (logger.mode=online)" in warnings[0]
    assert "training goes on" in warnings[0]
    assert [r["step"] for r in read_metrics(run)] == [1, 2] and "step     2/2" in result.stdout
    assert not list(run.rglob("offline-run-*"))  # logger.mode=online won over WANDB_MODE=offline


@pytest.mark.timeout(120)
def test_wandb_failing_during_the_run_warns_once_and_metrics_go_on(tmp_path, monkeypatch, capsys):
    for key, value in _wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    cfg, plan = typed("logger=wandb", "logger.mode=offline", "mesh=single", run_dir=str(tmp_path))
    metrics = MetricsLogger(tmp_path, cfg, plan)
    assert metrics.wandb is not None
    metrics.log(1, loss=5.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1)
    metrics.wandb.run.finish()  # the W&B run ends under the trainer (a real W&B error on the next log)
    for step in (2, 3):
        metrics.log(step, loss=4.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1)
    metrics.close()
    out = capsys.readouterr().out
    assert out.count("W&B failed to log step 2") == 1 and "W&B failed" not in out.split("W&B failed to log step 2")[1]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_log_every_zero_is_refused_before_any_worker(tmp_path):
    # p3d-train logger.log_every=0 (it used to kill every worker with ZeroDivisionError after step 1)
    run = tmp_path / "run"
    result = p3d_train("logger.log_every=0", f"run.dir={run}", timeout=100)
    assert result.returncode == 2
    assert one_error_line(result) == (
        "p3d: config error: logger.log_every=0 (command line) must be at least 1; try logger.log_every=1"
    )
    assert not run.exists()


# ---- 3. p3d-plan refuses what it cannot compute, with p3d-train's own line


def p3d_plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli.plan", *args], cwd=cwd, capture_output=True, text=True, timeout=100
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arg", ["model.hidden_size=0", "model.n_heads=0"])
def test_p3d_plan_refuses_a_zero_model_dimension(arg, tmp_path):
    result = p3d_plan(arg, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    line = one_error_line(result)
    assert line.startswith(f"p3d: config error: {arg} (command line) must be at least 1; try "), line
    train = p3d_train(arg, f"run.dir={tmp_path / 'run'}", timeout=100)
    assert train.returncode == 2 and one_error_line(train) == line  # the same rule, the same words
    assert list(tmp_path.iterdir()) == []  # neither wrote anything


@pytest.mark.timeout(120)
def test_p3d_plan_refuses_a_model_whose_heads_do_not_divide_it(tmp_path):
    result = p3d_plan("model.hidden_size=4", cwd=tmp_path)  # head dim 4 / 8 = 0
    assert (
        result.returncode == 2
        and "model.n_heads=8 (model/tiny.yaml) must divide model.hidden_size=4" in one_error_line(result)
    )


# ---- 4. keys added with + are checked like every other key
@pytest.mark.timeout(240)
def test_unknown_key_added_with_plus_is_refused(tmp_path):
    run = tmp_path / "run"
    result = p3d_train("+train.foo=1", f"run.dir={run}", timeout=100)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert one_error_line(result) == (
        "p3d: config error: train.foo=1 (command line) is not a p3d option; remove it (p3d-train --cfg job lists the "
        "options)"
    )
    assert not run.exists()
    plan = p3d_plan("+train.foo=1", cwd=tmp_path)
    assert plan.returncode == 2 and "train.foo=1 (command line) is not a p3d option" in one_error_line(plan)
    with pytest.raises(P3DConfigError, match=r"^train.step=5 is not a p3d option; .*try train.steps=5$"):
        typed("+train.step=5")  # a misspelt option: the nearest real one is suggested
    with pytest.raises(P3DConfigError, match=r"^foo=bar is not a p3d option"):
        typed("+foo=bar")


@pytest.mark.timeout(480)
def test_sweep_with_a_skipped_point_exits_non_zero(tmp_path):
    # tp8 cannot split model=tiny's 4 kv heads: point 1 is skipped by a config rule, point 0 trains
    sweep = tmp_path / "sweep"
    result = p3d_train("-m", "mesh=single,tp8_pp1", "train.steps=2", f"hydra.sweep.dir={sweep}", timeout=450)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    no_traceback(result)
    assert (
        result.stderr.rstrip().splitlines()[-1]
        == "p3d: 1 of 2 sweep points not done (1 skipped: point 1); exit status 2"
    )
    assert json.loads((sweep / "0" / "p3d_status.json").read_text())["status"] == "done"
    assert json.loads((sweep / "1" / "p3d_status.json").read_text())["status"] == "skipped"


# ---- 7. p3d-report --csv into a folder that does not exist
@pytest.mark.timeout(120)
def test_report_csv_into_a_missing_folder_is_created(tmp_path):
    sweep = tmp_path / "sweep"
    make_point(sweep, "0", status={"status": "done", "returncode": 0})
    report = [sys.executable, "-m", "p3d.cli.report", str(sweep)]
    made = subprocess.run(
        [*report, "--csv", "new/deeper/x.csv", "--png", "plots/x.png"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )  # relative to where the user stands
    assert made.returncode == 0, made.stderr
    no_traceback(made)
    assert (tmp_path / "new" / "deeper" / "x.csv").read_text().startswith("point,mesh,")
    assert (tmp_path / "plots" / "x.png").stat().st_size > 0
    (tmp_path / "a_file").write_text("")
    refused = subprocess.run(
        [*report, "--csv", "a_file/x.csv", "--no-plot"], cwd=tmp_path, capture_output=True, text=True, timeout=100
    )  # a folder that cannot be made: one line, exit 2
    assert refused.returncode == 2
    assert one_error_line(refused).startswith(f"p3d-report: cannot write the report there ({tmp_path / 'a_file'}: ")
