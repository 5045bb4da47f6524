"""The resume rules (p3d.config.resume_rules), in-process: one rule for every config field, the docs list each,
the spec's segments, the samples after the last one trained under a new batch, a resume laid over the resumed
run's spec (p3d.launch.resume_base)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from itertools import islice
from pathlib import Path

import pytest
import torch

from p3d.checkpoint import find as checkpoint
from p3d.config import resume_rules
from p3d.config.resume_rules import Rule
from p3d.config.schema import Config, DataConfig, MoEConfig
from p3d.data.loader import micro_batches, sample_stream
from p3d.rundir.spec import config_dict, read_spec, write_spec
from tests.helpers.runs import ROOT, typed

BASE = ("model=tiny", "mesh=single", "train.steps=3")  # lr 3e-3, 20 warmup steps, global batch 16


B0, K = 16, 3  # the base run's global batch and steps: its checkpoint has consumed 48 samples

# ---- the rules as data


def test_every_config_field_has_one_rule_and_every_rule_a_field():
    with_experts = Config(model=dataclasses.replace(Config().model, moe=MoEConfig()))  # model.moe's fields too
    fields = resume_rules.flatten(config_dict(Config())) | resume_rules.flatten(config_dict(with_experts))
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


def test_the_docs_list_every_rule():
    """docs/checkpoints.md, "Resuming with changes", names every field the resume rules hold."""
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    section = page.split("\n## Resuming with changes\n", 1)[1].split("\n## ", 1)[0]
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


def test_sequence_parallelism_follows_the_mesh_on_a_resume():
    """Issue 64, item 12: the spec holds what sequence parallelism came to (specs before it was on by default hold
    false). A resume on the same tp keeps it, an older spec's false included; one on another tp or cp derives it again
    (unset: on wherever tp > 1), as a fresh launch would; one that names it takes the command line's."""
    from p3d.launch.resume_base import over_resumed_run

    groups = {"mesh", "schedule", "train"}
    resumed = {"mesh": {"name": "tp2", "tp": 2, "pp": 1, "cp": 1}, "schedule": {"sequence_parallel": False}}
    composed = {"mesh": {"name": "tp2", "tp": 2, "pp": 1, "cp": 1}, "schedule": {"sequence_parallel": None}}
    same = over_resumed_run(composed, resumed, ["train.steps=8"], groups)
    assert same["schedule"]["sequence_parallel"] is False  # an older spec's false, on its own mesh
    on = {**resumed, "schedule": {"sequence_parallel": True}}  # what tp2 derived
    single = {"mesh": {"name": "single", "tp": 1, "pp": 1, "cp": 1}, "schedule": {"sequence_parallel": None}}
    assert over_resumed_run(single, on, ["mesh=single"], groups)["schedule"]["sequence_parallel"] is None
    assert over_resumed_run(single, on, ["mesh.tp=1"], groups)["schedule"]["sequence_parallel"] is None
    named = {**single, "schedule": {"sequence_parallel": False}}
    assert over_resumed_run(named, on, ["mesh=single", "schedule.sequence_parallel=false"], groups)["schedule"] == {
        "sequence_parallel": False
    }


GROUPS = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"


@pytest.mark.parametrize("direction", ["groups-to-one-node", "one-node-to-groups"])
def test_a_resume_onto_or_off_groups_rederives_the_clusters_peak_and_memory(tmp_path, direction):
    """Issue 64, item 4: a run over cluster.groups resumed by hand with ``cluster.groups=[] cluster.nodes=1`` divided
    its MFU by the groups' mean peak (0.075), and the reverse resume kept the one device's (0.1). The figures that
    stand for the groups follow them, as cluster.device's numbers follow the device."""
    from p3d.launch.check import prepare
    from p3d.rundir.spec import write_spec
    from tests.helpers.runs import compose

    run = str(tmp_path / "run")
    first, then = ((GROUPS, "mesh=dp2"), ("cluster.groups=[]", "cluster.nodes=1"))
    if direction == "one-node-to-groups":
        first, then = ("mesh=dp2",), (GROUPS,)
    cfg, plan = prepare(compose(*first, run_dir=run), [*first])
    write_spec(cfg, plan, run)
    assert cfg.cluster.peak_tflops == pytest.approx(0.075 if GROUPS in first else 0.1)
    overrides = ["train.resume=auto", *then]
    resumed, _ = prepare(compose(*overrides, run_dir=run), overrides)
    assert resumed.mesh.dp == 2 and resumed.cluster.nodes == (2 if GROUPS in then else 1)
    assert resumed.cluster.peak_tflops == pytest.approx(0.075 if GROUPS in then else 0.1)
    assert resumed.cluster.memory_gb == cfg.cluster.memory_gb  # the same cpu devices: the same memory
