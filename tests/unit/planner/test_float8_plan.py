"""``train.fp8`` in the planner (p3d.planner.float8, docs/precision.md): float8 GEMMs at the device's float8 peak, the
casts' memory traffic, the halved SP all-gathers; p3d-plan's float8 speedup beside the published anchors, and an MFU
that names the peak it divides by."""

from __future__ import annotations

import dataclasses

import pytest

from p3d.planner import predict
from p3d.planner.float8 import PUBLISHED
from p3d.planner.shapes import layout_of
from p3d.planner.step_time import block_work

# the anchors (docs/precision.md): Llama 3 8B on 8 H100, Llama 3 70B on 128 H100, each in a layout p3d-plan fits
ANCHOR = ("cluster=h100_sxm", "mesh.pp=1", "mesh.dp=auto", "zero=stage3", "schedule.micro_batch_size=1")
ANCHOR += ("schedule.sequence_parallel=true",)
LLAMA3_8B = ("model=llama3_8b", "mesh.tp=2", *ANCHOR, "schedule.global_batch_size=8", "schedule.recompute=selective")
LLAMA3_70B = ("model=llama70b", "cluster.nodes=16", "mesh.tp=8", *ANCHOR, "schedule.global_batch_size=128")
LLAMA3_70B += ("schedule.recompute=full",)


@pytest.mark.parametrize("anchor", [LLAMA3_8B, LLAMA3_70B], ids=["llama3_8b-8xH100", "llama3_70b-128xH100"])
def test_p3d_plan_predicts_the_float8_speedup_beside_the_published_figures(make_cfg, anchor):
    report = predict(make_cfg(*anchor))  # a bf16 config on a float8 device: the figure comes with it
    assert report.fits and not [w for w in report.warnings if "refuse" in w], report.warnings
    assert report.float8_speedup is not None and 1.1 < report.float8_speedup < 1.8
    note = next(n for n in report.notes if n.startswith("float8: "))
    assert f"{report.float8_speedup:.2f}x" in note and PUBLISHED in note
    assert report.to_json()["float8_speedup"] == report.float8_speedup
    fp8 = predict(make_cfg(*anchor, "train.fp8=tensorwise"))
    assert fp8.float8_speedup == pytest.approx(report.float8_speedup, rel=1e-9)
    assert "MFU" in fp8.render() and "of the bf16 peak 989 TFLOP/s" in fp8.render()


def test_no_float8_figure_on_a_device_without_float8(make_cfg):
    report = predict(make_cfg("model=llama3_8b", "cluster=a100_80gb", "mesh.tp=1", "mesh.pp=1", "zero=stage3"))
    assert report.float8_speedup is None and not any(n.startswith("float8") for n in report.notes)


def test_recipes_order_as_their_gemms_and_casts_say(make_cfg):
    """rowwise_with_gw_hp keeps the weight gradient's GEMM in bf16: slower than tensorwise; rowwise casts x and dy
    once more each for the weight gradient: slower than tensorwise too."""
    speed = {r: predict(make_cfg(*LLAMA3_8B, f"train.fp8={r}")).float8_speedup for r in ("tensorwise", "rowwise")}
    speed["rowwise_with_gw_hp"] = predict(make_cfg(*LLAMA3_8B, "train.fp8=rowwise_with_gw_hp")).float8_speedup
    assert speed["tensorwise"] > speed["rowwise"] > 1.0
    assert speed["tensorwise"] > speed["rowwise_with_gw_hp"] > 1.0


def test_casts_cost_memory_traffic_and_tensorwise_sp_halves_the_forward_gathers(make_cfg):
    sp = ("model=llama3_8b", "cluster=h100_sxm", "mesh.tp=8", "mesh.pp=1", "schedule.sequence_parallel=true")
    bf16, tw, rw = (make_cfg(*sp, f"train.fp8={r}") for r in ("none", "tensorwise", "rowwise"))
    k_bf16, k_tw, k_rw = (block_work(c, layout_of(c)) for c in (bf16, tw, rw))
    assert k_bf16.cast_fwd == k_bf16.cast_bwd == 0.0 and k_bf16.tp_saved == 0.0
    assert k_tw.cast_fwd > 0 and k_tw.cast_bwd > 0 and k_tw.tp_saved == pytest.approx(k_tw.ag)
    assert k_rw.cast_bwd == pytest.approx(3 * k_tw.cast_bwd) and k_rw.tp_saved == 0.0  # rowwise gathers bf16
    assert all(g.fp8 for name in ("qkv", "proj", "fc1", "fc2") for g in k_tw.gemms[name])
    assert not any(g.fp8 for name in ("qkv", "proj", "fc1", "fc2") for g in k_bf16.gemms[name])


def test_mxfp8_runs_the_routed_experts_only(make_cfg):
    cfg = make_cfg("model=mixtral_8x7b", "cluster=b200", "train.fp8=mxfp8")
    k = block_work(cfg, dataclasses.replace(layout_of(cfg)), moe=True)
    router, experts = k.gemms["fc1"][0], k.gemms["fc1"][1]
    assert experts.fp8 and not router.fp8 and not k.gemms["qkv"][0].fp8


def test_zero3_gathers_the_float8_weights_in_one_byte(make_cfg):
    """Tensorwise under ZeRO-3: the blocks' linear weights gathered in float8 (1 byte each), the rest in bf16; the
    rowwise recipes gather bf16 and cast after."""
    from p3d.planner.step_time import fsdp_seconds

    zero3 = ("model=llama3_8b", "cluster=h100_sxm", "mesh.tp=1", "mesh.pp=1", "zero=stage3")
    stage = None
    gathers = {}
    for r in ("none", "tensorwise", "rowwise"):
        cfg = make_cfg(*zero3, f"train.fp8={r}")
        layout = layout_of(cfg)
        stage = stage or predict(cfg).stages[0].params
        gathers[r] = fsdp_seconds(cfg, layout, stage)[0]
    assert gathers["rowwise"] == gathers["none"]
    # llama3_8b: 6.98B of its 8.03B parameters are the blocks' matrices; the embedding and head stay bf16
    assert 0.5 < gathers["tensorwise"] / gathers["none"] < 0.6


def test_mesh_auto_searches_with_float8(make_cfg):
    """mesh=auto models every candidate in float8 (the torch executor, float8 GEMMs, casts): its best step is
    shorter than bf16's best."""
    auto = ("model=llama3_8b", "cluster=h100_sxm", "mesh=auto", "plan.top=1")
    best_bf16 = predict(make_cfg(*auto))
    best_fp8 = predict(make_cfg(*auto, "train.fp8=tensorwise"))
    assert best_fp8.layout.fp8 and best_fp8.layout.torch_executor and not best_bf16.layout.fp8
    assert best_fp8.step_time_s < best_bf16.step_time_s / 1.1
