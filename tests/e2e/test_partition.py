"""partition=cost idles less than uniform (issue 11, item 6): the measured idle share (the metric ``bubble``) of a
model shaped like ``model=small`` on pp2, at an eighth of its FLOPs so that a step takes about a second here; on
the case itself it is a benchmark, ``bench/schedules.py partition``."""

from __future__ import annotations

import statistics

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import p3d_train

# model=small's 4-layer case in miniature: h = 256, 4 blocks, an 18k-word head weighing 5.4 blocks at s = 128
HEAVY_HEAD = (
    "model.hidden_size=256", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden_size=704",
    "model.vocab_size=18432", "model.seq_len=128", "mesh=pp2", "schedule.micro_batch_size=1",
    "schedule.global_batch_size=16", "train.steps=4", "train.save_every=0",
)  # fmt: skip


# slow tier (20 s): kept: the FLOPs of each stage under each partition (unit/layout/test_partition.py)
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_cost_partition_idles_less_than_uniform(tmp_path):
    """pp2, 16 micro batches: uniform puts [embed, 3 blocks | block, norm, head] (3 against 6.4 blocks of FLOPs),
    cost [embed, 4 blocks | norm, head] (4 against 5.4); the measured idle share of the steps after the first
    must be lower under cost, and its stages' compute seconds closer to equal."""
    measured = {}
    for partition in ("uniform", "cost"):
        run = tmp_path / partition
        result = p3d_train(*HEAVY_HEAD, f"schedule.partition={partition}", f"run.dir={run}", timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        records = read_metrics(run)[1:]
        ratio = statistics.median(max(r["stage_compute_s"]) / min(r["stage_compute_s"]) for r in records)
        measured[partition] = (statistics.median(r["bubble"] for r in records), ratio)
    print({p: f"idle {idle:.3f}, busier / other stage compute {ratio:.2f}" for p, (idle, ratio) in measured.items()})
    assert measured["cost"][0] < measured["uniform"][0], measured
    assert measured["cost"][1] < measured["uniform"][1], measured
