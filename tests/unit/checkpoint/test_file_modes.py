"""Checkpoint files get the mode the umask gives, safetensors files too (issue 31: safetensors' save_file
writes 0600 whatever the umask, so teammates on shared storage could not read a checkpoint).

In-process: this process alone is a gloo group of one rank, and saves a small module through
``Checkpointer.save`` as a worker does, synchronously and from the background thread of ``train.async_save``
(where the umask must be read without setting it)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist

from p3d.checkpoint import checkpointer as checkpoint
from p3d.checkpoint import files as ckpt_files
from p3d.checkpoint import find as ckpt_find
from p3d.data.tokenizer import HF_CONFIG
from p3d.hf.tokenizer import byte_tokenizer_json
from p3d.parallel.mesh import Mesh
from p3d.rundir.spec import SPEC_NAME, write_spec
from tests.helpers.file_modes import umask, wrong_modes
from tests.helpers.runs import typed


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A process group of this process alone: the collectives of Checkpointer.save run on it."""
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


def _private_tokenizer(tmp_path):
    """A tokenizer.json and its tokenizer_config.json, both 0600: the checkpoint's copies must not take
    their source's mode."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(byte_tokenizer_json())
    (tok_dir / HF_CONFIG).write_text('{"eos_token": "<|endoftext|>"}\n')
    for f in tok_dir.iterdir():
        os.chmod(f, 0o600)
    return tok_dir / "tokenizer.json"


def _save(run_dir, cfg, plan, asynchronous: bool):
    """One checkpoint of a small trained module (its Adam moments exist), as Checkpointer.save writes it."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, async_save=asynchronous))
    mesh = Mesh(tp=1, pp=1, dp=1)
    states = checkpoint.OptimizerStates(optimizer)
    checkpoints = checkpoint.Checkpointer(cfg, plan, mesh, run_dir, module, states, scheduler, torch.device("cpu"))
    final = checkpoints.save(1, 8, {})
    checkpoints.wait()
    return final


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_every_checkpoint_file_gets_the_mode_of_the_umask(one_rank, tmp_path, mask, asynchronous):
    tokenizer = _private_tokenizer(tmp_path)
    cfg, plan = typed("mesh=single", f"data.tokenizer={tokenizer}")
    run_dir = tmp_path / "run"
    with umask(mask):
        write_spec(cfg, plan, run_dir)
        os.chmod(run_dir / SPEC_NAME, 0o600)  # copied into the checkpoint: the copy takes the umask's mode
        final = _save(run_dir, cfg, plan, asynchronous)
    ckpt_find.verify(final)
    written = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()}
    assert {"model/pp0_tp0_dp0.safetensors", "optim/pp0_tp0_dp0.safetensors", "meta.json"} <= written
    assert {"rng/rank0.json", "done/rank0.json", SPEC_NAME, "tokenizer.json", HF_CONFIG} <= written
    assert wrong_modes(run_dir / "checkpoints", mask) == {}  # with `latest` and every directory


def test_the_umask_is_read_without_setting_it(monkeypatch):
    """os.umask reads it only by setting it, for every thread: the background writer must not."""
    with umask(0o027):

        def refuse(mask):
            raise AssertionError("os.umask called while reading the umask")

        monkeypatch.setattr(os, "umask", refuse)
        seen = []
        writer = threading.Thread(target=lambda: seen.append(ckpt_files.umask()))
        writer.start()
        writer.join()
        monkeypatch.undo()
    assert seen == [0o027]
