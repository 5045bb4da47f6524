"""The slow tier, marked where each test is defined: ``make test`` leaves out the variants whose path a case it
runs already covers (``-m "not slow"``); ``make test-all`` runs them too."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def with_slow(names: Iterable[str], slow: Iterable[str]) -> list:
    """``names`` as pytest params (their ids the names), those in ``slow`` marked for the slow tier; every name in
    ``slow`` must be one of ``names`` (a renamed case cannot silently leave the tier)."""
    names, slow = list(names), set(slow)
    assert slow <= set(names), f"slow cases that do not exist: {sorted(slow - set(names))}"
    return [pytest.param(n, id=n, marks=pytest.mark.slow) if n in slow else pytest.param(n, id=n) for n in names]
