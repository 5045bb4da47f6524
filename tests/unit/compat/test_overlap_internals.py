"""The torch pipelining and FSDP2 internals the overlapped dp reduction relies on (p3d.compat.overlap_internals)."""

from __future__ import annotations

import pytest

from p3d.compat.overlap_internals import TOUCHPOINTS, Touchpoint


@pytest.mark.parametrize("touchpoint", TOUCHPOINTS, ids=lambda t: t.name)
def test_installed_torch_still_has(touchpoint: Touchpoint):
    assert touchpoint.present(), f"{touchpoint.name} is gone; {touchpoint.used_by} relies on it"
