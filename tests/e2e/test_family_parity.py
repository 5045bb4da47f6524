"""Layout parity of the families' pieces (issue 61): every layout trains the single-process run's model.

The pieces together in two models: a dense one with a head_dim apart from hidden / heads (12 of a 64 hidden over 8
heads), q|k|v biases, q/k norms and yarn's scaled RoPE; a mixture of experts (moe_tiny) with the same head_dim,
biases and q/k norms and Llama 3.1's scaling. Each case runs ``p3d-train`` for 10 fp32 steps (clipping on) and
compares the loss and global gradient norm of every step, and the held-out loss, with the ``to_sequential`` twin
trained by a plain PyTorch loop (p3d.train.reference), 1e-5 relative: a bias cut across heads, a q/k norm weight
whose tp partials were not summed, a cp rank rotating by its local positions, or an expert on the wrong ep rank
leaves the reference at the first step.
"""

from __future__ import annotations

import functools

import pytest

from p3d.train.metrics import read_metrics
from tests.helpers.runs import assert_follows_curve, output_tail, p3d_train, single_process_curve
from tests.helpers.tiers import with_slow

STEPS = 10
RTOL = 1e-5
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=2", f"train.eval_every={STEPS}")
PIECES = ("model.head_dim=12", "model.qkv_bias=true", "model.qk_norm=true")
DENSE = ("model=tiny", *PIECES, "model.rope_scaling.rope_type=yarn", "model.rope_scaling.factor=4",
         "model.rope_scaling.original_max_position_embeddings=16")  # fmt: skip
MOE = ("model=moe_tiny", *PIECES, "model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8",
       "model.rope_scaling.original_max_position_embeddings=16", "model.rope_scaling.low_freq_factor=1",
       "model.rope_scaling.high_freq_factor=4")  # fmt: skip

CASES = {
    "tp2_pp2": (DENSE, ["mesh=tp2_pp2"]),  # DeepSpeed's 1F1B: heads split over tp, blocks over pp
    "tp2_pp2-sp": (DENSE, ["mesh=tp2_pp2", "schedule.sequence_parallel=true"]),
    "dp2-cp2": (DENSE, ["mesh=dp2", "mesh.cp=2"]),  # global positions on every cp rank
    "cp2-tp2-sp-selective": (
        DENSE,
        ["mesh=tp2", "mesh.cp=2", "schedule.sequence_parallel=true", "schedule.recompute=selective"],
    ),  # fmt: skip
    "dp2-zero3": (DENSE, ["mesh=dp2", "zero=stage3"]),  # FSDP2 over the biases and norms too
    "moe-ep2-dp2": (MOE, ["mesh=dp2", "mesh.ep=2"]),
    "moe-ep2-dp2_tp2": (MOE, ["mesh=dp2_tp2", "mesh.ep=2"]),
    "moe-ep2-dp2_pp2-zero3": (MOE, ["mesh=dp2_pp2", "mesh.ep=2", "zero=stage3"]),
}
FAST = ("tp2_pp2",)  # make test keeps the dense model on tp2_pp2; the other layouts are the slow tier's


@functools.cache
def reference(model: tuple[str, ...]) -> list[dict]:
    return single_process_curve(*COMMON, *model)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", with_slow(CASES, set(CASES) - set(FAST)))
def test_the_families_pieces_hold_parity_on_every_layout(case, tmp_path):
    model, layout = CASES[case]
    result = p3d_train(*COMMON, *model, f"run.dir={tmp_path}", *layout)
    assert result.returncode == 0, output_tail(result)
    got, ref = read_metrics(tmp_path), reference(model)
    assert_follows_curve(got, ref, RTOL, extra=("val_loss", "moe_aux_loss"))
    assert got[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=RTOL)
    assert got[-1]["loss"] < got[0]["loss"] - 0.5  # it learns
