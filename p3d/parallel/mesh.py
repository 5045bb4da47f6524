"""The device mesh of one worker: its rank in a :class:`ParallelDims` and the process groups.

The rank arithmetic (tp fastest, then cp, dp, pp; DeepSpeed's pipe/data/model axes with cp inside) lives in
:mod:`p3d.layout.dims`, shared with validation, the planner and the dry run; ``with_groups``
creates the process groups in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from p3d.layout.dims import ParallelDims


@dataclass(frozen=True)
class Mesh:
    tp: int
    pp: int
    dp: int
    rank: int = 0
    procs_per_node: int | None = None  # None: the whole world on one node
    tp_group: Any = field(default=None, compare=False, repr=False)
    pp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)
    replica_group: Any = field(default=None, compare=False, repr=False)  # pp x tp ranks of one dp replica
    ep: int = 1  # expert parallelism, carved from dp (p3d.layout.dims)
    ep_group: Any = field(
        default=None, compare=False, repr=False
    )  # the ep dp ranks whose experts this rank's tokens reach
    edp_group: Any = field(default=None, compare=False, repr=False)  # the dp x cp ranks holding this rank's experts
    cp: int = 1  # context parallelism: each sequence split over cp ranks (p3d.parallel.context)
    cp_group: Any = field(default=None, compare=False, repr=False)  # the cp ranks splitting this rank's sequences
    dp_cp_group: Any = field(default=None, compare=False, repr=False)  # every holder of this rank's parameters

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mesh.rank={self.rank} outside world size {self.world_size}")

    @classmethod
    def from_plan(cls, plan, rank: int) -> Mesh:
        return cls(
            tp=plan.tp, pp=plan.pp, dp=plan.dp, rank=rank, procs_per_node=plan.procs_per_node, ep=plan.ep, cp=plan.cp
        )

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @cached_property
    # DeepSpeed's PipelineModule wants its own; the same arithmetic (tests/unit/parallel/test_mesh.py)
    def topology(self):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    @cached_property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            tp=self.tp, pp=self.pp, dp=self.dp, procs_per_node=self.procs_per_node, ep=self.ep, cp=self.cp
        )

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.dims.coords_of(self.rank)

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
    def cp_rank(self) -> int:
        """Which cp rank of its sequences this rank is: it holds chunks cp_rank and 2 cp - 1 - cp_rank of each."""
        return self.dims.cp_of(self.rank)

    @property
    def dp_cp(self) -> int:
        """The ranks holding the same parameters (and reducing their gradients): dp x cp."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place among them (the order of ``ParallelDims.dp_cp_ranks``)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """Which of the ep shares of each MoE layer's experts this rank holds."""
        return self.dims.ep_rank_of(self.dp_rank)

    @property
    def edp(self) -> int:
        """The ranks that hold the same experts (and reduce their gradients): dp / ep, times cp."""
        return self.dp // self.ep * self.cp

    @property
    def edp_rank(self) -> int:
        """This rank's place among them (the order of ``ParallelDims.edp_ranks``: dp major, cp minor)."""
        return self.dp_rank // self.ep * self.cp + self.cp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    # ---- process groups
    def with_groups(self) -> Mesh:
        """Create every group; each rank must call this with the same mesh (same order of new_group)."""
        import torch.distributed as dist

        groups = {}
        d = self.dims
        for name, lists in (
            ("tp_group", d.tp_ranks()),
            ("pp_group", d.pp_ranks()),
            ("dp_group", d.dp_ranks()),
            ("replica_group", d.replica_ranks()),
            *((("ep_group", d.ep_ranks()), ("edp_group", d.edp_ranks())) if self.ep > 1 else ()),
            *((("cp_group", d.cp_ranks()), ("dp_cp_group", d.dp_cp_ranks())) if self.cp > 1 else ()),
        ):
            for ranks in lists:
                g = dist.new_group(ranks=ranks)
                if self.rank in ranks:
                    groups[name] = g
        if self.cp == 1:  # the dp ranks are every holder of the parameters
            groups["dp_cp_group"] = groups["dp_group"]
        if self.ep == 1:  # every expert on every dp x cp rank: their gradients reduce like the rest
            groups["edp_group"] = groups["dp_cp_group"]
        return dataclasses.replace(self, **groups)

    def describe(self) -> str:
        return self.dims.describe()
