"""Planner tests: typed configs composed through Hydra exactly as p3d-train and p3d-plan compose them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # deepspeed (dry run, checkpointing, engine) on CPU
CONF = Path(__file__).resolve().parents[2] / "conf"


def compose_config(*overrides: str):
    """Config (typed, cluster preset filled) for these overrides, through Hydra's compose API."""
    from hydra import compose, initialize_config_dir

    from p3d.config.schema import register_configs
    from p3d.config.spec import to_config
    from p3d.config.validate import fill_cluster

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        node = compose("config", overrides=["run.dir=/tmp/p3d-plan-test", *overrides])
    return fill_cluster(to_config(node))


@pytest.fixture
def make_cfg():
    return compose_config
