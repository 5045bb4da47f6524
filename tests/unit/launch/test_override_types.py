"""A command-line value its field cannot hold is refused in one line before Hydra composes (issue 50, item 7):
the field, the value, what it takes and an override of that type; the same values Hydra's merge refuses, no
other."""

from __future__ import annotations

import sys

import pytest

from p3d import exit_codes
from p3d.launch.compose import run_hydra
from p3d.launch.override_types import wrong_type
from tests.helpers.runs import compose

REFUSED = [
    ("mesh.cp=1.5", "mesh.cp=1.5 (command line) must be an integer; try mesh.cp=1"),
    ("train.lr=abc", "train.lr=abc (command line) must be a number; try train.lr=0.003"),
    ("mesh.ep=null", "mesh.ep=null (command line) may not be null (an integer); try mesh.ep=1"),
    ("logger.mode=bogus", "logger.mode=bogus (command line) must be one of auto, online, offline, disabled; try"),
    ("dry_run=maybe", "dry_run=maybe (command line) must be true or false; try dry_run=false"),
    ("train.steps=1e3", "train.steps=1e3 (command line) must be an integer; try train.steps=300"),
    # a list field given one item that fits it: that item as a list (issue 64, item 23: not the default, [])
    ("cluster.setup=3", "cluster.setup=3 (command line) must be a list of strings; try cluster.setup=[3]"),
    ("train.trace_steps=2", "train.trace_steps=2 (command line) must be a list of integers; try train.trace_steps=[2]"),
    # a mapping where a list of them goes (issue 64, item 19: OmegaConf's ConfigTypeError and a traceback)
    ("cluster.groups={device: cpu, nodes: 1}", "cluster.groups={device: cpu, nodes: 1} (command line) must be a list"),
    ("model.moe.top_k=x", "model.moe.top_k=x (command line) must be an integer; try model.moe.top_k=2"),
]


@pytest.mark.parametrize("override,line", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_value_its_field_cannot_hold_is_one_line_with_a_fix_of_the_right_type(override, line):
    extra = ("model=moe_tiny",) if override.startswith("model.moe.") else ()
    refused = wrong_type([*extra, override])
    assert refused is not None and "\n" not in refused and refused.startswith(line), refused
    fix = refused.rsplit("; try ", 1)[1]
    if override.startswith("cluster.groups="):
        assert fix == "cluster.groups=[{device: cpu, nodes: 1}]"
    assert wrong_type([*extra, fix]) is None
    compose(*extra, fix)  # Hydra composes the suggestion


def test_a_sweep_is_refused_at_its_first_bad_value():
    assert wrong_type(["-m", "train.lr=1e-3,abc"]) == "train.lr=abc (command line) must be a number; try train.lr=0.003"
    assert wrong_type(["-m", "mesh=dp2,tp2", "train.lr=1e-3,3e-4"]) is None


# what Hydra's merge takes and refuses: the check must agree on each (a value Hydra takes is never refused here)
AGREE = [
    "train.lr=3", "train.lr=inf", "dry_run=yes", "train.tf32=on", "model.name=3", "mesh.dp=two",
    "cluster.memory_gb=null", "train.steps=${oc.env:P3D_STEPS,5}", "+train.foo=1",
    "mesh.cp=2.0", "cluster.nodes=true", "train.steps=0x10", "logger.mode=ONLINE", "cluster.device=h100",
    "train.async_save=maybe", "mesh.cp=[1,2]", "data.mix=[{path: a, weight: x}]",
    "data.mix=[{path:/d/one,weight:0.8},{path:b,weight:1}]",
]  # fmt: skip


@pytest.mark.parametrize("override", AGREE)
def test_the_check_refuses_exactly_what_hydra_refuses(override):
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose(override)
        hydra_refuses = False
    except (HydraException, OmegaConfBaseException):
        hydra_refuses = True
    assert (wrong_type([override]) is not None) == hydra_refuses, (override, wrong_type([override]))


def test_every_composing_command_refuses_before_hydra_runs(monkeypatch, capsys):
    """run_hydra (p3d-train, p3d-plan, p3d-prepare, p3d-tokenizer): exit status 2, one line on stderr, the task
    never called and Hydra never composing."""
    ran = []
    monkeypatch.setattr(sys, "argv", ["p3d-train", "mesh=dp2", "mesh.cp=1.5"])
    assert run_hydra(ran.append) == exit_codes.CONFIG_ERROR
    assert not ran
    err = capsys.readouterr().err
    assert err == "p3d: config error: mesh.cp=1.5 (command line) must be an integer; try mesh.cp=1\n", err
