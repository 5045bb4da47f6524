"""The tests' cached composition (tests.helpers.runs.compose: group choices composed once, value overrides applied
to a copy) equals Hydra composing the whole line, config and errors alike."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.helpers.runs import compose, hydra_compose

LINES = [
    (),
    ("model=small", "mesh=pp2"),
    ("model.seq_len=4096", "model=small"),  # a value before its group's choice: applied after composing, as Hydra does
    ("mesh=dp2_pp2_tp2", "schedule.pipeline=interleaved_1f1b", "schedule.global_batch_size=16"),
    ("cluster=mixed_h100_a100", "cluster.groups=[{device: a100_80gb, nodes: 2}]"),
    ("+model.extra=1",),  # an addition
    ("~logger",),  # a group deleted
    ("zero=stage1", "train.steps=3", "train.seed=7"),
]


@pytest.mark.parametrize("line", LINES, ids=[" ".join(line) or "defaults" for line in LINES])
def test_the_cached_composition_is_hydras(line):
    got, want = compose(*line), hydra_compose(*line)
    assert OmegaConf.to_container(got) == OmegaConf.to_container(want)
    assert OmegaConf.is_struct(got) == OmegaConf.is_struct(want)


@pytest.mark.parametrize("line", [("model.bogus=1",), ("mesh.tp=[1",), ("train.steps=abc",), ("mesh=nope",)])
def test_a_bad_override_raises_what_hydra_raises(line):
    with pytest.raises(Exception) as want:
        hydra_compose(*line)
    with pytest.raises(want.type) as got:
        compose(*line)
    assert str(got.value) == str(want.value)
    assert type(got.value.__cause__) is type(want.value.__cause__)
    if isinstance(want.value, ConfigCompositionException) and want.value.__cause__ is not None:
        assert str(got.value.__cause__) == str(want.value.__cause__)
