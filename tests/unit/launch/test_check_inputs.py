"""Inputs that used to crash or be silently ignored (issue 23), checked in-process: W&B's mode precedence, a run
that logged no step, every number's bound, zero and minus one refused in one line, a sweep's exit status."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from p3d.config.bounds import BOUNDS
from p3d.config.schema import Config
from p3d.launch.report import sweep_status
from p3d.launch.report_rows import Row
from p3d.layout.run_plan import P3DConfigError
from p3d.train.metrics import MetricsLogger, wandb_mode
from tests.helpers.runs import typed
from tests.helpers.tiers import with_slow
from tests.helpers.wandb_log import FAKE_KEY

# ---- 1. W&B: WANDB_MODE, logger.mode above it, failures never end training


def test_wandb_mode_precedence():
    assert wandb_mode("auto", {"WANDB_MODE": "offline", "WANDB_API_KEY": FAKE_KEY}) == ("offline", "WANDB_MODE=offline")
    assert wandb_mode("auto", {"WANDB_MODE": "disabled"})[0] == "disabled"
    assert wandb_mode("auto", {"WANDB_MODE": "dryrun"})[0] == "offline"  # wandb's old name for offline
    assert wandb_mode("offline", {"WANDB_MODE": "online", "WANDB_API_KEY": FAKE_KEY})[0] == "offline"
    assert wandb_mode("online", {"WANDB_MODE": "disabled"}) == ("online", "logger.mode=online")
    assert wandb_mode("auto", {"WANDB_API_KEY": FAKE_KEY})[0] == "online"


@pytest.mark.timeout(120)
def test_run_that_logged_no_step_leaves_its_run_dir_usable(tmp_path):
    from p3d.launch.check import check_run

    cfg, plan = typed("mesh=single", run_dir=str(tmp_path))
    MetricsLogger(tmp_path, cfg, plan).close()  # a run that died before its first step
    assert not (tmp_path / "metrics.jsonl").exists()
    assert check_run(cfg).train.resume == "none"  # not "already holds a run"


# ---- 2. every number has a bound; logger.log_every=0


def _numeric_fields(schema, prefix=""):
    hints = typing.get_type_hints(type(schema))
    for f in dataclasses.fields(schema):
        value, hint = getattr(schema, f.name), hints[f.name]
        nested = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]  # Optional[MoEConfig]: null
        if value is None and nested:
            value = nested[0]()
        if dataclasses.is_dataclass(value):
            yield from _numeric_fields(value, f"{prefix}{f.name}.")
        elif hint in (int, float, typing.Optional[int], typing.Optional[float]):  # noqa: UP045 - the schema's hints
            yield prefix + f.name


def test_every_int_and_float_field_has_a_bound():
    fields = set(_numeric_fields(Config()))
    assert fields - set(BOUNDS) == set(), "add these to p3d.config.bounds.BOUNDS"
    assert set(BOUNDS) - fields == set(), "BOUNDS names fields the schema does not have"


def _first_of_each_section(keys: list[str]) -> set[str]:
    """One bound per config section (``model``, ``model.moe``, ``train``, ...): the representatives make test runs."""
    firsts: dict[str, str] = {}
    for key in keys:
        firsts.setdefault(key.rsplit(".", 1)[0], key)
    return set(firsts.values())


BOUNDED = sorted(BOUNDS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", with_slow(BOUNDED, set(BOUNDED) - _first_of_each_section(BOUNDED)))
def test_zero_and_minus_one_are_refused_in_one_line_unless_allowed(key):
    b = BOUNDS[key]
    for value in (0, -1):
        allowed = b.low is None or (value > b.low if b.open_low else value >= b.low)
        model = ("model=moe_tiny",) if key.startswith("model.moe.") else ()  # its fields exist on an MoE model
        if allowed:
            typed(*model, f"{key}={value}")  # e.g. train.warmup_steps=0, zero.stage=0: valid
            continue
        with pytest.raises(P3DConfigError) as err:
            typed(*model, f"{key}={value}")
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"{key}={value}") and "; try " in text, text


# ---- 5. a sweep with a point not done exits non-zero and says how many


def test_sweep_status_counts_points_not_done():
    rows = [
        Row(point="0", mesh="single", status="done"),
        Row(point="1", mesh="tp8", status="skipped"),
        Row(point="2", mesh="pp2", status="failed"),
    ]
    assert sweep_status(rows[:1]) == (0, "")
    assert sweep_status(rows[:2]) == (2, "p3d: 1 of 2 sweep points not done (1 skipped: point 1); exit status 2")
    status, line = sweep_status(rows)
    assert status == 1 and line.startswith("p3d: 2 of 3 sweep points not done (1 skipped, 1 failed: points 1, 2)")


def test_p3d_plan_refuses_a_split_it_cannot_model_in_one_line(capsys):
    """Issue 64, item 19: ``p3d-plan mesh=pp2 schedule.stage_blocks=[3,2]`` gave a traceback (the planner cut 4 blocks
    into pieces of 3 and 2) where p3d-train refuses it in one line; other rules p3d-train would refuse stay
    warnings of the plan. And [-1,5] is refused for its negative piece (it was: 'needs a block')."""
    from p3d.launch.plan import plan_task
    from tests.helpers.runs import compose

    assert plan_task(compose("mesh=pp2", "schedule.stage_blocks=[3,2]")) == 2
    assert capsys.readouterr().err.strip() == (
        "p3d: config error: schedule.stage_blocks=[3, 2] holds 5 blocks, model.n_layers=4; try "
        "schedule.stage_blocks=[2,2]"
    )
    assert plan_task(compose("mesh=dp2", "schedule.replica_micro_batches=[3,2]")) == 2
    assert "schedule.replica_micro_batches=[3, 2] x schedule.micro_batch_size=2" in capsys.readouterr().err
    assert plan_task(compose("mesh=pp2", "schedule.stage_blocks=[-1,5]")) == 2
    assert "schedule.stage_blocks=[-1, 5]: a piece cannot hold -1 blocks; try" in capsys.readouterr().err
    assert plan_task(compose("mesh=pp2", "schedule.stage_blocks=[3,1]")) == 0
