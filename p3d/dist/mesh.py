"""The device mesh: G = dp x pp x tp ranks, tp fastest.

A rank's coordinates follow DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model;
the last varies fastest): rank = (pp * dp_size + dp) * tp_size + tp. A TP group is a run of adjacent
ranks (one node, the fastest links); the dp replicas of a stage come next (stride tp) and pipeline
stages are furthest apart (stride tp * dp). With tp = GPUs per node each node holds one TP group,
and both the dp all-reduce and the pp sends cross nodes. The rank arithmetic needs no process
group and is unit-tested; ``with_groups`` creates the process groups.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional


@dataclass(frozen=True)
class Mesh:
    tp: int
    pp: int
    dp: int
    rank: int = 0
    procs_per_node: Optional[int] = None  # None: the whole world on one node
    tp_group: Any = field(default=None, compare=False, repr=False)
    pp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)
    replica_group: Any = field(default=None, compare=False, repr=False)  # pp x tp ranks of one dp replica

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"Mesh.{name}={getattr(self, name)} must be positive")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mesh.rank={self.rank} outside world size {self.world_size}")

    @classmethod
    def from_plan(cls, plan, rank: int) -> "Mesh":
        return cls(tp=plan.tp, pp=plan.pp, dp=plan.dp, rank=rank, procs_per_node=plan.procs_per_node)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @cached_property
    def topology(self):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    # ---- rank arithmetic (no processes needed)
    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of a global rank."""
        c = self.topology.get_coord(rank)
        return c.data, c.pipe, c.model

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return self.topology.get_rank(pipe=pp, data=dp, model=tp)

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.coords_of(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def pp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def node_of(self, rank: int) -> int:
        return rank // (self.procs_per_node or self.world_size)

    def local_rank_of(self, rank: int) -> int:
        return rank % (self.procs_per_node or self.world_size)

    def tp_ranks(self) -> list[list[int]]:
        """All TP groups (ranks sharing dp and pp)."""
        return self.topology.get_axis_comm_lists("model") or [[r] for r in range(self.world_size)]

    def pp_ranks(self) -> list[list[int]]:
        return self.topology.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]

    def dp_ranks(self) -> list[list[int]]:
        return self.topology.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]

    def replica_ranks(self) -> list[list[int]]:
        """The pp x tp ranks of each dp replica (all ranks with one dp coordinate)."""
        return [[self.rank_of(d, p, t) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    # ---- process groups
    def with_groups(self) -> "Mesh":
        """Create every group; each rank must call this with the same mesh (same order of new_group)."""
        import torch.distributed as dist

        groups = {}
        for name, lists in (("tp_group", self.tp_ranks()), ("pp_group", self.pp_ranks()),
                            ("dp_group", self.dp_ranks()), ("replica_group", self.replica_ranks())):
            for ranks in lists:
                g = dist.new_group(ranks=ranks)
                if self.rank in ranks:
                    groups[name] = g
        return dataclasses.replace(self, **groups)

    def describe(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp} ({self.world_size} ranks)"
