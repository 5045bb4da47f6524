"""Packing into windows, one global sample order, and this dp rank's micro batches.

Documents are tokenized, each followed by the end-of-document id, concatenated, and cut into
windows of seq_len + 1 tokens (inputs = window[:-1], labels = window[1:]); documents cross window
borders as in standard LM pre-training, and no token is dropped or repeated within an epoch.
Windows are numbered by a global sample index. Step k consumes samples [k B, (k+1) B) with
B = global_batch_size; dp rank d takes the d-th contiguous slice of B / dp samples, cut into
micro batches. Every TP and PP peer of a replica therefore reads the same batch, and the samples
of a step do not depend on the mesh.
"""
from __future__ import annotations

from itertools import islice
from typing import Iterable, Iterator

import torch

from p3d.data.corpus import iter_texts
from p3d.data.tokenizer import load_tokenizer


def pack(token_docs: Iterable[list[int]], window: int, eos_id: int) -> Iterator[list[int]]:
    buf: list[int] = []
    for ids in token_docs:
        buf.extend(ids)
        buf.append(eos_id)
        while len(buf) >= window:
            yield buf[:window]
            del buf[:window]


def sample_stream(data_cfg, seq_len: int) -> Iterator[torch.Tensor]:
    """Windows (seq_len + 1,) in global sample order, epoch after epoch."""
    tok = load_tokenizer(data_cfg.tokenizer)
    epoch_samples = 0
    while True:
        n = 0
        for w in pack((tok.encode(t) for t in iter_texts(data_cfg)), seq_len + 1, tok.eos_id):
            n += 1
            yield torch.tensor(w, dtype=torch.long)
        if n == 0:
            raise ValueError(f"the data ({data_cfg.source.value} {data_cfg.path or ''}) holds fewer than "
                             f"model.seq_len+1={seq_len + 1} tokens")
        epoch_samples = n


def global_batches(data_cfg, seq_len: int, global_batch_size: int) -> Iterator[torch.Tensor]:
    """(B, seq_len + 1) per optimizer step: what the single-process reference trains on."""
    stream = sample_stream(data_cfg, seq_len)
    while True:
        yield torch.stack(list(islice(stream, global_batch_size)))


def micro_batches(data_cfg, seq_len: int, global_batch_size: int, micro_batch_size: int, dp: int,
                  dp_rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels), each (micro_batch_size, seq_len): this replica's micro batches, step after step."""
    per_rank = global_batch_size // dp
    for batch in global_batches(data_cfg, seq_len, global_batch_size):
        mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        for chunk in mine.split(micro_batch_size):
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
