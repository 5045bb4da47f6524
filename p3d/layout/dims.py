"""The degrees of one run (tp x cp x dp x pp), the ``dp=auto`` rule, and rank <-> coordinates.

Pure arithmetic, no processes and no torch, so that validation, the planner, the dry run, Slurm
sizing and the worker's :class:`p3d.parallel.mesh.Mesh` all read one definition. Ranks follow
DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model; the last varies fastest), with context
parallelism (``cp``) between data and model:

    rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp

so a TP group is a run of adjacent ranks (one node, the fastest links), the cp ranks of a sequence come next
(stride tp: their keys and values cross every layer, docs/context.md says why this order), the dp replicas of a
stage next (stride tp cp) and pipeline stages are furthest apart (stride tp cp dp). With cp = 1 this is
DeepSpeed's formula, which its engine (cp = 1 only) uses too.

The cp ranks of one dp coordinate read the same sequences (each its 2 of the 2 cp chunks of every one) and hold
the same parameters: gradients reduce over the dp x cp ranks of a (pp, tp) coordinate (``dp_cp_ranks``), ZeRO
shards over them, and each writes 1/(dp cp) of a checkpoint.

Expert parallelism (``ep``) is carved from dp, not a dimension of its own: dp rank d holds the experts of ep
rank d % ep. An ep group is ep consecutive dp ranks (so ep x tp consecutive global ranks, one node where that
fits: the all-to-alls stay on the fastest links; with cp, ep dp ranks of one cp coordinate), and the
expert-data-parallel (edp) group of a rank is the dp / ep ranks of its dp group with the same ep rank, times the cp
ranks of each: they hold the same experts and reduce their gradients.
``tests/unit/parallel/test_mesh.py`` checks this against DeepSpeed's topology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p3d.config.errors import P3DConfigError


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def resolve_dp(tp: int, pp: int, dp: object, nodes: int, gpus_per_node: int | None, cp: int = 1) -> int:
    """``mesh.dp`` as a number. ``auto`` takes the cluster's GPUs (nodes x gpus_per_node) / (tp cp pp), or
    1 where the mesh decides the world (cpu workers: gpus_per_node is None). An explicit dp is returned
    as given: whether it fills the cluster is a rule of validation; the planner models it as asked."""
    if dp == "auto":
        if gpus_per_node is None:
            return 1
        world, per_replica = nodes * gpus_per_node, tp * cp * pp
        if world % per_replica:
            fit = math.ceil(world / per_replica) * per_replica // gpus_per_node or 1
            names = "mesh.tp*mesh.cp*mesh.pp" if cp > 1 else "mesh.tp*mesh.pp"
            raise P3DConfigError(
                f"{names}={per_replica} must divide the world size {world} (cluster.nodes={nodes} x "
                f"cluster.gpus_per_node={gpus_per_node})",
                [f"cluster.nodes={fit}", *degrees_that_fill(world, {"cp": cp, "pp": pp, "tp": tp})],
            )
        return world // per_replica
    if not _positive_int(dp):
        raise P3DConfigError(f"mesh.dp={dp!r} must be a positive integer or auto; try mesh.dp=auto")
    return dp  # type: ignore[return-value]  # checked just above


def degrees_that_fill(world: int, degrees: dict[str, int], dp: int | None = None) -> list[str]:
    """Fixes that make the mesh fill ``world`` ranks by lowering one degree (``mesh.cp=1``): the largest value
    below the given one with which the product is ``world`` (``dp`` given) or divides it (dp auto)."""
    fixes = []
    for name, given in degrees.items():
        rest = math.prod(v for k, v in degrees.items() if k != name) * (dp or 1)
        fits = [v for v in range(given - 1, 0, -1) if (rest * v == world if dp else world % (rest * v) == 0)]
        fixes += [f"mesh.{name}={fits[0]}"] if fits else []
    return fixes


def largest_divisor_at_most(n: int, limit: int, *also: int) -> int:
    """The largest d <= limit dividing n and every one of ``also`` (a degree a refusal can suggest)."""
    return max(d for d in range(1, limit + 1) if n % d == 0 and all(a % d == 0 for a in also))


@dataclass(frozen=True)
class ParallelDims:
    tp: int
    pp: int
    dp: int
    procs_per_node: int | None = None  # None: the whole world on one node
    ep: int = 1  # experts split over ep ranks of each dp group (ep divides dp)
    cp: int = 1  # each sequence split over cp ranks (context parallelism)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "cp"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def degrees(self, ep: bool = False) -> str:
        """``dp=2 x pp=2 x cp=2 x tp=2``: cp where it is > 1, and with ``ep`` the expert degree likewise."""
        experts = f" (ep={self.ep})" if ep and self.ep > 1 else ""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return f"dp={self.dp}{experts} x pp={self.pp}{cp} x tp={self.tp}"

    def describe(self) -> str:
        return f"{self.degrees(ep=True)} ({self.world_size} ranks)"

    # ---- rank <-> coordinates
    def rank_of(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def _split(self, rank: int) -> tuple[int, int, int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return dp, pp, tp, cp

    def coords_of(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of a global rank (its cp coordinate: ``cp_of``)."""
        return self._split(rank)[:3]

    def cp_of(self, rank: int) -> int:
        """Which of the cp ranks of its sequences ``rank`` is."""
        return self._split(rank)[3]

    @property
    def logging_rank(self) -> int:
        """Last stage, dp 0, tp 0: the rank where the loss is known, whose log the console shows."""
        return self.rank_of(0, self.pp - 1, 0)

    def node_of(self, rank: int) -> int:
        return rank // (self.procs_per_node or self.world_size)

    def local_rank_of(self, rank: int) -> int:
        return rank % (self.procs_per_node or self.world_size)

    # ---- groups: lists of ranks, in the order every rank must create them
    def tp_ranks(self) -> list[list[int]]:
        """All TP groups (ranks sharing dp, cp and pp)."""
        return [
            [self.rank_of(d, p, t, c) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    def pp_ranks(self) -> list[list[int]]:
        return [
            [self.rank_of(d, p, t, c) for p in range(self.pp)]
            for d in range(self.dp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def dp_ranks(self) -> list[list[int]]:
        """The dp groups: ranks sharing pp, cp and tp (the replicas of one piece of the model and of a sequence)."""
        return [
            [self.rank_of(d, p, t, c) for d in range(self.dp)]
            for p in range(self.pp)
            for c in range(self.cp)
            for t in range(self.tp)
        ]

    def cp_ranks(self) -> list[list[int]]:
        """The cp groups: ranks sharing dp, pp and tp, which split the same sequences (keys and values pass here)."""
        return [
            [self.rank_of(d, p, t, c) for c in range(self.cp)]
            for p in range(self.pp)
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_cp_ranks(self) -> list[list[int]]:
        """The ranks sharing pp and tp: every holder of the same parameters (gradients reduce, ZeRO shards here);
        the dp groups when cp = 1. In rank order (dp major, cp minor)."""
        return [
            [self.rank_of(d, p, t, c) for d in range(self.dp) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def shard_ranks(self, shard_size: int) -> list[list[int]]:
        """HSDP's shard groups (``zero.shard_size``): runs of ``shard_size`` consecutive ranks of each dp x cp group,
        so with tp fastest ``shard_size`` x tp consecutive ranks, inside one node whenever that divides the
        processes per node (Slurm's block placement: consecutive ranks share a node)."""
        n = self.dp * self.cp
        return [ranks[lo : lo + shard_size] for ranks in self.dp_cp_ranks() for lo in range(0, n, shard_size)]

    def shard_replica_ranks(self, shard_size: int) -> list[list[int]]:
        """HSDP's replica groups: the ranks of each dp x cp group that hold the same piece (one per shard group)."""
        return [ranks[j::shard_size] for ranks in self.dp_cp_ranks() for j in range(shard_size)]

    def ep_rank_of(self, dp_rank: int) -> int:
        """Which ep rank's experts dp rank ``dp_rank`` holds."""
        return dp_rank % self.ep

    def ep_ranks(self) -> list[list[int]]:
        """The ep groups: runs of ep consecutive dp ranks of each dp group (the tokens' all-to-alls)."""
        return [ranks[lo : lo + self.ep] for ranks in self.dp_ranks() for lo in range(0, self.dp, self.ep)]

    def edp_ranks(self) -> list[list[int]]:
        """The expert-data-parallel groups: every holder of the same experts (the experts' gradient reduction and
        their ZeRO sharding), the dp ranks of each dp x cp group with the same ep rank and all their cp ranks, in
        ``dp_cp_ranks``' order (dp major, cp minor); the dp ranks with one ep rank when cp = 1."""
        return [
            [self.rank_of(d, p, t, c) for d in range(e, self.dp, self.ep) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
            for e in range(self.ep)
        ]

    def replica_ranks(self) -> list[list[int]]:
        """The pp x tp ranks of one whole copy of the model: all ranks with one (dp, cp) coordinate."""
        return [
            [self.rank_of(d, p, t, c) for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
            for c in range(self.cp)
        ]
