"""``torch._grouped_mm``, a private op: the matmuls of many groups of rows, each by its own matrix, in one call.

The MoE experts' GEMMs (p3d.parallel.experts.grouped) call it as ``grouped_mm(rows, weights_t, ends)``: rows
(R, K) sorted by group, weights_t (G, K, N), ends (G,) int32 the cumulative row counts (group g owns rows
[ends[g-1], ends[g])) -> (R, N); rows from ends[-1] on belong to no group and are left unwritten (their gradient
too). Differentiable in rows and weights.

What torch 2.13 does with it (CPU: measured here; CUDA: read in aten/src/ATen/native/cuda/GroupedBlas.cpp and
GroupedMMUtils.h, not yet run on a GPU):
- CUDA, bf16 operands on compute capability 9.0 or 10.0 (H100, H200, B200): one CUTLASS kernel that reads the
  group ends on the device: no host sync, one launch whatever G is. This is the path MoE training takes.
- CUDA otherwise (fp32, fp16, or bf16 before sm90): ``_grouped_mm_fallback`` copies the group ends to the host
  (a device sync) and launches one mm per group: the loop this op exists to avoid. ``grouped_mm_without_sync``
  says no.
- CPU, bf16, fp16 and fp32 (forward and backward): the same fallback, one mm per group inside the op, exactly the
  matmuls a loop would run (bitwise in fp32); the ends are already host memory, so nothing waits.
- Every operand's strides must be multiples of 16 bytes (K, N and the row widths: multiples of 8 in bf16, 4 in
  fp32), else the op refuses (``strides should be multiple of 16 bytes``); ``grouped_mm_fits`` checks it first.
- Its meta function (torch.compile, fake tensors) accepts bf16 only.
The touchpoints are checked by tests/unit/compat/test_grouped_mm.py.
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 16  # every stride of every operand, including the output's rows and the gradients'


def grouped_mm(rows: torch.Tensor, weights_t: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(R, K) x (G, K, N) by groups of rows ending at ``ends`` (int32, on the rows' device) -> (R, N)."""
    return torch._grouped_mm(rows, weights_t, offs=ends)


def grouped_mm_fits(dtype: torch.dtype, *widths: int) -> bool:
    """Whether rows and weights of these inner widths (K and N of every product, forward and backward) meet the
    op's 16-byte stride rule in ``dtype``."""
    per = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    return all(w % per == 0 for w in widths)


def grouped_mm_without_sync(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs on ``device`` in ``dtype`` without waiting for the device (module doc): on CPU
    always (there is no device to wait for), on CUDA for bf16 on sm90 / sm100 only, where it is also one kernel;
    elsewhere it syncs and loops over the groups."""
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float16, torch.float32)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) in ((9, 0), (10, 0))
    return False
