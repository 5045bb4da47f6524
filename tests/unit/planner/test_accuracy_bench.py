"""bench/planner.py accuracy's arithmetic (its runs are a benchmark, not a test): the measured median over the steps
after the warm-up, Kendall's tau, the inverted pairs split at the noise, and every layout a config p3d-plan accepts."""

from __future__ import annotations

import importlib
import json

import pytest

from p3d.planner import evaluate


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench.planner")


def test_step_records_reads_the_step_records_only_and_keeps_where_the_time_went(bench, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    steps = [{"step": s, "loss": 1.0, "step_time_s": 1.0 + s, "dp_comm_s": 0.1 * s} for s in range(1, 6)]
    metrics.write_text("\n".join(json.dumps(r) for r in [{"event": "start"}, *steps]))
    records = bench.step_records(metrics)
    assert {s: r["step_time_s"] for s, r in records.items()} == {1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 5: 6.0}
    assert records[3] == {"step_time_s": 4.0, "dp_comm_s": pytest.approx(0.3)}  # loss is not kept


def test_kendall_tau(bench):
    assert bench.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert bench.kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert bench.kendall_tau([1, 2, 3], [10, 30, 20]) == pytest.approx(1 / 3)


def test_inverted_pairs_split_at_the_noise(bench):
    names = ["a", "b", "c"]
    counted, close = bench.inverted_pairs(names, [1.0, 2.0, 3.0], [1.0, 0.99, 2.0])  # a/b inverted by 1%
    assert counted == [] and [(x, y) for x, y, _ in close] == [("a", "b")]
    counted, close = bench.inverted_pairs(names, [1.0, 2.0, 3.0], [1.0, 0.5, 2.0])
    assert [(x, y) for x, y, _ in counted] == [("a", "b")] and close == []


def test_summary_names_the_worst_and_the_median(bench):
    rows = [
        {"name": "x", "world": 1, "table_s": 1.0, "calibrated_s": 1.1, "measured_s": 1.0},
        {"name": "y", "world": 2, "table_s": 1.0, "calibrated_s": 1.8, "measured_s": 2.0},
        {"name": "z", "world": 4, "table_s": 1.0, "calibrated_s": 3.0, "measured_s": 3.0},
    ]
    text = "\n".join(bench.summary(rows))
    assert "median |error| 10.0%, worst x +10.0%" in text  # |x| = |y|: the first listed
    assert "Kendall tau +1.00" in text and "beyond 3%: none" in text


def test_every_layout_is_one_p3d_plan_accepts(bench, make_cfg):
    """The eight layouts and the three oversubscribed ones compose and plan (with the checks p3d-train makes), at the
    world sizes the bench states."""
    worlds = {}
    assert len(bench.LAYOUTS) == 8
    for name, overrides in {**bench.LAYOUTS, **bench.OVERSUBSCRIBED}.items():
        report = evaluate(make_cfg(*bench.COMMON, *overrides))
        refused = [w for w in report.warnings if w.startswith("p3d-train would refuse")]
        assert refused == [], (name, refused)
        worlds[name] = report.layout.world_size
    assert sorted(set(worlds.values())) == [1, 2, 4, 8]
    assert {worlds[n] for n in bench.LAYOUTS} == {1, 2} and {worlds[n] for n in bench.OVERSUBSCRIBED} == {4, 8}


def test_repeatability_is_the_spread_between_passes(bench):
    rows = [
        {"name": "x", "passes_s": [1.0, 1.1]},
        {"name": "y", "passes_s": [2.0, 2.0]},
        {"name": "z", "passes_s": [3.6, 3.0]},
    ]
    line = bench.repeatability(rows)
    assert "10.0% apart (median), at most 20.0% (z)" in line
