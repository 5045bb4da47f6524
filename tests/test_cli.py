"""p3d-train as a user runs it: config errors, the default job, the dry run, a dying worker, torchrun."""

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

from p3d.layout.geometry import total_params
from p3d.train.metrics import read_metrics
from tests.conftest import ROOT, p3d_train, typed, worker_pids

pytestmark = pytest.mark.procs  # every test here starts processes (make test, not test-fast)


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
        (["mesh=tp3"], "Could not find 'mesh/tp3'\n\nAvailable options in 'mesh':\n\tauto"),  # Hydra lists them
        (["model.hiden_size=3"], "Key 'hiden_size' not in 'ModelConfig'"),
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


def test_validation_error_is_one_line(tmp_path):
    result = p3d_train("mesh=tp4", "model.n_kv_heads=2", f"run.dir={tmp_path}", timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("p3d: config error: mesh.tp=4"), result.stderr


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


def _expected_rank_params(m, tp, pp_rank, n_blocks, last):
    """Independent closed form of one rank's parameters under Megatron-style sharding."""
    hd = m.hidden_size // m.n_heads
    sharded = m.hidden_size * hd * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.hidden_size * m.ffn_hidden_size
    n = n_blocks * (sharded // tp + 2 * m.hidden_size)
    vocab_rows = -(-m.vocab_size // tp)
    if pp_rank == 0:
        n += vocab_rows * m.hidden_size
    if last:
        n += m.hidden_size + vocab_rows * m.hidden_size
    return n


def test_dry_run_llama70b_tp8_pp8_counts():
    from p3d.launch.dryrun import dry_run

    cfg, plan = typed("mesh=tp8_pp8", "model=llama70b", "dry_run=true", "schedule=large")
    report = dry_run(cfg, plan)
    assert report.total == total_params(cfg.model) == 70_553_706_496
    assert len(report.params) == 64 and len(report.mesh_map) == 64
    # partition=cost: the head weighs 1.2 blocks, so the last stage gives up a block (9 + head = 10.2 blocks'
    # work) and the busiest stage does 11 blocks' work, against 11.2 with ten blocks everywhere
    blocks = [sum(name.startswith("block") for name in report.stage_layers[pp]) for pp in range(8)]
    assert blocks == [10, 10, 10, 10, 10, 10, 11, 9]
    for (pp, tp), n in report.params.items():
        assert n == _expected_rank_params(cfg.model, 8, pp, blocks[pp], pp == 7), (pp, tp)


def test_dry_run_with_sp_and_recompute_counts_the_same_parameters():
    """Sequence parallelism and recompute change no parameter: the dry run's per-rank counts stay."""
    from p3d.launch.dryrun import dry_run

    base = ("model=tiny", "mesh=tp2_pp2", "model.tie_embeddings=true", "dry_run=true")
    plain = dry_run(*typed(*base))
    sp = dry_run(
        *typed(
            *base,
            "schedule.sequence_parallel=true",
            "schedule.recompute=selective",
            "schedule.recompute_swiglu=true",
        )
    )
    assert sp.cfg.schedule.sequence_parallel and not plain.cfg.schedule.sequence_parallel
    assert sp.total == plain.total == total_params(sp.cfg.model)
    assert (sp.params, sp.owned, sp.padding, sp.stage_layers) == (
        plain.params,
        plain.owned,
        plain.padding,
        plain.stage_layers,
    )


@pytest.mark.parametrize(
    "overrides,words",
    [
        ((), "total from shards: 262,720 (262.7K); closed form: 262,720; match"),
        (("model=small", "mesh=single"), "total from shards: 123,587,328 (123.6M); closed form: 123,587,328; match"),
    ],
    ids=["tiny", "small"],
)
def test_dry_run_counts_parameters_in_the_unit_that_fits(overrides, words):
    """Issue 31, item 8e: not ``262,720 (0.00 B)``."""
    from p3d.launch.dryrun import dry_run

    assert words in dry_run(*typed("dry_run=true", *overrides)).render().splitlines()


def test_human_counts_have_four_digits_and_the_unit_that_fits():
    from p3d.console import human_count

    cases = {7: "7", 999: "999", 262_720: "262.7K", 999_960: "1M", 124_439_808: "124.4M", 70_553_706_496: "70.55B"}
    assert {n: human_count(n) for n in cases} == cases
    assert human_count(1_250_000_000_000) == "1.25T"


@pytest.mark.timeout(120)
def test_dry_run_cli_is_fast_and_starts_nothing(tmp_path):
    t0 = time.monotonic()
    result = p3d_train("mesh=tp8_pp8", "model=llama70b", "dry_run=true", f"run.dir={tmp_path}", timeout=100)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - t0 < 60
    out = result.stdout
    assert "rank    63: dp   0 pp   7 tp  7 -> node   0 device 63" in out
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


@pytest.mark.parametrize(
    "pipeline",
    [("schedule.pipeline=interleaved_1f1b", "schedule.virtual_stages=2"), ("schedule.pipeline=zbv",)],
    ids=["interleaved_1f1b", "zbv"],
)
def test_dry_run_of_a_torch_schedule_prints_each_ranks_chunks_and_exact_counts(pipeline):
    """The chunks of every pp rank (loop placement: c mod p; V: r and 2p-1-r), and each rank's parameter count equal
    to the ChunkModules a worker builds (tied table: a copy on each holder under loop placement, one shared under V)."""
    import torch.nn as nn

    from p3d.launch.dryrun import dry_run
    from p3d.parallel.mesh import Mesh
    from p3d.parallel.pipeline.chunks import ChunkModule
    from p3d.parallel.pipeline.specs import build_layer_specs

    cfg, plan = typed("mesh=pp2", "model.tie_embeddings=true", "dry_run=true", "schedule.virtual_stages=2", *pipeline)
    report = dry_run(cfg, plan)
    v_shaped = "zbv" in pipeline[0]
    assert report.rank_chunks == ([[0, 3], [1, 2]] if v_shaped else [[0, 2], [1, 3]])
    text = report.render()
    assert "pp   1 chunk   3: block3, final_norm, head" in text or "pp   0 chunk   3: block3, final_norm, head" in text
    assert report.total == total_params(cfg.model)
    bounds = [0, 2, 3, 4, 7]  # tiny, pp2 x 2 chunks, partition=blocks
    for pp, chunks in enumerate(report.rank_chunks):
        specs = build_layer_specs(cfg.model, plan.padded_vocab_size, Mesh.from_plan(plan, pp), cfg.train.seed)
        tied: dict = {}
        built = nn.ModuleList([ChunkModule(specs, bounds[c], bounds[c + 1], tied) for c in chunks])
        assert report.params[(pp, 0)] == sum(p.numel() for p in built.parameters()), pp


@pytest.mark.procs
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


def test_workers_are_forked_only_where_it_is_safe(monkeypatch):
    """gloo only (no CUDA in a forked child); never with P3D_WORKER_START=exec; never beside a thread that is
    not the run lease's heartbeat (a fork copies only the calling thread, and a lock held by another would
    stay held in the child), nor where the kernel's thread count cannot be read or shows threads Python does
    not know of (gloo's, in a process that ran collectives)."""
    import threading
    import types

    from p3d.jobs import forked

    def threads(*names):
        found = [threading.main_thread(), *(types.SimpleNamespace(name=n) for n in names)]
        monkeypatch.setattr(forked.threading, "enumerate", lambda: found)
        monkeypatch.setattr(forked, "native_threads", lambda: len(found))

    monkeypatch.delenv(forked.WORKER_START, raising=False)
    threads()
    assert forked.can_fork("gloo")
    assert not forked.can_fork("nccl")
    monkeypatch.setenv(forked.WORKER_START, "exec")
    assert not forked.can_fork("gloo")
    monkeypatch.setenv(forked.WORKER_START, "fork")
    threads("p3d-lease")
    assert forked.can_fork("gloo")
    threads("a-stranger")
    assert not forked.can_fork("gloo")
    threads()
    monkeypatch.setattr(forked, "native_threads", lambda: None)  # not Linux
    assert not forked.can_fork("gloo")
    monkeypatch.setattr(forked, "native_threads", lambda: 40)
    assert not forked.can_fork("gloo")


@pytest.mark.procs
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
