"""Every touchpoint of torchao's float8 training internals that p3d uses (torchao 0.18.0, pinned in
requirements-cpu.txt; the ``fp8`` extra in pyproject.toml). tests/unit/compat/test_torchao_internals.py checks each.

torchao's float8 training is a module swap (``nn.Linear`` -> ``Float8Linear``) that p3d's own TP layers do not fit, so
p3d calls the pieces ``Float8Linear`` is made of (torchao/float8/float8_linear.py, ``matmul_with_hp_or_float8_args``):

- the recipe's six casts (``Float8LinearConfig``: public): input, weight and grad_output for the forward and the
  input gradient, and the input and grad_output again for the weight gradient, each with a granularity (tensorwise,
  or axiswise along a dim of the 2-D operand), a float8 dtype, or DISABLED (the operand stays high precision);
- ``tensor_to_amax`` and ``amax_to_scale`` (float8_utils, private): an amax, then its scale; p3d max-reduces the
  amax over tp between the two, which torchao's own TP path does through DTensor;
- ``hp_tensor_and_scale_to_float8`` (float8_training_tensor, private): the cast, a ``Float8TrainingTensor`` whose
  ``torch.mm`` is the scaled GEMM (emulated: dequantised fp32 mm, the result in the first operand's original dtype);
  ``_data`` its float8 payload and ``_scale`` its scale (SP's float8 all-gather rebuilds one from a gathered payload);
- ``LinearMMConfig`` / ``ScaledMMConfig``: the three GEMMs' settings, as ``Float8Linear.__init__`` builds them;
- ``_to_mxfp8_then_scaled_grouped_mm`` (prototype/moe_training, private): the MXFP8 grouped GEMM of the routed
  experts, ``KernelPreference.EMULATED`` on CPU (real kernels need sm100), each group padded to 32 rows inside.

Importing torchao logs a warning for each CUDA extension it cannot load on a CPU machine: silenced here.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import torch

PINNED = "0.18.0"  # the version these touchpoints were read in and are tested on


# "Failed to load ..._C_mxfp8...so" on every machine without torchao's CUDA build; torch's pytree on torchao's
# KernelPreference enum ("register_constant() on Enum subclasses is deprecated")
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _import(name: str):
    logs = [logging.getLogger(n) for n in QUIET_LOGGERS]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def torchao_version() -> str:
    return str(_import("torchao").__version__)


def float8_config(recipe: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` of ``recipe`` (tensorwise, rowwise, rowwise_with_gw_hp); ``emulate``: the
    scaled GEMMs as dequantised fp32 matmuls (CPU). The configs are frozen dataclasses: replaced, not set."""
    config = _import("torchao.float8").Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate)


def linear_mm_config(config):
    """The three GEMMs' settings of a linear (output, grad_input, grad_weight), as ``Float8Linear`` makes them."""
    t = _import("torchao.float8.float8_training_tensor")
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    return t.LinearMMConfig(
        *(t.ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
    )


@dataclasses.dataclass(frozen=True)
class Cast:
    """One of a recipe's casts of a 2-D operand: ``dtype`` None for DISABLED (kept high precision); ``axis`` None for
    one scale per tensor, else the dim each scale is taken along (0: one per column, -1: one per row); ``role`` the
    operand's GemmInputRole."""

    dtype: torch.dtype | None
    axis: int | None
    role: Any
    power_of_2: bool


def recipe_casts(config) -> dict[str, Cast]:
    """The recipe's six casts by name, with the axes ``matmul_with_hp_or_float8_args`` gives them (x: (M, K), w_t:
    (K, N), dy: (M, N)): ``input`` (-1), ``weight`` (0), ``grad_output`` (-1), ``weight_for_grad_input`` (-1),
    ``grad_output_for_grad_weight`` (0), ``input_for_grad_weight`` (0)."""
    cfg = _import("torchao.float8.config")
    role = _import("torchao.float8.float8_training_tensor").GemmInputRole
    spec = {
        "input": (config.cast_config_input, -1, role.INPUT),
        "weight": (config.cast_config_weight, 0, role.WEIGHT),
        "grad_output": (config.cast_config_grad_output, -1, role.GRAD_OUTPUT),
        "weight_for_grad_input": (config.cast_config_weight_for_grad_input, -1, role.WEIGHT),
        "grad_output_for_grad_weight": (config.cast_config_grad_output_for_grad_weight, 0, role.GRAD_OUTPUT),
        "input_for_grad_weight": (config.cast_config_input_for_grad_weight, 0, role.INPUT),
    }
    out = {}
    for name, (cc, axis, r) in spec.items():
        disabled = cc.scaling_type is cfg.ScalingType.DISABLED
        axiswise = cc.scaling_granularity is cfg.ScalingGranularity.AXISWISE
        out[name] = Cast(
            None if disabled else cc.target_dtype, axis if axiswise else None, r, config.round_scales_to_power_of_2
        )
    return out


def amax(x: torch.Tensor, cast: Cast) -> torch.Tensor:
    """max |x| (a 0-d tensor), or along ``cast.axis`` with the dim kept: torchao's ``tensor_to_amax``."""
    cfg = _import("torchao.float8.config")
    utils = _import("torchao.float8.float8_utils")
    granularity = cfg.ScalingGranularity.TENSORWISE if cast.axis is None else cfg.ScalingGranularity.AXISWISE
    return utils.tensor_to_amax(x, False, None, granularity, cast.axis)


def amax_to_scale(x_amax: torch.Tensor, cast: Cast) -> torch.Tensor:
    """The scale(s) of ``x_amax``, elementwise: float8's largest value over the amax (``amax_to_scale``)."""
    utils = _import("torchao.float8.float8_utils")
    return utils.amax_to_scale(x_amax, cast.dtype, round_scales_to_power_of_2=cast.power_of_2)


def to_float8(x: torch.Tensor, x_amax: torch.Tensor, cast: Cast, mm_config, scale_given: bool = False):
    """``x`` cast to float8 with the scale of ``x_amax`` (or, ``scale_given``, that scale itself): a
    ``Float8TrainingTensor`` (``hp_tensor_and_scale_to_float8``)."""
    t = _import("torchao.float8.float8_training_tensor")
    scale = x_amax if scale_given else amax_to_scale(x_amax, cast)
    return t.hp_tensor_and_scale_to_float8(x, scale, cast.dtype, mm_config, cast.role, cast.axis)


def is_float8(x: torch.Tensor) -> bool:
    return isinstance(x, _import("torchao.float8.float8_training_tensor").Float8TrainingTensor)


def payload(x) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, scale) of a tensorwise ``Float8TrainingTensor``."""
    return x._data, x._scale


def set_payload_scale(x, scale: torch.Tensor) -> None:
    """Give the ``Float8TrainingTensor`` ``x`` (or the one inside a DTensor) a new scale, its data kept."""
    inner = getattr(x, "_local_tensor", x)
    inner._scale = scale


def from_payload(data: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype, mm_config, role):
    """A ``Float8TrainingTensor`` of float8 ``data`` and its tensorwise ``scale`` (a gathered payload)."""
    t = _import("torchao.float8.float8_training_tensor")
    return t.Float8TrainingTensor(data, scale, orig_dtype, mm_config, role)


def mxfp8_grouped_mm(rows: torch.Tensor, weights_t: torch.Tensor, ends: torch.Tensor, emulate: bool) -> torch.Tensor:
    """(R, K) x (G, K, N) by groups of rows ending at ``ends`` (int32) in MXFP8 (one e8m0 scale per 32 values along
    K), each group padded to a multiple of 32 rows inside; out bf16 (R, N). ``emulate``: torchao's EMULATED kernel
    preference (CPU), else its sm100 kernels."""
    mx = _import("torchao.prototype.moe_training.mxfp8_grouped_mm")
    common = _import("torchao.quantization.quantize_.common")
    kernel = common.KernelPreference.EMULATED if emulate else common.KernelPreference.AUTO
    return mx._to_mxfp8_then_scaled_grouped_mm(
        rows, weights_t, ends, out_dtype=torch.bfloat16, kernel_preference=kernel, pad_token_groups_for_grouped_mm=True
    )
