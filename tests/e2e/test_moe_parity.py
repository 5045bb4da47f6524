"""Mixture-of-experts parity: every layout of model=moe_tiny trains the single-process run's model.

Each case runs ``p3d-train`` for 10 fp32 steps (dropless top-2 routing, clipping on) and compares, step by step,
the loss, the global gradient norm, the balancing loss and the load imbalance, and the held-out loss after the
last step, with the ``to_sequential`` twin (every expert local) trained by a plain PyTorch loop on the same data
from the same init (p3d.train.reference). Tolerance: 1e-5 relative. A routing decision is discrete: a layout that
computed a router score differently would send a token to another expert and its loss would leave the reference's
at once, which this tolerance catches.
"""

from __future__ import annotations

import functools

import pytest

from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.runs import p3d_train, typed
from tests.helpers.tiers import with_slow

STEPS = 10
RTOL = 1e-5
COMMON = ("model=moe_tiny", f"train.steps={STEPS}", "train.warmup_steps=2", f"train.eval_every={STEPS}")

# DeepSeek-V3's router, scaled down (its 256 experts in 8 groups, top-8 of the best 4): sigmoid scores, 8 experts in 4
# groups of 2, each token's top-2 among the 4 experts of its best 2 groups
GROUPED = (
    "model.moe.score=sigmoid",
    "model.moe.n_experts=8",
    "model.moe.n_groups=4",
    "model.moe.topk_groups=2",
)
CASES = {
    # the cases
    "ep2-dp2": ["mesh=dp2", "mesh.ep=2"],
    "ep2-dp2_pp2-1f1b": ["mesh=dp2_pp2", "mesh.ep=2"],
    "ep2-dp2_pp2-interleaved": ["mesh=dp2_pp2", "mesh.ep=2", "schedule.pipeline=interleaved_1f1b"],
    "ep2-dp2_tp2-sp": ["mesh=dp2_tp2", "mesh.ep=2", "schedule.sequence_parallel=true"],
    "ep4-dp4-zero1": ["mesh=dp4", "mesh.ep=4", "zero=stage1"],
    # variants: DeepSpeed's engine (ep = 1), the other schedules, ZeRO-2/3, recompute, routing options
    "ep1-dp2_pp2-deepspeed": ["mesh=dp2_pp2"],
    "ep1-tp2_pp2-deepspeed-zero1": ["mesh=dp2_pp2_tp2", "zero=stage1"],
    "ep1-pp2-deepspeed-recompute": ["mesh=pp2", "schedule=recompute"],  # DeepSpeed's reentrant checkpointing
    "ep2-dp2_pp2-zbv": ["mesh=dp2_pp2", "mesh.ep=2", "schedule.pipeline=zbv"],
    "ep2-dp2_pp2-dualpipev": ["mesh=dp2_pp2", "mesh.ep=2", "schedule.pipeline=dualpipev"],
    "ep2-dp2_pp2-zero_bubble": ["mesh=dp2_pp2", "mesh.ep=2", "schedule.pipeline=interleaved_zero_bubble"],
    "ep2-dp2_pp2-gpipe": ["mesh=dp2_pp2", "mesh.ep=2", "schedule.pipeline=gpipe"],
    "ep2-dp4-zero1": ["mesh=dp4", "mesh.ep=2", "zero=stage1"],
    "ep2-dp4-zero2": ["mesh=dp4", "mesh.ep=2", "zero=stage2"],
    "ep2-dp2_pp2-zero3": ["mesh=dp2_pp2", "mesh.ep=2", "zero=stage3"],
    "ep2-dp2_pp2-recompute": ["mesh=dp2_pp2", "mesh.ep=2", "schedule=recompute"],
    "ep2-dp2_tp2-selective": [
        "mesh=dp2_tp2",
        "mesh.ep=2",
        "schedule.recompute=selective",
        "schedule.recompute_swiglu=true",
    ],
    "ep2-dp2-capacity": ["mesh=dp2", "mesh.ep=2", "model.moe.capacity_factor=1.0"],
    # validation after every other step leaves the next steps' gradients, routing figures and biases alone
    "ep2-dp2-validating": ["mesh=dp2", "mesh.ep=2", "train.eval_every=2", "model.moe.bias_update_rate=0.01"],
    "ep2-dp2-sigmoid-bias": [
        "mesh=dp2",
        "mesh.ep=2",
        "model.moe.score=sigmoid",
        "model.moe.bias_update_rate=0.01",
        "model.moe.aux_loss_coef=0.0",
    ],
    # context parallelism with experts (issue 62): the balancing loss, a capacity and the routing figures over the
    # whole sequence across the cp ranks; DeepSeek-V3's grouped sigmoid router with its selection biases moving
    "ep2-dp2-cp2-grouped": ["mesh=dp2", "mesh.ep=2", "mesh.cp=2", *GROUPED, "model.moe.bias_update_rate=0.01"],
    "ep2-dp2-cp2": ["mesh=dp2", "mesh.ep=2", "mesh.cp=2"],
    "ep2-dp2-cp2-capacity": ["mesh=dp2", "mesh.ep=2", "mesh.cp=2", "model.moe.capacity_factor=1.0"],
    "ep2-dp2-cp2-zero1": ["mesh=dp2", "mesh.ep=2", "mesh.cp=2", "zero=stage1"],
    "ep2-dp2-cp2-zero3-grouped": ["mesh=dp2", "mesh.ep=2", "mesh.cp=2", "zero=stage3", *GROUPED],
    # (biases fixed: aux-loss-free balancing drives competing experts' corrected scores together, and tp's partial
    # sums, rounded in another order, flipped a near tie at step 3 on dp2_tp2 with SP, with cp and without alike)
    "ep2-dp2_tp2-cp2-sp-grouped": [
        "mesh=dp2_tp2",
        "mesh.ep=2",
        "mesh.cp=2",
        "schedule.sequence_parallel=true",
        *GROUPED,
    ],
    "tp2-cp2-grouped-capacity": ["mesh=tp2", "mesh.cp=2", *GROUPED, "model.moe.capacity_factor=1.0"],
    "ep2-dp2_pp2-cp2-interleaved": ["mesh=dp2_pp2", "mesh.ep=2", "mesh.cp=2", "schedule.pipeline=interleaved_1f1b"],
}
MODEL_KEYS = ("model.", "train.eval_every")
# make test keeps three of the five: a pipeline (interleaved), tp with SP, ep4 with ZeRO-1; ep2 on dp2 and
# dp2_pp2 under 1f1b are in the slow tier with the variants (make test trains ep2 on dp2 through the README's line,
# and tests/workers/test_moe_layers.py checks ep2 against the unsharded block); and of issue 62's cp cases ep2 on
# dp2 with cp2 and the grouped router in the slow tier too (51 s; make test keeps the block under cp with ep2 and with
# the grouped router against the unsharded in tests/workers/test_moe_cp.py, and the grouped router's training in
# tests/e2e/test_deepseek_parity.py's tp2-sp)
FAST = ("ep2-dp2_pp2-interleaved", "ep2-dp2_tp2-sp", "ep4-dp4-zero1")
SLOW = tuple(c for c in CASES if c not in FAST)


@functools.cache
def reference(model_overrides: tuple[str, ...]) -> list[dict]:
    cfg, _ = typed("mesh=single", *COMMON, *model_overrides)
    return reference_run(cfg)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", with_slow(CASES, SLOW))
def test_moe_layout_matches_single_process(case, tmp_path):
    overrides = CASES[case]
    result = p3d_train(*COMMON, f"run.dir={tmp_path}", *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = read_metrics(tmp_path)
    ref = reference(tuple(o for o in overrides if o.startswith(MODEL_KEYS)))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert any(r["grad_norm"] > 1.0 for r in ref), "clipping must be exercised"
    for r, g in zip(ref, got):
        step = r["step"]
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL), f"step {step} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=RTOL), f"step {step} grad norm"
        assert g["moe_aux_loss"] == pytest.approx(r["moe_aux_loss"], rel=RTOL), f"step {step} balancing loss"
        assert g["moe_load_imbalance"] == pytest.approx(r["moe_load_imbalance"], rel=RTOL), f"step {step} load"
        assert g["moe_dropped"] == pytest.approx(r["moe_dropped"], abs=1e-12), f"step {step} dropped"
        if "val_loss" in r:
            assert g["val_loss"] == pytest.approx(r["val_loss"], rel=RTOL), f"step {step} held-out loss"
    assert got[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=RTOL), "held-out loss after the last step"
    assert got[-1]["loss"] < got[0]["loss"] - 0.5  # it learns
