"""``p3d-prepare prepare.slices=n cluster=slurm`` on the local one-node Slurm: an array job of n slices,
then the dependent merge; the merged store holds the windows of one local prepare of the same files."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from p3d.data.prepared import PreparedSamples
from p3d.data.store import TokenStore
from tests.helpers.runs import ROOT
from tests.helpers.slurm import run
from tests.helpers.stores import SEQ, prepared_config, write_corpus


def p3d_prepare(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli.prepare", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(600)
def test_slices_run_as_an_array_job_and_merge_into_the_store_of_one_prepare(slurm_cluster, tmp_path):
    for k in range(4):
        write_corpus(tmp_path / "c" / f"f{k}", 120, seed=k)
    args = ("data=files", f"data.path={tmp_path}/c/*/docs.jsonl", "prepare.workers=1", "prepare.shard_bytes=3000")
    out = tmp_path / "sliced"
    name = f"p3d-{uuid.uuid4().hex[:8]}"
    result = p3d_prepare(
        *args, f"prepare.out={out}", "prepare.slices=3", "cluster=slurm", "cluster.time=5", f"cluster.job_name={name}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    m = re.search(r"submitted Slurm array job (\d+) \(3 tasks.*and merge job (\d+)", result.stdout)
    assert m, result.stdout
    array, merge = m.groups()
    assert f"job logs {out}/logs/prepare-{array}_<i>.out and {out}/logs/merge-{merge}.out" in result.stdout
    detail = run("scontrol", "show", "job", merge).stdout
    assert f"Dependency=afterok:{array}" in detail or "Dependency=(null)" in detail, detail  # (null): already met
    state = slurm_cluster.wait(merge, timeout=480)
    logs = "".join(f.read_text() for f in sorted((out / "logs").glob("*.out")))
    assert state == "COMPLETED", logs[-3000:]
    tasks = slurm_cluster.wait_accounted(array, runs=3)
    assert sorted(r["JobID"] for r in tasks) == [f"{array}_{i}" for i in range(3)], tasks
    assert all(r["State"] == "COMPLETED" for r in tasks), tasks
    for i in range(3):
        assert f"slice {i} of 3" in (out / "logs" / f"prepare-{array}_{i}.out").read_text()
    assert "merged 3 parts" in (out / "logs" / f"merge-{merge}.out").read_text()

    whole = tmp_path / "whole"
    local = p3d_prepare(*args, f"prepare.out={whole}")
    assert local.returncode == 0, local.stderr
    a, b = TokenStore(whole), TokenStore(out)
    b.check_files()
    assert b.manifest["parts"] == 3 and b.manifest["train"] == a.manifest["train"]
    assert b.manifest["val"] == a.manifest["val"] and b.manifest["sources"] == a.manifest["sources"]
    n = a.tokens("train") // (SEQ + 1)
    for shuffle in (0, 1):
        x = PreparedSamples(prepared_config(whole, shuffle_buffer=shuffle), SEQ, seed=3).read(np.arange(n))
        y = PreparedSamples(prepared_config(out, shuffle_buffer=shuffle), SEQ, seed=3).read(np.arange(n))
        assert torch.equal(x, y)


@pytest.mark.timeout(180)
def test_a_partition_that_is_not_there_is_refused_before_submitting(slurm_cluster, tmp_path):
    write_corpus(tmp_path / "c", 20, seed=0)
    name = f"p3d-{uuid.uuid4().hex[:8]}"
    result = p3d_prepare(
        "data=files",
        f"data.path={tmp_path}/c/docs.jsonl",
        f"prepare.out={tmp_path / 'o'}",
        "prepare.slices=1",
        "cluster=slurm",
        "cluster.partition=nope",
        f"cluster.job_name={name}",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert re.search(r"cluster.partition=nope .*: Slurm lists no nodes there", result.stderr), result.stderr
    assert not (tmp_path / "o").exists()
    assert run("squeue", "-h", "-n", f"{name}-prepare").stdout.strip() == ""


@pytest.mark.timeout(300)
def test_a_failed_slice_cancels_the_merge(slurm_cluster, tmp_path):
    """A slice whose job fails (here its cluster.setup line exits 3) leaves the merge never to run: Slurm
    cancels it (--kill-on-invalid-dep) instead of keeping it pending; no manifest is written."""
    for k in range(2):
        write_corpus(tmp_path / "c" / f"f{k}", 10, seed=k)
    out = tmp_path / "o"
    result = p3d_prepare(
        "data=files",
        f"data.path={tmp_path}/c/*/docs.jsonl",
        f"prepare.out={out}",
        "prepare.slices=2",
        "cluster=slurm",
        "cluster.time=5",
        "cluster.setup=[exit 3]",
        f"cluster.job_name=p3d-{uuid.uuid4().hex[:8]}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    array, merge = re.search(r"array job (\d+) .* merge job (\d+)", result.stdout).groups()
    assert slurm_cluster.wait(merge, timeout=240) == "CANCELLED"
    tasks = slurm_cluster.wait_accounted(array, runs=2)
    assert [r["State"] for r in tasks] == ["FAILED", "FAILED"] and tasks[0]["ExitCode"] == "3:0", tasks
    assert not (out / "manifest.json").exists()
