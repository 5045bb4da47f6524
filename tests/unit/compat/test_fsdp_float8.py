"""The touchpoints of p3d.compat.fsdp_float8: FSDP2's all-gather extension protocol as torch 2.13 calls it (a
one-argument ``fsdp_pre_all_gather``, ``fsdp_post_all_gather`` with ``out=`` on later gathers) and the wrapper's
behaviour under the ops FSDP2 shards and pads with, checked here without a process group; FSDP2 itself gathers it
in tests/workers/test_float8_zero.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from p3d.compat import torchao_internals as ao
from p3d.compat.fsdp_float8 import Float8GatherWeight, gathered_shard, hp_tensor


def _weight(rows=8, cols=16):
    config = ao.float8_config("tensorwise", emulate=True)
    cast = ao.recipe_casts(config)["weight"]
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    return Float8GatherWeight(w, ao.linear_mm_config(config), cast), w, cast


def test_the_extension_has_the_signatures_fsdp2_calls():
    wrapped, _, _ = _weight()
    assert len(inspect.signature(wrapped.fsdp_pre_all_gather).parameters) == 1  # torch: 1 (mesh) or 5
    post = inspect.signature(wrapped.fsdp_post_all_gather).parameters
    assert list(post)[:3] == ["outputs", "metadata", "param_dtype"] and "out" in post


def test_sharding_ops_keep_the_wrapper_and_the_rest_unwrap():
    wrapped, w, _ = _weight()
    for kept in (wrapped.detach(), wrapped[2:4], wrapped.view(-1), wrapped.new_zeros(3, 16), wrapped.clone()):
        assert isinstance(kept, Float8GatherWeight)
    product = wrapped * 2
    assert type(product) is torch.Tensor and torch.equal(product, w * 2)
    wrapped.mul_(0.5)  # an optimizer's in-place update reaches the fp32 tensor inside
    assert torch.equal(hp_tensor(wrapped), w) and hp_tensor(w) is w and gathered_shard(w) is w


def test_pre_all_gather_casts_once_per_scale_as_uint8_and_post_rebuilds_float8():
    wrapped, w, cast = _weight()
    with pytest.raises(RuntimeError, match="needs its scale first"):
        wrapped.fsdp_pre_all_gather(None)
    scale = ao.amax_to_scale(w.abs().max() * 2, cast)  # as if another rank's shard held twice this amax
    wrapped.set_scale(scale)
    (payload,), (meta,) = wrapped.fsdp_pre_all_gather(None)
    assert payload.dtype == torch.uint8 and payload.shape == w.shape and meta is scale
    want, _ = ao.payload(ao.to_float8(w, scale, cast, None, scale_given=True))
    assert torch.equal(payload, want.view(torch.uint8))
    assert wrapped.fsdp_pre_all_gather(None)[0][0] is payload  # cached: one cast a step, whatever the micro batches
    wrapped.add_(1.0)  # the optimizer step; the next step starts with its own scale: cast again
    wrapped.set_scale(ao.amax_to_scale(hp_tensor(wrapped).abs().max(), cast))
    again = wrapped.fsdp_pre_all_gather(None)[0][0]
    assert again is not payload and not torch.equal(again, payload)
    gathered, inner = wrapped.fsdp_post_all_gather((payload,), (scale,), torch.bfloat16)
    assert ao.is_float8(gathered) and inner[0] is payload
    before = w - 1.0  # the values the payload was cast from (w was updated in place since)
    torch.testing.assert_close(gathered._data.float() / gathered._scale, before, rtol=0.07, atol=1e-2)
    assert wrapped.fsdp_post_all_gather((payload,), (scale * 2,), torch.bfloat16, out=gathered) is None
    assert torch.equal(gathered._scale, scale * 2)
