"""The token store end to end: ``p3d-prepare`` (1 vs 2 workers byte-identical, SIGKILL then rerun
byte-identical, a finished store left alone) and ``p3d-train data=prepared`` (the streaming losses on
dp2_pp2_tp2, exact resume, resume under another dp)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p3d.data.store import TokenStore
from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.runs import ROOT, p3d_train, typed

SHARD = "prepare.shard_bytes=400000"  # the stdlib corpus (about 12.6 MB here) in about 30 shards
RTOL = 1e-5  # as tests/e2e/test_parity.py


def prepare(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p3d.cli.prepare", f"prepare.out={out}", SHARD, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def files_of(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir())}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "one"
    r = prepare(out, "prepare.workers=1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "p3d-prepare: wrote" in r.stdout and "tokens/s" in r.stderr
    return out


@pytest.mark.timeout(600)
def test_two_workers_write_the_same_bytes_as_one(store, tmp_path):
    r = prepare(tmp_path / "two", "prepare.workers=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert files_of(tmp_path / "two") == files_of(store)
    assert len([n for n in files_of(store) if n.endswith(".json")]) > 10  # many shards, so both workers had some


@pytest.mark.timeout(600)
def test_a_prepare_killed_midway_finishes_on_rerun_byte_identical(store, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "p3d.cli.prepare", f"prepare.out={out}", SHARD, "prepare.workers=2"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the kill takes its pool workers too
    )
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and len(list(out.glob("shard-*.json"))) < 2 and proc.poll() is None:
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = len(list(out.glob("shard-*.json")))
    assert not (out / "manifest.json").exists() and 0 < done < len(list(store.glob("shard-*.json"))), done
    r = prepare(out, "prepare.workers=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert files_of(out) == files_of(store)


@pytest.mark.timeout(300)
def test_a_finished_store_is_left_alone_unless_asked(store, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    before = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    r = prepare(copy, "prepare.workers=1")
    assert r.returncode == 0 and "is a finished store" in r.stdout and "left as it is" in r.stdout, r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == before
    r = prepare(copy, "prepare.workers=1", "prepare.overwrite=true")
    assert r.returncode == 0 and "p3d-prepare: wrote" in r.stdout, r.stderr[-2000:]
    assert files_of(copy) == files_of(store)
    assert any(p.stat().st_mtime_ns != before[p.name] for p in copy.iterdir())


@pytest.mark.timeout(300)
def test_bad_prepare_input_is_one_line_and_writes_nothing(tmp_path):
    r = prepare(tmp_path / "out", "data=files", f"data.path={tmp_path}/none*.jsonl")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "matches no file" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# ---- training from the store

COMMON = ("train.steps=6", "train.warmup_steps=2", "train.decay=constant")


@pytest.mark.timeout(600)
def test_store_trains_like_streaming_on_dp2_pp2_tp2(store, tmp_path):
    """Shuffle off: the store's windows in the corpus order are streaming's, so dp2_pp2_tp2 from the store
    matches the single-process reference streaming the stdlib corpus."""
    r = p3d_train(
        f"run.dir={tmp_path}",
        "mesh=dp2_pp2_tp2",
        "data=prepared",
        f"data.path={store}",
        "data.shuffle_buffer=0",
        *COMMON,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cfg, _ = typed("mesh=single", "data.shuffle_buffer=0", *COMMON)  # data=stdlib, streamed
    ref = reference_run(cfg)
    got = read_metrics(tmp_path)
    assert [g["step"] for g in got] == list(range(1, 7))
    for x, y in zip(ref, got):
        assert y["loss"] == pytest.approx(x["loss"], rel=RTOL), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=RTOL), x["step"]


@pytest.mark.timeout(900)
def test_store_resumes_exactly_and_under_another_dp(store, tmp_path):
    """Shuffled store on dp2: 6 straight steps match the reference; 3 steps then a resume to 6 give the
    same losses bit for bit; the resume under dp1 reads the same samples (losses within fp32 reduction order)."""
    data = ("data=prepared", f"data.path={store}")
    straight = p3d_train(f"run.dir={tmp_path / 'straight'}", "mesh=dp2", *data, *COMMON)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]
    first = p3d_train(f"run.dir={tmp_path / 'r1'}", "mesh=dp2", *data, *COMMON[1:], "train.steps=3")
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.copytree(tmp_path / "r1", tmp_path / "r1dp1")
    again = p3d_train(f"run.dir={tmp_path / 'r1'}", "mesh=dp2", *data, *COMMON, "train.resume=auto")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    other = p3d_train(f"run.dir={tmp_path / 'r1dp1'}", "mesh=single", *data, *COMMON, "train.resume=auto")
    assert other.returncode == 0, other.stdout[-2000:] + other.stderr[-2000:]

    a, b, c = (read_metrics(tmp_path / d) for d in ("straight", "r1", "r1dp1"))
    assert [m["step"] for m in b] == [m["step"] for m in c] == list(range(1, 7))
    for x, y in zip(a, b):
        assert (y["loss"], y["grad_norm"], y["samples"]) == (x["loss"], x["grad_norm"], x["samples"]), x["step"]
    for x, y in zip(a[3:], c[3:]):
        assert y["samples"] == x["samples"] and y["loss"] == pytest.approx(x["loss"], rel=RTOL), x["step"]
    cfg, _ = typed("mesh=single", *data, *COMMON)
    for x, y in zip(reference_run(cfg), a):  # the shuffled store: parity with the single-process reference
        assert y["loss"] == pytest.approx(x["loss"], rel=RTOL), x["step"]


@pytest.mark.timeout(600)
def test_a_mixture_trains_and_validates_like_the_reference_and_logs_tokens_and_epochs_per_store(store, tmp_path):
    """A mixture of the stdlib store and a small files store on dp2: the reference's losses (the same
    samples whatever the mesh) and val losses (the blend of the stores' held-out windows, the same
    batches), and metrics.jsonl's tokens_by_source and epochs_by_source follow the blend, step by step."""
    from tests.helpers.stores import make_store, write_corpus

    small_corpus = write_corpus(tmp_path / "c", 200, seed=1)
    small, _ = make_store(tmp_path, "small", small_corpus, "prepare.shard_bytes=4000", "data.val_fraction=0.2")
    mix = f"data.mix=[{{path:{store},weight:0.8}},{{path:{small},weight:0.2}}]"
    args = ("data=prepared", mix, *COMMON[1:], "train.steps=4", "train.eval_every=2", "train.eval_batches=2")
    r = p3d_train(f"run.dir={tmp_path / 'run'}", "mesh=dp2", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = read_metrics(tmp_path / "run")
    cfg, _ = typed("mesh=single", *args)
    width = cfg.model.seq_len + 1
    want = reference_run(cfg)
    assert [g["step"] for g in got] == [x["step"] for x in want] == [1, 2, 3, 4]
    assert [("val_loss" in g) for g in got] == [("val_loss" in x) for x in want] == [False, True, False, True]
    for x, y in zip(want, got):
        assert y["loss"] == pytest.approx(x["loss"], rel=RTOL), x["step"]
        if "val_loss" in x:
            assert y["val_loss"] == pytest.approx(x["val_loss"], rel=RTOL), x["step"]
    assert got[1]["val_loss"] != got[3]["val_loss"]  # evaluated on the model of that step
    for g in got:
        per = g["tokens_by_source"]
        assert sum(per.values()) == g["samples"] * width
        assert abs(per["small"] - 0.2 * g["samples"] * width) <= width, g  # within one sample of the weight
        windows = {Path(x).name: TokenStore(x).tokens("train") // width for x in (store, small)}
        for name, tokens in per.items():  # epochs of its own windows each store gave
            assert g["epochs_by_source"][name] == pytest.approx(tokens / width / windows[name], abs=1e-6), g


@pytest.mark.timeout(600)
def test_a_bad_store_stops_p3d_train_in_one_line_before_any_worker(store, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(store, bad)
    (bad / "shard-00001.val.idx").unlink()
    for path, needle in (
        (tmp_path / "none", "is not a token store (no such directory)"),
        (bad, "shard-00001.val.idx is missing"),
    ):
        r = p3d_train(f"run.dir={tmp_path / 'run'}", "mesh=single", "data=prepared", f"data.path={path}")
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], r.stderr
        assert not (tmp_path / "run").exists()  # nothing written
