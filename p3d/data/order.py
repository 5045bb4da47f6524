"""Sample orders computed by arithmetic, so that sample i of any epoch, or of a blend, costs O(1).

:func:`permute`: a seeded pseudo-random permutation of ``range(n)`` evaluated at any positions, a
Feistel network over the smallest even power of two >= n, walked until it lands inside ``range(n)``
(cycle walking: a permutation of the larger domain restricted to ``range(n)`` stays a permutation;
the domain is under 4 n, so a position takes under 4 walks on average). No table of n entries is
ever built, so resuming at step 100,000 costs what step 1 does.

:class:`Blend`: which source each sample of a mixture comes from. Over one period of P samples each
source s gets ``quota_s`` (its weight x P, rounded by largest remainder), given out greedily: sample i
goes to the source furthest behind its share (weight x (i + 1) - taken so far; ties to the lower
index), so every prefix of the order stays within one sample of the weights. The period repeats, so
sample i's source and its index within that source are found from i // P and a table of P entries.

:func:`replica_rows`: which rows of a step's global batch a dp replica reads.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=64)
def _keys(seed: int, epoch: int) -> list[np.uint64]:
    return [
        np.uint64(int.from_bytes(hashlib.blake2b(f"{seed}/{epoch}/{r}".encode(), digest_size=8).digest(), "little"))
        for r in range(_ROUNDS)
    ]


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << np.uint64(half)) | right


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(n)`` for (seed, epoch), at ``positions`` (each in range(n))."""
    if n <= 1:
        return np.asarray(positions, dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _keys(seed, epoch)
    with np.errstate(over="ignore"):
        y = _feistel(np.asarray(positions, dtype=np.uint64), half, keys)
        outside = y >= np.uint64(n)
        while outside.any():
            y[outside] = _feistel(y[outside], half, keys)
            outside = y >= np.uint64(n)
    return y.astype(np.int64)


def window_of(samples: np.ndarray, n: int, seed: int, shuffle: bool) -> np.ndarray:
    """Window index of each global sample index: epoch = i // n, then the epoch's permutation (or none)."""
    samples = np.asarray(samples, dtype=np.int64)
    epoch, pos = samples // n, samples % n
    if not shuffle:
        return pos
    out = np.empty_like(pos)
    for e in np.unique(epoch):
        here = epoch == e
        out[here] = permute(pos[here], n, seed, int(e))
    return out


class Blend:
    """Source and within-source index of each sample of a weighted mixture (see the module's notes)."""

    PERIOD = 100_000

    def __init__(self, weights: list[float]):
        total = float(sum(weights))
        share = [w / total for w in weights]
        raw = [s * self.PERIOD for s in share]
        quota = [int(r) for r in raw]
        for s in sorted(range(len(raw)), key=lambda s: (quota[s] - raw[s], s))[: self.PERIOD - sum(quota)]:
            quota[s] += 1
        self.quota = np.asarray(quota, dtype=np.int64)
        target = [q / self.PERIOD for q in quota]
        source = np.empty(self.PERIOD, dtype=np.int64)
        before = np.empty(self.PERIOD, dtype=np.int64)  # samples of the same source earlier in the period
        taken = [0] * len(quota)
        for i in range(self.PERIOD):
            s = max(range(len(quota)), key=lambda s: (target[s] * (i + 1) - taken[s], -s))
            source[i], before[i] = s, taken[s]
            taken[s] += 1
        self.source, self.before = source, before
        self.prefix = np.zeros((self.PERIOD + 1, len(quota)), dtype=np.int64)  # per-source counts of each prefix
        self.prefix[np.arange(1, self.PERIOD + 1), source] = 1
        np.cumsum(self.prefix, axis=0, out=self.prefix)

    def counts(self, n: int) -> np.ndarray:
        """Samples of each source among the first ``n`` of the order."""
        return (n // self.PERIOD) * self.quota + self.prefix[n % self.PERIOD]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source's own order) of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        period, r = samples // self.PERIOD, samples % self.PERIOD
        source = self.source[r]
        return source, period * self.quota[source] + self.before[r]


def replica_rows(
    global_batch_size: int, micro_batch_size: int, dp: int, dp_rank: int, split: Sequence[int] | None = None
) -> tuple[int, int]:
    """(first row, rows) of dp rank ``dp_rank``'s share of a global batch: the d-th contiguous slice of B / dp rows,
    or with ``split`` (micro batches of each replica, schedule.replica_micro_batches) ``split[d]`` micro batches after
    the rows of the replicas before it. Either way the replicas' rows, in replica order, are the global batch."""
    if not split:
        per_rank = global_batch_size // dp
        return dp_rank * per_rank, per_rank
    return sum(split[:dp_rank]) * micro_batch_size, split[dp_rank] * micro_batch_size
