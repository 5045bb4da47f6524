"""Heterogeneous layouts train the same model (issue 55): uneven stages (schedule.stage_blocks), uneven micro batches
per replica (schedule.replica_micro_batches) and both, through p3d-train (real workers, gloo), against the
single-process run: every step's loss and global gradient norm within 1e-5 over 10 fp32 steps, clipping active.

The uneven micro batches run on the torch executor (DeepSpeed's engine averages over dp with one accumulation count):
replica r runs its own m_r micro batches and divides each micro batch's loss by the replicas' mean count M / dp, so
that the mean over dp weighs every micro batch of the global batch 1 / M, as the single process does. A resume from a
heterogeneous run into a homogeneous layout (and back) continues the same curve: checkpoints are cut by layer name.
"""

from __future__ import annotations

import functools

import pytest

from p3d.checkpoint import find as checkpoint
from p3d.train.metrics import read_metrics
from p3d.train.reference import reference_run
from tests.helpers.runs import assert_follows_curve, output_tail, p3d_train, typed
from tests.helpers.tiers import with_slow

STEPS = 10
RTOL = 1e-5
COMMON = (f"train.steps={STEPS}", "train.warmup_steps=2", f"train.eval_every={STEPS}")
# two simulated cpu nodes, the second twice as slow (its blocks would sleep twice as long under P3D_TEST_BLOCK_SECONDS)
GROUPS = "cluster.groups=[{device: cpu, nodes: 1}, {device: cpu, nodes: 1, peak_tflops: 0.05}]"

CASES = {
    # uneven stages: DeepSpeed's engine (1f1b) takes the plan's bounds
    "pp2-3+1": ["mesh=pp2", "schedule.stage_blocks=[3,1]"],
    # and a torch schedule's chunks: 6 blocks over pp2 x 2 chunks, 3 + 1 on rank 0 (chunks 0, 2), 1 + 1 on rank 1
    "pp2-interleaved-3+1+1+1": [
        "mesh=pp2",
        "schedule.pipeline=interleaved_1f1b",
        "schedule.virtual_stages=2",
        "schedule.stage_blocks=[3,1,1,1]",
        "model.n_layers=6",
    ],
    # uneven micro batches: 3 and 5 of the 8 micro batches of 2 sequences
    "dp2-3+5": ["mesh=dp2", "schedule.replica_micro_batches=[3,5]"],
    # both, on two simulated nodes of a mixed cluster (replica 0's stages and replica 1's on both nodes)
    "dp2_pp2-3+1-3+5": ["mesh=dp2_pp2", GROUPS, "schedule.stage_blocks=[3,1]", "schedule.replica_micro_batches=[3,5]"],
    # both with ZeRO-1 (torch's ZeroRedundancyOptimizer over dp) and interleaving
    "dp2_pp2-interleaved-zero1": [
        "mesh=dp2_pp2",
        "zero=stage1",
        "schedule.pipeline=interleaved_1f1b",
        "schedule.virtual_stages=2",
        "schedule.stage_blocks=[2,1,1,2]",
        "schedule.replica_micro_batches=[2,6]",
        "model.n_layers=6",
    ],
    # FSDP2 (ZeRO-2) averages the replicas' gradients itself: the weighted losses make its mean the step's
    "dp2-3+5-zero2": ["mesh=dp2", "zero=stage2", "schedule.replica_micro_batches=[3,5]"],
    # validating every other step: uneven micro batches and stages, the next steps still the reference's
    "dp2_pp2-interleaved-2+6-validating": [
        "mesh=dp2_pp2",
        "schedule.pipeline=interleaved_1f1b",
        "schedule.stage_blocks=[2,1,1,2]",
        "schedule.replica_micro_batches=[2,6]",
        "model.n_layers=6",
        "train.eval_every=2",
    ],
    # a mixture of experts: each micro batch's balancing loss weighs as its LM loss; the routing figures add up
    "moe-dp2_pp2-3+5": ["mesh=dp2_pp2", "model=moe_tiny", "schedule.replica_micro_batches=[3,5]"],
}
MODEL_KEYS = ("model.", "model=", "train.", "data.")  # overrides the reference takes too


@functools.cache
def reference(steps: int, *model: str) -> list[dict]:  # model may set train.eval_every again: the later wins
    cfg, _ = typed("mesh=single", f"train.steps={steps}", "train.warmup_steps=2", f"train.eval_every={steps}", *model)
    return reference_run(cfg)


def assert_matches(got: list[dict], ref: list[dict]) -> None:
    assert_follows_curve(got, ref, RTOL, lr=True, extra=("val_loss", "moe_aux_loss"))


def expected_bounds(blocks: list[int]) -> list[int]:
    """The layer-list bounds of pieces of ``blocks`` blocks (the embedding with the first, norm and head the last)."""
    bounds = [0, 1 + blocks[0]]
    for b in blocks[1:]:
        bounds.append(bounds[-1] + b)
    return bounds[:-1] + [bounds[-1] + 2]


# slow tier (about 15 s each); kept in make test: dp2_pp2-3+1-3+5 alone (uneven stages and micro batches together, on
# two simulated groups); the resumes below are slow too
SLOW = (
    "pp2-3+1",
    "pp2-interleaved-3+1+1+1",
    "dp2-3+5",
    "dp2_pp2-interleaved-zero1",
    "dp2-3+5-zero2",
    "moe-dp2_pp2-3+5",
    "dp2_pp2-interleaved-2+6-validating",
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", with_slow(CASES, SLOW))
def test_uneven_layout_matches_single_process(case, tmp_path):
    overrides = CASES[case]
    proc = p3d_train(*COMMON, f"run.dir={tmp_path}", *overrides)
    assert proc.returncode == 0, output_tail(proc)
    model = tuple(o for o in overrides if o.startswith(MODEL_KEYS))
    assert_matches(read_metrics(tmp_path), reference(STEPS, *model))
    meta = checkpoint.verify(checkpoint.step_dir(tmp_path, STEPS))
    blocks = [o.split("=", 1)[1] for o in overrides if o.startswith("schedule.stage_blocks=")]
    if blocks:  # the run cut the layers (and its checkpoint) where stage_blocks says, not evenly
        assert meta["stage_bounds"] == expected_bounds([int(b) for b in blocks[0].strip("[]").split(",")])
    if "schedule.replica_micro_batches=[3,5]" in overrides:
        assert "3 + 5 micro batches of 2 x 64 per replica" in proc.stdout, output_tail(proc)


HETERO = (GROUPS, "mesh=dp2_pp2", "schedule.stage_blocks=[3,1]", "schedule.replica_micro_batches=[3,5]")
HOMOGENEOUS = ("cluster=local", "mesh=pp2")  # one node, an even split (the resume drops the uneven one)
# constant after the warmup: a segment's train.steps is moot
RESUME = ("train.warmup_steps=2", "train.decay=constant", "train.save_every=1")

CHAINS = {
    "hetero-to-homogeneous": ((HETERO, 5), (HOMOGENEOUS, 10)),
    "hetero-to-homogeneous-and-back": ((HETERO, 4), (HOMOGENEOUS, 7), (HETERO, 10)),
}


@pytest.mark.timeout(500)
@pytest.mark.parametrize("chain", with_slow(CHAINS, CHAINS))
def test_resume_between_heterogeneous_and_homogeneous_continues_the_curve(chain, tmp_path):
    """A run on two simulated groups with uneven stages and micro batches resumes on one node as pp2 with the even
    split (its checkpoint is cut by layer name), and back: the steps together follow the single-process curve."""
    for i, (layout, steps) in enumerate(CHAINS[chain]):
        resume = ("train.resume=auto",) if i else ()
        proc = p3d_train(f"run.dir={tmp_path}", f"train.steps={steps}", *RESUME, *resume, *layout, timeout=300)
        assert proc.returncode == 0, output_tail(proc)
        if i and layout == HOMOGENEOUS:  # the uneven split is the groups': gone with them
            assert "schedule.stage_blocks: [3, 1] -> []" in proc.stdout, output_tail(proc)
    steps = CHAINS[chain][-1][1]
    cfg, _ = typed("mesh=single", f"train.steps={steps}", "train.warmup_steps=2", "train.decay=constant")
    assert_matches(read_metrics(tmp_path), reference_run(cfg))
