"""The model group's rules (p3d.layout.model_rules): a window shorter than the sequence, a RoPE scaling without
the fields its formula needs or fields without a scaling, an odd head width: one line each, with a fix the same
command accepts."""

from __future__ import annotations

import pytest

from p3d.layout.run_plan import P3DConfigError
from tests.helpers.runs import typed

LLAMA3 = ("model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8")


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["model.sliding_window=32"],
            "model.sliding_window=32 is shorter than model.seq_len=64: p3d attends to the whole sequence (no "
            "windowed attention); try model.seq_len=32",
        ),
        (
            ["model=mistral_7b", "model.sliding_window=4096"],
            "model.sliding_window=4096 is shorter than model.seq_len=8192",
        ),
        (
            ["model.rope_scaling.factor=4"],
            "model.rope_scaling.factor=4.0 has no effect with model.rope_scaling.rope_type=null (plain RoPE); try "
            "model.rope_scaling.rope_type=linear",
        ),
        ([*LLAMA3], "model.rope_scaling.original_max_position_embeddings is null: rope_type=llama3 needs it"),
        (
            [*LLAMA3, "model.rope_scaling.original_max_position_embeddings=16", "model.rope_scaling.low_freq_factor=4",
             "model.rope_scaling.high_freq_factor=1"],
            "model.rope_scaling.low_freq_factor=4.0 must be below high_freq_factor=1.0",
        ),
        (["model.rope_scaling.rope_type=yarn"], "model.rope_scaling.factor is null: rope_type=yarn needs it"),
        (["model.head_dim=9"], "model.head_dim=9 (head dim) must be even for rotary embeddings; try model.head_dim=10"),
    ],
)  # fmt: skip
def test_a_model_p3d_cannot_build_as_given_is_refused_in_one_line(overrides, line):
    with pytest.raises(P3DConfigError) as err:
        typed(*overrides)
    assert str(err.value).startswith(line) and "\n" not in str(err.value), err.value


def test_a_window_at_least_the_sequence_and_a_complete_scaling_are_accepted():
    cfg, _ = typed("model.sliding_window=64", *LLAMA3, "model.rope_scaling.original_max_position_embeddings=16",
                   "model.rope_scaling.low_freq_factor=1", "model.rope_scaling.high_freq_factor=4",
                   "model.head_dim=10")  # fmt: skip
    assert cfg.model.rope_scaling.factor == 8 and cfg.model.head_dim == 10
