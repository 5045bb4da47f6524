"""The block attention under context parallelism (p3d.parallel.context.blocks), in one process: a query chunk over
its causal diagonal and the keys before it, each block one kernel call, with grouped-query heads (3 and 6 query
heads over 1 and 2 kv heads), equals torch's SDPA with ``enable_gqa`` on the whole sequence, in output and in the
gradients of q, k and v."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from p3d.parallel.context.blocks import KVBlock, attend, block_backward

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (6, 2), (4, 4)])
def test_a_chunk_over_its_blocks_matches_sdpa_with_gqa(heads, kv_heads):
    gen = torch.Generator().manual_seed(3)
    s, c, hd = 24, 8, 8  # the last chunk (rows 16..23): keys 0..15 in full, 16..23 causal
    q = torch.randn(2, heads, s, hd, generator=gen)
    k, v = (torch.randn(2, kv_heads, s, hd, generator=gen) for _ in range(2))
    up = torch.randn(2, heads, s, hd, generator=gen)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=heads != kv_heads) * up).sum().backward()
    # the rows of the last chunk get all their gradient from its queries: compare with SDPA over those rows only
    ref_out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    rows, prefix = slice(s - c, s), slice(0, s - c)
    blocks = [KVBlock(k[:, :, rows], v[:, :, rows], True), KVBlock(k[:, :, prefix], v[:, :, prefix], False)]
    scale = 1 / math.sqrt(hd)
    out, lse, rng = attend(q[:, :, rows], blocks, scale)
    torch.testing.assert_close(out, ref_out[:, :, rows], **TOL)
    grads = [block_backward(up[:, :, rows], q[:, :, rows], out, lse, b, scale, rng) for b in blocks]
    torch.testing.assert_close(grads[0][0] + grads[1][0], ref[0].grad[:, :, rows], **TOL)
    # the last chunk's keys are seen by its own queries only
    torch.testing.assert_close(grads[0][1], ref[1].grad[:, :, rows], **TOL)
    torch.testing.assert_close(grads[0][2], ref[2].grad[:, :, rows], **TOL)
    assert grads[1][1].shape == (2, kv_heads, s - c, hd)  # the prefix's share, per kv head
