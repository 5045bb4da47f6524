"""Packing into windows, one global sample order, and this dp rank's micro batches.

Documents are tokenized, each followed by the end-of-document id, concatenated, and cut into
windows of seq_len + 1 tokens (inputs = window[:-1], labels = window[1:]); documents cross window
borders as in standard LM pre-training, and no token is dropped or repeated within an epoch.
Training windows pass a shuffle buffer seeded by (train.seed, epoch), then are numbered by a
global sample index: each step consumes the next B = global_batch_size samples, and dp rank d takes
the d-th contiguous slice of B / dp of them (with uneven micro batches per replica, its own count of micro batches
after the replicas before it: ``replica_rows``). So every TP and PP peer of a replica reads the same batch,
the samples of a step do not depend on the mesh, and the data position of a run is one number, the
samples consumed so far (a checkpoint's ``samples``): a resumed run starts at exactly that sample,
whatever batch size or mesh it resumes with.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

import numpy as np
import torch

from p3d.config.schema import DataSource
from p3d.data.corpus import DataStats, iter_texts
from p3d.data.order import replica_rows
from p3d.data.store import token_dtype
from p3d.data.tokenizer import load_tokenizer


def pack(token_docs: Iterable[list[int]], window: int, eos_id: int, dtype=np.int64) -> Iterator[np.ndarray]:
    """Windows (window,) of the documents' ids, each followed by ``eos_id``, as arrays of ``dtype``: the shuffle
    buffer holds ``data.shuffle_buffer`` of them, so a window is stored in the smallest dtype of the vocabulary
    (``store.token_dtype``), not as a Python list (8 bytes a token, 36 above id 256: 1,024 windows of 4,097 tokens
    were 34 MB a rank, whatever mesh.cp divides)."""
    buf: list[int] = []
    for ids in token_docs:
        buf.extend(ids)
        buf.append(eos_id)
        while len(buf) >= window:
            yield np.asarray(buf[:window], dtype=dtype)
            del buf[:window]


def shuffled(items: Iterable, buffer: int, rng: random.Random) -> Iterator:
    """A deterministic streaming shuffle: each item leaves a buffer of ``buffer`` items at random."""
    pool: list = []
    for item in items:
        if len(pool) < buffer:
            pool.append(item)
            continue
        j = rng.randrange(buffer)
        pool[j], item = item, pool[j]
        yield item
    rng.shuffle(pool)
    yield from pool


def sample_stream(
    data_cfg, seq_len: int, seed: int, split: str = "train", start: int = 0, stats: DataStats | None = None
) -> Iterator[torch.Tensor]:
    """Windows (seq_len + 1,) in global sample order from sample index ``start``, epoch after epoch."""
    tok = load_tokenizer(data_cfg.tokenizer)

    def epochs():
        epoch = 0
        while True:
            docs = (tok.encode(t) for t in iter_texts(data_cfg, split, stats))
            windows = pack(docs, seq_len + 1, tok.eos_id, token_dtype(tok.vocab_size))
            if split == "train" and data_cfg.shuffle_buffer > 0:
                windows = shuffled(windows, data_cfg.shuffle_buffer, random.Random(f"{seed}/{epoch}"))
            n = 0
            for w in windows:
                n += 1
                yield w
            if n == 0:
                raise ValueError(
                    f"the {split} split of the data ({data_cfg.source.value} {data_cfg.path or ''}) holds "
                    f"fewer than model.seq_len+1={seq_len + 1} tokens"
                )
            epoch += 1

    return (torch.from_numpy(w.astype(np.int64)) for w in islice(epochs(), start, None))


def global_batches(
    data_cfg,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    start_sample: int = 0,
    split: str = "train",
    stats: DataStats | None = None,
) -> Iterator[torch.Tensor]:
    """(B, seq_len + 1) per optimizer step from global sample index ``start_sample``: what the
    single-process reference trains on."""
    if data_cfg.source == DataSource.prepared:
        from p3d.data.prepared import prepared_global_batches

        yield from prepared_global_batches(data_cfg, seq_len, global_batch_size, seed, start_sample, split)
        return
    stream = sample_stream(data_cfg, seq_len, seed, split, start_sample, stats)
    while True:
        yield torch.stack(list(islice(stream, global_batch_size)))


def rank_slice(batch: torch.Tensor, micro_batch_size: int, dp: int, dp_rank: int, split: Sequence[int] | None = None):
    """(inputs, labels) micro batches of one global batch for dp rank ``dp_rank`` (``split``: see replica_rows)."""
    first, rows = replica_rows(batch.shape[0], micro_batch_size, dp, dp_rank, split)
    mine = batch[first : first + rows]
    for chunk in mine.split(micro_batch_size):
        yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def micro_batches(
    data_cfg,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp: int,
    dp_rank: int,
    seed: int,
    start_sample: int = 0,
    stats: DataStats | None = None,
    split: Sequence[int] | None = None,
):
    """(inputs, labels), each (micro_batch_size, seq_len): this replica's micro batches, step after step,
    from global sample index ``start_sample`` (the samples a resumed run has consumed). From a token store
    (``data=prepared``) only this replica's windows are read, found by arithmetic (p3d.data.prepared). ``split``:
    the micro batches of each replica where they differ (``replica_rows``)."""
    if data_cfg.source == DataSource.prepared:
        from p3d.data.prepared import prepared_micro_batches

        yield from prepared_micro_batches(
            data_cfg, seq_len, global_batch_size, micro_batch_size, dp, dp_rank, seed, start_sample, split
        )
        return
    for batch in global_batches(data_cfg, seq_len, global_batch_size, seed, start_sample, stats=stats):
        yield from rank_slice(batch, micro_batch_size, dp, dp_rank, split)


def validation_batches(data_cfg, seq_len: int, global_batch_size: int, n_batches: int) -> list[torch.Tensor]:
    """The first ``n_batches`` global batches of the held-out split: the same set at every evaluation."""
    return list(islice(global_batches(data_cfg, seq_len, global_batch_size, seed=0, split="val"), n_batches))
