"""Checkpoint files that load without running code, the previous format, and a full disk mid-save."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p3d import exit_codes
from p3d.checkpoint import checkpointer as checkpoint
from p3d.checkpoint import find as ckpt_find
from p3d.checkpoint.files import LEGACY_FORMAT
from p3d.train.metrics import read_metrics
from tests.helpers.runs import ROOT, copy_run, p3d_train

MESH = "mesh=tp2_pp2"


class _CreatesAFile:
    """Unpickling this opens (creates) ``marker``: what a malicious checkpoint file could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("saved") / "run"
    result = p3d_train(f"run.dir={run}", "train.steps=2", MESH)
    assert result.returncode == 0, result.stderr[-2000:]
    return run


def _plant_pickle(ckpt: Path, rel: str, marker: Path) -> Path:
    """Replace ``rel`` by a pickle whose loading would create ``marker``; meta.json records its new size
    (so the size check passes and the reader itself must refuse it)."""
    f = ckpt / rel
    f.write_bytes(pickle.dumps({"params": _CreatesAFile(marker)}))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][rel] = f.stat().st_size
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return f


def _export(run: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli.export", f"run.dir={run}", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _to_previous_format(ckpt: Path) -> None:
    """Rewrite a checkpoint as the previous format wrote it: torch.save files per (pp, tp), no RNG."""
    meta = json.loads((ckpt / "meta.json").read_text())
    read = checkpoint.reader(ckpt, meta)
    for kind in ("model", "optim"):
        for pp in range(meta["mesh"]["pp"]):
            for tp in range(meta["mesh"]["tp"]):
                torch.save(read(kind, pp, tp), ckpt / kind / f"pp{pp}_tp{tp}.pt")
        for f in (ckpt / kind).glob("*.safetensors"):
            f.unlink()
    shutil.rmtree(ckpt / "rng")
    shutil.rmtree(ckpt / "done")
    files = {str(f.relative_to(ckpt)): f.stat().st_size for f in sorted(ckpt.rglob("*")) if f.is_file()}
    files.pop("meta.json")
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format": LEGACY_FORMAT, "files": files}))


@pytest.mark.timeout(400)
def test_a_pickle_in_place_of_a_checkpoint_file_runs_no_code(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path)
    marker = tmp_path / "marker"
    planted = _plant_pickle(ckpt_find.step_dir(run, 2), "optim/pp0_tp1_dp0.safetensors", marker)
    result = p3d_train(f"run.dir={run}", "train.steps=4", MESH, "train.resume=auto", timeout=200)
    assert result.returncode == exit_codes.WORKER_FAILED, result.stdout[-2000:]
    assert f"checkpoint file {planted} cannot be read" in result.stdout + result.stderr
    exported = _export(run, tmp_path / "hf")
    assert exported.returncode == exit_codes.CONFIG_ERROR, exported.stderr
    assert f"checkpoint file {planted} cannot be read" in exported.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.timeout(400)
def test_a_checkpoint_of_the_previous_format_resumes_once_with_a_note(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path)
    _to_previous_format(ckpt_find.step_dir(run, 2))
    result = p3d_train(f"run.dir={run}", "train.steps=3", MESH, "train.resume=auto", timeout=200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"is in the previous format ({LEGACY_FORMAT}" in result.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert ckpt_find.verify(ckpt_find.step_dir(run, 3))["format"] == checkpoint.FORMAT  # written anew

    straight = read_metrics(_copy_resumed(saved_run, tmp_path))  # the same step 3 from the new format
    assert read_metrics(run)[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-6, abs=0)


def _copy_resumed(saved: Path, tmp_path: Path) -> Path:
    run = tmp_path / "new_format"
    shutil.copytree(saved, run)
    result = p3d_train(f"run.dir={run}", "train.steps=3", MESH, "train.resume=auto", timeout=200)
    assert result.returncode == 0, result.stdout[-2000:]
    return run


@pytest.mark.timeout(400)
def test_a_pickle_in_a_checkpoint_of_the_previous_format_runs_no_code(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path)
    ckpt = ckpt_find.step_dir(run, 2)
    _to_previous_format(ckpt)
    marker = tmp_path / "marker"
    planted = _plant_pickle(ckpt, "optim/pp1_tp0.pt", marker)  # a file resume reads
    result = p3d_train(f"run.dir={run}", "train.steps=4", MESH, "train.resume=auto", timeout=200)
    assert result.returncode == exit_codes.WORKER_FAILED, result.stdout[-2000:]
    assert f"checkpoint file {planted} cannot be read" in result.stdout + result.stderr
    exported = _export(run, tmp_path / "hf")
    assert exported.returncode == exit_codes.CONFIG_ERROR, exported.stderr
    assert f"checkpoint file {planted} cannot be read" in exported.stderr
    assert not marker.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 7 MiB tmpfs: room for the run's files and one checkpoint of model=tiny on tp2_pp2 (4.3 MiB)."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.timeout(500)
def test_a_full_disk_during_a_save_stops_with_one_line_and_keeps_the_previous_checkpoint(small_disk, tmp_path):
    run = small_disk / "run"
    result = p3d_train(f"run.dir={run}", "train.steps=4", "train.save_every=1", MESH, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == exit_codes.WORKER_FAILED, out[-3000:]
    errors = [line for line in out.splitlines() if "CheckpointSaveError" in line]
    assert errors, out[-3000:]
    assert "checkpoint save failed" in errors[0] and "No space left on device" in errors[0], errors[0]
    assert "MiB free on the file system of" in errors[0], errors[0]
    assert "Traceback" not in out
    found = ckpt_find.find(run, "auto")
    assert found == ckpt_find.step_dir(run, 1), found  # the step-2 save failed; nothing partial is taken
    ckpt_find.verify(found)
    assert [d.name for d in (run / "checkpoints").iterdir() if d.name.startswith((".step_", "step_"))] == [found.name]

    moved = tmp_path / "run"  # resume where there is room
    shutil.copytree(run, moved)
    resumed = p3d_train(f"run.dir={moved}", "train.steps=2", MESH, "train.resume=auto", timeout=200)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from step 1" in resumed.stdout
