"""The rules of ``train.fp8`` (p3d.layout.float8_rules): each refuses before any worker starts, in one line with a
fix the same command accepts; the GPU rule is checked on capability values (the preset's, and those a worker would
read from its GPU), not by running anything on a GPU."""

from __future__ import annotations

import pytest

from p3d.layout.float8_rules import NEEDS, capability_refusal
from tests.helpers.runs import assert_fixes_accepted, assert_refused_in_one_line, typed

RULES = [
    (
        ("model=tiny", "mesh=single", "train.fp8=tensorwise", "train.dtype=fp32"),
        "train.fp8=tensorwise with train.dtype=fp32: the float8 matmuls run inside a bf16 run",
        "try train.dtype=bf16",
    ),
    (
        ("model=llama3_8b", "cluster=a100_80gb", "train.fp8=rowwise"),
        "train.fp8=rowwise needs a GPU of compute capability 8.9 or newer (L40S, H100, H200, B200); "
        "cluster.device=a100_80gb is 8.0",
        "try train.fp8=none",
    ),
    (
        ("model=mixtral_8x7b", "cluster=h100_sxm", "train.fp8=mxfp8"),
        "train.fp8=mxfp8 needs a GPU of compute capability 10.0 or newer (B200); cluster.device=h100_sxm is 9.0",
        "try train.fp8=tensorwise",
    ),
    (
        ("model=tiny", "mesh=single", "train.fp8=mxfp8"),
        "train.fp8=mxfp8 computes the routed experts' grouped GEMMs in MXFP8; model=tiny has no experts",
        "try train.fp8=tensorwise",
    ),
    (
        ("model=moe_tiny", "mesh=tp4", "train.fp8=mxfp8"),
        "train.fp8=mxfp8 with model.moe.expert_ffn_size / mesh.tp=4 = 16: MXFP8 scales blocks of 32 values",
        "try train.fp8=none",
    ),
]


@pytest.mark.parametrize("overrides,message,fix", RULES, ids=[r[1][:40] for r in RULES])
def test_each_float8_rule_names_field_value_and_fix(overrides, message, fix):
    assert_refused_in_one_line(overrides, message, fix)


@pytest.mark.parametrize("overrides", [r[0] for r in RULES], ids=[r[1][:40] for r in RULES])
def test_every_suggested_float8_fix_is_accepted_by_the_same_command(overrides):
    assert_fixes_accepted(overrides)


@pytest.mark.parametrize(
    "recipe,capability,refused",
    [
        ("tensorwise", (8, 0), True),  # A100
        ("tensorwise", (8, 6), True),  # A10, RTX 30xx
        ("tensorwise", (8, 9), False),  # L4, L40S, RTX 40xx
        ("rowwise", (9, 0), False),  # H100, H200
        ("mxfp8", (9, 0), True),
        ("mxfp8", (10, 0), False),  # B200
        ("mxfp8", (12, 0), False),
        ("tensorwise", None, False),  # a CPU: emulated
        ("none", (7, 0), False),
    ],
)
def test_the_gpu_rule_on_capability_values(recipe, capability, refused):
    refusal = capability_refusal(recipe, capability, "this GPU")
    assert (refusal is not None) == refused
    if refused:
        need = NEEDS[recipe]
        assert f"compute capability {need[0]}.{need[1]} or newer" in str(refusal) and "\n" not in str(refusal)


def test_float8_makes_dtype_auto_bf16_on_cpu_and_runs_on_the_torch_executor():
    from p3d.layout.schedule_rules import runs_on_deepspeed

    cfg, _ = typed("model=tiny", "mesh=dp2_pp2_tp2", "train.fp8=tensorwise")
    assert cfg.train.dtype.value == "bf16"
    assert not runs_on_deepspeed(cfg)
    plain, _ = typed("model=tiny", "mesh=dp2_pp2_tp2")
    assert plain.train.dtype.value == "fp32" and runs_on_deepspeed(plain)
