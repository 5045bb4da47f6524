"""What ``train.fp8`` changes in the planner's model of a step (docs/precision.md, docs/planner.md).

- GEMMs: a block's q|k|v, out-projection, gate|up and down (dense recipes), or the routed experts' grouped GEMMs
  (mxfp8), run at the device's float8 peak (``Device.float8_tflops``) with 1-byte operands; rowwise_with_gw_hp
  keeps the weight gradient's GEMM in bf16. A layer with a local dimension off 16 stays bf16, as p3d runs it.
- Casts: memory-bound passes, each reading its bf16 operand twice (the amax, then the cast) and writing 1 byte
  (5 bytes an element): the inputs of the four linears forward, their output gradients backward, and with the
  rowwise recipe both again for the weight gradient; the weights once a step per cast the recipe makes (fp32 read
  twice, 1 byte written: 9 bytes an element), spread over the step's micro batches.
- Traffic: tensorwise with sequence parallelism gathers the linears' inputs in float8, half the forward
  all-gathers' bytes; under ZeRO-2/3 it gathers the float8 layers' weights in float8, 1 byte an element.
"""

from __future__ import annotations

from p3d.config.schema import Config
from p3d.layout.float8_rules import FLOAT8_MULTIPLE, recipe
from p3d.layout.geometry import attention_params, mlp_params

# Gemm.fp8: 0 bf16; 1 forward and both backward GEMMs in float8; 2 the weight gradient's GEMM in bf16
BF16, FLOAT8, FLOAT8_WGRAD_HP = 0, 1, 2
CAST_BYTES = 5.0  # per element of an activation or gradient cast: bf16 read for the amax, read again, 1 byte written
WEIGHT_CAST_BYTES = 9.0  # per element of a weight cast: the fp32 master read twice, 1 byte written
# the published anchors the planner's float8 prediction is printed beside (docs/precision.md)
PUBLISHED = (
    "published (torchao, torchtitan): +25% Llama 3 8B on 8 H100 tensorwise, +10% rowwise; 1.34-1.51x on "
    "70B-405B, 128 H100 to 2K H200"
)


def dense_kind(cfg: Config) -> int:
    """The Gemm.fp8 of a block's dense linears under ``train.fp8``."""
    name = recipe(cfg)
    if name in ("none", "mxfp8"):
        return BF16
    return FLOAT8_WGRAD_HP if name == "rowwise_with_gw_hp" else FLOAT8


def experts_kind(cfg: Config) -> int:
    """The Gemm.fp8 of the routed experts' grouped GEMMs: MXFP8 under ``train.fp8=mxfp8``."""
    return FLOAT8 if recipe(cfg) == "mxfp8" else BF16


def fits(kind: int, *dims: float) -> int:
    """``kind`` where every local dimension is a multiple of 16 (else the layer stays bf16)."""
    return kind if all(float(d).is_integer() and int(d) % FLOAT8_MULTIPLE == 0 for d in dims) else BF16


def casts_per_pass(cfg: Config) -> tuple[int, int, int]:
    """(activation casts forward, gradient casts backward, weight casts a step) per linear: tensorwise 1, 1, 1
    (the weight-gradient GEMM reuses the forward's casts); rowwise 1, 3, 2 (x and dy again along the other axis);
    rowwise_with_gw_hp 1, 1, 2; none and mxfp8 0 (MXFP8's casts are inside its grouped GEMM)."""
    return {"tensorwise": (1, 1, 1), "rowwise": (1, 3, 2), "rowwise_with_gw_hp": (1, 1, 2)}.get(recipe(cfg), (0, 0, 0))


def gathered_in_float8(cfg: Config, tp: int, blocks: int, moe_blocks: int) -> int:
    """Parameters of a stage's ``blocks`` that ZeRO-2/3 all-gathers in float8 (tensorwise: the float8 layers'
    weights, p3d.parallel.zero.float8_gather): every block's attention matrices and each dense block's MLP."""
    if recipe(cfg) != "tensorwise" or cfg.zero.stage < 2:
        return 0
    m = cfg.model
    return blocks * attention_params(m, tp) + (blocks - moe_blocks) * mlp_params(m, 0, tp)  # layer 0: dense if any is


def sp_gathers_in_float8(cfg: Config) -> bool:
    """Tensorwise under sequence parallelism: the column-parallel layers' inputs all-gathered in float8."""
    return recipe(cfg) == "tensorwise" and bool(cfg.schedule.sequence_parallel)
