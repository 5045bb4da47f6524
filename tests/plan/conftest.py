"""Planner tests: typed configs composed through Hydra exactly as p3d-train and p3d-plan compose them."""

from __future__ import annotations

import pytest

from tests.conftest import compose


def compose_config(*overrides: str):
    """Config (typed, cluster preset filled) for these overrides, through Hydra's compose API."""
    from p3d.layout.run_plan import fill_derived
    from p3d.rundir.spec import to_config

    return fill_derived(to_config(compose(*overrides, run_dir="/tmp/p3d-plan-test")))


@pytest.fixture
def make_cfg():
    return compose_config
