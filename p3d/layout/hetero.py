"""The arithmetic of a heterogeneous cluster (``cluster.groups``, docs/clusters.md): its groups' numbers, which group
each node and rank sits in, and each group's nominal speed. No torch, no processes.

A cluster of groups ``[{device: h100_sxm, nodes: 1}, {device: a100_80gb, nodes: 1}]`` is ``cluster.nodes`` = 2 nodes
taken in the groups' order: node 0 is the H100 node, node 1 the A100 node. Ranks fill the nodes block by block (rank
r on node r // ranks per node), as srun and the local launcher place them, so the group of a rank follows from its
node. Every group's unset number comes from its device preset; the cluster-wide figures that one number must stand
for (``cluster.peak_tflops`` for MFU, ``cluster.memory_gb`` for the pre-flight check, the links) are the GPU-weighted
mean peak, the smallest memory and the slowest links of the groups, unless set.

The uneven layouts such a cluster runs are ``schedule.stage_blocks`` and ``schedule.replica_micro_batches``
(p3d.layout.schedule_rules checks them; the planner chooses them, p3d.planner.hetero).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from p3d.config.devices import DEVICES, DeviceName
from p3d.config.errors import P3DConfigError
from p3d.config.schema import ClusterConfig, ClusterGroup, Config

_FEATURE = re.compile(r"^[\w.-]+$")  # one Slurm node feature; an expression (a&b, a|b, [a*2], ...) is not one


def plain_feature(constraint: str | None) -> bool:
    """Whether a ``constraint`` names one node feature (which ``sinfo`` can check and a node's features can hold)."""
    return bool(constraint) and _FEATURE.match(str(constraint)) is not None


def _presets() -> str:
    return ", ".join(sorted(DEVICES))


def check_group(i: int, g: ClusterGroup) -> None:
    """One group: a known device preset, at least one node, positive numbers."""
    where = f"cluster.groups[{i}]"
    if g.device is None or g.device == "":
        raise P3DConfigError(
            f"{where}.device is not set: every group names a device preset ({_presets()}); "
            f"try cluster.groups='[{{device: h100_sxm, nodes: {g.nodes}}}, ...]'"
        )
    if g.device not in DEVICES:
        raise P3DConfigError(f"{where}.device={g.device} is not a device preset; try one of: {_presets()}")
    if not isinstance(g.nodes, int) or g.nodes < 1:
        raise P3DConfigError(f"{where}.nodes={g.nodes} must be at least 1; try {where}.nodes=1")
    for name in ("peak_tflops", "memory_gb"):
        value = getattr(g, name)
        if value is not None and not value > 0:
            raise P3DConfigError(f"{where}.{name}={value} must be positive; try {where}.{name}=null (the preset's)")


def filled_group(g: ClusterGroup) -> ClusterGroup:
    """The group with its unset numbers from its device preset."""
    preset = DEVICES[str(g.device)]
    return dataclasses.replace(
        g,
        device=str(g.device),
        peak_tflops=g.peak_tflops if g.peak_tflops is not None else preset.peak_tflops,
        memory_gb=g.memory_gb if g.memory_gb is not None else preset.memory_gb,
    )


def fill_groups(c: ClusterConfig) -> ClusterConfig:
    """``cluster`` with its groups checked and filled (``check_group``, ``filled_group``), ``cluster.nodes`` their sum,
    ``cluster.device`` the first group's, and the cluster-wide numbers left unset from the groups (module doc).
    Unchanged without groups; the same again when filled (the launcher and the planner both fill a config)."""
    if not c.groups:
        return c
    for i, g in enumerate(c.groups):
        check_group(i, g)
    groups = [filled_group(g) for g in c.groups]
    per_node = {DEVICES[str(g.device)].gpus_per_node for g in groups}
    if len(per_node) > 1 and c.gpus_per_node is None:
        raise P3DConfigError(
            "cluster.groups mix devices with different GPUs per node "
            f"({', '.join(f'{g.device}: {DEVICES[str(g.device)].gpus_per_node}' for g in groups)}); set "
            "cluster.gpus_per_node (one rank per GPU, the same on every node)"
        )
    nodes = sum(g.nodes for g in groups)
    unset = {k: v for k, v in cluster_figures(groups).items() if getattr(c, k) is None}
    return dataclasses.replace(c, groups=groups, nodes=nodes, device=DeviceName(groups[0].device), **unset)


def cluster_figures(groups: list[ClusterGroup]) -> dict[str, Any]:
    """The cluster-wide numbers that stand for filled ``groups`` where unset (module doc)."""
    presets = [DEVICES[str(g.device)] for g in groups]
    nodes = sum(g.nodes for g in groups)
    return {
        "peak_tflops": sum(g.nodes * float(g.peak_tflops or 0) for g in groups) / nodes,
        "memory_gb": min(float(g.memory_gb or 0) for g in groups),
        "intra_node_gbps": min(p.intra_node_gbps for p in presets),
        "inter_node_gbps": min(p.inter_node_gbps for p in presets),
        "gpus_per_node": presets[0].gpus_per_node,
    }


def regrouped(c: ClusterConfig, groups: list[ClusterGroup]) -> ClusterConfig:
    """Filled cluster ``c`` on other (filled) ``groups``, an elastic run's groups left: ``cluster.nodes`` their sum,
    ``cluster.device`` the first's, and each cluster-wide number that was derived from ``c``'s groups (it equals
    theirs) derived from the new ones; a number the user set, and the pinned ``gpus_per_node``, kept."""
    was, now = cluster_figures(c.groups), cluster_figures(groups)
    derived = {
        k: now[k]
        for k in ("peak_tflops", "memory_gb", "intra_node_gbps", "inter_node_gbps")
        if getattr(c, k) is not None and math.isclose(float(getattr(c, k)), float(was[k]))
    }
    nodes = sum(g.nodes for g in groups)
    return dataclasses.replace(c, groups=groups, nodes=nodes, device=DeviceName(groups[0].device), **derived)


def check_group_ranks(cfg: Config, world: int) -> None:
    """The ranks of a cluster of groups must fill its nodes evenly (a node belongs to one group)."""
    c = cfg.cluster
    if c.groups and world % c.nodes:
        raise P3DConfigError(
            f"the mesh's {world} ranks do not fill the {c.nodes} nodes of cluster.groups evenly (one group per node); "
            f"choose a mesh whose ranks are a multiple of {c.nodes}"
        )


def node_groups(c: ClusterConfig) -> list[int]:
    """The group of each node, in node order (``[]`` without groups)."""
    return [i for i, g in enumerate(c.groups) for _ in range(g.nodes)]


def group_of_node(c: ClusterConfig, node: int) -> int:
    """The group that node ``node`` belongs to (0 without groups)."""
    groups = node_groups(c)
    return groups[node] if groups else 0


def groups_left(c: ClusterConfig, lost: list[int]) -> list[ClusterGroup]:
    """The groups of the nodes left once the nodes ``lost`` (their indices in the run's node order) are gone: each
    lost node's own group one node smaller, a group left with none dropped. The nodes left keep their order when the
    run starts again (the local launcher numbers its surviving simulated nodes 0, 1, ... in it; srun takes the
    allocation's nodes in it), so the groups left, in their order, take the nodes left as the groups took them:
    losing node 0 of ``[2 x fast, 1 x slow]`` leaves ``[1 x fast, 1 x slow]``, not two fast nodes."""
    owners = node_groups(c)
    counts = [g.nodes for g in c.groups]
    for node in lost:
        if not 0 <= node < len(owners):
            raise ValueError(f"node {node} is not one of the {len(owners)} nodes of cluster.groups")
        counts[owners[node]] -= 1
    return [dataclasses.replace(g, nodes=k) for g, k in zip(c.groups, counts) if k > 0]


def first_nodes(groups: list[ClusterGroup], nodes: int) -> list[ClusterGroup]:
    """The groups of the first ``nodes`` nodes of ``groups`` (an elastic re-fit on fewer nodes than are left runs on
    the first ones: the local launcher's lowest simulated nodes, srun's first nodes of the allocation)."""
    out, left = [], nodes
    for g in groups:
        if left <= 0:
            break
        out.append(dataclasses.replace(g, nodes=min(g.nodes, left)))
        left -= g.nodes
    return out


def nominal_tflops(g: ClusterGroup) -> float:
    """A group's nominal matmul rate per device: its peak x its device's matmul efficiency (the planner's device
    table: p3d.planner.machine), TFLOP/s."""
    return float(g.peak_tflops or DEVICES[str(g.device)].peak_tflops) * DEVICES[str(g.device)].matmul_efficiency


def slowdown(c: ClusterConfig, node: int) -> float:
    """How many times longer node ``node``'s devices take for the same work than the cluster's fastest group's
    (1.0 without groups): the factor ``P3D_TEST_BLOCK_SECONDS`` is stretched by on that node (p3d.train.block_seconds),
    how a simulated mixed cluster runs on one CPU machine."""
    if not c.groups:
        return 1.0
    rates = [nominal_tflops(g) for g in c.groups]
    return max(rates) / rates[group_of_node(c, node)]


def mean_slowdown(c: ClusterConfig) -> float:
    """How many times longer the cluster's mean device takes for the same work than its fastest group's: the fastest
    group's nominal rate over the GPU-weighted mean rate (1.0 without groups). The planner's homogeneous model of a
    cluster of groups runs at the groups' mean peak (``cluster.peak_tflops``); its ``plan.block_seconds`` sleeps are
    stretched by this."""
    if not c.groups:
        return 1.0
    rates = [nominal_tflops(g) for g in c.groups]
    mean = sum(g.nodes * r for g, r in zip(c.groups, rates)) / sum(g.nodes for g in c.groups)
    return max(rates) / mean


def describe_groups(c: ClusterConfig) -> str:
    """``1 x h100_sxm + 1 x a100_80gb`` (nodes x device of each group)."""
    return " + ".join(f"{g.nodes} x {g.device}" for g in c.groups)


def micro_batches_text(plan) -> str:
    """``8``, or ``3 + 5`` where the replicas of ``plan`` (a RunPlan) run different counts."""
    counts = plan.replica_micro_batches
    return " + ".join(map(str, counts)) if len(set(counts)) > 1 else str(plan.micro_batches)
