"""Rotary position embeddings (RoPE) and their scalings for a longer context (``model.rope_scaling``).

A head of width hd rotates its pairs (i, i + hd/2) by position x frequency, with the frequencies
inv_freq_i = theta^(-2i / hd), i < hd/2 (the HF Llama convention: both halves share them). A scaling changes the
frequencies, and yarn also the size of cos and sin (its attention factor), as transformers' rope init functions do
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, the oracle of tests/unit/model/test_rope.py), op for op
in fp32 so that an imported model's logits agree to fp32 rounding:

- ``linear``: every frequency divided by ``factor`` (position interpolation).
- ``llama3`` (Llama 3.1-3.3): with o = original_max_position_embeddings, the wavelengths 2 pi / inv_freq longer than
  o / low_freq_factor divided by ``factor``, those shorter than o / high_freq_factor kept, the band between blended
  linearly in o / wavelength.
- ``yarn`` (Peng et al. 2023): each frequency blended between itself (extrapolation) and itself / factor
  (interpolation) by a ramp over the dimensions whose rotations over o lie between beta_slow and beta_fast; cos and
  sin multiplied by the attention factor (0.1 ln(factor) + 1 unless given, or the ratio of the two mscales).

Context parallelism keeps global positions: a cp rank takes the rows of its tokens from the whole table
(p3d.model.attention). The DeepSeek-V3 family reuses ``inv_frequencies`` (yarn with mscale) for its rotary part.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from p3d.config.schema import RopeScaling, RopeType


def _plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (hd/2,)


def _llama3(head_dim: int, theta: float, r: RopeScaling) -> torch.Tensor:
    inv_freq = _plain(head_dim, theta)
    old, factor = r.original_max_position_embeddings, r.factor
    assert old and factor and r.low_freq_factor is not None and r.high_freq_factor is not None  # model_rules
    low_freq_wavelen, high_freq_wavelen = old / r.low_freq_factor, old / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # long waves: interpolated
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(middle, blended, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(r: RopeScaling) -> float:
    """The factor yarn multiplies cos and sin by (so q.k by its square)."""
    assert r.factor is not None
    if r.attention_factor is not None:
        return r.attention_factor
    if r.mscale and r.mscale_all_dim:
        return float(_mscale(r.factor, r.mscale) / _mscale(r.factor, r.mscale_all_dim))
    return _mscale(r.factor)


def mla_scale_factor(r: RopeScaling | None) -> float:
    """What multi-head latent attention multiplies its softmax scale 1/sqrt(d_qk) by (DeepSeek-V2/V3; transformers'
    ``yarn_apply_mscale``): under a RoPE scaling with ``mscale_all_dim``, yarn's mscale(factor, mscale_all_dim)
    squared, 1 otherwise. Yarn multiplies cos and sin by the attention factor mscale / mscale_all_dim's (1 for
    DeepSeek-V3, whose two are equal), so q.k by its square; this restores the full mscale^2 on every score,
    the rotated part and the rest alike."""
    if r is None or r.rope_type is None or not r.mscale_all_dim:
        return 1.0
    assert r.factor is not None  # model_rules
    return _mscale(r.factor, r.mscale_all_dim) ** 2


def _yarn(head_dim: int, theta: float, r: RopeScaling) -> torch.Tensor:
    old, factor = r.original_max_position_embeddings, r.factor
    assert old and factor  # model_rules
    beta_fast, beta_slow = r.beta_fast or 32, r.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``old``
        return (head_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the high frequencies, extrapolated; 0: the low ones, interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (hd/2,) fp32, attention factor) of a head of width ``head_dim``: what HF's rope init function of
    the same rope_type returns (``scaling`` None or of rope_type null: plain RoPE)."""
    if scaling is None or scaling.rope_type is None:
        return _plain(head_dim, theta), 1.0
    assert scaling.factor is not None  # p3d.layout.model_rules
    if scaling.rope_type == RopeType.linear:
        return _plain(head_dim, theta) / scaling.factor, 1.0
    if scaling.rope_type == RopeType.llama3:
        return _llama3(head_dim, theta, scaling), 1.0
    return _yarn(head_dim, theta, scaling), yarn_attention_factor(scaling)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, scaling: RopeScaling | None, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (s, hd), frequencies repeated over both halves, times the attention factor."""
    inv_freq, factor = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq.to(device))  # (s, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def _key(scaling: RopeScaling | None) -> tuple | None:
    return None if scaling is None or scaling.rope_type is None else tuple(dataclasses.asdict(scaling).items())


@functools.lru_cache(maxsize=8)
def _table(seq_len: int, head_dim: int, theta: float, key: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    scaling = None if key is None else RopeScaling(**dict(key))
    return rope_cos_sin(seq_len, head_dim, theta, scaling, "cpu", torch.float32)


def rope_table(
    seq_len: int, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (s, hd) in fp32 on the CPU, computed once per shape and scaling: every block's buffers start from it."""
    return _table(seq_len, head_dim, theta, _key(scaling))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, s, hd). Rotates pairs (i, i + hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
