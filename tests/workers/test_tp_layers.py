"""Every tensor-parallel component against its unsharded twin: outputs and gradients, tp = 2 and 4.

The unsharded twin is the same class built with tp = 1 (no group), whose weights are the master
tensors the sharded layers slice. Each rank checks its shard of every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.tp import SEED, TOL, column_shard, meshes, same_inputs


def _check_column(rank, world):
    from p3d.parallel.tp.layers import ColumnParallelLinear

    full_mesh, mesh = meshes(rank, world)
    sizes, keys = [16, 8, 8], ["q", "k", "v"]
    full = ColumnParallelLinear(12, sizes, full_mesh, keys, 0.1, SEED)
    shard = ColumnParallelLinear(12, sizes, mesh, keys, 0.1, SEED)
    torch.testing.assert_close(shard.weight, column_shard(full.weight.detach(), sizes, rank, world), **TOL)

    x_full = same_inputs(2, 5, 12).requires_grad_()
    x = x_full.detach().clone().requires_grad_()
    y_full, y = full(x_full), shard(x)
    torch.testing.assert_close(y, column_shard(y_full.detach(), sizes, rank, world, dim=-1), **TOL)
    g = same_inputs(2, 5, 32)
    (y_full * g).sum().backward()
    (y * column_shard(g, sizes, rank, world, dim=-1)).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad, **TOL)  # all-reduced by copy_to_tp
    torch.testing.assert_close(shard.weight.grad, column_shard(full.weight.grad, sizes, rank, world), **TOL)


def _check_row(rank, world):
    from p3d.parallel.tp.layers import RowParallelLinear

    full_mesh, mesh = meshes(rank, world)
    full = RowParallelLinear(16, 6, full_mesh, "wo", 0.1, SEED)
    shard = RowParallelLinear(16, 6, mesh, "wo", 0.1, SEED)
    torch.testing.assert_close(shard.weight, full.weight.detach().chunk(world, dim=1)[rank], **TOL)

    x_full = same_inputs(2, 5, 16).requires_grad_()
    x = x_full.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()  # input already split
    y_full, y = full(x_full), shard(x)
    torch.testing.assert_close(y, y_full, **TOL)
    g = same_inputs(2, 5, 6)
    (y_full * g).sum().backward()
    (y * g).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad.chunk(world, dim=-1)[rank], **TOL)
    torch.testing.assert_close(shard.weight.grad, full.weight.grad.chunk(world, dim=1)[rank], **TOL)


def _check_embedding(rank, world):
    from p3d.layout.geometry import padded_vocab
    from p3d.parallel.tp.layers import VocabParallelEmbedding

    full_mesh, mesh = meshes(rank, world)
    vocab = 37  # not a multiple of tp: exercises the padding rows
    full = VocabParallelEmbedding(vocab, vocab, 8, full_mesh, "embed", 0.1, SEED)
    shard = VocabParallelEmbedding(vocab, padded_vocab(vocab, world), 8, mesh, "embed", 0.1, SEED)
    padded_full = torch.nn.functional.pad(full.weight.detach(), (0, 0, 0, padded_vocab(vocab, world) - vocab))
    torch.testing.assert_close(shard.weight, padded_full.chunk(world)[rank], **TOL)

    ids = same_inputs(3, 7, high=vocab)
    y_full, y = full(ids), shard(ids)
    torch.testing.assert_close(y, y_full, **TOL)
    g = same_inputs(3, 7, 8)
    (y_full * g).sum().backward()
    (y * g).sum().backward()
    padded_grad = torch.nn.functional.pad(full.weight.grad, (0, 0, 0, padded_vocab(vocab, world) - vocab))
    torch.testing.assert_close(shard.weight.grad, padded_grad.chunk(world)[rank], **TOL)


def _check_cross_entropy(rank, world):
    from p3d.layout.geometry import padded_vocab
    from p3d.parallel.tp.cross_entropy import vocab_parallel_cross_entropy

    vocab = 37
    padded = padded_vocab(vocab, world)
    logits_full = same_inputs(3, 7, padded) * 3
    logits_full[..., vocab:] = 50.0  # padding columns hold garbage: they must not count
    target = same_inputs(3, 7, high=vocab)
    ref_logits = logits_full[..., :vocab].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction="none").view(3, 7)
    g = same_inputs(3, 7).abs()
    (ref * g).sum().backward()

    rows = padded // world
    local = logits_full.chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, dist.group.WORLD, rank * rows, vocab)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    (loss * g).sum().backward()
    expected_grad = torch.nn.functional.pad(ref_logits.grad, (0, padded - vocab)).chunk(world, dim=-1)[rank]
    torch.testing.assert_close(local.grad, expected_grad, **TOL)


def _check_block(rank, world):
    from p3d.config.schema import ModelConfig
    from p3d.model.llama import TransformerBlock

    full_mesh, mesh = meshes(rank, world)
    cfg = ModelConfig(hidden_size=32, n_heads=8, n_kv_heads=4, ffn_hidden_size=48, n_layers=2)
    full = TransformerBlock(cfg, full_mesh, 1, SEED)
    shard = TransformerBlock(cfg, mesh, 1, SEED)
    x_full = same_inputs(2, 9, 32).requires_grad_()
    x = x_full.detach().clone().requires_grad_()
    y_full, y = full(x_full), shard(x)
    torch.testing.assert_close(y, y_full, **TOL)
    g = same_inputs(2, 9, 32)
    (y_full * g).sum().backward()
    (y * g).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad, **TOL)
    hd = cfg.hidden_size // cfg.n_heads
    qkv = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
    full_params = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        fg = full_params[name].grad
        if name.endswith("wqkv.weight"):
            expected = column_shard(fg, qkv, rank, world)
        elif name.endswith("w_gate_up.weight"):
            expected = column_shard(fg, [cfg.ffn_hidden_size] * 2, rank, world)
        elif name.endswith(("wo.weight", "w_down.weight")):
            expected = fg.chunk(world, dim=1)[rank]
        else:  # RMSNorm weights: replicated, identical gradients on every rank
            expected = fg
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear_matches_unsharded(tp):
    run_distributed(_check_column, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear_matches_unsharded(tp):
    run_distributed(_check_row, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_matches_unsharded(tp):
    run_distributed(_check_embedding, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_unsharded(tp):
    run_distributed(_check_cross_entropy, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_block_matches_unsharded(tp):
    run_distributed(_check_block, tp)
