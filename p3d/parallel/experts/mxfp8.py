"""The routed experts' grouped GEMMs in MXFP8 (``train.fp8=mxfp8``; docs/precision.md).

MXFP8: e4m3 values with one e8m0 (power of 2) scale per 32 consecutive values along each GEMM's reduction, so a
block never spans two tp shards (the rule p3d.layout.float8_rules checks: the hidden size and an expert's inner
width per tp rank multiples of 32) and no amax crosses ranks. torchao's ``_to_mxfp8_then_scaled_grouped_mm``
(p3d.compat.torchao_internals) pads each expert's group of rows to a multiple of 32 inside, and quantises the
rows, the weights and the gradients itself: forward and both backward GEMMs in MXFP8. On CPU its EMULATED kernel
preference (dequantised bf16 GEMMs), on a GPU its sm100 kernels. The weights it is given are the step's bf16 copies
(``compute_weight``), cast once a step as in bf16.

A capacity (``model.moe.capacity_factor``) leaves dropped rows after the last group, which the op does not take:
those runs compute the experts in bf16 (``grouped_swiglu`` falls back), said in the docs.
"""

from __future__ import annotations

from functools import partial

import torch

from p3d.compat import torchao_internals as ao


def use_mxfp8(experts: torch.nn.Module, emulate: bool) -> None:
    """Make ``experts`` (a RoutedExperts) compute its grouped GEMMs in MXFP8."""
    experts.grouped_mm = partial(ao.mxfp8_grouped_mm, emulate=emulate)  # type: ignore[assignment]  # a function attribute
