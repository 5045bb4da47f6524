"""torch's fused attention kernels called one block at a time, with their log-sum-exp: the private aten ops behind
``F.scaled_dot_product_attention``. Context parallelism (p3d.parallel.context) attends a rank's queries to blocks
of keys (its chunk's causal diagonal, the keys before it) and merges the blocks by their log-sum-exps; the public
SDPA returns no log-sum-exp, so each block calls the kernel SDPA itself would run, and its backward.

    attention_forward(q, k, v, causal, scale) -> Block(out, lse, rng)
        q (b, h, sq, d), k and v (b, h, sk, d) with as many heads as q (GQA is the caller's: p3d folds or expands);
        out (b, h, sq, d) in q's dtype, lse (b, h, sq) fp32: log sum_j exp(scale q.k_j) over the block's keys
        (natural log, the causal mask inside the block when ``causal``, which needs sq == sk)
    attention_backward(grad_out, q, k, v, out, lse, causal, scale, rng) -> (dq, dk, dv) in q's dtype

The backward may be given an ``out`` and ``lse`` that are not this block's but the merge of several blocks: the
kernels compute P = exp(scale q k^T - lse) and D = rowsum(grad_out * out) from them, which is then the merged
attention's P restricted to the block, and their dq, dk, dv are the block's share of the merged attention's
gradients (flash attention's backward, Dao et al. 2022; ring attention builds on the same identity).

The touchpoints (each checked by tests/unit/compat/test_sdpa_kernels.py):
- cpu: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fp32 and bf16; lse fp32);
- cuda, fp16/bf16 with d a multiple of 8 up to 256: ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2)
  and its ``_backward``, which takes the forward's rng_state and unused tensors (``rng``; dropout is 0, so they are
  read for nothing) and max_q, max_k;
- cuda otherwise (fp32): ``aten._scaled_dot_product_efficient_attention`` (memory-efficient, cutlass) and its
  ``_backward``, whose log-sum-exp is padded to a multiple of 32 queries (cut here, padded again for backward).
cuDNN's attention is not used: its log-sum-exp layout differs by version and flash covers bf16.

A value head narrower than the query and key heads (MLA: d_qk 192, d_v 128): torch 2.13's flash kernels, cpu's and
FlashAttention-2, take one head dim for q, k and v (sdp_utils ``check_head_dim_size_flash``: "Q/K/V should have the
same head size"), and SDPA falls back to the memory-efficient kernel on cuda and to the math kernel on cpu (its
(s, s) scores). The memory-efficient kernel takes v's own width (a multiple of 8 in bf16, 4 in fp32), and cuDNN's
(not chosen by default) 192 / 128 on sm90 from cuDNN 9.10 and on sm100 from 9.11. ``value_padding`` says how many
zero columns v gets to run on the flash kernels: its output's extra columns are zeros and cut off, the gradient of
the padded v is cut back, and the backward's rowsum(grad_out * out) is the same with zeros in both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

aten = torch.ops.aten

EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel's log-sum-exp is (b, h, ceil(sq / 32) * 32)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


class Block(NamedTuple):
    out: torch.Tensor  # (b, h, sq, d), q's dtype
    lse: torch.Tensor  # (b, h, sq), fp32
    rng: tuple  # what the kernel's backward takes back (cuda: its philox seed and offset tensors); cpu: ()


def kernel_for(q: torch.Tensor) -> str:
    """The kernel a block of ``q`` runs on: "cpu_flash", "flash" or "efficient" (``choose_kernel``)."""
    return choose_kernel(q.device.type, q.dtype, q.shape[-1])


def choose_kernel(device: str, dtype: torch.dtype, head_dim: int) -> str:
    """cpu: the cpu flash kernel; cuda: FlashAttention-2 where it runs (fp16/bf16, head dim a multiple of 8 up to
    256), else the memory-efficient kernel (fp32)."""
    if device == "cpu":
        return "cpu_flash"
    if device != "cuda":
        raise NotImplementedError(f"context-parallel attention on {device}: p3d calls the cpu and cuda kernels")
    flash = dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM
    return "flash" if flash else "efficient"


def value_padding(device: str, dtype: torch.dtype, qk_dim: int, v_dim: int) -> int:
    """Zero columns to add to v (b, h, s, d_v) for the kernel the block runs on (``choose_kernel``): d_qk - d_v where
    that kernel is a flash kernel (one head dim for q, k and v), 0 where it takes v's width (memory-efficient), and
    0 when v is not narrower or the device is neither cpu nor cuda (SDPA chooses there)."""
    if v_dim >= qk_dim or device not in ("cpu", "cuda"):
        return 0
    return qk_dim - v_dim if choose_kernel(device, dtype, qk_dim) in ("cpu_flash", "flash") else 0


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, kernel: str | None = None
) -> Block:
    """One block of attention with its log-sum-exp (module doc). ``kernel``: ``kernel_for(q)`` unless given (the
    tests run the cuda ops' meta implementations on "meta" tensors)."""
    kernel = kernel or kernel_for(q)
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return Block(out, lse, ())
    if kernel == "flash":
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return Block(out, lse, (seed, offset))
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return Block(out, lse[..., : q.shape[2]], (seed, offset))


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    rng: tuple,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the (possibly merged) ``out`` and ``lse`` (module doc)."""
    kernel = kernel or kernel_for(q)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    seed, offset = rng
    # the cuda kernels read grad_out, out (last dim contiguous) and lse (b, h, sq) contiguous
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.contiguous()
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
        )
    rows = -(-q.shape[2] // EFFICIENT_LSE_ROWS) * EFFICIENT_LSE_ROWS
    padded = F.pad(lse, (0, rows - q.shape[2]))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv
