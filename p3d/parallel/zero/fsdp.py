"""ZeRO-2 and ZeRO-3 on the torch executor's chunks: torch's FSDP2 (``fully_shard``) over the dp group.

What is sharded, per dp rank of one (pp, tp) coordinate: every parameter of this rank's chunks, its gradient and
its Adam moments, cut along dim 0 into dp pieces (torch.chunk's rule: ceil(rows / dp) rows each, the last rank
fewer or none). A TP layer's parameter is this tp rank's local slice (p3d.parallel.tp), and it is that slice
that FSDP cuts: TP stays ours, FSDP sees plain tensors.

Units: each ``TransformerBlock`` of a chunk is its own FSDP unit, and the chunk is the root unit of the rest (the
embedding, the final norm, the head). Per block, because a unit is what is gathered at once: the memory above the
shards is one or two blocks' full weights (the one running and the one FSDP2 prefetches; its forward and backward
prefetch the next unit's all-gather while the current one computes), not the chunk's. A chunk-sized unit would
hold the whole chunk gathered, which is what ZeRO-3 exists to avoid.

``zero.stage`` is ``reshard_after_forward``:
  stage 2: False. A block's weights are gathered for its first micro batch's forward and stay gathered
           until the step's gradients are reduced; gradients and Adam states live sharded. Gathers: one per
           unit per step.
  stage 3: True. Weights are freed after each forward and gathered again for each micro batch's forward and
           backward. Gathers: 2 per unit per micro batch.
Gradients are reduce-scattered once per step under every schedule: torch's ``PipelineStage`` turns off
FSDP's gradient sync for each micro batch's backward (``backward_maybe_with_nosync``) and reduces when the
schedule's last backward of the stage is done (``perform_reduce_grad``), so the micro batches accumulate in the
unsharded gradient (tests/workers/test_zero_collectives.py counts the reduce-scatters).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from p3d.compat.deepspeed_internals import PIPE_REPLICATED_ATTR
from p3d.compat.fsdp_float8 import hp_tensor
from p3d.parallel.experts.params import EXPERT_PARALLEL

# The markers p3d reads on parameters (p3d.parallel.tp.layers, p3d.compat.deepspeed_internals); FSDP2 replaces
# each parameter by a new DTensor parameter, so they are copied over by name.
MARKERS = ("model_parallel", "tensor_model_parallel", PIPE_REPLICATED_ATTR, EXPERT_PARALLEL)


def dp_device_mesh(mesh, device: torch.device, shard_size: int | None = None):
    """The DeviceMesh FSDP2 shards over. The whole dp group: one dimension over the existing dp group. HSDP
    (``shard_size`` < dp): two, (dp / shard_size replicas) x (shard_size ranks), from groups created here, on every
    rank in the same order: ``ParallelDims.shard_ranks`` (runs of shard_size consecutive dp ranks: inside a node
    whenever shard_size x tp divides the ranks per node) and ``shard_replica_ranks``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    s = shard_size or mesh.dp_cp
    if s == mesh.dp_cp:  # every holder of the parameters: the dp ranks, and with context parallelism the cp ones
        return DeviceMesh.from_group(mesh.dp_cp_group, device.type, mesh_dim_names=("dp",))
    shard_group = replicate_group = None
    for ranks in mesh.dims.shard_ranks(s):
        group = dist.new_group(ranks=ranks)
        if mesh.rank in ranks:
            shard_group = group
    for ranks in mesh.dims.shard_replica_ranks(s):
        group = dist.new_group(ranks=ranks)
        if mesh.rank in ranks:
            replicate_group = group
    assert shard_group is not None and replicate_group is not None  # every rank is in one of each
    mine = next(ranks for ranks in mesh.dims.dp_cp_ranks() if mesh.rank in ranks)
    layout = torch.tensor(mine).view(mesh.dp_cp // s, s)
    return DeviceMesh.from_group(
        [replicate_group, shard_group], device.type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


def expert_device_mesh(mesh, device: torch.device):
    """The DeviceMesh of the routed experts' FSDP2 units: the edp group (the dp / ep ranks holding the same
    experts; one rank when ep = dp)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(mesh.edp_group, device.type, mesh_dim_names=("edp",))


def shard_chunk(
    chunk: nn.Module,
    dp_mesh,
    stage: int,
    unit: type[nn.Module],
    mp_policy=None,
    experts_of: Callable[[nn.Module], nn.Module | None] | None = None,
    experts_mesh=None,
) -> None:
    """Wrap ``chunk`` in place: each child of type ``unit`` (the transformer block) an FSDP unit, then the chunk
    as the root of the rest. ``experts_of(block)``: its routed experts, made a unit of their own over
    ``experts_mesh`` (the edp group) first: they differ between the ep ranks of dp, so they are sharded only over
    the ranks that hold them, and FSDP2 reduces their gradients over those (to their mean over edp, which the
    executor divides by ep: FSDP2's own divide factor is applied twice on a one-rank group in torch 2.13)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    markers = {
        name: {attr: getattr(p, attr) for attr in MARKERS if hasattr(p, attr)} for name, p in chunk.named_parameters()
    }
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=stage >= 3, mp_policy=mp_policy or MixedPrecisionPolicy())
    for module in chunk.children():
        if isinstance(module, unit):
            experts = experts_of(module) if experts_of is not None else None
            if experts is not None:
                fully_shard(experts, **{**kwargs, "mesh": experts_mesh})
            fully_shard(module, **kwargs)
    fully_shard(chunk, **kwargs)
    for name, p in chunk.named_parameters():
        for attr, value in markers[name].items():
            setattr(p, attr, value)


def mixed_precision(dtype):
    """FSDP2's policy for ``train.dtype``: bf16 gathers bf16 copies of the fp32 shards (half the all-gather bytes)
    and reduces the gradients in fp32; the shards stay the fp32 master weights. fp32: gather and reduce in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if getattr(dtype, "value", dtype) == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def is_sharded(t: torch.Tensor | None) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded tensor (the tensor itself, no copy), or the tensor when it is not sharded; of
    a weight gathered in float8 (p3d.parallel.zero.float8_gather), the fp32 piece inside."""
    if is_sharded(t):
        with torch.no_grad():
            return hp_tensor(t.to_local())  # type: ignore[attr-defined]
    return t


def piece_of(t: torch.Tensor) -> tuple[int, int, int]:
    """(pieces, index, replica) of a sharded tensor: it is cut into ``pieces`` along dim 0, this rank holds piece
    ``index``, and ``replica`` > 0 on the copies HSDP keeps of the same piece (they write no checkpoint)."""
    mesh = t.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim == 1:
        return mesh.size(), mesh.get_local_rank(), 0
    return mesh.size(1), mesh.get_local_rank(1), mesh.get_local_rank(0)


def replicas(t: torch.Tensor) -> int:
    """How many ranks of a dp group hold each piece of the sharded ``t``: 1, or dp / shard_size under HSDP."""
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return 1 if mesh.ndim == 1 else mesh.size(0)


def row_range(rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The rows [lo, hi) of a (rows, ...) tensor that dp rank ``dp_rank`` holds: torch.chunk's cut, as FSDP2's."""
    per = math.ceil(rows / dp) if rows else 0
    lo = min(rows, dp_rank * per)
    return lo, min(rows, lo + per)


def flat_range(p: torch.Tensor, dp: int, dp_rank: int) -> tuple[int, int]:
    """(start, numel) of this rank's piece in ``p`` flattened: a dim-0 cut is one contiguous flat range."""
    rows = p.shape[0] if p.ndim else 1
    lo, hi = row_range(rows, dp, dp_rank)
    per_row = p.numel() // rows if rows else 0
    return lo * per_row, (hi - lo) * per_row


def my_rows(full: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """This rank's dim-0 piece of the whole tensor ``full`` (to load a checkpoint into a sharded parameter)."""
    lo, hi = row_range(full.shape[0], dp, dp_rank)
    return full[lo:hi]


def sharded_like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """A tensor sharded as ``p`` is, holding this rank's rows of ``full`` (an Adam moment read from a checkpoint)."""
    out = torch.zeros_like(p)  # a DTensor with p's mesh and placements
    pieces, index, _ = piece_of(p)
    local(out).copy_(my_rows(full, pieces, index).to(out.dtype))
    return out
