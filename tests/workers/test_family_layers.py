"""The families' attention pieces under tensor parallelism against the unsharded attention: head_dim apart from
hidden / heads, q|k|v biases split by heads, per-head q/k RMSNorm on the local heads (its weight's gradient summed
over tp), yarn's scaled tables; outputs and every gradient shard, tp = 2, with and without sequence parallelism."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tp import SEED, TOL, column_shard, meshes, same_inputs

S = 8


def _family_cfg():
    from p3d.config.options import RopeType
    from p3d.config.schema import ModelConfig, RopeScaling

    yarn = RopeScaling(rope_type=RopeType.yarn, factor=4.0, original_max_position_embeddings=4)
    return ModelConfig(
        hidden_size=24, n_heads=4, n_kv_heads=2, head_dim=10, qkv_bias=True, qk_norm=True, rope_scaling=yarn,
        n_layers=2, seq_len=S,
    )  # fmt: skip


def _seq_block(t, rank, world):
    return t.chunk(world, dim=1)[rank].detach().clone()


def _check_attention(rank, world, sequence_parallel):
    from p3d.model.attention import Attention

    cfg = _family_cfg()
    full_mesh, mesh = meshes(rank, world)
    full = Attention(cfg, full_mesh, "block1.attn", SEED)
    shard = Attention(cfg, mesh, "block1.attn", SEED, sequence_parallel=sequence_parallel)
    sizes = [4 * 10, 2 * 10, 2 * 10]  # q | k | v, 10 wide heads of a 24 hidden
    with torch.no_grad():  # biases and norm weights off their init (0, 1), so that a misplaced slice shows
        bias = same_inputs(sum(sizes)) * 0.5
        full.bqkv.bias.copy_(bias), shard.bqkv.bias.copy_(column_shard(bias, sizes, rank, world))
        for name in ("q_norm", "k_norm"):
            w = 1 + 0.3 * same_inputs(10) * (2 if name == "k_norm" else 1)
            getattr(full, name).weight.copy_(w), getattr(shard, name).weight.copy_(w)
    x_full = same_inputs(2, S, 24).requires_grad_()
    x = (_seq_block(x_full, rank, world) if sequence_parallel else x_full.detach().clone()).requires_grad_()
    y_full, y = full(x_full), shard(x)
    torch.testing.assert_close(y, _seq_block(y_full, rank, world) if sequence_parallel else y_full, **TOL)
    g = same_inputs(2, S, 24)
    (y_full * g).sum().backward()
    (y * (_seq_block(g, rank, world) if sequence_parallel else g)).sum().backward()
    want_x = _seq_block(x_full.grad, rank, world) if sequence_parallel else x_full.grad
    torch.testing.assert_close(x.grad, want_x, **TOL)
    full_params = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        fg = full_params[name].grad
        if name in ("wqkv.weight", "bqkv.bias"):
            expected = column_shard(fg, sizes, rank, world)
        elif name == "wo.weight":
            expected = fg.chunk(world, dim=1)[rank]
        else:  # q/k norms: replicated, each rank's heads' partial gradients summed over tp
            expected = fg
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{name}: {m}")  # noqa: B023
    assert {n for n, _ in shard.named_parameters()} == {*full_params} and len(full_params) == 5


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_attention_with_biases_qk_norms_and_yarn_matches_unsharded(sequence_parallel):
    run_distributed(_check_attention, 2, sequence_parallel)
