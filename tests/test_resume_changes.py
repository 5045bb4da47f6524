"""A resumed run continues the run it says it continues, also when the resume changes the config:
the new lr schedule from the resumed step, the samples after the last trained one under a new global
batch size and dp, train.steps not above the checkpoint refused, and a rule for every config field."""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
from p3d.config import resume_rules
from p3d.config.resume_rules import Rule
from p3d.config.schema import Config, DataConfig, LRDecay, TrainConfig
from p3d.data.loader import micro_batches, sample_stream
from p3d.rundir.spec import config_dict, read_spec, write_spec
from p3d.train.metrics import read_metrics
from p3d.train.optim import lr_factor
from tests.conftest import ROOT, typed

BASE = ("model=tiny", "mesh=single", "train.steps=3")  # lr 3e-3, 20 warmup steps, global batch 16
B0, K = 16, 3  # the base run's global batch and steps: its checkpoint has consumed 48 samples


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


# ---- the rules as data


def test_every_config_field_has_one_rule_and_every_rule_a_field():
    fields = resume_rules.flatten(config_dict(Config()))
    for field in fields:
        resume_rules.rule(field)  # KeyError: a field with no rule
    groups = {f.split(".", 1)[0] for f in fields}
    for key in resume_rules.RULES:
        assert key in fields or (key.endswith(".*") and key[:-2] in groups), f"{key} names no config field"
    refused = {f for f in fields if resume_rules.rule(f)[0] == Rule.REFUSED}
    shape = {
        f"model.{k}"
        for k in (
            "n_layers",
            "hidden_size",
            "n_heads",
            "n_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
            "tie_embeddings",
            "rope_theta",
            "norm_eps",
            "seq_len",
        )
    }
    assert shape | {"data.source", "data.path", "data.tokenizer", "train.seed"} <= refused
    changes = {f for f in fields if resume_rules.rule(f)[0] == Rule.CHANGES}
    assert {
        "train.steps",
        "train.lr",
        "train.warmup_steps",
        "train.decay",
        "schedule.global_batch_size",
        "train.save_every",
        "train.eval_every",
        "mesh.dp",
        "mesh.pp",
        "mesh.tp",
        "logger.log_every",
    } <= changes


def test_a_field_the_checkpoint_spec_predates_is_not_compared():
    old = {"data": {"source": "stdlib"}, "train": {"lr": 0.003}}
    new = {"data": {"source": "stdlib", "added_later": "x"}, "train": {"lr": 0.01}}
    assert [(c.field, c.old, c.new, c.rule) for c in resume_rules.diff(old, new)] == [
        ("train.lr", 0.003, 0.01, Rule.CHANGES)
    ]


def test_readme_lists_every_rule():
    section = (ROOT / "README.md").read_text().split("**Resuming with changes**", 1)[1].split("\n- **", 1)[0]
    for key in resume_rules.RULES:
        assert f"`{key}`" in section, key


def test_the_spec_keeps_one_entry_per_segment(tmp_path):
    cfg, plan = typed(*BASE, run_dir=str(tmp_path))
    write_spec(cfg, plan, tmp_path)
    ckpt = checkpoint.step_dir(tmp_path, 3)  # what a save at step 3 leaves: meta.json and the spec's copy
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "samples": 48}))
    shutil.copy(tmp_path / "run_spec.yaml", ckpt / "run_spec.yaml")

    same = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=str(ckpt)))
    write_spec(same, plan, tmp_path)  # a requeue: nothing changed, the segment goes on
    assert _segments(tmp_path) == [{"from_step": 0, "spec": "specs/from_step_00000000.yaml"}]

    changed = dataclasses.replace(same, train=dataclasses.replace(same.train, lr=0.01, steps=8))
    write_spec(changed, plan, tmp_path)
    segs = _segments(tmp_path)
    assert segs[1] == {
        "from_step": 3,
        "spec": "specs/from_step_00000003.yaml",
        "changes": ["train.steps: 3 -> 8 from step 4", "train.lr: 0.003 -> 0.01 from step 4"],
    }
    first, _ = read_spec(tmp_path / segs[0]["spec"])  # the whole spec each segment ran with
    now, _ = read_spec(tmp_path)
    assert (first.train.lr, first.train.steps, now.train.lr, now.train.steps) == (3e-3, 3, 0.01, 8)


def _segments(run_dir: Path) -> list[dict]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(run_dir / "run_spec.yaml"))["segments"]


# ---- the data position is the samples consumed


def _digest(window: torch.Tensor) -> str:
    return hashlib.sha1(window.numpy().tobytes()).hexdigest()


def _trained(
    data_cfg, seq: int, batch: int, dp: int, start_sample: int, steps: int, seed: int, mbs: int = 2
) -> list[torch.Tensor]:
    """The windows ``steps`` steps of global batch ``batch`` on ``dp`` replicas train on, in global order
    (each step: replica 0's micro batches, then replica 1's, ...), as the trainer's loader yields them."""
    n = batch // dp // mbs  # micro batches per replica and step
    per_rank = []
    for rank in range(dp):
        it = micro_batches(data_cfg, seq, batch, mbs, dp, rank, seed, start_sample)
        per_rank.append([torch.cat([x, y[:, -1:]], dim=1) for x, y in islice(it, steps * n)])
    return [
        w for step in range(steps) for rank in range(dp) for mb in per_rank[rank][step * n : (step + 1) * n] for w in mb
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch,dp", [(32, 1), (8, 1), (32, 2), (8, 2)])
def test_a_new_global_batch_reads_the_samples_after_the_last_one_trained(batch, dp):
    """K steps of 16 on one replica, then 3 steps of ``batch`` on ``dp`` replicas from the checkpoint's
    samples (48): together they train samples 0, 1, 2, ... of the uninterrupted stream, none skipped or
    repeated."""
    data_cfg, seq, seed = DataConfig(), 64, 7
    stream = [_digest(w) for w in islice(sample_stream(data_cfg, seq, seed), K * batch + 3 * batch + B0 * K)]
    before = [_digest(w) for w in _trained(data_cfg, seq, B0, 1, 0, K, seed)]
    after = [_digest(w) for w in _trained(data_cfg, seq, batch, dp, B0 * K, 3, seed)]
    assert before == stream[: B0 * K]  # samples 0 .. 47
    assert after == stream[B0 * K : B0 * K + 3 * batch]  # samples 48, 49, ...: the next one first
    stale = stream[K * batch : K * batch + 3 * batch]  # where "start step x new batch" would have started
    assert after != stale


# ---- end to end


@pytest.mark.procs
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


@pytest.mark.procs
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


@pytest.mark.procs
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


@pytest.mark.procs
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


# ---- a resume starts from the run it resumes (issue 31)


def test_a_resume_takes_the_resumed_runs_fields_and_only_what_the_command_line_names():
    from p3d.launch.resume_base import over_resumed_run

    groups = {"mesh", "cluster", "schedule", "logger", "train", "run"}
    resumed = {
        "mesh": {"name": "pp2", "tp": 1, "pp": 2, "dp": 1},
        "logger": {"name": "wandb"},
        "train": {"steps": 4, "eval_every": 2, "save_every": 2, "resume": "none", "dtype": "fp32", "x": 1},
        "schedule": {"pipeline": "1f1b", "virtual_stages": 1, "global_batch_size": 16},
        "cluster": {"device": "cpu", "peak_tflops": 0.1, "memory_gb": 24.0, "nodes": 1},
        "run": {"dir": "/old/run1"},
        "dry_run": False,
    }
    composed = {  # the defaults, with the command line's overrides
        "mesh": {"name": "pp4", "tp": 1, "pp": 4, "dp": "auto"},
        "logger": {"name": "none"},
        "train": {"steps": 6, "eval_every": 0, "save_every": 0, "resume": "auto", "dtype": "auto"},
        "schedule": {"pipeline": "zbv", "virtual_stages": None, "global_batch_size": 16},
        "cluster": {"device": "h100_sxm", "peak_tflops": None, "memory_gb": None, "nodes": 1},
        "run": {"dir": "outputs/run1"},
        "dry_run": False,
    }
    steps_only = over_resumed_run(
        composed, resumed, ["train.resume=auto", "run.dir=outputs/run1", "train.steps=6"], groups
    )
    assert steps_only["logger"] == {"name": "wandb"} and steps_only["mesh"] == resumed["mesh"]
    assert steps_only["train"] == {**resumed["train"], "steps": 6, "resume": "auto"}
    assert steps_only["run"]["dir"] == "outputs/run1"  # this launch's, not the spec's
    assert resumed["train"]["steps"] == 4  # the resumed spec is not modified
    # a group takes its whole section; a changed pipeline re-derives the chunks per rank, a device its numbers
    changed = over_resumed_run(
        composed,
        resumed,
        ["mesh=pp4", "schedule.pipeline=zbv", "cluster.device=h100_sxm", "~train.x", "hydra.run.dir=x"],
        groups,
    )
    assert changed["mesh"] == composed["mesh"]
    assert changed["schedule"] == {"pipeline": "zbv", "virtual_stages": None, "global_batch_size": 16}
    assert changed["cluster"] == {"device": "h100_sxm", "peak_tflops": None, "memory_gb": None, "nodes": 1}
    assert changed["train"]["dtype"] == "auto" and "x" not in changed["train"]
    # a derived field the command line names is the command line's
    kept = over_resumed_run(
        composed | {"schedule": {**composed["schedule"], "virtual_stages": 2}},
        resumed,
        ["schedule.pipeline=zbv", "schedule.virtual_stages=2"],
        groups,
    )
    assert kept["schedule"]["virtual_stages"] == 2
