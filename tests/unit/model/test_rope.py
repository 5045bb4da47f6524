"""RoPE scalings (p3d.model.rope) against transformers' own rope init functions (``ROPE_INIT_FUNCTIONS``): the same
frequencies and attention factor for llama3 (Llama 3.1 8B's and 3.2 1B's settings), linear and yarn (Qwen's
4x over 32k; DeepSeek-V3's with mscale; a given attention factor; untruncated bounds), at Llama's and Qwen3's head
widths."""

from __future__ import annotations

import pytest
import torch

from p3d.config.options import RopeType
from p3d.config.schema import RopeScaling
from p3d.model.rope import inv_frequencies, rope_cos_sin

LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
CASES = {
    "llama3-8b": (RopeType.llama3, LLAMA31, 128, 500000.0),
    "llama3-1b": (RopeType.llama3, {**LLAMA31, "factor": 32.0}, 64, 500000.0),
    "linear": (RopeType.linear, dict(factor=4.0), 128, 10000.0),
    "yarn-qwen": (RopeType.yarn, dict(factor=4.0, original_max_position_embeddings=32768), 128, 1e6),
    "yarn-mscale": (
        RopeType.yarn,
        dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        64,
        10000.0,
    ),  # fmt: skip
    "yarn-mscale-ratio": (
        RopeType.yarn,
        dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=1.0),
        64,
        10000.0,
    ),
    "yarn-given-factor": (
        RopeType.yarn,
        dict(factor=8.0, original_max_position_embeddings=2048, attention_factor=1.3, truncate=False),
        96,
        10000.0,
    ),
}


def _transformers(kind: RopeType, fields: dict, head_dim: int, theta: float):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind.value, "rope_theta": theta, **fields}
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=131072,
        rope_parameters=params,
    )  # fmt: skip
    return ROPE_INIT_FUNCTIONS[kind.value](config, "cpu")


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_factor_are_transformers(case):
    kind, fields, head_dim, theta = CASES[case]
    ours, factor = inv_frequencies(head_dim, theta, RopeScaling(rope_type=kind, **fields))
    theirs, their_factor = _transformers(kind, fields, head_dim, theta)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert factor == their_factor
    plain, _ = inv_frequencies(head_dim, theta)
    assert (ours != plain).any()  # the scaling moved frequencies: a test that compares something


def test_llama3_divides_the_long_waves_blends_the_middle_and_keeps_the_short():
    """Llama 3.1 8B (hd 128, theta 5e5): 29 of 64 frequencies divided by 8, 6 blended, 29 kept (issue 61)."""
    plain, _ = inv_frequencies(128, 500000.0)
    scaled, _ = inv_frequencies(128, 500000.0, RopeScaling(rope_type=RopeType.llama3, **LLAMA31))
    ratio = plain / scaled
    divided = torch.isclose(ratio, torch.tensor(8.0)).sum().item()
    kept = torch.isclose(ratio, torch.tensor(1.0)).sum().item()
    assert (divided, kept, 64 - divided - kept) == (29, 29, 6)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    scaling = RopeScaling(rope_type=RopeType.yarn, factor=4.0, original_max_position_embeddings=64)
    cos, sin = rope_cos_sin(16, 8, 10000.0, scaling, "cpu", torch.float32)
    _, factor = inv_frequencies(8, 10000.0, scaling)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    torch.testing.assert_close(cos[0], torch.full((8,), factor))  # position 0: cos = 1, times the factor
    torch.testing.assert_close(cos.pow(2) + sin.pow(2), torch.full((16, 8), factor**2))
