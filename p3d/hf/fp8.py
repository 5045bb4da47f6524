"""Block-quantized FP8 checkpoints (DeepSeek-V3's published weights), dequantized at import.

The format (config.json ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}``): a quantized matrix ``<name>.weight`` (rows, cols) is stored as
float8_e4m3fn (safetensors dtype ``F8_E4M3``) beside ``<name>.weight_scale_inv`` (ceil(rows / 128),
ceil(cols / 128)) in fp32, one factor per 128 x 128 block (the last ones partial), and the weight is

    W[i, j] = float(W8[i, j]) x scale_inv[i // 128, j // 128]

(DeepSeek's ``weight_dequant``). The embedding, the norms, the routers and their correction biases, and the head stay
unquantized (bf16, fp32). The launcher accepts an F8_E4M3 tensor only with its scale of the right shape, counts the
scales among the tensors the import consumes, and refuses any other quantization (p3d.hf.check); each worker reads
its slice of the float8 rows or columns and of the scales that cover them, and dequantizes it to fp32 (``dequantize``).
p3d trains the dequantized weights; p3d-export writes them unquantized (fp32, or bf16 with ``dtype=bf16``): never
float8 blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from p3d.hf.names import HFImportError

if TYPE_CHECKING:
    import torch

FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE = "_scale_inv"  # <name>.weight -> <name>.weight_scale_inv
SCALE_DTYPES = ("F32", "BF16", "F16")


def block_size(hf: dict, where: str) -> tuple[int, int] | None:
    """(rows, cols) of a quantization block from config.json's ``quantization_config``, None without one; a
    quantization p3d cannot dequantize refused in one line."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    method, fmt, size = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3":
        raise HFImportError(
            f"model.init_from={where}: quantization_config quant_method={method}, fmt={fmt} is not supported (p3d "
            "dequantizes DeepSeek's block FP8: quant_method=fp8, fmt=e4m3, weight_block_size=[128, 128])"
        )
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        raise HFImportError(
            f"model.init_from={where}: quantization_config weight_block_size={size} is not a [rows, cols] block "
            "(p3d dequantizes per-block scales only: weight_block_size=[128, 128])"
        )
    return size[0], size[1]


def scale_shape(shape: list[int] | tuple[int, ...], block: tuple[int, int]) -> list[int]:
    """The scale_inv's shape of a (rows, cols) weight: one factor per block, the last ones partial."""
    return [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]


def check_quantized(name: str, shape: list[int], headers: dict[str, tuple[str, list[int]]], block, where) -> str:
    """The scale tensor's name of the F8_E4M3 tensor ``name``, once it is held with the block's shape; else a one-line
    refusal (no quantization_config, no scale, a scale of another shape or dtype)."""
    if block is None:
        raise HFImportError(
            f"model.init_from={where}: {name} is stored as {FP8_DTYPE} but config.json has no quantization_config: "
            "p3d cannot tell how to dequantize it"
        )
    scale = name + SCALE
    if len(shape) != 2:
        raise HFImportError(f"model.init_from={where}: {name} is stored as {FP8_DTYPE} but is not a matrix ({shape})")
    if scale not in headers:
        raise HFImportError(f"model.init_from={where}: {name} is stored as {FP8_DTYPE} without its {scale}")
    dtype, got = headers[scale]
    if got != scale_shape(shape, block) or dtype not in SCALE_DTYPES:
        raise HFImportError(
            f"model.init_from={where}: {scale} is {dtype} {got}; a {shape} weight in {list(block)} blocks needs "
            f"{scale_shape(shape, block)} (F32)"
        )
    return scale


def _covering(start: int, stop: int, block: int) -> tuple[int, int, int]:
    """(first block, last block + 1, offset of ``start`` in the first block) of the blocks that hold [start, stop)."""
    first = start // block
    return first, max(first + 1, -(-stop // block)), start - first * block


def dequantize(weight8: torch.Tensor, scale: Any, rows: tuple[int, int], cols: tuple[int, int], block) -> torch.Tensor:
    """fp32 of the float8 slice ``weight8`` (rows [r0, r1), cols [c0, c1) of the whole weight); ``scale``: the
    safetensors slice of the whole scale_inv (indexable), of which the blocks covering the slice are read."""
    (r0, r1), (c0, c1) = rows, cols
    first_r, end_r, off_r = _covering(r0, r1, block[0])
    first_c, end_c, off_c = _covering(c0, c1, block[1])
    s = scale[first_r:end_r, first_c:end_c].float()  # the blocks' factors
    s = s.repeat_interleave(block[0], dim=0)[off_r : off_r + (r1 - r0)]
    s = s.repeat_interleave(block[1], dim=1)[:, off_c : off_c + (c1 - c0)]
    return weight8.float() * s
