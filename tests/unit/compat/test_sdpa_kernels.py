"""The fused attention kernels p3d.compat.sdpa_kernels calls one block at a time: each touchpoint's schema, and what
p3d relies on from it.

On CPU the cpu flash kernel runs for real: its output and log-sum-exp against plain math, its backward given the
merge of two blocks' outputs against SDPA on the whole. The cuda kernels cannot run here: their schemas must still
take the arguments p3d passes, by position and name, and their "meta" implementations (what torch.compile traces
with) must accept p3d's calls, None for the undefined tensors included, and return the shapes p3d reads.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from p3d.compat import sdpa_kernels
from p3d.compat.sdpa_kernels import attention_backward, attention_forward

aten = torch.ops.aten

# the arguments p3d passes, in order: each op's schema must still start with them
SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu": ["query", "key", "value", "dropout_p", "is_causal"],
    "_scaled_dot_product_flash_attention_for_cpu_backward": [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal",
    ],
    "_scaled_dot_product_flash_attention": [
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask",
    ],
    "_scaled_dot_product_flash_attention_backward": [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset",
    ],
    "_scaled_dot_product_efficient_attention": [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
    ],
    "_scaled_dot_product_efficient_attention_backward": [
        "grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
        "dropout_p", "grad_input_mask", "is_causal",
    ],
}  # fmt: skip
# the outputs p3d unpacks: (count, the names of those it reads at their positions)
RETURNS = {
    "_scaled_dot_product_flash_attention_for_cpu": (2, {0: "output", 1: "logsumexp"}),
    "_scaled_dot_product_flash_attention": (9, {0: "output", 1: "logsumexp", 6: "rng_state", 7: "unused"}),
    "_scaled_dot_product_efficient_attention": (
        4,
        {0: "output", 1: "log_sumexp", 2: "philox_seed", 3: "philox_offset"},
    ),
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_each_kernel_takes_the_arguments_p3d_passes(name):
    schema = getattr(aten, name).default._schema
    args = [a.name for a in schema.arguments]
    assert args[: len(SCHEMAS[name])] == SCHEMAS[name], f"aten.{name}: {schema}"
    assert "scale" in [a.name for a in schema.arguments if a.kwarg_only], f"aten.{name}: no scale= keyword"
    if name in RETURNS:
        count, read = RETURNS[name]
        names = [r.name for r in schema.returns]
        assert len(names) == count and all(names[i] == n for i, n in read.items()), f"aten.{name}: {schema}"


def _math(q, k, v, causal, scale):
    """Plain attention in fp64: (out, lse)."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v.double(), lse


@pytest.mark.parametrize("causal,sq,sk", [(True, 24, 24), (False, 16, 40)])
def test_cpu_kernel_returns_the_output_and_the_natural_log_sum_exp(causal, sq, sk):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen) for n in (sq, sk, sk))
    scale = 1 / math.sqrt(8)
    block = attention_forward(q, k, v, causal, scale)
    want_out, want_lse = _math(q, k, v, causal, scale)
    assert block.out.shape == q.shape and block.lse.shape == q.shape[:3] and block.lse.dtype == torch.float32
    torch.testing.assert_close(block.out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block.lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    low = attention_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal, scale)
    assert low.out.dtype == torch.bfloat16 and low.lse.dtype == torch.float32  # bf16 kernel, fp32 log-sum-exp


def test_cpu_backward_of_merged_blocks_is_the_whole_attentions():
    """Queries 16..31 of a causal sequence over two blocks (keys 0..15 in full, 16..31 causal), merged by
    log-sum-exp; each block's backward given the merged out and lse: dq sums to SDPA's, dk and dv are its slices."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, up = (torch.randn(1, 2, 32, 8, generator=gen) for _ in range(4))
    scale = 1 / math.sqrt(8)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*ref, is_causal=True) * up).sum().backward()
    rows, prefix = slice(16, 32), slice(0, 16)
    full = attention_forward(q[:, :, rows], k[:, :, prefix], v[:, :, prefix], False, scale)
    diag = attention_forward(q[:, :, rows], k[:, :, rows], v[:, :, rows], True, scale)
    lse = torch.logaddexp(full.lse, diag.lse)
    out = (full.lse - lse).exp().unsqueeze(-1) * full.out + (diag.lse - lse).exp().unsqueeze(-1) * diag.out
    dq1, dk1, dv1 = attention_backward(up[:, :, rows], q[:, :, rows], k[:, :, prefix], v[:, :, prefix], out, lse,
                                       False, scale, full.rng)  # fmt: skip
    dq2, dk2, dv2 = attention_backward(up[:, :, rows], q[:, :, rows], k[:, :, rows], v[:, :, rows], out, lse,
                                       True, scale, diag.rng)  # fmt: skip
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dq1 + dq2, ref[0].grad[:, :, rows], **tol)
    torch.testing.assert_close(dk2, ref[1].grad[:, :, rows], **tol)
    torch.testing.assert_close(dv2, ref[2].grad[:, :, rows], **tol)
    # keys 0..15 also get the gradient of queries 0..15 (not in these blocks): dk1 is the rows' share only
    early = [t.clone().requires_grad_() for t in (q[:, :, prefix], k[:, :, prefix], v[:, :, prefix])]
    (F.scaled_dot_product_attention(*early, is_causal=True) * up[:, :, prefix]).sum().backward()
    torch.testing.assert_close(dk1 + early[1].grad, ref[1].grad[:, :, prefix], **tol)
    torch.testing.assert_close(dv1 + early[2].grad, ref[2].grad[:, :, prefix], **tol)


@pytest.mark.parametrize("kernel,dtype", [("flash", torch.bfloat16), ("efficient", torch.float32)])
@pytest.mark.parametrize("causal,sq,sk", [(True, 40, 40), (False, 40, 72)])
def test_cuda_kernels_accept_p3ds_calls_on_meta_tensors(kernel, dtype, causal, sq, sk):
    q = torch.empty(2, 4, sq, 64, device="meta", dtype=dtype)
    k = v = torch.empty(2, 4, sk, 64, device="meta", dtype=dtype)
    block = attention_forward(q, k, v, causal, 0.125, kernel=kernel)
    assert block.out.shape == q.shape and block.out.dtype == dtype
    assert block.lse.shape == (2, 4, sq) and block.lse.dtype == torch.float32  # efficient's padding cut off
    assert len(block.rng) == 2
    grads = attention_backward(block.out, q, k, v, block.out, block.lse, causal, 0.125, block.rng, kernel=kernel)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.dtype == dtype for g in grads)


def test_the_kernel_follows_device_dtype_and_head_dim():
    choose = sdpa_kernels.choose_kernel
    assert sdpa_kernels.kernel_for(torch.empty(1, 1, 4, 8)) == "cpu_flash"
    assert choose("cpu", torch.bfloat16, 8) == "cpu_flash"
    assert [choose("cuda", torch.bfloat16, d) for d in (64, 128, 256)] == ["flash"] * 3
    assert choose("cuda", torch.float16, 128) == "flash"
    assert choose("cuda", torch.float32, 128) == "efficient"  # FlashAttention-2 has no fp32
    assert choose("cuda", torch.bfloat16, 12) == "efficient"  # nor head dims off its multiple of 8
    assert choose("cuda", torch.bfloat16, 512) == "efficient"
    with pytest.raises(NotImplementedError, match="meta"):
        sdpa_kernels.kernel_for(torch.empty(1, 1, 4, 8, device="meta"))
