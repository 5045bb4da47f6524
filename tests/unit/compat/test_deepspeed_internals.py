"""DeepSpeed's private API that p3d relies on is all in p3d.compat.deepspeed_internals; each touchpoint is still
there."""

from __future__ import annotations

import ast

import pytest

from p3d.compat.deepspeed_internals import TOUCHPOINTS, Touchpoint
from tests.helpers.runs import ROOT


@pytest.mark.parametrize("touchpoint", TOUCHPOINTS, ids=lambda t: t.name)
def test_installed_deepspeed_still_has(touchpoint: Touchpoint):
    import deepspeed

    assert touchpoint.present(), (
        f"DeepSpeed {deepspeed.__version__} no longer has {touchpoint.name}, which "
        f"{touchpoint.used_by} relies on: see p3d/compat/deepspeed_internals.py"
    )


def test_a_missing_touchpoint_is_reported():
    assert not Touchpoint("nothing", "nobody", lambda: False).present()
    from p3d.compat.deepspeed_internals import _source_has

    assert not _source_has("deepspeed.runtime.pipe.engine:PipelineEngine", "no_such_attribute_anywhere")
    assert not _source_has("deepspeed.runtime.pipe.engine:NoSuchClass", "self")


PRIVATE = {
    "_INSTRUCTION_MAP",
    "_hp_mapping",
    "_hp_optimizer_states_linked",
    "_lazy_init_hp_params_optimizer_state",
    "__compatible_ops__",
    "pipeline_enable_backward_allreduce",
    "ds_pipe_replicated",
    "_global_grad_norm",
}


def test_only_ds_compat_touches_deepspeed_private_api():
    users = {}
    for path in (ROOT / "p3d").rglob("*.py"):
        if path.name == "deepspeed_internals.py":
            continue
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if names & PRIVATE:
            users[str(path.relative_to(ROOT))] = sorted(names & PRIVATE)
    assert users == {}
