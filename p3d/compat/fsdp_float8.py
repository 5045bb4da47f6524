"""ZeRO-3's float8 all-gather: FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on
a parameter's local tensor, torch/distributed/fsdp/_fully_shard/_fsdp_param.py) with torchao's
``Float8TrainingTensor`` as the gathered weight. Checked by tests/unit/compat/test_fsdp_float8.py and
tests/workers/test_float8_zero.py.

``Float8GatherWeight`` wraps a float8 TP layer's fp32 master weight (p3d.parallel.tp.float8, tensorwise): FSDP2
shards it as any tensor (the ops it cuts, pads and copies with keep the wrapper), and for each all-gather the
shard is cast to e4m3 with the scale ``set_scale`` gave it (precomputed after the optimizer step from the amax over
dp x tp: p3d.parallel.zero.float8_gather), once a step (the cast is kept until the next step's scale), and travels as
uint8: gloo has no float8 types ("Invalid scalar type"), and a uint8 view is the same bytes, so the gather is
bitwise the float8 one. After it, the gathered bytes are the weight's float8 data: a ``Float8TrainingTensor``
that the layer's matmul takes as already cast. Half bf16's all-gather bytes; the fp32 master stays sharded.
Every other op on the wrapper runs on the fp32 tensor inside (AdamW's updates, the checkpoint's reads through
``p3d.parallel.zero.fsdp.local``).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format

from p3d.compat import torchao_internals as ao

# the ops FSDP2 shards, pads and moves a parameter with: their results stay wrapped (the others unwrap)
_KEEP = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.narrow.default,
}


class Float8GatherWeight(torch.Tensor):
    """An fp32 weight that FSDP2 all-gathers in float8 (module doc). ``mm_config``: the layer's GEMM settings."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, mm_config, cast: ao.Cast):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            memory_format=suggest_memory_format(tensor),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, mm_config, cast: ao.Cast):
        self._tensor, self._mm_config, self._cast = tensor, mm_config, cast
        self._scale: torch.Tensor | None = None
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None  # (scale, uint8 payload)

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return f"Float8GatherWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        wrapped = [a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, cls)]
        first = wrapped[0]
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func is torch.ops.aten.detach.default or func in _KEEP:
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, first._mm_config, first._cast), out)
        return out

    def __tensor_flatten__(self):
        return ["_tensor"], {"mm_config": self._mm_config, "cast": self._cast}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8GatherWeight(inner["_tensor"], meta["mm_config"], meta["cast"])

    def set_scale(self, scale: torch.Tensor) -> None:
        """The scale of the next gathers (a 0-d fp32 tensor): the amax of the whole weight over dp x tp."""
        self._scale = scale

    def fsdp_pre_all_gather(self, mesh):
        if self._scale is None:
            raise RuntimeError("a float8-gathered weight needs its scale first (p3d.parallel.zero.float8_gather)")
        # one cast per scale: a step's (p3d.parallel.zero.float8_gather sets new ones as each step starts). Not keyed
        # by the shard's version: an update through the wrapper (or a DTensor around it) bumps the outer tensor's
        # counter, not the fp32 one inside
        if self._cached is None or self._cached[0] is not self._scale:
            shard = ao.to_float8(self._tensor, self._scale, self._cast, self._mm_config, scale_given=True)
            data, _ = ao.payload(shard)
            self._cached = (self._scale, data.view(torch.uint8))
        return (self._cached[1],), (self._scale,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        (scale,) = metadata
        if out is not None:  # the same storage gathered again: only the scale may have moved
            ao.set_payload_scale(out, scale)
            return None
        weight = ao.from_payload(data.view(self._cast.dtype), scale, param_dtype, self._mm_config, self._cast.role)
        return weight, (data,)


def gathered_shard(param: torch.Tensor) -> torch.Tensor:
    """The very local tensor FSDP2 calls the extensions on: a DTensor parameter's ``_local_tensor`` (``to_local()``
    returns a new alias, on which a scale would be set in vain)."""
    return getattr(param, "_local_tensor", param)


def hp_tensor(t: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor inside a ``Float8GatherWeight`` (a plain tensor as it is)."""
    return t._tensor if isinstance(t, Float8GatherWeight) else t
