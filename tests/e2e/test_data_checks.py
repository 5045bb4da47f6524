"""Bad data as p3d-train meets it: one line before any worker starts, skipped lines counted alike on every data
rank, ranks whose streams drift apart stop the run."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers.runs import p3d_train


@pytest.mark.timeout(180)
def test_a_run_skips_bad_lines_on_every_data_rank_alike(tmp_path):
    """pp2 x dp2: four ranks read the stream; each skips the same bad lines, so their batches still match
    (the trainer checks that every step) and the run finishes and reports the skips."""
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(600)]
    body = b"".join((b"\xff\xfe bad bytes\n" if i % 60 == 0 else line.encode() + b"\n") for i, line in enumerate(lines))
    (tmp_path / "t.txt").write_bytes(body)
    result = p3d_train(
        f"run.dir={tmp_path / 'run'}",
        "data=files",
        f"data.path={tmp_path / 't.txt'}",
        "mesh=pp2",
        "mesh.dp=2",
        "train.steps=2",
        "data.text_unit=line",
        timeout=150,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(
        rf"data: skipped [1-9]\d* lines of {tmp_path / 't.txt'} with bytes that are not UTF-8", result.stdout
    ), result.stdout[-2000:]


def _disagreeing_readers(rank, world):
    from p3d.data.corpus import DataStats
    from p3d.train.loop import Stopper, step_stats

    stats = DataStats(skipped_records=3, failed_files=1 if rank == 1 else 0)  # a file failed on rank 1 only
    with pytest.raises(RuntimeError, match="data-reading ranks skipped different records or files"):
        step_stats(Stopper(), 0.0, 0.0, {"dp_comm_s": 0.0}, torch.device("cpu"), stats if rank < 2 else None)


def test_ranks_whose_data_streams_drift_apart_stop_the_run():
    from tests.helpers.dist import run_distributed

    run_distributed(_disagreeing_readers, 3, timeout=60)  # rank 2 reads no data (a middle stage)


@pytest.mark.parametrize(
    "setup,overrides,needle",
    [
        (None, ["data=files", "data.path={tmp}/missing*.jsonl"], "matches no file"),
        ("empty", ["data=files", "data.path={tmp}/empty.jsonl"], "holds 0 tokens"),
        (
            "column",
            ["data=files", "data.path={tmp}/col.jsonl"],
            "is not a column of the data (columns: ['body']); try data.text_column=body",
        ),
        (
            "column",
            ["data=files", "data.path={tmp}/col.jsonl", "data.format=xml"],
            "data.format=xml (command line) is not one of auto, csv",
        ),
        (None, ["data=files", "data.path={tmp}/a.csv"], "data.path"),
        (None, ["data.source=hub", "data.path=no-such-org/no-such-dataset"], "cannot read data.path=no-such-org"),
    ],
)
def test_bad_data_is_one_line_before_any_worker(tmp_path, setup, overrides, needle):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "col.jsonl").write_text(json.dumps({"body": "hello " * 50}))
    args = [o.format(tmp=tmp_path) for o in overrides]
    result = p3d_train(f"run.dir={tmp_path / 'run'}", *args, timeout=90, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stdout[-1500:] + result.stderr[-1500:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "run" / "logs").exists()
