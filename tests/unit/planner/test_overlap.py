"""The overlap formulas behind plan.overlap_tp / overlap_dp / p2p_scatter (docs/planner.md, "Overlap"): their limits.

TP: each collective pipelined with its GEMM exposes what it outlasts, so free GEMMs expose every collective and
long ones none. DP: one layer chunk stays exposed (layers per virtual stage with a pipeline), whatever the compute.
Off (the defaults, what p3d runs), nothing changes.
"""

from __future__ import annotations

import pytest

from p3d.planner import evaluate
from p3d.planner.shapes import StageParams, layout_of, stage_params
from p3d.planner.step_time import StageTime, _per_block, block_work, dp_exposed, dp_seconds, fsdp_exposed, fsdp_seconds

H100 = ("cluster.device=h100_sxm", "cluster.launcher=slurm", "train.dtype=bf16", "model=llama3_8b")
TP8_SP = (*H100, "cluster.nodes=1", "mesh.tp=8", "mesh.pp=1", "mesh.dp=1", "schedule.sequence_parallel=true")


def tp_exposed(cfg, flops_s: float) -> tuple[float, float]:
    """(exposed, all) seconds of one block's TP collectives per micro batch at a GEMM rate of ``flops_s``."""
    k = block_work(cfg, layout_of(cfg))
    return _per_block(cfg, k, at_rate(flops_s), 1e12)["tp"], (3 if cfg.schedule.recompute.value == "full" else 2) * k.tp


def at_rate(flops_s: float):
    """A GEMM timer at one flat rate (the limits below do not depend on the GEMMs' shapes)."""
    return lambda g: g.flops / flops_s


def flops(k, name: str) -> float:
    return sum(g.flops for g in k.gemms[name])


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tp_overlap_exposes_every_collective_when_gemms_are_free_and_none_when_they_are_long(make_cfg, recompute):
    cfg = make_cfg(*TP8_SP, "plan.overlap_tp=true", f"schedule.recompute={recompute}")
    free, every = tp_exposed(cfg, 1e30)
    assert every > 0 and free == pytest.approx(every, rel=1e-12)
    assert tp_exposed(cfg, 1.0)[0] == 0.0


def test_tp_overlap_pairs_each_collective_with_its_own_gemm(make_cfg):
    """At a rate where only the smallest GEMM (llama3_8b: the out-projection, h q / t) is shorter than its
    collective, exactly that pair is exposed, in the forward and the backward: 2 (t_rs - t_proj)."""
    cfg = make_cfg(*TP8_SP, "plan.overlap_tp=true")
    k = block_work(cfg, layout_of(cfg))
    proj, others = flops(k, "proj"), min(flops(k, n) for n in ("qkv", "fc1", "fc2"))
    assert proj < others
    assert k.rs == pytest.approx(k.ag, rel=1e-12)
    flops_s = (proj + others) / 2 / k.rs  # proj shorter than t_rs, the rest longer
    assert _per_block(cfg, k, at_rate(flops_s), 1e12)["tp"] == pytest.approx(2 * (k.rs - proj / flops_s), rel=1e-9)


def test_tp_overlap_off_keeps_every_collective(make_cfg):
    cfg = make_cfg(*TP8_SP)
    assert tp_exposed(cfg, 1.0) == tp_exposed(cfg, 1e30)
    assert tp_exposed(cfg, 1.0)[0] == tp_exposed(cfg, 1.0)[1]


def stage_time(compute: float) -> StageTime:
    return StageTime(compute, 0.0, 0.0, 0.0, compute / 2, compute / 2)


@pytest.mark.parametrize(
    "mesh,chunks", [(("mesh.pp=1", "mesh.dp=8"), 32), (("mesh.pp=2", "mesh.dp=4", "schedule.virtual_stages=4"), 4)]
)
def test_dp_overlap_leaves_one_chunk_exposed(make_cfg, mesh, chunks):
    """Megatron's distributed optimizer: one chunk of layers exposed (pp = 1: a block of llama3_8b's 32; with a
    pipeline: the layers of a virtual stage), however long the compute; what outlasts one micro batch on top."""
    cfg = make_cfg(*H100, "cluster.nodes=1", "mesh.tp=1", *mesh, "plan.overlap_dp=true", "zero=stage1")
    layout = layout_of(cfg)
    st = StageParams(matrices=1000, vectors=10, blocks=32 // layout.pp)
    assert dp_exposed(cfg, layout, st, 1.0, stage_time(1e6)) == pytest.approx(1 / chunks)
    assert dp_exposed(cfg, layout, st, 1.0, stage_time(0.5)) == pytest.approx(0.5)  # 1 s over a 0.5 s window
    off = make_cfg(*H100, "cluster.nodes=1", "mesh.tp=1", *mesh, "zero=stage1", "plan.overlap_dp=false")
    assert dp_exposed(off, layout, st, 1.0, stage_time(1e6)) == 1.0


@pytest.mark.parametrize("zero", [0, 1])
def test_the_torch_executor_hides_all_but_its_last_bucket_behind_the_last_backward(make_cfg, zero):
    """plan.overlap_dp unset models p3d's executors. Its torch schedules (ZeRO 0/1): buckets of zero.bucket_mb fp32
    gradients issued in the last backward, so one bucket stays exposed, and what outlasts one micro batch's backward;
    DeepSpeed's 1F1B exposes it all."""
    mesh = ("mesh.pp=2", "mesh.dp=4", f"zero=stage{zero}", "zero.bucket_mb=1")
    cfg = make_cfg(*H100, "cluster.nodes=1", "mesh.tp=1", *mesh, "schedule.pipeline=interleaved_1f1b")
    layout = layout_of(cfg)
    st = StageParams(matrices=2**20, vectors=0, blocks=16)  # 4 MB of fp32 gradients: 4 buckets of 1 MB
    assert layout.torch_executor
    assert dp_exposed(cfg, layout, st, 1.0, stage_time(1e6)) == pytest.approx(1 / 4)
    assert dp_exposed(cfg, layout, st, 1.0, stage_time(1.0)) == pytest.approx(0.5)  # backward 0.5 s: 1 - 0.5
    deepspeed = make_cfg(*H100, "cluster.nodes=1", "mesh.tp=1", *mesh)
    assert not layout_of(deepspeed).torch_executor
    assert dp_exposed(deepspeed, layout_of(deepspeed), st, 1.0, stage_time(1e6)) == 1.0


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_overlap_exposes_each_pass_first_block_and_all_without_compute(make_cfg, stage):
    """ZeRO 2 / 3 with prefetching: behind long compute each pass that communicates exposes one block's traffic (ZeRO
    3: every micro batch's forward gathers, the first backward gathers and the last one reduces; ZeRO 2: the first
    forward gathers, the last backward reduces); without compute every byte is exposed (``dp_seconds``)."""
    cfg = make_cfg(
        *H100,
        "cluster.nodes=2",
        "mesh.tp=1",
        "mesh.pp=1",
        "mesh.dp=16",
        "plan.overlap_dp=true",
        f"zero=stage{stage}",
        "schedule.global_batch_size=64",
        "schedule.micro_batch_size=1",
    )
    layout = layout_of(cfg)
    (st,) = stage_params(cfg, layout)
    gather, reduce = fsdp_seconds(cfg, layout, st)
    m, blocks = layout.micro_batches, st.blocks
    assert m > 1 and blocks == 32
    passes = (m + 1) * gather + reduce if stage == 3 else gather + reduce
    assert dp_exposed(cfg, layout, st, 1.0, stage_time(1e6)) == pytest.approx(passes / blocks)
    assert dp_exposed(cfg, layout, st, 1.0, stage_time(0.0)) == pytest.approx(dp_seconds(cfg, layout, st))


def test_zero3_traffic_outlasting_a_blocks_compute_is_exposed_block_by_block(make_cfg):
    """A block's gather can hide only behind its neighbour's forward: at 1.5 x a block's forward, the excess is
    exposed in every block of the forward, though the step's compute outlasts the step's traffic (the whole-step
    overlap before issue 50 hid it all); the backward's gather and reduction fit behind its longer compute."""
    one = ("schedule.global_batch_size=8", "schedule.micro_batch_size=1")
    cfg = make_cfg(*H100, "cluster.nodes=1", "mesh.tp=1", "mesh.pp=1", "mesh.dp=8", "zero=stage3", *one)
    layout = layout_of(cfg)
    st = StageParams(matrices=1000, vectors=10, blocks=32)
    t = StageTime(3.2, 0.0, 0.0, 0.0, 2.4, 0.8)  # per block: 0.025 s forward, 0.075 s backward
    g, r = 0.0375 * 32, 0.01 * 32  # per block: 0.0375 s gather, 0.01 s reduce
    first = layout.micro_batches * (0.0375 + 31 * 0.0125)  # every forward: its first gather and the excess
    assert layout.micro_batches == 1
    assert fsdp_exposed(layout, st, (g, r), t) == pytest.approx(first + 0.0475)  # backward: gather + reduce hidden
    assert 2 * g + r < t.total  # the step's traffic is shorter than its compute


def test_p2p_scatter_sends_one_tp_share(make_cfg):
    """Megatron's (s/t, b, h) sends: with sequence parallelism a hop carries 1/t of the bytes, so the exposed
    pipeline traffic falls (blocking sends: plan.overlap_pp off)."""
    base = (*H100, "cluster.nodes=4", "mesh.tp=8", "mesh.pp=4", "mesh.dp=1", "schedule.sequence_parallel=true")
    full = evaluate(make_cfg(*base, "plan.overlap_pp=false"), check=False).breakdown["pp_comm"]
    scattered = evaluate(make_cfg(*base, "plan.overlap_pp=false", "plan.p2p_scatter=true"), check=False)
    assert 0 < scattered.breakdown["pp_comm"] < full / 4


@pytest.mark.parametrize(
    "overrides",
    [
        ("mesh=dp2",),  # DeepSpeed's 1F1B
        ("mesh=dp2", "mesh.cp=2"),
        ("model=moe_tiny", "mesh=dp2", "mesh.ep=2"),
        ("mesh=dp2_pp2", "schedule.pipeline=interleaved_1f1b"),
        ("mesh=dp2", "zero=stage2"),
        ("mesh=dp2", "schedule.replica_micro_batches=[3,5]"),  # uneven micro batches: torch's Schedule1F1B
    ],
    ids=["deepspeed", "cp2", "ep2", "interleaved", "zero2", "uneven"],
)
def test_the_dp_line_names_the_executor_the_launcher_runs(make_cfg, overrides):
    """Issue 64, item 14: p3d-plan's dp_comm line names the executor p3d-train would start, as the launcher decides
    it (``schedule_rules.runs_on_deepspeed``), and the planner's layout follows the same rule."""
    from p3d.layout.schedule_rules import runs_on_deepspeed
    from p3d.planner import predict

    cfg = make_cfg(*overrides)
    line = next(x for x in predict(cfg).render().splitlines() if x.strip().startswith("dp_comm"))
    deepspeed = runs_on_deepspeed(cfg)
    named = ("DeepSpeed's engine", "torch's executor")
    assert named[not deepspeed] in line and named[deepspeed] not in line, line
    assert layout_of(cfg).torch_executor is not deepspeed
