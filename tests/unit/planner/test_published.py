"""The planner against the published training runs of tests/helpers/published.py (sources, FLOP conventions and
the fit are described there; docs/planner.md, "Validation against published runs", prints the table), orderings of
layouts of one model the sources report, and their memory tables."""

from __future__ import annotations

import statistics

import pytest

from p3d.planner import evaluate
from tests.helpers.published import HELD_OUT, NEW_SOURCES, ROWS, gpt, run
from tests.helpers.published_fit import (
    GENERATIONS,
    MISSES,
    compared,
    fit,
    fit_loss,
    held_out_errors,
    neighbours,
    predicted,
    stored,
)

# Step time within 13 % at the stored constants: inside the former +-15 % on TFLOP/s per GPU on both sides (which
# is -13.0 % .. +17.6 % on step time)
WITHIN = 0.13
# Issue 50's bounds on the rows the constants were not fitted on (issue 36's, then on leave-one-out errors)
MEDIAN_WITHIN, WORST_WITHIN = 0.08, 0.25


@pytest.mark.parametrize("name", [n for n in ROWS if n not in MISSES])
def test_step_time_within_13_percent(name):
    row = ROWS[name]
    got = compared(name)
    assert abs(got.error) <= WITHIN, (
        f"{name} ({row.source}): predicted {got.step_pred:.2f} s, published {got.step_pub:.2f} s "
        f"({row.value} {row.unit}, {row.convention}): {got.error:+.1%}"
    )


@pytest.mark.parametrize("name", sorted(MISSES))
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known miss > 13%; see docs/planner.md, Known limits")
def test_known_misses(name):
    assert abs(compared(name).error) <= WITHIN


def test_held_out_errors_meet_the_issue_bounds():
    """The planner on the rows its GEMM constants were not fitted on (every other row of the listing): median
    |error| <= 8 % and none beyond 25 % (issue 50), with held-out rows from at least three sources new to the table.
    docs/planner.md prints the table (bench/planner.py published)."""
    errors = held_out_errors()
    worst = max(errors, key=lambda n: abs(errors[n]))
    assert statistics.median(abs(e) for e in errors.values()) <= MEDIAN_WITHIN, errors
    assert abs(errors[worst]) <= WORST_WITHIN, (worst, errors[worst])
    sources = {ROWS[n].source for n in HELD_OUT}
    assert sum(any(s in sources for s in keys) for keys in NEW_SOURCES.values()) >= 3, sources


def test_stored_constants_are_the_fits_optimum():
    """Each generation's (e, k0) in p3d/config/devices.py minimises the mean |ln error| over its fit rows on the
    lattice the fit searches (no neighbour does better): a change to the time model that moves the optimum fails
    here until the constants are fitted again (.venv/bin/python bench/planner.py published --fit)."""
    for gen in GENERATIONS:
        here = fit_loss(gen, *stored(gen))
        for point in neighbours(stored(gen)):
            assert here <= fit_loss(gen, *point), f"{gen}: {point} fits better than the stored {stored(gen)}"


@pytest.mark.slow
def test_the_fit_finds_the_stored_constants():
    """The whole search (bench/planner.py published --fit) lands on the stored constants."""
    for gen in GENERATIONS:
        assert fit(gen) == pytest.approx(stored(gen)), gen


# ---- orderings of layouts of one model


def test_mtnlg_throughput_falls_with_more_replicas_at_fixed_batch(make_cfg):
    """[MTNLG]: 530B, tp 8 pp 35, batch 1920: 126 > 121 > 113 TFLOP/s on 8 / 10 / 12 replicas (fewer
    micro batches each, a larger bubble). Same order, and each ratio to the first within 5 %."""
    published = [126, 121, 113]
    got = [
        predicted(make_cfg, ["model=gpt_530b"] + run(8, 35, dp, 1, 1920, "a100_80gb", zero=1, megatron=False), "eq3")
        for dp in (8, 10, 12)
    ]
    assert got == sorted(got, reverse=True)
    for g, p in zip(got[1:], published[1:]):
        assert g / got[0] == pytest.approx(p / published[0], rel=0.05)


def test_llama3_8k_gpus_beat_16k_gpus_per_gpu(make_cfg):
    """[L3] Table 4: 430 TFLOP/s on 8192 GPUs > 400 on 16384 (same 16M-token batch); ratio within 5 %."""
    a, b = (predicted(make_cfg, ROWS[k].overrides, "p3d") for k in ("L3-405B-8192", "L3-405B-16384"))
    assert a > b
    assert b / a == pytest.approx(400 / 430, rel=0.05)


@pytest.mark.parametrize(
    "shape,pp,gbs,full_s,present_s",
    [
        ((48, 6144, 64), 1, 4, 1.42, 1.10),
        ((96, 12288, 96), 8, 64, 18.13, 13.75),
        ((105, 20480, 128), 35, 280, 49.05, 37.83),
        ((128, 25600, 160), 64, 512, 94.42, 71.49),
    ],
)
def test_selective_with_sequence_parallel_beats_full_recompute(make_cfg, shape, pp, gbs, full_s, present_s):
    """[K22] Table 5: iteration time with full recompute vs selective recompute + sequence parallelism
    (dp 1, tp 8): faster in every case, speedup 1.29-1.32x; predicted speedup within 10 %."""
    full = evaluate(make_cfg(*gpt(*shape), *run(8, pp, 1, 1, gbs, "a100_80gb")), check=False).step_time_s
    present = evaluate(
        make_cfg(*gpt(*shape), *run(8, pp, 1, 1, gbs, "a100_80gb", "selective", True)), check=False
    ).step_time_s
    assert present < full
    assert full / present == pytest.approx(full_s / present_s, rel=0.10)


@pytest.mark.parametrize("gbs", [32, 128])
def test_tensor_parallel_peaks_at_gpus_per_node(make_cfg, gbs):
    """[N21] Sec. 5.4.1, Fig. 13: a ~162B GPT on 64 A100, (t, p) from (2, 32) to (32, 2), dp 1: throughput
    peaks at t = 8, the GPUs of one node, and falls sharply once tensor parallelism crosses nodes.
    (The shape is not given in the text; 88 layers of h = 12288 make 160 B.)"""
    tput = {
        t: predicted(make_cfg, gpt(88, 12288, 96) + run(t, 64 // t, 1, 1, gbs, "a100_80gb"), "eq3")
        for t in (2, 4, 8, 16, 32)
    }
    assert max(tput, key=tput.get) == 8
    assert tput[8] > tput[16] > tput[32]


def test_interleaving_helps_most_at_small_batch(make_cfg):
    """[N21] Fig. 12: GPT-3 175B on 96 A100 (t 8, p 12): the interleaved schedule is faster than 1F1B,
    and its advantage shrinks as the batch (micro batches per pipeline) grows."""
    gains = []
    for gbs in (24, 48, 96):
        plain, inter = (
            predicted(make_cfg, ["model=gpt_175b"] + run(8, 12, 1, 1, gbs, "a100_80gb", v=v), "eq3") for v in (1, 2)
        )
        gains.append(inter / plain)
    assert all(g > 1 for g in gains)
    assert gains == sorted(gains, reverse=True)


# ---- memory tables


def test_zero_stages_through_a_config(make_cfg):
    """[ZERO] Table 1, the 7.5 B model on 64 GPUs, mixed-precision Adam (K = 12), model states per GPU:
    31.4 GB with P_os, 16.6 GB with P_os+g, 1.88 GB with P_os+g+p. Through the planner's own path: a
    GPT of 36 x 4096 on 64 GPUs (pp 1, tp 1), bf16 with the ZeRO stage's sharding. Its bytes per
    parameter are Psi (2 + 2 + 12/64) and Psi 16/64 exactly, and at the paper's Psi = 7.5e9 they give the table.

    p3d's stage 2 is not the paper's P_os+g: FSDP2 (docs/zero.md) keeps the parameters sharded between steps too, so
    its resident states are stage 3's, 16/64 per parameter, and a step gathers 2 + 4 bytes per parameter on top (bf16
    weights, fp32 gradients accumulated over the micro batches)."""
    from p3d.layout.geometry import total_params
    from p3d.planner.memory import stage_memory
    from p3d.planner.shapes import layout_of

    cases = ((1, 2 + 2 + 12 / 64, 31.4), (2, 16 / 64, 1.88), (3, 16 / 64, 1.88))
    for stage, factor, published_gb in cases:
        cfg = make_cfg(*gpt(36, 4096, 32), *run(1, 1, 64, 1, 64, "a100_80gb", zero=stage))
        (mem,) = stage_memory(cfg, layout_of(cfg))
        states = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
        per_param = states / total_params(cfg.model)
        assert per_param == pytest.approx(factor, rel=1e-6)
        assert 7.5e9 * per_param / 1e9 == pytest.approx(published_gb, abs=0.05)
        assert mem.step_buffers == pytest.approx((6.0 if stage >= 2 else 0.0) * total_params(cfg.model), rel=1e-6)
