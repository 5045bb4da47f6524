"""Training from token stores (``data=prepared``): sample i of the global order by arithmetic.

A store's training tokens are the stream streaming would pack, so window k is tokens
[k W, (k+1) W) with W = seq_len + 1 (the tail shorter than a window is dropped, as streaming drops it).
Sample i of the global order is window ``permute(i % n, epoch=i // n)`` (identity with
``data.shuffle_buffer=0``: the corpus order, exactly the streaming order without a shuffle buffer). A
mixture (``data.mix``) first asks :class:`p3d.data.order.Blend` which store sample i comes from and its
index in that store's own order; each store counts its own epochs. Nothing is scanned: a rank reads
the windows of its own micro batches through ``np.memmap``, whatever step it starts at.

Validation: the held-out documents of each store, windows in order (epochs repeat), blended like training:
val sample j comes from the store the training blend gives sample j (the val loss weighs the stores alike).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from p3d.data.order import Blend, replica_rows, window_of
from p3d.data.store import StoreError, TokenStore, store_paths, tokenizer_identity


@functools.cache
def blend_of(weights: tuple[float, ...]) -> Blend:
    """One blend table per set of weights and process (its period takes a fraction of a second to build)."""
    return Blend(list(weights))


@dataclass
class StoreSource:
    store: TokenStore
    windows: int  # whole windows of seq_len + 1 tokens in the split


def open_stores(data_cfg, seq_len: int, split: str = "train", check: bool = False) -> list[StoreSource]:
    """The stores of the data config, with their whole windows in ``split``; ``check``: every rule of
    the bad-input list, each one line (:class:`StoreError`)."""
    paths = store_paths(data_cfg)
    if check and data_cfg.mix:
        for i, (_, weight, _) in enumerate(paths):
            if not weight > 0:
                raise StoreError(f"data.mix[{i}].weight={weight} must be above 0; drop that store or give it a weight")
        if len(paths) < 2:
            raise StoreError(
                f"data.mix holds one store ({paths[0][0]}); a mixture needs two or more, or use data.path={paths[0][0]}"
            )
    out = []
    run_tok = tokenizer_identity(data_cfg.tokenizer) if check else {}
    for path, _, field in paths:
        store = TokenStore(path, field)
        if check:
            store.check_files()
            if store.tokenizer["sha256"] != run_tok["sha256"]:
                raise StoreError(
                    f"{field}={path} was tokenized with {store.tokenizer['spec']}, this run's data.tokenizer="
                    f"{data_cfg.tokenizer} is another tokenizer; set data.tokenizer={store.tokenizer['spec']} or "
                    "prepare the store with this one"
                )
        tokens = store.tokens(split)
        windows = tokens // (seq_len + 1)
        if check and windows == 0:
            what = (
                "holds no tokens (an empty store)"
                if store.tokens("train") == 0 and split == "train"
                else (f"holds {tokens} {split} tokens, fewer than one window of model.seq_len+1={seq_len + 1}")
            )
            fix = (
                "prepare it with a larger data.val_fraction or set train.eval_every=0"
                if split == "val"
                else "lower model.seq_len or prepare more text"
            )
            raise StoreError(f"{field}={path} {what}; {fix}")
        out.append(StoreSource(store, windows))
    return out


class PreparedSamples:
    """Windows (seq_len + 1,) of one split of the stores, by global sample index."""

    def __init__(self, data_cfg, seq_len: int, seed: int, split: str = "train"):
        self.sources = open_stores(data_cfg, seq_len, split)
        if any(s.windows == 0 for s in self.sources):
            raise StoreError(f"a store of this run holds fewer than model.seq_len+1={seq_len + 1} {split} tokens")
        self.width = seq_len + 1
        self.seed = seed
        self.shuffle = split == "train" and data_cfg.shuffle_buffer > 0
        self.split = split
        weights = [w for _, w, _ in store_paths(data_cfg)]
        self.blend = blend_of(tuple(weights)) if len(self.sources) > 1 else None
        names = [Path(s.store.path).name for s in self.sources]
        self.names = names if len(set(names)) == len(names) else [str(s.store.path) for s in self.sources]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(store, window index in that store) of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        if self.blend is None:
            store, own = np.zeros_like(samples), samples
        else:
            store, own = self.blend.locate(samples)
        window = np.empty_like(own)
        for s in np.unique(store):
            here = store == s
            # each store has its own seed stream, so two stores of one size do not share an order
            window[here] = window_of(own[here], self.sources[s].windows, self.seed + 7919 * int(s), self.shuffle)
        return store, window

    def read(self, samples) -> torch.Tensor:
        """(len(samples), seq_len + 1) int64."""
        return self.read_windows(*self.locate(np.asarray(samples, dtype=np.int64)))

    def read_windows(self, store: np.ndarray, window: np.ndarray) -> torch.Tensor:
        """(len(window), seq_len + 1) int64: window ``window[j]`` of store ``store[j]``."""
        out = np.empty((len(window), self.width), dtype=np.int64)
        for row, (s, w) in enumerate(zip(store.tolist(), window.tolist())):
            out[row] = self.sources[s].store.split(self.split).read(w * self.width, (w + 1) * self.width)
        return torch.from_numpy(out)

    def tokens_by_source(self, n: int) -> dict[str, int]:
        """Tokens each store gave to the first ``n`` samples (metrics.jsonl's ``tokens_by_source``), O(1)."""
        counts = self.blend.counts(n) if self.blend is not None else np.asarray([n])
        return {name: int(c) * self.width for name, c in zip(self.names, counts)}

    def epochs_by_source(self, n: int) -> dict[str, float]:
        """Epochs of its own windows each store gave to the first ``n`` samples (metrics.jsonl's
        ``epochs_by_source``; its integer part is the epoch that store is in), O(1)."""
        counts = self.blend.counts(n) if self.blend is not None else np.asarray([n])
        return {name: round(int(c) / s.windows, 6) for name, c, s in zip(self.names, counts, self.sources)}


def prepared_micro_batches(
    data_cfg, seq_len, global_batch_size, micro_batch_size, dp, dp_rank, seed, start_sample, split=None
):
    """This replica's micro batches from global sample ``start_sample``: only its own windows are read (``split``:
    the micro batches of each replica where they differ, p3d.data.order.replica_rows)."""
    samples = PreparedSamples(data_cfg, seq_len, seed)
    offset, per_rank = replica_rows(global_batch_size, micro_batch_size, dp, dp_rank, split)
    step = 0
    while True:
        first = start_sample + step * global_batch_size + offset
        store, window = samples.locate(np.arange(first, first + per_rank))  # this replica's share of the step
        for m in range(0, per_rank, micro_batch_size):
            chunk = samples.read_windows(store[m : m + micro_batch_size], window[m : m + micro_batch_size])
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        step += 1


def prepared_global_batches(data_cfg, seq_len, global_batch_size, seed, start_sample=0, split="train"):
    samples = PreparedSamples(data_cfg, seq_len, seed, split)
    step = 0
    while True:
        first = start_sample + step * global_batch_size
        yield samples.read(np.arange(first, first + global_batch_size))
        step += 1
