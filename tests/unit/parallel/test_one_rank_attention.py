"""One cp rank's attention in one process (p3d.parallel.context.attention.one_rank_attention): what every rank of
cp 2 and cp 4 computes from the whole sequence's keys and values, each rank's output in its local order and the
sum of their gradients, equals torch's SDPA on the whole sequence (fp32, 1e-5), with grouped-query heads. The
function the cp group's all-gather variant runs between its collectives, callable on one device without them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from p3d.parallel.context.attention import one_rank_attention
from p3d.parallel.context.chunks import take_local, to_global_order

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 3, 1), (4, 6, 2), (4, 4, 4)])
def test_every_ranks_attention_together_is_sdpa_on_the_whole_sequence(cp, heads, kv_heads):
    gen = torch.Generator().manual_seed(cp)
    s, hd = 16 * cp, 8
    q = torch.randn(2, heads, s, hd, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, s, hd, generator=gen, requires_grad=True) for _ in range(2))
    up = torch.randn(2, heads, s, hd, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    want = [t.detach() for t in (ref, *torch.autograd.grad(ref, (q, k, v), up))]

    outs, dqs, dk, dv = [], [], torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        q_r = take_local(q.detach(), cp, rank, dim=2).requires_grad_()
        k_all, v_all = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        out = one_rank_attention(q_r, k_all, v_all, cp, rank)
        out.backward(take_local(up, cp, rank, dim=2))
        outs.append(out.detach())
        dqs.append(q_r.grad)
        dk += k_all.grad
        dv += v_all.grad
    got = (to_global_order(outs, dim=2), to_global_order(dqs, dim=2), dk, dv)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _saved_and_peak(s: int, cp: int = 2) -> tuple[list[tuple[int, ...]], int]:
    """Rank 0 of cp at model=small's attention shape (12 query heads over 4 kv heads, head dim 64), fp32, s tokens:
    the shapes it saves for backward and its forward + backward peak of tensor memory (tests/helpers/memory.py)."""
    from tests.helpers.memory import peak_allocated

    gen = torch.Generator().manual_seed(s)
    q = torch.randn(1, 12, s // cp, 64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 4, s, 64, generator=gen, requires_grad=True) for _ in range(2))
    up = torch.randn(1, 12, s // cp, 64, generator=gen)
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = one_rank_attention(q, k, v, cp, 0)
        out.backward(up)

    return saved, peak_allocated(step)


def test_one_ranks_attention_saves_no_scores_and_its_peak_grows_linearly_in_s():
    """No (chunk x keys)-shaped tensor is kept for backward, its saved elements double from s = 1024 to 2048 and
    its forward + backward peak grows at most 2.2x (the plain-matmul attention before issue 52 built (b, nkv, g, c,
    s) fp32 scores: 3.7x)."""
    (saved1, peak1), (saved2, peak2) = _saved_and_peak(1024), _saved_and_peak(2048)
    c = 2048 // 2 // 2
    scores = [shape for shape in saved2 if sum(n >= c for n in shape) >= 2]
    assert not scores, f"saved for backward, (chunk x keys)-shaped: {scores}"
    elements = [sum(math.prod(shape) for shape in saved) for saved in (saved1, saved2)]
    assert elements[1] == 2 * elements[0], f"saved elements {elements} at s = 1024, 2048"
    assert peak2 <= 2.2 * peak1, f"forward + backward peak {peak1} bytes at s=1024, {peak2} at s=2048"
