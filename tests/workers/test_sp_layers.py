"""Sequence parallelism: every layer with ``sequence_parallel`` against its unsharded twin, tp = 2 and 4.

Outside the TP regions a rank holds its block of the sequence, (b, s/tp, h): rank r's block is
tokens [r s/tp, (r+1) s/tp). Each check feeds the sharded layer this rank's block (or, inside a TP
region, its slice of the features), the unsharded twin (tp = 1, the master weights) the whole
input, and compares outputs and every gradient with this rank's part of the twin's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.tp import SEED, TOL, column_shard, meshes, same_inputs

S = 8  # divisible by tp = 2 and 4
LIMIT_S = 300  # process start-up dominates; a loaded shared machine needs more than the default 120 s


def _seq_block(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.detach().chunk(world, dim=1)[rank].clone()


def _check_mappings(rank, world):
    from p3d.parallel.tp.mappings import gather_from_sp, reduce_scatter_to_sp, scatter_to_sp

    group = dist.group.WORLD
    full = same_inputs(2, S, 3)
    g = same_inputs(2, S, 3) * 2
    # scatter: forward keeps this rank's block, backward all-gathers the block gradients
    x = full.clone().requires_grad_()
    y = scatter_to_sp(x, group)
    torch.testing.assert_close(y, _seq_block(full, rank, world), **TOL)
    (y * _seq_block(g, rank, world)).sum().backward()
    torch.testing.assert_close(x.grad, g, **TOL)
    # gather: forward concatenates the blocks, backward reduce-scatters (sums each rank's gradient)
    x = _seq_block(full, rank, world).requires_grad_()
    y = gather_from_sp(x, group)
    torch.testing.assert_close(y, full, **TOL)
    (y * g * (rank + 1)).sum().backward()  # rank-dependent upstream gradient: the sum must be taken
    torch.testing.assert_close(x.grad, _seq_block(g, rank, world) * sum(range(1, world + 1)), **TOL)
    # reduce-scatter: forward sums partials and keeps this rank's block, backward all-gathers
    x = (full * (rank + 1)).requires_grad_()
    y = reduce_scatter_to_sp(x, group)
    torch.testing.assert_close(y, _seq_block(full, rank, world) * sum(range(1, world + 1)), **TOL)
    (y * _seq_block(g, rank, world)).sum().backward()
    torch.testing.assert_close(x.grad, g, **TOL)


@contextlib.contextmanager
def _forward_order():
    """The order of all-gathers issued, waited for, and matmuls run (aten's mm family) inside the block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    order: list[str] = []
    issue = dist.all_gather_into_tensor

    class Waited:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            order.append("gather waited")
            return self.work.wait(*args, **kwargs)

    def gather(*args, **kwargs):
        order.append("gather issued")
        work = issue(*args, **kwargs)
        return Waited(work) if work is not None else None

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "matmul"):
                order.append("matmul")
            return func(*args, **(kwargs or {}))

    dist.all_gather_into_tensor = gather
    try:
        with Matmuls():
            yield order
    finally:
        dist.all_gather_into_tensor = issue


def _check_column(rank, world):
    from p3d.parallel.tp.layers import ColumnParallelLinear

    full_mesh, mesh = meshes(rank, world)
    sizes, keys = [16, 8, 8], ["q", "k", "v"]
    full = ColumnParallelLinear(12, sizes, full_mesh, keys, 0.1, SEED)
    shard = ColumnParallelLinear(12, sizes, mesh, keys, 0.1, SEED, sequence_parallel=True)
    x_full = same_inputs(2, S, 12).requires_grad_()
    x = _seq_block(x_full, rank, world).requires_grad_()  # (b, s/tp, in)
    with _forward_order() as order:
        y = shard(x)
    # the other blocks' all-gather is issued, this rank's block multiplied while it travels, then waited for
    assert order[:3] == ["gather issued", "matmul", "gather waited"], order
    y_full = full(x_full)  # y: the whole sequence, this rank's columns
    torch.testing.assert_close(y, column_shard(y_full.detach(), sizes, rank, world, dim=-1), **TOL)
    g = same_inputs(2, S, 32)
    (y_full * g).sum().backward()
    (y * column_shard(g, sizes, rank, world, dim=-1)).sum().backward()
    torch.testing.assert_close(x.grad, _seq_block(x_full.grad, rank, world), **TOL)  # reduce-scattered
    torch.testing.assert_close(shard.weight.grad, column_shard(full.weight.grad, sizes, rank, world), **TOL)


def _check_row(rank, world):
    from p3d.parallel.tp.layers import RowParallelLinear

    full_mesh, mesh = meshes(rank, world)
    full = RowParallelLinear(16, 6, full_mesh, "wo", 0.1, SEED)
    shard = RowParallelLinear(16, 6, mesh, "wo", 0.1, SEED, sequence_parallel=True)
    x_full = same_inputs(2, S, 16).requires_grad_()
    x = x_full.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()  # whole sequence, feature slice
    y_full, y = full(x_full), shard(x)  # y: (b, s/tp, out), this rank's block of the sum
    torch.testing.assert_close(y, _seq_block(y_full, rank, world), **TOL)
    g = same_inputs(2, S, 6)
    (y_full * g).sum().backward()
    (y * _seq_block(g, rank, world)).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad.chunk(world, dim=-1)[rank], **TOL)  # all-gathered
    torch.testing.assert_close(shard.weight.grad, full.weight.grad.chunk(world, dim=1)[rank], **TOL)


def _embedding_pair(rank, world):
    from p3d.layout.geometry import padded_vocab
    from p3d.parallel.tp.layers import VocabParallelEmbedding

    full_mesh, mesh = meshes(rank, world)
    vocab = 37  # not a multiple of tp: padding rows
    full = VocabParallelEmbedding(vocab, vocab, 8, full_mesh, "embed", 0.1, SEED)
    shard = VocabParallelEmbedding(vocab, padded_vocab(vocab, world), 8, mesh, "embed", 0.1, SEED, True)
    return full, shard, vocab, padded_vocab(vocab, world)


def _check_embedding(rank, world):
    full, shard, vocab, padded = _embedding_pair(rank, world)
    ids = same_inputs(3, S, high=vocab)
    y_full, y = full(ids), shard(ids)  # y: (b, s/tp, h), reduce-scattered
    torch.testing.assert_close(y, _seq_block(y_full, rank, world), **TOL)
    g = same_inputs(3, S, 8)
    (y_full * g).sum().backward()
    (y * _seq_block(g, rank, world)).sum().backward()
    padded_grad = torch.nn.functional.pad(full.weight.grad, (0, 0, 0, padded - vocab))
    torch.testing.assert_close(shard.weight.grad, padded_grad.chunk(world)[rank], **TOL)


def _check_tied_head(rank, world):
    full, shard, vocab, padded = _embedding_pair(rank, world)
    x_full = same_inputs(3, S, 8).requires_grad_()
    x = _seq_block(x_full, rank, world).requires_grad_()
    y_full, y = full.as_head(x_full), shard.as_head(x)  # y: (b, s, V_pad/tp), the input all-gathered
    y_full_padded = torch.nn.functional.pad(y_full.detach(), (0, padded - vocab))
    torch.testing.assert_close(y, y_full_padded.chunk(world, dim=-1)[rank], **TOL)
    g = same_inputs(3, S, padded)
    g[..., vocab:] = 0.0  # the loss never sends gradient to vocab padding columns
    (y_full * g[..., :vocab]).sum().backward()
    (y * g.chunk(world, dim=-1)[rank]).sum().backward()
    torch.testing.assert_close(x.grad, _seq_block(x_full.grad, rank, world), **TOL)
    padded_grad = torch.nn.functional.pad(full.weight.grad, (0, 0, 0, padded - vocab))
    torch.testing.assert_close(shard.weight.grad, padded_grad.chunk(world)[rank], **TOL)


def _check_norm(rank, world):
    from p3d.model.norms import RMSNorm

    full, shard = RMSNorm(8, 1e-5), RMSNorm(8, 1e-5, sp_group=dist.group.WORLD)
    with torch.no_grad():
        w = same_inputs(8)
        full.weight.copy_(w), shard.weight.copy_(w)
    x_full = same_inputs(2, S, 8).requires_grad_()
    x = _seq_block(x_full, rank, world).requires_grad_()
    y_full, y = full(x_full), shard(x)
    torch.testing.assert_close(y, _seq_block(y_full, rank, world), **TOL)
    g = same_inputs(2, S, 8)
    (y_full * g).sum().backward()
    (y * _seq_block(g, rank, world)).sum().backward()
    torch.testing.assert_close(x.grad, _seq_block(x_full.grad, rank, world), **TOL)
    torch.testing.assert_close(shard.weight.grad, full.weight.grad, **TOL)  # all-reduced over tp


def _check_block(rank, world, recompute_attention):
    from p3d.config.schema import ModelConfig
    from p3d.model.llama import TransformerBlock

    full_mesh, mesh = meshes(rank, world)
    cfg = ModelConfig(hidden_size=32, n_heads=8, n_kv_heads=4, ffn_hidden_size=48, n_layers=2)
    full = TransformerBlock(cfg, full_mesh, 1, SEED)
    shard = TransformerBlock(cfg, mesh, 1, SEED, sequence_parallel=True, recompute_attention=recompute_attention)
    x_full = same_inputs(2, S, 32).requires_grad_()
    x = _seq_block(x_full, rank, world).requires_grad_()
    y_full, y = full(x_full), shard(x)
    torch.testing.assert_close(y, _seq_block(y_full, rank, world), **TOL)
    g = same_inputs(2, S, 32)
    (y_full * g).sum().backward()
    (y * _seq_block(g, rank, world)).sum().backward()
    torch.testing.assert_close(x.grad, _seq_block(x_full.grad, rank, world), **TOL)
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
        else:  # RMSNorm weights: replicated, gradients summed over the sequence blocks of every rank
            expected = fg
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_mappings_match_unsharded(tp):
    run_distributed(_check_mappings, tp, timeout=LIMIT_S)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_column_parallel_linear_matches_unsharded(tp):
    run_distributed(_check_column, tp, timeout=LIMIT_S)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_row_parallel_linear_matches_unsharded(tp):
    run_distributed(_check_row, tp, timeout=LIMIT_S)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_vocab_parallel_embedding_matches_unsharded(tp):
    run_distributed(_check_embedding, tp, timeout=LIMIT_S)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_tied_head_matches_unsharded(tp):
    run_distributed(_check_tied_head, tp, timeout=LIMIT_S)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_rms_norm_matches_unsharded(tp):
    run_distributed(_check_norm, tp, timeout=LIMIT_S)


@pytest.mark.parametrize("tp,selective", [(2, False), (4, False), (2, True)])
def test_sp_transformer_block_matches_unsharded(tp, selective):
    run_distributed(_check_block, tp, selective, timeout=LIMIT_S)
