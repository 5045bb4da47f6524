"""The torch and DeepSpeed names ``dp_comm_s``'s clocks wrap (p3d.compat.dp_collectives) are still there."""

from __future__ import annotations

import pytest

from p3d.compat.dp_collectives import TOUCHPOINTS, Touchpoint


@pytest.mark.parametrize("touchpoint", TOUCHPOINTS, ids=lambda t: t.name)
def test_installed_torch_and_deepspeed_still_have(touchpoint: Touchpoint):
    assert touchpoint.present(), f"{touchpoint.name} is gone; {touchpoint.used_by} relies on it"
