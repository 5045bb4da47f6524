"""``train.fp8`` on the torch executor's chunks (docs/precision.md): which matmuls compute in float8, which stay bf16,
and the console line that says so.

The recipe's layers: every column- and row-parallel layer of the blocks (q|k|v, o, gate|up, down) whose local
dimensions are multiples of 16 (p3d.parallel.tp.float8). They stay bf16: the embedding (a lookup), the output head
(its logits feed the loss; torchao and torchtitan keep it high precision too), the routers (fp32 scores), the shared
experts, and any layer with a local dimension off 16. ``mxfp8``: the routed experts' grouped GEMMs in MXFP8
(p3d.parallel.experts.mxfp8), every dense layer bf16. Emulated on CPU; on a GPU the recipe's compute capability is
checked first, with the launcher's rule (p3d.layout.float8_rules).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from p3d.layout.float8_rules import capability_refusal


def apply_float8(chunks: Sequence[nn.Module], recipe: str, device: torch.device) -> str:
    """Give this rank's ``chunks`` their float8 matmuls for ``recipe``; returns the console line."""
    from p3d.model.experts import RoutedExperts, SwiGLUExpert
    from p3d.parallel.pipeline.specs import HeadPipe
    from p3d.parallel.tp.float8 import convert_to_float8

    if device.type == "cuda":
        refusal = capability_refusal(recipe, torch.cuda.get_device_capability(device), f"this GPU ({device})")
        if refusal is not None:
            raise RuntimeError(str(refusal))
    emulate = device.type != "cuda"
    how = f"train.fp8={recipe}" + (f" (emulated on {device.type})" if emulate else "")
    if recipe == "mxfp8":
        from p3d.parallel.experts.mxfp8 import use_mxfp8

        experts = [m for chunk in chunks for m in chunk.modules() if isinstance(m, RoutedExperts)]
        for m in experts:
            use_mxfp8(m, emulate)
        return f"{how}: the routed experts of {len(experts)} MoE blocks in MXFP8; every other matmul bf16"
    kept: list[str] = []
    for chunk in chunks:
        kept += convert_to_float8(chunk, recipe, emulate, skip=(HeadPipe, SwiGLUExpert))
    from p3d.parallel.tp.float8 import float8_linears

    n = sum(len(float8_linears(chunk)) for chunk in chunks)
    moe = any(isinstance(m, RoutedExperts) for chunk in chunks for m in chunk.modules())
    bf16 = "the embedding, the head" + (", the routers, the shared and routed experts" if moe else "")
    odd = f", and for a dimension off 16 {', '.join(kept)}" if kept else ""
    return f"{how}: {n} linears of this stage's blocks in float8; bf16: {bf16}{odd}"
