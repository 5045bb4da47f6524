"""Activation bytes under context parallelism: a cp2 rank keeps half of what one process keeps for the whole
sequence, in attention and in the whole block, and exactly the planner's ``block_bytes``.

Measured as in test_plan_sp_activations: every tensor autograd saves during the forward
(``torch.autograd.graph.saved_tensors_hooks``), once per storage, parameters excluded. A cp rank's input is its
s / cp tokens; its attention keeps its own q, k, v, output and log-sum-exp (the gathered keys and values are not
kept: they are gathered again in backward).
"""

from __future__ import annotations

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
