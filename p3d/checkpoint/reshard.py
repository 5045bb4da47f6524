"""Layout-free tensors: from a checkpoint's (pp, tp) shards to the logical tensor and back to any mesh.

Every parameter has a global name (its pipeline layer index and module path, e.g.
``3.attn.wqkv.weight``, or ``tied_modules.embed.weight``) and a shard spec saved with it:
- ``rows``: the weight stacks ``blocks`` along dim 0 (q|k|v, gate|up, or the vocab), each block
  padded to ``padded`` rows and split evenly over tp; rank r holds [b_1 r-th slice | b_2 r-th slice ...].
- ``cols``: split evenly along dim 1.
- ``replicated``: the same on every tp rank.
Adam moments and fp32 master weights are cut exactly like their parameter.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F


def full_from_shards(shards: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The logical (unpadded) tensor from its tp shards, in tp-rank order."""
    kind = spec["kind"]
    if kind == "replicated":
        return shards[0]
    if kind == "cols":
        return torch.cat(shards, dim=1)
    tp = len(shards)
    local = [p // tp for p in spec["padded"]]
    parts = [s.split(local, dim=0) for s in shards]  # parts[rank][block]
    blocks = [torch.cat([parts[r][b] for r in range(tp)], dim=0)[:real] for b, real in enumerate(spec["blocks"])]
    return torch.cat(blocks, dim=0)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with ``rows`` zero rows appended along dim 0 (a matrix's vocab padding; a bias (n,) works alike)."""
    return F.pad(t, (0, 0) * (t.ndim - 1) + (0, rows)) if rows else t


def shard_from_full(full: torch.Tensor, spec: dict, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of a logical tensor under the (target) spec."""
    kind = spec["kind"]
    if kind == "replicated":
        return full
    if kind == "cols":
        return full.chunk(tp, dim=1)[rank]
    out, start = [], 0
    for real, padded in zip(spec["blocks"], spec["padded"]):
        block = pad_rows(full[start : start + real], padded - real)
        out.append(block.chunk(tp, dim=0)[rank])
        start += real
    return torch.cat(out, dim=0).contiguous()


def source_stage(name: str, stage_bounds: list[int]) -> int:
    """The stage of a saved layout that holds parameter ``name`` (tied weights: the first stage)."""
    head = name.split(".", 1)[0]
    if not head.isdigit():
        return 0
    layer = int(head)
    for s in range(len(stage_bounds) - 1):
        if stage_bounds[s] <= layer < stage_bounds[s + 1]:
            return s
    raise KeyError(f"layer {layer} of {name} is outside the saved stages {stage_bounds}")


class ShardedCheckpoint:
    """Reads a checkpoint's per-(pp, tp) coordinates lazily and serves logical tensors; ``loader(kind,
    pp, tp)`` reads one coordinate (p3d.checkpoint.checkpointer.reader)."""

    def __init__(self, path: Path, meta: dict, loader):
        self.path, self.meta, self._load = Path(path), meta, loader
        self.tp = meta["mesh"]["tp"]
        self.bounds = meta["stage_bounds"]
        self._files: dict[tuple[str, int, int], dict] = {}

    def _file(self, kind: str, pp: int, tp: int) -> dict:
        key = (kind, pp, tp)
        if key not in self._files:
            self._files[key] = self._load(kind, pp, tp)
        return self._files[key]

    def spec(self, name: str) -> dict:
        return self._file("model", source_stage(name, self.bounds), 0)["shard"][name]

    def param(self, name: str) -> torch.Tensor:
        pp = source_stage(name, self.bounds)
        shards = [self._file("model", pp, t)["params"][name] for t in range(self.tp)]
        return full_from_shards(shards, self.spec(name))

    def optim(self, name: str, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """The logical fp32 master and Adam moments of ``name`` (or only ``keys`` of them)."""
        pp = source_stage(name, self.bounds)
        per_rank = [self._file("optim", pp, t)[name] for t in range(self.tp)]
        spec = self.spec(name)
        return {k: full_from_shards([s[k] for s in per_rank], spec) for k in keys or per_rank[0]}

    def master(self, name: str) -> torch.Tensor:
        return self.optim(name, ("master",))["master"]

    def names(self) -> list[str]:
        out = []
        for pp in range(len(self.bounds) - 1):
            out += [n for n in self._file("model", pp, 0)["params"] if n not in out]
        return out
