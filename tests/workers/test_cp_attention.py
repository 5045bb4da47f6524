"""Context-parallel attention against unsharded attention: outputs and the gradients of q, k and v.

Every cp rank feeds ``context_parallel_attention`` its tokens (chunks r and 2 cp - 1 - r of the sequence) of
the same random q, k, v; the twin is torch's causal SDPA on the whole sequence (GQA: ``enable_gqa``). The output and
each input gradient of a rank must equal the twin's at that rank's tokens, for uneven head counts (3 query heads
over 1 kv head, 6 over 2, 4 over 4) and cp = 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.dist import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
LIMIT_S = 300


def _check(rank, world, heads, kv_heads, seq, variant):
    from p3d.parallel.context.attention import context_parallel_attention
    from p3d.parallel.context.chunks import take_local

    gen = torch.Generator().manual_seed(7)
    b, hd = 2, 8
    q = torch.randn(b, heads, seq, hd, generator=gen)
    k = torch.randn(b, kv_heads, seq, hd, generator=gen)
    v = torch.randn(b, kv_heads, seq, hd, generator=gen)
    upstream = torch.randn(b, heads, seq, hd, generator=gen)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=heads != kv_heads)
    (ref * upstream).sum().backward()

    def mine(t):
        return take_local(t, world, rank, dim=2)

    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, dist.group.WORLD, world, rank, variant)
    (out * mine(upstream)).sum().backward()
    torch.testing.assert_close(out, mine(ref.detach()), **TOL)
    for name, got, want in (("q", ql, qf), ("k", kl, kf), ("v", vl, vf)):
        torch.testing.assert_close(got.grad, mine(want.grad), **TOL, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.timeout(LIMIT_S)
@pytest.mark.parametrize(
    "world,heads,kv_heads,seq,variant",
    [
        (2, 3, 1, 16, "allgather"),
        pytest.param(2, 6, 2, 8, "allgather", marks=pytest.mark.slow),
        pytest.param(4, 4, 4, 16, "allgather", marks=pytest.mark.slow),
        (4, 6, 3, 24, "allgather"),
        pytest.param(2, 3, 1, 16, "ring", marks=pytest.mark.slow),
        pytest.param(2, 6, 2, 8, "ring", marks=pytest.mark.slow),
        pytest.param(4, 4, 4, 16, "ring", marks=pytest.mark.slow),
        (4, 6, 3, 24, "ring"),
    ],
    ids=[
        "cp2-gqa3",
        "cp2-gqa3x2",
        "cp4-mha",
        "cp4-gqa2",
        "ring-cp2-gqa3",
        "ring-cp2-gqa3x2",
        "ring-cp4-mha",
        "ring-cp4-gqa2",
    ],
)
def test_cp_attention_matches_unsharded(world, heads, kv_heads, seq, variant):
    run_distributed(_check, world, heads, kv_heads, seq, variant, timeout=LIMIT_S - 30)
