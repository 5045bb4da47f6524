"""What a run shows: W&B offline files with every metric, nothing from logger=none, the measured
pipeline bubble, a progress bar, and a tokenizer trained by p3d-tokenizer."""

from __future__ import annotations

import json

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import p3d_train
from tests.helpers.tiers import with_slow
from tests.helpers.wandb_log import history, run_config


@pytest.mark.timeout(240)
def test_wandb_offline_run_holds_every_metric(tmp_path):
    # no WANDB_* variables and no ~/.netrc: no API key anywhere -> offline, not an error
    result = p3d_train(
        f"run.dir={tmp_path / 'run'}",
        "logger=wandb",
        "train.steps=3",
        "mesh=pp2",
        env={"HOME": str(tmp_path)},
        drop_env="WANDB_",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    rows = history(runs[0])
    metrics = read_metrics(tmp_path / "run")
    assert [r["_step"] for r in rows] == [1, 2, 3]
    for row, m in zip(rows, metrics):
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "bubble", "peak_mem_gb"):
            assert row[key] == pytest.approx(m[key]), key
        for stage in (0, 1):  # a list in metrics.jsonl, one chart per stage in W&B
            assert row[f"stage_compute_s/{stage}"] == pytest.approx(m["stage_compute_s"][stage])
    config = run_config(runs[0])  # the resolved run spec is the W&B config
    assert config["mesh"]["name"] == "pp2" and config["run_plan"]["pp"] == 2 and config["train"]["steps"] == 3


# slow tier (10 s): kept: the MoE figures in metrics.jsonl (tests/e2e/test_moe_parity.py) and W&B's lists as charts
# (the test above)
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wandb_holds_the_moe_balancing_loss_and_load_imbalance(tmp_path):
    result = p3d_train(
        f"run.dir={tmp_path / 'run'}",
        "logger=wandb",
        "train.steps=2",
        "model=moe_tiny",
        "mesh=dp2",
        "mesh.ep=2",
        env={"HOME": str(tmp_path)},
        drop_env="WANDB_",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = history(next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")))
    metrics = read_metrics(tmp_path / "run")
    assert [r["_step"] for r in rows] == [1, 2]
    for row, m in zip(rows, metrics):
        assert row["moe_aux_loss"] == pytest.approx(m["moe_aux_loss"]) and 2.9 < m["moe_aux_loss"] < 3.3
        assert row["moe_dropped"] == 0
        for layer in range(3):  # moe_tiny's MoE blocks 1-3: one chart each
            assert row[f"moe_load_imbalance/{layer}"] == pytest.approx(m["moe_load_imbalance"][layer])
            assert row[f"moe_aux_loss_layers/{layer}"] == pytest.approx(m["moe_aux_loss_layers"][layer])


@pytest.mark.timeout(240)
def test_logger_none_writes_no_wandb_files_and_bubble_is_measured(tmp_path):
    result = p3d_train(f"run.dir={tmp_path}", "logger=none", "train.steps=3", "mesh=pp2", "logger.progress=bar")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (tmp_path / "wandb").exists() and not list(tmp_path.rglob("*.wandb"))
    rows = read_metrics(tmp_path)
    # pp=2 stages, 8 micro batches: the 1F1B idle share is (p-1)/(m+p-1) = 1/9
    assert all(r["bubble_theory"] == pytest.approx(1 / 9) for r in rows)
    # measured: time blocked on the neighbour stage, at least the fill/drain share (imbalance only adds)
    assert all(0.5 / 9 <= r["bubble"] < 0.9 for r in rows), [r["bubble"] for r in rows]
    assert all(r["peak_mem_gb"] > 0.1 for r in rows)
    assert all(r["dp_comm_s"] == 0.0 for r in rows)  # one replica: no dp collective to wait on
    assert "train: 100%" in result.stdout and "3/3" in result.stdout  # the progress bar reached its end


@pytest.mark.timeout(240)
def test_no_pipeline_means_no_bubble(tmp_path):
    result = p3d_train(f"run.dir={tmp_path}", "train.steps=2", "mesh=dp2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(r["bubble"] == 0.0 and r["bubble_theory"] == 0.0 for r in read_metrics(tmp_path))


# case -> overrides: every executor's dp collectives (DeepSpeed's ReduceGrads and ZeRO-1 all-gather; torch's flat
# all-reduce and ZeRO-1 broadcasts; FSDP2's gathers and reduce-scatters under ZeRO-2/3)
DP_COMM_CASES = {
    "zero3-fsdp": ("mesh=dp2", "zero=stage3"),
    "zero2-fsdp": ("mesh=dp2", "zero=stage2"),
    "zero0-deepspeed": ("mesh=dp2",),
    "zero1-deepspeed": ("mesh=dp2", "zero=stage1"),
    "zero1-torch": ("mesh=dp2_pp2", "zero=stage1", "schedule.pipeline=gpipe"),
}
DP_COMM_DELAY = 0.1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", with_slow(DP_COMM_CASES, [c for c in DP_COMM_CASES if c != "zero3-fsdp"]))
def test_time_blocked_in_dp_collectives_is_measured(tmp_path, case):
    """dp2, rank 1 sleeps DP_COMM_DELAY in each of its m = 4 forwards (P3D_TEST_SLOW_RANK). Under FSDP2 the first
    collective after each forward is a dp all-gather (the next unit's weights), so rank 0 waits there, about
    m x the delay a step, and dp_comm_s (the mean over the two ranks) is at least 0.4 m x the delay. Under the
    others the step gate's all-gather absorbs the wait before the step's dp reduction, which then blocks for its
    own traffic only: more than 0, less than the step (the clocks themselves: tests/workers/test_dp_collectives.py)."""
    from p3d.train.timing import SLOW_ENV

    slowed = {SLOW_ENV: f"1:{DP_COMM_DELAY}"}
    result = p3d_train(f"run.dir={tmp_path}", "train.steps=3", "logger=none", *DP_COMM_CASES[case], env=slowed)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "4 micro batches" in result.stdout
    rows = read_metrics(tmp_path)
    waited = [r["dp_comm_s"] for r in rows]
    least = 0.4 * 4 * DP_COMM_DELAY if "fsdp" in case else 1e-5
    assert all(least <= w < r["step_time_s"] for w, r in zip(waited, rows)), waited


@pytest.mark.timeout(240)
def test_validation_loss_is_logged(tmp_path):
    result = p3d_train(f"run.dir={tmp_path}", "train.steps=4", "train.eval_every=2", "mesh=tp2_pp2")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_metrics(tmp_path)
    assert [("val_loss" in r) for r in rows] == [False, True, False, True]
    assert rows[3]["val_loss"] < rows[1]["val_loss"]  # held-out loss falls as the model learns


@pytest.mark.timeout(240)
def test_trained_tokenizer_round_trips_and_trains(tmp_path):
    import subprocess
    import sys

    from p3d.data.tokenizer import HFTokenizer
    from tests.helpers.runs import ROOT

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3}) for i in range(400))
    )
    out = tmp_path / "tok" / "tokenizer.json"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "p3d.cli.tokenizer",
            "data=files",
            f"data.path={corpus}",
            "tokenizer.vocab_size=400",
            f"tokenizer.out={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    tok = HFTokenizer(str(out))
    assert tok.vocab_size == 400
    text = "def f12(x):\n    return x * 12 + 5\n"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text.encode()) / 2
    run = p3d_train(
        f"run.dir={tmp_path / 'run'}",
        "data=files",
        f"data.path={corpus}",
        f"data.tokenizer={out}",
        "model.vocab_size=400",
        "model.seq_len=32",
        "train.steps=2",
        "mesh=tp2",
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    refused = p3d_train(
        f"run.dir={tmp_path / 'run2'}",
        "data=files",
        f"data.path={corpus}",
        f"data.tokenizer={out}",
        "model.vocab_size=300",
        timeout=60,
    )
    assert refused.returncode == 2 and "model.vocab_size=300" in refused.stderr and "400 tokens" in refused.stderr
