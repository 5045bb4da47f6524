"""What one MoE layer's forward and backward would cost a GPU, counted on CPU (tests/helpers/kernels.py): the
matmul kernels do not grow with the number of experts (grouped GEMM, not a loop over experts), and at ep = 1
nothing waits for the device (counts, offsets and permutation stay on it) and nothing is copied to the host. The
figures of the step reach the host once per step, outside the layer (p3d.parallel.experts.balance). The ep > 1 half
(one copy of the split sizes to the host per layer) is tests/workers/test_moe_layers.py's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.kernels import KernelCounter
from tests.helpers.runs import compose_config

LAYER = 1  # moe_tiny's first MoE block


def _count_layer(n_experts: int, top_k: int, *overrides: str) -> KernelCounter:
    from p3d.model.moe import MoEFeedForward
    from p3d.parallel.mesh import Mesh

    cfg = compose_config(
        "model=moe_tiny", f"model.moe.n_experts={n_experts}", f"model.moe.top_k={top_k}", *overrides
    ).model
    moe = MoEFeedForward(cfg, Mesh(tp=1, pp=1, dp=1), LAYER, seed=3).train()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, cfg.hidden_size, generator=gen).requires_grad_()
    dy = torch.randn(2, 32, cfg.hidden_size, generator=gen)
    with KernelCounter() as counter:
        (moe(x) * dy).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in moe.parameters())
    return counter


GROUPED = ("model.moe.score=sigmoid", "model.moe.n_groups=4", "model.moe.topk_groups=2")  # DeepSeek-V3's router


@pytest.mark.parametrize(
    "overrides",
    [(), ("model.moe.capacity_factor=1.0",), GROUPED],
    ids=["dropless", "capacity", "grouped-router"],
)
def test_matmuls_do_not_grow_from_8_to_64_experts_and_nothing_waits_at_ep1(overrides):
    few, many = _count_layer(8, 6, *overrides), _count_layer(64, 6, *overrides)
    assert many.matmuls == few.matmuls, (few.matmuls, many.matmuls)
    for counted in (few, many):
        assert counted.syncs == 0, counted.sync_ops
        assert counted.host_copies == 0
