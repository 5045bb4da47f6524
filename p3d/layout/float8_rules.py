"""The rules of ``train.fp8``, float8 matmuls through torchao (docs/precision.md).

Each raises :class:`P3DConfigError` with one line: field, value, fix. ``check_config`` runs ``check_float8``, so
p3d-train, the dry run and p3d-plan refuse alike, before any worker starts. The worker checks the GPU it got with the
same rule (``capability_refusal``), since a cluster's preset names the device the user meant, not the one present.
No torch here: the launcher finds torchao without importing it.
"""

from __future__ import annotations

import importlib.util

from p3d.config.devices import DEVICES
from p3d.config.errors import P3DConfigError
from p3d.config.schema import Config, DType

# the compute capability each recipe's kernels need: float8 tensor cores (Ada, Hopper), MX formats (Blackwell)
NEEDS = {"tensorwise": (8, 9), "rowwise": (8, 9), "rowwise_with_gw_hp": (8, 9), "mxfp8": (10, 0)}
# the smallest dimension multiple a float8 GEMM takes (torch._scaled_mm: 16-byte rows); smaller ones stay bf16
FLOAT8_MULTIPLE = 16
# MXFP8: one scale per 32 values along the reduction, and each expert's group of rows padded to a multiple of 32
MX_BLOCK = 32


def recipe(cfg: Config) -> str:
    """``train.fp8`` as its string: none, tensorwise, rowwise, rowwise_with_gw_hp or mxfp8."""
    return str(getattr(cfg.train.fp8, "value", cfg.train.fp8))


def capability_refusal(name: str, capability: tuple[int, int] | None, device: str) -> P3DConfigError | None:
    """Why recipe ``name`` cannot run on a GPU of ``capability`` (None: a CPU, which emulates float8), or None. The
    launcher asks it of the preset (``check_float8``), the worker of the GPU it got (p3d.parallel.tp.float8)."""
    need = NEEDS.get(name)
    if need is None or capability is None or tuple(capability) >= need:
        return None
    fixes = (
        ["train.fp8=none"] if tuple(capability) < NEEDS["tensorwise"] else ["train.fp8=tensorwise", "train.fp8=none"]
    )
    return P3DConfigError(
        f"train.fp8={name} needs a GPU of compute capability {need[0]}.{need[1]} or newer "
        f"({'B200' if name == 'mxfp8' else 'L40S, H100, H200, B200'}); {device} is {capability[0]}.{capability[1]}",
        fixes,
    )


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def check_float8(cfg: Config) -> None:
    name = recipe(cfg)
    if name == "none":
        return
    if cfg.train.dtype == DType.fp32:
        raise P3DConfigError(
            f"train.fp8={name} with train.dtype=fp32: the float8 matmuls run inside a bf16 run (their inputs and "
            "outputs bf16, the master weights fp32 as always)",
            ["train.dtype=bf16", "train.fp8=none"],
        )
    if not torchao_installed():
        raise P3DConfigError(
            f"train.fp8={name} needs torchao, which is not installed here (pip install 'p3d[fp8]')",
            ["train.fp8=none"],
        )
    device = str(getattr(cfg.cluster.device, "value", cfg.cluster.device))
    refusal = capability_refusal(name, DEVICES[device].capability, f"cluster.device={device}")
    if refusal is not None:
        raise refusal
    if name == "mxfp8":
        check_mxfp8(cfg)


def check_mxfp8(cfg: Config) -> None:
    """MXFP8 scales blocks of 32 values along each grouped GEMM's reduction: the hidden size and an expert's inner
    width per tp rank (p3d.parallel.experts.mxfp8)."""
    m, tp = cfg.model, cfg.mesh.tp
    if m.moe is None:
        raise P3DConfigError(
            f"train.fp8=mxfp8 computes the routed experts' grouped GEMMs in MXFP8; model={m.name} has no experts",
            ["train.fp8=tensorwise", "train.fp8=none"],
        )
    inner = m.moe.expert_ffn_size or m.ffn_hidden_size
    for field, value in (
        ("model.hidden_size", m.hidden_size),
        (f"model.moe.expert_ffn_size / mesh.tp={tp}", inner // tp),
    ):
        if value % MX_BLOCK:
            raise P3DConfigError(
                f"train.fp8=mxfp8 with {field} = {value}: MXFP8 scales blocks of {MX_BLOCK} values along each "
                f"grouped GEMM's reduction, so it must be a multiple of {MX_BLOCK}",
                ["train.fp8=none", *(f"mesh.tp={t}" for t in (2, 1) if t < tp)],
            )
