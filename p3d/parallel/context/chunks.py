"""Which tokens of each sequence a cp rank holds, and cutting tensors to them.

A sequence of s tokens is cut into 2 cp chunks of c = s / (2 cp); cp rank r holds chunk r and chunk 2 cp - 1 - r,
in that order: its s / cp local tokens are [r c, (r + 1) c) then [(2 cp - 1 - r) c, (2 cp - r) c). Under a causal
mask a query attends to the keys before it, so an early chunk costs little and a late one much: pairing the
r-th from the head with the r-th from the tail gives every rank (r + 1) + (2 cp - r) = 2 cp + 1 chunk-pairs of
work (Megatron-Core's and torchtitan's load balancing). Everything per token (embedding, norms, MLP, loss) runs on
the local tokens; only attention looks across ranks, and RoPE rotates each token by its global position.
"""

from __future__ import annotations

import functools

import torch


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunks (of 2 cp) that ``cp_rank`` holds, head first."""
    return cp_rank, 2 * cp - 1 - cp_rank


@functools.lru_cache(maxsize=64)
def local_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """(s / cp,) int64: the global positions of this rank's tokens, in local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} not divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(cp, cp_rank)])


def take_local(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (the sequence along ``dim``): (b, s, ...) -> (b, s / cp, ...)."""
    if cp == 1:
        return x
    index = local_positions(x.shape[dim], cp, cp_rank).to(x.device)
    return x.index_select(dim, index).contiguous()


def to_global_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every cp rank's local tokens (``parts[r]``: rank r's, (.., s / cp, ..) along ``dim``) -> the sequence in
    global order, (.., s, ..)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        head, tail = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = head, tail
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]  # every slot is filled above


def chunk_holder(chunk: int, cp: int) -> tuple[int, int]:
    """(cp rank, half) holding global chunk ``chunk``: rank ``chunk`` as its head (half 0) for the first cp chunks,
    rank 2 cp - 1 - chunk as its tail (half 1) for the others."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)
