"""Activation bytes under context parallelism: a cp2 rank keeps half of what one process keeps for the whole
sequence, in attention and in the whole block, and exactly the planner's ``block_bytes``.

Measured as in test_plan_sp_activations: every tensor autograd saves during the forward
(``torch.autograd.graph.saved_tensors_hooks``), once per storage, parameters excluded. A cp rank's input is its
s / cp tokens; its attention keeps its own q, k, v, output and log-sum-exp (the gathered keys and values are not
kept: they are gathered again in backward).
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.dist import run_distributed

CP = 2


def saved_bytes(module, x) -> int:
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    held: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            held.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    y.pow(2).sum().backward()  # the cp backward runs (its collectives pair up on both ranks)
    return sum(held.values())


def _measure(rank, world, cfg, planned):
    import torch
    import torch.distributed as dist

    from p3d.model.llama import TransformerBlock
    from p3d.parallel.mesh import Mesh

    m, b = cfg.model, cfg.schedule.micro_batch_size
    whole = Mesh(tp=1, pp=1, dp=1)
    split = Mesh(tp=1, pp=1, dp=1, cp=world, rank=rank, cp_group=dist.group.WORLD)
    figures = {}
    for name, mesh in (("cp1", whole), ("cp2", split)):
        block = TransformerBlock(m, mesh, 1, cfg.train.seed)
        tokens = m.seq_len // mesh.cp
        x = torch.randn(b, tokens, m.hidden_size, requires_grad=True)
        figures[name] = (saved_bytes(block.attn, x), saved_bytes(block, x))
    (attn1, block1), (attn2, block2) = figures["cp1"], figures["cp2"]
    assert attn2 * CP == attn1, f"attention: cp2 keeps {attn2} bytes, cp1 {attn1}"
    assert block2 * CP == block1, f"block: cp2 keeps {block2} bytes, cp1 {block1}"
    assert block2 == planned, f"block at cp2: measured {block2}, planned {planned}"


def test_cp2_keeps_half_the_activations_and_the_planned_bytes(make_cfg):
    from p3d.planner.memory import block_bytes
    from p3d.planner.shapes import Layout

    cfg = make_cfg("model=tiny", "mesh=single", f"mesh.cp={CP}", "schedule.micro_batch_size=2")
    planned = block_bytes(cfg, Layout(1, 1, 1, cfg.schedule.micro_batch_size, 1, cp=CP))
    run_distributed(_measure, CP, cfg, planned, timeout=600)


def _one_attention(cfg, rank, world, variant):
    """(saved shapes, forward + backward peak bytes) of the cp attention at ``cfg``'s shape on this rank."""
    import torch
    import torch.distributed as dist

    from p3d.parallel.context.attention import context_parallel_attention
    from tests.helpers.memory import peak_allocated

    m = cfg.model
    nh, nkv, hd, sl = m.n_heads, m.n_kv_heads, m.hidden_size // m.n_heads, m.seq_len // world
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, n, sl, hd, generator=gen, requires_grad=True) for n in (nh, nkv, nkv))
    grad = torch.randn(1, nh, sl, hd, generator=gen)
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = context_parallel_attention(q, k, v, dist.group.WORLD, world, rank, variant)
        out.backward(grad)

    return saved, peak_allocated(step)


def _attention_memory(rank, world, cfgs, variant):
    from p3d.planner.context import attention_core_bytes
    from p3d.planner.shapes import Layout

    figures = []
    for cfg in cfgs:
        saved, peak = _one_attention(cfg, rank, world, variant)
        c = cfg.model.seq_len // world // 2
        scores = [shape for shape in saved if sum(n >= c for n in shape) >= 2]
        assert not scores, f"saved for backward, (chunk x keys)-shaped: {scores}"
        planned = attention_core_bytes(cfg, Layout(1, 1, 1, 1, 1, cp=world))
        figures.append((cfg.model.seq_len, sum(math.prod(shape) for shape in saved), peak, planned))
    print(f"rank {rank} {variant}: (s, saved elements, peak bytes, planned bytes) {figures}")
    (s1, saved1, peak1, _), (s2, saved2, peak2, _) = figures  # the planned figures: printed, bench/cp.py attention
    assert s2 == 2 * s1 and saved2 == 2 * saved1, f"saved elements {saved1} at s={s1}, {saved2} at s={s2}"
    assert peak2 <= 2.2 * peak1, f"forward + backward peak {peak1} bytes at s={s1}, {peak2} at s={s2}"


@pytest.mark.slow  # the default tier runs one_rank_attention's in-process twin (tests/unit/parallel)
@pytest.mark.parametrize("variant", ["allgather", "ring"])
def test_cp_attention_memory_is_linear_in_s(make_cfg, variant):
    """The cp attention (cp 2, 12 query heads over 4 kv heads, head dim 64, fp32) keeps no chunk x keys score tensor
    for backward, its saved elements double with s, and its forward + backward peak of tensor memory
    (tests/helpers/memory.py: torch's allocations summed in order, a count, not a timing) grows at most 2.2x from
    s = 1024 to 2048. The planner's ``attention_core_bytes`` is printed beside it, not held to it here (all-gather:
    13 % and 16 % under the measured peak at these lengths; bench/cp.py attention). The plain-matmul attention it
    replaced built (b, nkv, g, c, s) fp32 scores in forward and backward (3.7x per doubling)."""
    base = ("model=small", "model.n_kv_heads=4", "mesh=single", f"mesh.cp={CP}", f"context.attention={variant}")
    cfgs = [make_cfg(*base, f"model.seq_len={s}") for s in (1024, 2048)]
    run_distributed(_attention_memory, CP, cfgs, variant, timeout=600)
