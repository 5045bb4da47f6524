"""Float8 training (``train.fp8``, issue 63) on CPU by emulation: ``model=tiny`` in each dense recipe follows the bf16
curve, step by step, within ``LOSS_RTOL`` = 1e-2 relative, and differs from it by at least ``RUNS_FLOAT8`` = 5e-4 at
some step (the float8 path ran: bf16 itself would match its own curve exactly); the same on dp2_pp2_tp2 (with
sequence parallelism: the tensorwise SP gather travels in float8), on an MoE layout in MXFP8, and across a resume
that changes ``train.fp8``. torchao measured 2.3e-3 for float8 against bf16 on a tiny Llama over 40 steps
(/work/shared/notes/stack-on-cpu.md); the figures each case prints are in docs/precision.md."""

from __future__ import annotations

import functools

import pytest

from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.runs import p3d_train, typed
from tests.helpers.tiers import with_slow

STEPS = 40
LOSS_RTOL = 1e-2
RUNS_FLOAT8 = 5e-4
# lr 2.25e-3: at p3d's default 3e-3 the tiny model's loss plateaus from step 24 on, where float8 and bf16 part by up
# to 2.8e-2 (tensorwise, measured); at 2.25e-3 the three dense recipes stay within 1.9e-3 to 2.4e-3 of bf16 over 40
# steps (measured 2026-12-07), at 2e-3 within 4.5e-4 (tensorwise: below RUNS_FLOAT8)
COMMON = ("train.dtype=bf16", "train.lr=2.25e-3")
CASES = {
    "tensorwise": ["mesh=single", "train.fp8=tensorwise"],
    "rowwise": ["mesh=single", "train.fp8=rowwise"],
    "rowwise_with_gw_hp": ["mesh=single", "train.fp8=rowwise_with_gw_hp"],
    "dp2_pp2_tp2-sp-tensorwise": ["mesh=dp2_pp2_tp2", "schedule.sequence_parallel=true", "train.fp8=tensorwise"],
    "dp2_pp2_tp2-rowwise": ["mesh=dp2_pp2_tp2", "train.fp8=rowwise"],
}
MOE = ("model=moe_tiny", "mesh=dp2", "mesh.ep=2")


@functools.cache
def bf16_curve(steps: int, *overrides: str) -> list[float]:
    """bf16's losses on ``mesh=single``, or with ``model=moe_tiny`` on its MoE layout (``MOE``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        mesh = MOE[1:] if "model=moe_tiny" in overrides else ("mesh=single",)
        result = p3d_train(*COMMON, *overrides, *mesh, f"train.steps={steps}", f"run.dir={run_dir}", timeout=500)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return [r["loss"] for r in read_metrics(run_dir)]


def _follows(got: list[dict], ref: list[float], case: str, runs_float8: float = RUNS_FLOAT8) -> None:
    assert [r["step"] for r in got] == list(range(1, len(ref) + 1))
    rel = [abs(g["loss"] - r) / r for g, r in zip(got, ref, strict=True)]
    print(f"{case}: loss, max relative difference {max(rel):.2e} at step {rel.index(max(rel)) + 1}")
    assert max(rel) <= LOSS_RTOL, rel
    assert max(rel) >= runs_float8, f"float8 must differ from bf16 somewhere, else it ran bf16: {max(rel):.1e}"
    assert got[-1]["loss"] < got[0]["loss"] - 0.5  # it learns, as bf16 does


# make test keeps one short case: tp2 with sequence parallelism, tensorwise (float8 gather, tp-reduced amaxes), 12
# steps, against the fp32 single-process reference computed here (no second launch); the 40-step cases below hold
# the float8 curves to bf16's. Measured: 3.1e-4 from fp32 at most
def test_float8_tp2_sp_follows_the_reference_curve(tmp_path):
    steps = 12
    run = ("mesh=tp2", "schedule.sequence_parallel=true", "train.fp8=tensorwise", f"train.steps={steps}")
    result = p3d_train(*COMMON, *run, f"run.dir={tmp_path}", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "train.fp8=tensorwise (emulated on cpu): 16 linears of this stage's blocks in float8" in result.stdout
    # torchao's import, through p3d.compat, is quiet: no warning per CUDA extension it cannot load on a CPU
    assert "Failed to load" not in result.stdout + result.stderr and "register_constant" not in result.stderr
    cfg, _ = typed("mesh=single", "train.lr=2.25e-3", f"train.steps={steps}")
    ref = [r["loss"] for r in reference_run(cfg)]
    _follows(read_metrics(tmp_path), ref, "tp2-sp-tensorwise float8 vs fp32", runs_float8=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", with_slow(CASES, CASES))
def test_float8_follows_the_bf16_curve_for_40_steps(case, tmp_path):
    result = p3d_train(*COMMON, *CASES[case], f"train.steps={STEPS}", f"run.dir={tmp_path}", timeout=800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _follows(read_metrics(tmp_path), bf16_curve(STEPS), f"{case} float8 vs bf16")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mxfp8_experts_follow_the_bf16_curve_on_an_moe_layout(tmp_path):
    result = p3d_train(*COMMON, *MOE, "train.fp8=mxfp8", f"train.steps={STEPS}", f"run.dir={tmp_path}", timeout=800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "the routed experts of 3 MoE blocks in MXFP8" in result.stdout
    _follows(read_metrics(tmp_path), bf16_curve(STEPS, "model=moe_tiny"), "moe_tiny dp2 ep2 mxfp8 vs bf16")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_resumes_across_fp8_values(tmp_path):
    """Checkpoints hold the fp32 master weights and moments, never a float8 cast: a tensorwise run resumed as
    rowwise, then as bf16, continues the curve within the same tolerance. A constant LR after the warmup: each
    segment's ``train.steps`` would otherwise end its own cosine (what a resume that changes it means)."""
    half = STEPS // 2
    runs = [("train.fp8=tensorwise", half), ("train.fp8=rowwise", half + 10), ("train.fp8=none", STEPS)]
    for i, (fp8, until) in enumerate(runs):
        resume = ("train.resume=auto",) if i else ()
        result = p3d_train(
            *COMMON,
            "mesh=single",
            "train.decay=constant",
            fp8,
            *resume,
            f"train.steps={until}",
            f"run.dir={tmp_path}",
            timeout=800,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        if i:
            assert f"resumed from step {runs[i - 1][1]}" in result.stdout
    _follows(
        read_metrics(tmp_path),
        bf16_curve(STEPS, "train.decay=constant"),
        "resume tensorwise -> rowwise -> bf16, vs bf16",
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero3_float8_gather_starts_bitwise_like_zero0(tmp_path):
    """dp2 tensorwise, 3 steps, no clipping: ZeRO-3 gathers the float8 weights in float8, ZeRO-0 casts whole ones;
    the same weights, so the first loss is bitwise the same. After it the other parameters' FSDP2 bf16 policy
    (against autocast) parts the runs as it parts bf16 runs (docs/precision.md): within 1e-4 (measured 1.6e-5)."""
    losses = {}
    for zero in ("stage0", "stage3"):
        run_dir = tmp_path / zero
        run = ("mesh=dp2", f"zero={zero}", "train.fp8=tensorwise", "train.steps=3", "train.grad_clip=0")
        result = p3d_train(*COMMON, *run, f"run.dir={run_dir}", timeout=400)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[zero] = [r["loss"] for r in read_metrics(run_dir)]
    assert losses["stage3"][0] == losses["stage0"][0]
    rel = [abs(a - b) / b for a, b in zip(losses["stage3"], losses["stage0"], strict=True)]
    print(f"zero3 vs zero0 in float8: {[f'{r:.1e}' for r in rel]}")
    assert max(rel) <= 1e-4, rel
    # the checkpoint holds the fp32 shards inside the float8-gathered weights, and the scales follow the load
    run = ("mesh=dp2", "zero=stage3", "train.fp8=tensorwise", "train.steps=5", "train.grad_clip=0")
    resumed = p3d_train(*COMMON, *run, "train.resume=auto", f"run.dir={tmp_path / 'stage3'}", timeout=400)
    assert resumed.returncode == 0 and "resumed from step 3" in resumed.stdout, resumed.stdout[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "stage3")] == [1, 2, 3, 4, 5]
