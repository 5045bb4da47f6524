"""p3d-train as a user runs it: config errors, the pre-flight memory check, the default job, the dry run's speed,
a dying worker, torchrun, forked and fresh workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import ROOT, p3d_train, worker_pids


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["mesh=tp4", "model.n_kv_heads=2"],
            "mesh.tp=4 (mesh/tp4.yaml) must divide model.n_heads=8 and model.n_kv_heads=2 "
            "(attention is split by heads); try mesh=tp2",
        ),
        (["schedule.global_batch_size=10"], "schedule.global_batch_size=10 (command line) must be a multiple of"),
        (["mesh=pp4", "schedule.global_batch_size=6", "schedule.micro_batch_size=2"], "gives 3 micro batches"),
        (["mesh=tp3"], "mesh=tp3 (command line) is not an option of the mesh group; did you mean tp4? try mesh=tp4"),
        (
            ["model.hiden_size=3"],
            "model.hiden_size=3 (command line) is not a p3d option; did you mean model.hidden_size? "
            "try model.hidden_size=3",
        ),
    ],
)
def test_bad_override_exits_2_before_any_worker(args, needle, tmp_path):
    t0 = time.monotonic()
    result = p3d_train(*args, f"run.dir={tmp_path}", timeout=60)
    elapsed = time.monotonic() - t0
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert elapsed < 15, f"took {elapsed:.1f}s"
    assert not (tmp_path / "logs").exists() and not (tmp_path / "run_spec.yaml").exists()


@pytest.mark.parametrize(
    "args,start",
    [
        (["mesh=tp4", "model.n_kv_heads=2"], "mesh.tp=4"),  # a rule across groups
        (["mesh.cp=1.5"], "mesh.cp=1.5 (command line) must be an integer; try mesh.cp=1"),  # a type, before Hydra
    ],
)
def test_validation_error_is_one_line(args, start, tmp_path):
    result = p3d_train(*args, f"run.dir={tmp_path}", timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"p3d: config error: {start}"), result.stderr


@pytest.mark.timeout(120)
def test_preflight_refuses_a_layout_predicted_not_to_fit_unless_forced(tmp_path):
    """The planner runs before launch: 8 cpu workers share this machine's memory, far more than 1 MB."""
    refused = p3d_train("cluster.memory_gb=0.001", f"run.dir={tmp_path / 'a'}", timeout=60)
    assert refused.returncode == 2, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert "tp=2 pp=2 dp=2 is predicted to need" in last and "8 workers together" in last, refused.stderr
    assert "cluster.memory_gb=0.001" in last and "plan.force=true" in last
    assert not (tmp_path / "a" / "run_spec.yaml").exists() and not (tmp_path / "a" / "logs").exists()
    forced = p3d_train(
        "cluster.memory_gb=0.001",
        "plan.force=true",
        "mesh=single",
        "train.steps=1",
        f"run.dir={tmp_path / 'b'}",
        timeout=100,
    )
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1]


@pytest.mark.timeout(300)
def test_default_job_end_to_end(tmp_path):
    """No overrides but the step count: tiny Llama, dp2 x pp2 x tp2 = 8 processes, stdlib text."""
    result = p3d_train("train.steps=4", f"run.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4
    for field in ("loss", "lr", "grad_norm", "tok/s", "step"):
        assert field in progress[-1]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (tmp_path / "run_spec.yaml").is_file()
    ds = json.loads((tmp_path / "deepspeed_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_batch_size"] == 16
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"rank{r}.log" for r in range(8)]


@pytest.mark.timeout(120)
def test_dry_run_cli_is_fast_and_starts_nothing(tmp_path):
    t0 = time.monotonic()
    gpus = ("cluster=h100_sxm", "cluster.nodes=8", "schedule=large")  # 64 GPUs: the README's line
    result = p3d_train("mesh=tp8_pp8", "model=llama70b", *gpus, "dry_run=true", f"run.dir={tmp_path}", timeout=100)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - t0 < 60
    out = result.stdout
    assert "rank    63: dp   0 pp   7 tp  7 -> node   7 device 7" in out
    assert "stage   7: block71..block79 (9 blocks), final_norm, head" in out
    assert "total from shards: 70,553,706,496 (70.55B); closed form: 70,553,706,496; match" in out
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(240)
def test_a_dead_worker_stops_the_run_and_is_named(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "p3d.cli", "train.steps=500", f"run.dir={tmp_path}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = tmp_path / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("training did not start")
        pids = worker_pids(tmp_path)
        assert sorted(pids) == list(range(8))
        os.kill(pids[5], signal.SIGKILL)
        t0 = time.monotonic()
        out, _ = launcher.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    assert "rank 5 (dp 0, pp 1, tp 1) was killed by SIGKILL" in out
    time.sleep(1)
    assert worker_pids(tmp_path) == {}  # no orphan keeps running


@pytest.mark.timeout(240)
def test_runs_as_worker_under_torchrun(tmp_path):
    """recipes/torchrun.sh: p3d-train under an external launcher acts as a worker."""
    env = {
        **os.environ,
        "NPROC": "2",
        "RUN_DIR": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    result = subprocess.run(
        ["bash", "recipes/torchrun.sh", "mesh=pp2", "train.steps=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "run_spec.yaml").is_file()


@pytest.mark.slow  # 33 s: every other test runs forked workers, this one fresh ones beside them
def test_forked_and_fresh_workers_train_the_same_run(tmp_path):
    """On CPU the launcher imports torch once and forks its workers (p3d.jobs.forked); P3D_WORKER_START=exec
    starts each as a fresh interpreter, as GPU runs do. Both give the same losses and norms to the last bit,
    the same console lines and logs, and workers named p3d-rank<R> whose pids their placement lines give."""
    runs = {}
    for mode in ("fork", "exec"):
        result = p3d_train(
            "mesh=dp2_pp2", "train.steps=3", f"run.dir={tmp_path / mode}", env={"P3D_WORKER_START": mode}
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[mode] = result
        logs = sorted((tmp_path / mode / "logs").iterdir())
        assert [p.name for p in logs] == [f"rank{r}.log" for r in range(4)]
        for r, log in enumerate(logs):
            assert re.search(rf"\[rank {r}\] placement: host \S+ dp \d pp \d tp 0 local {r} pid \d+", log.read_text())
    assert read_metrics(tmp_path / "fork") and [
        (r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "fork")
    ] == [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "exec")]
    steps = {
        m: [ln.split("| tok/s")[0] for ln in r.stdout.splitlines() if ln.startswith("step ")] for m, r in runs.items()
    }
    assert len(steps["fork"]) == 3 and steps["fork"] == steps["exec"]


# slow tier (37 s of imports: DeepSpeed's compile at import); kept: test_forked_and_fresh_workers_train_the_same_run
@pytest.mark.slow
def test_the_launcher_imports_what_a_zero_worker_imports_and_can_still_fork(tmp_path):
    """forked.worker_imports names the modules a worker would import after the fork: DeepSpeed and, with ZeRO under
    DeepSpeed's engine, the module of its optimizer check (it compiles at import: 1.5 s a worker). After the
    launcher's preload, that check imports nothing more, and no import left a thread that makes a fork unsafe."""
    probe = """
import sys, torch
from p3d.jobs import forked
forked.preload(forked.worker_imports("1f1b", 1))
assert forked.can_fork("gloo"), "a preloaded module started a thread"
import deepspeed, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
deepspeed.init_distributed(dist_backend="gloo")  # adopts the group (the check logs on rank 0)
before = set(sys.modules)
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
assert is_zero_supported_optimizer(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
print(sorted(set(sys.modules) - before))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
